"""The prediction log's writer process: state/predlog.py starts it and feeds it.

Why a process of its own: the log is written at the rate of the predictions
(thousands of rows a second), and a writer thread in the supervisor shared
its interpreter lock with the IOLoop. Each SQLite call hands that lock back
and forth, and the IOLoop waited for it on every hand-back: a third of the
single-text throughput went (docs/loop.md). Here the supervisor only puts
answers on a queue, packed; its sender thread writes what gathered every
~0.5 s to this process's stdin. Here each write becomes one transaction:
a row in `batches` per (model, version) holding the answers as the
supervisor packed them, a row in `rids` for a request whose id cannot be
found by its time (see ``found_by_time``), and the trim, on another core (or in
the idle moments of a busy one: the process lowers its own CPU priority,
see ``NICE``). Nothing is done per text.

Protocol (msgpack objects, one after another, both ways):

    in:  [item, ...]      a batch; item is one of
         ["A", at, request_id, model, version, n, blob]   a /predict answer of n texts,
                                   blob: msgpack [texts, predictions], or [texts, labels,
                                   score rows, top k] (PredictionLog.add_scores)
         ["r", [row, ...]]                                rows (PredictionLog.add)
         ["f", seq]        a flush marker: acknowledged once all before it is committed
    out: {"logged": n, "dropped": n, "error": null | [errno, message], "acks": [seq, ...]}
         after a transaction that acknowledges markers or changes the error state,
         else at most once a second

EOF on stdin (the supervisor closed it, or died) commits what was read and
ends the process; so does SIGTERM. SIGINT (a Ctrl-C at the terminal reaches
the whole process group) is ignored: the supervisor's clean stop closes
stdin. Imports no TensorFlow and nothing above state/.
"""
from __future__ import annotations

import os
import select
import signal
import sqlite3
import sys
import time
from typing import Any

import msgpack

from state.statedb import as_oserror

NICE = 19        # the lowest CPU priority: serving first, the log writes in idle time
TRIM_SLACK = 0.05  # a model's texts may exceed max_rows by this share before a trim
_BATCH = ("INSERT INTO batches (model, version, n, at_first, at, data) "
          "VALUES (?, ?, ?, ?, ?, ?)")
# a client's id sent again (a retry) never replaces the answer logged first
_RID = "INSERT OR IGNORE INTO rids (request_id, batch) VALUES (?, ?)"

# Finding a request by its id. The ids the service makes (frontend/request_ids.py
# new_id: 8 hex digits, the time in ms modulo 10**10 as 10 digits, 24 random
# hex digits) carry their time, and the answer is logged within moments of it:
# such a request is found among the few batches written around that time,
# and needs no row of its own (a `rids` row costs the writer more than all
# else it does for a single-text answer). Any other id, or an answer logged
# more than ID_WINDOW_MS after its id's time, gets a `rids` row.
ID_MOD = 10 ** 10
ID_WINDOW_MS = 2000
MAX_SPAN_S = 2.0  # a batch row holds answers of at most this span of time


def id_ms(rid: str) -> int | None:
    """The time in a service-made request id (ms modulo ID_MOD), else None."""
    if len(rid) < 19 or not rid[8:18].isdigit():
        return None
    try:
        int(rid[:8], 16)
        int(rid[18:], 16)
    except ValueError:
        return None
    return int(rid[8:18])


def found_by_time(rid: str, at: float) -> bool:
    """Whether the answer to `rid`, logged at `at`, is found by its id's time."""
    ms = id_ms(rid)
    return ms is not None and (int(at * 1000) - ms) % ID_MOD <= ID_WINDOW_MS


def store(conn: sqlite3.Connection, model: str, version: Any, ents: list[list[Any]]) -> int:
    """Insert entries of one (model, version) as batch rows (split so that none
    spans more than MAX_SPAN_S), with a `rids` row for each request not found
    by its id's time. Returns the texts stored."""
    total = 0
    start = 0
    lo = hi = ents[0][0]
    for k in range(len(ents) + 1):
        if k < len(ents):
            at = ents[k][0]
            if max(hi, at) - min(lo, at) <= MAX_SPAN_S:
                lo, hi = min(lo, at), max(hi, at)
                continue
        part = ents[start:k]
        n = sum(e[3] for e in part)
        bid = conn.execute(_BATCH, (model, version, n, lo, hi,
                                    msgpack.packb(part, use_bin_type=True))).lastrowid
        own = [(e[1], bid) for e in part if not found_by_time(e[1], e[0])]
        if own:
            conn.executemany(_RID, own)
        total += n
        if k < len(ents):
            start, lo, hi = k, ents[k][0], ents[k][0]
    return total


