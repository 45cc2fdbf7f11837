"""Cluster mode, the supervisor's side: the record backend and the job queue glue.

`ClusterNode` is the record backend (control/records.py `RecordBackend`)
that supervisor.py chooses when ``cluster.redis_url`` is set, in place of
the file record and its watcher; its `training` is the job queue
(control/jobs.py `JobQueue`):

- load(): the record at start: from Redis, else (Redis down) from this
  node's cache file of the last record it saw;
- the follower (cluster/record.py) hands every newer revision to the
  applies' ``on_record_change``, exactly what the file watcher does for an edited
  ``.applied.json``: each node applies locally, ready-gated and drained;
- write() (note_record()): after a local apply/unload, the one slot that changed (and
  the default) is written into the Redis record atomically, merged with
  whatever other nodes wrote meanwhile; the writes go out in order from one
  task, and ``after_change`` waits for them (the /apply answer names the
  revision and which nodes serve it already);
- a node says in its heartbeat the revision it fully serves: the newest
  record whose every slot (version, replicas) and default match what it
  serves; GET /cluster compares those.

Applies go in two phases (cluster/twophase.py): every live node prepares
the version first, then the record write flips them all (``prepare_all``,
called by Applies.apply before its local switch).

Training (`ClusterTraining`): jobs are queued in Redis (cluster/job_queue.py);
each node claims one when it has a free training slot and runs it with the
ordinary JobManager machinery, mirroring the job's state into Redis.
The node reads the serving state and changes it only through the serving
controller (the record it wrote, the demo's flag); it subscribes to the
controller's changes to keep its heartbeat's revision true.
Imports no TensorFlow.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import socket
import time
from typing import TYPE_CHECKING, Any, cast

from cluster.connect import NotReplicated, RedisTarget
from cluster.record import Cluster, ClusterUnreachable
from cluster.job_queue import ClusterJobs
from cluster.twophase import PREPARED, TwoPhase
from control.jobs import JobDoc, JobError, listed

if TYPE_CHECKING:
    from state.config import Config
    from control.serving import AppliedRecord
    from state.store import ModelStore
    from control.events import Events
    from control.jobs import JobManager
    from control.pool import WorkerPool
    from control.provision import Provisioner
    from control.records import OnChange
    from control.servingctl import ServingController

log = logging.getLogger("textswap.cluster")


def default_node_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}"


def check_store_writable(root: str) -> None:
    """Nodes share the store (publish = stage + rename on it): refuse a store
    this node cannot write, at start rather than at the first training."""
    probe = os.path.join(root, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w") as fh:
            fh.write("ok")
        os.unlink(probe)
    except OSError as exc:
        raise RuntimeError(f"the model store {root} is not writable by this node ({exc}); "
                           "cluster nodes must share a writable store") from None


class ClusterNode:
    """The record in Redis and this node's part in the cluster (RecordBackend)."""

    wipe_tmp = False  # other nodes' staging in the shared store is theirs

    def __init__(self, config: "Config", ctl: "ServingController", store: "ModelStore",
                 events: "Events", provision: "Provisioner", pool: "WorkerPool",
                 node_id: str | None = None) -> None:
        cfg = config.cluster
        self.cfg, self.ctl, self.serving, self.store = config, ctl, ctl.serving, store
        self.events, self.provision, self.pool = events, provision, pool
        self.node_id = node_id or cfg.node_id or default_node_id(config.server.port)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.node_id)
        self.cluster = Cluster(
            RedisTarget.of(cfg), self.node_id, prefix=cfg.key_prefix,
            cache_path=os.path.join(store.root, ".cluster", f"{safe}.record.json"),
            poll_interval=cfg.poll_interval, heartbeat_interval=cfg.poll_interval,
            heartbeat_ttl=cfg.heartbeat_ttl)
        self.training = ClusterTraining(self, ClusterJobs(self.cluster, cfg.job_lease,
                                                          config.training.keep_jobs))
        self.twophase = TwoPhase(self.cluster, config, store, ctl.serving, provision, pool)
        self._writes: asyncio.Queue[Any] = asyncio.Queue()
        self._writer: asyncio.Task[Any] | None = None
        self._write_error: BaseException | None = None
        self._delivered = 0
        self._written = 0  # the revision of this node's latest record write
        self._written_record: dict[str, Any] | None = None  # and that record
        self._delivered_at = 0.0
        self._on_change: Any = None

    # -- the record backend (what the file watcher is in single-node mode) ---------
    async def load(self) -> "AppliedRecord | None":
        try:
            rec = await self.cluster.read_record()
        except ClusterUnreachable as exc:
            rec = self.cluster.record
            log.error("%s; starting from this node's cached record (revision %s)", exc,
                      rec["revision"] if rec else "none")
        if rec is None:
            rec = self.cluster.record
        if rec is not None:
            self._delivered = rec["revision"]  # start() applies it; no second delivery
        return cast("AppliedRecord | None", rec)  # cluster/record.py read it in this format

    def start(self, record: "AppliedRecord | None", on_change: "OnChange") -> None:
        self._on_change = on_change
        self._writer = asyncio.ensure_future(self._write_loop())
        self.events.subscribe(self._on_event)
        self.ctl.subscribe(self._check_applied)  # the heartbeat's revision stays true
        self.cluster.start(self._deliver, self._describe, self._tick, self.twophase.on_message,
                           self._failover)

    def _failover(self) -> None:
        """The cluster store's primary changed: converge on the record it holds,
        whatever this node saw before (cluster/record.py took that record)."""
        self._delivered = 0
        self.training.after_failover()
        rec = self.cluster.record
        if rec is not None:
            self._deliver(rec)

    def _tick(self) -> None:
        self.training.tick()
        self.twophase.tick()

    def stop(self) -> None:
        """Stop following the record (the watcher's stop); close() finishes."""
        self.cluster.halt()

    async def close(self) -> None:
        """After the jobs stopped: flush their last states, leave the cluster."""
        try:
            await asyncio.wait_for(self._writes.join(), 2.0)
        except asyncio.TimeoutError:
            pass
        await self.training.flush()
        self.twophase.stop()
        if self._writer is not None:
            self._writer.cancel()
        await self.cluster.stop()

    async def write(self, record: "AppliedRecord", changed: str | None, strict: bool) -> None:
        """Queued for the writer task (after_change waits for it); the switch
        goes ahead at once: the node follows the cluster's record."""
        self.note_record(record, changed)

    def status(self) -> dict[str, Any]:
        return self.cluster.status()

    def note_record(self, record: "AppliedRecord", changed: str | None = None) -> None:
        """The node changed the slot `changed` (None: everything, e.g. a
        fallback): merge that into the cluster's record."""
        entry = record["models"].get(changed) if changed else None
        default = record["default"]

        def mutate(rec: dict[str, Any]) -> dict[str, Any]:
            if changed is None:
                return {"default": default, "models": dict(record["models"])}
            if entry is None:
                rec["models"].pop(changed, None)
                if rec["default"] == changed:
                    rec["default"] = None
            else:
                rec["models"][changed] = entry
                if default == changed or rec["default"] not in rec["models"]:
                    rec["default"] = default if default in rec["models"] else changed
            return rec
        self._writes.put_nowait(mutate)

    async def _write_loop(self) -> None:
        while True:
            mutate = await self._writes.get()
            try:
                try:
                    rec = await self.cluster.update_record(mutate)
                    self._write_error = None
                except NotReplicated as exc:
                    # written on the primary, not (yet) on a replica: this node
                    # follows it as written; the apply answers 503 not_replicated
                    rec = self.cluster.record or {}
                    self._write_error = exc
                    if not rec:
                        raise
                self._written = rec["revision"]  # holds this node's change
                self._written_record = rec
                self.ctl.note_record(cast("AppliedRecord", rec))  # read in this format
                self._delivered = max(self._delivered, rec["revision"])
                self._check_applied()
            except ClusterUnreachable as exc:
                # our change never reached the cluster: follow the cluster's
                # record again once it is back (it stays the truth)
                self._write_error = exc
                self._delivered = 0
                self.cluster.applied_revision = 0
            except Exception as exc:
                log.exception("cluster record update failed")
                self._write_error = exc
            finally:
                self._writes.task_done()

    # -- following ---------------------------------------------------------------------
    def _deliver(self, rec: dict[str, Any]) -> None:
        """A record from Redis (every tick and on notifications): act on a new
        revision, or retry a stale one now and then (a load that failed)."""
        self._check_applied()
        now = time.monotonic()
        if rec["revision"] > self._delivered or (
                self.cluster.applied_revision < rec["revision"] and
                now - self._delivered_at > 2.0 and not self._busy()):
            self._delivered, self._delivered_at = rec["revision"], now
            log.info("cluster record revision %d: converging on it", rec["revision"])
            self._on_change(rec)

    def _busy(self) -> bool:
        return any(s.busy or s.applying for s in self.serving.slots.values())

    def matches(self, rec: dict[str, Any]) -> bool:
        """This node serves exactly what rec asks for."""
        slots = {n: s for n, s in self.serving.slots.items() if s.replicas}
        if set(slots) != set(rec["models"]):
            return False
        for name, entry in rec["models"].items():
            s = slots[name]
            if entry["version"] is not None and s.version != entry["version"]:
                return False
            if entry["replicas"] and len(s.replicas) != entry["replicas"]:
                return False
        return rec["default"] == self.serving.default_name

    def stale(self, name: str, version: int) -> bool:
        """A queued watcher apply of (name, version) that the newest record
        no longer asks for: skip it (a newer record won while it waited)."""
        rec = self.cluster.record
        if rec is None:
            return False
        entry = rec["models"].get(name)
        return entry is None or (entry["version"] is not None and entry["version"] != version)

    def _check_applied(self) -> None:
        """The heartbeat's revision: the record's when this node serves exactly
        it, else below it (a node that drifted off the record is a straggler)."""
        rec = self.cluster.record
        if rec is None:
            return
        if self.matches(rec):
            if rec["revision"] != self.cluster.applied_revision:
                self.cluster.note_applied(rec["revision"])
        elif self.cluster.applied_revision >= rec["revision"]:
            self.cluster.note_applied(rec["revision"] - 1)

    def _on_event(self, kind: str, fields: dict[str, Any]) -> None:
        self._check_applied()  # apply, unload, rollback, crash...: still on the record?

    def _describe(self) -> dict[str, Any]:
        s = self.cfg.server
        return {"inference": f"{s.host}:{s.port}", "pid": os.getpid(),
                "default": self.serving.default_name,
                "serving": {n: {"version": sl.version, "replicas": len(sl.replicas)}
                            for n, sl in sorted(self.serving.slots.items()) if sl.replicas},
                "training": self.training.running_ids()}

    # -- hooks for /apply ------------------------------------------------------------------
    async def check(self) -> None:
        """Before an operator's change: refuse (503) while Redis is down; and
        when this node's last record write was not replicated, until it is
        (WAIT after a write of our own: the replicas apply in order), so that
        a retry answered "unchanged" is as replicated as a 200 says."""
        await self.cluster.call(self.cluster.redis.ping)
        if isinstance(self._write_error, NotReplicated):
            await self.cluster.multi_acked([("INCR", self.cluster.key("acked"))],
                                           "the cluster record")
            self._write_error = None

    async def prepare_all(self, name: str, version: int | None, replicas: int,
                          partial: bool = False, mode: str | None = None) -> None:
        """Before a local apply: every live node prepares (name, version);
        409 not_prepared (nothing switched) when one cannot (twophase.py)."""
        await self.twophase.prepare_all(name, version, replicas, partial, mode)

    async def after_change(self) -> dict[str, Any]:
        """After a local apply/unload: wait for its record write, then say
        which nodes serve that revision already."""
        await self._writes.join()
        if isinstance(self._write_error, NotReplicated):
            raise NotReplicated(
                f"applied on this node and written to the cluster record, but {self._write_error}",
                details=self._write_error.details) from None
        if self._write_error is not None:
            raise ClusterUnreachable(
                f"applied on this node, but the cluster record could not be written "
                f"({self._write_error}); this node returns to the cluster's record once "
                "the store is back") from None
        # the revision this node's write made, not the record's latest: another
        # node's write may have followed it (each apply answers with its own)
        rev = self._written
        self._check_applied()
        if self.cluster.applied_revision >= rev:
            await self.cluster._beat_quietly()
        try:
            done, pending = await self.cluster.serving_revision(rev)
        except ClusterUnreachable:
            done, pending = [self.node_id], []
        # this node serves what it wrote (the write was made from its own
        # state), whatever its heartbeat says yet: a record notification that
        # came before the write's answer, or a beat still on its way, may leave
        # the beat a revision behind for a moment
        written = self._written_record
        if (self.node_id not in done and written is not None
                and written["revision"] == rev and self.matches(written)):
            done = sorted([*done, self.node_id])
            pending = [n for n in pending if n != self.node_id]
        out = {"revision": rev, "node": self.node_id, "nodes_serving": done,
               "nodes_pending": pending}
        prepared = PREPARED.get()
        if prepared is not None:  # this apply's prepare phase (two-phase apply)
            out["prepare"] = prepared
            PREPARED.set(None)
        return out

    async def overview(self) -> dict[str, Any]:
        out = await self.cluster.overview()
        out["this_node"] = self.cluster.status()
        return out

    async def claim_demo(self) -> bool:
        """The first-start demo trains once per cluster."""
        try:
            return await self.cluster.once("demo")
        except ClusterUnreachable:
            return False


