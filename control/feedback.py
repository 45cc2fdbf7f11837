"""Feedback and the review queue (docs/loop.md): the learning loop's logic,
which the HTTP handlers of frontend/loop_handlers.py only parse for and render.

`FeedbackService.feedback(body)` stores true labels for logged predictions
(`request_id` with `label`, `index` or `labels`) or free examples (`model`,
`examples`), checked against what the model's version knows (its labels,
whether it is multi-label); then the retrain policies hear that labels
arrived. `FeedbackService.review(name, limit, strategy)` lists logged
predictions that have no label yet, uncertain (or random) first.

Multi-label models (the version's meta.json says multi_label): the truth of
a text is a label set, `"labels": [...]` for one text (a single-text request,
or with "index"), `"labels": [[...], [...]]` for the whole batch; free
examples `{"text", "labels": [...]}`. A set is stored in the log's label text
as state/dataset.py's encode_label_set (the JSON of the sorted distinct list),
the predicted set likewise in the feedback's `predicted`.

Both are awaited on the IOLoop. The log's reads, its flush and the store's
meta files are blocking calls: they run in a small executor of this module's
own (`off_loop`), so a flood of feedback queues there and never holds the
IOLoop or the default executor. The log's writes are futures, awaited, not
blocked on. An answered feedback is committed. Every refusal is a
ServiceError with its status and code (state/errors.py); a failed durable
write is 507 insufficient_storage or 503 store_unavailable, nothing stored.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import re
import sqlite3
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypedDict, TypeVar

from control.quality import predicted_set
from state.dataset import encode_label_set, is_label_set
from state.errors import InvalidName, NotFound, ServiceError, StoreError
from state.statedb import as_oserror
from state.storage import storage_error
from state.texts import text_problem

if TYPE_CHECKING:
    from state.predlog_api import PredictionLogBackend
    from state.store import ModelStore

MAX_LABEL_CHARS = 200
STRATEGIES = ("uncertain", "random")
MAX_REVIEW = 1000
MAX_INDEX = 10**6
# a request id (frontend/request_ids.py's form): a client's own has at most 64
# characters, and a predict key's namespace in front of it 9 more
ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,80}\Z")
WRITE_TIMEOUT_S = 30.0
_META_CAP = 512
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="loop")
T = TypeVar("T")


def refused(status: int, code: str, message: str,
            details: dict[str, object] | None = None) -> ServiceError:
    return ServiceError(message, status, code, details)


async def off_loop(fn: Callable[..., T], *args: object, what: str = "the prediction log",
                   path: str = "") -> T:
    """fn(*args) in this module's executor, awaited; a failed durable write
    (disk full, I/O error) is a 507 or 503 StorageFailed."""
    try:
        return await asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)
    except (OSError, sqlite3.Error) as exc:
        raise storage_error(what, path, as_oserror(exc)) from None


async def _written(fut: concurrent.futures.Future[Any], path: str) -> None:
    """A write of the log, committed: awaited on the IOLoop, never blocked on."""
    try:
        await asyncio.wait_for(asyncio.wrap_future(fut), WRITE_TIMEOUT_S)
    except (OSError, sqlite3.Error) as exc:
        raise storage_error("the prediction log", path, as_oserror(exc)) from None
    except asyncio.TimeoutError:
        raise refused(503, "store_unavailable",
                      f"the prediction log did not commit within {WRITE_TIMEOUT_S:g} s; "
                      "nothing is known to be stored") from None


class VersionInfo(TypedDict):
    """What feedback needs of a version (its meta.json; FeedbackService._meta_of)."""
    labels: set[str]
    multi_label: bool
    thresholds: dict[str, float]
    min_labels: int


class LabelsArrived(Protocol):
    """What feedback tells the retrain policies (control/policies.py)."""

    def labels_arrived(self, name: str) -> None: ...


class FeedbackService:
    """True labels in, the review queue out; see the module's docstring."""

    def __init__(self, predlog: PredictionLogBackend | None, store: ModelStore,
                 policies: LabelsArrived | None, max_items: int, max_text_chars: int,
                 max_examples: int = 1000) -> None:
        self.predlog = predlog
        self.store = store
        self.policies = policies
        self.max_items = max_items
        self.max_examples = max_examples  # free examples in one body (feedback.max_examples)
        self.max_text_chars = max_text_chars
        self._meta: dict[tuple[str, int | None], VersionInfo] = {}

    @property
    def path(self) -> str:
        """Where the log is, for storage errors ("" for Redis)."""
        return str(getattr(self.predlog, "path", ""))

    def _log(self) -> PredictionLogBackend:
        if self.predlog is None or not self.predlog.enabled:
            raise refused(409, "log_off", "the prediction log is off (predictions.log: false)")
        return self.predlog

    # -- feedback ---------------------------------------------------------------------------
    async def feedback(self, data: dict[str, Any]) -> dict[str, Any]:
        """A POST /feedback body (a JSON object of its known fields) stored:
        the answer, naming every item stored."""
        plog = self._log()
        if "examples" in data or "model" in data:
            answer = await self._examples(data, plog)
            model = answer["model"]
        else:
            answer = await self._on_predictions(data, plog)
            model = answer["model"]["name"]
        if self.policies is not None and answer["stored"]:
            self.policies.labels_arrived(model)
        return answer

    async def _examples(self, data: dict[str, Any], plog: PredictionLogBackend
                        ) -> dict[str, Any]:
        cap = self.max_items
        extra = sorted(set(data) & {"request_id", "index", "label", "labels"})
        if extra or "model" not in data or "examples" not in data:
            raise refused(400, "bad_request", "free examples are {\"model\": name, "
                                              "\"examples\": [{\"text\", \"label\"}, ...]} "
                                              "(multi-label models: {\"text\", \"labels\": "
                                              "[...]})"
                          + (f"; not with {', '.join(extra)}" if extra else ""))
        name = data["model"]
        if not isinstance(name, str):
            raise refused(400, "invalid_field", "'model' must be a model name")
        examples = data["examples"]
        if not isinstance(examples, list) or not examples:
            raise refused(400, "invalid_field", "'examples' must be a non-empty list")
        if len(examples) > min(cap, self.max_examples):
            setting = "max_examples" if self.max_examples < cap else "max_items"
            raise refused(413, "too_many_items", f"'examples' has {len(examples)} items; "
                                                 f"the limit is {min(cap, self.max_examples)} "
                                                 f"(feedback.{setting})")

        def lookup() -> VersionInfo:
            try:
                self.store.resolve(name)
            except (NotFound, InvalidName):
                raise refused(404, "not_found",
                              f"no model named {name!r} in the store") from None
            return self._meta_of(name, None)
        info = await off_loop(lookup)
        multi = info["multi_label"]
        key = "labels" if multi else "label"
        pairs: list[tuple[str, Any]] = []  # (text, label) or (text, label set)
        for i, ex in enumerate(examples):
            where = f"'examples[{i}]'"
            if not isinstance(ex, dict) or set(ex) - {"text", key} or key not in ex:
                other = "label" if multi else "labels"
                raise refused(400, "invalid_field", f"{where} must be {{\"text\", \"{key}\"}}"
                              + (f": model {name!r} is "
                                 + ("multi-label (a label set per text)" if multi else
                                    "single-label (one label per text)")
                                 if isinstance(ex, dict) and other in ex else ""))
            text = ex.get("text")
            if not isinstance(text, str):
                raise refused(400, "invalid_field", f"{where}.text must be a string")
            problem = text_problem(text, f"{where}.text", self.max_text_chars)
            if problem is not None:
                raise refused(*problem)
            pairs.append((text, label_set(ex["labels"], f"{where[:-1]}.labels'") if multi
                          else label(ex.get("label"), f"{where}.label")))

        known = info["labels"]
        out: dict[str, Any]
        if multi:
            new = sorted({x for _, labs in pairs for x in labs if x not in known})
            stored = [(text, encode_label_set(labs)) for text, labs in pairs]
            # the log's new-label rows: a set with any new label
            await _written(plog.add_examples(name, stored, [
                enc for (_, labs), (_, enc) in zip(pairs, stored) if set(labs) - known]),
                self.path)
            items = [{"index": i, "labels": labs, "new_label": bool(set(labs) & set(new))}
                     for i, (_, labs) in enumerate(pairs)]
        else:
            new = sorted({lab for _, lab in pairs if lab not in known})
            await _written(plog.add_examples(name, pairs, new), self.path)
            items = [{"index": i, "label": lab, "new_label": lab in new}
                     for i, (_, lab) in enumerate(pairs)]
        out = {"model": name, "stored": len(pairs), "new_labels": new,
               "new_label": bool(new), "items": items}
        if multi:
            out["multi_label"] = True
        return out

    async def _on_predictions(self, data: dict[str, Any], plog: PredictionLogBackend
                              ) -> dict[str, Any]:
        cap = self.max_items
        if "request_id" not in data:
            raise refused(400, "missing_field", "'request_id' is required (or 'model' and "
                                                "'examples' for labels without a prediction)")
        rid = data["request_id"]
        if not isinstance(rid, str) or not ID_RE.match(rid):
            raise refused(400, "invalid_request_id",
                          "'request_id' must be 1 to 80 characters of A-Z a-z 0-9 . _ : -")
        if ("label" in data) == ("labels" in data):
            raise refused(400, "bad_request", "give exactly one of 'label' (one text, or "
                                              "with 'index') or 'labels' (the whole batch; "
                                              "for a multi-label model: a label set)")
        index = None
        if "index" in data:
            index = data["index"]
            if isinstance(index, bool) or not isinstance(index, int):
                raise refused(400, "invalid_field", "'index' must be an integer")
            if not 0 <= index <= MAX_INDEX:
                raise refused(400, "invalid_field",
                              f"'index' must be between 0 and {MAX_INDEX}, got {index}")
        # checks that hold for either kind of model, before the request is looked up
        if "label" in data:
            label(data["label"], "'label'")
        else:
            labels = data["labels"]
            if not isinstance(labels, list):
                raise refused(400, "invalid_field", "'labels' must be a list")
            if len(labels) > cap:
                raise refused(413, "too_many_items", f"'labels' has {len(labels)} items; "
                                                     f"the limit is {cap}")
            if any(isinstance(x, list) for x in labels):
                if not all(isinstance(x, list) for x in labels):
                    raise refused(400, "invalid_field",
                                  "'labels' must be one label set (a list of labels) or, for "
                                  "the whole batch, a list of label sets; not a mix")
                for i, x in enumerate(labels):
                    label_set(x, f"'labels[{i}]'")
            else:
                for i, x in enumerate(labels):
                    label(x, f"'labels[{i}]'")

        def look_up() -> tuple[list[dict[str, Any]], VersionInfo]:
            rows = plog.get(rid)
            if not rows:  # maybe still queued for the writer
                plog.flush(WRITE_TIMEOUT_S)
                rows = plog.get(rid)
            if not rows:
                if data.get("labels") == []:  # not a batch's labels; a set only if multi-label
                    raise refused(400, "invalid_field",
                                  "'labels' must be a non-empty list (the batch's labels), or "
                                  f"a multi-label model's empty label set; request id {rid!r} "
                                  "is not in the prediction log")
                raise refused(404, "unknown_request_id",
                              f"no logged prediction has request id {rid!r}",
                              {"request_id": rid})
            return rows, self._meta_of(rows[0]["model"], rows[0]["version"])
        rows, info = await off_loop(look_up, path=self.path)
        if info["multi_label"]:
            batch, answer = self._sets(rid, rows, data, index, info)
        else:
            batch, answer = self._singles(rid, rows, data, index, info)
        await _written(plog.add_feedback_many(batch), self.path)
        return answer

    def _singles(self, rid: str, rows: list[dict[str, Any]], data: dict[str, Any],
                 index: int | None, info: VersionInfo
                 ) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
        """The feedback rows and the answer for a single-label version's predictions."""
        if "labels" in data:
            if "index" in data:
                raise refused(400, "bad_request", "'index' goes with 'label', not 'labels'")
            if not data["labels"] or isinstance(data["labels"][0], list):
                raise refused(400, "invalid_field",
                              "'labels' must be a non-empty list of labels, one per text "
                              f"(model {rows[0]['model']!r} is single-label: no label sets)")
            wanted = [label(x, f"'labels[{i}]'") for i, x in enumerate(data["labels"])]
            if len(wanted) != len(rows):
                raise refused(400, "wrong_length",
                              f"'labels' has {len(wanted)} items; request {rid} had "
                              f"{len(rows)} texts", {"expected": len(rows)})
            targets = list(zip(rows, wanted))
        else:
            targets = _one(rid, rows, index, label(data["label"], "'label'"))
        items, batch = [], []
        known = info["labels"]
        for row, truth in targets:
            new = bool(known) and truth not in known
            batch.append((rid, row["index"], truth, row["model"], row["version"],
                          row["text"], row["label"], new))
            items.append({"request_id": rid, "index": row["index"], "label": truth,
                          "predicted": row["label"], "correct": truth == row["label"],
                          "new_label": new})
        model = {"name": rows[0]["model"], "version": rows[0]["version"]}
        out = {"request_id": rid, "model": model, "stored": len(items),
               "new_label": any(i["new_label"] for i in items), "items": items}
        if len(items) == 1:
            out.update({k: items[0][k] for k in ("index", "label", "predicted", "correct")})
        return batch, out

    def _sets(self, rid: str, rows: list[dict[str, Any]], data: dict[str, Any],
              index: int | None, info: VersionInfo
              ) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
        """The feedback rows and the answer for a multi-label version's
        predictions: a label set per text."""
        name = rows[0]["model"]
        if "label" in data:
            raise refused(400, "invalid_field",
                          f"model {name!r} is multi-label: give 'labels': [...] (the text's "
                          "label set; [] for none), not 'label'")
        labels = data["labels"]
        batch_form = bool(labels) and all(isinstance(x, list) for x in labels)
        if batch_form and index is None:
            if len(labels) != len(rows):
                raise refused(400, "wrong_length",
                              f"'labels' has {len(labels)} label sets; request {rid} had "
                              f"{len(rows)} texts", {"expected": len(rows)})
            targets = [(row, label_set(x, f"'labels[{i}]'"))
                       for i, (row, x) in enumerate(zip(rows, labels))]
        elif batch_form:
            raise refused(400, "invalid_field", "with 'index', 'labels' is that text's label "
                                                "set (a list of labels), not a list of sets")
        else:
            targets = _one(rid, rows, index, label_set(labels, "'labels'"))
        items, batch = [], []
        known = info["labels"]
        for row, truth in targets:
            predicted = predicted_set(row.get("scores") or {}, info["thresholds"],
                                      info["min_labels"], row["label"])
            new = bool(known) and bool(set(truth) - known)
            batch.append((rid, row["index"], encode_label_set(truth), row["model"],
                          row["version"], row["text"], encode_label_set(predicted), new))
            items.append({"request_id": rid, "index": row["index"], "labels": truth,
                          "predicted": predicted, "correct": truth == predicted,
                          "new_label": new,
                          "new_labels": sorted(set(truth) - known) if known else []})
        out = {"request_id": rid, "model": {"name": name, "version": rows[0]["version"]},
               "multi_label": True, "stored": len(items),
               "new_label": any(i["new_label"] for i in items), "items": items}
        if len(items) == 1:
            out.update({k: items[0][k] for k in ("index", "labels", "predicted", "correct")})
        return batch, out

    # -- the review queue -------------------------------------------------------------------
    async def review(self, name: str, limit: int, strategy: str) -> dict[str, object]:
        """Up to `limit` logged predictions of `name` that have no label yet,
        by `strategy` (one of STRATEGIES; limit 1..MAX_REVIEW)."""
        if not 1 <= limit <= MAX_REVIEW:
            raise refused(400, "invalid_field", f"'limit' must be between 1 and {MAX_REVIEW}")
        if strategy not in STRATEGIES:
            raise refused(400, "invalid_field", f"'strategy' must be one of "
                                                f"{', '.join(STRATEGIES)}")
        plog = self.predlog
        if plog is None:
            raise refused(409, "log_off", "the service keeps no prediction log")

        def read() -> list[dict[str, Any]]:
            try:
                self.store.resolve(name)
            except (NotFound, InvalidName):
                raise refused(404, "not_found",
                              f"no model named {name!r} in the store") from None
            plog.flush(10)  # what was answered before this request is in the queue
            rows = plog.review(name, limit, strategy)
            for r in rows:  # a multi-label version: the set it answered, rebuilt
                info = self._meta_of(name, r["version"])
                if info["multi_label"]:
                    r["labels"] = predicted_set(r["scores"] or {}, info["thresholds"],
                                                info["min_labels"], r["label"])
            return rows
        rows = await off_loop(read, path=self.path)
        items = [{"request_id": r["request_id"], "index": r["index"], "text": r["text"],
                  "label": r["label"], "top": _top(r["scores"]),
                  "score": max(r["scores"].values()) if r["scores"] else None,
                  "margin": r["margin"], "version": r["version"], "at": r["at"],
                  **({"labels": r["labels"]} if "labels" in r else {})}
                 for r in rows]
        return {"model": name, "strategy": strategy, "count": len(items), "items": items}

    # -- what a version knows ---------------------------------------------------------------
    def _meta_of(self, name: str, version: int | None) -> VersionInfo:
        """What feedback needs of a version of a model (its meta.json): the
        labels it knows, multi_label, thresholds, min_labels; the latest
        version when version is None. Blocking: called in the executor. A
        version the store cannot read (removed, or its meta.json broken) knows
        no labels, so none of its feedback is flagged new."""
        v: int | None = None
        try:
            # the latest is resolved each time (a retraining adds versions)
            v = self.store.resolve(name)[0] if version is None else int(version)
        except (StoreError, TypeError, ValueError):
            v = None
        key = (name, v)
        info = self._meta.get(key)
        if info is None:
            try:
                meta = self.store.meta(name, v) if v is not None else {}
            except StoreError:
                meta = {}
            if len(self._meta) > _META_CAP:
                self._meta.clear()
            info = self._meta[key] = {
                "labels": set(meta.get("labels") or []),
                "multi_label": bool(meta.get("multi_label")),
                "thresholds": dict(meta.get("thresholds") or {}),
                "min_labels": int(meta.get("min_labels", 1))}
        return info


