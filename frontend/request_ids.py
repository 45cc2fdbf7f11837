"""Request ids (docs/loop.md): the client's X-Request-Id, checked, or a new
one. The predict pipeline (frontend/pipeline.py) gives every logged answer
one and logs it under it; feedback and erasure name it.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any

from tornado.ioloop import IOLoop

from control.feedback import ID_RE
from frontend.base import ApiError

if TYPE_CHECKING:
    from state.predlog_api import PredictionLogBackend

log = logging.getLogger("textswap.http")

HEADER = "X-Request-Id"
_PREFIX = os.urandom(4).hex()  # this process's ids, apart from other restarts and nodes
CLIENT_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")  # what a client may choose
HELD = 100_000  # client-chosen ids kept in memory (the log is asked about older ones)


def new_id() -> str:
    """8 hex digits of this process, the time in ms (modulo 10**10) as 10
    digits, then 96 random bits as 24 hex digits: unguessable, and the
    prediction log finds the answer by the time (state/predlog_writer.py id_ms)."""
    return f"{_PREFIX}{int(time.time() * 1000) % 10**10:010d}{os.urandom(12).hex()}"


def check_id(value: Any, what: str = f"the {HEADER} header") -> str:
    """A client's id (at most 64 characters), or one a route names: a logged id,
    which may carry a key's namespace in front (at most 80)."""
    header = what.endswith("header")
    if not isinstance(value, str) or not (CLIENT_RE if header else ID_RE).match(value):
        raise ApiError(400, "invalid_request_id",
                       f"{what} must be 1 to {64 if header else 80} characters of "
                       "A-Z a-z 0-9 . _ : -")
    return value


def key_namespace(headers: Any) -> str | None:
    """The namespace of the ids a client chooses while a predict key is set:
    8 hex digits of the hash of the key it sent (None: no key sent)."""
    auth = headers.get("Authorization", "") if headers is not None else ""
    token = auth.partition(" ")[2].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:8] if token else None


def request_id(headers: Any, fallback: Any = None, namespace: str | None = None) -> str:
    """The request's id: the client's X-Request-Id (checked: 400 when malformed),
    else `fallback` when it is a valid id (the OIP body's "id"), else a new one.
    A client's id is put in its key's namespace, "<namespace>:<id>", when given."""
    given = headers.get(HEADER) if headers is not None else None
    if given is not None:
        return f"{namespace}:{check_id(given)}" if namespace else check_id(given)
    if isinstance(fallback, str) and CLIENT_RE.match(fallback):
        return f"{namespace}:{fallback}" if namespace else fallback
    return new_id()


def chosen(headers: Any, fallback: Any = None) -> str | None:
    """Who chose the request's id: "header" (X-Request-Id), "body" (the OIP
    body's "id"), or None (the service: request_id made one)."""
    if headers is not None and headers.get(HEADER) is not None:
        return "header"
    if isinstance(fallback, str) and CLIENT_RE.match(fallback):
        return "body"
    return None


class ClientIds:
    """The ids clients chose, each answered once (docs/loop.md "Request ids"):
    an id already used (by this service since its start, up to HELD ids, or
    found in the prediction log) is taken. Held on the IOLoop before the log is
    asked, so two requests racing with one id cannot both have it; a request
    that is not answered gives its id back (a retry after a 503 may use it)."""

    def __init__(self, predlog: "PredictionLogBackend", cap: int = HELD) -> None:
        self.predlog, self.cap = predlog, cap
        self._held: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self._unreadable = False  # the log could not be asked: said once

    async def claim(self, rid: str) -> bool:
        """True: the id is this request's now; False: it was used before."""
        if rid in self._held:
            return False
        self._held[rid] = None
        if len(self._held) > self.cap:
            self._held.popitem(last=False)
        try:
            found = await IOLoop.current().run_in_executor(None, self.predlog.get, rid, 0)
        except Exception as exc:  # the log is down: the ids held in memory still count
            if not self._unreadable:
                self._unreadable = True
                log.warning("cannot look up request ids in the prediction log (%s): only "
                            "the ids used since the start are refused", exc)
            return True
        self._unreadable = False
        return not found

    def release(self, rid: str) -> None:
        self._held.pop(rid, None)
