"""Cluster mode: the prediction log and the feedback on it, in Redis.

`RedisPredictionLog` has the interface and the semantics of
state/predlog.py's `PredictionLog` (the supervisor creates one or the other
as ``sup.predlog``), so that feedback sent to any node finds the prediction
whichever node answered it, and every node's /quality and /review see the
whole cluster's traffic. What the log answers is decided once for both
in state/predlog_core.py (`PredictionLogCore`, the base class); this module
only stores and reads, with Redis commands. Keys (``<p>`` is ``cluster.key_prefix``, ``<m>`` a
model name, which holds no ``:``):

    <p>:plog:<m>          a stream, one entry per answer (a /predict request,
                          or the rows of one request given to ``add``): field
                          ``d`` = msgpack [1, at, request_id, version, texts,
                          tops, labels|nil, indexes|nil], where tops[i] is the
                          answer's own ``top`` list ([{label, score}], best
                          first). One entry per answer, not per text: the
                          sender packs an answer in one C call and Redis does
                          one XADD, whatever the batch size.
    <p>:plog:<m>:stats    a hash: ``v:<version>`` texts logged per version
                          (what ``counts`` reports), ``last:<version>`` the
                          newest entry id holding that version (``recent`` of
                          a version starts there), ``avg`` the decayed mean
                          of texts per answer (for the bound below)
    <p>:plog:<m>:fb       a hash, feedback: field ``<request_id>:<index>`` ->
                          msgpack [request_id, index, label, version, text,
                          predicted, new_label, at]; a repeat replaces
    <p>:plog:<m>:ex       a hash, free examples: field = the text -> msgpack
                          [label, new_label, at]; a repeated text replaces
    <p>:plogid:<rid>      "<model>\\n<entry id>" with an expiry: ``get`` is a
                          GET and an XRANGE of one id, whatever the log's size

Bounds. Each stream holds about ``predictions.max_rows`` texts: XADD trims
it to MAXLEN = max_rows / ``avg`` entries, exactly below 1,000 entries and
approximately (``MAXLEN ~``, whole stream nodes) above. ``avg`` is a moving
mean of the texts per answer that moves 1/MAXLEN of the way towards each new
answer, so it follows the mean of what the stream holds (its entries are
replaced at that pace too): when single texts give way to batches of 256,
MAXLEN shrinks as the batches come in, and the stream keeps about max_rows
texts throughout.
A request id key lives twice the time an entry is expected to stay in its
stream (the stream's age per entry times MAXLEN), at least 10 minutes and
at most 7 days, so the ids held are about twice the answers in the streams.
A trimmed answer, or one whose id key expired, is not found (404 on
feedback), as a trimmed row in SQLite. The stats hash grows with versions
only; feedback and examples are kept (as in SQLite), bounded by what people
label. A request id given twice (a client's own X-Request-Id) finds the
first answer (its id key is set only if absent).

Differences from SQLite, on purpose: ``counts`` reports the texts logged per
version since the log began (a counter), not the rows still held; ``review``
looks at the newest ``REVIEW_WINDOW`` texts only (10,000; SQLite reads the
whole table through an index). ``recent`` and ``review`` decode entries in
Python (read in pages of at most 1,000 entries).

Threading: ``add``/``add_answer`` run on the IOLoop and only put the answer
on a queue; a sender thread gathers for ~50 ms and writes each model's
answers with one Lua script call (XADD + the id keys + the stats, atomic).
Feedback and examples are written by one thread of their own (MULTI/EXEC,
in call order); their futures resolve once Redis acknowledged the write (as
durable as the Redis setup: ``appendonly yes``). Reads run on the caller's
thread (executors, never the IOLoop) with the sync client; its connection
pool is thread-safe.

Redis down: nothing blocks the request path; the sender drops what it could
not write (counted in ``dropped``), tries at most once a second, and pings
once a second when idle, so the health clears when Redis is back. Writes
and reads raise (or fail their future with) `PredlogUnreachable`, both an
OSError (frontend/loop_handlers.py answers those with 503
``store_unavailable``) and a ServiceError (503 ``store_unavailable`` where
handlers map those: /quality), its message saying that Redis is
unreachable; a connection attempt gives up after ``op_timeout`` (1 s). Imports no TensorFlow, nothing above
state/.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import msgpack
import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from cluster.connect import RedisTarget
from state.errors import ServiceError
from state.predlog_core import (WHAT, Erasure, PredictionLogCore, closed_future, drain,
                                prediction, scores_margin, top_of)
from state.storage import Health

log = logging.getLogger("textswap.predlog")

_BATCH_WAIT_S = 0.05   # the sender gathers answers this long between two writes
MAX_QUEUED = 20_000    # answers waiting for the sender; beyond, new ones are dropped
MAX_PER_CALL = 500     # answers per Lua call (a call blocks Redis while it runs)
REVIEW_WINDOW = 10_000  # texts: the review queue looks at the newest this many
MAX_PAGE = 1000        # stream entries per read
MIN_TTL_S = 600
MAX_TTL_S = 7 * 86400
RETRY_S = 1.0          # Redis down: one write attempt (or ping) a second at most
PEER_LAG_S = 0.2       # a flush lasts this long at least: another node's sender
                       # writes what it answered within ~50 ms plus a round trip

# KEYS: stream, stats, then the id key of each answer. ARGV: max_rows, model,
# min ttl, max ttl, then (blob, version, texts) per answer.
_LUA_ADD = """
local max_rows = tonumber(ARGV[1])
local n = (#ARGV - 4) / 3
local avg = tonumber(redis.call('HGET', KEYS[2], 'avg') or '0')
for i = 0, n - 1 do
  local cnt = tonumber(ARGV[7 + 3 * i])
  if avg <= 0 then avg = cnt
  else avg = avg + (cnt - avg) / math.max(1, max_rows / math.max(avg, 1)) end
end
local maxlen = math.max(1, math.ceil(max_rows / math.max(avg, 1)))
local ttl = tonumber(ARGV[4])
local xlen = redis.call('XLEN', KEYS[1])
if xlen > 0 then
  local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1][1]
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local age_s = math.max(0, now_ms - tonumber(string.match(first, '^(%d+)'))) / 1000
  local life = 2 * age_s / xlen * math.max(maxlen, xlen)
  ttl = math.min(ttl, math.max(tonumber(ARGV[3]), math.ceil(life)))
