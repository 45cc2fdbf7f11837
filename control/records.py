"""Where the applied record lives: a backend chosen once, at start.

`RecordBackend` is what the control plane asks of it: load the record at
start, persist each change (before the switch it describes), follow changes
made from outside, and the cluster-wide steps of an operator's apply. Two
implementations:

    FileRecords   <models_dir>/.applied.json, written durably off the IOLoop,
                  followed by the watcher thread (control/watcher.py)
    ClusterNode   the record in Redis, shared by every node (cluster/node.py)

supervisor.py picks one; nothing else knows which.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol, cast

from tornado.locks import Lock

from state.errors import ServiceError, StorageFailed
from state.storage import Storage
from state.store import ModelStore
from control.watcher import RecordWatcher
from tornado.ioloop import IOLoop

if TYPE_CHECKING:
    from control.serving import AppliedRecord, RecordEntry
    from control.servingctl import ServingController
    from state.config import WatcherSettings

log = logging.getLogger("textswap.supervisor")

OnChange = Callable[["AppliedRecord"], object]
KEEP: Any = object()  # commit(): leave this part of the record as it is


class RecordBackend(Protocol):
    wipe_tmp: bool  # the store's staging is this service's alone (start wipes it)

    async def load(self) -> "AppliedRecord | None":
        """The record to serve at start (StoreError: unreadable)."""

    def start(self, record: "AppliedRecord | None", on_change: OnChange) -> None:
        """Follow changes made from outside; on_change(record) on the IOLoop."""

    def stop(self) -> None:
        """Stop following."""

    async def close(self) -> None:
        """After the jobs stopped: the last writes out, then leave."""

    async def write(self, record: "AppliedRecord", changed: str | None, strict: bool) -> None:
        """Persist `record` (slot `changed` changed; None: any). Raises
        StorageFailed when it could not be written."""

    async def check(self) -> None:
        """Before an operator's change: raise when changes cannot be made now."""

    async def prepare_all(self, name: str, version: int | None, replicas: int,
                          partial: bool = False, mode: str | None = None) -> None:
        """Before an operator's apply: what must be ready elsewhere first."""

    async def after_change(self) -> dict[str, object] | None:
        """After a persisted change: what to add to the answer (None: nothing)."""

    def stale(self, name: str, version: int) -> bool:
        """A followed apply of (name, version) that a newer record superseded."""

    async def claim_demo(self) -> bool:
        """True where this service trains the first-start demo."""

    def status(self) -> dict[str, object] | None:
        """The backend's part of /status (None: nothing to say)."""

    async def overview(self) -> dict[str, object]:
        """GET /cluster: every node and what it serves (ServiceError: none)."""


class FileRecords:
    """The record in the store's .applied.json; the watcher follows it."""

    wipe_tmp = True

    def __init__(self, store: ModelStore, storage: Storage, loop: IOLoop,
                 watcher_cfg: "WatcherSettings") -> None:
        self.store, self.storage, self.loop = store, storage, loop
        self.watcher: RecordWatcher | None = None
        self._watch = bool(watcher_cfg.enabled)
        self._interval = float(watcher_cfg.interval)
        self._last: "AppliedRecord | None" = None  # the last record written or loaded

    async def load(self) -> "AppliedRecord | None":
        self._last = cast("AppliedRecord | None", self.store.read_record())  # normalized there
        return self._last

    def start(self, record: "AppliedRecord | None", on_change: OnChange) -> None:
        if self._watch:
            self.watcher = RecordWatcher(self.store, self.loop, self._interval, on_change)
            self.watcher.start(record)

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    async def close(self) -> None:
        return None

    async def write(self, record: "AppliedRecord", changed: str | None, strict: bool) -> None:
        watcher, before = self.watcher, self._last
        if watcher is not None:
            watcher.note_record(record)  # this service's own write: not a change to follow
        try:
            await self.storage.write("the applied-model record", self.store.record_path,
                                     self.store.write_record, record)
        except Exception:
            if strict and watcher is not None and before is not None:
                watcher.note_record(before)  # nothing changed
            raise
        self._last = record

    async def check(self) -> None:
        return None

    async def prepare_all(self, name: str, version: int | None, replicas: int,
                          partial: bool = False, mode: str | None = None) -> None:
        return None

    async def after_change(self) -> dict[str, object] | None:
        return None

    def stale(self, name: str, version: int) -> bool:
        return False

    async def claim_demo(self) -> bool:
        return True

    def status(self) -> dict[str, object] | None:
        return None

    async def overview(self) -> dict[str, object]:
        raise ServiceError("cluster mode is off (set cluster.redis_url)", 404, "not_found")


