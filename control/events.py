"""Service events (apply, unload, crash, restart, recycle...) for whoever listens.

The supervisor emits an event where it happens, on the IOLoop; listeners
(the history store, metrics, the log of the dashboard) subscribe without the
supervisor knowing them. A listener that raises is logged and skipped: an
event never breaks the action that caused it. Listeners must be quick; any
disk work goes to their own writer thread.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger("textswap.events")

Listener = Callable[[str, dict[str, object]], None]


class Events:
    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def emit(self, kind: str, **fields: Any) -> None:
        fields.setdefault("at", time.time())
        for fn in self._listeners:
            try:
                fn(kind, fields)
            except Exception:
                log.exception("event listener failed on %s", kind)
