"""Cluster mode: the training queue in Redis, with leases.

A job submitted on any node is checked there (data, params), its data is
written into the shared model store, and it is queued here. Any node with a
free training slot claims the oldest queued job (one Lua script: exactly one
node gets it) and runs it under a lease it renews every tick. A node that
dies stops renewing; once its lease expires any node's reaper marks the job
`interrupted` (never run again, so never twice at once). A runner that finds
its lease taken by the reaper (it was cut off too long) stops its trainer;
one whose lease merely ran out, unreaped, takes it again. After this node
sees the store's primary move (a failover: every runner's renewals failed
alike), its reaper waits one lease, so that runners renew first. And a
reaper ends a job only once it has seen its lease missing for a whole lease
(two passes at least): a new primary may lack the last renewal, and a node
may see the new primary before the runner does. A claim whose answer was
lost (the primary died right after running it) leaves a job running under
this node's name that no runner here knows: the node takes it up at its
next tick, since it never started (unstarted_claims).

Keys (prefix as in cluster.py):

    <prefix>:job:<id>    hash: doc (the job as GET /train/<id> shows it,
                         JSON, written by the submitter and then the
                         runner), state, node, and error / finished_at once
                         the reaper or a cancel ended it
    <prefix>:queue       list of queued ids, oldest first
    <prefix>:running     set of running ids (what the reaper looks at)
    <prefix>:lease:<id>  the runner's node id, expiring after lease_s
    <prefix>:cancel      set of running ids whose cancel was asked elsewhere
    <prefix>:joblist     every kept id, oldest first (GET /train)
    <prefix>:jobseq      counter for job ids unique across the cluster

Imports no TensorFlow.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from cluster.record import Cluster

if TYPE_CHECKING:
    from control.jobs import JobDoc

_CLAIM = """
local ids = redis.call('LRANGE', KEYS[1], 0, -1)
for _, id in ipairs(ids) do
  redis.call('LREM', KEYS[1], 1, id)
  local jk = ARGV[1] .. ':job:' .. id
  if redis.call('HGET', jk, 'state') == 'queued' then
    redis.call('HSET', jk, 'state', 'running', 'node', ARGV[2])
    redis.call('SET', ARGV[1] .. ':lease:' .. id, ARGV[2], 'PX', ARGV[3])
    redis.call('SADD', KEYS[2], id)
    return id
  end
end
return false
"""

# -> 'ok', 'cancel' (asked elsewhere) or 'lost' (the lease is not ours any more).
# A lease that ran out while the job is still running here and unreaped
# (KEYS[2]: the running set; the job's node is this one) is taken again: no
# other node can have claimed a running job, and a store that was away (a
# failover) let every lease run out alike.
_RENEW = """
local lk = ARGV[1] .. ':lease:' .. ARGV[2]
local holder = redis.call('GET', lk)
if not holder and redis.call('SISMEMBER', KEYS[2], ARGV[2]) == 1
   and redis.call('HGET', ARGV[1] .. ':job:' .. ARGV[2], 'node') == ARGV[3] then
  redis.call('SET', lk, ARGV[3], 'PX', ARGV[4])
  holder = ARGV[3]
end
if holder ~= ARGV[3] then return 'lost' end
redis.call('PEXPIRE', lk, ARGV[4])
if redis.call('SISMEMBER', KEYS[1], ARGV[2]) == 1 then return 'cancel' end
return 'ok'
"""

# the runner's write: only while it holds the lease; final also ends the run
_SAVE = """
local lk = ARGV[1] .. ':lease:' .. ARGV[2]
if redis.call('GET', lk) ~= ARGV[3] then return 0 end
local jk = ARGV[1] .. ':job:' .. ARGV[2]
redis.call('HSET', jk, 'doc', ARGV[4])
if ARGV[5] ~= '' then
  redis.call('HSET', jk, 'state', ARGV[5])
  redis.call('DEL', lk)
  redis.call('SREM', KEYS[1], ARGV[2])
  redis.call('SREM', KEYS[2], ARGV[2])
end
return 1
"""

# running jobs whose lease key is missing now (candidates: the reaper waits)
_EXPIRED = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. ':lease:' .. id) == 0 then
    table.insert(out, id)
  end
end
return out
"""

