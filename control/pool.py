"""Every worker process of the service, the shared standby pool, the zygote,
and the budget.

Workers and trainers are forked from the zygote (control/zygote_client.py,
`worker.zygote`): one process that imported TensorFlow once, so a new
worker is booted in about 0.1 s and shares TensorFlow's memory copy-on-write
(about 60 MB private per small model instead of 250). The pool starts the
zygote with the first launch and stops it when the service stops; running
workers never depend on it. With `worker.zygote: false` (or no pidfds) each
child is spawned and imports TensorFlow itself (7-8 s).

A worker is generic until told what to load: once booted it waits. The pool
keeps `worker.standby_pool` such workers for any slot that needs one (an
apply, a crash replacement, a recycle). With the zygote, a booted standby
saves only the fork; what still pays is preloading (`worker.preload`): the
standby loads the model most likely applied next at nice +10, so applying
exactly that model is only the swap (bench/slots.py measures both).

`worker.max_workers` (0: no limit) counts every live worker process: serving,
draining, standby, preloading, loading (the zygote is not counted). Every
spawn goes through `has_room`, so the service never holds more; callers that
would need more are refused with a 409 that names the count and the limit.
Imports no TensorFlow.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

from tornado.ioloop import IOLoop

from state.errors import Conflict, StoreError
from state.store import ModelStore
from control import zygote_client as zygote_mod
from control.workerhandle import State, WorkerError, WorkerDied, WorkerHandle

if TYPE_CHECKING:
    from state.config import Config

log = logging.getLogger("textswap.pool")


class WorkerPool:
    def __init__(self, config: "Config", store: ModelStore, on_exit: Callable[[WorkerHandle], None],
                 guesses: Callable[[], list[tuple[str, int]]]) -> None:
        self.cfg = config
        self.wcfg = config.worker
        self.store = store
        self.loop = IOLoop.current()
        self.on_exit = on_exit
        self.guesses = guesses
        self.workers: dict[int, WorkerHandle] = {}  # every live process, by generation
        self.standby: list[WorkerHandle] = []
        self.size = self.wcfg.standby_pool if self.wcfg.standby else 0
        self.max_workers = self.wcfg.max_workers
        self.failures = 0
        self.bad_guesses: set[tuple[str, int]] = set()
        self._stopping = False
        # workers and trainers fork from it (started by the first launch);
        # None: each child is spawned and imports TensorFlow itself
        self.zygote: zygote_mod.Zygote | None = None
        if self.wcfg.zygote:
            if zygote_mod.supported() and zygote_mod.become_subreaper():
                self.zygote = zygote_mod.Zygote({"log_level": config.log_level,
                                                 "parent_pid": os.getpid()})
            else:
                log.warning("no zygote on this system (needs Linux 5.3+ pidfds): "
                            "every worker imports TensorFlow itself")

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop_starting(self) -> None:
        """The service stops: no process starts any more, so the zygote stops
        too (running workers do not depend on it)."""
        self._stopping = True
        if self.zygote is not None:
            self.zygote.close()

    # -- processes and the budget ----------------------------------------------
    def options(self, nice: bool) -> dict[str, object]:
        w = self.wcfg
        return {"max_batch": w.max_batch, "batch_wait_ms": w.batch_wait_ms,
                "intra_op_threads": w.intra_op_threads,
                "inter_op_threads": w.inter_op_threads, "engine": w.engine,
                "boot_nice": 10 if nice else 0, "log_level": self.cfg.log_level,
                "parent_pid": os.getpid()}

    def has_room(self, n: int = 1) -> bool:
        return not self.max_workers or len(self.workers) + n <= self.max_workers

    def budget_error(self, need: int, what: str) -> Conflict:
        by_state: dict[str, int] = {}
        for w in self.workers.values():
            by_state[w.state.value] = by_state.get(w.state.value, 0) + 1
        return Conflict(
            f"{what} needs {need} more worker process{'es' if need != 1 else ''}, but "
            f"{len(self.workers)} of the limit of {self.max_workers} (worker.max_workers) are "
            f"in use ({', '.join(f'{n} {s}' for s, n in sorted(by_state.items()))})",
            code="memory_budget",
            details={"workers": len(self.workers), "max_workers": self.max_workers,
                     "needed": need})

    def spawn(self, nice: bool = False) -> WorkerHandle:
        """A new worker process; callers check has_room first."""
        w = WorkerHandle(self.options(nice), self._exited, zygote=self.zygote)
        self.workers[w.generation] = w
        return w

    def _exited(self, w: WorkerHandle) -> None:
        self.workers.pop(w.generation, None)
        if w in self.standby:
            self.standby.remove(w)
            if not self.stopping:
                self.failures += 1
                self.ensure(delay=min(30.0, 0.5 * 2 ** self.failures))
        elif not self.stopping:
            self.ensure(delay=1.0)
        self.on_exit(w)

    # -- the standby pool ---------------------------------------------------------
    def ensure(self, nice: bool = True, delay: float = 0.0) -> None:
        """Top the pool up to its size, one TensorFlow import at a time."""
        if not self.size or self.stopping:
            return
        self.standby = [w for w in self.standby if w.alive]
        if len(self.standby) >= self.size:
            return
        if any(w.state is State.STARTING for w in self.standby):
            return  # the booted callback asks again
        if not self.has_room(1):
            return  # the budget is full; an exit asks again
        if delay:
            self.loop.call_later(delay, self.ensure, nice)
            return
        w = self.spawn(nice=nice)
        self.standby.append(w)
        self.loop.spawn_callback(self._after_boot, w)

    def take(self, name: str, version: int) -> WorkerHandle | None:
        """The best standby for (name, version): one that preloaded it, else a
        booted one, else one still loading a guess or booting."""
        live = [w for w in self.standby if w.alive]
        want = {"name": name, "version": version}
        order = (
            lambda w: w.model == want and w.state in (State.READY, State.LOADING),
            lambda w: w.state is State.STANDBY,
            lambda w: w.state is State.READY,
            lambda w: w.state is State.LOADING,
            lambda w: w.state is State.STARTING,
        )
        for good in order:
            for w in live:
                if good(w):
                    self.standby.remove(w)
                    return w
        return None

    def give_back(self, ws: list[WorkerHandle]) -> None:
        for w in ws:
            if w.alive and w.state in (State.STARTING, State.STANDBY, State.LOADING, State.READY):
                self.standby.append(w)

    def forget(self, name: str, version: int) -> list[WorkerHandle]:
        """A version that must not serve again unasked (rolled back
        automatically, or FAILED): standbys holding it, loaded or still
        loading (a preload that began before it failed), stop; the pool
        tops itself up with fresh ones, whose guesses skip it."""
        want = {"name": name, "version": version}
        gone = [w for w in self.standby if w.model == want]
        for w in gone:
            self.standby.remove(w)
            log.info("standby gen %d drops %s v%s: it was rolled back or failed",
                     w.generation, name, version)
            self.loop.spawn_callback(w.stop, self.wcfg.stop_timeout)
        return gone

    def refresh(self) -> None:
        """A model was published or applied: standbys may want a fresher guess."""
        for w in list(self.standby):
            self.loop.spawn_callback(self._preload, w)

    async def _after_boot(self, w: WorkerHandle) -> None:
        try:
            await w.booted
        except WorkerDied:
            return
        self.failures = 0
        self.ensure()  # the next one of a pool bigger than one
        await self._preload(w)

    async def _preload(self, w: WorkerHandle) -> None:
        """Load the likeliest next model into a standby, at its low priority."""
        if not self.wcfg.preload or not w.booted.done() or w.booted.exception():
            return
        if (w not in self.standby or self.stopping or w.loads >= 1
                or w.state is not State.STANDBY):
            return
        held = {(s.model["name"], s.model["version"]) for s in self.standby
                if s is not w and s.model}
        guess = next((g for g in self.guesses()
                      if g not in held and g not in self.bad_guesses), None)
        if guess is None:
            return
        try:
            version, path = self.store.resolve(*guess)
            self.store.check_artifact(*guess)
        except StoreError:
            self.bad_guesses.add(guess)
            return
        log.info("standby gen %d preloads %s v%s", w.generation, guess[0], version)
        try:
            await w.load(path, guess[0], version, preload=True)
        except WorkerError:
            self.bad_guesses.add(guess)  # it exits; the pool replaces it

    def describe(self) -> list[dict[str, object]]:
        return [w.describe() for w in self.standby if w.alive]
