"""Safe rollouts: probation and rollback, the quality gate, shadow and canary.

`RolloutControl` owns each slot's rollout state: the previous version kept
loaded in probation after a swap (rollback within it is one assignment,
automatic when the new version's error rate or p99 passes the limits), the
golden-set quality gate of an apply or a promotion, and shadow/canary
candidates (start, promote, abort). The figures themselves are
`control/rollout_state.py`'s. Every change of a slot (probation, the swap
back, candidates) is a call of the serving controller (control/servingctl.py);
it persists through `RecordKeeper.commit` (persist, then switch).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from tornado import gen

from state.errors import ApplyFailed, Conflict, ServiceError, StorageFailed
from state.store import check_name
from control.rollout_state import Candidate, Probation, label_changes
from control.rollout_state import score as rollouts_score
from control.slots import RolledBack, Slot
from control.workerhandle import WorkerHandle

if TYPE_CHECKING:
    from tornado.ioloop import IOLoop

    from state.config import Config
    from state.store import ModelStore
    from control.records import RecordKeeper
    from control.events import Events
    from control.pool import WorkerPool
    from control.provision import Provisioner
    from control.rollout_state import GoldenSet, GoldenSets
    from control.routing import Router
    from control.servingctl import ApplyResult, ModelRef, RollbackResult, ServingController

log = logging.getLogger("textswap.supervisor")


class RolloutControl:
    """Probation, rollback, the quality gate, shadow and canary, per slot."""

    def __init__(self, ctl: "ServingController", cfg: "Config", loop: "IOLoop",
                 store: "ModelStore", pool: "WorkerPool", events: "Events",
                 golden: "GoldenSets", provision: "Provisioner", router: "Router",
                 keeper: "RecordKeeper", apply: Callable[..., Awaitable["ApplyResult"]],
                 gate_set: Callable[[str, "GoldenSet | None"], "GoldenSet | None"]
                 = lambda name, golden: golden) -> None:
        """apply: the applies' apply (a rollback past the probation is a new
        apply); gate_set: the golden set plus a retrain policy's feedback
        hold-out (the policies' gate_set)."""
        self.ctl, self.serving = ctl, ctl.serving
        self.cfg, self.wcfg, self.loop = cfg, cfg.worker, loop
        self.store, self.pool, self.events, self.golden = store, pool, events, golden
        self.provision, self.router, self.keeper = provision, router, keeper
        self.apply, self.gate_set = apply, gate_set

    async def after_swap(self, slot: Slot, old: list[WorkerHandle],
                          previous: "ModelRef | None", version: int
                          ) -> list[dict[str, object]]:
        """The previous version's workers: kept idle in probation (a rollback
        is then one assignment), or drained and stopped."""
        probation_s = self.cfg.rollout.probation_s
        if self.serving.stopping or not old or previous is None or previous["version"] == version \
                or probation_s <= 0:
            return await self.provision.retire(old)
        if slot.probation is not None:  # one probation per slot: the newest
            self.loop.spawn_callback(self.provision.retire, self.cancel_probation(slot))
        old_p99 = slot.stats_before_swap
        assert previous["version"] is not None  # workers served it
        p = Probation(version=previous["version"], workers=old, new_version=version,
                      until=time.monotonic() + probation_s, old_p99=old_p99)
        self.ctl.start_probation(slot, p)
        p.timer = self.loop.call_later(probation_s, self.end_probation, slot, p)
        log.info("%s v%s stays loaded in probation for %.0fs (rollback is instant)",
                 slot.name, p.version, probation_s)
        # in-flight requests on the old workers still finish: wait for them
        drained = await gen.multi([w.wait_idle(self.wcfg.drain_timeout) for w in old])
        return [{"generation": w.generation, "pid": w.pid, "drained": d, "ended": "probation"}
                for w, d in zip(old, drained)]

    def cancel_probation(self, slot: Slot) -> list[WorkerHandle]:
        return self.ctl.cancel_probation(slot)

    def end_probation(self, slot: Slot, p: Probation) -> None:
        if not self.ctl.end_probation(slot, p):
            return
        log.info("probation of %s v%s ended: its workers stop", slot.name, p.version)
        self.events.emit("probation_ended", name=slot.name, from_version=p.version,
                         to_version=p.new_version, details=p.new_stats.describe())
        self.loop.spawn_callback(self.provision.retire, p.workers)

    def switch_back(self, slot: Slot, reason: str, auto: bool,
                    figures: dict[str, object] | None = None) -> RolledBack:
        """Within probation: the previous version serves again, in one
        assignment; the rolled-back version's workers drain and stop. Routing
        only: the callers persist (before it, or right after it)."""
        info, bad = self.ctl.switch_back(slot, reason, auto, figures)
        bad_version, back_to = info["version"], info["back_to"]
        (log.warning if auto else log.info)(
            "%s rolled back from v%s to v%s (%s): %s", slot.name, bad_version, back_to,
            "automatic" if auto else "manual", reason)
        self.events.emit("rollback", name=slot.name, source="auto" if auto else "api",
                         from_version=bad_version, to_version=back_to, reason=reason,
                         details=figures)
        self.loop.spawn_callback(self.provision.retire, bad)
        if auto:  # nor may a standby that preloaded it keep it
            self.pool.forget(slot.name, bad_version)  # (and preload_guesses skip it)
        return info

    def rollback_now(self, slot: Slot, reason: str, auto: bool,
                     figures: dict[str, object] | None = None) -> RolledBack:
        """The automatic rollback (errors, latency, a crash in probation):
        switch at once, since every moment on the bad version costs requests,
        then write the record (RecordKeeper.save_later; retried until it succeeds)."""
        info = self.switch_back(slot, reason, auto, figures)
        self.keeper.save_later(slot.name)
        return info

    async def rollback(self, name: str, source: str = "api") -> "RollbackResult":
        """POST /rollback: the previous version serves again. Within probation
        it is one routing assignment; after it, an apply of that version."""
        check_name(name)
        slot = self.router.slot_for(name)
        t0 = time.monotonic()
        p = slot.probation
        if p is not None and all(w.usable for w in p.workers):
            # persist, then switch: the record names the version in probation
            if p.timer is not None:  # it must not end while the record is written
                self.loop.remove_timeout(p.timer)
                p.timer = None
            done: list[RolledBack] = []

            def switch() -> None:
                done.append(self.switch_back(slot, "manual rollback", auto=False))
            try:
                await self.keeper.commit(
                    name, {"version": p.version, "replicas": len(p.workers),
                           "explicit": slot.explicit}, switch=switch)
            except StorageFailed:
                if slot.probation is p:  # nothing changed: probation runs on
                    p.timer = self.loop.call_at(
                        self.loop.time() + max(0.0, p.until - time.monotonic()),
                        self.end_probation, slot, p)
                raise
            except Conflict:  # the probation ended while the record was written
                self.keeper.save_later(name)
                raise
            info = done[0]
            out: RollbackResult = {"name": name, "from_version": info["version"],
                                   "to_version": info["back_to"], "instant": True,
                                   "took_s": round(time.monotonic() - t0, 6)}
            after = await self.keeper.records.after_change()  # cluster: written, replicated
            if after is not None:
                out["cluster"] = after
            return out
        if not slot.previous:
            raise Conflict(f"{name} has no previous version to roll back to", code="no_previous")
        target, bad = slot.previous, slot.version
        assert bad is not None  # a slot with a previous version serves one
        result = await self.apply(name, target, default=False, source="rollback")
        self.ctl.note_rolled_back(slot, {"version": bad, "reason": "manual rollback",
                                         "auto": False, "figures": None, "at": time.time(),
                                         "back_to": target})
        self.events.emit("rollback", name=name, source=source, from_version=bad,
                         to_version=target, reason="manual rollback after probation",
                         phases=result.get("phases_s"))
        return {"name": name, "from_version": bad, "to_version": target, "instant": False,
                "took_s": round(time.monotonic() - t0, 6), "apply": result}

    def check_probations(self) -> None:
        """Once a second: roll back a version in probation whose error rate or
        tail latency went past the configured limits."""
        r = self.cfg.rollout
        for slot in list(self.serving.slots.values()):
            p = slot.probation
            if p is None or p.new_version != slot.version:
                continue
            s = p.new_stats
            if s.requests < r.min_requests:
                continue
            figures: dict[str, object] = {
                "new_version": s.describe(),
                "previous_p99_ms": None if p.old_p99 is None else round(1000 * p.old_p99, 3)}
            if s.error_rate > r.max_error_rate:
                self.rollback_now(slot, f"error rate {s.error_rate:.1%} above "
                                   f"rollout.max_error_rate {r.max_error_rate:.1%}",
                                   auto=True, figures=figures)
                continue
            p99 = s.p(0.99)
            if p.old_p99 and p99 and p99 > r.max_latency_ratio * p.old_p99 and (
                    p99 - p.old_p99) * 1000 > r.latency_slack_ms:
                self.rollback_now(slot, f"p99 latency {1000 * p99:.1f} ms above "
                                   f"{r.max_latency_ratio}x the previous version's "
                                   f"{1000 * p.old_p99:.1f} ms", auto=True, figures=figures)

    async def quality_gate(self, slot: Slot, version: int, workers: list[WorkerHandle],
                            enabled: bool, min_accuracy: float | None) -> dict[str, object] | None:
        golden = self.golden.get(slot.name)
        # a policy retrain: its feedback hold-out too (docs/loop.md)
        golden = self.gate_set(slot.name, golden)
        if golden is None:
            if min_accuracy is not None and enabled:
                raise ServiceError(f"min_accuracy needs a golden set: register one with PUT "
                                   f"/models/{slot.name}/golden", 422, "no_golden_set")
            return None
        if not enabled:
            log.warning("quality gate of %s v%s skipped on request", slot.name, version)
            return {"skipped": True}
        texts, truth = golden["texts"], golden["labels"]
        floor = min_accuracy if min_accuracy is not None else golden.get("min_accuracy")
        cand = rollouts_score(workers[0].labels, await self.score_on(workers[0], texts), truth)
        serving = None
        if slot.replicas and slot.version != version:
            key = (slot.version, golden["sha256"])
            serving = slot.gate_cache.get(key)
            if serving is None:
                serving = rollouts_score(slot.labels, await self.score_on(slot.replicas[0],
                                                                           texts), truth)
                self.ctl.cache_gate(slot, key, serving)
        tol = self.cfg.rollout.gate_tolerance
        reasons = []
        if serving and cand["accuracy"] < serving["accuracy"] - tol:
            reasons.append(f"accuracy {cand['accuracy']:.4f} on the golden set is below the "
                           f"serving v{slot.version}'s {serving['accuracy']:.4f} minus "
                           f"rollout.gate_tolerance {tol}")
        if floor is not None and cand["accuracy"] < floor:
            reasons.append(f"accuracy {cand['accuracy']:.4f} is below min_accuracy {floor}")
        info: dict[str, object] = {
            "passed": not reasons, "golden_examples": len(texts), "tolerance": tol,
            "min_accuracy": floor, "candidate": {"version": version, **cand},
            "serving": None if serving is None else {"version": slot.version, **serving},
            "per_label_changes": label_changes(serving, cand) if serving else None}
        if reasons:
            raise Conflict(f"quality gate refused {slot.name} v{version}: "
                           + "; ".join(reasons), code="quality_gate", details={"gate": info})
        return info

    async def score_on(self, w: WorkerHandle, texts: list[str]) -> list[Any]:
        step = self.wcfg.max_batch
        parts = await gen.multi([w.predict(texts[i:i + step]) for i in range(0, len(texts), step)])
        return [row for part in parts for row in part]

    async def start_candidate(self, slot: Slot, version: int, path: str, replicas: int,
                               mode: str, fraction: float | None, keep_examples: int,
                               source: str, t_call: float) -> "ApplyResult":
        if not slot.replicas:
            raise Conflict(f"nothing serves {slot.name} yet: apply a version normally "
                           "before a shadow or canary", code="not_serving")
        if version == slot.version:
            raise Conflict(f"{slot.name} v{version} already serves", code="already_serving")
        if slot.candidate is not None:  # replaced: recorded as an abort, with its figures
            old = slot.candidate
            self.events.emit("abort", name=slot.name, source=source, from_version=slot.version,
                             to_version=old.version, details=old.describe(),
                             reason=f"replaced by a {mode} of v{version}")
            self.loop.spawn_callback(self.provision.retire, self.drop_candidate(slot))
        fraction = fraction if fraction is not None else (1.0 if mode == "shadow" else 0.1)
        what = f"a {mode} of {slot.name} v{version}"
        await self.provision.make_room(replicas, what)
        new = self.provision.obtain(slot.name, version, replicas, what)
        try:
            ready = list(await gen.multi([self.provision.make_ready(w, slot.name, version, path)
                                          for w in new]))
        except ApplyFailed:
            for w in new:
                if w.alive:
                    self.loop.spawn_callback(w.stop, 1.0)
            self.pool.ensure(delay=1.0)
            raise
        workers = [w for w, _, _ in ready]
        self.ctl.set_candidate(slot, Candidate(version=version, workers=workers, mode=mode,
                                               fraction=fraction,
                                               keep_examples=keep_examples))
        log.info("%s v%s runs as a %s candidate beside v%s (fraction %.3f)", slot.name,
                 version, mode, slot.version, fraction)
        self.events.emit(mode, name=slot.name, source=source, from_version=slot.version,
                         to_version=version, details={"fraction": fraction})
        self.pool.ensure(delay=2.0)
        return {"name": slot.name, "mode": mode, "serving": {"name": slot.name,
                                                              "version": slot.version},
                "candidate": {"name": slot.name, "version": version}, "fraction": fraction,
                "workers": [{"generation": w.generation, "pid": w.pid} for w in workers],
                "total_s": round(time.monotonic() - t_call, 4)}

    def drop_candidate(self, slot: Slot) -> list[WorkerHandle]:
        return self.ctl.drop_candidate(slot)

    async def promote(self, name: str, gate: bool = True) -> dict[str, object]:
        """The shadow or canary candidate serves all traffic: one assignment."""
        slot = self.router.slot_for(name)
        async with slot.lock:
            c = slot.candidate
            if c is None:
                raise Conflict(f"{name} has no shadow or canary candidate to promote",
                               code="no_candidate")
            gate_info = await self.quality_gate(slot, c.version, c.workers, gate, None)
            seen: list[tuple[list[WorkerHandle], ModelRef, float]] = []

            def switch() -> None:
                t0 = time.monotonic()
                old, previous = self.ctl.promote(slot, c)
                seen.append((old, previous, time.monotonic() - t0))
            try:  # persist, then switch
                await self.keeper.commit(
                    name, {"version": c.version, "replicas": len(c.workers),
                           "explicit": slot.explicit}, switch=switch)
            except Conflict:
                self.keeper.save_later(name)
                raise
            old, previous, took = seen[0]
            log.info("%s v%s promoted from %s", name, c.version, c.mode)
            self.events.emit("promote", name=name, source="api", from_version=previous["version"],
                             to_version=c.version, details={"mode": c.mode, **c.describe(),
                                                            "gate": gate_info})
            ended = await self.after_swap(slot, old, previous, c.version)
        after = await self.keeper.records.after_change()  # cluster: written, replicated
        out: dict[str, object] = {
            "name": name, "from_version": previous["version"], "to_version": c.version,
            "mode": c.mode, "swap_s": round(took, 6), "gate": gate_info,
            "old_workers": ended, "figures": c.describe()}
        if after is not None:
            out["cluster"] = after
        return out

    async def abort(self, name: str) -> dict[str, object]:
        slot = self.router.slot_for(name)
        c = slot.candidate
        if c is None:
            raise Conflict(f"{name} has no shadow or canary candidate to abort",
                           code="no_candidate")
        figures = c.describe()
        workers = self.drop_candidate(slot)
        self.events.emit("abort", name=name, source="api", from_version=slot.version,
                         to_version=c.version, details=figures)
        ended = await self.provision.retire(workers)
        self.pool.ensure()
        return {"name": name, "aborted_version": c.version, "mode": c.mode, "figures": figures,
                "workers": ended}

    def rollout_status(self, name: str) -> dict[str, object]:
        slot = self.router.slot_for(name)
        return {"name": name, "version": slot.version, "previous_version": slot.previous,
                "probation": slot.probation.describe() if slot.probation else None,
                "candidate": slot.candidate.describe() if slot.candidate else None,
                "serving": slot.stats.describe(),
                "rolled_back": list(slot.rolled_back.values())}