# the candidates (ARGV[3..]) still running with no lease -> interrupted
_REAP = """
local out = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('SISMEMBER', KEYS[1], id) == 1 and
     redis.call('EXISTS', ARGV[1] .. ':lease:' .. id) == 0 then
    local jk = ARGV[1] .. ':job:' .. id
    redis.call('HSET', jk, 'state', 'interrupted', 'finished_at', ARGV[2],
               'error', 'the node running it (' .. (redis.call('HGET', jk, 'node') or '?') ..
               ') stopped renewing its lease: it died or lost the cluster store')
    redis.call('SREM', KEYS[1], id)
    redis.call('SREM', KEYS[2], id)
    table.insert(out, id)
  end
end
return out
"""

# the running jobs this node (ARGV[2]) claimed, started or not
_MINE = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('HGET', ARGV[1] .. ':job:' .. id, 'node') == ARGV[2] then
    table.insert(out, id)
  end
end
return out
"""

# -> 'cancelled' (was queued), 'requested' (running: the runner stops it),
#    'missing', or 'done:<state>' (already finished)
_CANCEL = """
local jk = ARGV[1] .. ':job:' .. ARGV[2]
local state = redis.call('HGET', jk, 'state')
if not state then return 'missing' end
if state == 'queued' then
  redis.call('LREM', KEYS[1], 0, ARGV[2])
  redis.call('HSET', jk, 'state', 'cancelled', 'finished_at', ARGV[3])
  return 'cancelled'
end
if state == 'running' then
  redis.call('SADD', KEYS[2], ARGV[2])
  return 'requested'
