"""Rollout state of a slot: probation, shadow and canary candidates, the
figures that judge them, and the quality gate's scoring.

Rollout modes are routing policies of a slot, not new machinery (see
ARCHITECTURE.md): after a swap the previous version's workers stay loaded
and idle in *probation* (a rollback is one assignment); a *shadow*
candidate gets a sampled copy of live traffic whose answers are compared and
dropped; a *canary* candidate answers a share of real traffic. The classes
here only hold state and figures; the Supervisor makes the moves.
Imports no TensorFlow.
"""
from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Required, TypedDict

from state.store import write_json_atomic

if TYPE_CHECKING:
    from control.workerhandle import WorkerHandle

# Figures per version keep at most this many recent latencies.
WINDOW = 2048


def percentile(values: list[float] | collections.deque[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class VersionStats:
    """Requests, errors and recent latencies of one version in one role."""

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def observe(self, seconds: float) -> None:
        self.requests += 1
        self.latencies.append(seconds)

    def error(self) -> None:
        self.requests += 1
        self.errors += 1

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def p(self, q: float) -> float | None:
        return percentile(self.latencies, q)

    def describe(self) -> dict[str, object]:
        p50, p99 = self.p(0.5), self.p(0.99)
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": round(self.error_rate, 4),
                "p50_ms": None if p50 is None else round(1000 * p50, 3),
                "p99_ms": None if p99 is None else round(1000 * p99, 3)}


@dataclass
class Probation:
    """The previous version's workers, idle, until `until` (monotonic)."""
    version: int                # the previous version, kept loaded
    workers: list["WorkerHandle"]  # its WorkerHandles (state IDLE)
    new_version: int            # the version now serving, being watched
    until: float
    old_p99: float | None       # the previous version's p99 before the swap
    started: float = field(default_factory=time.time)
    new_stats: VersionStats = field(default_factory=VersionStats)
    timer: object = None  # the IOLoop's timeout handle that ends it

    def describe(self) -> dict[str, object]:
        return {"version": self.version, "watching_version": self.new_version,
                "workers": [w.pid for w in self.workers],
                "remaining_s": round(max(0.0, self.until - time.monotonic()), 3),
                "previous_p99_ms": None if self.old_p99 is None else round(1000 * self.old_p99, 3),
                "new_version": self.new_stats.describe()}


@dataclass
class Candidate:
    """A version loaded beside the serving one, in shadow or canary mode."""
    version: int
    workers: list["WorkerHandle"]
    mode: str                   # "shadow" | "canary"
    fraction: float
    keep_examples: int = 0
    started: float = field(default_factory=time.time)
    stats: VersionStats = field(default_factory=VersionStats)          # the candidate's
    serving_stats: VersionStats = field(default_factory=VersionStats)  # canary: the other
    mirrored: int = 0
    compared: int = 0
    agreed: int = 0
    score_diff_sum: float = 0.0
    dropped: int = 0            # mirrors skipped: the candidate was busy
    examples: collections.deque[dict[str, object]] = field(
        default_factory=lambda: collections.deque(maxlen=100))

    def compare(self, texts: list[str], labels: list[str], cand_labels: list[str],
                serving: list[list[float]], candidate: list[list[float]]) -> None:
        """Agreement of the candidate's answers with the serving version's, by
        label name (the versions may order or even name their labels apart).
        The score difference is on the label the serving version chose."""
        index = {lab: i for i, lab in enumerate(cand_labels)}
        for text, a, b in zip(texts, serving, candidate):
            ia = max(range(len(a)), key=a.__getitem__)
            ib = max(range(len(b)), key=b.__getitem__)
            same = index.get(labels[ia])
            self.compared += 1
            self.score_diff_sum += abs(a[ia] - (b[same] if same is not None else 0.0))
            if cand_labels[ib] == labels[ia]:
                self.agreed += 1
            elif self.keep_examples and len(self.examples) < self.keep_examples:
                self.examples.append({"text": text, "serving": {"label": labels[ia],
                                                                "score": a[ia]},
                                      "candidate": {"label": cand_labels[ib],
                                                    "score": b[ib]}})

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "version": self.version, "mode": self.mode, "fraction": self.fraction,
            "workers": [w.pid for w in self.workers], "started_at": self.started,
            "candidate": self.stats.describe()}
        if self.mode == "shadow":
            out.update({
                "mirrored": self.mirrored, "compared": self.compared,
                "skipped_busy": self.dropped,
                "agreement_rate": round(self.agreed / self.compared, 4) if self.compared else None,
                "mean_score_diff": (round(self.score_diff_sum / self.compared, 6)
                                    if self.compared else None),
                "disagreements": list(self.examples) if self.keep_examples else None})
        else:
            out["serving"] = self.serving_stats.describe()
        return out


