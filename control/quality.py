"""Live quality and drift per model version (GET /models/<name>/quality,
the Prometheus figures, the dashboard). No TensorFlow.

Reads the prediction log only through its read interface (`predlog`:
recent, fed_back, counts; state/predlog.py), always on an executor thread,
and each version's training-data profile (`profile.json`, written by the
trainer: model_worker/profile.py).

Live quality, on the predictions that got feedback: accuracy, macro-F1,
per-label precision/recall/F1, the confusion matrix (rows: the true label,
columns: the predicted one); with abstentions (label null), coverage and
accuracy on the answered texts.

Multi-label versions (meta.json `multi_label`): the truth of a text is a label
set (stored encoded in the feedback's label: state/dataset.py decode_truth),
and so is the prediction: the set the feedback handler computed when the
feedback arrived (stored in the feedback's `predicted`), else the set
recomputed from the logged top scores and the version's thresholds
(`predicted_set`; exact when the logged top list holds every label above its
threshold). Figures: micro-, macro- and samples-F1, exact-match accuracy,
per-label precision/recall/F1/support/predicted; no confusion matrix.

Drift, over the last `drift.window` logged texts of the version, against
its profile:
- unknown_ngram_share: the share of a text's n-grams the training data does
  not hold (mean over the window), minus the same share measured
  leave-one-out on the training texts: `unknown_ngram_excess`;
- label_js: Jensen-Shannon divergence (base 2, 0..1) between the predicted
  labels in the window and the labels predicted on held-out training texts;
- top_score_js: the same between the histograms of the top score.
`alert` is true when the window holds at least `drift.min_texts` texts and a
signal is above its threshold (`drift.max_*`). A version without a profile
(trained before profiles existed, or built outside the trainer) has
`drift: null`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, TypedDict

from model_worker import profile as prof
from state.dataset import decode_truth
from state.errors import NotFound
from state.store import StoreError

if TYPE_CHECKING:
    from state.config import DriftSettings
    from state.predlog_api import PredictionLogBackend
    from state.store import ModelStore
    from control.serving import ServingState

log = logging.getLogger("textswap.quality")

SIGNALS = (("unknown_ngram_excess", "max_unknown_excess"), ("label_js", "max_label_js"),
           ("top_score_js", "max_top_score_js"))


class MultiRow(TypedDict):
    """A fed-back row of a multi-label version: the true and the predicted set."""
    truth: list[str]
    label: list[str]


class VersionQuality(TypedDict):
    """One version's entry in a quality report."""
    version: int | None
    serving: bool
    predictions: int
    feedback: int
    live: dict[str, Any]  # live_figures / live_figures_multi: figures, per label, confusion
    training: dict[str, object] | None
    drift: dict[str, Any] | None  # drift_signals


class QualityReport(TypedDict):
    """GET /models/<name>/quality (Quality.compute)."""
    model: str
    at: float
    serving_version: int | None
    versions: list[VersionQuality]


# -- live figures ---------------------------------------------------------------------------
def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 6) if b else None


def live_figures(rows: list[dict[str, Any]]) -> dict[str, object]:
    """Accuracy, macro-F1, per-label figures and confusion on fed-back rows
    ({"label": predicted or None when abstained, "truth"})."""
    answered = [r for r in rows if r.get("label") is not None and not r.get("abstained")]
    out: dict[str, object] = {"feedback": len(rows), "answered": len(answered),
                           "coverage": _ratio(len(answered), len(rows)),
                           "accuracy": None, "macro_f1": None, "per_label": {},
                           "confusion": None}
    if not answered:
        return out
    labels = sorted({r["truth"] for r in answered} | {r["label"] for r in answered})
    index = {name: i for i, name in enumerate(labels)}
    matrix = [[0] * len(labels) for _ in labels]
    for row in answered:
        matrix[index[row["truth"]]][index[row["label"]]] += 1
    correct = sum(matrix[i][i] for i in range(len(labels)))
    per_label, f1s = {}, []
    for i, name in enumerate(labels):
        tp = matrix[i][i]
        predicted = sum(matrix[j][i] for j in range(len(labels)))
        support = sum(matrix[i])
        p = tp / predicted if predicted else 0.0
        r = tp / support if support else 0.0
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        per_label[name] = {"precision": round(p, 6), "recall": round(r, 6), "f1": round(f1, 6),
                           "support": support, "predicted": predicted}
        f1s.append(f1)  # macro over every label true or predicted (as scikit-learn does)
    out.update(accuracy=round(correct / len(answered), 6),
               macro_f1=round(sum(f1s) / len(f1s), 6) if f1s else None,
               per_label=per_label, confusion={"labels": labels, "rows": matrix})
    return out