end
local id
for i = 0, n - 1 do
  local blob, ver, cnt = ARGV[5 + 3 * i], ARGV[6 + 3 * i], ARGV[7 + 3 * i]
  if maxlen >= 1000 then
    id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 'd', blob)
  else
    id = redis.call('XADD', KEYS[1], 'MAXLEN', maxlen, '*', 'd', blob)
  end
  redis.call('SET', KEYS[3 + i], ARGV[2] .. '\\n' .. id, 'EX', ttl, 'NX')  -- the first answer stays
  redis.call('HINCRBY', KEYS[2], 'v:' .. ver, cnt)
  redis.call('HSET', KEYS[2], 'last:' .. ver, id)
end
redis.call('HSET', KEYS[2], 'avg', tostring(avg))
return {maxlen, ttl}
"""


# Erasure: XDEL only flags a stream entry as deleted, and its bytes stay in
# the stream's node (and so in an RDB or a rewritten AOF) until the whole node
# goes. So the stream is rebuilt without the erased entries, atomically (no
# XADD of another node lands in between), keeping every other entry's id.
# KEYS: the stream. ARGV: the ids to drop. Returns how many were dropped.
_LUA_REBUILD = """
local drop = {}
for i = 1, #ARGV do drop[ARGV[i]] = true end
local keep = {}
local dropped = 0
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
  if drop[e[1]] then dropped = dropped + 1 else table.insert(keep, e) end
end
if dropped == 0 then return 0 end
redis.call('DEL', KEYS[1])
for _, e in ipairs(keep) do
  redis.call('XADD', KEYS[1], e[1], unpack(e[2]))
end
return dropped
"""


class PredlogUnreachable(ServiceError, OSError):
    """Redis did not answer. An OSError without errno, so that
    frontend/loop_handlers.py (which maps OSError) answers 503 store_unavailable
    with this message; and a ServiceError (503) for the handlers that map those
    (GET /quality, /train with feedback)."""
    status, code = 503, "store_unavailable"


def _ver_str(version: Any) -> str:
    return "" if version is None else str(version)


def _ver_of(raw: bytes | str) -> Any:
    s = raw.decode() if isinstance(raw, bytes) else raw
    if s == "":
        return None
    try:
        return int(s)
    except ValueError:
        return s


def _same_version(a: Any, b: Any) -> bool:
    return _ver_str(a) == _ver_str(b)


def _rows_of(model: str, blob: bytes) -> list[dict[str, Any]]:
    """The log's rows of one stream entry, by index."""
    _fmt, at, rid, version, texts, tops, labels, idx = msgpack.unpackb(blob, raw=False)
    out = []
    for i, text in enumerate(texts):
        top = tops[i] or []
        scores = {t["label"]: t["score"] for t in top}
        label = labels[i] if labels is not None else (top[0]["label"] if top else None)
        out.append(prediction(at, rid, idx[i] if idx is not None else i, model, version, text,
                              label, scores, scores_margin(scores)))
    return out


