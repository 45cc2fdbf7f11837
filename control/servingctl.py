"""The serving controller: the one writer of the serving state.

`ServingController` owns every change of `ServingState` (control/serving.py)
and of its slots (control/slots.py), whose fields are read-only properties
for every other part. Each transition is one method here, on the IOLoop: it
checks that the move is legal and writes the fields, nothing else. The parts
that orchestrate a transition (waiting for workers, the quality gate, the
record's write) call it at their steps:

    apply       open_slot, begin_apply, fresh_start, apply_switch (the swap),
                note_apply, end_apply                         (control/applies.py)
    unload      unload                                        (control/applies.py)
    record      follow_record, note_record, start_from       (applies, records, cluster)
    rollback    start_probation, end_probation, cancel_probation, switch_back,
                note_rolled_back                              (control/rollout_control.py)
    candidates  set_candidate, drop_candidate, promote        (control/rollout_control.py)
    recovery    worker_exited, begin_replacing, count_crash, add_replica,
                remove_replica, end_replacing, give_up, restore_default
                                                              (control/healing.py)

After each transition it publishes "state changed" to its subscribers (the
cluster node's heartbeat revision): they read the state, never hold a part
that changes it. `tests/test_layers.py` fails on a write of these fields
anywhere else.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Sequence

from state.errors import Conflict, UnknownModel
from control.rollout_state import Candidate, GateScore, Probation, VersionStats
from control.serving import AppliedRecord, FailedModel, ServingState
from control.slots import ApplyResult, ModelRef, RollbackResult, RolledBack, Slot
from control.workerhandle import State, WorkerHandle

if TYPE_CHECKING:
    from tornado.ioloop import IOLoop

    from state.config import Config

log = logging.getLogger("textswap.supervisor")

__all__ = ["ApplyResult", "ModelRef", "RollbackResult", "ServingController"]


class ServingController:
    """Every transition of the serving state, validated; its only writer."""

    def __init__(self, serving: ServingState, cfg: "Config", loop: "IOLoop") -> None:
        self.serving, self.cfg, self.loop = serving, cfg, loop
        self._subscribers: list[Callable[[], object]] = []

    # -- subscriptions -----------------------------------------------------------
    def subscribe(self, fn: Callable[[], object]) -> None:
        """fn() after every transition (on the IOLoop, in its step)."""
        self._subscribers.append(fn)

    def _changed(self) -> None:
        for fn in self._subscribers:
            try:
                fn()
            except Exception:  # a subscriber's bug must not undo a transition
                log.exception("serving-state subscriber failed")

    # -- start and stop ----------------------------------------------------------
    def start_from(self, record: AppliedRecord) -> None:
        """At start: the record read from the backend, and its default."""
        self.serving._record = record
        self.serving._default_name = record["default"]

    def set_demo_training(self, running: bool) -> None:
        """The first-start demo's job runs (its apply is not explicit), or not."""
        self.serving._demo_training = running

    def stop(self) -> None:
        """The service stops: no transition starts any more."""
        self.serving._stopping = True

    def clear_routing(self) -> None:
        """At the end of a shutdown: nothing routes any more."""
        for slot in self.serving._slots.values():
            slot._replicas = ()

    # -- the record and the default ------------------------------------------------
    def note_record(self, record: AppliedRecord) -> None:
        """The record as last written (RecordKeeper.commit, the cluster's write)."""
        self.serving._record = record

    def follow_record(self, record: AppliedRecord) -> None:
        """A record changed from outside is the truth: its default serves
        (its slots converge through applies and unloads)."""
        self.note_record(record)
        if record["default"] != self.serving._default_name:
            log.info("default model is now %s (record changed)", record["default"])
            self.set_default(record["default"])

    def set_default(self, name: str | None) -> None:
        """The default model becomes `name`; the one before is remembered."""
        st = self.serving
        if name != st._default_name:
            st._previous_default, st._default_name = st._default_name, name
            self._changed()

    def restore_default(self, back: str) -> None:
        """A FAILED default with no version to fall back to: the default
        before it (serving in its own slot) is the default again."""
        slot = self.serving._slots.get(back)
        if slot is None or not slot._replicas:
            raise Conflict(f"{back} does not serve: it cannot be the default again",
                           code="not_serving")
        self.serving._default_name, self.serving._previous_default = back, None
        self._changed()

    # -- apply -----------------------------------------------------------------------
    def open_slot(self, name: str) -> Slot:
        """The slot of `name`, made for a first apply."""
        slot = self.serving._slots.get(name)
        if slot is None:
            slot = self.serving._slots[name] = Slot(name)
        return slot

    def begin_apply(self, slot: Slot) -> None:
        slot._applying += 1

    def end_apply(self, slot: Slot) -> None:
        """An apply left: a first apply that failed leaves no slot behind."""
        slot._applying -= 1
        if (not slot._replicas and not slot.busy and slot._version is None
                and self.serving._slots.get(slot.name) is slot):
            del self.serving._slots[slot.name]
            slot._unloaded = True
        slot.wake_all()

    def fresh_start(self, slot: Slot, version: int) -> None:
        """An operator's explicit apply: the version's crashes, rollback and
        FAILED mark are forgotten."""
        slot._crashes.pop(version, None)
        slot._rolled_back.pop(version, None)
        self.serving._failed_models.pop(f"{slot.name} v{version}", None)

    def swap(self, slot: Slot, workers: Sequence[WorkerHandle], version: int,
             replicas: int) -> None:
        """Route the slot to `workers`: one assignment. The caller decides what
        becomes of the workers that served before."""
        if not workers:
            raise ValueError(f"a swap of {slot.name} needs workers")
        if slot._unloaded:
            raise Conflict(f"model {slot.name!r} was unloaded", code="unloaded")
        for w in workers:
            w.slot, w.on_answer = slot, slot.on_answer
            if w.state is not State.SERVING:
                w.set_state(State.SERVING)
        slot._replicas = tuple(workers)  # the swap
        for w in workers:
            w.send({"t": "serve"})  # leaves the standby's low priority
        if slot._version is not None and slot._version != version:
            slot._previous = slot._version
        slot._version, slot._labels, slot._wanted = version, list(workers[0].labels), replicas
        # the old version's p99 is the yardstick of the automatic rollback: a
        # version that served only a few requests (swapped right back) has none
        enough = len(slot._stats.latencies) >= max(100, self.cfg.rollout.min_requests)
        slot._stats_before_swap = slot._stats.p(0.99) if enough else None
        slot._stats = VersionStats()
        slot._failed = None
        slot.wake_all()

    def apply_switch(self, slot: Slot, workers: Sequence[WorkerHandle], version: int,
                     replicas: int, explicit: bool, default: str | None, end_demo: bool
                     ) -> tuple[list[WorkerHandle], ModelRef | None]:
        """An apply's switch: the slot's flag, the swap, the default. Returns
        the workers that served before and what they served (re-read now: an
        automatic rollback may have swapped the slot while the new ones loaded)."""
        old = list(slot._replicas)
        previous: ModelRef | None = {"name": slot.name, "version": slot._version} if old \
            else None
        if end_demo:
            self.serving._demo_training = False
        slot._explicit = explicit
        self.swap(slot, workers, version, replicas)
        self.set_default(default)
        self._changed()
        return old, previous

    def note_apply(self, slot: Slot, result: ApplyResult) -> None:
        """The apply's answer, shown by /status (the slot's and the last one)."""
        slot._last_apply = self.serving._last_apply = result

    # -- unload ----------------------------------------------------------------------
    def unload(self, slot: Slot) -> tuple[list[WorkerHandle], bool]:
        """The slot goes: out of routing at once. Returns its workers (the
        version kept in probation too) and whether it was the default."""
        if self.serving._slots.get(slot.name) is not slot:
            raise UnknownModel(f"model {slot.name!r} is not serving here")
        del self.serving._slots[slot.name]
        slot._unloaded = True
        old = list(slot._replicas)
        slot._replicas = ()
        # the version kept in probation stops too (it held its workers, and so
        # the memory budget, until probation_s ran out)
        old += self.cancel_probation(slot)
        slot.wake_all()
        was_default = self.serving._default_name == slot.name
        if was_default:
            self.serving._default_name = None
        self._changed()
        return old, was_default

    # -- probation and rollback ------------------------------------------------------
    def start_probation(self, slot: Slot, p: Probation) -> None:
        """The previous version's workers stay loaded, idle (one per slot)."""
        if slot._probation is not None:
            raise Conflict(f"{slot.name} already has a version in probation",
                           code="in_probation")
        for w in p.workers:
            w.set_state(State.IDLE)
        slot._probation = p

    def cancel_probation(self, slot: Slot) -> list[WorkerHandle]:
        """The probation ends now; its workers are the caller's to retire."""
        p, slot._probation = slot._probation, None
        if p is None:
            return []
        if p.timer is not None:
            self.loop.remove_timeout(p.timer)
            p.timer = None
        return p.workers

    def end_probation(self, slot: Slot, p: Probation) -> bool:
        """Probation `p` ran out; False when it was no longer the slot's."""
        if slot._probation is not p:
            return False
        slot._probation = None
        return True

    def switch_back(self, slot: Slot, reason: str, auto: bool,
                    figures: dict[str, object] | None = None
                    ) -> tuple[RolledBack, list[WorkerHandle]]:
        """Within probation: the previous version serves again, in one
        assignment. Returns what was rolled back and its workers (draining)."""
        p = slot._probation
        if p is None or not p.workers or slot._version is None:
            raise Conflict(f"{slot.name} has no version in probation any more",
                           code="no_previous")
        self.cancel_probation(slot)
        bad_version, bad = slot._version, list(slot._replicas)
        for w in bad:
            if w.state is State.SERVING:
                w.set_state(State.DRAINING)  # no new requests from now on
        self.swap(slot, p.workers, p.version, len(p.workers))
        slot._previous = None
        info: RolledBack = {"version": bad_version, "reason": reason, "auto": auto,
                            "figures": figures, "at": time.time(), "back_to": p.version}
        slot._rolled_back[bad_version] = info
        self._changed()
        return info, bad

    def note_rolled_back(self, slot: Slot, info: RolledBack) -> None:
        """A rollback past the probation (an apply of the version before)."""
        slot._rolled_back[info["version"]] = info

    def cache_gate(self, slot: Slot, key: tuple[int | None, str], score: GateScore) -> None:
        """The serving version's score on a golden set, kept for the next gate."""
        slot._gate_cache[key] = score

    # -- shadow and canary candidates ------------------------------------------------
    def set_candidate(self, slot: Slot, cand: Candidate) -> None:
        if not slot._replicas:
            raise Conflict(f"nothing serves {slot.name} yet: apply a version normally "
                           "before a shadow or canary", code="not_serving")
        for w in cand.workers:
            w.slot, w.on_answer = slot, slot.on_answer
            w.set_state(State.SERVING)
            w.send({"t": "serve"})
        slot._candidate = cand

    def drop_candidate(self, slot: Slot) -> list[WorkerHandle]:
        """The candidate goes; its workers drain (the caller retires them)."""
        c, slot._candidate = slot._candidate, None
        if c is None:
            return []
        for w in c.workers:
            if w.state is State.SERVING:
                w.set_state(State.DRAINING)
        return c.workers

    def promote(self, slot: Slot, c: Candidate
                ) -> tuple[list[WorkerHandle], ModelRef]:
        """The candidate serves all traffic: one assignment. Returns the
        workers that served before and what they served."""
        if slot._candidate is not c or not c.workers:
            raise Conflict(f"the {c.mode} candidate of {slot.name} is gone (its workers "
                           "died)", code="no_candidate")
        slot._candidate = None
        old = list(slot._replicas)
        previous: ModelRef = {"name": slot.name, "version": slot._version}
        self.swap(slot, c.workers, c.version, len(c.workers))
        self._changed()
        return old, previous

    # -- recovery ----------------------------------------------------------------------
    def worker_exited(self, w: WorkerHandle, info: dict[str, object]) -> tuple[Slot | None, str]:
        """A worker process ended: it leaves whatever it had in the slot.
        Returns its slot and its role: "probation", "candidate",
        "candidate_gone" (its last worker), "replica" (out of routing now),
        or "" (nothing to do)."""
        self.serving._exits.append(info)
        if self.serving._stopping:
            return None, ""
        slot: Slot | None = getattr(w, "slot", None)
        if slot is None:
            return None, ""
        p, c = slot._probation, slot._candidate
        if p is not None and w in p.workers:  # an idle previous version died
            p.workers.remove(w)
            if not p.workers:
                self.cancel_probation(slot)
            return slot, "probation"
        if c is not None and w in c.workers:
            c.workers.remove(w)
            if not c.workers:
                slot._candidate = None
                return slot, "candidate_gone"
            return slot, "candidate"
        if not self.remove_replica(slot, w):
            return slot, ""
        self.serving._restarts += 1
        return slot, "replica"

    def begin_replacing(self, slot: Slot) -> None:
        """A replacement replica loads: requests arriving meanwhile wait."""
        slot._replacing += 1

    def end_replacing(self, slot: Slot) -> None:
        slot._replacing -= 1
        slot.wake_all()

    def count_crash(self, slot: Slot, version: int, window: float) -> int:
        """Record a crash of `version`; the number within the window."""
        now = time.monotonic()
        crashes = slot._crashes[version]
        crashes.append(now)
        while crashes and now - crashes[0] > window:
            crashes.popleft()
        return len(crashes)

    def add_replica(self, slot: Slot, w: WorkerHandle, version: int) -> bool:
        """One more serving replica of `version`; False (nothing changed) when
        the slot moved on meanwhile or the service stops."""
        if slot._unloaded or slot._version != version or self.serving._stopping:
            return False
        w.slot = slot
        w.on_answer = slot.on_answer
        if w.state is not State.SERVING:
            w.set_state(State.SERVING)
        slot._replicas = (*slot._replicas, w)
        slot.wake_all()
        self._changed()
        return True

    def remove_replica(self, slot: Slot, w: WorkerHandle) -> bool:
        if w in slot._replicas:
            slot._replicas = tuple(x for x in slot._replicas if x is not w)
            slot.wake_all()
            self._changed()
            return True
        return False

    def give_up(self, slot: Slot, version: int, reason: str) -> FailedModel:
        """`version` is FAILED; the slot too when no replica of it is left."""
        info: FailedModel = {"name": slot.name, "version": version, "reason": reason,
                             "at": time.time()}
        self.serving._failed_models[f"{slot.name} v{version}"] = info
        if not slot._replicas:
            slot._failed = dict(info)
        self._changed()
        return info
