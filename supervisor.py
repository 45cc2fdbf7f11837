"""textswap supervisor: entry point, and the one owner of slots, workers and jobs.

    python supervisor.py --config config.yaml

All state changes happen on the IOLoop (rule 2 of ARCHITECTURE.md): HTTP
handlers, worker exit callbacks, the watcher thread and signal handlers only
call or post to the Supervisor. This process never imports TensorFlow.
"""
from __future__ import annotations

import argparse
import collections
import random
import gc
import logging
import os
import signal
import sys
import time
from typing import Any

import psutil
from tornado import gen
from tornado.ioloop import IOLoop, PeriodicCallback
from tornado.locks import Event

from state.config import Config, ConfigError, load_config
from state.errors import ApplyFailed, Conflict, NoModel, ServiceError, UnknownModel
from control.events import Events
from control.jobs import JobManager
from control import metrics
from state.statedb import FILENAME as STATE_DB, StateDB
from control.pool import WorkerPool
from control.rollouts import Candidate, GoldenSets, Probation, VersionStats, label_changes
from control.rollouts import score as rollouts_score
from control.slots import Slot
from state.store import InvalidArtifact, ModelStore, StoreError, check_name
from control.watcher import RecordWatcher
from control.workerhandle import (RequestFailed, RequestTimedOut, State, WorkerDied, WorkerError,
                          WorkerHandle)

log = logging.getLogger("textswap.supervisor")

DEMO_NAME = "demo"
DEMO_DATA = "data/demo/sentiment_zh.jsonl"
DEMO_PARAMS: dict[str, Any] = {"architecture": "bow"}  # fixed and fast: predicts ~20 s after a first start


# Events written to the durable history (GET /history)
HISTORY_KINDS = {"apply", "apply_failed", "rollback", "promote", "abort", "gate_refused",
                 "unload", "crash", "restart", "recycle", "failed", "shadow", "canary",
                 "probation_ended"}
_HISTORY_COLUMNS = {"name", "source", "from_version", "to_version", "version", "phases",
                    "reason", "details", "at"}