def predicted_set(scores: dict[str, float], thresholds: dict[str, float], min_labels: int,
                  fallback: object = None) -> list[str]:
    """The label set a multi-label version answered, from the logged scores
    ({label: score}, the answer's `top`) and its meta.json thresholds: every
    label at or above its threshold, else (min_labels 1) the best one. Exact
    when the logged top list holds every label above its threshold (top_k >=
    labels answered); a min_score the request or the policy set is not logged,
    so not applied. Without scores: [fallback] (the logged top label)."""
    if not scores:
        return [fallback] if isinstance(fallback, str) and fallback else []
    chosen = sorted(lab for lab, score in scores.items()
                    if score is not None and float(score) >= float(thresholds.get(lab, 0.5)))
    if not chosen and min_labels > 0:
        chosen = [max(scores, key=lambda lab: float(scores[lab] or 0.0))]
    return chosen


def as_set(value: object) -> list[str]:
    """A stored label (an encoded set, one label, or None) as a sorted label set."""
    value = decode_truth(value)
    if isinstance(value, list):
        return sorted(set(value))
    return [value] if isinstance(value, str) and value else []


def live_figures_multi(rows: list[MultiRow]) -> dict[str, object]:
    """Multi-label figures on fed-back rows ({"label": predicted set, "truth":
    true set}, both lists): micro-F1 (over every label decision), macro-F1
    (mean over every label true or predicted somewhere), samples-F1 (mean per
    text; a text with both sets empty scores 1, as the training report does),
    exact-match accuracy, per-label counts."""
    out: dict[str, object] = {"multi_label": True, "feedback": len(rows), "answered": len(rows),
                           "coverage": 1.0 if rows else None, "accuracy": None,
                           "micro_f1": None, "macro_f1": None, "samples_f1": None,
                           "labels_per_text": None, "per_label": {}, "confusion": None}
    if not rows:
        return out
    pairs = [(set(r["truth"]), set(r["label"])) for r in rows]
    names = sorted(set().union(*(t | p for t, p in pairs)))
    per_label, f1s = {}, []
    tp_all = fp_all = fn_all = 0
    for name in names:
        tp = sum(1 for t, p in pairs if name in t and name in p)
        predicted = sum(1 for _, p in pairs if name in p)
        support = sum(1 for t, _ in pairs if name in t)
        tp_all, fp_all, fn_all = tp_all + tp, fp_all + predicted - tp, fn_all + support - tp
        prec = tp / predicted if predicted else 0.0
        rec = tp / support if support else 0.0
        f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
        per_label[name] = {"precision": round(prec, 6), "recall": round(rec, 6),
                           "f1": round(f1, 6), "support": support, "predicted": predicted}
        f1s.append(f1)
    micro = 2 * tp_all / (2 * tp_all + fp_all + fn_all) if tp_all else 0.0
    samples = [2 * len(t & p) / (len(t) + len(p)) if t or p else 1.0 for t, p in pairs]
    out.update(accuracy=round(sum(t == p for t, p in pairs) / len(pairs), 6),
               micro_f1=round(micro, 6),
               macro_f1=round(sum(f1s) / len(f1s), 6) if f1s else 0.0,
               samples_f1=round(sum(samples) / len(samples), 6),
               labels_per_text=round(sum(len(p) for _, p in pairs) / len(pairs), 6),
               per_label=per_label)
    return out


# -- drift ------------------------------------------------------------------------------------
def _top_score(scores: object) -> float | None:
    if isinstance(scores, dict) and scores:
        return max(float(v) for v in scores.values())
    if isinstance(scores, list) and scores:
        return max(float(s["score"]) for s in scores)
    return None


