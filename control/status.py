"""Status and history: what GET /status and GET /history read.

`StatusView` reads the serving state (slots, failures), the pool, the jobs
and the backends' health, and shapes /status; it writes only the durable history (events it is
subscribed to, handed to the state DB's writer thread).
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from state.predlog_api import PredictionLogBackend
    from state.statedb import StateDB
    from state.storage import Storage
    from state.store import ModelStore
    from control.jobs import JobManager
    from control.pool import WorkerPool
    from control.records import RecordBackend, RecordKeeper
    from control.serving import ServingState

log = logging.getLogger("textswap.supervisor")

# Events written to the durable history (GET /history)
HISTORY_KINDS = {"apply", "apply_failed", "rollback", "promote", "abort", "gate_refused",
                 "unload", "crash", "restart", "recycle", "failed", "shadow", "canary",
                 "probation_ended"}
_HISTORY_COLUMNS = {"name", "source", "from_version", "to_version", "version", "phases",
                    "reason", "details", "at"}


class StatusView:
    """Shapes /status; keeps the durable history."""

    def __init__(self, serving: "ServingState", store: "ModelStore", pool: "WorkerPool",
                 db: "StateDB", storage: "Storage", keeper: "RecordKeeper", jobs: "JobManager",
                 records: "RecordBackend", predlog: "PredictionLogBackend") -> None:
        self.serving, self.store, self.pool, self.db, self.storage = serving, store, pool, db, storage
        self.keeper, self.jobs, self.records, self.predlog = keeper, jobs, records, predlog

    def to_history(self, kind: str, f: dict[str, Any]) -> None:
        """Rollout events go to the durable history (statedb's writer thread)."""
        if kind not in HISTORY_KINDS:
            return
        details = {k: v for k, v in f.items() if k not in _HISTORY_COLUMNS}
        if isinstance(f.get("details"), dict):
            details.update(f["details"])
        self.db.add_history(
            f.get("name"), kind, source=f.get("source"), from_version=f.get("from_version"),
            to_version=f.get("to_version", f.get("version")), phases=f.get("phases"),
            reason=f.get("reason"), details=details or None, at=f.get("at"))

    def history(self, name: str | None = None, limit: int = 100) -> list[dict[str, object]]:
        """Not for the IOLoop (GET /history runs it in an executor): it waits for
        the writes handed over so far, so an answered apply is in what it reads."""
        try:
            self.db.flush(10)
        except TimeoutError:  # a stuck disk: answer with what is committed
            log.warning("GET /history answers without the pending writes: the state db is slow")
        return self.db.history(name, limit)

    def _predlog(self) -> dict[str, int] | None:
        """The prediction log's counts (texts logged, dropped, queued), or None."""
        if not self.predlog.enabled:
            return None
        return self.predlog.stats()

    def status(self) -> dict[str, object]:
        me = psutil.Process()
        described = {g: w.describe() for g, w in sorted(self.pool.workers.items())}
        models = {n: s.describe([described[w.generation] for w in s.replicas
                                 if w.generation in described])
                  for n, s in sorted(self.serving.slots.items())}
        default = self.serving.slots.get(self.serving.default_name or "")
        serving = None
        if default is not None and default.replicas:
            first = default.replicas[0]
            serving = {"name": default.name, "version": default.version,
                       "generation": first.generation, "pid": first.pid,
                       "labels": default.labels, "replicas": len(default.replicas)}
        pool = self.pool.describe()
        workers = list(described.values())
        return {
            "supervisor": {"pid": os.getpid(), "uptime_s": round(time.time() - self.serving.started, 3),
                           "rss_bytes": me.memory_info().rss,
                           "models_dir": self.store.root, "stopping": self.serving.stopping},
            "default": self.serving.default_name,
            "models": models,
            "serving": serving,
            "workers": workers,
            "draining": [w["generation"] for w in workers if w["state"] == "DRAINING"],
            "standby": pool[0] if pool else None,
            "pool": pool,
            "budget": {"max_workers": self.pool.max_workers or None, "workers": len(workers),
                       "standby_pool": self.pool.size},
            "restarts": self.serving.restarts,
            "recent_exits": list(self.serving.exits),
            "failed_models": list(self.serving.failed_models.values()),
            "last_apply": self.serving.last_apply,
            "record_revision": self.serving.record.get("revision", 0),
            "storage": {**self.storage.health(), "record_dirty": self.keeper.dirty},
            "zygote": self.pool.zygote.describe() if self.pool.zygote is not None else None,
            "prediction_log": self._predlog(),
            "jobs": self.jobs.list(),
            "cluster": self.records.status(),
        }