end
return 'done:' .. state
"""


class ClusterJobs:
    """The queue's operations; every one may raise ClusterUnreachable (503)."""

    def __init__(self, cluster: Cluster, lease_s: float = 10.0, keep: int = 200) -> None:
        self.c = cluster
        self.r = cluster.redis
        self.lease_ms = int(lease_s * 1000)
        self.keep = keep
        p = cluster.prefix
        self.k_queue, self.k_running = f"{p}:queue", f"{p}:running"
        self.k_cancel, self.k_list, self.k_seq = f"{p}:cancel", f"{p}:joblist", f"{p}:jobseq"
        self._claim = self.r.register_script(_CLAIM)
        self._renew = self.r.register_script(_RENEW)
        self._save = self.r.register_script(_SAVE)
        self._expired = self.r.register_script(_EXPIRED)
        self._reap = self.r.register_script(_REAP)
        # job id -> when this node first saw it running with no lease (monotonic)
        self._missing_since: dict[str, float] = {}
        self._cancel = self.r.register_script(_CANCEL)
        self._mine = self.r.register_script(_MINE)

    def _jk(self, job_id: str) -> str:
        return self.c.key("job", job_id)

    async def new_id(self) -> str:
        n = await self.c.call(lambda: self.r.incr(self.k_seq))
        return f"{time.strftime('%Y%m%d%H%M%S')}-{n}"

    async def enqueue(self, doc: dict[str, Any]) -> None:
        """Queue the job (MULTI/EXEC), then WAIT for the replicas asked for
        (NotReplicated, 503, when too few acknowledged it)."""
        await self.c.multi_acked([
            ("HSET", self._jk(doc["id"]), "doc", json.dumps(doc), "state", "queued", "node", ""),
            ("RPUSH", self.k_queue, doc["id"]),
            ("RPUSH", self.k_list, doc["id"]),
            ("PUBLISH", self.c.k_events, "jobs")], f"training job {doc['id']}")
        await self._trim()

    async def claim(self) -> "JobDoc | None":
        """The oldest queued job, now ours under a lease; None when none waits."""
        job_id = await self.c.call(lambda: self._claim(
            keys=[self.k_queue, self.k_running],
            args=[self.c.prefix, self.c.node_id, self.lease_ms]))
        if not job_id:
            return None
        return await self.get(job_id)

    async def unstarted_claims(self, running_here: "set[str]") -> "list[JobDoc]":
        """Jobs this node claimed and never started: the claim ran but its
        answer was lost (the primary died or the connection broke right
        after), so no runner here knows of them. Each is this node's again
        under a fresh lease (-> their documents, to run); one cancelled
        meanwhile ends `cancelled`. A job a runner started (its document is
        the runner's, no longer the submitter's `queued` one) is never
        returned: after a crash it is the reaper's, never run twice."""
        ids = await self.c.call(lambda: self._mine(keys=[self.k_running],
                                                   args=[self.c.prefix, self.c.node_id]))
        out: list[JobDoc] = []
        for job_id in ids:
            if job_id in running_here:
                continue
            fields = await self.c.call(lambda: self.r.hgetall(self._jk(job_id)))
            try:
                submitted = json.loads(fields.get("doc") or "null")
            except ValueError:
                submitted = None
            if not isinstance(submitted, dict) or submitted.get("state") != "queued":
                continue
            verdict = await self.renew(job_id)
            if verdict == "cancel":
                await self.save({**submitted, "state": "cancelled", "finished_at": time.time(),
                                 "error": "cancelled before it started"}, "cancelled")
            elif verdict == "ok":
                doc = self._merge(fields)
                if doc is not None:
                    out.append(doc)
        return out

    async def renew(self, job_id: str) -> str:
        return await self.c.call(lambda: self._renew(
            keys=[self.k_cancel, self.k_running],
            args=[self.c.prefix, job_id, self.c.node_id, self.lease_ms]))

    async def save(self, doc: dict[str, Any], final_state: str = "") -> bool:
        """Write the runner's view of a job; False when its lease is lost."""
        ok = await self.c.call(lambda: self._save(
            keys=[self.k_running, self.k_cancel],
            args=[self.c.prefix, doc["id"], self.c.node_id, json.dumps(doc), final_state]))
        return bool(ok)

    async def reap(self) -> list[str]:
        """End the running jobs whose lease this node has seen missing for a
        whole lease, on two passes at least; -> the ids it ended.

        A lease missing once is not enough: after a failover the new primary
        may lack the runner's last renewal (replication is asynchronous), and
        this node may reach the new primary before the runner does. The wait
        gives the runner a lease to take its lease again."""
        missing = await self.c.call(lambda: self._expired(
            keys=[self.k_running], args=[self.c.prefix]))
        now = time.monotonic()
        seen = {job_id: self._missing_since.get(job_id, now) for job_id in missing}
        self._missing_since = seen
        due = [job_id for job_id, since in seen.items() if now - since >= self.lease_ms / 1000.0]
        if not due:
            return []
        reaped = await self.c.call(lambda: self._reap(
            keys=[self.k_running, self.k_cancel], args=[self.c.prefix, time.time(), *due]))
        for job_id in reaped:
            self._missing_since.pop(job_id, None)
        return list(reaped)

    async def cancel(self, job_id: str) -> str:
        out = await self.c.call(lambda: self._cancel(
            keys=[self.k_queue, self.k_cancel], args=[self.c.prefix, job_id, time.time()]))
        await self.c.call(lambda: self.r.publish(self.c.k_events, "jobs"))
        return out

    @staticmethod
    def _merge(fields: dict[str, str]) -> "JobDoc | None":
        if not fields or "doc" not in fields:
            return None
        doc = json.loads(fields["doc"])
        state = fields.get("state") or doc.get("state")
        if state in ("interrupted", "cancelled") and doc.get("state") != state:
            # ended by the reaper or a cancel while queued: say so over the runner's doc
            doc["state"] = state
            doc["error"] = doc.get("error") or fields.get("error")
            if fields.get("finished_at"):
                doc["finished_at"] = float(fields["finished_at"])
        else:
            doc["state"] = state
        doc["node"] = fields.get("node") or None
        return doc

    async def get(self, job_id: str) -> "JobDoc | None":
        return self._merge(await self.c.call(lambda: self.r.hgetall(self._jk(job_id))))

    async def list(self) -> "list[JobDoc]":
        async def run() -> list[dict[str, str]]:
            ids = await self.r.lrange(self.k_list, 0, -1)
            async with self.r.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hgetall(self._jk(job_id))  # type: ignore[arg-type, unused-ignore]  # decode_responses: str
                return await pipe.execute()
        docs = [self._merge(f) for f in await self.c.call(run)]
        return [d for d in reversed(docs) if d is not None]

    async def _trim(self) -> None:
        """Keep the newest `keep` jobs listed; older finished ones go."""
        ids = await self.c.call(lambda: self.r.lrange(self.k_list, 0, -1))
        excess = len(ids) - self.keep
        for job_id in ids:
            if excess <= 0:
                break
            state = await self.c.call(lambda: self.r.hget(self._jk(job_id), "state"))
            if state in ("queued", "running"):
                continue
            await self.c.call(lambda: self.r.delete(self._jk(job_id)))
            await self.c.call(lambda: self.r.lrem(self.k_list, 1, job_id))
            excess -= 1
