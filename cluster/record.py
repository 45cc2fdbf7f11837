"""Cluster mode: the applied-model record, heartbeats and a lock in Redis.

Off by default (``cluster.redis_url`` empty): one node keeps its file record
(store.py + watcher.py). With a Redis URL, every node reads and writes the
record here instead, so an apply on any node reaches all of them:

    <prefix>:record        the whole record, ONE JSON string:
                           {"default", "models": {name: {version, replicas,
                           explicit}}, "revision", "applied_at", "by"};
                           changed only by `update_record` (WATCH/MULTI: a
                           read-modify-write that retries when another node
                           wrote in between), which bumps the revision and
                           publishes it
    <prefix>:events        pub/sub channel: "record <rev>", "jobs", and the
                           two-phase apply's "prepare <id>", "prepared <id>",
                           "abort <id>", "published <name> <version>"
                           (cluster/twophase.py)
    <prefix>:node:<id>     a node's heartbeat (JSON, expires after
                           heartbeat_ttl): what it serves, the revision it
                           has fully applied, the time
    <prefix>:once:<what>   once-per-cluster locks (the first-start demo)

Following: a pub/sub listener re-reads the record on each notification, and
a ticker re-reads it every ``poll_interval`` anyway, so a lost message or a
Redis restart cannot leave a node behind. Each new revision is handed to the
supervisor's callback on the IOLoop, which reconciles the node with the
latest record (cluster.py does not touch workers). The last record seen is
also kept in a local cache file, so a node started while Redis is down
serves its last known record.

Redis down: nothing here raises into the serving path. The listener and the
ticker log once, retry with backoff, and resync on reconnect; calls that
need Redis (apply, train) raise `ClusterUnreachable` (503). If Redis comes
back empty (lost its data), the first node to notice writes back the last
record it knows (SET NX), so the cluster keeps its setting.

Sentinel (``cluster.sentinels``, cluster/connect.py): the client asks the
Sentinels for the primary on every new connection. Each tick also asks them
which address is the primary now; a new one is a failover: logged, counted
(`status`, GET /cluster), the pub/sub connection is made again on the new
primary, and the record is re-read and taken as it is there, even at a lower
revision (a write the old primary had not replicated is gone; the nodes
converge on what the cluster holds). A record write's revision is one above
the highest this node has seen, so a revision number never names two records.

Acknowledged means replicated: the record writes and the queued jobs
(`multi_acked`) WAIT for ``cluster.min_replicas_acked`` replicas on the
connection that wrote them; too few within ``replica_ack_timeout``:
`NotReplicated` (503 not_replicated).

Everything runs on the IOLoop with redis.asyncio: no thread, no blocking
call. Imports no TensorFlow.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from typing import Any, Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, WatchError

from cluster.connect import NotReplicated, RedisTarget, primary_of
from state.errors import ServiceError
from state.store import normalize_record, write_json_atomic

log = logging.getLogger("textswap.cluster")

# what a broken connection raises, from redis-py or below it
DOWN_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


class ClusterUnreachable(ServiceError):
    status, code = 503, "cluster_unreachable"


def empty_record() -> dict[str, Any]:
    return {"default": None, "models": {}, "revision": 0}


class Cluster:
    """One node's view of the cluster store. Create and use it on the IOLoop."""

    def __init__(self, url: "str | RedisTarget", node_id: str, *, prefix: str = "textswap",
                 cache_path: str | None = None, poll_interval: float = 1.0,
                 heartbeat_interval: float = 1.0, heartbeat_ttl: float = 5.0,
                 op_timeout: float = 1.0) -> None:
        self.target = url if isinstance(url, RedisTarget) else RedisTarget(url)
        self.url = self.target.where()  # for messages: no password
        self.node_id = node_id
        self.prefix = prefix
        self.cache_path = cache_path
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_ttl = heartbeat_ttl
        # one immediate retry inside redis-py (a pooled connection that a Redis
        # restart closed), no more: a down Redis must answer fast (503); the
        # loops below do the real retrying, with backoff
        self.op_timeout = op_timeout
        self.redis: aioredis.Redis = self.target.async_client(
            socket_timeout=op_timeout, socket_connect_timeout=op_timeout,
            retry=Retry(NoBackoff(), 1), decode_responses=True)
        self.k_record = f"{prefix}:record"
        self.k_events = f"{prefix}:events"
        self.record: dict[str, Any] | None = self._read_cache()
        # the highest revision this node saw, even one lost in a failover: the
        # next write goes above it, so one number never names two records
        self.max_seen = self.record["revision"] if self.record else 0
        self.applied_revision = 0       # the revision this node fully serves
        self._beat_lock = asyncio.Lock()  # heartbeat(): one beat in flight at a time
        self.up: bool | None = None     # None: not known yet
        self.down_since: float | None = None
        self.last_error: str | None = None
        self._on_record: Callable[[dict[str, Any]], Any] | None = None
        self._describe: Callable[[], dict[str, Any]] | None = None
        self._on_jobs: Callable[[], Any] | None = None
        self._on_message: Callable[[str], Any] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self._wake = asyncio.Event()
        self.primary: str | None = None  # Sentinel: the primary's address, as last asked
        self.failovers = 0               # primaries changed since this node started
        self.last_failover: float | None = None
        self._epoch = 0                  # bumped on a failover: the listener resubscribes
        self._on_failover: Callable[[], Any] | None = None
        self._sentinels_silent = False

    # -- keys -----------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # -- connection state ---------------------------------------------------------------
    def _mark_down(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.up is not False:
            self.down_since = time.time()
            log.error("cluster store %s unreachable (%s): serving on with what this node "
                      "has; retrying with backoff", self.url, self.last_error)
        self.up = False

    def _mark_up(self) -> None:
        if self.up is False:
            log.warning("cluster store reachable again after %.1fs",
                        time.time() - (self.down_since or time.time()))
        self.up, self.down_since = True, None

    def unreachable(self, exc: BaseException | None = None) -> ClusterUnreachable:
        why = f"{type(exc).__name__}: {exc}" if exc else (self.last_error or "unknown")
        return ClusterUnreachable(f"cluster store unreachable ({why}); this node keeps "
                                  "serving what it has, retry later")

    async def call(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run one Redis operation; ClusterUnreachable (503) when Redis is down."""
        try:
            out = await coro_fn()
        except NotReplicated:
            self._mark_up()
            raise
        except DOWN_ERRORS as exc:
            if isinstance(exc, WatchError):
                raise
            self._mark_down(exc)
            raise self.unreachable(exc) from None
        self._mark_up()
        return out

    # -- the record -----------------------------------------------------------------------
    def _read_cache(self) -> dict[str, Any] | None:
        if not self.cache_path:
            return None
        try:
            with open(self.cache_path, encoding="utf-8") as fh:
                return {**normalize_record(json.load(fh))}
        except FileNotFoundError:
            return None
        except Exception as exc:  # a broken cache is not worth refusing to start
            log.error("ignoring the cached cluster record %s: %s", self.cache_path, exc)
            return None

    def _write_cache(self, rec: dict[str, Any]) -> None:
        if not self.cache_path:
            return
        try:
            os.makedirs(os.path.dirname(self.cache_path) or ".", exist_ok=True)
            write_json_atomic(self.cache_path, rec)
        except OSError as exc:
            log.error("cannot write the cluster record cache %s: %s", self.cache_path, exc)

    @staticmethod
    def _parse(raw: str | None) -> dict[str, Any] | None:
        if raw is None:
            return None
        data = json.loads(raw)
        rec = normalize_record(data)
        for extra in ("applied_at", "by"):
            if extra in data:
                rec[extra] = data[extra]
        return rec

    def _remember(self, rec: dict[str, Any]) -> bool:
        """Keep rec if it is newer than what we know; True when it is."""
        if self.record is not None and rec["revision"] <= self.record["revision"]:
            return False
        self.record = rec
        self.max_seen = max(self.max_seen, rec["revision"])
        self._write_cache(rec)
        return True

    async def read_record(self, force: bool = False) -> dict[str, Any] | None:
        """The record in Redis now (ClusterUnreachable when down); force: keep
        it even when older than the one this node knows (after a failover)."""
        raw = await self.call(lambda: self.redis.get(self.k_record))
        try:
            rec = self._parse(raw)
        except (ValueError, Exception) as exc:
            log.error("ignoring the record in Redis: %s", exc)
            return None
        if rec is not None:
            if force and self.record is not None and rec != self.record:
                if rec["revision"] <= self.record["revision"]:
                    log.warning("cluster record: revision %d was lost with the old primary; "
                                "the cluster's record is revision %d",
                                self.record["revision"], rec["revision"])
                self.record = None
            self._remember(rec)
        return rec

    async def update_record(self, mutate: Callable[[dict[str, Any]], dict[str, Any] | None]
                            ) -> dict[str, Any]:
        """Atomically change the record: mutate(copy of current) -> new, or None
        for no change. The revision goes up by one and every node is told."""
        async def txn(conn: Any) -> dict[str, Any]:
            while True:
                await self._cmd(conn, "WATCH", self.k_record)
                current = self._parse(await self._cmd(conn, "GET", self.k_record))
                if current is None:  # Redis lost it, or a new cluster
                    current = dict(self.record) if self.record else empty_record()
                base = json.loads(json.dumps(current))
                new = mutate(base)
                if new is None:
                    await self._cmd(conn, "UNWATCH")
                    return current
                new = normalize_record(new)
                # above anything this node saw: after a failover that lost a
                # write, the lost revision's number is not given to another record
                new["revision"] = max(current["revision"], self.max_seen) + 1
                new["applied_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                new["by"] = self.node_id
                done = await self._exec(conn, [
                    ("SET", self.k_record, json.dumps(new)),
                    ("PUBLISH", self.k_events, f"record {new['revision']}")])
                if done is None:
                    continue  # another node wrote first: redo on its record
                self._remember(new)
                await self._replicated(conn, "the cluster record (revision "
                                       f"{new['revision']})")
                return new
        rec = await self.call(lambda: self.on_connection(txn))
        self._remember(rec)
        return rec

    # -- writes on one connection, then WAIT -------------------------------------------------
    async def on_connection(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """fn(connection): one pooled connection for a write and its WAIT."""
        pool = self.redis.connection_pool
        conn = await pool.get_connection()
        try:
            return await fn(conn)
        except BaseException:
            await conn.disconnect()  # a half-read answer must not go back to the pool
            raise
        finally:
            await pool.release(conn)

    @staticmethod
    async def _cmd(conn: Any, *args: Any) -> Any:
        await conn.send_command(*args)
        return await conn.read_response()

    async def _exec(self, conn: Any, commands: list[tuple[Any, ...]]) -> Any:
        """MULTI, the commands, EXEC in one round trip: EXEC's answer (None
        when a WATCHed key changed)."""
        await conn.send_packed_command(conn.pack_commands(
            [("MULTI",), *commands, ("EXEC",)]))
        out = None
        for _ in range(len(commands) + 2):  # an error reply raises: on_connection drops conn
            out = await conn.read_response()
        return out

    async def _replicated(self, conn: Any, what: str) -> None:
        """WAIT on conn for min_replicas_acked replicas; NotReplicated when fewer."""
        want = self.target.min_acked
        if want <= 0:
            return
        await conn.send_command("WAIT", want, int(self.target.ack_timeout * 1000))
        got = int(await conn.read_response(timeout=self.target.ack_timeout + self.op_timeout))
        if got < want:
            log.warning("%s: %d of %d replicas acknowledged within %.1fs", what, got, want,
                        self.target.ack_timeout)
            raise self.target.not_replicated(got, what)

    async def multi_acked(self, commands: list[tuple[Any, ...]], what: str) -> Any:
        """The commands in one MULTI/EXEC, then WAIT (NotReplicated, 503)."""
        async def run(conn: Any) -> Any:
            out = await self._exec(conn, commands)
            await self._replicated(conn, what)
            return out
        return await self.call(lambda: self.on_connection(run))

    # -- following ----------------------------------------------------------------------
    def start(self, on_record: Callable[[dict[str, Any]], Any],
              describe: Callable[[], dict[str, Any]],
              on_jobs: Callable[[], Any] | None = None,
              on_message: Callable[[str], Any] | None = None,
              on_failover: Callable[[], Any] | None = None) -> None:
        """Follow the record (on_record(latest) on each new revision), send
        heartbeats (describe() -> what this node serves), call on_jobs on a
        jobs notification and on every tick, on_message(data) on any other
        notification."""
        self._on_record, self._describe, self._on_jobs = on_record, describe, on_jobs
        self._on_message = on_message
        self._on_failover = on_failover
        self._tasks = [asyncio.ensure_future(self._listen()),
                       asyncio.ensure_future(self._tick())]

    def halt(self) -> None:
        """Stop following and beating (sync: the supervisor's shutdown path)."""
        self._stopping = True
        self._wake.set()
        for t in self._tasks:
            t.cancel()

    async def stop(self) -> None:
        self.halt()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:  # leave at once instead of after the TTL
            await asyncio.wait_for(self.redis.delete(self.key("node", self.node_id)), 1.0)
        except DOWN_ERRORS:
            pass
        try:
            await self.redis.aclose()  # type: ignore[attr-defined, unused-ignore]  # types-redis 4.6 lacks aclose
        except DOWN_ERRORS:
            pass

    async def _check_primary(self) -> None:
        """Sentinel: which address is the primary now; a new one is a failover."""
        if not self.target.sentinel:
            return
        try:
            addr = await primary_of(self.redis)
        except DOWN_ERRORS as exc:
            # the clients' own connections say whether Redis answers; this
            # only says the Sentinels could not be asked (logged once)
            if not self._sentinels_silent:
                log.error("no Sentinel names a primary now (%s: %s): a failover under way, "
                          "or the Sentinels unreachable; asking again every tick",
                          type(exc).__name__, exc)
            self._sentinels_silent = True
            return
        if self._sentinels_silent:
            log.warning("the Sentinels answer again: primary %s", addr)
        self._sentinels_silent = False
        if addr is None or addr == self.primary:
            return
        before, self.primary = self.primary, addr
        if before is None:
            log.info("cluster store primary: %s (Sentinel service %s)", addr,
                     self.target.service)
            return
        self.failovers += 1
        self.last_failover = time.time()
        self._epoch += 1
        log.warning("cluster store failover: the primary moved from %s to %s (failover %d "
                    "seen by this node); following the new primary, re-reading the record",
                    before, addr, self.failovers)
        # the new primary's record is the cluster's now, even at a lower
        # revision (a write the old primary had not replicated is gone)
        try:
            rec = await self.read_record(force=True)
        except ClusterUnreachable:
            return
        if self._on_failover is not None and rec is not None:
            self._on_failover()

    async def _sync(self) -> None:
        """Re-read the record; hand a newer one to the node; reseed a lost one."""
        try:
            rec = await self.read_record()
        except ClusterUnreachable:
            return
        if rec is None and self.record is not None and self.record["revision"] > 0:
            # Redis came back without our record (no persistence): write back
            # the last one we know; NX, so the first node to do it wins
            seeded = await self.call(lambda: self.redis.set(
                self.k_record, json.dumps(self.record), nx=True))
            if seeded:
                log.warning("cluster record missing in Redis: restored revision %d from this "
                            "node's cache", self.record["revision"])
            return
        self._deliver()

    def _deliver(self) -> None:
        if (self._on_record is not None and self.record is not None
                and self.record["revision"] > self.applied_revision):
            res = self._on_record(self.record)
            if asyncio.iscoroutine(res):
                asyncio.ensure_future(res)

    async def _listen(self) -> None:
        backoff = 0.25
        while not self._stopping:
            pubsub = self.redis.pubsub()
            epoch = self._epoch
            try:
                epoch = self._epoch
                await pubsub.subscribe(self.k_events)
                self._mark_up()
                backoff = 0.25
                await self._sync()  # whatever changed while we were not subscribed
                while not self._stopping and epoch == self._epoch:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None:
                        continue
                    data = msg.get("data") or ""
                    if data.startswith("record"):
                        await self._sync()
                    elif data == "jobs" and self._on_jobs is not None:
                        self._on_jobs()
                    elif self._on_message is not None:
                        self._on_message(data)
            except asyncio.CancelledError:
                raise
            except DOWN_ERRORS as exc:
                self._mark_down(exc)
            finally:
                try:
                    await pubsub.aclose()  # type: ignore[attr-defined, unused-ignore]  # types-redis 4.6 lacks aclose
                except DOWN_ERRORS:
                    pass
            if self._stopping:
                return
            if epoch != self._epoch:
                continue  # a failover: subscribe on the new primary at once
            # jitter: nodes do not all reconnect in the same instant; a
            # failover seen meanwhile ends the wait
            end = time.monotonic() + backoff * (0.75 + random.random() / 2)
            while time.monotonic() < end and epoch == self._epoch and not self._stopping:
                await asyncio.sleep(0.05)
            backoff = min(5.0, backoff * 2)

    async def _tick(self) -> None:
        """Every poll_interval: heartbeat, re-read the record, poke the jobs."""
        while not self._stopping:
            try:
                await self._check_primary()
                await self.heartbeat()
                await self._sync()
            except ClusterUnreachable:
                pass
            except Exception:  # the ticker must outlive anything odd
                log.exception("cluster tick failed")
            if self._on_jobs is not None:
                try:
                    self._on_jobs()
                except Exception:
                    log.exception("cluster jobs tick failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    # -- heartbeats ---------------------------------------------------------------------
    async def heartbeat(self) -> None:
        """Write this node's beat. One at a time, each built when its turn
        comes: two beats in flight on two connections could land in the other
        order, leaving an older revision as the node's last word."""
        if self._describe is None:
            return
        async with self._beat_lock:
            beat = {**self._describe(), "node": self.node_id,
                    "revision": self.applied_revision, "time": time.time()}
            await self.call(lambda: self.redis.set(
                self.key("node", self.node_id), json.dumps(beat),
                px=int(self.heartbeat_ttl * 1000)))

    def note_applied(self, revision: int) -> None:
        """The node now fully serves this revision (or no longer does): say so at once."""
        self.applied_revision = revision
        asyncio.ensure_future(self._beat_quietly())

    async def _beat_quietly(self) -> None:
        try:
            await self.heartbeat()
        except ClusterUnreachable:
            pass

    async def nodes(self) -> list[dict[str, Any]]:
        """Every node with a live heartbeat, sorted by id."""
        async def scan() -> list[dict[str, Any]]:
            keys = [k async for k in self.redis.scan_iter(match=self.key("node", "*"),
                                                          count=500)]
            values = await self.redis.mget(keys) if keys else []
            return [json.loads(v) for v in values if v]
        beats = await self.call(scan)
        now = time.time()
        for b in beats:
            b["heartbeat_age_s"] = round(max(0.0, now - b.get("time", now)), 3)
        return sorted(beats, key=lambda b: b.get("node", ""))

    async def overview(self) -> dict[str, Any]:
        """GET /cluster: the record, every node, and the stragglers."""
        rec = await self.read_record()
        nodes = await self.nodes()
        revision = rec["revision"] if rec else 0
        stragglers = [n["node"] for n in nodes if n.get("revision", 0) < revision]
        return {"node": self.node_id, "record": rec, "revision": revision,
                "sentinel": self.sentinel_status(),
                "nodes": nodes, "stragglers": stragglers,
                "converged": bool(nodes) and not stragglers}

    async def serving_revision(self, revision: int) -> tuple[list[str], list[str]]:
        """(nodes already at this revision or later, nodes not yet)."""
        nodes = await self.nodes()
        done = [n["node"] for n in nodes if n.get("revision", 0) >= revision]
        return done, [n["node"] for n in nodes if n.get("revision", 0) < revision]

    # -- once per cluster -----------------------------------------------------------------
    async def once(self, what: str) -> bool:
        """True for exactly one caller in the cluster's life (e.g. the demo)."""
        return bool(await self.call(lambda: self.redis.set(
            self.key("once", what), self.node_id, nx=True)))

    def sentinel_status(self) -> dict[str, Any] | None:
        """Sentinel mode: the primary, the failovers this node saw."""
        if not self.target.sentinel:
            return None
        return {"service": self.target.service, "primary": self.primary,
                "failovers": self.failovers, "last_failover": self.last_failover,
                "min_replicas_acked": self.target.min_acked}

    def status(self) -> dict[str, Any]:
        return {"node": self.node_id, "redis": self.url, "up": self.up,
                "sentinel": self.sentinel_status(),
                "down_since": self.down_since, "last_error": self.last_error,
                "revision": self.record["revision"] if self.record else 0,
                "applied_revision": self.applied_revision}