def label(value: object, where: str) -> str:
    """One label, checked: a non-empty string (or a number, as text) of at most
    MAX_LABEL_CHARS characters, not written as a label set."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise refused(400, "invalid_field", f"{where} must be a string")
    out = str(value).strip()
    if not out:
        raise refused(400, "invalid_field", f"{where} is empty")
    if len(out) > MAX_LABEL_CHARS:
        raise refused(400, "invalid_field", f"{where} has {len(out)} characters; the "
                                            f"limit is {MAX_LABEL_CHARS}")
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:
        raise refused(400, "invalid_field", f"{where} is not valid Unicode") from None
    if is_label_set(out):  # would read back as a label set (state/dataset.py)
        raise refused(400, "invalid_field", f"{where} {out!r} is written as a JSON list, "
                                            "which is how label sets are stored; a "
                                            "single-label model takes a plain label")
    return out


def label_set(value: object, where: str) -> list[str]:
    """One text's label set: a list of labels, sorted and distinct; [] (the text
    truly has none of the model's labels) is allowed."""
    if not isinstance(value, list):
        raise refused(400, "invalid_field", f"{where} must be a list of labels (a label set; "
                                            "[] for a text with no label)")
    out = set()
    for i, x in enumerate(value):
        if isinstance(x, list):
            raise refused(400, "invalid_field", f"{where[:-1]}[{i}]' must be a label, not a "
                                                "list")
        inner = f"{where[:-1]}[{i}]'" if where.endswith("'") else f"{where}[{i}]"
        out.add(label(x, inner))
    return sorted(out)


def _one(rid: str, rows: list[dict[str, Any]], index: int | None, value: T
         ) -> list[tuple[dict[str, Any], T]]:
    """The (row, truth) of a feedback on one text: the request's only text, or
    the one at `index`."""
    if index is None:
        if len(rows) != 1:
            raise refused(400, "missing_field",
                          f"request {rid} had {len(rows)} texts: give 'index' "
                          "(0-based) or 'labels' for all of them")
        return [(rows[0], value)]
    hit = [r for r in rows if r["index"] == index]
    if not hit:
        raise refused(404, "unknown_index", f"request {rid} has no text at index "
                                            f"{index} (it had {len(rows)})",
                      {"request_id": rid, "index": index})
    return [(hit[0], value)]


def _top(scores: dict[str, float]) -> list[dict[str, object]]:
    return [{"label": k, "score": v}
            for k, v in sorted(scores.items(), key=lambda kv: kv[1], reverse=True)]