def top_list(scores: Any) -> list[dict[str, Any]]:
    """Scores as a /predict top list [{"label", "score"}, ...], best first (from
    a {label: score} map, or a top list)."""
    if isinstance(scores, dict):
        return sorted(({"label": k, "score": float(v)} for k, v in scores.items()),
                      key=lambda t: -t["score"])
    return list(scores or ())


def entries_of(items: list[list[Any]]) -> dict[tuple[str, Any], list[list[Any]]]:
    """A batch's answers as stored entries, grouped by (model, version). An
    entry is [at, request_id, first index, n, blob]: blob is msgpack of the n
    [texts, predictions] as /predict answered them (a /predict answer's blob
    is stored as the supervisor packed it: nothing per text is done here);
    rows from PredictionLog.add become one entry per run of one request's rows."""
    groups: dict[tuple[str, Any], list[list[Any]]] = {}
    for item in items:
        kind = item[0]
        if kind == "A":
            _, at, rid, model, version, n, blob = item
            groups.setdefault((model, version), []).append([at, rid, 0, n, blob])
        elif kind == "r":
            runs: list[tuple[tuple[str, Any], list[Any], list[str], list[dict[str, Any]]]] = []
            for r in item[1]:
                key = (r["model"], r.get("version"))
                idx = int(r.get("index", 0))
                top = top_list(r.get("scores"))
                pred = {"label": r.get("label") if r.get("label") is not None or not top
                        else top[0]["label"], "top": top}
                if runs and runs[-1][0] == key and runs[-1][1][1] == r["request_id"] \
                        and runs[-1][1][2] + len(runs[-1][2]) == idx:
                    runs[-1][2].append(r["text"])  # the next text of the same request
                    runs[-1][3].append(pred)
                    continue
                head = [r.get("at") or time.time(), r["request_id"], idx]
                runs.append((key, head, [r["text"]], [pred]))
            for key, head, texts, preds in runs:
                groups.setdefault(key, []).append(
                    [*head, len(texts), msgpack.packb([texts, preds], use_bin_type=True)])
    return groups


def cut(entry: list[Any], k: int) -> list[Any]:
    """An entry without its first k texts."""
    body = msgpack.unpackb(entry[4], raw=False)
    if len(body) == 2:  # [texts, predictions]
        body = [body[0][k:], body[1][k:]]
    else:  # [texts, labels, score rows, top k]
        body = [body[0][k:], body[1], body[2][k:], body[3]]
    return [entry[0], entry[1], entry[2] + k, entry[3] - k,
            msgpack.packb(body, use_bin_type=True)]


