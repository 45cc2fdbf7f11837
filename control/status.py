"""Status and history: what GET /status and GET /history read.

`StatusView` reads the supervisor's state (slots, pool, jobs, failures) and
shapes /status; it writes only the durable history (events it is
subscribed to, handed to the state DB's writer thread).
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from supervisor import Supervisor

log = logging.getLogger("textswap.supervisor")

# Events written to the durable history (GET /history)
HISTORY_KINDS = {"apply", "apply_failed", "rollback", "promote", "abort", "gate_refused",
                 "unload", "crash", "restart", "recycle", "failed", "shadow", "canary",
                 "probation_ended"}
_HISTORY_COLUMNS = {"name", "source", "from_version", "to_version", "version", "phases",
                    "reason", "details", "at"}


class StatusView:
    """Shapes /status; keeps the durable history."""

    def __init__(self, sup: "Supervisor") -> None:
        self.sup = sup
        self.cfg, self.wcfg, self.loop = sup.cfg, sup.wcfg, sup.loop
        self.store, self.pool, self.events = sup.store, sup.pool, sup.events

    def to_history(self, kind: str, f: dict[str, Any]) -> None:
        """Rollout events go to the durable history (statedb's writer thread)."""
        if kind not in HISTORY_KINDS or self.sup.state is None:
            return
        details = {k: v for k, v in f.items() if k not in _HISTORY_COLUMNS}
        if isinstance(f.get("details"), dict):
            details.update(f["details"])
        self.sup.state.add_history(
            f.get("name"), kind, source=f.get("source"), from_version=f.get("from_version"),
            to_version=f.get("to_version", f.get("version")), phases=f.get("phases"),
            reason=f.get("reason"), details=details or None, at=f.get("at"))

    def history(self, name: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Not for the IOLoop (GET /history runs it in an executor): it waits for
        the writes handed over so far, so an answered apply is in what it reads."""
        try:
            self.sup.state.flush(10)
        except TimeoutError:  # a stuck disk: answer with what is committed
            log.warning("GET /history answers without the pending writes: the state db is slow")
        return self.sup.state.history(name, limit)

    def _predlog(self) -> dict[str, Any] | None:
        """The prediction log's counts (texts logged, dropped, queued), or None."""
        plog = getattr(self.sup, "predlog", None)
        if plog is None or not getattr(plog, "enabled", False):
            return None
        return plog.stats()

    def status(self) -> dict[str, Any]:
        me = psutil.Process()
        described = {g: w.describe() for g, w in sorted(self.pool.workers.items())}
        models = {n: s.describe([described[w.generation] for w in s.replicas
                                 if w.generation in described])
                  for n, s in sorted(self.sup.slots.items())}
        default = self.sup.slots.get(self.sup.default_name or "")
        serving = None
        if default is not None and default.replicas:
            first = default.replicas[0]
            serving = {"name": default.name, "version": default.version,
                       "generation": first.generation, "pid": first.pid,
                       "labels": default.labels, "replicas": len(default.replicas)}
        pool = self.pool.describe()
        workers = list(described.values())
        return {
            "supervisor": {"pid": os.getpid(), "uptime_s": round(time.time() - self.sup.started, 3),
                           "rss_bytes": me.memory_info().rss,
                           "models_dir": self.store.root, "stopping": self.sup.stopping},
            "default": self.sup.default_name,
            "models": models,
            "serving": serving,
            "workers": workers,
            "draining": [w["generation"] for w in workers if w["state"] == "DRAINING"],
            "standby": pool[0] if pool else None,
            "pool": pool,
            "budget": {"max_workers": self.pool.max_workers or None, "workers": len(workers),
                       "standby_pool": self.pool.size},
            "restarts": self.sup.restarts,
            "recent_exits": list(self.sup.exits),
            "failed_models": list(self.sup.failed_models.values()),
            "last_apply": self.sup.last_apply,
            "record_revision": self.sup.record.get("revision", 0),
            "storage": {**self.sup.storage.health(), "record_dirty": self.sup.applies.dirty},
            "zygote": self.pool.zygote.describe() if self.pool.zygote is not None else None,
            "prediction_log": self._predlog(),
            "jobs": self.sup.jobs.list(),
            "cluster": None if self.sup.cluster is None else self.sup.cluster.cluster.status(),
        }
