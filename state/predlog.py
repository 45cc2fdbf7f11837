"""The prediction log and the feedback on it (docs/loop.md).

Interface (the Supervisor creates one as ``sup.predlog``; the live-quality and
drift code reads it through these methods only):

    add(rows)                      non-blocking, from the IOLoop; rows are dicts
                                   {"at", "request_id", "index", "model", "version",
                                    "text", "label", "scores": {label: score} or a
                                    top list [{"label", "score"}]}; a writer thread
                                   writes them in batches
    get(request_id, index=None)    logged predictions of one request, by index
    add_feedback(request_id, index, label, ...)  -> Future (committed)
                                   keyed (request_id, index): a repeat replaces
    add_examples(model, [(text, label)], ...)    -> Future: labels with no
                                   logged prediction (a repeated text replaces)
    recent(model, version=None, limit=1000)      newest predictions, newest first
    fed_back(model, version=None)  predictions joined with their feedback:
                                   {"request_id", "index", "version", "text",
                                    "label", "truth", "scores", "at", "fed_at"}
    counts(model)                  {version: {"predictions": n, "feedback": n}}
    feedback_examples(model, since=None) -> [(text, label)] (feedback and free
                                   examples; a text fed back twice: the newest)
    review(model, limit, strategy) predictions with no feedback yet,
                                   "uncertain" (smallest top-2 margin first) or
                                   "random"
    flush(timeout) / close()

The logic (review order, counts, fed-back rows, erasure and retention
bookkeeping) is state/predlog_core.py's `PredictionLogCore`, shared with the
Redis log; this module stores and reads, with SQLite.

Threading and processes: predictions (add, add_answer) are packed with
msgpack at once (~4 us) and the bytes put on a queue; a sender thread
writes what gathered every ~0.5 s to the writer process
(state/predlog_writer.py: it stores and trims them, off the supervisor's
interpreter lock). Storage (schema 2, see _SCHEMA): a row per write and
per (model, version) holding the answers as packed, and a row per request
id; reads decode what they need. Feedback
and free examples (add_feedback, add_examples) are written by a thread here,
in call order, each future resolving once committed. Read methods open a
connection per thread (thread-local), so they are safe from executor threads;
they must not run on the IOLoop. Storage: SQLite, WAL, ``synchronous=NORMAL``
(``<models_dir>/.predictions.db``): a clean stop commits everything queued;
a kill -9 of the supervisor may lose the predictions of its last ~0.5 s (the
writer commits what it was sent, then exits), never an answered feedback.
When the writer falls behind by more than ``MAX_QUEUED`` answers (a machine
saturated for a long time), new predictions are dropped and counted
(``dropped``), never the request slowed. Texts are stored:
``predictions.log: false`` turns the log off. Imports no TensorFlow.
"""
from __future__ import annotations

import array
import concurrent.futures
import itertools
import json
import logging
import os
import queue
import sqlite3
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import msgpack

from state.predlog_core import (WHAT, Erasure, PredictionLogCore, closed_future, drain,
                                prediction, top_margin, top_of)
from state.predlog_writer import (ID_MOD, ID_WINDOW_MS, MAX_SPAN_S, TRIM_SLACK, id_ms, store,
                                  top_list)
from state.sqlitedb import ThreadConnections, connect, transaction
from state.statedb import as_oserror
from state.storage import Health

log = logging.getLogger("textswap.predlog")

FILENAME = ".predictions.db"
SCHEMA_VERSION = 2  # 1: a row per text in `predictions` (migrated on open)
# The sender gathers answers this long between two writes (a flush or a stop
# cuts the wait short). Measured (bench/loop.py --cost): with 50 ms, the
# writer's twenty wake-ups a second cost the supervisor ~25 us a single-text
# request (its caches and core shared with the writer) for ~5 us of its own
# work; with 0.5 s, nothing measurable, and the writer ~30 % less a text.
_BATCH_WAIT_S = 0.5
MAX_QUEUED = 200_000  # texts waiting for the writer; beyond, new answers are dropped

