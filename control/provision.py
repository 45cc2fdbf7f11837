"""Workers for a slot: taken from the standby pool or started, made ready, retired.

`Provisioner` owns the steps between "a slot needs n workers of (name,
version)" and "they are READY", and the reverse (drain, then stop). It reads
the pool (`WorkerPool`) and the budget, and may end a probation early to make
room (through the rollouts). It never changes routing: the callers swap.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

from tornado import gen
from tornado.locks import Semaphore

from state.errors import ApplyFailed
from state.store import StoreError
from control.workerhandle import Frame, RequestFailed, State, WorkerDied, WorkerError, WorkerHandle

if TYPE_CHECKING:
    from tornado.ioloop import IOLoop

    from state.config import Config
    from state.store import ModelStore
    from control.pool import WorkerPool
    from control.serving import ServingState
    from control.slots import Slot

log = logging.getLogger("textswap.supervisor")


class Provisioner:
    """Obtains, readies and retires worker processes for the slots."""

    def __init__(self, serving: "ServingState", cfg: "Config", loop: "IOLoop",
                 store: "ModelStore", pool: "WorkerPool",
                 end_probation: Callable[["Slot"], list[WorkerHandle]] = lambda slot: []
                 ) -> None:
        self.serving, self.cfg, self.wcfg, self.loop = serving, cfg, cfg.worker, loop
        self.store, self.pool = store, pool
        # a slot's probation ends early to make room: its workers, no longer
        # kept (the serving controller's cancel_probation)
        self.end_probation = end_probation
        self._loads = Semaphore(max(2, os.cpu_count() or 1))  # model loads at once

    def preload_guesses(self) -> list[tuple[str, int]]:
        """Models likely applied next, best first: a newer version of a serving
        model (just trained), then the version each served before (a rollback).
        The default model's guesses come first; a version rolled back
        automatically or marked FAILED is no guess (pool.forget)."""
        order = sorted(self.serving.slots.values(), key=lambda s: s.name != self.serving.default_name)
        newer, back = [], []
        for slot in order:
            if slot.version is None or not slot.replicas:
                continue
            try:
                later = [v for v in self.store.versions(slot.name) if v > slot.version]
            except StoreError:
                later = []
            later = [v for v in later if not (v in slot.rolled_back and slot.rolled_back[v]["auto"])
                     and f"{slot.name} v{v}" not in self.serving.failed_models]
            if later:
                newer.append((slot.name, later[-1]))
            if slot.previous and slot.previous != slot.version and (
                    slot.probation is None or slot.probation.version != slot.previous) and (
                    f"{slot.name} v{slot.previous}" not in self.serving.failed_models):
                back.append((slot.name, slot.previous))
        return newer + back

    def obtain(self, name: str, version: int, n: int, what: str) -> list[WorkerHandle]:
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

    async def make_ready(self, w: WorkerHandle, name: str, version: int, path: str
                          ) -> tuple[WorkerHandle, Frame, bool]:
        """Boot (if needed) and load (unless preloaded) one worker.
        Returns (worker, ready frame, preloaded)."""
        deadline = self.loop.time() + self.wcfg.boot_timeout
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
            # loads queue for a CPU (many applies at once would otherwise share
            # the cores until every one of them missed its load_timeout); the
            # deadline counts from the load's start
            async with self._loads:
                ready = await gen.with_timeout(self.loop.time() + self.wcfg.load_timeout,
                                               w.load(path, name, version),
                                               quiet_exceptions=(WorkerDied, RequestFailed))
        except (gen.TimeoutError, WorkerError) as exc:
            status = None
            why = str(exc) or "load deadline passed"
            if isinstance(exc, gen.TimeoutError):
                why = f"model did not load and warm up within {self.wcfg.load_timeout}s"
                status = 504
            w.error = why
            self.loop.spawn_callback(w.stop, 1.0)
            raise ApplyFailed(f"{name} v{version} failed to load: {why}",
                              status=status) from exc
        return w, ready, False

    async def prepare(self, name: str, version: int, replicas: int, *,
                      make_room: bool = True) -> list[WorkerHandle]:
        """Load (name, version) into `replicas` workers beside what serves and
        hold them READY among the standbys, where `obtain` takes them first:
        an apply of that version is then only the swap (the cluster's
        two-phase apply). make_room=False: within the free budget only (no
        probation ends for it). Raises what an apply's load would: Conflict
        (memory_budget), ApplyFailed."""
        version, path = self.store.resolve(name, version)
        self.store.check_artifact(name, version)
        what = (f"preparing {name} v{version} with {replicas} "
                f"replica{'s' if replicas != 1 else ''}")
        if make_room:
            await self.make_room(replicas, what)
        new = self.obtain(name, version, replicas, what)
        try:
            ready = list(await gen.multi([self.make_ready(w, name, version, path)
                                          for w in new]))
        except Exception:
            for w in new:
                if w.alive and w.state is not State.SERVING:
                    self.loop.spawn_callback(w.stop, 1.0)
            self.pool.ensure(delay=1.0)
            raise
        workers = [w for w, _, _ in ready]
        self.pool.give_back(workers)
        return workers

    async def retire(self, ws: list[WorkerHandle]) -> list[dict[str, object]]:
        """Drain then stop workers that no longer receive requests."""
        async def one(w: WorkerHandle) -> dict[str, object]:
            drained = True
            if w.alive:
                if w.state in (State.SERVING, State.IDLE):
                    w.set_state(State.DRAINING)
                drained = await w.wait_idle(self.wcfg.drain_timeout)
            ended = await w.stop(self.wcfg.stop_timeout)
            return {"generation": w.generation, "pid": w.pid, "drained": drained, "ended": ended}
        return list(await gen.multi([one(w) for w in ws]))

    async def make_room(self, n: int, what: str) -> None:
        """Free budget for n workers (minus the standbys they can take):
        probation workers are the first to go."""
        if not self.pool.max_workers:
            return
        need = n - len([w for w in self.pool.standby if w.alive])
        for slot in sorted(self.serving.slots.values(), key=lambda s: s.probation.started
                           if s.probation else 0.0):
            if need <= 0 or self.pool.has_room(need):
                return
            if slot.probation is not None:
                log.info("ending the probation of %s v%s early: %s needs room", slot.name,
                         slot.probation.version, what)
                await self.retire(self.end_probation(slot))
        await self._wait_for_leavers(need, what)

    async def _wait_for_leavers(self, need: int, what: str) -> None:
        """Workers draining on their way out (an unload, a swap's old replicas)
        give their place back within drain_timeout + stop_timeout: wait for
        them rather than refuse the load (obtain refuses if there is still
        no room then)."""
        if need <= 0 or self.pool.has_room(need):
            return
        leaving = [w.exited for w in self.pool.workers.values()
                   if w.state is State.DRAINING and not w.exited.done()]
        if not leaving:
            return
        log.info("%s waits for %d draining worker(s) to exit", what, len(leaving))
        try:
            await gen.with_timeout(
                self.loop.time() + self.wcfg.drain_timeout + self.wcfg.stop_timeout,
                gen.multi(leaving))
        except gen.TimeoutError:
            pass
