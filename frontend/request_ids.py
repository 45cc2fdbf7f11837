"""Request ids (docs/loop.md): the client's X-Request-Id, checked, or a new
one. The predict pipeline (frontend/pipeline.py) gives every logged answer
one and logs it under it; feedback and erasure name it.
"""
from __future__ import annotations

import os
import time
from typing import Any

from control.feedback import ID_RE
from frontend.base import ApiError

HEADER = "X-Request-Id"
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