_SCHEMA = [
    # The predictions, as written by the writer process (state/predlog_writer.py):
    # one row per (model, version) per write (~0.5 s of answers), its answers'
    # entries in `data` as msgpack: [[at, request_id, first index, n, blob], ...],
    # blob the msgpack the request path made: [texts, predictions], or [texts,
    # labels, score rows, top k] (add_scores). A row per text cost the writer
    # ~25 us a text (the row, its two index entries); this costs a fraction.
    """CREATE TABLE IF NOT EXISTS batches (
           id INTEGER PRIMARY KEY,
           model TEXT NOT NULL,
           version INTEGER,
           n INTEGER NOT NULL,    -- texts in data
           at_first REAL NOT NULL,  -- its oldest answer's time
           at REAL NOT NULL,      -- its newest answer's time (at most MAX_SPAN_S later)
           data BLOB NOT NULL
       )""",
    "CREATE INDEX IF NOT EXISTS batches_model ON batches (model, id)",
    "CREATE INDEX IF NOT EXISTS batches_version ON batches (model, version, id)",
    "CREATE INDEX IF NOT EXISTS batches_at ON batches (at_first)",
    # where a request's answer is, for the requests not found by their id's time
    # (predlog_writer.found_by_time; a request id used again: the first answer)
    """CREATE TABLE IF NOT EXISTS rids (
           request_id TEXT PRIMARY KEY,
           batch INTEGER NOT NULL
       ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS rids_batch ON rids (batch)",
    """CREATE TABLE IF NOT EXISTS feedback (
           request_id TEXT NOT NULL,
           idx INTEGER NOT NULL,
           model TEXT NOT NULL,
           version INTEGER,
           text TEXT NOT NULL,    -- copied: the feedback outlives the trimmed prediction
           predicted TEXT,
           label TEXT NOT NULL,
           new_label INTEGER NOT NULL DEFAULT 0,
           at REAL NOT NULL,
           PRIMARY KEY (request_id, idx)
       )""",
    "CREATE INDEX IF NOT EXISTS feedback_model ON feedback (model, at)",
    # one row, rewritten by the writer process to learn that a failed disk works again
    "CREATE TABLE IF NOT EXISTS writer_probe (id INTEGER PRIMARY KEY, at REAL)",
    """CREATE TABLE IF NOT EXISTS examples (
           model TEXT NOT NULL,
           text TEXT NOT NULL,
           label TEXT NOT NULL,
           new_label INTEGER NOT NULL DEFAULT 0,
           at REAL NOT NULL,
           PRIMARY KEY (model, text)
       )""",
]


def _unpack(e: list[Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """A stored entry's texts and predictions (the top lists rebuilt when the
    entry holds score rows: see PredictionLog.add_scores)."""
    body = msgpack.unpackb(e[4], raw=False)
    if len(body) == 2:
        return body[0], body[1]
    texts, labels, rows, k = body
    return texts, [top_of(row, labels, k) for row in rows]


def _pred(model: str, version: Any, e: list[Any], text: str, p: dict[str, Any], i: int
          ) -> dict[str, Any]:
    """Text i of a stored entry as a prediction row."""
    top = p.get("top") or []
    return prediction(e[0], e[1], e[2] + i, model, version, text,
                      top[0]["label"] if top else p.get("label"),
                      {t["label"]: t["score"] for t in top}, top_margin(top))


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Schema 1 (a row per text in `predictions`) to batches and request ids, in
    the caller's transaction: a few thousand texts a row, a request's texts
    never split."""
    key: tuple[str, Any] | None = None
    runs: list[list[Any]] = []  # [at, request_id, first index, texts, predictions]
    n = 0

    def put() -> None:
        if runs and key is not None:
            store(conn, key[0], key[1],
                  [[at, rid, first, len(texts), msgpack.packb([texts, preds], use_bin_type=True)]
                   for at, rid, first, texts, preds in runs])

    for at, rid, idx, model, version, text, label, scores in conn.execute(
            "SELECT at, request_id, idx, model, version, text, label, scores FROM predictions "
            "ORDER BY id").fetchall():
        top = top_list(json.loads(scores or "{}"))
        pred = {"label": label if label is not None or not top else top[0]["label"], "top": top}
        last = runs[-1] if runs else None
        if (model, version) == key and last is not None and last[1] == rid \
                and last[2] + len(last[3]) == idx:
            last[3].append(text)
            last[4].append(pred)
            n += 1
            continue
        if (model, version) != key or (n >= 2000 and (last is None or last[1] != rid)):
            put()
            key, runs, n = (model, version), [], 0
        runs.append([at, rid, idx, [text], [pred]])
        n += 1
    put()
    conn.execute("DROP TABLE predictions")


def _open(path: str) -> None:
    """The schema made (or migrated) at start: a start that cannot open the log
    fails loudly."""
    conn = connect(path, any_thread=True)
    try:
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        if current > SCHEMA_VERSION:
            raise RuntimeError(f"{path} has schema version {current}; this code "
                               f"knows up to {SCHEMA_VERSION}")
        with transaction(conn):
            for stmt in _SCHEMA:
                conn.execute(stmt)
            if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                            "name = 'predictions'").fetchone():
                _migrate_v1(conn)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    finally:
        conn.close()