def drift_signals(rows: list[dict[str, Any]], profile: dict[str, Any], known: frozenset[int],
                  cfg: "DriftSettings") -> dict[str, object]:
    """The drift signals of a window of logged predictions against a profile."""
    shares = prof.known_shares((r["text"] for r in rows), known)
    expected_unknown = (None if profile["known_share"].get("mean") is None
                        else 1.0 - profile["known_share"]["mean"])
    unknown = 1.0 - sum(shares) / len(shares) if shares else None
    labels = profile["labels"]
    names = labels["names"]
    expected_labels = labels.get("predicted") or labels["train"]
    answered = [r["label"] for r in rows if r.get("label") is not None and not r.get("abstained")]
    counts = Counter(answered)
    live_labels = {n: round(counts[n] / len(answered), 6) for n in names} if answered else None
    label_js = None
    if answered:
        # a label the model does not know cannot be predicted; kept for safety
        other = sum(c for n, c in counts.items() if n not in expected_labels)
        label_js = prof.js_divergence([counts[n] for n in names] + [other],
                                      [expected_labels.get(n, 0.0) for n in names] + [0.0])
    top = [t for t in (_top_score(r.get("scores")) for r in rows) if t is not None]
    top_js = top_mean = None
    if top:
        top_mean = sum(top) / len(top)
        ref = profile.get("top_score")
        if ref and ref.get("bins") == prof.TOP_SCORE_BINS:
            top_js = prof.js_divergence(prof.histogram(top), ref["counts"])
    out: dict[str, object] = {
        "texts": len(rows),
        "window": cfg.window,
        "min_texts": cfg.min_texts,
        "unknown_ngram_share": _round(unknown),
        "expected_unknown_ngram_share": _round(expected_unknown),
        "unknown_ngram_excess": (_round(unknown - expected_unknown)
                                 if unknown is not None and expected_unknown is not None else None),
        "label_js": _round(label_js),
        "label_distribution": live_labels,
        "expected_label_distribution": expected_labels,
        "expected_labels_from": labels.get("predicted_on") if labels.get("predicted") else "train",
        "top_score_js": _round(top_js),
        "top_score_mean": _round(top_mean),
        "top_score_histogram": {"bins": prof.TOP_SCORE_BINS, "counts": prof.histogram(top)},
        "thresholds": {key: getattr(cfg, key) for _, key in SIGNALS},
    }
    over = [name for name, key in SIGNALS if out[name] is not None and out[name] > getattr(cfg, key)]
    out["over"] = over
    out["alert"] = bool(len(rows) >= cfg.min_texts and over)
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


