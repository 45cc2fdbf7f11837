"""A model slot: everything the service does for one applied model name.

The serving state keeps one Slot per applied name; its fields are read-only
properties, written by the serving controller (control/servingctl.py). A slot owns its serving
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
from types import MappingProxyType
from typing import Mapping, Sequence, TypedDict

from tornado.locks import Condition, Lock

from state.errors import NoModel, Overloaded

# the most replicas one model may have (POST /apply; a cluster prepare request)
MAX_REPLICAS = 64
from control.rollout_state import Candidate, GateScore, Probation, VersionStats
from control.workerhandle import WorkerHandle


class ModelRef(TypedDict):
    """A model and the version it serves (an answer's previous/current)."""
    name: str
    version: int | None


class ApplyResult(TypedDict, total=False):
    """The answer of an apply (POST /apply; a job's or the service's own):
    a swap's, an unchanged one's (previous, current, unchanged), or a
    shadow's/canary's (name, mode, serving, candidate, fraction, workers)."""
    previous: ModelRef | None
    current: ModelRef | None
    unchanged: bool
    replicas: int
    default: bool
    worker: dict[str, object]
    workers: list[dict[str, object]]
    phases_s: dict[str, float]
    preloaded: bool
    from_probation: bool
    load_s: float
    warmup_s: float
    engine: str
    old_worker: dict[str, object] | None
    old_workers: list[dict[str, object]]
    probation: dict[str, object] | None
    gate: dict[str, object] | None
    source: str
    total_s: float
    cluster: dict[str, object]
    # a shadow or canary candidate
    name: str
    mode: str
    serving: ModelRef
    candidate: ModelRef
    fraction: float


class RollbackResult(TypedDict, total=False):
    """The answer of POST /rollback: instant within probation, else an apply."""
    name: str
    from_version: int | None
    to_version: int | None
    instant: bool
    took_s: float
    apply: ApplyResult
    cluster: dict[str, object]


class RolledBack(TypedDict):
    """A version rolled back, and why (`ServingController.switch_back`)."""
    version: int
    reason: str
    auto: bool
    figures: dict[str, object] | None
    at: float
    back_to: int


class Slot:
    """One applied model name. Every field is a read-only property: the
    serving controller (control/servingctl.py) writes them; routing here
    writes only its own count of waiting requests."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._version: int | None = None       # the version its replicas serve
        self._labels: list[str] = []
        self._replicas: tuple[WorkerHandle, ...] = ()  # SERVING workers, all of `version`
        self._wanted = 1                        # replica count asked for
        self._explicit = True                   # applied by someone (not the first-start demo)
        self._previous: int | None = None       # version served before: the rollback target
        self._lock = Lock()                     # one apply/unload of this slot at a time
        self._changed = Condition()             # routing may find room now
        self._waiters = 0
        self._applying = 0                      # applies queued or running
        self._replacing = 0                     # replacement replicas loading
        self._unloaded = False
        self._crashes: dict[int, collections.deque[float]] = collections.defaultdict(
            collections.deque)
        self._failed: dict[str, object] | None = None
        self._last_apply: ApplyResult | None = None
        self._created = time.time()
        # rollouts (rollout_state.py): figures of the serving version, the previous
        # version kept idle after a swap, a shadow/canary candidate, versions
        # rolled back (an automatic one is not applied again unless asked)
        self._stats = VersionStats()
        self._stats_before_swap: float | None = None
        self._probation: Probation | None = None
        self._candidate: Candidate | None = None
        self._rolled_back: dict[int, RolledBack] = {}
        self._gate_cache: dict[tuple[int | None, str], GateScore] = {}

    # -- the fields, read-only ---------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def labels(self) -> list[str]:
        return self._labels

    @property
    def replicas(self) -> tuple[WorkerHandle, ...]:
        return self._replicas

    @property
    def wanted(self) -> int:
        return self._wanted

    @property
    def explicit(self) -> bool:
        return self._explicit

    @property
    def previous(self) -> int | None:
        return self._previous

    @property
    def lock(self) -> Lock:
        return self._lock

    @property
    def changed(self) -> Condition:
        """Notified when routing may find room (answers, swaps, recoveries)."""
        return self._changed

    @property
    def crashes(self) -> Mapping[int, collections.deque[float]]:
        """Recent crash times by version (the crash budget)."""
        return MappingProxyType(self._crashes)

    @property
    def waiters(self) -> int:
        """Requests waiting for room on a replica."""
        return self._waiters

    @property
    def applying(self) -> int:
        return self._applying

    @property
    def replacing(self) -> int:
        return self._replacing

    @property
    def unloaded(self) -> bool:
        return self._unloaded

    @property
    def failed(self) -> dict[str, object] | None:
        return self._failed

    @property
    def last_apply(self) -> ApplyResult | None:
        return self._last_apply

    @property
    def created(self) -> float:
        return self._created

    @property
    def stats(self) -> VersionStats:
        return self._stats

    @property
    def stats_before_swap(self) -> float | None:
        return self._stats_before_swap

    @property
    def probation(self) -> Probation | None:
        return self._probation

    @property
    def candidate(self) -> Candidate | None:
        return self._candidate

    @property
    def rolled_back(self) -> Mapping[int, RolledBack]:
        return MappingProxyType(self._rolled_back)

    @property
    def gate_cache(self) -> Mapping[tuple[int | None, str], GateScore]:
        return MappingProxyType(self._gate_cache)

    # -- routing ---------------------------------------------------------------
    @staticmethod
    def pick(workers: Sequence[WorkerHandle], cap: int) -> WorkerHandle | None:
        """The usable worker with the fewest requests in flight, under cap (a
        slot's replicas, or a candidate's workers)."""
        best = None
        for w in workers:
            if w.usable and w.inflight < cap and (best is None or w.inflight < best.inflight):
                best = w
        return best

    def on_answer(self) -> None:
        if self._waiters:
            self._changed.notify(1)

    def wake_all(self) -> None:
        self._changed.notify_all()

    @property
    def busy(self) -> bool:
        """Something will change the replica set soon: requests should wait."""
        return bool(self._applying or self._replacing)

    async def route(self, cap: int, deadline: float) -> WorkerHandle:
        """A replica with room for one more request, waiting up to deadline."""
        while True:
            if self._unloaded:
                raise NoModel(f"model {self._name!r} was unloaded")
            w = self.pick(self._replicas, cap)
            if w is not None:
                return w
            if not self._replicas and not self.busy:
                why = f": {self._failed['reason']}" if self._failed else ""
                raise NoModel(f"model {self._name!r} has no serving worker{why}")
            self._waiters += 1
            try:
                woke = await self._changed.wait(timeout=deadline)
            finally:
                self._waiters -= 1
            if not woke:
                if not any(r.usable for r in self._replicas):
                    raise NoModel(f"model {self.name!r} did not become available in time")
                raise Overloaded(f"every replica of {self.name!r} is at its limit of {cap} "
                                 "requests in flight; retry later")

    # -- reads -----------------------------------------------------------------
    def model_label(self) -> str:
        return f"{self.name} v{self.version} x{len(self.replicas)}"

    @property
    def state(self) -> str:
        if self.replicas:
            return "SERVING" if len(self.replicas) >= self.wanted else "DEGRADED"
        if self.replacing:
            return "RECOVERING"
        if self.applying:
            return "APPLYING"
        return "FAILED" if self.failed else "EMPTY"

    def describe(self, workers: list[dict[str, object]]) -> dict[str, object]:
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
            "rolled_back": list(self._rolled_back.values()),
        }
