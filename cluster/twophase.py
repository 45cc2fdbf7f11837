"""Cluster mode: the two-phase apply (prepare on every node, then one commit).

An apply in cluster mode (an operator's, or a training job's) first asks
every live node to *prepare*: load and warm up the target version beside
the one it serves, in workers held READY among its standbys
(`Provisioner.prepare`). Each node answers in Redis. Only when every node is
ready does the applying node go on with its ordinary apply, whose record
write is the commit: each node follows the record, and its apply of that
version takes the prepared workers, so on every node it is only the swap
and the nodes switch within a fraction of a second of each other.

A node that cannot prepare (its `worker.max_workers` budget is full, the
model fails to load there) or does not answer within
`cluster.prepare_timeout` stops the apply: nothing switches anywhere and
the apply answers 409 `not_prepared` naming the node(s) and why, unless the
apply asked for `"partial": true`, which lets the ready nodes switch (the
others follow the record as before: they load it cold, or stay stragglers).

    <prefix>:prep:<id>   hash: request (JSON: name, version, replicas, by,
                         deadline), node:<node id> (JSON answer: ready, at,
                         s, how / reason, code), verdict (commit | abort);
                         expires a while after its deadline
    <prefix>:preps       sorted set of open prepare ids by deadline: a node
                         that missed the pub/sub message finds them on its
                         tick
    <prefix>:prepseq     counter for prepare ids
    pub/sub on <prefix>:events: "prepare <id>", "prepared <id> <node>",
    "abort <id>", "published <name> <version>"

Preload on publish: a node that runs a training job publishes
"published <name> <version>" once the version is in the shared store; every
node serving an older version of that name prepares it within its free
budget, so the apply that usually follows is only the swap.

Prepared workers nobody took are trimmed: an aborted or expired prepare's
workers beyond the standby pool's size stop (the rest stay as preloaded
standbys). Everything runs on the IOLoop. Imports no TensorFlow.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from cluster.record import Cluster, ClusterUnreachable
from control.slots import MAX_REPLICAS
from state.errors import Conflict, InvalidName, ServiceError, StoreError
from state.store import check_name

if TYPE_CHECKING:
    from state.config import Config
    from state.store import ModelStore
    from control.pool import WorkerPool
    from control.provision import Provisioner
    from control.serving import ServingState

log = logging.getLogger("textswap.cluster")

# what the prepare phase of the apply running in this task found: read by
# ClusterNode.after_change for the /apply answer
PREPARED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "textswap_prepared", default=None)

PUBLISH_HOLD_S = 3600.0  # the longest a version preloaded on publish is held


class NotPrepared(Conflict):
    code = "not_prepared"


class Held:
    """Workers one node prepared for (name, version), held until `until`."""

    def __init__(self, name: str, version: int, workers: list[Any], until: float,
                 pid: str | None, published: bool) -> None:
        self.name, self.version, self.workers = name, version, workers
        self.until, self.pid, self.published = until, pid, published


class TwoPhase:
    """Prepares on this node, and coordinates the prepares of its applies.
    Given what it uses (no back-reference to the node that holds it)."""

    def __init__(self, cluster: Cluster, cfg: "Config", store: "ModelStore",
                 serving: "ServingState", provision: "Provisioner", pool: "WorkerPool") -> None:
        self.store, self.serving, self.provision, self.pool = store, serving, provision, pool
        self.c: Cluster = cluster
        self.timeout = float(cfg.cluster.prepare_timeout)
        self.k_open = self.c.key("preps")
        self._seen: dict[str, float] = {}           # prepare ids this node handled
        self._inflight: dict[tuple[str, int, int], asyncio.Future[Any]] = {}
        self._held: list[Held] = []
        self._wakers: dict[str, asyncio.Event] = {}
        self._aborted: set[str] = set()             # ids whose prepared workers go
        self._tasks: set[asyncio.Future[Any]] = set()
        self._scanning = False

    def _key(self, pid: str) -> str:
        return self.c.key("prep", pid)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    # -- the coordinator: the node that took the apply ------------------------------
    async def prepare_all(self, name: str, version: int | None, replicas: int,
                          partial: bool = False, mode: str | None = None
                          ) -> dict[str, Any] | None:
        """Phase one of a cluster apply: every live node prepares (name,
        version); returns once all are ready (or, with partial, once every
        node answered or the timeout passed and this node is ready). Raises
        NotPrepared (409) when a node is not ready and partial is false, or
        this node's own error when it cannot prepare: nothing has switched."""
        if mode not in (None, "normal"):
            return None  # shadow and canary switch nothing: one phase, as on one node
        version, _ = self.store.resolve(name, version)
        t0 = time.monotonic()
        me = self.c.node_id
        nodes = {b["node"] for b in await self.c.nodes()} | {me}
        pid = str(await self.c.call(lambda: self.c.redis.incr(self.c.key("prepseq"))))
        deadline = time.time() + self.timeout
        req = {"id": pid, "name": name, "version": version, "replicas": replicas,
               "by": me, "deadline": deadline, "nodes": sorted(nodes)}
        key = self._key(pid)

        async def open_() -> None:
            async with self.c.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, "request", json.dumps(req))
                pipe.expire(key, int(self.timeout) + 600)
                pipe.zadd(self.k_open, {pid: deadline})
                pipe.publish(self.c.k_events, f"prepare {pid}")
                await pipe.execute()
        self._seen[pid] = time.time()
        wake = self._wakers[pid] = asyncio.Event()
        try:
            await self.c.call(open_)
            log.info("cluster apply %s: %s v%s x%d, preparing on %s", pid, name, version,
                     replicas, ", ".join(sorted(nodes)))
            local = asyncio.ensure_future(self._answer(pid, req, coordinator=True))
            try:
                info = await self._collect(pid, req, nodes, partial, local, wake, t0)
            except BaseException:
                self._spawn(self._end(pid, "abort"))
                self._release(pid)
                raise
        finally:
            self._wakers.pop(pid, None)
        self._spawn(self._end(pid, "commit"))
        PREPARED.set(info)
        return info

    async def _collect(self, pid: str, req: dict[str, Any], nodes: set[str], partial: bool,
                       local: asyncio.Future[Any], wake: asyncio.Event, t0: float
                       ) -> dict[str, Any]:
        me = self.c.node_id
        gone: set[str] = set()
        beats_at = time.monotonic()
        while True:
            answers = await self._answers(pid)
            if local.done():
                exc = local.result()
                if exc is not None:
                    raise exc  # this node's own error, as a one-node apply answers it
                answers.setdefault(me, {"ready": True, "node": me})  # its write may have failed
            expired = time.time() >= req["deadline"]
            ready = sorted(n for n in nodes if answers.get(n, {}).get("ready"))
            failed = {n: answers[n] for n in nodes if n in answers and not answers[n]["ready"]}
            waiting = nodes - set(ready) - set(failed) - gone
            if expired:
                for n in waiting:
                    failed[n] = {"ready": False, "code": "prepare_timeout",
                                 "reason": f"not ready within {self.timeout:g}s "
                                           "(cluster.prepare_timeout)"}
                waiting = set()
            if (failed and not partial) or (not waiting and me in failed):
                raise self._refusal(req, ready, failed, partial)
            if not waiting:
                break
            if time.monotonic() - beats_at > 1.0:  # a node that died meanwhile is not waited for
                beats_at = time.monotonic()
                try:
                    live = {b["node"] for b in await self.c.nodes()}
                    gone |= {n for n in waiting if n not in live and n != me}
                except ClusterUnreachable:
                    pass
            try:
                await asyncio.wait_for(wake.wait(), max(0.01, min(
                    0.25, req["deadline"] - time.time())))
            except asyncio.TimeoutError:
                pass
            wake.clear()
        info = {"id": pid, "ready": ready, "not_ready": {n: a["reason"] for n, a in
                                                        sorted(failed.items())},
                "gone": sorted(gone), "partial": bool(failed or gone),
                "prepare_s": round(time.monotonic() - t0, 4),
                "nodes": {n: answers[n] for n in sorted(answers) if n in nodes}}
        if failed:
            log.warning("cluster apply %s: partial, %s not prepared (%s)", pid,
                        ", ".join(sorted(failed)),
                        "; ".join(f"{n}: {a['reason']}" for n, a in sorted(failed.items())))
        return info

    def _refusal(self, req: dict[str, Any], ready: list[str],
                 failed: dict[str, dict[str, Any]], partial: bool) -> NotPrepared:
        why = "; ".join(f"node {n}: {a['reason']}" for n, a in sorted(failed.items()))
        tail = ("" if partial else ' ("partial": true lets the ready nodes switch)')
        return NotPrepared(
            f"cluster apply of {req['name']} v{req['version']} refused: "
            f"{len(failed)} node{'s' if len(failed) != 1 else ''} could not prepare it "
            f"({why}); nothing switched on any node{tail}",
            details={"prepare_id": req["id"], "not_ready": {n: {"reason": a["reason"],
                                                                "code": a.get("code")}
                                                            for n, a in sorted(failed.items())},
                     "ready": ready})

    async def _answers(self, pid: str) -> dict[str, dict[str, Any]]:
        raw = await self.c.call(lambda: self.c.redis.hgetall(self._key(pid)))
        return {k[5:]: json.loads(v) for k, v in raw.items() if k.startswith("node:")}

    async def _end(self, pid: str, verdict: str) -> None:
        async def run() -> None:
            async with self.c.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._key(pid), "verdict", verdict)
                pipe.zrem(self.k_open, pid)
                if verdict == "abort":
                    pipe.publish(self.c.k_events, f"abort {pid}")
                await pipe.execute()
        try:
            await self.c.call(run)
        except ClusterUnreachable:
            pass  # the nodes trim what they prepared once it expires

    # -- every node: prepare, answer, hold --------------------------------------------
    def on_message(self, data: str) -> None:
        """A notification on the events channel (from the listener)."""
        kind, _, rest = data.partition(" ")
        if kind == "prepare":
            self._spawn(self._on_prepare(rest))
        elif kind == "prepared":
            waker = self._wakers.get(rest.split(" ")[0])
            if waker is not None:
                waker.set()
        elif kind == "abort":
            self._release(rest)
        elif kind == "published":
            name, _, version = rest.rpartition(" ")
            if name and version.isdigit():
                self._spawn(self._on_published(name, int(version)))

    def tick(self) -> None:
        """Every poll_interval: open prepares missed on pub/sub; trim."""
        self._trim()
        if not self._scanning:
            self._scanning = True
            self._spawn(self._scan())

    async def _scan(self) -> None:
        try:
            now = time.time()
            ids = await self.c.call(lambda: self.c.redis.zrangebyscore(self.k_open, now, "+inf"))
            for pid in ids:
                if pid not in self._seen:
                    await self._on_prepare(pid)
            await self.c.call(lambda: self.c.redis.zremrangebyscore(
                self.k_open, "-inf", now - 60))
            for pid, at in list(self._seen.items()):
                if at < now - self.timeout - 600:
                    del self._seen[pid]
                    self._aborted.discard(pid)
        except ClusterUnreachable:
            pass
        except Exception:
            log.exception("cluster prepare scan failed")
        finally:
            self._scanning = False

    async def _on_prepare(self, pid: str) -> None:
        if pid in self._seen:
            return
        self._seen[pid] = time.time()
        try:
            raw = await self.c.call(lambda: self.c.redis.hget(self._key(pid), "request"))
        except ClusterUnreachable:
            del self._seen[pid]  # the tick finds it again
            return
        if raw is None:
            return
        try:
            req = json.loads(raw)
            if req["by"] == self.c.node_id or time.time() >= float(req["deadline"]):
                return
        except (ValueError, TypeError, KeyError) as exc:
            log.error("cluster apply %s: a malformed prepare request ignored: %s", pid, exc)
            return
        await self._answer(pid, req)

    async def _answer(self, pid: str, req: dict[str, Any], coordinator: bool = False
                      ) -> BaseException | None:
        """Prepare req here and answer in Redis; the error (None: ready)."""
        name: Any  # and version, replicas: checked by _check_request below
        version: Any
        replicas: Any
        name, version, replicas = req.get("name"), req.get("version"), req.get("replicas")
        t = time.monotonic()
        exc: BaseException | None = None
        try:
            _check_request(name, version, replicas)  # read from Redis: untrusted
            how = await asyncio.wait_for(
                self.prepare_local(name, version, replicas, pid=pid, coordinator=coordinator),
                max(0.05, req["deadline"] - time.time()))
            ans = {"ready": True, "at": time.time(), "s": round(time.monotonic() - t, 4),
                   "how": how}
        except asyncio.TimeoutError:
            why = f"not ready within {self.timeout:g}s (cluster.prepare_timeout)"
            exc = NotPrepared(f"this node could not prepare {name} v{version}: {why}")
            ans = {"ready": False, "code": "prepare_timeout", "reason": why}
        except ServiceError as e:
            exc, ans = e, {"ready": False, "code": e.code, "reason": str(e)}
        except StoreError as e:
            exc, ans = e, {"ready": False, "code": "store_error", "reason": str(e)}
        except Exception as e:  # an odd failure is still an answer, never a hang
            log.exception("preparing %s v%s failed", name, version)
            exc, ans = e, {"ready": False, "code": "internal",
                           "reason": f"{type(e).__name__}: {e}"}
        if not ans["ready"]:
            log.warning("cluster apply %s: cannot prepare %s v%s here: %s", pid, name, version,
                        ans["reason"])
        ans["node"] = self.c.node_id

        async def write() -> None:
            async with self.c.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._key(pid), f"node:{self.c.node_id}", json.dumps(ans))
                pipe.publish(self.c.k_events, f"prepared {pid} {self.c.node_id}")
                await pipe.execute()
        try:
            await self.c.call(write)
        except ClusterUnreachable:
            pass  # the coordinator's timeout names this node
        return exc

    async def prepare_local(self, name: str, version: int, replicas: int, *,
                            pid: str | None = None, coordinator: bool = False,
                            make_room: bool = True, published: bool = False) -> str:
        """Have (name, version) x replicas ready to swap in on this node:
        'serving' (a follower already serves exactly that: its apply is a
        no-op), 'probation' (still loaded from before: the apply reuses it)
        or 'prepared' (workers held READY among the standbys)."""
        slot = self.serving.slots.get(name)
        if (not coordinator and slot is not None and slot.replicas
                and slot.version == version and len(slot.replicas) == replicas):
            return "serving"
        p = slot.probation if slot is not None else None
        if (p is not None and p.version == version and len(p.workers) == replicas
                and all(w.usable for w in p.workers)):
            return "probation"
        key = (name, version, replicas)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self.provision.prepare(
                name, version, replicas, make_room=make_room))
            self._inflight[key] = task

            def done(t: asyncio.Future[Any], key: tuple[Any, ...] = key) -> None:
                if self._inflight.get(key) is t:
                    del self._inflight[key]
                if not t.cancelled():
                    t.exception()  # retrieved: a waiter that timed out does not log it
            task.add_done_callback(done)
        workers = await asyncio.shield(task)
        until = time.time() + (PUBLISH_HOLD_S if published else self.timeout + 60)
        if pid is not None and pid in self._aborted:
            until = 0.0  # the apply was refused while these loaded
        self._held.append(Held(name, version, workers, until, pid, published))
        return "prepared"

    def _release(self, pid: str) -> None:
        """An aborted prepare: its workers beyond the standby pool stop."""
        self._aborted.add(pid)
        for h in self._held:
            if h.pid == pid:
                h.until = 0.0
        self._trim()

    def _trim(self) -> None:
        pool = self.pool
        now = time.time()
        keep: list[Held] = []
        for h in self._held:
            want = {"name": h.name, "version": h.version}
            live = [w for w in h.workers if w.alive and w in pool.standby and w.model == want]
            if not live:
                continue  # taken by the apply (or gone)
            if h.published and now < h.until:
                slot = self.serving.slots.get(h.name)
                try:
                    newest = self.store.versions(h.name)[-1]
                except (StoreError, IndexError):
                    newest = None
                if (slot is not None and slot.replicas and slot.version is not None
                        and slot.version < h.version and newest == h.version):
                    keep.append(h)
                    continue
                h.until = 0.0
            if now < h.until:
                keep.append(h)
                continue
            for w in live:
                if len([s for s in pool.standby if s.alive]) <= pool.size:
                    break  # the rest stay as preloaded standbys
                pool.standby.remove(w)
                log.info("releasing worker gen %d prepared for %s v%s (not applied)",
                         w.generation, h.name, h.version)
                asyncio.ensure_future(w.stop(1.0))
        self._held = keep

    async def _on_published(self, name: str, version: int) -> None:
        """A version reached the shared store: a node serving an older one of
        that name preloads it within its free budget (ends no probation)."""
        slot = self.serving.slots.get(name)
        if (self.serving.stopping or slot is None or not slot.replicas or slot.version is None
                or version <= slot.version):
            return
        replicas = slot.wanted or len(slot.replicas)
        try:
            await self.prepare_local(name, version, replicas, make_room=False, published=True)
            log.info("preloaded %s v%s x%d on publish", name, version, replicas)
        except (ServiceError, StoreError) as exc:
            log.info("not preloading %s v%s on publish: %s", name, version, exc)
        except Exception:
            log.exception("preloading %s v%s on publish failed", name, version)

    async def published(self, name: str, version: int) -> None:
        """Tell every node that (name, version) is in the shared store now."""
        try:
            await self.c.call(lambda: self.c.redis.publish(self.c.k_events,
                                                           f"published {name} {version}"))
        except ClusterUnreachable:
            pass


def _check_request(name: Any, version: Any, replicas: Any) -> None:
    """A prepare request's fields, checked as POST /apply checks them."""
    check_name(name)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InvalidName(f"version must be a whole number >= 1, not {str(version)[:40]!r}")
    if not isinstance(replicas, int) or isinstance(replicas, bool) \
            or not 1 <= replicas <= MAX_REPLICAS:
        raise InvalidName(f"replicas must be a whole number from 1 to {MAX_REPLICAS}, "
                          f"not {str(replicas)[:40]!r}")
