"""The prediction log's logic, whichever backend stores it.

`PredictionLogCore` is the base class of state/predlog.py's `PredictionLog`
(SQLite and its writer process) and cluster/redis_predlog.py's
`RedisPredictionLog` (Redis streams): what the two logs answer is decided
here, once, and each backend only stores and reads. Here:

- the request path's gate (a disabled or closed log takes nothing) and the
  shape of what it queues (`add`, `add_answer`, `add_scores`);
- feedback and free examples made into rows (the time, the new-label flag)
  before a backend stores them;
- the rows the reads answer: a logged prediction (`prediction`, its margin:
  `top_margin`, `scores_margin`), a prediction fed back (`fed_back_row`),
  the counts per version (`tally`), the newest label of each text
  (`newest_labels`);
- the review queue: what is left out (fed back, or a text already
  labelled) and the order (`review_pick`: the smallest margin first, the
  newest first among equals; or shuffled), each text once;
- erasure and retention bookkeeping (`Erasure`: what was removed, the
  texts erased; `age_cutoff`: each model's age limit as a time).

A backend implements the storage methods named ``_store_*``, ``_erase_*``,
``_purge``, ``_expire`` and the reads' sources (see each below). Imports
nothing above state/.
"""
from __future__ import annotations

import concurrent.futures
import queue
import random
import time
from typing import Any, Callable, Iterable, Sequence

from state.storage import Health

WHAT = "the prediction log"  # how storage health and errors name it


def drain(q: queue.SimpleQueue[Any], first: Any) -> list[Any]:
    """`first` and whatever else is on the queue now (one batch)."""
    batch = [first]
    while True:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            return batch


def top_of(row: list[float], labels: list[str], k: int) -> dict[str, Any]:
    """A prediction (its label and top k) from a score row (what /predict
    answered for it)."""
    order = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:max(1, k)]
    top = [{"label": labels[i], "score": row[i]} for i in order]
    return {"label": top[0]["label"] if top else None, "top": top}


def top_margin(top: list[dict[str, Any]]) -> float:
    """The top score minus the second, of a top list, best first (only the top
    one kept: its distance to a tie; none: 1.0)."""
    if len(top) >= 2:
        return top[0]["score"] - top[1]["score"]
    if top:
        return 2.0 * top[0]["score"] - 1.0
    return 1.0


def scores_margin(scores: dict[str, float]) -> float:
    """`top_margin` of a {label: score} map."""
    vals = sorted(scores.values(), reverse=True)
    if not vals:
        return 1.0
    if len(vals) == 1:
        return 2.0 * vals[0] - 1.0
    return vals[0] - vals[1]


def prediction(at: Any, request_id: str, index: int, model: str, version: Any, text: str,
               label: Any, scores: dict[str, float], margin: float) -> dict[str, Any]:
    """A logged prediction as the reads answer it (get, recent, review)."""
    return {"at": at, "request_id": request_id, "index": index, "model": model,
            "version": version, "text": text, "label": label, "scores": scores,
            "margin": margin}


def fed_back_row(request_id: str, index: int, version: Any, text: str, predicted: Any,
                 truth: str, new_label: Any, scores: dict[str, float], at: Any,
                 fed_at: float) -> dict[str, Any]:
    """A prediction fed back, as fed_back answers it (`at` None and scores {}:
    the prediction was trimmed)."""
    return {"request_id": request_id, "index": index, "version": version, "text": text,
            "label": predicted, "truth": truth, "new_label": bool(new_label),
            "scores": scores, "at": at, "fed_at": fed_at}


def tally(out: dict[Any, dict[str, int]], version: Any, what: str, n: int) -> None:
    """Add n to counts' figure `what` ("predictions", "feedback") of a version."""
    out.setdefault(version, {"predictions": 0, "feedback": 0})[what] += n