def _scores_top(scores: Any) -> list[dict[str, Any]]:
    if isinstance(scores, dict):
        return [{"label": k, "score": v} for k, v in scores.items()]
    if isinstance(scores, list):
        return [{"label": s["label"], "score": s["score"]} for s in scores]
    return []


def _entries(items: list[Any]) -> tuple[dict[str, list[tuple[Any, ...]]], int]:
    """Queued answers as stream entries: model -> [(request_id, version, texts,
    blob)]; and the texts that could not be packed."""
    by_model: dict[str, list[tuple[Any, ...]]] = {}
    bad = 0
    packb = msgpack.packb
    for it in items:
        try:
            if it[0] in ("a", "s"):
                if it[0] == "a":
                    _, at, rid, model, version, texts, preds = it
                else:  # score rows: the predictions /predict answered
                    _, at, rid, model, version, texts, labels, rows, k = it
                    preds = [top_of(row, labels, k) for row in rows]
                tops = [p.get("top") for p in preds]
                labels = None if all(tops) else [p.get("label") for p in preds]
                blob = packb([1, at, rid, version, texts, tops, labels, None],
                             use_bin_type=True)
                by_model.setdefault(model, []).append((rid, version, len(texts), blob))
            elif it[0] == "r":
                groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
                for r in it[1]:
                    groups.setdefault((r["request_id"], r["model"], r.get("version")),
                                      []).append(r)
                for (rid, model, version), rows in groups.items():
                    blob = packb([1, rows[0].get("at") or time.time(), rid, version,
                                  [r["text"] for r in rows],
                                  [_scores_top(r.get("scores")) for r in rows],
                                  [r.get("label") for r in rows],
                                  [r.get("index", 0) for r in rows]], use_bin_type=True)
                    by_model.setdefault(model, []).append((rid, version, len(rows), blob))
        except Exception as exc:  # e.g. a value msgpack cannot pack: skipped, counted
            n = len(it[5]) if it[0] in ("a", "s") else len(it[1])
            bad += n
            log.error("prediction log: %d texts not packable, skipped: %r", n, exc)
    return by_model, bad


def _write_acked(client: redis.Redis, t: RedisTarget, per_key: dict[str, dict[Any, bytes]]
                 ) -> None:
    """MULTI, the HSETs, EXEC, then WAIT on that one connection (WAIT
    counts the replicas holding what this connection wrote): fewer than
    min_replicas_acked within replica_ack_timeout raise NotReplicated."""
    if not per_key:
        return
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        cmds: list[tuple[Any, ...]] = [("MULTI",)]
        for key, mapping in per_key.items():
            cmds.append(("HSET", key, *(x for kv in mapping.items() for x in kv)))
        cmds += [("EXEC",), ("WAIT", t.min_acked, int(t.ack_timeout * 1000))]
        conn.send_packed_command(conn.pack_commands(cmds))
        got = [conn.read_response() for _ in cmds][-1]
    except BaseException:
        conn.disconnect()  # a half-read answer must not go back to the pool
        raise
    finally:
        pool.release(conn)
    if int(got) < t.min_acked:
        raise t.not_replicated(int(got), "the feedback")


def _rewrite_aof(client: redis.Redis) -> None:
    """After an erasure: the append-only file rewritten when AOF is on, and
    a new RDB snapshot (BGSAVE) when RDB persistence is on (`save` set),
    so that no file of Redis keeps the erased texts past the next write."""
    def setting(name: str) -> str:
        got = client.config_get(name)  # str keys, whatever the client decodes
        return {str(k): (v.decode() if isinstance(v, bytes) else str(v))
                for k, v in got.items()}.get(name, "")
    try:
        if setting("appendonly") == "yes":
            client.bgrewriteaof()
    except redis.ResponseError as exc:  # CONFIG refused (an ACL user), or one running
        log.warning("prediction log: no append-only file rewrite after an erasure: %s", exc)
    try:
        if setting("save").strip():
            _bgsave(client)
    except redis.ResponseError as exc:  # CONFIG or BGSAVE refused (an ACL user)
        log.warning("prediction log: no RDB snapshot after an erasure: %s", exc)


