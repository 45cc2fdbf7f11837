"""Healing: worker exits, crash recovery, the once-a-second sweep, recycling.

`Healer` owns what happens when a worker dies (a replica is replaced with
backoff, a version crashing too often or failing to load is marked FAILED
and the version before it applied again; a crash in probation rolls back),
the sweep (request deadlines, hung workers, probation checks) and the
recycling of workers past `worker.max_requests` / `worker.max_rss_mb`
(successor first, so requests see no gap). It adds and removes replicas of
a slot through the serving controller (control/servingctl.py); it never
changes which version a slot serves except through the rollouts (rollback)
and the applies (fallback).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tornado import gen

from state.errors import ApplyFailed, Conflict, ServiceError
from state.store import StoreError
from control.slots import Slot
from control.workerhandle import State, WorkerHandle

if TYPE_CHECKING:
    from tornado.ioloop import IOLoop

    from state.config import Config
    from state.store import ModelStore
    from control.applies import Applies
    from control.events import Events
    from control.pool import WorkerPool
    from control.records import RecordKeeper
    from control.provision import Provisioner
    from control.rollout_control import RolloutControl
    from control.servingctl import ServingController

log = logging.getLogger("textswap.supervisor")


class Healer:
    """Replaces dead workers, kills hung ones, recycles old ones."""

    def __init__(self, ctl: "ServingController", cfg: "Config", loop: "IOLoop",
                 store: "ModelStore", pool: "WorkerPool", events: "Events",
                 provision: "Provisioner", applies: "Applies",
                 rollouts: "RolloutControl", keeper: "RecordKeeper") -> None:
        self.ctl, self.serving = ctl, ctl.serving
        self.cfg, self.wcfg, self.loop = cfg, cfg.worker, loop
        self.store, self.pool, self.events = store, pool, events
        self.provision, self.applies, self.rollouts = provision, applies, rollouts
        self.keeper = keeper

    def on_worker_exit(self, w: WorkerHandle) -> None:
        c = w.slot.candidate if isinstance(w.slot, Slot) else None
        slot, role = self.ctl.worker_exited(w, {
            "generation": w.generation, "pid": w.pid, "exitcode": w.exitcode,
            "state": w.state.value, "model": w.model, "error": w.error, "at": time.time()})
        if slot is None or role in ("", "probation"):
            return
        if role in ("candidate", "candidate_gone"):
            log.error("%s candidate gen %d died: exit code %s", w.model_label, w.generation,
                      w.exitcode)
            if role == "candidate_gone" and c is not None:
                self.events.emit("abort", name=slot.name, source="auto", to_version=c.version,
                                 reason=f"candidate crashed (exit code {w.exitcode})",
                                 details=c.describe())
            return
        p = slot.probation
        log.error("%s replica gen %d (pid %d) died: exit code %s; %d replica(s) left",
                  w.model_label, w.generation, w.pid, w.exitcode, len(slot.replicas))
        self.events.emit("crash", name=slot.name, version=slot.version, pid=w.pid,
                         exitcode=w.exitcode, reason=w.error)
        if (p is not None and p.new_version == slot.version
                and all(x.usable for x in p.workers)):
            # a crash of the version in probation: back to the previous one at
            # once; the dead worker's requests are retried there
            self.rollouts.rollback_now(slot, f"worker crashed (exit code {w.exitcode}) during "
                               "probation", auto=True,
                               figures={"exitcode": w.exitcode, "error": w.error,
                                        "new_version": p.new_stats.describe()})
            return
        self.ctl.begin_replacing(slot)  # now: requests arriving meanwhile wait, not fail
        self.loop.spawn_callback(self.recover, slot, w)

    async def recover(self, slot: Slot, dead: WorkerHandle) -> None:
        """Replace one dead replica, or give up on its version.

        Every crash (and every failed restart) of a version counts; more than
        max_restarts within restart_window, or a load failure (exit code 4,
        not worth retrying), marks it FAILED and the version served before,
        if any, is applied instead."""
        assert dead.model is not None
        version = dead.model["version"]
        window = self.wcfg.restart_window
        try:
            while not self.serving.stopping and not slot.unloaded and slot.version == version:
                n = self.ctl.count_crash(slot, version, window)
                if n > self.wcfg.max_restarts:
                    await self.give_up(slot, version, f"worker crashed {n} times within "
                                        f"{window:.0f}s (last: exit code {dead.exitcode}, "
                                        f"{dead.error})")
                    return
                backoff = 0.0 if n <= 1 else min(5.0, 0.25 * 2 ** (n - 2))
                if backoff:
                    await gen.sleep(backoff)
                try:
                    await self.add_replica(slot, version, "restart")
                    return
                except ApplyFailed as exc:
                    log.error("restart of %s v%s failed: %s", slot.name, version, exc)
                    if exc.code == "model_load_failed":
                        await self.give_up(slot, version, f"cannot load: {exc}")
                        return
                except StoreError as exc:
                    await self.give_up(slot, version, f"cannot restart: {exc}")
                    return
                except Conflict as exc:
                    log.error("restart of %s v%s waits for room: %s", slot.name, version, exc)
                    await gen.sleep(1.0)
        finally:
            self.ctl.end_replacing(slot)

    async def add_replica(self, slot: Slot, version: int, why: str) -> WorkerHandle | None:
        """One more serving replica of `version` (a crash replacement or a
        recycling successor); None if the slot moved on meanwhile."""
        version, path = self.store.resolve(slot.name, version)
        (w,) = self.provision.obtain(slot.name, version, 1, f"a {why} of {slot.name} v{version}")
        w, _, _ = await self.provision.make_ready(w, slot.name, version, path)
        if not self.ctl.add_replica(slot, w, version):  # the slot moved on meanwhile
            self.loop.spawn_callback(w.stop, self.wcfg.stop_timeout)
            return None
        w.send({"t": "serve"})
        log.info("%s v%s: replica gen %d (pid %d) serves (%s)", slot.name, version,
                 w.generation, w.pid, why)
        self.events.emit(why, name=slot.name, version=version, pid=w.pid)
        self.pool.ensure(delay=2.0)
        return w

    async def give_up(self, slot: Slot, version: int, reason: str) -> None:
        log.error("model %s v%s marked FAILED: %s", slot.name, version, reason)
        self.ctl.give_up(slot, version, reason)
        self.events.emit("failed", name=slot.name, version=version, reason=reason)
        self.pool.forget(slot.name, version)
        if slot.replicas:
            return  # other replicas of it still answer; an operator decides
        fallback = slot.previous
        if fallback and fallback != version:
            log.info("falling back to %s v%s, served before", slot.name, fallback)
            await self.applies.apply_logged(slot.name, fallback, "fallback", default=False)
        elif (self.serving.default_name == slot.name
              and (back := self.serving.previous_default) is not None
              and back in self.serving.slots and self.serving.slots[back].replicas):
            # no earlier version to go back to: the model that was the default
            # before it (still serving in its own slot) answers again
            log.info("default model %s FAILED: %s is the default again", slot.name, back)

            def switch() -> None:
                self.ctl.restore_default(back)
            await self.keeper.commit(None, default=back, switch=switch, strict=False)

    def sweep(self) -> None:
        """Once a second: fail requests past their deadline, kill hung workers,
        judge versions in probation, recycle workers past their limits."""
        self.rollouts.check_probations()
        self.keeper.retry_dirty()
        limit = self.wcfg.hang_timeout
        for w in list(self.pool.workers.values()):
            w.expire(self.wcfg.request_timeout)
            if w.state in (State.SERVING, State.DRAINING, State.IDLE) and (
                    w.oldest_request_age() > limit):
                log.error("worker gen %d has not answered for %.0fs: killing it as hung",
                          w.generation, limit)
                w.error = f"hung: no answer for {limit:.0f}s"
                w.kill()
        max_requests, max_rss = self.wcfg.max_requests, self.wcfg.max_rss_mb
        if not (max_requests or max_rss):
            return
        now = time.monotonic()
        for slot in self.serving.slots.values():
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
                    self.loop.spawn_callback(self.recycle, slot, w, why)

    async def recycle(self, slot: Slot, w: WorkerHandle, why: str) -> None:
        """Retire a worker after its successor serves: requests see no gap."""
        log.info("recycling %s replica gen %d (pid %d): %s", w.model_label, w.generation,
                 w.pid, why)
        try:
            new = await self.add_replica(slot, slot.version or 0, "recycle")
        except (ServiceError, StoreError) as exc:
            log.warning("recycling gen %d postponed: %s", w.generation, exc)
            w.recycle_after = time.monotonic() + 30.0
            return
        if new is not None and self.ctl.remove_replica(slot, w):
            await self.provision.retire([w])