class Writer:
    def __init__(self, path: str, max_rows: int) -> None:
        self.path, self.max_rows = path, max_rows
        self.conn = sqlite3.connect(path, timeout=10.0, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.rows: dict[str, int] = {}  # texts per model, as counted and kept since
        self.logged = self.dropped = 0
        self.error: list[Any] | None = None

    def write(self, items: list[list[Any]]) -> bool:
        """One transaction for the batch (when it fails, its texts are lost and
        counted): rows in `batches` per (model, version) (store), and in `rids`
        for requests not found by their id's time. Returns whether the error
        state changed."""
        before = self.error
        try:
            groups = entries_of(items)
        except Exception as exc:  # pragma: no cover - the supervisor sends what it built
            print(f"prediction log: malformed batch skipped: {exc!r}", file=sys.stderr,
                  flush=True)
            return False
        if not groups:
            return False
        counts: dict[str, int] = {}
        total = 0
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for (model, version), ents in groups.items():
                    n = store(conn, model, version, ents)
                    counts[model] = counts.get(model, 0) + n
                    total += n
                for model, n in counts.items():
                    self._trim(model, n)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # SQLite may have rolled back itself (disk full)
                    conn.execute("ROLLBACK")
                raise
        except Exception as exc:  # a full disk: serving goes on, these texts are lost
            self.rows.clear()  # rolled back: count again at the next write
            total = sum(e[3] for ents in groups.values() for e in ents)
            self.dropped += total
            err = as_oserror(exc)
            self.error = [err.errno, str(err)]
            print(f"prediction log write failed ({total} texts lost): {exc}",
                  file=sys.stderr, flush=True)
            return before is None
        self.logged += total
        self.error = None
        return before is not None

    def probe(self) -> bool:
        """In the error state, a real one-row write: does the disk take writes
        again? (With no predictions coming, the error would otherwise stay.)
        Returns whether the error state changed."""
        if self.error is None:
            return False
        try:
            self.conn.execute("INSERT OR REPLACE INTO writer_probe (id, at) VALUES (1, ?)",
                              (time.time(),))
        except Exception as exc:
            err = as_oserror(exc)
            self.error = [err.errno, str(err)]
            return False
        self.error = None
        return True

    def _trim(self, model: str, added: int) -> None:
        """Keep the newest max_rows texts of a model (up to TRIM_SLACK more between
        two trims): the count is kept here (counted once); a trim deletes the
        oldest batches whole, and cuts the oldest texts off the next one."""
        conn = self.conn
        count = self.rows.get(model)
        if count is None:
            count = conn.execute("SELECT COALESCE(SUM(n), 0) FROM batches WHERE model = ?",
                                 (model,)).fetchone()[0]
        else:
            count += added
        if count > self.max_rows + int(self.max_rows * TRIM_SLACK):
            excess = count - self.max_rows
            gone: list[int] = []
            for bid, n in conn.execute("SELECT id, n FROM batches WHERE model = ? ORDER BY id",
                                       (model,)).fetchall():
                if excess <= 0:
                    break
                if n <= excess:
                    gone.append(bid)
                    excess -= n
                    count -= n
                    continue
                ents = msgpack.unpackb(conn.execute("SELECT data FROM batches WHERE id = ?",
                                                    (bid,)).fetchone()[0], raw=False)
                while excess > 0:
                    k = min(excess, ents[0][3])
                    if k == ents[0][3]:
                        ents.pop(0)
                    else:  # the entry's first k texts go
                        ents[0] = cut(ents[0], k)
                    excess -= k
                    count -= k
                conn.execute("UPDATE batches SET n = ?, data = ? WHERE id = ?",
                             (sum(e[3] for e in ents), msgpack.packb(ents, use_bin_type=True),
                              bid))
                break
            for i in range(0, len(gone), 500):
                part = gone[i:i + 500]
                marks = ",".join("?" * len(part))  # only ? marks go into the SQL (bandit B608)
                conn.execute(f"DELETE FROM rids WHERE batch IN ({marks})", part)  # nosec B608
                conn.execute(f"DELETE FROM batches WHERE id IN ({marks})", part)  # nosec B608
        self.rows[model] = count


def report(out: Any, writer: Writer, acks: list[int]) -> bool:
    try:
        out.write(msgpack.packb({"logged": writer.logged, "dropped": writer.dropped,
                                 "error": writer.error, "acks": acks}))
        out.flush()
    except (BrokenPipeError, OSError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    path, max_rows = (argv if argv is not None else sys.argv[1:])[:2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        os.nice(NICE)
    except OSError:
        pass
    writer = Writer(path, int(max_rows))
    fd_in, out = sys.stdin.fileno(), sys.stdout.buffer
    parent = os.getppid()
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)
    last_report = 0.0
    reported = (0, 0)  # the counts last reported
    eof = False
    while not eof:
        try:
            ready = select.select([fd_in], [], [], 1.0)[0]
        except InterruptedError:
            ready = []
        if not ready:
            if stopping or os.getppid() != parent:  # asked to stop, or orphaned
                break
            # an idle second: report the error state if it changed, and the
            # counts of writes made since the last report (without this, the
            # last writes of a burst stayed unreported until the next one)
            if writer.probe() or (writer.logged, writer.dropped) != reported:
                last_report = time.monotonic()
                reported = (writer.logged, writer.dropped)
                if not report(out, writer, []):
                    break
            continue
        data = os.read(fd_in, 1 << 20)
        if not data:
            eof = True
        else:
            unpacker.feed(data)
        items: list[list[Any]] = []
        acks: list[int] = []
        for batch in unpacker:
            for item in batch:
                if item[0] == "f":
                    acks.append(item[1])
                else:
                    items.append(item)
        changed = writer.write(items)
        if acks and not items:
            changed = writer.probe() or changed
        now = time.monotonic()
        if acks or changed or eof or now - last_report >= 1.0:
            last_report = now
            reported = (writer.logged, writer.dropped)
            if not report(out, writer, acks):
                break  # the supervisor is gone: what was read is committed
        if stopping:
            break
    writer.conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
