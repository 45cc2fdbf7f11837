"""The learning loop's routes (docs/loop.md).

Inference port:  POST /feedback                (the feedback key: frontend/auth.py)
Multi-label models (the version's meta.json says multi_label): the truth of a
text is a label set, `"labels": [...]` for one text (a single-text request,
or with "index"), `"labels": [[...], [...]]` for the whole batch; free
examples `{"text", "labels": [...]}`. A set is stored in the log's label text
as state/dataset.py's encode_label_set (the JSON of the sorted distinct list),
the predicted set likewise in the feedback's `predicted`.

Management port: GET /models/<name>/review     (the review queue)
                 GET/PUT/DELETE /models/<name>/policy   (the retrain policy)

The prediction log (state/predlog.py) is read and written from a small
executor of this module's own, so a flood of feedback queues there and never
holds the IOLoop or the default executor; an answered feedback is committed.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import sqlite3
import time
from typing import Any

from tornado.ioloop import IOLoop

from control.quality import predicted_set
from frontend.base import ApiError, JsonHandler, int_field, service_error
from frontend.loop import check_id
from state.dataset import encode_label_set, is_label_set
from state.errors import InvalidName, NotFound
from state.statedb import as_oserror
from state.storage import storage_error

log = logging.getLogger("textswap.loop")
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="loop")
FEEDBACK_FIELDS = {"request_id", "index", "label", "labels", "model", "examples"}
MAX_LABEL_CHARS = 200
STRATEGIES = ("uncertain", "random")
MAX_REVIEW = 1000


class RateLimit:
    """Token buckets, one per caller: `rate` requests a second on average,
    bursts of up to `burst`. POST /feedback's callers are told apart by the
    key they send (by its hash; the client's address when none is needed),
    so one caller cannot flood the log with labels that retraining uses."""

    def __init__(self, rate: float, burst: float, max_callers: int = 10_000) -> None:
        self.rate, self.burst, self.max_callers = rate, max(burst, 1.0), max_callers
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, at)

    def take(self, caller: str, now: float | None = None) -> float:
        """0.0 when the request may go on, else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.get(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[caller] = (tokens, now)
            return (1.0 - tokens) / self.rate
        if caller not in self._buckets and len(self._buckets) >= self.max_callers:
            # forget the fullest buckets: they are the callers that waited longest
            for old in sorted(self._buckets, key=lambda c: self._buckets[c][1])[:1000]:
                del self._buckets[old]
        self._buckets[caller] = (tokens - 1.0, now)
        return 0.0


_LIMITS: dict[int, RateLimit] = {}  # one per config (the service has one)


def feedback_limit(config: Any) -> RateLimit:
    limit = _LIMITS.get(id(config))
    if limit is None:
        fb = config["feedback"]
        limit = _LIMITS[id(config)] = RateLimit(fb["rate_per_s"], fb["burst"])
    return limit


async def _run(fn: Any, *args: Any, what: str = "the prediction log", path: str = "") -> Any:
    """fn(*args) off the IOLoop; a failed durable write (disk full, I/O error)
    answers 507 insufficient_storage or 503 store_unavailable, nothing stored."""
    try:
        return await IOLoop.current().run_in_executor(_POOL, fn, *args)
    except (OSError, sqlite3.Error) as exc:
        raise service_error(storage_error(what, path, as_oserror(exc))) from None


def _label(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ApiError(400, "invalid_field", f"{where} must be a string")
    label = str(value).strip()
    if not label:
        raise ApiError(400, "invalid_field", f"{where} is empty")
    if len(label) > MAX_LABEL_CHARS:
        raise ApiError(400, "invalid_field", f"{where} has {len(label)} characters; the "
                                             f"limit is {MAX_LABEL_CHARS}")
    try:
        label.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "invalid_field", f"{where} is not valid Unicode") from None
    if is_label_set(label):  # would read back as a label set (state/dataset.py)
        raise ApiError(400, "invalid_field", f"{where} {label!r} is written as a JSON list, "
                                             "which is how label sets are stored; a "
                                             "single-label model takes a plain label")
    return label


def _label_set(value: Any, where: str) -> list[str]:
    """One text's label set: a list of labels, sorted and distinct; [] (the text
    truly has none of the model's labels) is allowed."""
    if not isinstance(value, list):
        raise ApiError(400, "invalid_field", f"{where} must be a list of labels (a label set; "
                                             "[] for a text with no label)")
    out = set()
    for i, x in enumerate(value):
        if isinstance(x, list):
            raise ApiError(400, "invalid_field", f"{where[:-1]}[{i}]' must be a label, not a "
                                                 "list")
        inner = f"{where[:-1]}[{i}]'" if where.endswith("'") else f"{where}[{i}]"
        out.add(_label(x, inner))
    return sorted(out)


def _meta_of(sup: Any, name: str, version: Any, cache: dict[tuple[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """What feedback needs of a version of a model (its meta.json): the labels it
    knows, multi_label, thresholds, min_labels; blocking. Latest when version is
    None."""
    v = version
    if version is None:  # the latest: resolved each time (a retraining adds versions)
        try:
            v = sup.store.resolve(name)[0]
        except Exception:
            v = None
    key = (name, v)
    if key not in cache:
        try:
            meta = sup.store.meta(name, int(v))
        except Exception:
            meta = {}
        if len(cache) > 512:
            cache.clear()
        cache[key] = {"labels": set(meta.get("labels") or []),
                      "multi_label": bool(meta.get("multi_label")),
                      "thresholds": dict(meta.get("thresholds") or {}),
                      "min_labels": int(meta.get("min_labels", 1))}
    return cache[key]


def _labels_of(sup: Any, name: str, version: Any, cache: dict[tuple[str, Any], dict[str, Any]]) -> set[str]:
    """The labels a version of a model knows (from its meta.json); blocking."""
    return _meta_of(sup, name, version, cache)["labels"]


_LABELS: dict[tuple[str, Any], dict[str, Any]] = {}


class FeedbackHandler(JsonHandler):
    """POST /feedback: true labels for logged predictions, or free examples."""

    guarded = True  # on the public port too: labels train models

    def _caller(self) -> str:
        auth = self.request.headers.get("Authorization", "")
        if self.authorized and auth:  # the key, not the address: one key, one budget
            return "key:" + hashlib.sha256(auth.encode()).hexdigest()[:16]
        return "addr:" + (self.request.remote_ip or "")

    async def post(self) -> None:
        wait = feedback_limit(self.cfg).take(self._caller())
        if wait:
            raise ApiError(429, "rate_limited",
                           f"too many feedback requests from this caller (feedback.rate_per_s: "
                           f"{self.cfg['feedback']['rate_per_s']:g}, burst "
                           f"{self.cfg['feedback']['burst']:g}); retry after {wait:.1f}s",
                           {"retry_after_s": round(wait, 3)},
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})
        data = self.json_object(FEEDBACK_FIELDS)
        plog = getattr(self.sup, "predlog", None)
        if plog is None or not plog.enabled:
            raise ApiError(409, "log_off", "the prediction log is off (predictions.log: false)")
        cap = self.cfg["feedback"]["max_items"]
        if "examples" in data or "model" in data:
            answer, model = await self._examples(data, plog, cap)
        else:
            answer, model = await self._on_predictions(data, plog, cap)
        policies = getattr(self.sup, "policies", None)
        if policies is not None and answer["stored"]:
            policies.labels_arrived(model)
        self.send_json(answer)

    async def _examples(self, data: dict[str, Any], plog: Any, cap: int
                        ) -> tuple[dict[str, Any], str]:
        extra = sorted(set(data) & {"request_id", "index", "label", "labels"})
        if extra or "model" not in data or "examples" not in data:
            raise ApiError(400, "bad_request", "free examples are {\"model\": name, "
                                               "\"examples\": [{\"text\", \"label\"}, ...]} "
                                               "(multi-label models: {\"text\", \"labels\": "
                                               "[...]})"
                           + (f"; not with {', '.join(extra)}" if extra else ""))
        name = data["model"]
        if not isinstance(name, str):
            raise ApiError(400, "invalid_field", "'model' must be a model name")
        examples = data["examples"]
        if not isinstance(examples, list) or not examples:
            raise ApiError(400, "invalid_field", "'examples' must be a non-empty list")
        if len(examples) > cap:
            raise ApiError(413, "too_many_items", f"'examples' has {len(examples)} items; "
                                                  f"the limit is {cap} (feedback.max_items)")

        def lookup() -> dict[str, Any]:
            try:
                self.sup.store.resolve(name)
            except (NotFound, InvalidName):
                raise ApiError(404, "not_found", f"no model named {name!r} in the store") from None
            return _meta_of(self.sup, name, None, _LABELS)
        info = await _run(lookup)
        multi = info["multi_label"]
        key = "labels" if multi else "label"
        pairs: list[tuple[str, Any]] = []  # (text, label) or (text, label set)
        for i, ex in enumerate(examples):
            where = f"'examples[{i}]'"
            if not isinstance(ex, dict) or set(ex) - {"text", key} or key not in ex:
                other = "label" if multi else "labels"
                raise ApiError(400, "invalid_field", f"{where} must be {{\"text\", \"{key}\"}}"
                               + (f": model {name!r} is "
                                  + ("multi-label (a label set per text)" if multi else
                                     "single-label (one label per text)")
                                  if isinstance(ex, dict) and other in ex else ""))
            text = ex.get("text")
            if not isinstance(text, str) or not text.strip():
                raise ApiError(400, "invalid_field", f"{where}.text must be a non-empty string")
            if len(text) > self.limits["max_text_chars"]:
                raise ApiError(422, "text_too_long", f"{where}.text has {len(text)} characters;"
                                                     f" the limit is "
                                                     f"{self.limits['max_text_chars']}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "bad_text", f"{where}.text is not valid Unicode") from None
            pairs.append((text, _label_set(ex["labels"], f"{where[:-1]}.labels'") if multi
                          else _label(ex.get("label"), f"{where}.label")))

        def store() -> dict[str, Any]:
            known = info["labels"]
            if multi:
                new = sorted({x for _, labs in pairs for x in labs if x not in known})
                stored = [(text, encode_label_set(labs)) for text, labs in pairs]
                # the log's new-label rows: a set with any new label
                plog.add_examples(name, stored, [enc for (_, labs), (_, enc) in
                                                 zip(pairs, stored) if set(labs) - known]
                                  ).result(30)
                items = [{"index": i, "labels": labs, "new_label": bool(set(labs) & set(new))}
                         for i, (_, labs) in enumerate(pairs)]
            else:
                new = sorted({lab for _, lab in pairs if lab not in known})
                plog.add_examples(name, pairs, new).result(30)
                items = [{"index": i, "label": lab, "new_label": lab in new}
                         for i, (_, lab) in enumerate(pairs)]
            out = {"model": name, "stored": len(pairs), "new_labels": new,
                   "new_label": bool(new), "items": items}
            if multi:
                out["multi_label"] = True
            return out
        return await _run(store, path=getattr(plog, "path", "")), name

    async def _on_predictions(self, data: dict[str, Any], plog: Any, cap: int
                              ) -> tuple[dict[str, Any], str]:
        if "request_id" not in data:
            raise ApiError(400, "missing_field", "'request_id' is required (or 'model' and "
                                                 "'examples' for labels without a prediction)")
        rid = check_id(data["request_id"], "'request_id'")
        if ("label" in data) == ("labels" in data):
            raise ApiError(400, "bad_request", "give exactly one of 'label' (one text, or "
                                               "with 'index') or 'labels' (the whole batch; "
                                               "for a multi-label model: a label set)")
        index = None
        if "index" in data:
            index = int_field(data, "index", minimum=0, maximum=10**6)
        # checks that hold for either kind of model, before the request is looked up
        if "label" in data:
            _label(data["label"], "'label'")
        else:
            labels = data["labels"]
            if not isinstance(labels, list):
                raise ApiError(400, "invalid_field", "'labels' must be a list")
            if len(labels) > cap:
                raise ApiError(413, "too_many_items", f"'labels' has {len(labels)} items; "
                                                      f"the limit is {cap}")
            if any(isinstance(x, list) for x in labels):
                if not all(isinstance(x, list) for x in labels):
                    raise ApiError(400, "invalid_field",
                                   "'labels' must be one label set (a list of labels) or, for "
                                   "the whole batch, a list of label sets; not a mix")
                for i, x in enumerate(labels):
                    _label_set(x, f"'labels[{i}]'")
            else:
                for i, x in enumerate(labels):
                    _label(x, f"'labels[{i}]'")

        def store() -> dict[str, Any]:
            rows = plog.get(rid)
            if not rows:  # maybe still queued for the writer
                plog.flush(30)
                rows = plog.get(rid)
            if not rows:
                if data.get("labels") == []:  # not a batch's labels; a set only if multi-label
                    raise ApiError(400, "invalid_field",
                                   "'labels' must be a non-empty list (the batch's labels), or "
                                   f"a multi-label model's empty label set; request id {rid!r} "
                                   "is not in the prediction log")
                raise ApiError(404, "unknown_request_id",
                               f"no logged prediction has request id {rid!r}",
                               {"request_id": rid})
            info = _meta_of(self.sup, rows[0]["model"], rows[0]["version"], _LABELS)
            if info["multi_label"]:
                return self._store_sets(rid, rows, data, index, info, plog)
            if "labels" in data:
                if "index" in data:
                    raise ApiError(400, "bad_request", "'index' goes with 'label', not 'labels'")
                if not data["labels"] or isinstance(data["labels"][0], list):
                    raise ApiError(400, "invalid_field",
                                   "'labels' must be a non-empty list of labels, one per text "
                                   f"(model {rows[0]['model']!r} is single-label: no label sets)")
                wanted = [_label(x, f"'labels[{i}]'") for i, x in enumerate(data["labels"])]
                if len(wanted) != len(rows):
                    raise ApiError(400, "wrong_length",
                                   f"'labels' has {len(wanted)} items; request {rid} had "
                                   f"{len(rows)} texts", {"expected": len(rows)})
                targets = list(zip(rows, wanted))
            else:
                wanted = [_label(data["label"], "'label'")]
                targets = self._one(rid, rows, index, wanted[0])
            items, batch = [], []
            for row, label in targets:
                known = _labels_of(self.sup, row["model"], row["version"], _LABELS)
                new = bool(known) and label not in known
                batch.append((rid, row["index"], label, row["model"], row["version"],
                              row["text"], row["label"], new))
                items.append({"request_id": rid, "index": row["index"], "label": label,
                              "predicted": row["label"], "correct": label == row["label"],
                              "new_label": new})
            plog.add_feedback_many(batch).result(30)
            model = {"name": rows[0]["model"], "version": rows[0]["version"]}
            out = {"request_id": rid, "model": model, "stored": len(items),
                   "new_label": any(i["new_label"] for i in items), "items": items}
            if len(items) == 1:
                out.update({k: items[0][k] for k in ("index", "label", "predicted", "correct")})
            return out
        answer = await _run(store, path=getattr(plog, "path", ""))
        return answer, answer["model"]["name"]

    @staticmethod
    def _one(rid: str, rows: list[dict[str, Any]], index: int | None, value: Any
             ) -> list[tuple[dict[str, Any], Any]]:
        """The (row, truth) of a feedback on one text: the request's only text, or
        the one at `index`."""
        if index is None:
            if len(rows) != 1:
                raise ApiError(400, "missing_field",
                               f"request {rid} had {len(rows)} texts: give 'index' "
                               "(0-based) or 'labels' for all of them")
            return [(rows[0], value)]
        hit = [r for r in rows if r["index"] == index]
        if not hit:
            raise ApiError(404, "unknown_index", f"request {rid} has no text at index "
                                                 f"{index} (it had {len(rows)})",
                           {"request_id": rid, "index": index})
        return [(hit[0], value)]

    def _store_sets(self, rid: str, rows: list[dict[str, Any]], data: dict[str, Any],
                    index: int | None, info: dict[str, Any], plog: Any) -> dict[str, Any]:
        """Feedback on a multi-label version's predictions: a label set per text
        (blocking: runs on the loop executor)."""
        name = rows[0]["model"]
        if "label" in data:
            raise ApiError(400, "invalid_field",
                           f"model {name!r} is multi-label: give 'labels': [...] (the text's "
                           "label set; [] for none), not 'label'")
        labels = data["labels"]
        batch_form = bool(labels) and all(isinstance(x, list) for x in labels)
        if batch_form and index is None:
            if len(labels) != len(rows):
                raise ApiError(400, "wrong_length",
                               f"'labels' has {len(labels)} label sets; request {rid} had "
                               f"{len(rows)} texts", {"expected": len(rows)})
            targets = [(row, _label_set(x, f"'labels[{i}]'"))
                       for i, (row, x) in enumerate(zip(rows, labels))]
        elif batch_form:
            raise ApiError(400, "invalid_field", "with 'index', 'labels' is that text's label "
                                                 "set (a list of labels), not a list of sets")
        else:
            targets = self._one(rid, rows, index, _label_set(labels, "'labels'"))
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
        plog.add_feedback_many(batch).result(30)
        out = {"request_id": rid, "model": {"name": name, "version": rows[0]["version"]},
               "multi_label": True, "stored": len(items),
               "new_label": any(i["new_label"] for i in items), "items": items}
        if len(items) == 1:
            out.update({k: items[0][k] for k in ("index", "labels", "predicted", "correct")})
        return out


def _top(scores: dict[str, float]) -> list[dict[str, Any]]:
    return [{"label": k, "score": v}
            for k, v in sorted(scores.items(), key=lambda kv: kv[1], reverse=True)]


class ReviewHandler(JsonHandler):
    """GET /models/<name>/review?limit=50&strategy=uncertain|random"""

    async def get(self, name: str) -> None:
        args = {k: self.get_query_argument(k) for k in self.request.query_arguments}
        unknown = sorted(set(args) - {"limit", "strategy"})
        if unknown:
            raise ApiError(400, "unknown_field", f"unknown query argument(s) {unknown}; "
                                                 "allowed: limit, strategy")
        try:
            limit = int(args.get("limit", "50"))
        except ValueError:
            raise ApiError(400, "invalid_field", "'limit' must be an integer") from None
        if not 1 <= limit <= MAX_REVIEW:
            raise ApiError(400, "invalid_field", f"'limit' must be between 1 and {MAX_REVIEW}")
        strategy = args.get("strategy", "uncertain")
        if strategy not in STRATEGIES:
            raise ApiError(400, "invalid_field", f"'strategy' must be one of "
                                                 f"{', '.join(STRATEGIES)}")
        plog = self.sup.predlog

        def read() -> list[dict[str, Any]]:
            try:
                self.sup.store.resolve(name)
            except (NotFound, InvalidName):
                raise ApiError(404, "not_found", f"no model named {name!r} in the store") from None
            plog.flush(10)  # what was answered before this request is in the queue
            rows = plog.review(name, limit, strategy)
            for r in rows:  # a multi-label version: the set it answered, rebuilt
                info = _meta_of(self.sup, name, r["version"], _LABELS)
                if info["multi_label"]:
                    r["labels"] = predicted_set(r["scores"] or {}, info["thresholds"],
                                                info["min_labels"], r["label"])
            return rows
        rows = await _run(read)
        items = [{"request_id": r["request_id"], "index": r["index"], "text": r["text"],
                  "label": r["label"], "top": _top(r["scores"]),
                  "score": max(r["scores"].values()) if r["scores"] else None,
                  "margin": r["margin"], "version": r["version"], "at": r["at"],
                  **({"labels": r["labels"]} if "labels" in r else {})}
                 for r in rows]
        self.send_json({"model": name, "strategy": strategy, "count": len(items),
                        "items": items})


class PolicyHandler(JsonHandler):
    """GET/PUT/DELETE /models/<name>/policy: the model's retrain policy."""

    async def _known(self, name: str) -> None:
        def check() -> None:
            try:
                self.sup.store.resolve(name)
            except (NotFound, InvalidName):
                raise ApiError(404, "not_found", f"no model named {name!r} in the store") from None
        await _run(check)

    async def get(self, name: str) -> None:
        await self._known(name)
        self.send_json(self.sup.policies.describe(name))

    async def put(self, name: str) -> None:
        from control.policies import PolicyError

        data = self.json_body()
        await self._known(name)
        try:
            await _run(self.sup.policies.put, name, data, what=f"the policy of {name}",
                       path=getattr(self.sup.policies, "path", ""))
        except PolicyError as exc:
            raise ApiError(400, "invalid_policy", str(exc)) from None
        self.send_json(self.sup.policies.describe(name))
        self.sup.policies.labels_arrived(name)  # labels may be waiting already

    async def delete(self, name: str) -> None:
        await self._known(name)
        removed = await _run(self.sup.policies.delete, name, what=f"the policy of {name}",
                             path=getattr(self.sup.policies, "path", ""))
        self.send_json({**self.sup.policies.describe(name), "removed": removed})


class _Erasure(JsonHandler):
    """Erasure of logged texts; the answer says what was removed, and the
    history records the erasure (not the texts)."""

    def _log(self) -> Any:
        plog = getattr(self.sup, "predlog", None)
        if plog is None:
            raise ApiError(409, "log_off", "the service keeps no prediction log")
        return plog

    def _record(self, model: str | None, answer: dict[str, Any]) -> None:
        state = getattr(self.sup, "state", None)
        if state is None:
            return
        try:
            state.add_history(model, "erase", source="api", details=answer)
        except Exception as exc:  # the erasure is done; its record is what failed
            log.error("cannot record an erasure in the history: %s", exc)


class RequestErasureHandler(_Erasure):
    """DELETE /predictions/<request_id>: one request's texts erased from the
    log (what is still queued for its writer too), from the feedback on it and
    from the model's free examples with those texts."""

    async def delete(self, request_id: str) -> None:
        plog = self._log()
        rid = check_id(request_id, "the request id")
        removed = await _run(plog.erase, rid, what="the prediction log",
                             path=getattr(plog, "path", ""))
        answer = {"request_id": rid, "removed": removed}
        self._record(None, answer)
        self.send_json(answer)


class ModelErasureHandler(_Erasure):
    """DELETE /models/<name>/predictions: a model's whole log, feedback and
    free examples."""

    async def delete(self, name: str) -> None:
        plog = self._log()
        model = name_of(name)
        removed = await _run(plog.purge, model, what="the prediction log",
                             path=getattr(plog, "path", ""))
        answer = {"model": model, "removed": removed}
        self._record(model, answer)
        self.send_json(answer)


def name_of(value: Any) -> str:
    from state.store import check_name
    try:
        return check_name(value)
    except InvalidName as exc:
        raise ApiError(400, "invalid_name", str(exc)) from None


def inference_routes(kw: dict[str, Any], config: Any) -> list[Any]:
    return [(r"/feedback", FeedbackHandler, kw)]  # kw's auth: the feedback key


def management_routes(kw: dict[str, Any]) -> list[Any]:
    return [(r"/models/([^/]+)/review", ReviewHandler, kw),
            (r"/models/([^/]+)/policy", PolicyHandler, kw),
            (r"/predictions/([^/]+)", RequestErasureHandler, kw),
            (r"/models/([^/]+)/predictions", ModelErasureHandler, kw)]

