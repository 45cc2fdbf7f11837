"""The watcher thread: follows the applied-model record on disk.

When another process or an operator rewrites ``<models_dir>/.applied.json``,
the service must swap to it exactly as ``POST /apply`` does. The thread only
looks at the file (stat, and a read when it changed) and posts
``on_change(record)`` to the IOLoop when the slot map or the default
changed; the supervisor then applies, resizes or unloads name by name. It
touches no other state (rule 2: one owner). Polling a stat every ``interval`` seconds is cheap,
portable, and works on network filesystems where inotify does not.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from typing import TYPE_CHECKING, Callable, Mapping

from tornado.ioloop import IOLoop

from state.store import ModelStore, StoreError

if TYPE_CHECKING:
    from control.serving import AppliedRecord

log = logging.getLogger("textswap.watcher")


class RecordWatcher:
    def __init__(self, store: ModelStore, loop: IOLoop, interval: float,
                 on_change: Callable[["AppliedRecord"], object]) -> None:
        self.store = store
        self.loop = loop
        self.interval = interval
        self.on_change = on_change
        self._stop = threading.Event()
        self._last_stat: tuple[int, int, int] | None = None
        self._last_seen: dict[str, object] | None = None
        # the service's own recent writes (revision, content): a read that lands
        # between two of them (an unload, then an apply) sees the older one,
        # which is not an operator's change to follow
        self._own: collections.deque[tuple[object, dict[str, object] | None]] = \
            collections.deque(maxlen=16)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="record-watcher", daemon=True)

    def start(self, current: "AppliedRecord | None") -> None:
        """Start watching; ``current`` is what the service serves already."""
        self._last_seen = _content(current)
        self._last_stat = self._stat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.store.record_path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # the watcher must outlive any odd file state
                log.exception("watcher check failed")

    def check(self) -> None:
        st = self._stat()
        if st == self._last_stat:
            return
        self._last_stat = st
        if st is None:
            return  # record removed: keep serving what we serve
        try:
            rec = self.store.read_record()
        except StoreError as exc:
            log.error("ignoring applied-model record: %s", exc)
            return
        if rec is None:
            return
        wanted = _content(rec)
        with self._lock:
            if wanted == self._last_seen or (rec.get("revision"), wanted) in self._own:
                return
            self._last_seen = wanted
        log.info("applied-model record changed on disk: default %s, models %s",
                 rec["default"], {n: e["version"] for n, e in rec["models"].items()})
        self.loop.add_callback(self.on_change, rec)

    def note_record(self, record: "AppliedRecord") -> None:
        """The service wrote the record itself: not a change to act on."""
        with self._lock:
            self._last_seen = _content(record)
            self._own.append((record.get("revision"), self._last_seen))


def _content(record: "Mapping[str, object] | None") -> dict[str, object] | None:
    """What a change is judged on: the slot map and the default, not the revision."""
    if record is None:
        return None
    return {"default": record.get("default"), "models": record.get("models")}
