"""The serving state: what the service serves, held in one place.

`ServingState` holds the slots by model name, the default model, the applied
record as last written or followed, the models that failed, the last apply's
answer and the service's lifetime counters. The control plane's transitions
change it (apply, unload and following the record in control/applies.py;
rollback, promote and probation in control/rollout_control.py; recovery in
control/healing.py), always on the IOLoop; every other part reads it. The
request path (control/routing.py) reads a slot and its replicas, once per
request, and writes only the slot's figures.
"""
from __future__ import annotations

import collections
import time
from typing import Any

from state.errors import NoModel, UnknownModel
from control.slots import Slot


class ServingState:
    """Slots, the default model and the applied record."""

    def __init__(self) -> None:
        self.slots: dict[str, Slot] = {}
        self.default_name: str | None = None
        self.previous_default: str | None = None  # the default before the last change
        self.record: dict[str, Any] = {"default": None, "models": {}, "revision": 0}
        self.failed_models: dict[str, dict[str, Any]] = {}
        self.last_apply: dict[str, Any] | None = None
        self.demo_training = False  # the first-start demo's job runs: its apply is not explicit
        self.started = time.time()
        self.stopping = False
        self.restarts = 0
        self.exits: collections.deque[Any] = collections.deque(maxlen=20)

    def set_default(self, name: str | None) -> None:
        """The default model becomes `name`; the one before is remembered."""
        if name != self.default_name:
            self.previous_default, self.default_name = self.default_name, name

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

    def slot_for(self, name: str | None) -> Slot:
        """The slot that answers for `name` (the default model when None)."""
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
