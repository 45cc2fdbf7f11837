"""The serving state: what the service serves, held in one place.

`ServingState` holds the slots by model name, the default model, the applied
record as last written or followed, the models that failed, the last apply's
answer and the service's lifetime counters. Every field is a read-only
property: one part writes them, the serving controller
(control/servingctl.py `ServingController`), whose methods are the
transitions (apply, unload, rollback, promote, recover, give up, follow the
record), always on the IOLoop. Every other part reads. The request path
(control/routing.py) reads a slot and its replicas, once per request, and
writes only the slot's figures.
"""
from __future__ import annotations

import collections
import time
from types import MappingProxyType
from typing import Mapping, TypedDict

from state.errors import NoModel, UnknownModel
from control.slots import ApplyResult, Slot


class RecordEntry(TypedDict):
    """One model of the applied record."""
    version: int | None
    replicas: int | None
    explicit: bool


class AppliedRecord(TypedDict):
    """The applied record: what serves, per name, and the default model."""
    default: str | None
    models: dict[str, RecordEntry]
    revision: int


class FailedModel(TypedDict):
    """A version marked FAILED (`ServingController.give_up`)."""
    name: str
    version: int
    reason: str
    at: float


def empty_record() -> AppliedRecord:
    return {"default": None, "models": {}, "revision": 0}


class ServingState:
    """Slots, the default model and the applied record (read-only here;
    written by `ServingController` alone)."""

    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}
        self._slots_view: Mapping[str, Slot] = MappingProxyType(self._slots)
        self._default_name: str | None = None
        self._previous_default: str | None = None  # the default before the last change
        self._record: AppliedRecord = empty_record()
        self._failed_models: dict[str, FailedModel] = {}
        self._last_apply: ApplyResult | None = None
        self._demo_training = False  # the first-start demo's job runs: its apply is not explicit
        self._started = time.time()
        self._stopping = False
        self._restarts = 0
        self._exits: collections.deque[dict[str, object]] = collections.deque(maxlen=20)

    # -- the fields, read-only ----------------------------------------------------
    @property
    def slots(self) -> Mapping[str, Slot]:
        return self._slots_view

    @property
    def default_name(self) -> str | None:
        return self._default_name

    @property
    def previous_default(self) -> str | None:
        return self._previous_default

    @property
    def record(self) -> AppliedRecord:
        return self._record

    @property
    def failed_models(self) -> Mapping[str, FailedModel]:
        return MappingProxyType(self._failed_models)

    @property
    def last_apply(self) -> ApplyResult | None:
        return self._last_apply

    @property
    def demo_training(self) -> bool:
        return self._demo_training

    @property
    def started(self) -> float:
        return self._started

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def exits(self) -> tuple[dict[str, object], ...]:
        return tuple(self._exits)

    # -- reads -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """The default model serves (what /readyz reports)."""
        slot = self._slots.get(self._default_name) if self._default_name else None
        return slot is not None and bool(slot._replicas)

    def serving_names(self) -> list[str]:
        return sorted(n for n, s in self._slots.items() if s.replicas)

    def serving_model(self, name: str | None = None) -> dict[str, object] | None:
        """{"name", "version", "labels", "replicas"} of what serves `name`
        (the default model when None), or None."""
        slot = self._slots.get(name or self._default_name or "")
        # on every request's path: the slot's fields read directly (no property call)
        if slot is None or not slot._replicas:
            return None
        return {"name": slot._name, "version": slot._version, "labels": list(slot._labels),
                "replicas": len(slot._replicas)}

    def slot_for(self, name: str | None) -> Slot:
        """The slot that answers for `name` (the default model when None)."""
        if name is None:
            if self._default_name is None:
                raise NoModel("no model is serving; apply one with POST /apply")
            slot = self._slots.get(self._default_name)
            if slot is None:
                raise NoModel(f"the default model {self._default_name!r} is not loaded yet")
            return slot
        slot = self._slots.get(name)
        if slot is None:
            serving = ", ".join(self.serving_names()) or "none"
            raise UnknownModel(f"model {name!r} is not serving here (serving: {serving})",
                               details={"serving": self.serving_names()})
        return slot
