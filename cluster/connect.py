"""Cluster mode: how a node reaches Redis, directly or through Sentinel, and
how a write waits for the replicas (docs/cluster.md "Sentinel").

``cluster.redis_url`` alone: one Redis at that address. With
``cluster.sentinels``, the primary is asked of the Sentinels (redis-py's
`Sentinel` and its `SentinelConnectionPool`): every new connection goes to
the primary they name now, and a connection to a former primary (now a
replica: READONLY) is dropped and made again. The URL then gives the
password (the Sentinels take the same one), the username, the db and TLS
(rediss://); its host is not used.

`replicated(conn)` is the WAIT that makes "acknowledged" mean "replicated":
on the connection that made the write (WAIT counts the replicas that hold
everything this connection wrote), for ``cluster.min_replicas_acked``
replicas, at most ``cluster.replica_ack_timeout`` seconds; fewer: the write
is on the primary but may not survive a failover, and the caller answers
503 ``not_replicated`` (every such write is idempotent by its id: a retry
is safe). Imports no TensorFlow.
"""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from state.config import ClusterSettings, redact_url
from state.errors import ServiceError


class NotReplicated(ServiceError):
    """The write reached the primary, but not enough replicas within the bound."""
    status, code = 503, "not_replicated"


@dataclass
class RedisTarget:
    """Where the cluster's Redis is: a URL, or Sentinels and a service name."""
    url: str
    sentinels: list[tuple[str, int]] = field(default_factory=list)
    service: str = "textswap"
    min_acked: int = 0
    ack_timeout: float = 1.0

    @classmethod
    def of(cls, ccfg: ClusterSettings) -> "RedisTarget":
        """From the config's cluster section, cfg.cluster (state/config.py
        resolved it)."""
        sentinels = []
        for item in ccfg.sentinels or []:
            host, _, port = str(item).rpartition(":")
            sentinels.append((host, int(port)))
        acked = ccfg.min_replicas_acked
        return cls(ccfg.redis_url, sentinels, ccfg.sentinel_service or "textswap",
                   (1 if sentinels else 0) if acked is None else int(acked),
                   float(ccfg.replica_ack_timeout or 1.0))

    @property
    def sentinel(self) -> bool:
        return bool(self.sentinels)

    def where(self) -> str:
        """For messages and /status: no password."""
        if self.sentinel:
            return (f"sentinel://{','.join(f'{h}:{p}' for h, p in self.sentinels)}"
                    f"/{self.service}")
        return redact_url(self.url)

    def _conn_kwargs(self) -> dict[str, Any]:
        """Password, username, db and TLS from the URL (Sentinel mode)."""
        parts = urllib.parse.urlsplit(self.url)
        kw: dict[str, Any] = {}
        if parts.password is not None:
            kw["password"] = urllib.parse.unquote(parts.password)
        if parts.username:
            kw["username"] = urllib.parse.unquote(parts.username)
        path = parts.path.strip("/")
        if path.isdigit():
            kw["db"] = int(path)
        if parts.scheme == "rediss":
            kw["ssl"] = True
        return kw

    def _sentinel_kwargs(self, timeout: float) -> dict[str, Any]:
        kw = {k: v for k, v in self._conn_kwargs().items() if k in ("password", "username", "ssl")}
        return {**kw, "socket_timeout": timeout, "socket_connect_timeout": timeout}

    def async_client(self, **kw: Any) -> aioredis.Redis:
        """A redis.asyncio client of the primary (kw: timeouts, retry, decoding)."""
        if not self.sentinel:
            return aioredis.Redis.from_url(self.url, **kw)
        s = aiosentinel.Sentinel(self.sentinels, sentinel_kwargs=self._sentinel_kwargs(
            kw.get("socket_connect_timeout") or 1.0), **self._conn_kwargs())
        return s.master_for(self.service, **kw)

    def sync_client(self, **kw: Any) -> redis.Redis:
        if not self.sentinel:
            return redis.Redis.from_url(self.url, **kw)
        s = redis.sentinel.Sentinel(self.sentinels, sentinel_kwargs=self._sentinel_kwargs(
            kw.get("socket_connect_timeout") or 1.0), **self._conn_kwargs())
        return s.master_for(self.service, **kw)

    def not_replicated(self, got: int, what: str) -> NotReplicated:
        return NotReplicated(
            f"{what} reached the cluster store's primary, but {got} of the "
            f"{self.min_acked} replica(s) asked for (cluster.min_replicas_acked) acknowledged "
            f"it within {self.ack_timeout:g} s, so it might not survive a failover; it is "
            "idempotent: retry the same request", details={"replicas_acked": got,
                                                           "replicas_asked": self.min_acked})


async def primary_of(client: aioredis.Redis) -> str | None:
    """The primary's address as the client's Sentinel names it now (None:
    not a Sentinel client)."""
    pool = client.connection_pool
    if not isinstance(pool, aiosentinel.SentinelConnectionPool):
        return None
    host, port = await pool.sentinel_manager.discover_master(pool.service_name)
    return f"{host}:{port}"