class ClusterTraining:
    """Jobs through Redis: submit anywhere, one node runs each, every node reads it."""

    def __init__(self, node: ClusterNode, queue: ClusterJobs) -> None:
        self.node = node
        self.q = queue
        self._ticking = False
        self._pushes: set[asyncio.Future[Any]] = set()
        self._manager: "JobManager | None" = None  # the manager that runs claimed jobs
        self._reap_from = 0.0  # monotonic: no reaping before (a failover's grace)

    shared_store = True  # the nodes' job data and staging are in one store

    def attach(self, manager: "JobManager") -> None:
        self._manager = manager

    def after_failover(self) -> None:
        """Every lease may have run out while the store had no primary (no
        runner could renew): reap nothing for one lease, so that the runners,
        alive, renew (cluster/job_queue.py takes a run-out lease again)."""
        self._reap_from = time.monotonic() + self.q.lease_ms / 1000.0

    @property
    def jobs(self) -> "JobManager":
        if self._manager is None:
            raise RuntimeError("no job manager attached to the cluster's queue")
        return self._manager

    def running_ids(self) -> list[str]:
        """The jobs this node runs now (its heartbeat's)."""
        if self._manager is None:
            return []
        return [j.id for j in self._manager.jobs.values() if j.state == "running"]

    def tick(self) -> None:
        if not self._ticking:
            self._ticking = True
            asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        """Renew our leases, stop what was cancelled or lost, reap dead nodes'
        jobs, claim queued jobs while we have room."""
        try:
            mgr = self.jobs
            for job in [j for j in mgr.jobs.values() if j.state == "running"]:
                verdict = await self.q.renew(job.id)
                if verdict == "cancel":
                    log.info("job %s cancelled through the cluster", job.id)
                    await mgr.cancel(job.id)
                elif verdict == "lost":
                    log.error("job %s: lease lost (this node was cut off too long): "
                              "stopping its trainer", job.id)
                    job.state = "interrupted"
                    job.error = "this node lost the job's lease"
                    if job.process is not None:
                        await job.process.stop(2.0)
            if time.monotonic() >= self._reap_from:
                await self.q.reap()
            if self.node.serving.stopping:
                return
            # claims whose answers were lost first (they are the oldest), then the queue
            lost = await self.q.unstarted_claims(set(mgr.jobs))
            while sum(1 for j in mgr.jobs.values() if j.state == "running") < \
                    mgr.cfg.max_concurrent:
                taken_up = bool(lost)
                doc = lost.pop(0) if lost else await self.q.claim()
                if doc is None:
                    break
                try:
                    mgr.check_claimed(doc)  # read from Redis: untrusted
                except JobError as exc:
                    await self._refuse(doc, str(exc))
                    continue
                log.info("job %s (%s) claimed by this node%s", doc["id"], doc["name"],
                         " (the claim's answer was lost: taken up now)" if taken_up else "")
                if doc.get("first_start_demo"):
                    self.node.ctl.set_demo_training(True)
                mgr.run_claimed(doc)
        except ClusterUnreachable:
            pass
        except Exception:
            log.exception("cluster training tick failed")
        finally:
            self._ticking = False

    async def _refuse(self, doc: Any, why: str) -> None:
        """A claimed job document that does not pass the checks: failed in the
        queue with the reason; nothing is run, written or deleted here."""
        job_id = doc.get("id") if isinstance(doc, dict) else None
        log.error("cluster job refused: %s", why)
        if not isinstance(job_id, str):
            return  # no key to answer under: its lease runs out and the reaper ends it
        await self.q.save({"id": job_id, "state": "failed", "error": f"refused: {why}",
                           "finished_at": time.time()}, "failed")

    async def new_id(self) -> str:
        try:
            return await self.q.new_id()
        except ClusterUnreachable as exc:
            raise JobError(503, exc.code, str(exc)) from None

    async def enqueue(self, job: Any) -> bool:
        doc = job.describe()
        if self.node.serving.demo_training and job.name == "demo":
            # the first-start demo: the node that runs it marks its slot as the
            # demo (retired once another model is the default), not this one
            doc["first_start_demo"] = True
            self.node.ctl.set_demo_training(False)
        try:
            await self.q.enqueue(doc)
        except ClusterUnreachable as exc:
            shutil.rmtree(job.dir, ignore_errors=True)
            raise JobError(503, exc.code, str(exc)) from None
        except NotReplicated as exc:
            # queued on the primary only: withdraw it while no node runs it, so
            # that the client's retry is the one job (a failover could drop it)
            try:
                verdict = await self.q.cancel(job.id)
            except (ClusterUnreachable, NotReplicated):
                verdict = "unknown"
            if verdict == "cancelled":
                raise JobError(503, exc.code, f"{exc} (the job {job.id} was withdrawn: "
                               "submit it again)") from None
            raise JobError(503, exc.code, f"{exc} (the job {job.id} already started on a "
                           f"node: follow it at GET /train/{job.id} rather than submit it "
                           "again)") from None
        self.tick()  # this node may have room: claim at once
        return True

    def changed(self, job: Any) -> None:
        """A job this node runs (or just queued) changed: mirror it."""
        final = job.state if job.state in ("succeeded", "failed", "cancelled",
                                           "interrupted") else ""
        task = asyncio.ensure_future(self._push(job.describe(), final))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)

    async def flush(self) -> None:
        if self._pushes:
            await asyncio.wait(list(self._pushes), timeout=2.0)

    async def _push(self, doc: dict[str, Any], final: str) -> None:
        try:
            if not await self.q.save(doc, final):
                log.warning("job %s: not written to the cluster (lease not ours)", doc["id"])
        except ClusterUnreachable:
            pass  # the next change writes the whole job again
        result = doc.get("result") or {}
        if final == "succeeded" and result.get("name") and result.get("version"):
            # a new version in the shared store: every node preloads it
            await self.node.twophase.published(result["name"], int(result["version"]))

    async def get(self, job_id: str) -> JobDoc | None:
        local = self.jobs.jobs.get(job_id)
        if local is not None and local.state == "running":
            return {**local.describe(), "node": self.node.node_id}
        return await self.q.get(job_id)

    async def list(self) -> list[JobDoc]:
        return [listed(d) for d in await self.q.list()]

    async def cancel(self, job_id: str) -> tuple[str, JobDoc | None]:
        local = self.jobs.jobs.get(job_id)
        if local is not None and local.state == "running":
            await self.jobs.cancel(job_id)
            return "cancelled", {**local.describe(), "node": self.node.node_id}
        verdict = await self.q.cancel(job_id)
        return verdict, await self.q.get(job_id)


def node_state_path(store_root: str, node_id: str) -> str:
    """Each node's own state db (jobs it ran, its rollout history) in the
    shared store: one SQLite file per node, never shared between hosts."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node_id)
    os.makedirs(os.path.join(store_root, ".cluster"), exist_ok=True)
    return os.path.join(store_root, ".cluster", f"{safe}.state.db")
