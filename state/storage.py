"""Durable writes off the IOLoop, and the storage health they report.

Every write of serving state (the applied record, golden sets, policies)
goes through `Storage.write`: it runs in one writer thread (so writes keep
their order and the IOLoop never waits on an fsync), and an `OSError`
becomes `StorageFailed`: 507 `insufficient_storage` when the disk is full
(ENOSPC, EDQUOT), 503 `store_unavailable` for any other I/O error, with what
failed and where. The caller has changed nothing yet (persist, then
switch), so a refused write leaves the service as it was.

`health()` is what /status and /metrics show: the last write error of each
target (kept until a later write of that target succeeds) and the free space of the model store.
Writers report from several threads (the durable-write thread, the state
database's, the prediction log's sender, the cluster threads) while the IOLoop
reads: the figures are changed and read under one lock.
"""
from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Protocol

from tornado.ioloop import IOLoop

from state.errors import StorageFailed

log = logging.getLogger("textswap.storage")

FULL = {errno.ENOSPC, errno.EDQUOT}


def storage_error(what: str, path: str, exc: OSError) -> StorageFailed:
    """The client-facing error for a failed write of `what` at `path`."""
    full = exc.errno in FULL
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    return StorageFailed(
        f"could not write {what} ({path}): {why}; nothing changed",
        status=507 if full else 503, code="insufficient_storage" if full else "store_unavailable",
        details={"what": what, "path": path, "errno": exc.errno,
                 "errno_name": errno.errorcode.get(exc.errno or 0)})


class Health(Protocol):
    """Where a writer reports its outcomes (the state db, the prediction
    log); `Storage` shows them as the storage health."""

    def failed(self, what: str, path: str, exc: OSError) -> None: ...

    def succeeded(self, what: str) -> None: ...


class Storage:
    """One writer thread for the service's durable writes; storage health."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="durable-write")
        self._lock = threading.Lock()  # guards the four figures below
        self.errors: dict[str, dict[str, Any]] = {}  # what -> its last failure, until it works
        self.last_ok: float | None = None
        self.writes = 0
        self.failures = 0

    async def write(self, what: str, path: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) in the writer thread; OSError -> StorageFailed."""
        try:
            out = await IOLoop.current().run_in_executor(self._pool, fn, *args)
        except OSError as exc:
            self.failed(what, path, exc)
            raise storage_error(what, path, exc) from None
        self.succeeded(what)
        return out

    def run(self, what: str, path: str, fn: Callable[..., Any], *args: Any) -> Any:
        """The same in the caller's thread (already off the IOLoop)."""
        try:
            out = fn(*args)
        except OSError as exc:
            self.failed(what, path, exc)
            raise storage_error(what, path, exc) from None
        self.succeeded(what)
        return out

    def failed(self, what: str, path: str, exc: OSError) -> None:
        entry = {"what": what, "path": path, "errno": exc.errno,
                 "errno_name": errno.errorcode.get(exc.errno or 0),
                 "message": str(exc), "at": time.time()}
        with self._lock:
            self.failures += 1
            self.errors[what] = entry
        log.error("durable write failed: %s (%s): %s", what, path, exc)

    @property
    def last_error(self) -> dict[str, Any] | None:
        """The newest failure among the targets that have not written since."""
        with self._lock:
            errors = list(self.errors.values())
        return max(errors, key=lambda e: e["at"]) if errors else None

    def succeeded(self, what: str) -> None:
        with self._lock:
            self.writes += 1
            self.last_ok = time.time()
            gone = self.errors.pop(what, None)
        if gone is not None:
            log.info("writes of %s work again (last error: %s)", what, gone["message"])

    def free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None

    def health(self) -> dict[str, Any]:
        with self._lock:  # one consistent view of the figures
            errors = sorted(self.errors.values(), key=lambda e: e["at"])
            last_ok, writes, failures = self.last_ok, self.writes, self.failures
        return {"ok": not errors, "last_error": errors[-1] if errors else None,
                "failing": sorted(e["what"] for e in errors), "errors": errors,
                "last_ok_at": last_ok, "free_bytes": self.free_bytes(),
                "writes": writes, "failures": failures}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