class Supervisor:
    """Owns the model slots, the worker pool, the applied-model record and jobs."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.wcfg = config["worker"]
        self.store = ModelStore(config.models_dir)
        self.loop = IOLoop.current()
        self.pool = WorkerPool(config, self.store, self._on_worker_exit, self._preload_guesses)
        self.slots: dict[str, Slot] = {}
        self.default_name: str | None = None
        self.previous_default: str | None = None  # the default before the last change
        self.record: dict[str, Any] = {"default": None, "models": {}, "revision": 0}
        self.events = Events()
        self.golden = GoldenSets(self.store.root)
        self.metrics = metrics.build(self, config)  # Prometheus figures (metrics.py)
        self.started = time.time()
        self.stopping = False
        self.stopped = Event()
        self.restarts = 0
        self.exits: collections.deque = collections.deque(maxlen=20)
        self.failed_models: dict[str, dict[str, Any]] = {}
        self.last_apply: dict[str, Any] | None = None
        self._demo_training = False
        self.watcher: RecordWatcher | None = None
        # cluster mode (cluster.redis_url; clusternode.py): the record lives in
        # Redis and stands in for the file watcher; jobs queue in Redis; each
        # node keeps its own state db (the store is shared)
        self.cluster: Any = None
        state_path = os.path.join(self.store.root, STATE_DB)
        if config["cluster"]["redis_url"]:
            from cluster.node import ClusterNode, node_state_path
            self.cluster = ClusterNode(self)
            state_path = node_state_path(self.store.root, self.cluster.node_id)
        self.state = StateDB(state_path)  # jobs, history
        self.events.subscribe(self._to_history)
        self.jobs = JobManager(self, self.state)
        if self.cluster is not None:
            self.jobs.cluster = self.cluster.training
        self._sweeper = PeriodicCallback(self._sweep, 1000)

    # -- start and stop -----------------------------------------------------------
    async def start(self) -> None:
        self.store.ensure(wipe_tmp=self.cluster is None)  # other nodes' staging is theirs
        self.pool.ensure(nice=False)  # first worker: full speed
        try:
            record = (self.store.read_record() if self.cluster is None
                      else await self.cluster.load())  # Redis, else this node's cache
        except StoreError as exc:
            log.error("%s; starting without a model", exc)
            record = None
        if record:
            self.record = record
            self.default_name = record["default"]
        if self.cluster is not None:  # follows the Redis record instead of the file
            self.watcher = self.cluster
            self.cluster.start(record)
        elif self.cfg["watcher"]["enabled"]:
            self.watcher = RecordWatcher(self.store, self.loop, self.cfg["watcher"]["interval"],
                                         self._on_record_change)
            self.watcher.start(record)
        self._sweeper.start()
        if record and record["models"]:
            for name, entry in record["models"].items():
                self.loop.spawn_callback(
                    self._apply_logged, name, entry["version"], "startup",
                    replicas=entry["replicas"], explicit=entry["explicit"])
        elif not self.store.names() and self.cfg["training"]["demo_on_empty_store"]:
            self.loop.spawn_callback(self._train_demo)
        else:
            log.info("no applied model yet: /readyz answers 503 until one is applied")

    async def _train_demo(self) -> None:
        """First start on an empty store: train and apply the bundled demo."""
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEMO_DATA)
        if self.cluster is not None and not await self.cluster.claim_demo():
            log.info("cluster: the first-start demo is trained once, by another node")
            return
        self._demo_training = True
        try:
            job = await self.jobs.submit(DEMO_NAME, {"path": path}, DEMO_PARAMS, True,
                                         trusted_path=True)
        except Exception as exc:
            self._demo_training = False
            log.error("could not start the demo training: %s", exc)
            return
        log.info("empty model store: training the bundled demo model (job %s); "
                 "/predict answers once it is applied", job.id)

    async def shutdown(self) -> None:
        if self.stopping:
            await self.stopped.wait()
            return
        self.stopping = True
        self.pool.stopping = True
        log.info("shutting down")
        self._sweeper.stop()
        if self.watcher:
            self.watcher.stop()
        await self.jobs.shutdown()
        if self.cluster is not None:
            await self.cluster.close()
        timeout = self.wcfg["stop_timeout"]
        serving = [w for s in self.slots.values() for w in s.replicas]
        for w in serving:
            w.set_state(State.DRAINING)
        await gen.multi([w.wait_idle(min(self.wcfg["drain_timeout"], 5.0)) for w in serving])
        await gen.multi([w.stop(timeout) for w in list(self.pool.workers.values())])
        for s in self.slots.values():
            s.replicas = []
        self.state.close()  # commits the pending job and history writes
        self.stopped.set()
        log.info("all workers stopped")

    def _to_history(self, kind: str, f: dict[str, Any]) -> None:
        """Rollout events go to the durable history (statedb's writer thread)."""
        if kind not in HISTORY_KINDS or self.state is None:
            return
        details = {k: v for k, v in f.items() if k not in _HISTORY_COLUMNS}
        if isinstance(f.get("details"), dict):
            details.update(f["details"])
        self.state.add_history(
            f.get("name"), kind, source=f.get("source"), from_version=f.get("from_version"),
            to_version=f.get("to_version", f.get("version")), phases=f.get("phases"),
            reason=f.get("reason"), details=details or None, at=f.get("at"))

    def history(self, name: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Not for the IOLoop (GET /history runs it in an executor): it waits for
        the writes handed over so far, so an answered apply is in what it reads."""
        try:
            self.state.flush(10)
        except TimeoutError:  # a stuck disk: answer with what is committed
            log.warning("GET /history answers without the pending writes: the state db is slow")
        return self.state.history(name, limit)

    # -- lookups used by the handlers -----------------------------------------------
    @property
    def ready(self) -> bool:
        """The default model serves (what /readyz reports)."""
        slot = self.slots.get(self.default_name) if self.default_name else None
        return slot is not None and bool(slot.replicas)

    def serving_names(self) -> list[str]:
        return sorted(n for n, s in self.slots.items() if s.replicas)

    def serving_model(self, name: str | None = None) -> dict[str, Any] | None:
        """{"name", "version", "labels", "replicas"} of what serves `name`
        (the default model when None), or None."""
        slot = self.slots.get(name or self.default_name or "")
        if slot is None or not slot.replicas:
            return None
        return {"name": slot.name, "version": slot.version, "labels": list(slot.labels),
                "replicas": len(slot.replicas)}

    def _slot_for(self, name: str | None) -> Slot:
        if name is None:
            if self.default_name is None:
                raise NoModel("no model is serving; apply one with POST /apply")
            slot = self.slots.get(self.default_name)
            if slot is None:
                raise NoModel(f"the default model {self.default_name!r} is not loaded yet")
            return slot
        slot = self.slots.get(name)
        if slot is None:
            serving = ", ".join(self.serving_names()) or "none"
            raise UnknownModel(f"model {name!r} is not serving here (serving: {serving})",
                               details={"serving": self.serving_names()})
        return slot

    # -- predict --------------------------------------------------------------------
    async def predict(self, texts: list[str], model: str | None = None
                      ) -> tuple[dict[str, Any], list[str], list]:
        """(model, labels, scores) for texts; retried once on a sibling or a
        replacement if the worker dies with the request in flight.

        A canary candidate answers its share of requests; a shadow candidate
        gets a sampled copy, compared off this request's path."""
        slot = self._slot_for(model)
        deadline = self.loop.time() + self.wcfg["request_timeout"]
        cap = self.wcfg["max_inflight"]
        cand = slot.candidate
        if cand is not None and cand.mode == "canary" and random.random() < cand.fraction:
            w = _least_busy(cand.workers, cap)
            if w is not None:
                t0 = time.monotonic()
                try:
                    scores = await w.predict(texts)
                    cand.stats.observe(time.monotonic() - t0)
                    return w.model, w.labels, scores  # type: ignore[return-value]
                except RequestFailed as exc:
                    cand.stats.error()
                    raise ServiceError(f"model failed on this request: {exc}", 500,
                                       exc.code) from exc
                except WorkerError:
                    cand.stats.error()  # died or timed out: the serving version answers
        for attempt in (1, 2):
            w = await slot.route(cap, deadline)
            t0 = time.monotonic()
            try:
                fut = w.predict(texts)
                if cand is not None and cand.mode == "shadow" and (
                        random.random() < cand.fraction):
                    self._mirror(slot, cand, texts, w.labels, fut)
                scores = await fut
            except WorkerDied:
                if attempt == 2:
                    self._count_error(slot, w)
                    raise ServiceError("the model worker died twice on this request", 503,
                                       "worker_died")
                continue
            except RequestFailed as exc:
                self._count_error(slot, w)
                raise ServiceError(f"model failed on this request: {exc}", 500,
                                   exc.code) from exc
            except RequestTimedOut as exc:
                self._count_error(slot, w)
                raise ServiceError(str(exc), 504, "timeout") from None
            took = time.monotonic() - t0
            slot.stats.observe(took)
            p = slot.probation
            if p is not None and w.model and w.model["version"] == p.new_version:
                p.new_stats.observe(took)
            if cand is not None and cand.mode == "canary":
                cand.serving_stats.observe(took)
            return w.model, w.labels, scores  # type: ignore[return-value]
        raise AssertionError("unreachable")

    def _count_error(self, slot: Slot, w: WorkerHandle) -> None:
        slot.stats.error()
        p = slot.probation
        if p is not None and w.model and w.model["version"] == p.new_version:
            p.new_stats.error()
            r = self.cfg["rollout"]
            if (p.new_stats.requests >= r["min_requests"]
                    and p.new_stats.error_rate > r["max_error_rate"]):
                # judged now, not at the next sweep: a version failing every
                # request would fail a second's worth of them meanwhile
                self._check_probations()

    def _mirror(self, slot: Slot, cand: Candidate, texts: list[str], labels: list[str],
                primary: Any) -> None:
        """Send a copy to the shadow candidate; compare once both answered.
        Never awaited by the client's request, and skipped when the candidate
        is at its in-flight cap, so a slow shadow cannot slow serving."""
        w = _least_busy(cand.workers, self.wcfg["max_inflight"])
        if w is None:
            cand.dropped += 1
            return
        cand.mirrored += 1
        t0 = time.monotonic()
        try:
            fut = w.predict(texts)
        except WorkerError:
            cand.stats.error()
            return

        async def compare() -> None:
            try:
                theirs = await fut
                cand.stats.observe(time.monotonic() - t0)
            except WorkerError:
                cand.stats.error()
                return
            try:
                ours = await primary
            except Exception:
                return
            cand.compare(texts, labels, w.labels, ours, theirs)
        self.loop.spawn_callback(compare)

    # -- workers for a slot ----------------------------------------------------------
    def _preload_guesses(self) -> list[tuple[str, int]]:
        """Models likely applied next, best first: a newer version of a serving
        model (just trained), then the version each served before (a rollback).
        The default model's guesses come first."""
        order = sorted(self.slots.values(), key=lambda s: s.name != self.default_name)
        newer, back = [], []
        for slot in order:
            if slot.version is None or not slot.replicas:
                continue
            try:
                later = [v for v in self.store.versions(slot.name) if v > slot.version]
            except StoreError:
                later = []
            later = [v for v in later if not slot.rolled_back.get(v, {}).get("auto")]
            if later:
                newer.append((slot.name, later[-1]))
            if slot.previous and slot.previous != slot.version and (
                    slot.probation is None or slot.probation.version != slot.previous):
                back.append((slot.name, slot.previous))
        return newer + back

    def refresh_preload(self) -> None:
        self.pool.refresh()

    def _obtain(self, name: str, version: int, n: int, what: str) -> list[WorkerHandle]:
        """n workers for (name, version): standbys first (best: one that
        preloaded it), new processes for the rest. Checks the budget before
        anything starts, with no await in between, so concurrent applies
        cannot over-commit."""
        taken: list[WorkerHandle] = []
        while len(taken) < n:
            w = self.pool.take(name, version)
            if w is None:
                break
            taken.append(w)
        need = n - len(taken)
        if need and not self.pool.has_room(need):
            self.pool.give_back(taken)
            raise self.pool.budget_error(need, what)
        return taken + [self.pool.spawn(nice=False) for _ in range(need)]

    async def _make_ready(self, w: WorkerHandle, name: str, version: int, path: str
                          ) -> tuple[WorkerHandle, dict[str, Any], bool]:
        """Boot (if needed) and load (unless preloaded) one worker.
        Returns (worker, ready frame, preloaded)."""
        deadline = self.loop.time() + self.wcfg["boot_timeout"]
        try:
            await gen.with_timeout(deadline, w.booted, quiet_exceptions=(WorkerDied,))
            if w.state is State.LOADING:  # a preload is under way: let it finish
                try:
                    await gen.with_timeout(deadline, w.ready,
                                           quiet_exceptions=(WorkerDied, RequestFailed))
                except (WorkerDied, RequestFailed):  # the guess was bad: a fresh one
                    w = self.pool.spawn()
                    await gen.with_timeout(deadline, w.booted, quiet_exceptions=(WorkerDied,))
        except (gen.TimeoutError, WorkerDied) as exc:
            w.kill()
            raise ApplyFailed(f"worker process did not start: {exc or 'timeout'}",
                              status=503, code="worker_boot_failed") from exc
        if w.state is State.READY and w.model == {"name": name, "version": version}:
            return w, w.ready.result(), True
        try:
            ready = await gen.with_timeout(self.loop.time() + self.wcfg["load_timeout"],
                                           w.load(path, name, version),
                                           quiet_exceptions=(WorkerDied, RequestFailed))
        except (gen.TimeoutError, WorkerError) as exc:
            status = None
            why = str(exc) or "load deadline passed"
            if isinstance(exc, gen.TimeoutError):
                why = f"model did not load and warm up within {self.wcfg['load_timeout']}s"
                status = 504
            w.error = why
            self.loop.spawn_callback(w.stop, 1.0)
            raise ApplyFailed(f"{name} v{version} failed to load: {why}",
                              status=status) from exc
        return w, ready, False

    async def _retire(self, ws: list[WorkerHandle]) -> list[dict[str, Any]]:
        """Drain then stop workers that no longer receive requests."""
        async def one(w: WorkerHandle) -> dict[str, Any]:
            drained = True
            if w.alive:
                if w.state in (State.SERVING, State.IDLE):
                    w.set_state(State.DRAINING)
                drained = await w.wait_idle(self.wcfg["drain_timeout"])
            ended = await w.stop(self.wcfg["stop_timeout"])
            return {"generation": w.generation, "pid": w.pid, "drained": drained, "ended": ended}
        return list(await gen.multi([one(w) for w in ws]))

    # -- apply --------------------------------------------------------------------
    def _on_record_change(self, record: dict[str, Any]) -> None:
        """The record was edited from outside: converge on it, name by name.
        A record naming a model or version the store lacks is logged and
        ignored as a whole: half-following it could unload what serves."""
        wanted = record["models"]
        for name, entry in wanted.items():
            try:
                self.store.resolve(name, entry["version"])
            except StoreError as exc:
                log.error("ignoring the applied-model record: %s", exc)
                return
        self.record = record
        for name, entry in wanted.items():
            slot = self.slots.get(name)
            replicas = entry["replicas"] or (slot.wanted if slot else None)
            if (slot is None or not slot.replicas or slot.version != entry["version"]
                    or (replicas and replicas != slot.wanted)):
                if slot is not None and entry["version"] is None and slot.replicas and (
                        not replicas or replicas == slot.wanted):
                    continue  # "latest" of a serving model: no change asked
                self.loop.spawn_callback(self._apply_logged, name, entry["version"], "watcher",
                                         replicas=entry["replicas"], explicit=entry["explicit"])
        for name in list(self.slots):
            if name not in wanted:
                self.loop.spawn_callback(self._unload_logged, name, "watcher")
        if record["default"] != self.default_name:
            log.info("default model is now %s (record changed)", record["default"])
            self.default_name = record["default"]

    async def _apply_logged(self, name: str, version: int | None, source: str,
                            **kw: Any) -> None:
        try:
            await self.apply(name, version, source=source, persist=source == "fallback", **kw)
        except ServiceError as exc:
            log.error("apply of %s v%s (%s) failed: %s", name, version, source, exc)
        except StoreError as exc:
            log.error("apply of %s v%s (%s) ignored: %s", name, version, source, exc)

    async def _unload_logged(self, name: str, source: str) -> None:
        try:
            await self.unload(name, source=source, persist=source != "watcher")
        except (ServiceError, StoreError) as exc:
            log.info("unload of %s (%s): %s", name, source, exc)

    async def apply(self, name: str, version: int | None = None, *, replicas: int | None = None,
                    default: bool | None = None, explicit: bool | None = None,
                    source: str = "api", persist: bool = True, **rollout: Any
                    ) -> dict[str, Any]:
        """Blue/green swap of one slot to (name, version) with `replicas` workers.

        replicas: the apply's, else the slot's current count, else config
        serving.replicas. default: whether `name` becomes the default model;
        None means yes for an operator's or a training job's apply, no for the
        watcher's and restarts (which follow the record's default).
        rollout: mode ("normal", "shadow", "canary"), fraction, keep_examples,
        gate (False skips the quality gate), min_accuracy."""
        check_name(name)
        self.store.resolve(name, version)  # fail fast: 404 before queueing
        t_call = time.monotonic()
        slot = self.slots.get(name)
        created = slot is None
        if slot is None:
            slot = self.slots[name] = Slot(name)
        if replicas is None:
            replicas = slot.wanted if not created else self.cfg["serving"]["replicas"]
        if self.cluster is not None and persist and source == "api":
            await self.cluster.check()  # 503 while the cluster store is unreachable
        slot.applying += 1
        try:
            async with slot.lock:
                result = await self._apply_locked(slot, version, replicas, default, explicit,
                                                  source, persist, t_call, **rollout)
            if self.cluster is not None and persist and not result.get("unchanged"):
                result["cluster"] = await self.cluster.after_change()  # revision, nodes
            return result
        finally:
            slot.applying -= 1
            if (not slot.replicas and not slot.busy and slot.version is None
                    and self.slots.get(name) is slot):
                del self.slots[name]  # a first apply that failed leaves no slot behind
                slot.unloaded = True
            slot.wake_all()

    async def _apply_locked(self, slot: Slot, version: int | None, replicas: int,
                            default: bool | None, explicit: bool | None, source: str,
                            persist: bool, t_call: float, mode: str = "normal",
                            fraction: float | None = None, keep_examples: int = 0,
                            gate: bool = True, min_accuracy: float | None = None
                            ) -> dict[str, Any]:
        name = slot.name
        if self.stopping:
            raise ServiceError("service is shutting down", 503, "stopping")
        if slot.unloaded:
            raise ServiceError(f"model {name!r} was unloaded while this apply waited", 409,
                               "unloaded")
        version, path = self.store.resolve(name, version)
        serving_now = slot.model_label() if slot.replicas else "nothing"
        try:
            self.store.check_artifact(name, version)
        except InvalidArtifact as exc:
            raise ServiceError(f"{exc}; {name} still serves {serving_now}", 422,
                               "invalid_model") from None
        if source == "api":  # an operator's explicit choice gets a fresh start
            slot.crashes.pop(version, None)
            slot.rolled_back.pop(version, None)
            self.failed_models.pop(f"{name} v{version}", None)
        elif version in slot.rolled_back and slot.rolled_back[version].get("auto"):
            raise ServiceError(f"{name} v{version} was rolled back automatically "
                               f"({slot.rolled_back[version]['reason']}); only an explicit "
                               "POST /apply brings it back", 409, "rolled_back")
        if mode != "normal":
            return await self._start_candidate(slot, version, path, replicas, mode,
                                               fraction, keep_examples, source, t_call)
        phases: dict[str, float] = {"queued": time.monotonic() - t_call}
        old = list(slot.replicas)
        previous = {"name": name, "version": slot.version} if old else None
        if (old and slot.version == version and len(old) == replicas
                and source in ("watcher", "startup")):
            return {"previous": previous, "current": previous, "unchanged": True}
        if source == "watcher" and self.cluster is not None and self.cluster.stale(name, version):
            # cluster mode: a newer record (maybe this node's own apply, which
            # held the lock) superseded the one this apply was queued for
            return {"previous": previous, "current": previous, "unchanged": True}
        t = time.monotonic()
        p = slot.probation
        reused = (p is not None and p.version == version and len(p.workers) == replicas
                  and all(w.usable for w in p.workers))
        if reused:  # the version in probation is still loaded: the swap is all there is
            assert p is not None
            self._cancel_probation(slot)
            ready = [(w, w.ready.result() if w.ready.done() else {}, True) for w in p.workers]
        else:
            what = (f"applying {name} v{version} with {replicas} "
                    f"replica{'s' if replicas != 1 else ''}")
            await self._make_room(replicas, what)
            new = self._obtain(name, version, replicas, what)
            try:
                ready = list(await gen.multi([self._make_ready(w, name, version, path)
                                              for w in new]))
            except ApplyFailed as exc:
                for w in new:
                    if w.alive and w.state is not State.SERVING:
                        self.loop.spawn_callback(w.stop, 1.0)
                self.pool.ensure(delay=1.0)
                self.events.emit("apply_failed", name=name, version=version, source=source,
                                 reason=str(exc))
                exc.args = (f"{exc}; {name} still serves {serving_now}",)
                raise
        phases["spawn"] = time.monotonic() - t  # boot + load, all replicas at once
        workers = [w for w, _, _ in ready]
        gate_info = None
        if source in ("api", "train"):
            t = time.monotonic()
            try:
                gate_info = await self._quality_gate(slot, version, workers, gate, min_accuracy)
            except Conflict as exc:
                if reused:
                    for w in workers:
                        w.set_state(State.DRAINING)
                self.loop.spawn_callback(self._retire, workers)
                self.events.emit("gate_refused", name=name, version=version, source=source,
                                 from_version=slot.version, reason=str(exc),
                                 details=exc.details)
                raise
            phases["gate"] = time.monotonic() - t
        t = time.monotonic()
        # re-read what serves now: an automatic rollback may have swapped the
        # slot while the new workers loaded or the gate scored them
        old = list(slot.replicas)
        previous = {"name": name, "version": slot.version} if old else None
        if explicit is not None:
            slot.explicit = explicit
        elif source == "api" or (source == "train" and not self._demo_training):
            slot.explicit = True
        elif source == "train":
            slot.explicit, self._demo_training = False, False
        self._swap(slot, workers, version, replicas)
        make_default = default if default is not None else source in ("api", "train")
        old_default = self.default_name
        if make_default or self.default_name is None and source not in ("startup", "watcher"):
            self.default_name = name
            if old_default != name:
                self.previous_default = old_default
        if persist:
            self._save_record(name)
        phases["swap"] = time.monotonic() - t
        log.info("%s now serves v%s on %d replica(s) (pids %s; %s)", name, version,
                 len(workers), ", ".join(str(w.pid) for w in workers), source)
        self.pool.ensure(delay=2.0)
        self.pool.refresh()
        if self.default_name != old_default and old_default:
            self._retire_demo(old_default)
        t = time.monotonic()
        ended = await self._after_swap(slot, old, previous, version)
        phases["drain_stop"] = time.monotonic() - t
        preloaded = all(p for _, _, p in ready)
        first = ready[0][1]
        result = {
            "previous": previous,
            "current": {"name": name, "version": version},
            "replicas": len(workers),
            "default": self.default_name == name,
            "worker": {"generation": workers[0].generation, "pid": workers[0].pid},
            "workers": [{"generation": w.generation, "pid": w.pid} for w in workers],
            "phases_s": {k: round(v, 4) for k, v in phases.items()},
            "preloaded": preloaded,
            "from_probation": reused,
            "load_s": round(first.get("load_s", 0.0), 4),
            "warmup_s": round(first.get("warm_s", 0.0), 4),
            "old_worker": ended[0] if ended else None,
            "old_workers": ended,
            "probation": slot.probation.describe() if slot.probation else None,
            "gate": gate_info,
            "source": source,
            "total_s": round(time.monotonic() - t_call, 4),
        }
        # the old single-worker phase names, for existing clients
        result["phases_s"].update({"drain": result["phases_s"]["drain_stop"], "stop": 0.0,
                                   "load": 0.0})
        slot.last_apply = self.last_apply = result
        self.events.emit("apply", name=name, version=version, source=source,
                         from_version=previous["version"] if previous else None,
                         phases=result["phases_s"], replicas=len(workers),
                         details={"gate": gate_info, "from_probation": reused,
                                  "preloaded": preloaded})
        return result

    # -- rollouts: probation, rollback, the gate, shadow and canary ------------------
    def _swap(self, slot: Slot, workers: list[WorkerHandle], version: int,
              replicas: int) -> None:
        """Route the slot to `workers`: one assignment. The caller decides what
        becomes of the workers that served before."""
        for w in workers:
            w.slot, w.on_answer = slot, slot.on_answer
            if w.state is not State.SERVING:
                w.set_state(State.SERVING)
        slot.replicas = workers  # the swap
        for w in workers:
            w.send({"t": "serve"})  # leaves the standby's low priority
        if slot.version is not None and slot.version != version:
            slot.previous = slot.version
        slot.version, slot.labels, slot.wanted = version, list(workers[0].labels), replicas
        # the old version's p99 is the yardstick of the automatic rollback: a
        # version that served only a few requests (swapped right back) has none
        enough = len(slot.stats.latencies) >= max(100, self.cfg["rollout"]["min_requests"])
        slot.stats_before_swap = slot.stats.p(0.99) if enough else None
        slot.stats = VersionStats()
        slot.failed = None
        slot.wake_all()

    async def _after_swap(self, slot: Slot, old: list[WorkerHandle],
                          previous: dict[str, Any] | None, version: int
                          ) -> list[dict[str, Any]]:
        """The previous version's workers: kept idle in probation (a rollback
        is then one assignment), or drained and stopped."""
        probation_s = self.cfg["rollout"]["probation_s"]
        if self.stopping or not old or previous is None or previous["version"] == version \
                or probation_s <= 0:
            return await self._retire(old)
        if slot.probation is not None:  # one probation per slot: the newest
            self.loop.spawn_callback(self._retire, self._cancel_probation(slot))
        old_p99 = slot.stats_before_swap
        for w in old:
            w.set_state(State.IDLE)
        p = Probation(version=previous["version"], workers=old, new_version=version,
                      until=time.monotonic() + probation_s, old_p99=old_p99)
        p.timer = self.loop.call_later(probation_s, self._end_probation, slot, p)
        slot.probation = p
        log.info("%s v%s stays loaded in probation for %.0fs (rollback is instant)",
                 slot.name, p.version, probation_s)
        # in-flight requests on the old workers still finish: wait for them
        drained = await gen.multi([w.wait_idle(self.wcfg["drain_timeout"]) for w in old])
        return [{"generation": w.generation, "pid": w.pid, "drained": d, "ended": "probation"}
                for w, d in zip(old, drained)]

    def _cancel_probation(self, slot: Slot) -> list[WorkerHandle]:
        p, slot.probation = slot.probation, None
        if p is None:
            return []
        if p.timer is not None:
            self.loop.remove_timeout(p.timer)
        return p.workers

    def _end_probation(self, slot: Slot, p: Probation) -> None:
        if slot.probation is not p:
            return
        slot.probation = None
        log.info("probation of %s v%s ended: its workers stop", slot.name, p.version)
        self.events.emit("probation_ended", name=slot.name, from_version=p.version,
                         to_version=p.new_version, details=p.new_stats.describe())
        self.loop.spawn_callback(self._retire, p.workers)

    async def _make_room(self, n: int, what: str) -> None:
        """Free budget for n workers (minus the standbys they can take):
        probation workers are the first to go."""
        if not self.pool.max_workers:
            return
        need = n - len([w for w in self.pool.standby if w.alive])
        for slot in sorted(self.slots.values(), key=lambda s: s.probation.started
                           if s.probation else 0.0):
            if need <= 0 or self.pool.has_room(need):
                return
            if slot.probation is not None:
                log.info("ending the probation of %s v%s early: %s needs room", slot.name,
                         slot.probation.version, what)
                await self._retire(self._cancel_probation(slot))

    def _rollback_now(self, slot: Slot, reason: str, auto: bool,
                      figures: dict[str, Any] | None = None) -> dict[str, Any]:
        """Within probation: the previous version serves again, in one
        assignment; the rolled-back version's workers drain and stop."""
        p = slot.probation
        assert p is not None
        self._cancel_probation(slot)
        bad_version, bad = slot.version, list(slot.replicas)
        for w in bad:
            if w.state is State.SERVING:
                w.set_state(State.DRAINING)  # no new requests from now on
        self._swap(slot, p.workers, p.version, len(p.workers))
        slot.previous = None
        info = {"version": bad_version, "reason": reason, "auto": auto, "figures": figures,
                "at": time.time(), "back_to": p.version}
        slot.rolled_back[bad_version] = info  # type: ignore[index]
        self._save_record(slot.name)
        (log.warning if auto else log.info)(
            "%s rolled back from v%s to v%s (%s): %s", slot.name, bad_version, p.version,
            "automatic" if auto else "manual", reason)
        self.events.emit("rollback", name=slot.name, source="auto" if auto else "api",
                         from_version=bad_version, to_version=p.version, reason=reason,
                         details=figures)
        self.loop.spawn_callback(self._retire, bad)
        return info

    async def rollback(self, name: str, source: str = "api") -> dict[str, Any]:
        """POST /rollback: the previous version serves again. Within probation
        it is one routing assignment; after it, an apply of that version."""
        check_name(name)
        slot = self._slot_for(name)
        t0 = time.monotonic()
        if slot.probation is not None and all(w.usable for w in slot.probation.workers):
            info = self._rollback_now(slot, "manual rollback", auto=False)
            return {"name": name, "from_version": info["version"], "to_version": info["back_to"],
                    "instant": True, "took_s": round(time.monotonic() - t0, 6)}
        if not slot.previous:
            raise Conflict(f"{name} has no previous version to roll back to", code="no_previous")
        target, bad = slot.previous, slot.version
        result = await self.apply(name, target, default=False, source="rollback")
        slot.rolled_back[bad] = {"version": bad, "reason": "manual rollback", "auto": False,  # type: ignore[index]
                                 "figures": None, "at": time.time(), "back_to": target}
        self.events.emit("rollback", name=name, source=source, from_version=bad,
                         to_version=target, reason="manual rollback after probation",
                         phases=result.get("phases_s"))
        return {"name": name, "from_version": bad, "to_version": target, "instant": False,
                "took_s": round(time.monotonic() - t0, 6), "apply": result}

    def _check_probations(self) -> None:
        """Once a second: roll back a version in probation whose error rate or
        tail latency went past the configured limits."""
        r = self.cfg["rollout"]
        for slot in list(self.slots.values()):
            p = slot.probation
            if p is None or p.new_version != slot.version:
                continue
            s = p.new_stats
            if s.requests < r["min_requests"]:
                continue
            figures = {"new_version": s.describe(),
                       "previous_p99_ms": None if p.old_p99 is None else round(1000 * p.old_p99, 3)}
            if s.error_rate > r["max_error_rate"]:
                self._rollback_now(slot, f"error rate {s.error_rate:.1%} above "
                                   f"rollout.max_error_rate {r['max_error_rate']:.1%}",
                                   auto=True, figures=figures)
                continue
            p99 = s.p(0.99)
            if p.old_p99 and p99 and p99 > r["max_latency_ratio"] * p.old_p99 and (
                    p99 - p.old_p99) * 1000 > r["latency_slack_ms"]:
                self._rollback_now(slot, f"p99 latency {1000 * p99:.1f} ms above "
                                   f"{r['max_latency_ratio']}x the previous version's "
                                   f"{1000 * p.old_p99:.1f} ms", auto=True, figures=figures)

    # the quality gate
    async def _quality_gate(self, slot: Slot, version: int, workers: list[WorkerHandle],
                            enabled: bool, min_accuracy: float | None) -> dict[str, Any] | None:
        golden = self.golden.get(slot.name)
        if golden is None:
            if min_accuracy is not None and enabled:
                raise ServiceError(f"min_accuracy needs a golden set: register one with PUT "
                                   f"/models/{slot.name}/golden", 422, "no_golden_set")
            return None
        if not enabled:
            log.warning("quality gate of %s v%s skipped on request", slot.name, version)
            return {"skipped": True}
        texts, truth = golden["texts"], golden["labels"]
        floor = min_accuracy if min_accuracy is not None else golden.get("min_accuracy")
        cand = rollouts_score(workers[0].labels, await self._score_on(workers[0], texts), truth)
        serving = None
        if slot.replicas and slot.version != version:
            key = (slot.version, golden["sha256"])
            serving = slot.gate_cache.get(key)
            if serving is None:
                serving = rollouts_score(slot.labels, await self._score_on(slot.replicas[0],
                                                                           texts), truth)
                slot.gate_cache[key] = serving
        tol = self.cfg["rollout"]["gate_tolerance"]
        reasons = []
        if serving and cand["accuracy"] < serving["accuracy"] - tol:
            reasons.append(f"accuracy {cand['accuracy']:.4f} on the golden set is below the "
                           f"serving v{slot.version}'s {serving['accuracy']:.4f} minus "
                           f"rollout.gate_tolerance {tol}")
        if floor is not None and cand["accuracy"] < floor:
            reasons.append(f"accuracy {cand['accuracy']:.4f} is below min_accuracy {floor}")
        info = {"passed": not reasons, "golden_examples": len(texts), "tolerance": tol,
                "min_accuracy": floor, "candidate": {"version": version, **cand},
                "serving": None if serving is None else {"version": slot.version, **serving},
                "per_label_changes": label_changes(serving, cand) if serving else None}
        if reasons:
            raise Conflict(f"quality gate refused {slot.name} v{version}: "
                           + "; ".join(reasons), code="quality_gate", details={"gate": info})
        return info

    async def _score_on(self, w: WorkerHandle, texts: list[str]) -> list:
        step = self.wcfg["max_batch"]
        parts = await gen.multi([w.predict(texts[i:i + step]) for i in range(0, len(texts), step)])
        return [row for part in parts for row in part]

    # shadow and canary
    async def _start_candidate(self, slot: Slot, version: int, path: str, replicas: int,
                               mode: str, fraction: float | None, keep_examples: int,
                               source: str, t_call: float) -> dict[str, Any]:
        if not slot.replicas:
            raise Conflict(f"nothing serves {slot.name} yet: apply a version normally "
                           "before a shadow or canary", code="not_serving")
        if version == slot.version:
            raise Conflict(f"{slot.name} v{version} already serves", code="already_serving")
        if slot.candidate is not None:  # replaced: recorded as an abort, with its figures
            old = slot.candidate
            self.events.emit("abort", name=slot.name, source=source, from_version=slot.version,
                             to_version=old.version, details=old.describe(),
                             reason=f"replaced by a {mode} of v{version}")
            self.loop.spawn_callback(self._retire, self._drop_candidate(slot))
        fraction = fraction if fraction is not None else (1.0 if mode == "shadow" else 0.1)
        what = f"a {mode} of {slot.name} v{version}"
        await self._make_room(replicas, what)
        new = self._obtain(slot.name, version, replicas, what)
        try:
            ready = list(await gen.multi([self._make_ready(w, slot.name, version, path)
                                          for w in new]))
        except ApplyFailed:
            for w in new:
                if w.alive:
                    self.loop.spawn_callback(w.stop, 1.0)
            self.pool.ensure(delay=1.0)
            raise
        workers = [w for w, _, _ in ready]
        for w in workers:
            w.slot, w.on_answer = slot, slot.on_answer
            w.set_state(State.SERVING)
            w.send({"t": "serve"})
        slot.candidate = Candidate(version=version, workers=workers, mode=mode,
                                   fraction=fraction, keep_examples=keep_examples)
        log.info("%s v%s runs as a %s candidate beside v%s (fraction %.3f)", slot.name,
                 version, mode, slot.version, fraction)
        self.events.emit(mode, name=slot.name, source=source, from_version=slot.version,
                         to_version=version, details={"fraction": fraction})
        self.pool.ensure(delay=2.0)
        return {"name": slot.name, "mode": mode, "serving": {"name": slot.name,
                                                              "version": slot.version},
                "candidate": {"name": slot.name, "version": version}, "fraction": fraction,
                "workers": [{"generation": w.generation, "pid": w.pid} for w in workers],
                "total_s": round(time.monotonic() - t_call, 4)}

    def _drop_candidate(self, slot: Slot) -> list[WorkerHandle]:
        c, slot.candidate = slot.candidate, None
        if c is None:
            return []
        for w in c.workers:
            if w.state is State.SERVING:
                w.set_state(State.DRAINING)
        return c.workers

    async def promote(self, name: str, gate: bool = True) -> dict[str, Any]:
        """The shadow or canary candidate serves all traffic: one assignment."""
        slot = self._slot_for(name)
        async with slot.lock:
            c = slot.candidate
            if c is None:
                raise Conflict(f"{name} has no shadow or canary candidate to promote",
                               code="no_candidate")
            gate_info = await self._quality_gate(slot, c.version, c.workers, gate, None)
            t0 = time.monotonic()
            slot.candidate = None
            old, previous = list(slot.replicas), {"name": name, "version": slot.version}
            self._swap(slot, c.workers, c.version, len(c.workers))
            self._save_record(name)
            took = time.monotonic() - t0
            log.info("%s v%s promoted from %s", name, c.version, c.mode)
            self.events.emit("promote", name=name, source="api", from_version=previous["version"],
                             to_version=c.version, details={"mode": c.mode, **c.describe(),
                                                            "gate": gate_info})
            ended = await self._after_swap(slot, old, previous, c.version)
        return {"name": name, "from_version": previous["version"], "to_version": c.version,
                "mode": c.mode, "swap_s": round(took, 6), "gate": gate_info,
                "old_workers": ended, "figures": c.describe()}

    async def abort(self, name: str) -> dict[str, Any]:
        slot = self._slot_for(name)
        c = slot.candidate
        if c is None:
            raise Conflict(f"{name} has no shadow or canary candidate to abort",
                           code="no_candidate")
        figures = c.describe()
        workers = self._drop_candidate(slot)
        self.events.emit("abort", name=name, source="api", from_version=slot.version,
                         to_version=c.version, details=figures)
        ended = await self._retire(workers)
        self.pool.ensure()
        return {"name": name, "aborted_version": c.version, "mode": c.mode, "figures": figures,
                "workers": ended}

    def rollout_status(self, name: str) -> dict[str, Any]:
        slot = self._slot_for(name)
        return {"name": name, "version": slot.version, "previous_version": slot.previous,
                "probation": slot.probation.describe() if slot.probation else None,
                "candidate": slot.candidate.describe() if slot.candidate else None,
                "serving": slot.stats.describe(),
                "rolled_back": list(slot.rolled_back.values())}

    def _retire_demo(self, name: str) -> None:
        """The first-start demo is a convenience, not a tenant: once another
        model is the default, its slot goes (unless someone applied it)."""
        slot = self.slots.get(name)
        if slot is not None and not slot.explicit:
            log.info("the first-start demo model %r is no longer the default: unloading it "
                     "(apply it explicitly to keep it)", name)
            self.loop.spawn_callback(self._unload_logged, name, "demo_retired")

    def _save_record(self, changed: str | None = None) -> None:
        """Persist what serves; `changed`: the one slot this change was about."""
        models = {n: {"version": s.version, "replicas": s.wanted, "explicit": s.explicit}
                  for n, s in sorted(self.slots.items()) if s.version is not None}
        self.record = {"default": self.default_name if self.default_name in models else None,
                       "models": models, "revision": self.record.get("revision", 0) + 1}
        if self.cluster is not None:  # merged into the Redis record (that slot only)
            self.cluster.note_record(self.record, changed)
            return
        if self.watcher:
            self.watcher.note_record(self.record)
        self.store.write_record(self.record)

    # -- unload -------------------------------------------------------------------
    async def unload(self, name: str, *, source: str = "api", persist: bool = True
                     ) -> dict[str, Any]:
        """Stop serving a model: out of routing at once, then drain and stop.
        The store keeps every version."""
        check_name(name)
        slot = self._slot_for(name)
        if self.cluster is not None and persist and source == "api":
            await self.cluster.check()  # 503 while the cluster store is unreachable
        async with slot.lock:
            if self.slots.get(name) is not slot:
                raise UnknownModel(f"model {name!r} is not serving here")
            del self.slots[name]
            slot.unloaded = True
            old, slot.replicas = slot.replicas, []
            slot.wake_all()
            was_default = self.default_name == name
            if was_default:
                self.default_name = None
            if persist:
                self._save_record(name)
            log.info("unloaded %s v%s (%s)", name, slot.version, source)
            self.events.emit("unload", name=name, version=slot.version, source=source)
            ended = await self._retire(old)
        self.pool.ensure()
        out = {"unloaded": {"name": name, "version": slot.version}, "workers": ended,
               "default": self.default_name, "was_default": was_default}
        if self.cluster is not None and persist:
            out["cluster"] = await self.cluster.after_change()
        return out

    # -- failures -------------------------------------------------------------------
    def _on_worker_exit(self, w: WorkerHandle) -> None:
        self.exits.append({"generation": w.generation, "pid": w.pid, "exitcode": w.exitcode,
                           "state": w.state.value, "model": w.model, "error": w.error,
                           "at": time.time()})
        if self.stopping:
            return
        slot: Slot | None = getattr(w, "slot", None)
        if slot is None:
            return
        p, c = slot.probation, slot.candidate
        if p is not None and w in p.workers:  # an idle previous version died
            p.workers.remove(w)
            if not p.workers:
                self._cancel_probation(slot)
            return
        if c is not None and w in c.workers:
            c.workers.remove(w)
            log.error("%s candidate gen %d died: exit code %s", w.model_label, w.generation,
                      w.exitcode)
            if not c.workers:
                slot.candidate = None
                self.events.emit("abort", name=slot.name, source="auto", to_version=c.version,
                                 reason=f"candidate crashed (exit code {w.exitcode})",
                                 details=c.describe())
            return
        if not slot.remove_replica(w):
            return
        self.restarts += 1
        log.error("%s replica gen %d (pid %d) died: exit code %s; %d replica(s) left",
                  w.model_label, w.generation, w.pid, w.exitcode, len(slot.replicas))
        self.events.emit("crash", name=slot.name, version=slot.version, pid=w.pid,
                         exitcode=w.exitcode, reason=w.error)
        if (p is not None and p.new_version == slot.version
                and all(x.usable for x in p.workers)):
            # a crash of the version in probation: back to the previous one at
            # once; the dead worker's requests are retried there
            self._rollback_now(slot, f"worker crashed (exit code {w.exitcode}) during "
                               "probation", auto=True,
                               figures={"exitcode": w.exitcode, "error": w.error,
                                        "new_version": p.new_stats.describe()})
            return
        slot.replacing += 1  # now: requests arriving meanwhile must wait, not fail
        self.loop.spawn_callback(self._recover, slot, w)

    async def _recover(self, slot: Slot, dead: WorkerHandle) -> None:
        """Replace one dead replica, or give up on its version.

        Every crash (and every failed restart) of a version counts; more than
        max_restarts within restart_window, or a load failure (exit code 4,
        not worth retrying), marks it FAILED and the version served before,
        if any, is applied instead."""
        assert dead.model is not None
        version = dead.model["version"]
        window = self.wcfg["restart_window"]
        try:
            while not self.stopping and not slot.unloaded and slot.version == version:
                n = slot.count_crash(version, window)
                if n > self.wcfg["max_restarts"]:
                    await self._give_up(slot, version, f"worker crashed {n} times within "
                                        f"{window:.0f}s (last: exit code {dead.exitcode}, "
                                        f"{dead.error})")
                    return
                backoff = 0.0 if n <= 1 else min(5.0, 0.25 * 2 ** (n - 2))
                if backoff:
                    await gen.sleep(backoff)
                try:
                    await self._add_replica(slot, version, "restart")
                    return
                except ApplyFailed as exc:
                    log.error("restart of %s v%s failed: %s", slot.name, version, exc)
                    if exc.code == "model_load_failed":
                        await self._give_up(slot, version, f"cannot load: {exc}")
                        return
                except StoreError as exc:
                    await self._give_up(slot, version, f"cannot restart: {exc}")
                    return
                except Conflict as exc:
                    log.error("restart of %s v%s waits for room: %s", slot.name, version, exc)
                    await gen.sleep(1.0)
        finally:
            slot.replacing -= 1
            slot.wake_all()

    async def _add_replica(self, slot: Slot, version: int, why: str) -> WorkerHandle | None:
        """One more serving replica of `version` (a crash replacement or a
        recycling successor); None if the slot moved on meanwhile."""
        version, path = self.store.resolve(slot.name, version)
        (w,) = self._obtain(slot.name, version, 1, f"a {why} of {slot.name} v{version}")
        w, _, _ = await self._make_ready(w, slot.name, version, path)
        if slot.unloaded or slot.version != version or self.stopping:
            self.loop.spawn_callback(w.stop, self.wcfg["stop_timeout"])
            return None
        slot.add_replica(w)
        w.send({"t": "serve"})
        log.info("%s v%s: replica gen %d (pid %d) serves (%s)", slot.name, version,
                 w.generation, w.pid, why)
        self.events.emit(why, name=slot.name, version=version, pid=w.pid)
        self.pool.ensure(delay=2.0)
        return w

    async def _give_up(self, slot: Slot, version: int, reason: str) -> None:
        log.error("model %s v%s marked FAILED: %s", slot.name, version, reason)
        info = {"name": slot.name, "version": version, "reason": reason, "at": time.time()}
        self.failed_models[f"{slot.name} v{version}"] = info
        self.events.emit("failed", name=slot.name, version=version, reason=reason)
        if slot.replicas:
            return  # other replicas of it still answer; an operator decides
        slot.failed = info
        fallback = slot.previous
        if fallback and fallback != version:
            log.info("falling back to %s v%s, served before", slot.name, fallback)
            await self._apply_logged(slot.name, fallback, "fallback", default=False)
        elif self.default_name == slot.name and self.previous_default in self.slots and (
                self.slots[self.previous_default].replicas):
            # no earlier version to go back to: the model that was the default
            # before it (still serving in its own slot) answers again
            log.info("default model %s FAILED: %s is the default again", slot.name,
                     self.previous_default)
            self.default_name, self.previous_default = self.previous_default, None
            self._save_record()

    def _sweep(self) -> None:
        """Once a second: fail requests past their deadline, kill hung workers,
        judge versions in probation, recycle workers past their limits."""
        self._check_probations()
        limit = self.wcfg["hang_timeout"]
        for w in list(self.pool.workers.values()):
            w.expire(self.wcfg["request_timeout"])
            if w.state in (State.SERVING, State.DRAINING, State.IDLE) and (
                    w.oldest_request_age() > limit):
                log.error("worker gen %d has not answered for %.0fs: killing it as hung",
                          w.generation, limit)
                w.error = f"hung: no answer for {limit:.0f}s"
                w.kill()
        max_requests, max_rss = self.wcfg["max_requests"], self.wcfg["max_rss_mb"]
        if not (max_requests or max_rss):
            return
        now = time.monotonic()
        for slot in self.slots.values():
            for w in slot.replicas:
                if getattr(w, "recycle_after", 0.0) > now:
                    continue
                why = None
                if max_requests and w.served >= max_requests:
                    why = f"served {w.served} requests (worker.max_requests {max_requests})"
                elif max_rss and (w.rss() or 0) > max_rss * 2 ** 20:
                    why = f"RSS above worker.max_rss_mb {max_rss}"
                if why:
                    w.recycle_after = now + 3600.0  # one recycle at a time per worker
                    self.loop.spawn_callback(self._recycle, slot, w, why)

    async def _recycle(self, slot: Slot, w: WorkerHandle, why: str) -> None:
        """Retire a worker after its successor serves: requests see no gap."""
        log.info("recycling %s replica gen %d (pid %d): %s", w.model_label, w.generation,
                 w.pid, why)
        try:
            new = await self._add_replica(slot, slot.version or 0, "recycle")
        except (ServiceError, StoreError) as exc:
            log.warning("recycling gen %d postponed: %s", w.generation, exc)
            w.recycle_after = time.monotonic() + 30.0
            return
        if new is not None and slot.remove_replica(w):
            await self._retire([w])

    # -- status -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        me = psutil.Process()
        described = {g: w.describe() for g, w in sorted(self.pool.workers.items())}
        models = {n: s.describe([described[w.generation] for w in s.replicas
                                 if w.generation in described])
                  for n, s in sorted(self.slots.items())}
        default = self.slots.get(self.default_name or "")
        serving = None
        if default is not None and default.replicas:
            first = default.replicas[0]
            serving = {"name": default.name, "version": default.version,
                       "generation": first.generation, "pid": first.pid,
                       "labels": default.labels, "replicas": len(default.replicas)}
        pool = self.pool.describe()
        workers = list(described.values())
        return {
            "supervisor": {"pid": os.getpid(), "uptime_s": round(time.time() - self.started, 3),
                           "rss_bytes": me.memory_info().rss,
                           "models_dir": self.store.root, "stopping": self.stopping},
            "default": self.default_name,
            "models": models,
            "serving": serving,
            "workers": workers,
            "draining": [w["generation"] for w in workers if w["state"] == "DRAINING"],
            "standby": pool[0] if pool else None,
            "pool": pool,
            "budget": {"max_workers": self.pool.max_workers or None, "workers": len(workers),
                       "standby_pool": self.pool.size},
            "restarts": self.restarts,
            "recent_exits": list(self.exits),
            "failed_models": list(self.failed_models.values()),
            "last_apply": self.last_apply,
            "record_revision": self.record.get("revision", 0),
            "jobs": self.jobs.list(),
            "cluster": None if self.cluster is None else self.cluster.cluster.status(),
        }


def _least_busy(workers: list[WorkerHandle], cap: int) -> WorkerHandle | None:
    best = None
    for w in workers:
        if w.usable and w.inflight < cap and (best is None or w.inflight < best.inflight):
            best = w
    return best


# -- entry point ---------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="textswap: train short-text classifiers and serve them with "
                    "zero-downtime model switching.")
    p.add_argument("--config", help="YAML config file (built-in defaults when omitted)")
    p.add_argument("--host", help="inference API bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="inference API port (default 8080)")
    p.add_argument("--manage-host", help="management API bind address (default 127.0.0.1)")
    p.add_argument("--manage-port", type=int, help="management API port (default 8081)")
    p.add_argument("--models-dir", help="model store folder (default ./models)")
    p.add_argument("--redis-url", help="cluster mode: the cluster store, e.g. "
                                       "redis://host:6379/0 (default: off)")
    p.add_argument("--node-id", help="cluster mode: this node's name (default hostname:port)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    server = {k: v for k, v in (("host", args.host), ("port", args.port),
                                ("manage_host", args.manage_host),
                                ("manage_port", args.manage_port)) if v is not None}
    overrides: dict[str, Any] = {"server": server} if server else {}
    if args.models_dir:
        overrides["models_dir"] = args.models_dir
    cluster = {k: v for k, v in (("redis_url", args.redis_url), ("node_id", args.node_id))
               if v is not None}
    if cluster:
        overrides["cluster"] = cluster
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = build_config(args)
    except (ConfigError, OSError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config["log_level"],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config["cluster"]["redis_url"]:  # nodes share the store: it must be writable
        from cluster.node import check_store_writable
        try:
            check_store_writable(config.models_dir)
        except RuntimeError as exc:
            print(f"cannot start: {exc}", file=sys.stderr)
            return 2
    from frontend.app import start_servers  # Tornado apps; no TensorFlow anywhere

    loop = IOLoop.current()
    sup = Supervisor(config)
    exit_code = 0

    servers: list = []

    async def stop() -> None:
        for server in servers:  # no new connections; in-flight requests finish below
            server.stop()
        await sup.shutdown()
        loop.stop()

    async def boot() -> None:
        nonlocal exit_code
        try:
            servers.extend(start_servers(sup, config))
        except OSError as exc:
            log.error("cannot listen: %s", exc)
            exit_code = 1
            await sup.shutdown()
            loop.stop()
            return
        await sup.start()
        s = config["server"]
        log.info("inference API on http://%s:%d, management API on http://%s:%d",
                 s["host"], s["port"], s["manage_host"], s["manage_port"])

    # Long-lived startup objects out of the collector's way, and fewer young
    # collections: the request path allocates many short-lived objects.
    gc.freeze()
    gc.set_threshold(20000, 20, 20)
    # the event loop's own signal handling: the handler runs on the loop
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.asyncio_loop.add_signal_handler(  # type: ignore[attr-defined]
            signum, lambda: loop.spawn_callback(stop))
    loop.add_callback(boot)
    loop.start()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
