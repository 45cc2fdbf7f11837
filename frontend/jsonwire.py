"""JSON on the request path: orjson where it gives the standard library's answer.

    loads(raw)  the value of a JSON document (bytes), or the exception
                json.loads(raw) raises for it
    loads_utf8(raw)  ... of json.loads(raw.decode("utf-8")) (a request body
                that frontend/base.py parse_json has checked is UTF-8)
    dumps(obj)  an answer's bytes: the value json.dumps(obj, ensure_ascii=False,
                allow_nan=False).encode() writes, or the exception it raises

orjson (Rust) parses and writes several times faster than the standard
library (docs/benchmarks.md "JSON"). Where the two could differ, the standard
library decides, so that every request gets the answer and every bad body the
error it got before:

- parsing: orjson refuses what the standard library also refuses, and some
  things it accepts (NaN and Infinity, lone surrogate escapes, numbers beyond
  a double); orjson reads an integer beyond 64 bits as a float. Any body
  orjson refuses, and any whose value holds a float of 2**63 or more, is
  parsed again by the standard library, which gives the value or the error (bad UTF-8, bad JSON,
  a RecursionError for deep nesting) exactly as before.
- writing: key order is the dict's, as before; text is written as UTF-8
  (ensure_ascii=False: Chinese as it is, control characters as \\u escapes);
  a value orjson cannot write (a lone surrogate, an integer beyond 64 bits,
  a non-string key) goes to the standard library, which writes it or raises
  as before. orjson writes NaN and infinities as null: an answer holding a
  null is checked by the standard library, which raises ValueError for them.
- the text differs in two ways, the values not at all: no spaces after `,`
  and `:` ({"a":1} where the standard library wrote {"a": 1}), and a float
  below 1e-4 or at least 1e16 may print in another but equal form (3.2e-05
  is written 0.000032, 1e-07 as 1e-7); both read back as the same double.

TEXTSWAP_JSON=stdlib in the environment turns orjson off (the standard
library throughout): bench/serving.py measures the two.
"""
from __future__ import annotations

import json
import os
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - the lock installs it
    orjson = None  # type: ignore[assignment]

ENABLED = orjson is not None and os.environ.get("TEXTSWAP_JSON", "") != "stdlib"

_BIG = 2.0 ** 63  # orjson reads an integer beyond 64 bits as a float (at least this)


def _big_float(v: Any) -> bool:
    """Whether `v` holds a float of at least 2**63 in size: perhaps an integer
    that orjson read as a float (the standard library reads it as an int)."""
    t = type(v)
    if t is float:
        return abs(v) >= _BIG or v != v
    if t is dict:
        v = v.values()
    elif t is not list:
        return False
    for x in v:
        tx = type(x)
        if tx is not str and tx is not int and tx is not bool and x is not None \
                and _big_float(x):
            return True
    return False


def _fast(raw: bytes) -> tuple[bool, Any]:
    if ENABLED:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the standard library says what is wrong, or accepts it
        else:
            if not _big_float(value):
                return True, value
    return False, None


def loads(raw: bytes) -> Any:
    """json.loads(raw) (bytes: UTF-8, -16 or -32), faster; same value, same exceptions."""
    done, value = _fast(raw)
    return value if done else json.loads(raw)


def loads_utf8(raw: bytes) -> Any:
    """json.loads(raw.decode("utf-8")), faster; same value, same exceptions."""
    done, value = _fast(raw)
    return value if done else json.loads(raw.decode("utf-8"))


def dumps(obj: Any) -> bytes:
    """json.dumps(obj, ensure_ascii=False, allow_nan=False).encode(), faster
    (compact separators; see above)."""
    if ENABLED:
        try:
            out = orjson.dumps(obj)
        except TypeError:  # orjson.JSONEncodeError: the standard library decides
            pass
        else:
            if b"null" in out:  # a None, or a NaN or infinity written as null
                json.dumps(obj, allow_nan=False)  # raises ValueError for the latter
            return out
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode()