def _delete_batches(conn: sqlite3.Connection, ids: list[int]) -> None:
    """Batch rows and their request ids, 500 at a time."""
    for i in range(0, len(ids), 500):
        part = ids[i:i + 500]
        marks = ",".join("?" * len(part))  # only ? marks go into the SQL (bandit B608)
        conn.execute(f"DELETE FROM rids WHERE batch IN ({marks})", part)  # nosec B608
        conn.execute(f"DELETE FROM batches WHERE id IN ({marks})", part)  # nosec B608


def _batch_texts(conn: sqlite3.Connection, texts: set[str], where: str,
                 args: tuple[Any, ...]) -> None:
    """Add the texts of the batches a condition selects to `texts`."""
    for (data,) in conn.execute(f"SELECT data FROM batches WHERE {where}", args):  # nosec B608: where is a constant of this module
        for e in msgpack.unpackb(data, raw=False):
            texts.update(_unpack(e)[0])


def _erase_rows(conn: sqlite3.Connection, request_id: str, done: Erasure) -> None:
    """One request's rows deleted (in the caller's transaction)."""
    rid = request_id.encode()
    texts: dict[str, set[str]] = {}  # model -> the texts erased
    n = 0
    # every batch whose bytes hold the id (then decoded: only exact matches go)
    for bid, model, data in conn.execute(
            "SELECT id, model, data FROM batches WHERE instr(data, ?) > 0", (rid,)).fetchall():
        ents = msgpack.unpackb(data, raw=False)
        keep = [e for e in ents if e[1] != request_id]
        if len(keep) == len(ents):
            continue
        for e in ents:
            if e[1] == request_id:
                texts.setdefault(model, set()).update(_unpack(e)[0])
                n += e[3]
        if keep:
            conn.execute("UPDATE batches SET n = ?, at_first = ?, at = ?, data = ? "
                         "WHERE id = ?", (sum(e[3] for e in keep),
                                          min(e[0] for e in keep), max(e[0] for e in keep),
                                          msgpack.packb(keep, use_bin_type=True), bid))
        else:
            conn.execute("DELETE FROM batches WHERE id = ?", (bid,))
    conn.execute("DELETE FROM rids WHERE request_id = ?", (request_id,))
    for model, text in conn.execute("SELECT model, text FROM feedback WHERE request_id = ?",
                                    (request_id,)).fetchall():
        texts.setdefault(model, set()).add(text)
    fb = conn.execute("DELETE FROM feedback WHERE request_id = ?", (request_id,)).rowcount
    ex = 0
    for model, gone in texts.items():
        ex += sum(conn.execute("DELETE FROM examples WHERE model = ? AND text = ?",
                               (model, t)).rowcount for t in gone)
        if done.wants_texts:
            done.texts(model).update(gone)
    done.count(n, fb, ex)


