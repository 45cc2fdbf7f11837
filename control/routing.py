"""Routing: which worker answers a request, and the one-assignment swap.

`Router` owns the request path of /predict and OIP infer: the slot for a
model name (or the default, read from the serving state), least-in-flight
choice among its replicas, one retry when a worker dies with the request in
flight, a canary's share and a shadow's mirrored copy, and the latency and
error figures per version. It reads the serving state and writes only the
figures (the swap, one assignment, is the serving controller's:
control/servingctl.py); it starts and stops nothing, and calls nothing of the control plane while a
request is served: a version in probation failing fast is reported through
`on_failing`, which runs after the request's step of the IOLoop.
"""
from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any, Callable

from state.errors import ServiceError
from control.rollout_state import Candidate
from control.slots import Slot
from control.workerhandle import (RequestFailed, RequestTimedOut, WorkerDied, WorkerError,
                                  WorkerHandle)

if TYPE_CHECKING:
    from tornado.ioloop import IOLoop

    from state.config import Config
    from control.serving import ServingState


class Router:
    """Sends predictions to a slot's workers."""

    def __init__(self, serving: "ServingState", cfg: "Config", loop: "IOLoop",
                 on_failing: Callable[[], object]) -> None:
        self.serving, self.cfg, self.wcfg, self.loop = serving, cfg, cfg.worker, loop
        self.on_failing = on_failing  # a probation version failing: judge it now

    def slot_for(self, name: str | None) -> Slot:
        return self.serving.slot_for(name)

    async def predict(self, texts: list[str], model: str | None = None,
                      options: dict[str, object] | None = None
                      ) -> tuple[dict[str, object], list[str], list[Any]]:
        """(model, labels, scores) for texts; retried once on a sibling or a
        replacement if the worker dies with the request in flight.

        A canary candidate answers its share of requests; a shadow candidate
        gets a sampled copy, compared off this request's path. options: more
        to ask of the worker (an explanation); such requests are not mirrored."""
        slot = self.slot_for(model)
        deadline = self.loop.time() + self.wcfg.request_timeout
        cap = self.wcfg.max_inflight
        # the request's path reads the slot's fields directly (read only, no
        # property call): the supervisor's CPU per request stays what it was
        cand = slot._candidate
        if cand is not None and cand.mode == "canary" and random.random() < cand.fraction:
            w = Slot.pick(cand.workers, cap)
            if w is not None:
                t0 = time.monotonic()
                try:
                    scores = await w.predict(texts, options)
                    cand.stats.observe(time.monotonic() - t0)
                    return w.model, w.labels, scores  # type: ignore[return-value]  # serving: model set
                except RequestFailed as exc:
                    cand.stats.error()
                    raise ServiceError(f"model failed on this request: {exc}", 500,
                                       exc.code) from exc
                except WorkerError:
                    cand.stats.error()  # died or timed out: the serving version answers
        for attempt in (1, 2):
            w = await slot.route(cap, deadline)
            t0 = time.monotonic()
            try:
                fut = w.predict(texts, options)
                if cand is not None and cand.mode == "shadow" and not options and (
                        random.random() < cand.fraction):
                    self.mirror(slot, cand, texts, w.labels, fut)
                scores = await fut
            except WorkerDied:
                if attempt == 2:
                    self.count_error(slot, w)
                    raise ServiceError("the model worker died twice on this request", 503,
                                       "worker_died")
                continue
            except RequestFailed as exc:
                if exc.code == "cannot_explain":  # the request's fault, not the model's
                    raise ServiceError(str(exc), 422, exc.code) from None
                self.count_error(slot, w)
                raise ServiceError(f"model failed on this request: {exc}", 500,
                                   exc.code) from exc
            except RequestTimedOut as exc:
                self.count_error(slot, w)
                raise ServiceError(str(exc), 504, "timeout") from None
            took = time.monotonic() - t0
            slot._stats.observe(took)
            p = slot._probation
            if p is not None and w.model and w.model["version"] == p.new_version:
                p.new_stats.observe(took)
            if cand is not None and cand.mode == "canary":
                cand.serving_stats.observe(took)
            return w.model, w.labels, scores  # type: ignore[return-value]  # serving: model set
        raise AssertionError("unreachable")

    def count_error(self, slot: Slot, w: WorkerHandle) -> None:
        slot.stats.error()
        p = slot.probation
        if p is not None and w.model and w.model["version"] == p.new_version:
            p.new_stats.error()
            r = self.cfg.rollout
            if (p.new_stats.requests >= r.min_requests
                    and p.new_stats.error_rate > r.max_error_rate):
                # judged now, not at the next sweep: a version failing every
                # request would fail a second's worth of them meanwhile
                self.loop.add_callback(self.on_failing)

    def mirror(self, slot: Slot, cand: Candidate, texts: list[str], labels: list[str],
                primary: Any) -> None:
        """Send a copy to the shadow candidate; compare once both answered.
        Never awaited by the client's request, and skipped when the candidate
        is at its in-flight cap, so a slow shadow cannot slow serving."""
        w = Slot.pick(cand.workers, self.wcfg.max_inflight)
        if w is None:
            cand.dropped += 1
            return
        cand.mirrored += 1
        t0 = time.monotonic()
        try:
            fut = w.predict(texts)
        except WorkerError:
            cand.stats.error()
            return

        async def compare() -> None:
            try:
                theirs = await fut
                cand.stats.observe(time.monotonic() - t0)
            except WorkerError:
                cand.stats.error()
                return
            try:
                ours = await primary
            except Exception:  # the client's request failed: nothing to compare with
                return
            cand.compare(texts, labels, w.labels, ours, theirs)
        self.loop.spawn_callback(compare)