class GoldenSet(TypedDict, total=False):
    """A golden set of the quality gate (`.golden/<name>.json`), or the one a
    policy retrain's gate uses (Policies.gate_set: with the feedback hold-out)."""
    name: Required[str]
    texts: Required[list[str]]
    labels: Required[list[str]]
    source: Required[str]
    sha256: Required[str]
    min_accuracy: Required[float | None]
    created_at: float


class LabelScore(TypedDict):
    recall: float
    support: int


class GateScore(TypedDict):
    """A version's score on a golden set (score)."""
    accuracy: Any  # a float; None for no examples (a golden set always has some)
    examples: int
    per_label: dict[str, LabelScore]


def score(labels: list[str], scores: list[list[float]], truth: list[str]) -> GateScore:
    """Accuracy and per-label recall of predictions against a golden set."""
    per: dict[str, list[int]] = {}
    correct = 0
    for row, want in zip(scores, truth):
        got = labels[max(range(len(row)), key=row.__getitem__)]
        hit = int(got == want)
        correct += hit
        cell = per.setdefault(want, [0, 0])
        cell[0] += hit
        cell[1] += 1
    n = len(truth)
    return {"accuracy": round(correct / n, 6) if n else None, "examples": n,
            "per_label": {lab: {"recall": round(c / t, 6), "support": t}
                          for lab, (c, t) in sorted(per.items())}}


def label_changes(serving: GateScore, candidate: GateScore) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for lab, cand in candidate["per_label"].items():
        before = serving["per_label"][lab]["recall"] if lab in serving["per_label"] else None
        out[lab] = {"serving": before, "candidate": cand["recall"],
                    "change": None if before is None else round(cand["recall"] - before, 6)}
    return out


class GoldenSets:
    """Golden sets of the quality gate, one per model name, kept in the
    model store (`.golden/<name>.json`, written atomically) so they survive
    restarts and every node sharing the store sees them."""

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, ".golden")
        self._cache: dict[str, GoldenSet | None] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.json")

    def get(self, name: str) -> GoldenSet | None:
        if name not in self._cache:
            try:
                with open(self.path(name), encoding="utf-8") as fh:
                    self._cache[name] = json.load(fh)
            except (OSError, ValueError):
                self._cache[name] = None
        return self._cache[name]

    def put(self, name: str, texts: list[str], labels: list[str], source: str,
            sha256: str, min_accuracy: float | None) -> dict[str, object]:
        entry: GoldenSet = {"name": name, "texts": texts, "labels": labels, "source": source,
                 "sha256": sha256, "min_accuracy": min_accuracy, "created_at": time.time()}
        os.makedirs(self.dir, exist_ok=True)
        write_json_atomic(self.path(name), entry)
        self._cache[name] = entry
        return summary(entry)

    def delete(self, name: str) -> bool:
        """Called off the IOLoop (it removes a file); the cache forgets the
        set only once the file is gone."""
        try:
            os.remove(self.path(name))
        except FileNotFoundError:
            self._cache.pop(name, None)
            return False
        self._cache.pop(name, None)
        return True


def summary(entry: GoldenSet) -> dict[str, object]:
    counts: dict[str, int] = {}
    for lab in entry["labels"]:
        counts[lab] = counts.get(lab, 0) + 1
    return {"name": entry["name"], "examples": len(entry["texts"]), "label_counts": counts,
            "source": entry["source"], "sha256": entry["sha256"],
            "min_accuracy": entry["min_accuracy"], "created_at": entry["created_at"]}
