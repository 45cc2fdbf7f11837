"""Applies and unloads: the blue/green switch of one slot, and the applied record.

`Applies` orchestrates the operator's changes of what serves: `apply` (load
the new version beside the serving one, pass the quality gate, swap, keep
the old one in probation or drain it), `unload`, and following a record
changed from outside (the watcher, or the cluster). It asks the provisioner
for workers, the rollouts for the gate, candidates and probation, the record
keeper to persist; every change of the serving state (slots made and
dropped, the swap, the default) is a call of the serving controller
(control/servingctl.py), its one writer.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tornado import gen

from state.errors import ApplyFailed, Conflict, ServiceError, StorageFailed, UnknownModel
from state.store import InvalidArtifact, StoreError, check_name
from control.slots import Slot
from control.workerhandle import Frame, State, WorkerHandle

if TYPE_CHECKING:
    from state.config import Config
    from control.events import Events
    from control.pool import WorkerPool
    from control.provision import Provisioner
    from control.records import RecordBackend, RecordKeeper
    from control.rollout_control import RolloutControl
    from control.routing import Router
    from control.serving import AppliedRecord, RecordEntry
    from control.servingctl import ApplyResult, ModelRef, ServingController
    from state.store import ModelStore
    from tornado.ioloop import IOLoop

log = logging.getLogger("textswap.supervisor")


class Applies:
    """Switches slots to versions, unloads them, and keeps the record."""

    def __init__(self, ctl: "ServingController", cfg: "Config", loop: "IOLoop",
                 store: "ModelStore", pool: "WorkerPool", events: "Events",
                 records: "RecordBackend", keeper: "RecordKeeper", provision: "Provisioner",
                 router: "Router", rollouts: "RolloutControl") -> None:
        self.ctl, self.serving = ctl, ctl.serving
        self.cfg, self.wcfg, self.loop = cfg, cfg.worker, loop
        self.store, self.pool, self.events = store, pool, events
        self.records, self.keeper, self.provision = records, keeper, provision
        self.router, self.rollouts = router, rollouts

    def on_record_change(self, record: "AppliedRecord") -> None:
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
        for name, entry in wanted.items():
            slot = self.serving.slots.get(name)
            replicas = entry["replicas"] or (slot.wanted if slot else None)
            if (slot is None or not slot.replicas or slot.version != entry["version"]
                    or (replicas and replicas != slot.wanted)):
                if slot is not None and entry["version"] is None and slot.replicas and (
                        not replicas or replicas == slot.wanted):
                    continue  # "latest" of a serving model: no change asked
                self.loop.spawn_callback(self.apply_logged, name, entry["version"], "watcher",
                                         replicas=entry["replicas"], explicit=entry["explicit"])
        for name in list(self.serving.slots):
            if name not in wanted:
                self.loop.spawn_callback(self.unload_logged, name, "watcher")
        self.ctl.follow_record(record)

    async def apply_logged(self, name: str, version: int | None, source: str,
                            **kw: Any) -> None:
        try:
            await self.apply(name, version, source=source, persist=source == "fallback", **kw)
        except ServiceError as exc:
            log.error("apply of %s v%s (%s) failed: %s", name, version, source, exc)
        except StoreError as exc:
            log.error("apply of %s v%s (%s) ignored: %s", name, version, source, exc)

    async def unload_logged(self, name: str, source: str) -> None:
        try:
            await self.unload(name, source=source, persist=source != "watcher")
        except (ServiceError, StoreError) as exc:
            log.info("unload of %s (%s): %s", name, source, exc)

    async def apply(self, name: str, version: int | None = None, *, replicas: int | None = None,
                    default: bool | None = None, explicit: bool | None = None,
                    source: str = "api", persist: bool = True, **rollout: Any
                    ) -> "ApplyResult":
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
        created = name not in self.serving.slots
        slot = self.ctl.open_slot(name)
        if replicas is None:
            replicas = slot.wanted if not created else self.cfg.serving.replicas
        if persist and source == "api":
            await self.records.check()  # cluster: 503 while its store is unreachable
        self.ctl.begin_apply(slot)
        try:
            partial = rollout.pop("partial", False)  # cluster: let the ready nodes switch alone
            if persist and source in ("api", "train"):  # cluster: cluster/twophase.py
                await self.records.prepare_all(name, version, replicas, partial,
                                               rollout.get("mode"))
            async with slot.lock:
                result = await self.apply_locked(slot, version, replicas, default, explicit,
                                                  source, persist, t_call, **rollout)
            if persist and not result.get("unchanged"):
                after = await self.records.after_change()  # cluster: revision, nodes
                if after is not None:
                    result["cluster"] = after
            return result
        finally:
            self.ctl.end_apply(slot)  # a first apply that failed leaves no slot behind

    async def apply_locked(self, slot: Slot, version: int | None, replicas: int,
                            default: bool | None, explicit: bool | None, source: str,
                            persist: bool, t_call: float, mode: str = "normal",
                            fraction: float | None = None, keep_examples: int = 0,
                            gate: bool = True, min_accuracy: float | None = None
                            ) -> "ApplyResult":
        """The apply, holding the slot's lock: check, ready the new workers,
        gate them, persist and swap, then keep or drain the old ones."""
        run = self.check_apply(slot, version, source, t_call)
        if mode != "normal":
            return await self.rollouts.start_candidate(slot, run.version, run.path, replicas,
                                                       mode, fraction, keep_examples, source,
                                                       t_call)
        run.phases["queued"] = time.monotonic() - t_call
        if self.unchanged(slot, run.version, replicas, source):
            now: ModelRef | None = {"name": slot.name, "version": slot.version} \
                if slot.replicas else None
            return {"previous": now, "current": now, "unchanged": True}
        t = time.monotonic()
        await self.ready_workers(run, slot, replicas, source)
        run.phases["spawn"] = time.monotonic() - t  # boot + load, all replicas at once
        if source in ("api", "train"):
            t = time.monotonic()
            await self.pass_gate(run, slot, source, gate, min_accuracy)
            run.phases["gate"] = time.monotonic() - t
        t = time.monotonic()
        old, previous = await self.swap_in(run, slot, replicas, default, explicit, source,
                                           persist)
        run.phases["swap"] = time.monotonic() - t
        t = time.monotonic()
        ended = await self.rollouts.after_swap(slot, old, previous, run.version)
        run.phases["drain_stop"] = time.monotonic() - t
        return self.answer(run, slot, previous, ended, source, t_call)

    def check_apply(self, slot: Slot, version: int | None, source: str,
                    t_call: float) -> "ApplyRun":
        """Step 1: may this apply run? The version resolved and its artifact
        checked; an operator's apply forgets the version's past failures."""
        name = slot.name
        if self.serving.stopping:
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
            self.ctl.fresh_start(slot, version)
        elif version in slot.rolled_back and slot.rolled_back[version].get("auto"):
            raise ServiceError(f"{name} v{version} was rolled back automatically "
                               f"({slot.rolled_back[version]['reason']}); only an explicit "
                               "POST /apply brings it back", 409, "rolled_back")
        return ApplyRun(version, path, serving_now)

    def unchanged(self, slot: Slot, version: int, replicas: int, source: str) -> bool:
        """A followed or restarted apply of what serves already: nothing to do."""
        if (slot.replicas and slot.version == version and len(slot.replicas) == replicas
                and source in ("watcher", "startup")):
            return True
        # cluster mode: a newer record (maybe this node's own apply, which
        # held the lock) superseded the one this apply was queued for
        return source == "watcher" and self.records.stale(slot.name, version)

    async def ready_workers(self, run: "ApplyRun", slot: Slot, replicas: int,
                            source: str) -> None:
        """Step 2: the new version's workers, READY: the probation's when it
        holds that version, else standbys or new ones. A failure retires them
        and the old ones serve on."""
        name, version = slot.name, run.version
        p = slot.probation
        if (p is not None and p.version == version and len(p.workers) == replicas
                and all(w.usable for w in p.workers)):
            # the version in probation is still loaded: the swap is all there is
            run.reused = True
            workers = self.ctl.cancel_probation(slot)
            run.ready = [(w, w.ready.result() if w.ready.done() else {}, True)
                         for w in workers]
            return
        what = (f"applying {name} v{version} with {replicas} "
                f"replica{'s' if replicas != 1 else ''}")
        await self.provision.make_room(replicas, what)
        new = self.provision.obtain(name, version, replicas, what)
        try:
            run.ready = list(await gen.multi([self.provision.make_ready(w, name, version,
                                                                        run.path)
                                              for w in new]))
        except ApplyFailed as exc:
            for w in new:
                if w.alive and w.state is not State.SERVING:
                    self.loop.spawn_callback(w.stop, 1.0)
            self.pool.ensure(delay=1.0)
            self.events.emit("apply_failed", name=name, version=version, source=source,
                             reason=str(exc))
            exc.args = (f"{exc}; {name} still serves {run.serving_now}",)
            raise

    async def pass_gate(self, run: "ApplyRun", slot: Slot, source: str, gate: bool,
                        min_accuracy: float | None) -> None:
        """Step 3: the quality gate (an operator's or a job's apply). Refused:
        the new workers go, the old ones serve on."""
        try:
            run.gate_info = await self.rollouts.quality_gate(slot, run.version, run.workers,
                                                             gate, min_accuracy)
        except Conflict as exc:
            if run.reused:
                for w in run.workers:
                    w.set_state(State.DRAINING)
            self.loop.spawn_callback(self.provision.retire, run.workers)
            self.events.emit("gate_refused", name=slot.name, version=run.version,
                             source=source, from_version=slot.version, reason=str(exc),
                             details=exc.details)
            raise

    async def swap_in(self, run: "ApplyRun", slot: Slot, replicas: int,
                      default: bool | None, explicit: bool | None, source: str,
                      persist: bool) -> tuple[list[WorkerHandle], "ModelRef | None"]:
        """Step 4: persist, then switch. The record as it will be (the slot's
        flags and the default included) is written; the controller's swap
        runs in the step where the write completed. Returns the workers that
        served before and what they served."""
        name, version, workers = slot.name, run.version, run.workers
        new_explicit = slot.explicit
        if explicit is not None:
            new_explicit = explicit
        elif source == "api" or (source == "train" and not self.serving.demo_training):
            new_explicit = True
        elif source == "train":
            new_explicit = False
        end_demo = source == "train" and explicit is None and not new_explicit
        make_default = default if default is not None else source in ("api", "train")
        old_default = self.serving.default_name

        def new_default() -> str | None:
            if make_default or self.serving.default_name is None and source not in (
                    "startup", "watcher"):
                return name
            return self.serving.default_name
        seen: list[tuple[list[WorkerHandle], ModelRef | None]] = []

        def switch() -> None:
            seen.append(self.ctl.apply_switch(slot, workers, version, replicas, new_explicit,
                                              new_default(), end_demo))
        if persist:
            entry: RecordEntry = {"version": version, "replicas": replicas,
                                  "explicit": new_explicit}
            try:
                await self.keeper.commit(name, entry, default=new_default, switch=switch,
                                         strict=source != "fallback")
            except StorageFailed as exc:
                # nothing switched: the new workers go, the old ones serve on
                self.loop.spawn_callback(self.provision.retire, workers)
                self.events.emit("apply_failed", name=name, version=version, source=source,
                                 reason=str(exc))
                exc.args = (f"{exc}; {name} still serves {run.serving_now}",)
                raise
        else:
            switch()
        log.info("%s now serves v%s on %d replica(s) (pids %s; %s)", name, version,
                 len(workers), ", ".join(str(w.pid) for w in workers), source)
        self.pool.ensure(delay=2.0)
        self.pool.refresh()
        if self.serving.default_name != old_default and old_default:
            self.retire_demo(old_default)
        return seen[0]

    def answer(self, run: "ApplyRun", slot: Slot, previous: "ModelRef | None",
               ended: list[dict[str, object]], source: str, t_call: float) -> "ApplyResult":
        """Step 5: the apply's answer, kept by the slot and in the history."""
        name, version, workers = slot.name, run.version, run.workers
        preloaded = all(p for _, _, p in run.ready)
        first = run.ready[0][1]
        result: ApplyResult = {
            "previous": previous,
            "current": {"name": name, "version": version},
            "replicas": len(workers),
            "default": self.serving.default_name == name,
            "worker": {"generation": workers[0].generation, "pid": workers[0].pid},
            "workers": [{"generation": w.generation, "pid": w.pid} for w in workers],
            "phases_s": {k: round(v, 4) for k, v in run.phases.items()},
            "preloaded": preloaded,
            "from_probation": run.reused,
            "load_s": round(first.get("load_s", 0.0), 4),
            "warmup_s": round(first.get("warm_s", 0.0), 4),
            # how the workers compute the model: "lean" (model_worker/lean.py) or "keras"
            "engine": str(first.get("engine", "keras")),
            "old_worker": ended[0] if ended else None,
            "old_workers": ended,
            "probation": slot.probation.describe() if slot.probation else None,
            "gate": run.gate_info,
            "source": source,
            "total_s": round(time.monotonic() - t_call, 4),
        }
        self.ctl.note_apply(slot, result)
        self.events.emit("apply", name=name, version=version, source=source,
                         from_version=previous["version"] if previous else None,
                         phases=result["phases_s"], replicas=len(workers),
                         details={"gate": run.gate_info, "from_probation": run.reused,
                                  "preloaded": preloaded})
        return result

    def retire_demo(self, name: str) -> None:
        """The first-start demo is a convenience, not a tenant: once another
        model is the default, its slot goes (unless someone applied it)."""
        slot = self.serving.slots.get(name)
        if slot is not None and not slot.explicit:
            log.info("the first-start demo model %r is no longer the default: unloading it "
                     "(apply it explicitly to keep it)", name)
            self.loop.spawn_callback(self.unload_logged, name, "demo_retired")

    async def unload(self, name: str, *, source: str = "api", persist: bool = True
                     ) -> dict[str, object]:
        """Stop serving a model: out of routing at once, then drain and stop.
        The store keeps every version."""
        check_name(name)
        slot = self.router.slot_for(name)
        if persist and source == "api":
            await self.records.check()  # cluster: 503 while its store is unreachable
        async with slot.lock:
            if self.serving.slots.get(name) is not slot:
                raise UnknownModel(f"model {name!r} is not serving here")
            seen: list[tuple[list[WorkerHandle], bool]] = []

            def switch() -> None:
                seen.append(self.ctl.unload(slot))
            if persist:
                await self.keeper.commit(name, None, switch=switch, default=lambda: (
                    None if self.serving.default_name == name else self.serving.default_name))
            else:
                switch()
            old, was_default = seen[0]
            log.info("unloaded %s v%s (%s)", name, slot.version, source)
            self.events.emit("unload", name=name, version=slot.version, source=source)
            ended = await self.provision.retire(old)
        self.pool.ensure()
        out: dict[str, object] = {
            "unloaded": {"name": name, "version": slot.version}, "workers": ended,
            "default": self.serving.default_name, "was_default": was_default}
        if persist:
            after = await self.records.after_change()
            if after is not None:
                out["cluster"] = after
        return out


@dataclass
class ApplyRun:
    """One apply's progress through its steps (Applies.apply_locked)."""
    version: int
    path: str
    serving_now: str  # what serves before it, for its errors
    ready: list[tuple[WorkerHandle, Frame, bool]] = field(default_factory=list)
    reused: bool = False  # the workers of the version in probation
    gate_info: dict[str, object] | None = None
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def workers(self) -> list[WorkerHandle]:
        return [w for w, _, _ in self.ready]