class _Writer:
    """One writer process, and the flush markers it has been sent."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.acks: dict[int, concurrent.futures.Future[Any]] = {}
        self.logged = self.dropped = 0  # as the process last reported
        self.sent = 0  # texts written to its pipe
        self.error: Any = None
        self.reader: threading.Thread | None = None


class _WriterLink:
    """The predictions' way to the writer process: the queue of packed
    answers, the sender thread, the process (started again when it ends) and
    the reader of its reports."""

    def __init__(self, owner: PredictionLog) -> None:
        self.owner = owner  # its path, max_rows and health
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.local = threading.local()  # a msgpack Packer per thread
        self.seq = itertools.count(1)
        self.writer: _Writer | None = None
        self.started_at = 0.0
        self.retired = [0, 0]  # logged, dropped by writer processes that ended
        self.lost = 0          # dropped here: queue full, writer down, unpackable
        self.queued = 0        # texts put on the queue and not yet sent to the writer
        self.wake = threading.Event()  # cuts the sender's gathering wait short
        self.sender = threading.Thread(target=self._send_loop, name="predlog-sender",
                                       daemon=True)
        self.sender.start()

    @property
    def logged(self) -> int:
        w = self.writer
        return self.retired[0] + (w.logged if w else 0)

    @property
    def dropped(self) -> int:
        w = self.writer
        return self.retired[1] + self.lost + (w.dropped if w else 0)

    def put(self, item: tuple[Any, ...], texts: int) -> None:
        """The item packed at once, as a one-item batch of the writer's
        protocol, and the bytes queued: ~4 us here, and no container outlives
        the request. (Queued as objects, the answers of the last ~0.5 s survived
        young collections and were promoted to the old generation, whose
        collections then traversed them: measurably more CPU a request in the
        supervisor.)"""
        if self.queued >= MAX_QUEUED:
            self.lost += texts
            return
        packer = getattr(self.local, "packer", None)
        if packer is None:  # a Packer is not thread-safe: one per thread (it is faster
            packer = self.local.packer = msgpack.Packer(use_bin_type=True)  # than packb)
        try:
            if item[0] == "r":
                blob = packer.pack([["r", item[1]]])
            else:  # body: [texts, predictions] or [texts, labels, rows, k]
                _, at, rid, model, version, *body = item
                blob = packer.pack([["A", at, rid, model, version, texts, packer.pack(body)]])
        except (TypeError, ValueError) as exc:  # a value msgpack cannot pack
            packer.reset()
            self.lost += texts
            log.error("prediction log: %d texts not packable, skipped: %r", texts, exc)
            return
        self.queued += texts
        self.q.put(("b", blob, texts))

    def flush(self, timeout: float | None) -> None:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.q.put(["f", next(self.seq), fut])
        self.wake.set()
        fut.result(timeout)

    def stop(self) -> None:
        """Send what is queued, then EOF to the writer (it commits and ends)."""
        self.q.put(["stop"])
        self.wake.set()
        self.sender.join(60)

    def _send_loop(self) -> None:
        stop = False
        while not stop:
            item = self.q.get()
            if item[0] == "b":  # gather more: fewer, bigger writes
                self.wake.wait(_BATCH_WAIT_S)
                self.wake.clear()
            batch = drain(self.q, item)
            stop = any(b[0] == "stop" for b in batch)
            items = [b for b in batch if b[0] != "stop"]
            texts = sum(it[2] for it in items if it[0] == "b")
            self.queued -= texts  # (one sender thread: no lock; the count is a bound)
            if items:
                self._send(items, texts)
        self._end_writer()

    def _send(self, items: list[Any], texts: int) -> None:
        markers = [it for it in items if it[0] == "f"]
        w = self.writer
        if len(markers) == len(items) and (w is None or w.proc.poll() is not None):
            for it in markers:  # nothing to write and no writer: all is committed
                it[2].set_result(None)
            return
        try:
            w = self._live_writer()
            for it in markers:
                w.acks[it[1]] = it[2]
            w.proc.stdin.write(b"".join(it[1] if it[0] == "b" else  # type: ignore[union-attr]  # stdin=PIPE, never None
                                        msgpack.packb([["f", it[1]]]) for it in items))
            w.proc.stdin.flush()  # type: ignore[union-attr]  # stdin=PIPE, never None
            w.sent += texts
        except (OSError, ValueError) as exc:
            log.error("prediction log: %d texts not sent to the writer: %s", texts, exc)
            self.lost += texts
            for it in markers:
                if not it[2].done():
                    it[2].set_exception(RuntimeError(f"the prediction log writer: {exc}"))

    def _live_writer(self) -> _Writer:
        w = self.writer
        if w is not None and w.proc.poll() is None:
            return w
        if w is not None:
            self._retire(w)
        wait = self.started_at + 1.0 - time.monotonic()
        if wait > 0:  # a writer that keeps dying is restarted once a second at most
            time.sleep(wait)
        self.started_at = time.monotonic()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.Popen([sys.executable, "-m", "state.predlog_writer", self.owner.path,
                                 str(self.owner.max_rows)], cwd=root,  # the package from the layout
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        w = self.writer = _Writer(proc)
        w.reader = threading.Thread(target=self._read_loop, args=(w,), name="predlog-acks",
                                    daemon=True)
        w.reader.start()
        return w

    def _read_loop(self, w: _Writer) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        out = w.proc.stdout
        while True:
            try:
                data = out.read1(1 << 16)  # type: ignore[union-attr]  # stdout=PIPE: a BufferedReader
            except (OSError, ValueError):
                data = b""
            if not data:
                break
            unpacker.feed(data)
            for msg in unpacker:
                self._report(w, msg)
        w.proc.wait()
        for fut in list(w.acks.values()):  # sent, never acknowledged: the writer died
            if not fut.done():
                fut.set_exception(RuntimeError(
                    f"the prediction log writer ended (exit {w.proc.returncode})"))
        w.acks.clear()

    def _report(self, w: _Writer, msg: dict[str, Any]) -> None:
        w.logged, w.dropped = msg.get("logged", 0), msg.get("dropped", 0)
        err = msg.get("error")
        w.error = err
        health = self.owner.health
        if health is not None:
            if err:
                health.failed(WHAT, self.owner.path, OSError(err[0], err[1]))
            else:
                health.succeeded(WHAT)
        for seq in msg.get("acks") or ():
            fut = w.acks.pop(seq, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _retire(self, w: _Writer) -> None:
        if w.reader is not None:
            w.reader.join(30)
        self.retired[0] += w.logged
        # texts it was sent and never reported committed or dropped: in flight
        # when it died (its last reports come before its EOF, so a clean stop
        # leaves none)
        lost = w.sent - w.logged - w.dropped
        if lost > 0:
            log.error("prediction log: the writer ended (exit %s) with %d texts not "
                      "committed: dropped", w.proc.returncode, lost)
        self.retired[1] += w.dropped + max(0, lost)
        if self.writer is w:
            self.writer = None

    def _end_writer(self) -> None:
        """EOF to the writer: it commits what it has and ends."""
        w = self.writer
        if w is None:
            return
        try:
            w.proc.stdin.close()  # type: ignore[union-attr]  # stdin=PIPE, never None
        except OSError:
            pass
        try:
            w.proc.wait(30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a writer stuck on disk
            log.error("the prediction log writer did not end in 30 s: killed")
            w.proc.kill()
            w.proc.wait()
        self._retire(w)


class PredictionLog(PredictionLogCore):
    """See the module docstring; the logic is state/predlog_core.py's."""

    def __init__(self, path: str, *, enabled: bool = True, max_rows: int = 100_000,
                 feedback_rows: int = 100_000, example_rows: int = 100_000,
                 health: Health | None = None) -> None:
        super().__init__(enabled=enabled, max_rows=max_rows, feedback_rows=feedback_rows,
                         example_rows=example_rows, health=health)
        self.path = os.path.abspath(path)
        self._rows: dict[tuple[str, str], int] = {}  # (table, model) -> rows, at least
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        _open(self.path)
        self._conns = ThreadConnections(self.path, any_thread=True)  # reads' connections
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()   # feedback, examples
        self._thread = threading.Thread(target=self._run, name="predlog-feedback", daemon=True)
        self._thread.start()
        self._link = _WriterLink(self)  # predictions, to the writer process

    @property
    def logged(self) -> int:
        """Prediction rows committed (by every writer process so far)."""
        return self._link.logged

    @property
    def dropped(self) -> int:
        """Prediction rows not written: a failed write, the queue full, the writer down."""
        return self._link.dropped

    def stats(self) -> dict[str, int]:
        """For /status: texts logged (committed by the writer), dropped (never
        written: a failed write, the queue full, the writer down), and queued
        (waiting in this process for the sender)."""
        return {"logged": self.logged, "dropped": self.dropped,
                "queued": max(0, self._link.queued)}

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return self._conns.get().execute(sql, args).fetchall()

    def _enqueue(self, item: tuple[Any, ...], texts: int) -> None:
        self._link.put(item, texts)

    # -- feedback and examples: a thread here, each future resolving on commit --------------
    def _submit(self, kind: str, payload: Any) -> concurrent.futures.Future[Any]:
        if self._closed:
            return closed_future()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._q.put((kind, payload, fut))
        return fut

    def _store_feedback(self, rows: list[tuple[Any, ...]]) -> concurrent.futures.Future[Any]:
        return self._submit("feedback", [(*r[:7], int(r[7]), r[8]) for r in rows])

    def _store_examples(self, model: str, rows: list[tuple[str, str, bool, float]]
                        ) -> concurrent.futures.Future[Any]:
        return self._submit("examples", [(model, t, lab, int(new), when)
                                         for t, lab, new, when in rows])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far is committed: the predictions by the
        writer process, the feedback here (not on the IOLoop)."""
        if self._closed:
            return
        self._link.flush(timeout)
        self._submit("noop", None).result(timeout)

    def close(self) -> None:
        """Commit what is queued, then stop the writer process and the threads."""
        if self._closed:
            return
        self._closed = True
        self._q.put(("stop", None, None))
        self._link.stop()
        self._thread.join(30)
        self._conns.close_mine()

    def _run(self) -> None:
        conn = connect(self.path, any_thread=True)
        stop = False
        while not stop:
            batch = drain(self._q, self._q.get())
            stop = any(b[0] == "stop" for b in batch)
            self._write(conn, batch)
        conn.close()

    def _write(self, conn: sqlite3.Connection, batch: list[tuple[Any, ...]]) -> None:
        futures = [f for _, _, f in batch if f is not None]
        writes = [(k, p) for k, p, _ in batch if k in ("feedback", "examples")]
        try:
            if writes:
                with transaction(conn):
                    for kind, payload in writes:
                        if kind == "feedback":
                            conn.executemany(
                                "INSERT OR REPLACE INTO feedback (request_id, idx, label, "
                                "model, version, text, predicted, new_label, at) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", payload)
                        else:
                            conn.executemany(
                                "INSERT OR REPLACE INTO examples (model, text, label, "
                                "new_label, at) VALUES (?, ?, ?, ?, ?)", payload)
                    self._trim(conn, writes)
                if self.health is not None:
                    self.health.succeeded(WHAT)
        except Exception as exc:  # a full disk: the feedback is refused (507/503)
            log.error("feedback write failed: %s", exc)
            if self.health is not None and isinstance(exc, (OSError, sqlite3.Error)):
                self.health.failed(WHAT, self.path, as_oserror(exc))
            for f in futures:
                if not f.done():
                    f.set_exception(exc)
            return
        for f in futures:
            if not f.done():
                f.set_result(None)

    def _trim(self, conn: sqlite3.Connection, writes: list[tuple[str, Any]]) -> None:
        """Keep each model's newest feedback.max_rows feedback rows and
        feedback.max_example_rows free examples (up to TRIM_SLACK more between
        trims, as the writer trims predictions), in the write's transaction.
        The rows counted here are an upper bound (a replaced row counts as
        added, an erasure is not subtracted): past the cap, they are counted."""
        added: dict[tuple[str, str], int] = {}
        for kind, payload in writes:
            for row in payload:
                key = (kind, row[3] if kind == "feedback" else row[0])
                added[key] = added.get(key, 0) + 1
        for (table, model), n in added.items():
            key = (table, model)
            cap = self.caps[table]
            rows = self._rows.get(key)
            rows = (rows + n) if rows is not None else None
            if rows is None or rows > cap + int(cap * TRIM_SLACK):
                rows = conn.execute(f"SELECT COUNT(*) FROM {table} WHERE model = ?",  # nosec B608: table is "feedback" or "examples"
                                    (model,)).fetchone()[0]
                if rows > cap:
                    conn.execute(f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM "  # nosec B608: table is "feedback" or "examples"
                                 f"{table} WHERE model = ? ORDER BY at, rowid LIMIT ?)",
                                 (model, rows - cap))
                    log.info("%s: %d oldest %s rows trimmed (feedback.%s: %d)", model,
                             rows - cap, table, "max_rows" if table == "feedback"
                             else "max_example_rows", cap)
                    rows = cap
            self._rows[key] = rows

    # -- erasure (executor threads): secure_delete, then the WAL checkpointed and cut --------
    def _erase_request(self, request_id: str, done: Erasure, timeout: float) -> None:
        self._erasing(timeout, lambda conn: _erase_rows(conn, request_id, done))

    def _purge(self, model: str, done: Erasure, timeout: float) -> None:
        def run(conn: sqlite3.Connection) -> None:
            if done.wants_texts:
                texts = done.texts(model)
                _batch_texts(conn, texts, "model = ?", (model,))
                for table in ("feedback", "examples"):
                    texts.update(r[0] for r in conn.execute(
                        f"SELECT text FROM {table} WHERE model = ?", (model,)))  # nosec B608: table is "feedback" or "examples"
            n = conn.execute("SELECT COALESCE(SUM(n), 0) FROM batches WHERE model = ?",
                             (model,)).fetchone()[0]
            _delete_batches(conn, [r[0] for r in conn.execute(
                "SELECT id FROM batches WHERE model = ?", (model,))])
            done.count(n, conn.execute("DELETE FROM feedback WHERE model = ?", (model,)).rowcount,
                       conn.execute("DELETE FROM examples WHERE model = ?", (model,)).rowcount)
        self._erasing(timeout, run)

    def _expire(self, cut: Callable[[str], float], done: Erasure) -> None:
        def run(conn: sqlite3.Connection) -> None:
            models = {r[0] for r in conn.execute(
                "SELECT DISTINCT model FROM batches UNION SELECT DISTINCT model FROM feedback "
                "UNION SELECT DISTINCT model FROM examples")}
            for model in sorted(models):
                t = cut(model)
                if not t:
                    continue
                old = conn.execute("SELECT id, n FROM batches WHERE model = ? AND at < ?",
                                   (model, t)).fetchall()
                if done.wants_texts:
                    texts = done.texts(model)
                    _batch_texts(conn, texts, "model = ? AND at < ?", (model, t))
                    for table in ("feedback", "examples"):
                        texts.update(r[0] for r in conn.execute(
                            f"SELECT text FROM {table} WHERE model = ? AND at < ?",  # nosec B608: table is "feedback" or "examples"
                            (model, t)))
                _delete_batches(conn, [r[0] for r in old])
                done.count(sum(r[1] for r in old),
                           conn.execute("DELETE FROM feedback WHERE model = ? AND at < ?",
                                        (model, t)).rowcount,
                           conn.execute("DELETE FROM examples WHERE model = ? AND at < ?",
                                        (model, t)).rowcount)
        self._erasing(60.0, run)

    def _erasing(self, timeout: float, body: Callable[[sqlite3.Connection], None]) -> None:
        conn = connect(self.path, any_thread=True)
        try:
            conn.execute("PRAGMA secure_delete=ON")
            with transaction(conn):
                body(conn)
            # the old pages' images left the WAL: copied back, then the file cut
            deadline = time.monotonic() + timeout
            while conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] and \
                    time.monotonic() < deadline:
                time.sleep(0.05)  # a reader's snapshot holds the WAL a moment
        finally:
            conn.close()

    # -- reads (executor threads) ------------------------------------------------------------
    def _batches(self, sql: str, args: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any, list[Any]]]:
        """(model, version, entries) of the batches a query selects (model,
        version, data), decoded one at a time (a caller may stop early)."""
        cur = self._conns.get().execute(sql, args)
        try:
            for model, version, data in cur:
                yield model, version, msgpack.unpackb(data, raw=False)
        finally:
            cur.close()

    def get(self, request_id: str, index: int | None = None) -> list[dict[str, Any]]:
        """The answer first logged under this id (a client that sends its id
        again is answered and logged, but never replaces that answer)."""
        sql = ("SELECT b.id FROM rids r JOIN batches b ON b.id = r.batch "
               "WHERE r.request_id = ?")
        args: tuple[Any, ...] = (request_id,)
        ms = id_ms(request_id)
        if ms is not None:  # a service-made id: by its time too (it has no rids row)
            now_ms = int(time.time() * 1000)
            t = (now_ms - (now_ms - ms) % ID_MOD) / 1000.0
            sql += (" UNION SELECT id FROM batches WHERE at_first BETWEEN ? AND ? "
                    "AND at >= ?")
            args += (t - MAX_SPAN_S - 1.0, t + ID_WINDOW_MS / 1000 + 1.0, t - 1.0)
        # the texts of the first logged request with this id (batches in the
        # order they were written; the first entry of this id is its answer)
        # sql is this function's constant text; the values go in as ? args
        for model, version, ents in self._batches(
                f"SELECT model, version, data FROM batches WHERE id IN ({sql}) ORDER BY id",  # nosec B608
                args):
            found: dict[int, dict[str, Any]] = {}
            for e in ents:
                if e[1] != request_id:
                    continue
                texts, preds = _unpack(e)
                for i, (text, p) in enumerate(zip(texts, preds)):
                    if index is None or e[2] + i == index:
                        found[e[2] + i] = _pred(model, version, e, text, p, i)
                if found or index is not None:
                    break
            if found or any(e[1] == request_id for e in ents):
                return [found[i] for i in sorted(found)]
        return []

    def _model_batches(self, model: str, version: Any, order: str
                       ) -> Iterator[tuple[str, Any, list[Any]]]:
        if version is None:
            return self._batches("SELECT model, version, data FROM batches WHERE model = ? "
                                 f"ORDER BY id{order}", (model,))  # nosec B608: order is "" or " DESC"
        return self._batches("SELECT model, version, data FROM batches WHERE model = ? AND "
                             f"version = ? ORDER BY id{order}", (model, int(version)))  # nosec B608

    def recent(self, model: str, version: Any = None, limit: int = 1000) -> list[dict[str, Any]]:
        """The newest `limit` predictions, newest first."""
        out: list[dict[str, Any]] = []
        if limit <= 0:
            return out
        for m, v, ents in self._model_batches(model, version, " DESC"):
            for e in reversed(ents):
                texts, preds = _unpack(e)
                for i in range(len(texts) - 1, -1, -1):
                    out.append(_pred(m, v, e, texts[i], preds[i], i))
                    if len(out) >= limit:
                        return out
        return out

    def _fed(self, model: str, version: Any) -> list[tuple[Any, ...]]:
        sql = ("SELECT request_id, idx, version, text, predicted, label, new_label, at "
               "FROM feedback WHERE model = ?")
        if version is None:
            return [tuple(r) for r in self._read(sql + " ORDER BY at", (model,))]
        return [tuple(r) for r in self._read(sql + " AND version = ? ORDER BY at",
                                             (model, int(version)))]

    def _predicted(self, model: str, version: Any, rids: set[str]
                   ) -> dict[tuple[str, int], tuple[Any, dict[str, float]]]:
        # the predictions fed back: one pass over the batches they can be in
        found: dict[tuple[str, int], tuple[float, dict[str, Any]]] = {}
        for _, _, ents in self._model_batches(model, version, ""):
            for e in ents:
                if e[1] in rids:
                    for i, p in enumerate(_unpack(e)[1]):
                        found[(e[1], e[2] + i)] = (e[0], p)
        return {k: (at, {t["label"]: t["score"] for t in p.get("top") or ()})
                for k, (at, p) in found.items()}

    def _count_rows(self, model: str
                    ) -> tuple[Iterable[tuple[Any, int]], Iterable[tuple[Any, int]]]:
        return ([(r[0], r[1]) for r in self._read(
                    "SELECT version, SUM(n) FROM batches WHERE model = ? GROUP BY version",
                    (model,))],
                [(r[0], r[1]) for r in self._read(
                    "SELECT version, COUNT(*) FROM feedback WHERE model = ? GROUP BY version",
                    (model,))])

    def feedback_count(self, model: str, since: float | None = None) -> int:
        """Labels (feedback and free examples) received after `since`."""
        t = 0.0 if since is None else since
        a = self._read("SELECT COUNT(*) FROM feedback WHERE model = ? AND at > ?", (model, t))
        b = self._read("SELECT COUNT(*) FROM examples WHERE model = ? AND at > ?", (model, t))
        return int(a[0][0]) + int(b[0][0])

    def _labels_after(self, model: str, t: float) -> Iterable[tuple[str, str]]:
        return [(r[0], r[1]) for r in self._read(
            "SELECT text, label, at FROM feedback WHERE model = ? AND at > ? UNION ALL "
            "SELECT text, label, at FROM examples WHERE model = ? AND at > ? ORDER BY at",
            (model, t, model, t))]

    def _review_marks(self, model: str
                      ) -> tuple[Iterable[tuple[str, int, str]], Iterable[str]]:
        return ([(r[0], r[1], r[2]) for r in self._read(
                    "SELECT request_id, idx, text FROM feedback WHERE model = ?", (model,))],
                [r[0] for r in self._read("SELECT text FROM examples WHERE model = ?",
                                          (model,))])

    def _review_candidates(self, model: str, fed: set[tuple[str, int]], done: set[str]
                           ) -> tuple[Sequence[float], Callable[[int], str],
                                      Callable[[int], dict[str, Any]]]:
        # One pass over the model's batches, newest first, keeping only numbers
        # (a margin, and where the text is): no container per text outlives
        # its step, so a log of 100,000 texts costs the collector nothing.
        margins = array.array("d")
        where = array.array("q")  # batch << 40 | entry << 20 | text index
        datas: list[tuple[Any, bytes]] = []  # (version, data) of each batch read
        cur = self._conns.get().execute("SELECT version, data FROM batches WHERE model = ? "
                                        "ORDER BY id DESC", (model,))
        for bi, (v, data) in enumerate(cur):
            datas.append((v, data))
            ents = msgpack.unpackb(data, raw=False)
            for ei in range(len(ents) - 1, -1, -1):
                e = ents[ei]
                rid, first = e[1], e[2]
                texts, preds = _unpack(e)
                for i in range(len(texts) - 1, -1, -1):
                    if texts[i] in done or (rid, first + i) in fed:
                        continue
                    margins.append(top_margin(preds[i].get("top") or []))
                    where.append(bi << 40 | ei << 20 | i)
        decoded: dict[int, list[Any]] = {}
        last: list[Any] = [-1, None, None, None]  # k, entry, texts, predictions

        def at(k: int) -> list[Any]:
            if last[0] != k:
                w = where[k]
                bi, ei = w >> 40, (w >> 20) & 0xFFFFF
                if bi not in decoded:
                    decoded[bi] = msgpack.unpackb(datas[bi][1], raw=False)
                e = decoded[bi][ei]
                last[:] = [k, e, *_unpack(e)]
            return last

        def row(k: int) -> dict[str, Any]:
            _, e, texts, preds = at(k)
            i = where[k] & 0xFFFFF
            return _pred(model, datas[where[k] >> 40][0], e, texts[i], preds[i], i)
        return margins, lambda k: at(k)[2][where[k] & 0xFFFFF], row

    def labels_seen(self, model: str) -> set[str]:
        """Every label fed back for the model (feedback and examples)."""
        rows = self._read("SELECT DISTINCT label FROM feedback WHERE model = ? UNION "
                          "SELECT DISTINCT label FROM examples WHERE model = ?", (model, model))
        return {r[0] for r in rows}
