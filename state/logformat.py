"""The supervisor's log output: text lines (the default, for a terminal) or
one JSON object a line on stdout (`log_format: json`, `--log-format json`),
for log collectors such as Loki or Elasticsearch.

    {"time": "2026-12-06T13:40:00.123Z", "level": "INFO",
     "logger": "textswap.supervisor", "message": "...", "request_id": "..."}

`request_id` is there when the record has one (the HTTP access log's
refusals of a request that carried one); a traceback goes into `exc_info`.
The lines the processes that import TensorFlow write to their stderr are
relayed as JSON objects too (control/childlog.py, `child_line`).
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": _utc(record.created), "level": record.levelname,
                               "logger": record.name, "message": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


_json = False
# a child's own record: "2026-12-06 13:40:00,123 INFO name: message"
_CHILD = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def setup(level: str, fmt: str) -> None:
    """The root logger's one handler: text to stderr, or JSON to stdout."""
    global _json
    _json = fmt == "json"
    if _json:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level, handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level, format=TEXT_FORMAT)


def json_on() -> bool:
    return _json


def child_line(name: str, line: str) -> str:
    """A line a child process wrote to its stderr, as a JSON log line: its
    level when it is one of the child's log records (else ERROR: a traceback
    or a crash's words), the child's name as its logger."""
    m = _CHILD.match(line)
    return json.dumps({"time": _utc(time.time()), "level": m.group(1) if m else "ERROR",
                       "logger": f"textswap.child.{name}", "message": line},
                      ensure_ascii=False)
