"""Request ids and the prediction log, for every predict path (docs/loop.md).

Called by the lean path (fastpath.py), PredictHandler (handlers.py) and the
Open Inference Protocol's infer (oip.py), each with two small calls:

    rid = request_id(headers)            # the client's X-Request-Id, or a new one (400 if bad)
    log_predictions(sup, rid, texts, payload)   # payload["request_id"] = rid; rows to the log

Logging costs the request path one msgpack call and a queue put
(state/predlog.py: a writer process stores them).
"""
from __future__ import annotations

import os
import random
import re
import time
from typing import Any

from frontend.base import ApiError

HEADER = "X-Request-Id"
ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")
_PREFIX = os.urandom(4).hex()  # this process's ids, apart from other restarts and nodes


def new_id() -> str:
    """8 hex digits of this process, the time in ms (modulo 10**10) as 10
    digits, then 96 random bits as 24 hex digits: unguessable, and the
    prediction log finds the answer by the time (state/predlog_writer.py id_ms)."""
    return f"{_PREFIX}{int(time.time() * 1000) % 10**10:010d}{os.urandom(12).hex()}"


def check_id(value: Any, what: str = f"the {HEADER} header") -> str:
    if not isinstance(value, str) or not ID_RE.match(value):
        raise ApiError(400, "invalid_request_id",
                       f"{what} must be 1 to 64 characters of A-Z a-z 0-9 . _ : -")
    return value


def request_id(headers: Any, fallback: Any = None) -> str:
    """The request's id: the client's X-Request-Id (checked: 400 when malformed),
    else `fallback` when it is a valid id (the OIP body's "id"), else a new one."""
    given = headers.get(HEADER) if headers is not None else None
    if given is not None:
        return check_id(given)
    if isinstance(fallback, str) and ID_RE.match(fallback):
        return fallback
    return new_id()


def _logging(sup: Any) -> Any:
    """The prediction log when this request is to be logged, else None."""
    plog = getattr(sup, "predlog", None)
    if plog is None or not plog.enabled:
        return None
    sample = sup.cfg["predictions"]["sample"]
    if sample < 1.0 and random.random() >= sample:
        return None
    return plog


RAW_MAX_LABELS = 32  # up to this many labels, a model's score rows are logged as they are


def _raw(scores: Any, labels: list[str]) -> bool:
    """Whether score rows can be logged as they are (few labels, plain lists)."""
    return (len(labels) <= RAW_MAX_LABELS and isinstance(scores, list)
            and (not scores or type(scores[0]) is list))


def log_predictions(sup: Any, rid: str, texts: list[str], payload: dict[str, Any],
                    raw: list[Any] | None = None) -> None:
    """Add the request id to a /predict answer and log its predictions.
    raw: (labels, score rows, k) as predictions.predict keeps them; logged
    instead of the prediction objects when the model has few labels (packing
    a float row costs a fraction of packing the objects built from it)."""
    payload["request_id"] = rid
    plog = _logging(sup)
    if plog is None:
        return
    model = payload["model"]
    if raw and _raw(raw[1], raw[0]):
        plog.add_scores(time.time(), rid, model["name"], model["version"], texts, *raw)
    else:
        plog.add_answer(time.time(), rid, model["name"], model["version"], texts,
                        payload["predictions"])


def log_scores(sup: Any, rid: str, texts: list[str], model: dict[str, Any],
               labels: list[str], scores: list[list[float]], keep: int = 5) -> None:
    """Log predictions from raw score rows (the OIP path): the best `keep` labels."""
    plog = _logging(sup)
    if plog is None:
        return
    now = time.time()
    if _raw(scores, labels):
        plog.add_scores(now, rid, model["name"], model["version"], texts, labels, scores,
                        min(keep, len(labels)))
        return
    rows = []
    for i, (t, row) in enumerate(zip(texts, scores)):
        order = sorted(range(len(labels)), key=row.__getitem__, reverse=True)[:keep]
        rows.append({"at": now, "request_id": rid, "index": i, "model": model["name"],
                     "version": model["version"], "text": t, "label": labels[order[0]],
                     "scores": {labels[j]: float(row[j]) for j in order}})
    plog.add(rows)