def newest_labels(rows: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """(text, label), oldest first, with each text once: its newest label, in
    the order of the newest labels."""
    newest: dict[str, str] = {}
    for text, label in rows:
        newest.pop(text, None)  # re-insert: dict order follows the newest
        newest[text] = label
    return list(newest.items())


def review_pick(margins: Sequence[float], strategy: str, limit: int, done: set[str],
                text_of: Callable[[int], str], row_of: Callable[[int], dict[str, Any]]
                ) -> list[dict[str, Any]]:
    """The review queue from its candidates, newest first (candidate k: its
    margin, text and row): "uncertain", the smallest margin first (a stable
    sort: among equal margins, the newest first), else shuffled; a text in
    `done` (labelled) or already picked is left out (a text asked many
    times is reviewed once); `limit` at most. `done` is extended."""
    order = list(range(len(margins)))
    if strategy == "uncertain":
        order.sort(key=margins.__getitem__)
    else:
        random.shuffle(order)
    out: list[dict[str, Any]] = []
    for k in order:
        text = text_of(k)
        if text in done:
            continue
        done.add(text)
        out.append(row_of(k))
        if len(out) >= limit:
            break
    return out


def labelled(feedback: Iterable[tuple[str, int, str]], example_texts: Iterable[str]
             ) -> tuple[set[tuple[str, int]], set[str]]:
    """What review leaves out: the (request id, index) fed back, and the texts
    labelled (fed back, or a free example), from the feedback's (request id,
    index, text) and the examples' texts."""
    fed: set[tuple[str, int]] = set()
    done: set[str] = set()
    for rid, index, text in feedback:
        fed.add((rid, index))
        done.add(text)
    done.update(example_texts)
    return fed, done


class Erasure:
    """One erasure's bookkeeping: the rows removed, counted, and (when the
    caller asked, `erased`) the texts erased, per model."""

    def __init__(self, erased: dict[str, set[str]] | None) -> None:
        self.erased = erased
        self.removed = {"predictions": 0, "feedback": 0, "examples": 0}

    @property
    def wants_texts(self) -> bool:
        return self.erased is not None

    def texts(self, model: str) -> set[str]:
        """The set that gets the model's erased texts (a throwaway one when the
        caller did not ask for them)."""
        return self.erased.setdefault(model, set()) if self.erased is not None else set()

    def count(self, predictions: int = 0, feedback: int = 0, examples: int = 0) -> None:
        self.removed["predictions"] += int(predictions)
        self.removed["feedback"] += int(feedback)
        self.removed["examples"] += int(examples)


def age_cutoff(ages: dict[str, float], default: float, now: float
               ) -> Callable[[str], float] | None:
    """A model's age limit (days; `ages` per model over `default`; 0: none) as
    the time before which its rows go (0.0: none); None when no model has one."""
    if not default and not any(v and v > 0 for v in ages.values()):
        return None

    def cut(model: str) -> float:
        days = ages.get(model, default)
        return now - float(days) * 86400.0 if days and days > 0 else 0.0
    return cut


def closed_future() -> concurrent.futures.Future[Any]:
    """What a write to a closed log gets."""
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_exception(RuntimeError("the prediction log is closed"))
    return fut


class PredictionLogCore:
    """The prediction log's logic over a backend's storage (module docstring).

    A backend implements: ``_enqueue(item, texts)`` (the request path: never
    blocks), ``_store_feedback(rows)`` and ``_store_examples(model, rows)``
    (futures), the reads' sources ``_labels_after``, ``_review_marks``,
    ``_review_candidates``, ``_fed``, ``_predicted``, ``_count_rows``, and
    the erasures ``_erase_request``, ``_purge``, ``_expire``; plus its own
    reads (get, recent, feedback_count, labels_seen), flush and close."""

    def __init__(self, *, enabled: bool, max_rows: int, feedback_rows: int,
                 example_rows: int, health: Health | None = None) -> None:
        self.health = health  # state/storage.py's Storage: write outcomes go there
        self.enabled = enabled
        self.max_rows = max_rows
        # per model, the feedback rows and free examples kept (the oldest go first)
        self.feedback_rows, self.example_rows = feedback_rows, example_rows
        self.caps = {"feedback": feedback_rows, "examples": example_rows}
        self._closed = False

    # -- predictions, from the request path (never block) ------------------------------
    def add(self, rows: list[dict[str, Any]]) -> None:
        """Queue predictions: rows {"at", "request_id", "index", "model",
        "version", "text", "label", "scores": {label: score} or a top list}."""
        if self.enabled and not self._closed and rows:
            self._enqueue(("r", rows), len(rows))

    def add_answer(self, at: float, request_id: str, model: str, version: Any,
                   texts: list[str], predictions: list[dict[str, Any]]) -> None:
        """Queue a /predict answer whole (one put on the request path)."""
        if self.enabled and not self._closed and texts:
            self._enqueue(("a", at, request_id, model, version, texts, predictions), len(texts))

    def add_scores(self, at: float, request_id: str, model: str, version: Any,
                   texts: list[str], labels: list[str], rows: list[list[float]], k: int
                   ) -> None:
        """Queue an answer as the model's score rows (one per text, a score per
        label) and the number of top labels it answered: read back as top
        lists (`top_of`; cheaper to queue than the predictions)."""
        if self.enabled and not self._closed and texts:
            self._enqueue(("s", at, request_id, model, version, texts, labels, rows, k),
                          len(texts))

    def _enqueue(self, item: tuple[Any, ...], texts: int) -> None:
        raise NotImplementedError

    # -- feedback and examples: futures that resolve once stored --------------------------
    def add_feedback(self, request_id: str, index: int, label: str, *, model: str,
                     version: Any, text: str, predicted: str | None = None,
                     new_label: bool = False, at: float | None = None
                     ) -> concurrent.futures.Future[Any]:
        """Store (or replace) the truth of logged prediction (request_id, index);
        the future resolves once it is stored."""
        return self.add_feedback_many([(request_id, index, label, model, version, text,
                                        predicted, new_label)], at)

    def add_feedback_many(self, items: list[tuple[Any, ...]], at: float | None = None
                          ) -> concurrent.futures.Future[Any]:
        """items: (request_id, index, label, model, version, text, predicted, new_label)."""
        when = time.time() if at is None else at
        return self._store_feedback([(*it[:7], bool(it[7]), when) for it in items])

    def add_examples(self, model: str, examples: Iterable[tuple[str, str]],
                     new_labels: Iterable[str] = (), at: float | None = None
                     ) -> concurrent.futures.Future[Any]:
        """Labels with no logged prediction (a repeated text replaces)."""
        when = time.time() if at is None else at
        new = set(new_labels)
        return self._store_examples(model, [(t, lab, lab in new, when) for t, lab in examples])

    def _store_feedback(self, rows: list[tuple[Any, ...]]) -> concurrent.futures.Future[Any]:
        """rows: (request_id, index, label, model, version, text, predicted,
        new_label: bool, at)."""
        raise NotImplementedError

    def _store_examples(self, model: str, rows: list[tuple[str, str, bool, float]]
                        ) -> concurrent.futures.Future[Any]:
        """rows: (text, label, new_label, at)."""
        raise NotImplementedError

    # -- reads (executor threads, never the IOLoop) ---------------------------------------
    def feedback_examples(self, model: str, since: float | None = None
                          ) -> list[tuple[str, str]]:
        """(text, label) of every label fed back for the model, oldest first; a text
        labelled more than once keeps its newest label."""
        return newest_labels(self._labels_after(model, -1.0 if since is None else since))

    def _labels_after(self, model: str, t: float) -> Iterable[tuple[str, str]]:
        """(text, label) of the feedback and free examples after t, oldest first."""
        raise NotImplementedError

    def review(self, model: str, limit: int = 50, strategy: str = "uncertain"
               ) -> list[dict[str, Any]]:
        """Logged predictions with no feedback yet, one per text (for
        "uncertain", its most uncertain prediction; the newest first among
        equal margins); "random": shuffled."""
        fed, done = labelled(*self._review_marks(model))
        margins, text_of, row_of = self._review_candidates(model, fed, done)
        return review_pick(margins, strategy, limit, done, text_of, row_of)

    def _review_marks(self, model: str
                      ) -> tuple[Iterable[tuple[str, int, str]], Iterable[str]]:
        """The feedback's (request id, index, text), and the examples' texts."""
        raise NotImplementedError

    def _review_candidates(self, model: str, fed: set[tuple[str, int]], done: set[str]
                           ) -> tuple[Sequence[float], Callable[[int], str],
                                      Callable[[int], dict[str, Any]]]:
        """The predictions review may pick, newest first (those fed back left
        out; labelled texts may be): their margins, and a text and a row by
        position."""
        raise NotImplementedError

    def fed_back(self, model: str, version: Any = None) -> list[dict[str, Any]]:
        """Feedback on logged predictions, oldest first, with what was predicted.
        The prediction may have been trimmed: then scores are {} and at None."""
        fb = self._fed(model, version)
        found = self._predicted(model, version, {f[0] for f in fb}) if fb else {}
        out = []
        for rid, index, ver, text, predicted, truth, new, fed_at in fb:
            at, scores = found.get((rid, index), (None, {}))
            out.append(fed_back_row(rid, index, ver, text, predicted, truth, new, scores,
                                    at, fed_at))
        return out

    def _fed(self, model: str, version: Any) -> list[tuple[Any, ...]]:
        """The feedback (of a version when given), oldest first: (request_id,
        index, version, text, predicted, label, new_label, at)."""
        raise NotImplementedError

    def _predicted(self, model: str, version: Any, rids: set[str]
                   ) -> dict[tuple[str, int], tuple[Any, dict[str, float]]]:
        """(request id, index) -> (at, scores) of the predictions logged under
        these ids."""
        raise NotImplementedError

    def counts(self, model: str) -> dict[Any, dict[str, int]]:
        """{version: {"predictions": n, "feedback": n}}."""
        out: dict[Any, dict[str, int]] = {}
        predictions, feedback = self._count_rows(model)
        for version, n in predictions:
            tally(out, version, "predictions", n)
        for version, n in feedback:
            tally(out, version, "feedback", n)
        return out

    def _count_rows(self, model: str
                    ) -> tuple[Iterable[tuple[Any, int]], Iterable[tuple[Any, int]]]:
        """(version, texts logged) and (version, feedback rows)."""
        raise NotImplementedError

    # -- erasure and retention (executor threads) ------------------------------------------
    def erase(self, request_id: str, timeout: float = 60.0,
              erased: dict[str, set[str]] | None = None) -> dict[str, int]:
        """Erase one request's texts everywhere the log holds them: its logged
        answers (every entry under this id, the queued ones too: flushed
        first), the feedback on them, and the free examples with those texts
        of the same model, so that they are unreadable (the backend's files
        too). Returns what was removed; `erased` gets the texts."""
        self.flush(timeout)
        done = Erasure(erased)
        self._erase_request(request_id, done, timeout)
        return done.removed

    def purge(self, model: str, timeout: float = 60.0,
              erased: dict[str, set[str]] | None = None) -> dict[str, int]:
        """Erase a model's whole log: its answers, feedback and free examples."""
        self.flush(timeout)
        done = Erasure(erased)
        self._purge(model, done, timeout)
        return done.removed

    def expire(self, ages: dict[str, float], default: float = 0.0,
               now: float | None = None,
               erased: dict[str, set[str]] | None = None) -> dict[str, int]:
        """Erase what is older than its model's age limit (days; `ages` per
        model over `default`; 0: none): answers, feedback and free examples,
        as erase() erases. Returns what was removed."""
        cut = age_cutoff(ages, default, time.time() if now is None else now)
        done = Erasure(erased)
        if cut is not None:
            self._expire(cut, done)
        return done.removed

    def _erase_request(self, request_id: str, done: Erasure, timeout: float) -> None:
        raise NotImplementedError

    def _purge(self, model: str, done: Erasure, timeout: float) -> None:
        raise NotImplementedError

    def _expire(self, cut: Callable[[str], float], done: Erasure) -> None:
        """cut(model): the time before which its rows go (0.0: none)."""
        raise NotImplementedError

    def flush(self, timeout: float | None = None) -> None:
        raise NotImplementedError
