"""A model slot: everything the service does for one applied model name.

The Supervisor keeps one Slot per applied name. A slot owns its serving
replicas (worker processes that all hold the same version), its blue/green
swap lock, its crash budget and its FAILED state. Slots never touch each
other's workers: applying, rolling back or crashing one model leaves every
other model's requests alone.

Routing inside a slot is "fewest requests in flight" among its usable
replicas, capped at `max_inflight` per replica; a request that finds no room
waits on the slot's condition (woken by answers, swaps and recoveries) up to
its deadline. Imports no TensorFlow.
"""
from __future__ import annotations

import collections
import time
from typing import Any

from tornado.locks import Condition, Lock

from state.errors import NoModel, Overloaded

# the most replicas one model may have (POST /apply; a cluster prepare request)
MAX_REPLICAS = 64
from control.rollout_state import Candidate, Probation, VersionStats
from control.workerhandle import State, WorkerHandle


class Slot:
    def __init__(self, name: str) -> None:
        self.name = name
        self.version: int | None = None       # the version its replicas serve
        self.labels: list[str] = []
        self.replicas: list[WorkerHandle] = []  # SERVING workers, all of `version`
        self.wanted = 1                        # replica count asked for
        self.explicit = True                   # applied by someone (not the first-start demo)
        self.previous: int | None = None       # version served before: the rollback target
        self.lock = Lock()                     # one apply/unload of this slot at a time
        self.changed = Condition()             # routing may find room now
        self.waiters = 0
        self.applying = 0                      # applies queued or running
        self.recovering = False                # no replica left; a replacement is loading
        self.replacing = 0                     # replacement replicas loading
        self.unloaded = False
        self.crashes: dict[int, collections.deque[Any]] = collections.defaultdict(collections.deque)
        self.failed: dict[str, Any] | None = None
        self.last_apply: dict[str, Any] | None = None
        self.created = time.time()
        # rollouts (rollout_state.py): figures of the serving version, the previous
        # version kept idle after a swap, a shadow/canary candidate, versions
        # rolled back (an automatic one is not applied again unless asked)
        self.stats = VersionStats()
        self.stats_before_swap: float | None = None
        self.probation: Probation | None = None
        self.candidate: Candidate | None = None
        self.rolled_back: dict[int, dict[str, Any]] = {}
        self.gate_cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    # -- routing ---------------------------------------------------------------
    def pick(self, cap: int) -> WorkerHandle | None:
        """The usable replica with the fewest requests in flight, under cap."""
        best = None
        for w in self.replicas:
            if w.usable and w.inflight < cap and (best is None or w.inflight < best.inflight):
                best = w
        return best

    def on_answer(self) -> None:
        if self.waiters:
            self.changed.notify(1)

    def wake_all(self) -> None:
        self.changed.notify_all()

    @property
    def busy(self) -> bool:
        """Something will change the replica set soon: requests should wait."""
        return bool(self.applying or self.recovering or self.replacing)

    async def route(self, cap: int, deadline: float) -> WorkerHandle:
        """A replica with room for one more request, waiting up to deadline."""
        while True:
            if self.unloaded:
                raise NoModel(f"model {self.name!r} was unloaded")
            w = self.pick(cap)
            if w is not None:
                return w
            if not self.replicas and not self.busy:
                why = f": {self.failed['reason']}" if self.failed else ""
                raise NoModel(f"model {self.name!r} has no serving worker{why}")
            self.waiters += 1
            try:
                woke = await self.changed.wait(timeout=deadline)
            finally:
                self.waiters -= 1
            if not woke:
                if not any(r.usable for r in self.replicas):
                    raise NoModel(f"model {self.name!r} did not become available in time")
                raise Overloaded(f"every replica of {self.name!r} is at its limit of {cap} "
                                 "requests in flight; retry later")

    # -- replicas --------------------------------------------------------------
    def add_replica(self, w: WorkerHandle) -> None:
        w.slot = self
        w.on_answer = self.on_answer
        if w.state is not State.SERVING:
            w.set_state(State.SERVING)
        self.replicas.append(w)
        self.wake_all()

    def remove_replica(self, w: WorkerHandle) -> bool:
        if w in self.replicas:
            self.replicas.remove(w)
            self.wake_all()
            return True
        return False

    def model_label(self) -> str:
        return f"{self.name} v{self.version} x{len(self.replicas)}"

    def count_crash(self, version: int, window: float) -> int:
        """Record a crash of `version`; the number within the window."""
        now = time.monotonic()
        crashes = self.crashes[version]
        crashes.append(now)
        while crashes and now - crashes[0] > window:
            crashes.popleft()
        return len(crashes)

    @property
    def state(self) -> str:
        if self.replicas:
            return "SERVING" if len(self.replicas) >= self.wanted else "DEGRADED"
        if self.recovering or self.replacing:
            return "RECOVERING"
        if self.applying:
            return "APPLYING"
        return "FAILED" if self.failed else "EMPTY"

    def describe(self, workers: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "state": self.state,
            "replicas": len(self.replicas),
            "replicas_wanted": self.wanted,
            "labels": self.labels,
            "explicit": self.explicit,
            "previous_version": self.previous,
            "inflight": sum(w.inflight for w in self.replicas),
            "workers": workers,
            "failed": self.failed,
            "last_apply": self.last_apply,
            "probation": self.probation.describe() if self.probation else None,
            "candidate": self.candidate.describe() if self.candidate else None,
            "rolled_back": list(self.rolled_back.values()),
        }