# -- the part ---------------------------------------------------------------------------------
class Quality:
    """Computes reports off the IOLoop and keeps the latest per
    model for /metrics (refreshed every drift.refresh_s for the serving models,
    and by each GET /models/<name>/quality)."""

    def __init__(self, cfg: "DriftSettings", store: "ModelStore",
                 predlog: "PredictionLogBackend | None", serving: "ServingState",
                 loop: Any) -> None:
        self.cfg = cfg  # the `drift` section
        self.store, self.predlog, self.serving, self.loop = store, predlog, serving, loop
        self.latest: dict[str, QualityReport] = {}  # name -> last report (for metrics)
        self._profiles: dict[tuple[str, int], tuple[float, Any, Any]] = {}
        self._lock = threading.Lock()
        self._refreshing = False
        self._timer = None
        if self.cfg.refresh_s > 0:
            from tornado.ioloop import PeriodicCallback
            self._timer = PeriodicCallback(self._tick, self.cfg.refresh_s * 1000)
            self._timer.start()

    async def report(self, name: str) -> QualityReport:
        """The quality report of a model (NotFound when neither the store nor
        the log knows it). Counts what was answered before this call: the log's
        queue is flushed first."""
        result = await self.loop.run_in_executor(None, self._flushed_compute, name)
        self.latest[name] = result
        return result

    def _flushed_compute(self, name: str) -> QualityReport:
        plog = self.predlog
        if plog is not None and getattr(plog, "enabled", False):
            plog.flush(10)
        return self.compute(name)

    async def _tick(self) -> None:
        if self._refreshing or self.predlog is None:
            return
        self._refreshing = True
        try:
            names = set(self.serving.slots) | set(self.latest)
            for name in sorted(names):
                try:
                    await self.report(name)
                except NotFound:
                    self.latest.pop(name, None)
                except OSError as exc:  # the log's disk or Redis: said once per tick
                    log.warning("quality of %s not computed: %s", name, exc)
                except Exception:
                    log.exception("quality of %s not computed", name)
        finally:
            self._refreshing = False

    # -- executor thread ------------------------------------------------------------------
    def _profile(self, name: str, version: int) -> tuple[dict[str, Any] | None, Any]:
        """(profile, decoded n-gram set) of a version, cached by the file's mtime."""
        folder = os.path.join(self.store.root, name, str(version))
        path = os.path.join(folder, prof.FILENAME)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return None, None
        with self._lock:
            hit = self._profiles.get((name, version))
        if hit is not None and hit[0] == mtime:
            return hit[1], hit[2]
        try:
            profile = prof.read(folder)
            known = prof.decode_set(profile["ngrams"]["set"]) if profile else None
        except Exception as exc:  # a damaged profile: no drift, not an error
            log.warning("profile of %s v%s unreadable: %s", name, version, exc)
            profile, known = None, None
        with self._lock:
            self._profiles[(name, version)] = (mtime, profile, known)
        return profile, known

    def _meta(self, name: str, version: int) -> dict[str, Any] | None:
        """The version's meta.json; None when it was deleted or is unreadable
        (its report then has no training figures)."""
        try:
            return self.store.meta(name, version)
        except (StoreError, OSError, ValueError):
            return None

    def _training(self, meta: dict[str, Any] | None) -> dict[str, object] | None:
        if meta is None:
            return None
        metrics = meta.get("metrics") or {}
        keys: tuple[str, ...] = ("accuracy", "macro_f1", "measured_on")
        if meta.get("multi_label"):
            keys += ("micro_f1", "samples_f1")
        return {k: metrics.get(k) for k in keys}

    @staticmethod
    def _live(fed: list[dict[str, Any]], meta: dict[str, Any] | None) -> dict[str, Any]:
        """The live figures of a version's fed-back rows: multi-label ones when
        its meta says so (or, meta unreadable, when the truths are label sets)."""
        multi = bool(meta.get("multi_label")) if meta else any(
            isinstance(decode_truth(r.get("truth")), list) for r in fed)
        if not multi:
            live = live_figures(fed)
            return {k: live[k] for k in ("accuracy", "macro_f1", "per_label", "confusion",
                                         "coverage", "answered")}
        thresholds = (meta or {}).get("thresholds") or {}
        min_labels = int((meta or {}).get("min_labels", 1))
        rows: list[MultiRow] = []
        for r in fed:
            stored = decode_truth(r.get("label"))
            predicted = (sorted(set(stored)) if isinstance(stored, list) else
                         predicted_set(r.get("scores") or {}, thresholds, min_labels, stored))
            rows.append({"truth": as_set(r.get("truth")), "label": predicted})
        live = live_figures_multi(rows)
        live.pop("feedback")
        return live

    def compute(self, name: str) -> QualityReport:
        store_versions = self.store.versions(name)  # InvalidName on a bad name
        plog = self.predlog
        counts = plog.counts(name) if plog is not None else {}
        if not store_versions and not counts:
            raise NotFound(f"no model named '{name}' in the store or the prediction log")
        serving = None
        slot = self.serving.slots.get(name)
        if slot is not None:
            serving = slot.version
        versions = sorted((v for v in counts if v is not None), reverse=True)
        if serving is not None and serving not in versions:
            versions.insert(0, serving)
        out: list[VersionQuality] = []
        for version in versions:
            c = counts.get(version, {"predictions": 0, "feedback": 0})
            fed = plog.fed_back(name, version) if plog is not None and c["feedback"] else []
            meta = self._meta(name, version) if version in store_versions else None
            entry: VersionQuality = {
                "version": version, "serving": version == serving,
                "predictions": c["predictions"], "feedback": c["feedback"],
                "live": self._live(fed, meta),
                "training": self._training(meta),
                "drift": None,
            }
            known: Any  # the profile's n-gram set where profile is not None
            profile, known = (self._profile(name, version) if version in store_versions
                              else (None, None))
            if profile is not None:
                rows = (plog.recent(name, version, limit=self.cfg.window)
                        if plog is not None and c["predictions"] else [])
                entry["drift"] = drift_signals(rows, profile, known, self.cfg)
            out.append(entry)
        return {"model": name, "at": time.time(), "serving_version": serving, "versions": out}