def _bgsave(client: redis.Redis, wait_s: float = 10.0) -> None:
    """BGSAVE SCHEDULE (while an AOF rewrite runs, Redis starts it when that
    ends). A save already running began before the erasure: wait for it
    (up to wait_s), then start the one that leaves the erased texts out."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.bgsave(schedule=True)
            return
        except redis.ResponseError as exc:
            if "in progress" not in str(exc).lower() or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


class _Sender:
    """The predictions' way to Redis: the queue, the sender thread (a Lua call
    per model and up to MAX_PER_CALL answers), and Redis's health as the
    sender sees it (a ping a second while it fails)."""

    def __init__(self, owner: RedisPredictionLog) -> None:
        self.owner = owner  # its client, keys, max_rows and health
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.logged = 0
        self.lost = 0
        self.failing = False
        self.last_try = 0.0
        self.last_ok_report = 0.0
        self.thread = threading.Thread(target=self._send_loop, name="predlog-sender",
                                       daemon=True)
        self.thread.start()

    def went_wrong(self, exc: PredlogUnreachable) -> None:
        if not self.failing:
            log.error("prediction log: %s; predictions are dropped until it answers", exc)
        self.failing = True
        if self.owner.health is not None:
            self.owner.health.failed(WHAT, self.owner.path, exc)

    def went_right(self) -> None:
        now = time.monotonic()
        if self.failing:
            log.warning("prediction log: Redis at %s answers again (%d texts dropped so far)",
                        self.owner.url, self.lost)
        if self.failing or now - self.last_ok_report >= 1.0:
            self.last_ok_report = now
            if self.owner.health is not None:
                self.owner.health.succeeded(WHAT)
        self.failing = False

    def _send_loop(self) -> None:
        stop = False
        while not stop:
            try:
                item = self.q.get(timeout=RETRY_S if self.failing else None)
            except queue.Empty:
                self._probe()
                continue
            if item[0] in ("a", "s", "r"):  # gather more: fewer, bigger writes
                time.sleep(_BATCH_WAIT_S)
                wait = self.last_try + RETRY_S - time.monotonic()
                if self.failing and wait > 0:
                    time.sleep(wait)  # Redis down: one attempt a second
            batch = drain(self.q, item)
            stop = any(b[0] == "stop" for b in batch)
            items = [b for b in batch if b[0] != "stop"]
            if items:
                self._send(items)

    def _probe(self) -> None:
        self.last_try = time.monotonic()
        try:
            self.owner._call(self.owner.redis.ping)
        except PredlogUnreachable as exc:
            self.went_wrong(exc)
            return
        self.went_right()

    def _send(self, items: list[Any]) -> None:
        markers = [it[1] for it in items if it[0] == "f"]
        by_model, bad = _entries([it for it in items if it[0] != "f"])
        self.lost += bad
        error: PredlogUnreachable | None = None
        if by_model:
            self.last_try = time.monotonic()
            for model, entries in by_model.items():
                for i in range(0, len(entries), MAX_PER_CALL):
                    chunk = entries[i:i + MAX_PER_CALL]
                    texts = sum(e[2] for e in chunk)
                    if error is not None:  # Redis is down: no more tries this round
                        self.lost += texts
                        continue
                    keys = [self.owner._k_stream(model), self.owner._k_stats(model),
                            *(self.owner._k_rid(e[0]) for e in chunk)]
                    args: list[Any] = [self.owner.max_rows, model, MIN_TTL_S, MAX_TTL_S]
                    for rid, version, n, blob in chunk:
                        args += [blob, _ver_str(version), n]
                    try:
                        self.owner._call(self.owner._add, keys=keys, args=args)
                    except PredlogUnreachable as exc:
                        error = exc
                        self.lost += texts
                        continue
                    self.logged += texts
            if error is not None:
                self.went_wrong(error)
            else:
                self.went_right()
        for fut in markers:
            if fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(None)


TRIM_SLACK = 0.05  # a hash may exceed its cap by this share before a trim


def _trim_hash(call: Callable[..., Any], client: redis.Redis, key: str, cap: int, at: int
               ) -> None:
    """Keep the newest `cap` fields of a feedback or examples hash (up to
    TRIM_SLACK more between trims), by the time packed in each value (its
    index `at`); `call` runs each command (RedisPredictionLog._call)."""
    n = call(client.hlen, key)
    if n <= cap + int(cap * TRIM_SLACK):
        return
    when: list[tuple[float, bytes]] = []
    for field, value in call(lambda: list(client.hscan_iter(key, count=1000))):
        when.append((float(msgpack.unpackb(value, raw=False)[at]), field))
    when.sort()
    old = [f for _, f in when[:max(0, len(when) - cap)]]
    for i in range(0, len(old), 1000):
        call(client.hdel, key, *old[i:i + 1000])
    log.info("%s: %d oldest fields trimmed (to %d)", key, len(old), cap)


def _entry_rows(model: str, entries: list[Any]) -> list[dict[str, Any]]:
    """The rows of stream entries read (XRANGE's [(id, fields)])."""
    out: list[dict[str, Any]] = []
    for _eid, fields in entries:
        blob = fields.get(b"d")
        if blob is not None:
            out.extend(_rows_of(model, blob))
    return out


class RedisPredictionLog(PredictionLogCore):
    """See the module docstring; the logic is state/predlog_core.py's."""

    def __init__(self, url: "str | RedisTarget", *, prefix: str = "textswap",
                 enabled: bool = True, max_rows: int = 100_000, op_timeout: float = 1.0,
                 read_timeout: float = 10.0, feedback_rows: int = 100_000,
                 example_rows: int = 100_000, health: Health | None = None) -> None:
        super().__init__(enabled=enabled, max_rows=max_rows, feedback_rows=feedback_rows,
                         example_rows=example_rows, health=health)
        self.prefix = prefix
        # one immediate retry (a pooled connection a Redis restart closed), no
        # more: a down Redis must answer fast (503), as cluster/record.py does
        # (Sentinel: cluster/connect.py; feedback and examples WAIT for the replicas)
        self.target = url if isinstance(url, RedisTarget) else RedisTarget(url)
        self.redis = self.target.sync_client(
            socket_connect_timeout=op_timeout, socket_timeout=read_timeout,
            retry=Retry(NoBackoff(), 1), decode_responses=False)
        kw = self.redis.connection_pool.connection_kwargs
        where = kw.get("path") or f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
        self.url = (self.target.where() if self.target.sentinel
                    else f"redis://{where}/{kw.get('db', 0)}")  # no password in messages
        self.path = f"{self.url} {prefix}:plog:*"
        self._add = self.redis.register_script(_LUA_ADD)
        self._rebuild = self.redis.register_script(_LUA_REBUILD)
        self._fb = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="predlog-feedback")
        self._sender = _Sender(self)

    @property
    def logged(self) -> int:
        """Texts written to Redis by this node."""
        return self._sender.logged

    @property
    def dropped(self) -> int:
        """Texts not written: Redis down, the queue full, unpackable."""
        return self._sender.lost

    def stats(self) -> dict[str, int]:
        """For /status: texts logged by this node, dropped, and queued here."""
        s = self._sender
        return {"logged": s.logged, "dropped": s.lost, "queued": s.q.qsize()}

    # -- keys ------------------------------------------------------------------------------
    def _k_stream(self, model: str) -> str:
        return f"{self.prefix}:plog:{model}"

    def _k_stats(self, model: str) -> str:
        return f"{self.prefix}:plog:{model}:stats"

    def _k_fb(self, model: str) -> str:
        return f"{self.prefix}:plog:{model}:fb"

    def _k_ex(self, model: str) -> str:
        return f"{self.prefix}:plog:{model}:ex"

    def _k_rid(self, rid: str) -> str:
        return f"{self.prefix}:plogid:{rid}"

    # -- errors and health -----------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """One read or write; PredlogUnreachable (OSError) when Redis fails."""
        try:
            return fn(*args, **kw)
        except PredlogUnreachable:
            raise
        except (RedisError, OSError) as exc:
            raise PredlogUnreachable(f"Redis at {self.url} is unreachable "
                                     f"({type(exc).__name__}: {exc})",
                                     details={"what": WHAT, "path": self.path}) from None

    # -- predictions: queue, sender thread -------------------------------------------------
    def _enqueue(self, item: tuple[Any, ...], texts: int) -> None:
        """One queue put; the top lists of score rows are built on the sender
        thread, off the request path."""
        if self._sender.q.qsize() >= MAX_QUEUED:
            self._sender.lost += texts
        else:
            self._sender.q.put(item)

    # -- feedback and examples: a thread of their own, futures resolve on Redis's ack -------
    def _submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        if not self._closed:
            try:
                return self._fb.submit(fn, *args)
            except RuntimeError:  # shut down meanwhile
                pass
        return closed_future()

    def _write(self, per_key: dict[str, dict[Any, bytes]],
               caps: dict[str, tuple[int, int]] | None = None) -> None:  # Any: hset's key type
        """caps: key -> (most fields kept, the index of the time in a value)."""
        def run() -> None:
            if self.target.min_acked > 0:
                return _write_acked(self.redis, self.target, per_key)
            pipe = self.redis.pipeline(transaction=True)  # all of it or nothing
            for key, mapping in per_key.items():
                pipe.hset(key, mapping=mapping)
            pipe.execute()
        try:
            self._call(run)
        except PredlogUnreachable as exc:
            log.error("feedback write failed: %s", exc)
            if self.health is not None:
                self.health.failed(WHAT, self.path, exc)
            raise
        if self.health is not None:
            self.health.succeeded(WHAT)
        for key, (cap, at) in (caps or {}).items():
            try:
                _trim_hash(self._call, self.redis, key, cap, at)
            except (PredlogUnreachable, ValueError, IndexError, TypeError) as exc:
                log.warning("cannot trim %s: %s", key, exc)

    def _store_feedback(self, rows: list[tuple[Any, ...]]) -> concurrent.futures.Future[Any]:
        per_key: dict[str, dict[str, bytes]] = {}
        for rid, index, label, model, version, text, predicted, new, when in rows:
            per_key.setdefault(self._k_fb(model), {})[f"{rid}:{index}"] = msgpack.packb(
                [rid, index, label, version, text, predicted, new, when], use_bin_type=True)
        return self._submit(self._write, per_key,
                            {key: (self.feedback_rows, 7) for key in per_key})

    def _store_examples(self, model: str, rows: list[tuple[str, str, bool, float]]
                        ) -> concurrent.futures.Future[Any]:
        mapping = {t: msgpack.packb([lab, new, when], use_bin_type=True)
                   for t, lab, new, when in rows}
        return self._submit(self._write, {self._k_ex(model): mapping} if mapping else {},
                            {self._k_ex(model): (self.example_rows, 2)} if mapping else {})

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued here so far is written (PredlogUnreachable
        when Redis refused it), and PEER_LAG_S at least, so that what another
        node answered just before is written too (feedback for an id not found
        yet flushes, then looks again). Not on the IOLoop."""
        if self._closed:
            return
        t0 = time.monotonic()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._sender.q.put(["f", fut])
        fut.result(timeout)
        self._submit(lambda: None).result(timeout)
        left = t0 + PEER_LAG_S - time.monotonic()
        if left > 0:
            time.sleep(left)

    def close(self) -> None:
        """Write what is queued (one try), then stop the threads."""
        if self._closed:
            return
        self._closed = True
        self._sender.q.put(["stop"])
        self._sender.thread.join(60)
        self._fb.shutdown(wait=True)
        try:
            self.redis.close()
        except Exception:  # pragma: no cover - closing a broken pool
            pass

    # -- erasure (executor threads): streams rebuilt without the entries, then the
    # append-only file rewritten and an RDB snapshot made, so that the texts leave the disk
    def _models(self) -> list[str]:
        """The models with a stream, feedback or examples here."""
        head = f"{self.prefix}:plog:".encode()
        names: set[str] = set()
        for key in self._call(lambda: list(self.redis.scan_iter(match=head + b"*", count=1000))):
            rest = key[len(head):].decode(errors="replace")
            names.add(rest.split(":", 1)[0])  # a model name holds no ':'
        return sorted(names)

    def _erase_request(self, request_id: str, done: Erasure, timeout: float) -> None:
        for model in self._models():
            texts: set[str] = set()
            stream = self._k_stream(model)
            gone: list[bytes] = []
            for eid, d in self._scan(stream):
                if d[2] == request_id:
                    gone.append(eid)
                    texts.update(d[4])
                    done.count(predictions=len(d[4]))
            if gone:
                self._call(self._rebuild, keys=[stream], args=gone)
            mine = [f for f in self._call(self.redis.hkeys, self._k_fb(model))
                    if f.decode(errors="replace").rpartition(":")[0] == request_id]
            if mine:
                for v in self._call(self.redis.hmget, self._k_fb(model), mine):
                    if v is not None:
                        texts.add(msgpack.unpackb(v, raw=False)[4])
                done.count(feedback=self._call(self.redis.hdel, self._k_fb(model), *mine))
            if texts:
                done.count(examples=self._call(self.redis.hdel, self._k_ex(model),
                                               *(t.encode() for t in texts)))
                if done.wants_texts:
                    done.texts(model).update(texts)
        self._call(self.redis.delete, self._k_rid(request_id))
        _rewrite_aof(self.redis)

    def _purge(self, model: str, done: Erasure, timeout: float) -> None:
        entries = list(self._scan(self._k_stream(model)))
        if done.wants_texts:
            texts = done.texts(model)
            for _eid, d in entries:
                texts.update(d[4])
            for v in self._call(self.redis.hvals, self._k_fb(model)):
                texts.add(msgpack.unpackb(v, raw=False)[4])
            texts.update(f.decode() for f in self._call(self.redis.hkeys, self._k_ex(model)))
        done.count(sum(len(d[4]) for _eid, d in entries),
                   self._call(self.redis.hlen, self._k_fb(model)),
                   self._call(self.redis.hlen, self._k_ex(model)))
        self._call(self.redis.delete, self._k_stream(model), self._k_stats(model),
                   self._k_fb(model), self._k_ex(model))
        _rewrite_aof(self.redis)

    def _expire(self, cut: Callable[[str], float], done: Erasure) -> None:
        for model in self._models():
            t = cut(model)
            if not t:
                continue
            stream = self._k_stream(model)
            old = [(eid, d) for eid, d in self._scan(stream) if float(d[1]) < t]
            texts = done.texts(model)
            if old:
                self._call(self._rebuild, keys=[stream], args=[eid for eid, _ in old])
                done.count(predictions=sum(len(d[4]) for _, d in old))
                for _, d in old:
                    texts.update(d[4])
            for key, at_pos, what in ((self._k_fb(model), 7, "feedback"),
                                      (self._k_ex(model), 2, "examples")):
                got = self._call(self.redis.hgetall, key)
                gone = [f for f, v in got.items()
                        if float(msgpack.unpackb(v, raw=False)[at_pos]) < t]
                if gone:
                    done.count(**{what: self._call(self.redis.hdel, key, *gone)})
                    texts.update(msgpack.unpackb(got[f], raw=False)[4] if what == "feedback"
                                 else f.decode() for f in gone)
        if any(done.removed.values()):
            _rewrite_aof(self.redis)

    def _scan(self, stream: str) -> Iterator[tuple[bytes, list[Any]]]:
        """(entry id, decoded entry) of a whole stream, oldest first, in pages."""
        start: bytes | str = "-"
        while True:
            page = self._call(self.redis.xrange, stream, start, "+", count=1000)
            for eid, fields in page:
                blob = fields.get(b"d")
                if blob is not None:
                    yield eid, msgpack.unpackb(blob, raw=False)
            if len(page) < 1000:
                return
            start = b"(" + page[-1][0]

    # -- reads (executor threads) ------------------------------------------------------------
    def get(self, request_id: str, index: int | None = None) -> list[dict[str, Any]]:
        raw = self._call(self.redis.get, self._k_rid(request_id))
        if raw is None:
            return []
        model, _, eid = raw.decode().partition("\n")
        entries = self._call(self.redis.xrange, self._k_stream(model), eid, eid)
        rows = [r for r in _entry_rows(model, entries) if r["request_id"] == request_id]
        if index is not None:
            rows = [r for r in rows if r["index"] == index]
        return sorted(rows, key=lambda r: r["index"])

    def _newest(self, model: str, want: int, version: Any = None, start: Any = "+"
                ) -> list[dict[str, Any]]:
        """Up to `want` rows, newest first (of one version when given)."""
        out: list[dict[str, Any]] = []
        end = start
        entries = 0
        while len(out) < want:
            # entries to read: what is missing over the rows per entry seen so
            # far (batches of 64 texts need few entries), a little more
            per = len(out) / entries if entries and out else 1.0
            count = max(10, min(MAX_PAGE, int((want - len(out)) / per * 1.2) + 1,
                                MAX_PAGE if entries else 100))
            page = self._call(self.redis.xrevrange, self._k_stream(model), end, "-", count)
            if not page:
                break
            entries += len(page)
            for _eid, fields in page:
                blob = fields.get(b"d")
                if blob is None:
                    continue
                rows = _rows_of(model, blob)
                if version is not None:
                    rows = [r for r in rows if _same_version(r["version"], version)]
                out.extend(reversed(rows))  # a later index is a newer row, as in SQLite
            if len(page) < count:
                break
            end = "(" + page[-1][0].decode()
        return out[:want]

    def recent(self, model: str, version: Any = None, limit: int = 1000) -> list[dict[str, Any]]:
        if limit <= 0:
            return []
        start: Any = "+"
        if version is not None:
            last = self._call(self.redis.hget, self._k_stats(model),
                              f"last:{_ver_str(version)}")
            if last is None:
                return []
            start = last.decode()
        return self._newest(model, limit, version, start)

    def _feedback(self, model: str) -> list[list[Any]]:
        """[request_id, index, label, version, text, predicted, new_label, at]."""
        vals = self._call(self.redis.hvals, self._k_fb(model))
        return [msgpack.unpackb(v, raw=False) for v in vals]

    def _examples(self, model: str) -> list[tuple[str, list[Any]]]:
        """(text, [label, new_label, at])."""
        got = self._call(self.redis.hgetall, self._k_ex(model))
        return [(k.decode(), msgpack.unpackb(v, raw=False)) for k, v in got.items()]

    def _fed(self, model: str, version: Any) -> list[tuple[Any, ...]]:
        fb = [f for f in self._feedback(model)
              if version is None or _same_version(f[3], version)]
        fb.sort(key=lambda f: f[7])
        return [(rid, index, ver, text, predicted, label, new, at)
                for rid, index, label, ver, text, predicted, new, at in fb]

    def _predicted(self, model: str, version: Any, rids: set[str]
                   ) -> dict[tuple[str, int], tuple[Any, dict[str, float]]]:
        """By each id's key (an id whose key expired is not found)."""
        preds: dict[tuple[str, int], tuple[Any, dict[str, float]]] = {}
        order = sorted(rids)

        def join() -> None:
            pipe = self.redis.pipeline(transaction=False)
            for rid in order:
                pipe.get(self._k_rid(rid))
            parts = [(rid, raw.decode().partition("\n")) for rid, raw
                     in zip(order, pipe.execute()) if raw is not None]
            where = [(rid, m, eid) for rid, (m, _, eid) in parts if m == model]
            for rid, m, eid in where:
                pipe.xrange(self._k_stream(m), eid, eid)
            for (rid, m, _eid), entries in zip(where, pipe.execute()):
                for r in _entry_rows(m, entries):
                    if r["request_id"] == rid:
                        preds[(rid, r["index"])] = (r["at"], r["scores"])
        self._call(join)
        return preds

    def _count_rows(self, model: str
                    ) -> tuple[Iterable[tuple[Any, int]], Iterable[tuple[Any, int]]]:
        """Texts logged per version since the log began (the stats hash)."""
        def read() -> tuple[dict[bytes, Any], list[Any]]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(self._k_stats(model))
            pipe.hvals(self._k_fb(model))
            stats, fb = pipe.execute()
            return stats, fb
        stats, fb = self._call(read)
        return ([(_ver_of(k[2:]), int(v)) for k, v in stats.items() if k.startswith(b"v:")],
                [(_ver_of(_ver_str(msgpack.unpackb(raw, raw=False)[3])), 1) for raw in fb])

    def feedback_count(self, model: str, since: float | None = None) -> int:
        """Labels (feedback and free examples) received after `since`."""
        t = 0.0 if since is None else since
        return (sum(1 for f in self._feedback(model) if f[7] > t)
                + sum(1 for _, e in self._examples(model) if e[2] > t))

    def _labels_after(self, model: str, t: float) -> Iterable[tuple[str, str]]:
        rows = [(f[7], f[4], f[2]) for f in self._feedback(model) if f[7] > t]
        rows += [(e[2], text, e[0]) for text, e in self._examples(model) if e[2] > t]
        rows.sort(key=lambda r: r[0])
        return [(text, label) for _, text, label in rows]

    def _review_marks(self, model: str
                      ) -> tuple[Iterable[tuple[str, int, str]], Iterable[str]]:
        return ([(f[0], f[1], f[4]) for f in self._feedback(model)],
                [text for text, _ in self._examples(model)])

    def _review_candidates(self, model: str, fed: set[tuple[str, int]], done: set[str]
                           ) -> tuple[Sequence[float], Callable[[int], str],
                                      Callable[[int], dict[str, Any]]]:
        """Among the newest REVIEW_WINDOW texts."""
        rows = [r for r in self._newest(model, REVIEW_WINDOW)
                if (r["request_id"], r["index"]) not in fed]
        return [r["margin"] for r in rows], lambda k: rows[k]["text"], rows.__getitem__

    def labels_seen(self, model: str) -> set[str]:
        """Every label fed back for the model (feedback and examples)."""
        return {f[2] for f in self._feedback(model)} | {e[0] for _, e in self._examples(model)}