class RecordKeeper:
    """Persist, then switch: every change to what serves is written to the
    record backend before the switch it describes (the only writer of the
    applied record; applies, rollouts and recovery commit through it)."""

    def __init__(self, ctl: "ServingController", loop: IOLoop, records: RecordBackend) -> None:
        self.ctl, self.serving, self.loop, self.records = ctl, ctl.serving, loop, records
        self._commit_lock = Lock()
        self.dirty = False  # the last record write failed: the sweep tries again
        self._commits = 0  # commits running or waiting for the lock

    async def commit(self, changed: str | None, entry: Any = KEEP, *, default: Any = KEEP,
                     switch: Callable[[], None] | None = None, strict: bool = True) -> None:
        """Persist, then switch. The record as it will be (every slot as it
        serves, slot `changed` set to `entry` or removed when `entry` is None,
        the default set to `default`, a name or a function of no arguments
        giving it) is written durably, off the IOLoop; then `switch()` changes
        routing, in the same IOLoop step as the write's completion. Commits
        are serialized (each record is built from what the previous one left).

        strict (an operator's or a job's change): a failed write raises
        StorageFailed (507 disk full, 503 other I/O errors) and nothing
        switches. Not strict (the service's own moves: fallback, automatic
        rollback, a FAILED default): switch anyway, serving comes first, and
        the sweep writes the record again until a write succeeds."""
        self._commits += 1
        try:
            await self._commit(changed, entry, default=default, switch=switch, strict=strict)
        finally:
            self._commits -= 1

    async def _commit(self, changed: str | None, entry: Any = KEEP, *, default: Any = KEEP,
                      switch: Callable[[], None] | None = None, strict: bool = True) -> None:
        async with self._commit_lock:
            models: dict[str, RecordEntry] = {
                n: {"version": s.version, "replicas": s.wanted, "explicit": s.explicit}
                for n, s in sorted(self.serving.slots.items()) if s.version is not None}
            if changed is not None and entry is not KEEP:
                if entry is None:
                    models.pop(changed, None)
                else:
                    models[changed] = cast("RecordEntry", dict(entry))
            want = self.serving.default_name if default is KEEP else (
                default() if callable(default) else default)
            record: AppliedRecord = {"default": want if want in models else None,
                                     "models": dict(sorted(models.items())),
                                     "revision": self.serving.record.get("revision", 0) + 1}
            try:
                await self.records.write(record, changed, strict)
                self.dirty = False
            except StorageFailed:
                if strict:
                    raise
                self.dirty = True
                log.error("serving changed without a durable record: it is written again "
                          "once the store accepts writes")
            self.ctl.note_record(record)
            if switch is not None:
                switch()

    def save_later(self, changed: str | None = None) -> None:
        """After a switch the service made on its own (an automatic rollback):
        write the record as things serve now, without holding anything up."""
        self.loop.spawn_callback(self.commit, changed, strict=False)

    def retry_dirty(self) -> None:
        """From the sweep: a record that failed to write is written again."""
        if self.dirty and not self._commits:  # none running or waiting: it would write
            self.dirty = False  # set again by the commit if it fails again
            self.save_later()

