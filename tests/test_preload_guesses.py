"""What the standby pool preloads, and what it lets go: a version rolled back
automatically or marked FAILED is no preload guess, and a standby that
already holds it (a preload that began before the rollback) stops.

The real WorkerPool, Provisioner, ServingState and model store; the worker
processes are stand-ins. The race this guards against (a new standby
preloading v2 while an apply of v2 loads it elsewhere, then v2 crashing) shows
on a busy machine only now and then (test_rollouts.py's crash test caught it
once in CI); its outcome, a standby holding the rolled-back version, is set up
here directly.
"""
from __future__ import annotations

import asyncio
import os
import shutil

from tornado.ioloop import IOLoop

from control.pool import WorkerPool
from control.provision import Provisioner
from control.serving import ServingState
from control.servingctl import ServingController
from control.slots import Slot
from control.workerhandle import State
from state.config import load_config
from state.store import ModelStore


class StandIn:
    """A standby worker process as the pool sees it: model, state, stop()."""

    def __init__(self, generation: int, model: dict | None) -> None:
        self.generation, self.model, self.alive = generation, model, True
        self.state = State.READY if model else State.STANDBY
        self.stopped = asyncio.Event()

    async def stop(self, timeout: float) -> str:
        self.alive = False
        self.stopped.set()
        return "stopped"


def _parts(root: str):
    cfg = load_config(None, {"models_dir": root, "worker": {"zygote": False}})
    store = ModelStore(root)
    state = ServingState()
    pool = WorkerPool(cfg, store, lambda w: None, lambda: provision.preload_guesses())
    provision = Provisioner(state, cfg, IOLoop.current(), store, pool)
    return state, pool, provision


def _serving(state: ServingState, name: str, version: int) -> Slot:
    """A slot serving `version` on a stand-in replica, set up directly (the
    fields are the serving controller's to change; no worker swaps in here)."""
    ServingController(state, {}, IOLoop.current()).open_slot(name)  # type: ignore[arg-type]
    slot = state.slots[name]
    slot._version, slot._replicas = version, (object(),)  # type: ignore[assignment]
    state._default_name = name
    return slot


def _versions(tiny_store: str, root: str, name: str, n: int) -> None:
    """n versions of `name`: copies of a real tiny model (the store lists
    complete versions only)."""
    for v in range(1, n + 1):
        shutil.copytree(os.path.join(tiny_store, "sent", "1"), os.path.join(root, name, str(v)))


def test_guesses_skip_versions_rolled_back_automatically_or_failed(tiny_store, tmp_path):
    root = str(tmp_path / "models")
    _versions(tiny_store, root, "m", 4)

    async def run():
        state, _pool, provision = _parts(root)
        slot = _serving(state, "m", 1)
        assert provision.preload_guesses() == [("m", 4)]
        slot._rolled_back[4] = {"auto": True, "reason": "crashed"}  # type: ignore[typeddict-item]
        assert provision.preload_guesses() == [("m", 3)]
        state._failed_models["m v3"] = {"name": "m", "version": 3}  # type: ignore[typeddict-item]
        assert provision.preload_guesses() == [("m", 2)]
        slot._rolled_back[2] = {"auto": False, "reason": "an operator's"}  # type: ignore[typeddict-item]  # asked for: may return
        assert provision.preload_guesses() == [("m", 2)]
        # the version served before (a rollback's target), unless it FAILED
        slot._version, slot._previous = 4, 2
        slot._rolled_back.clear()
        state._failed_models.clear()
        assert provision.preload_guesses() == [("m", 2)]
        state._failed_models["m v2"] = {"name": "m", "version": 2}  # type: ignore[typeddict-item]
        assert provision.preload_guesses() == []

    IOLoop.current().run_sync(run)


def test_forget_stops_the_standbys_that_hold_the_version(tmp_path):
    root = str(tmp_path / "models")

    async def run():
        _state, pool, _provision = _parts(root)
        holds = StandIn(1, {"name": "m", "version": 2})
        loading = StandIn(2, {"name": "m", "version": 2})
        loading.state = State.LOADING  # its preload began before the rollback
        other = StandIn(3, {"name": "m", "version": 3})
        empty = StandIn(4, None)
        pool.standby = [holds, loading, other, empty]  # type: ignore[list-item]
        gone = pool.forget("m", 2)
        assert gone == [holds, loading]
        assert pool.standby == [other, empty]
        await asyncio.wait_for(asyncio.gather(holds.stopped.wait(), loading.stopped.wait()), 10)
        assert other.alive and empty.alive
        assert pool.forget("m", 2) == []  # nothing left to drop

    IOLoop.current().run_sync(run)
