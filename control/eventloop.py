"""The supervisor's event loop: uvloop under Tornado where it imports, else asyncio's.

`server.event_loop` (config.yaml, or `--event-loop`) picks it:

    uvloop   (the default) uvloop's loop, on libuv, where the package imports;
             where it does not (not installed, an unsupported platform) the
             service starts on asyncio's own loop and logs why
    asyncio  asyncio's default loop (selector-based)

Tornado runs on any asyncio loop: `install` makes the chosen loop the current
one before the first `IOLoop.current()`, and that IOLoop wraps it. Nothing
else in the service depends on the loop's kind; bench/serving.py measures
the two (docs/benchmarks.md), and tests/test_service.py runs on both.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("textswap.supervisor")

CHOICES = ("uvloop", "asyncio")


def new_loop(choice: str) -> tuple[asyncio.AbstractEventLoop, str]:
    """A new event loop of the kind `choice` asks for, and the kind it is."""
    if choice not in CHOICES:
        raise ValueError(f"unknown event loop {choice!r}; one of {', '.join(CHOICES)}")
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError as exc:
            log.warning("server.event_loop is uvloop but it does not import (%s): "
                        "running on asyncio's loop", exc)
        else:
            return uvloop.new_event_loop(), "uvloop"
    return asyncio.new_event_loop(), "asyncio"


def install(choice: str) -> str:
    """Make a new loop of `choice` this thread's current one (before Tornado's
    IOLoop.current() wraps it); the kind installed, "uvloop" or "asyncio"."""
    loop, kind = new_loop(choice)
    asyncio.set_event_loop(loop)
    return kind


def running_kind() -> str:
    """The kind of the loop running in this thread: "uvloop" or "asyncio"."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
