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
import random
import sqlite3
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Iterator

import msgpack

from state.predlog_writer import (ID_MOD, ID_WINDOW_MS, MAX_SPAN_S, TRIM_SLACK, id_ms, store,
                                  top_list)
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


def drain(q: queue.SimpleQueue[Any], first: Any) -> list[Any]:
    """`first` and whatever else is on the queue now (one batch)."""
    batch = [first]
    while True:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            return batch


def _margin(top: list[dict[str, Any]]) -> float:
    """The top score minus the second (only the top one kept: its distance to a
    tie; none: 1.0)."""
    if len(top) >= 2:
        return top[0]["score"] - top[1]["score"]
    if top:
        return 2.0 * top[0]["score"] - 1.0
    return 1.0


def _unpack(e: list[Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """A stored entry's texts and predictions (the top lists rebuilt when the
    entry holds score rows: see PredictionLog.add_scores)."""
    body = msgpack.unpackb(e[4], raw=False)
    if len(body) == 2:
        return body[0], body[1]
    texts, labels, rows, k = body
    return texts, [top_of(row, labels, k) for row in rows]


def top_of(row: list[float], labels: list[str], k: int) -> dict[str, Any]:
    """A prediction (its label and top k) from a score row (what /predict
    answered for it; used by the Redis log too)."""
    order = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:max(1, k)]
    top = [{"label": labels[i], "score": row[i]} for i in order]
    return {"label": top[0]["label"] if top else None, "top": top}


def _pred(model: str, version: Any, e: list[Any], text: str, p: dict[str, Any], i: int
          ) -> dict[str, Any]:
    """Text i of a stored entry as a prediction row."""
    top = p.get("top") or []
    return {"at": e[0], "request_id": e[1], "index": e[2] + i, "model": model,
            "version": version, "text": text,
            "label": top[0]["label"] if top else p.get("label"),
            "scores": {t["label"]: t["score"] for t in top}, "margin": _margin(top)}


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


class _Writer:
    """One writer process, and the flush markers it has been sent."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.acks: dict[int, concurrent.futures.Future[Any]] = {}
        self.logged = self.dropped = 0  # as the process last reported
        self.sent = 0  # texts written to its pipe
        self.error: Any = None
        self.reader: threading.Thread | None = None


class PredictionLog:
    """See the module docstring."""

    def __init__(self, path: str, *, enabled: bool = True, max_rows: int = 100_000,
                 feedback_rows: int = 100_000, example_rows: int = 100_000,
                 health: "Health | None" = None) -> None:
        self.path = os.path.abspath(path)
        self.health = health  # state/storage.py's Storage: write outcomes go there
        self.enabled = enabled
        self.max_rows = max_rows
        # per model, the feedback rows and free examples kept (the oldest go first)
        self.caps = {"feedback": feedback_rows, "examples": example_rows}
        self._rows: dict[tuple[str, str], int] = {}  # (table, model) -> rows, at least
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        conn = self._connect()
        try:
            current = conn.execute("PRAGMA user_version").fetchone()[0]
            if current > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} has schema version {current}; this code "
                                   f"knows up to {SCHEMA_VERSION}")
            conn.execute("BEGIN IMMEDIATE")
            try:
                for stmt in _SCHEMA:
                    conn.execute(stmt)
                if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                                "name = 'predictions'").fetchone():
                    _migrate_v1(conn)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            conn.close()
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()   # feedback, examples
        self._pq: queue.SimpleQueue[Any] = queue.SimpleQueue()  # predictions, to the writer
        self._local = threading.local()
        self._closed = False
        self._seq = itertools.count(1)
        self._writer: _Writer | None = None
        self._started_at = 0.0
        self._retired = [0, 0]  # logged, dropped by writer processes that ended
        self._lost = 0          # dropped here: queue full, writer down, unpackable
        self._queued = 0        # texts put on the queue and not yet sent to the writer
        self._thread = threading.Thread(target=self._run, name="predlog-feedback", daemon=True)
        self._thread.start()
        self._wake = threading.Event()  # cuts the sender's gathering wait short
        self._sender = threading.Thread(target=self._send_loop, name="predlog-sender",
                                        daemon=True)
        self._sender.start()

    @property
    def logged(self) -> int:
        """Prediction rows committed (by every writer process so far)."""
        w = self._writer
        return self._retired[0] + (w.logged if w else 0)

    @property
    def dropped(self) -> int:
        """Prediction rows not written: a failed write, the queue full, the writer down."""
        w = self._writer
        return self._retired[1] + self._lost + (w.dropped if w else 0)

    def stats(self) -> dict[str, int]:
        """For /status: texts logged (committed by the writer), dropped (never
        written: a failed write, the queue full, the writer down), and queued
        (waiting in this process for the sender)."""
        return {"logged": self.logged, "dropped": self.dropped, "queued": max(0, self._queued)}

    # -- connections --------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None,
                               check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.row_factory = sqlite3.Row
        return conn

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
        return conn

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return self._reader().execute(sql, args).fetchall()

    # -- predictions: queue, sender thread, writer process ---------------------------------
    def add(self, rows: list[dict[str, Any]]) -> None:
        """Queue predictions for the writer (never blocks)."""
        if self.enabled and not self._closed and rows:
            self._put(["r", rows], len(rows))

    def add_answer(self, at: float, request_id: str, model: str, version: Any,
                   texts: list[str], predictions: list[dict[str, Any]]) -> None:
        """Queue a /predict answer whole: the writer process stores its packed
        texts and predictions as they are."""
        if self.enabled and not self._closed and texts:
            self._put(None, len(texts), (at, request_id, model, version, texts, predictions))

    def add_scores(self, at: float, request_id: str, model: str, version: Any,
                   texts: list[str], labels: list[str], rows: list[list[float]], k: int
                   ) -> None:
        """Queue an answer as the model's score rows (one per text, a score per
        label) and the number of top labels it answered: stored as they are,
        and read back as top lists (cheaper to pack than the predictions)."""
        if self.enabled and not self._closed and texts:
            self._put(None, len(texts), (at, request_id, model, version, texts, labels, rows, k))

    def _put(self, item: list[Any] | None, texts: int, answer: tuple[Any, ...] | None = None) -> None:
        """The item (or answer) packed at once, as a one-item batch of the writer's
        protocol, and the bytes queued: ~4 us here, and no container outlives
        the request. (Queued as objects, the answers of the last ~0.5 s survived
        young collections and were promoted to the old generation, whose
        collections then traversed them: measurably more CPU a request in the
        supervisor.)"""
        if self._queued >= MAX_QUEUED:
            self._lost += texts
            return
        packer = getattr(self._local, "packer", None)
        if packer is None:  # a Packer is not thread-safe: one per thread (it is faster
            packer = self._local.packer = msgpack.Packer(use_bin_type=True)  # than packb)
        try:
            if answer is not None:
                at, rid, model, version, *body = answer  # [texts, predictions] or
                item = ["A", at, rid, model, version, texts,  # [texts, labels, rows, k]
                        packer.pack(body)]
            blob = packer.pack([item])
        except (TypeError, ValueError) as exc:  # a value msgpack cannot pack
            packer.reset()
            self._lost += texts
            log.error("prediction log: %d texts not packable, skipped: %r", texts, exc)
            return
        self._queued += texts
        self._pq.put(("b", blob, texts))

    def _send_loop(self) -> None:
        stop = False
        while not stop:
            item = self._pq.get()
            if item[0] == "b":  # gather more: fewer, bigger writes
                self._wake.wait(_BATCH_WAIT_S)
                self._wake.clear()
            batch = drain(self._pq, item)
            stop = any(b[0] == "stop" for b in batch)
            items = [b for b in batch if b[0] != "stop"]
            texts = sum(it[2] for it in items if it[0] == "b")
            self._queued -= texts  # (one sender thread: no lock; the count is a bound)
            if items:
                self._send(items, texts)
        self._end_writer()

    def _send(self, items: list[Any], texts: int) -> None:
        markers = [it for it in items if it[0] == "f"]
        w = self._writer
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
            self._lost += texts
            for it in markers:
                if not it[2].done():
                    it[2].set_exception(RuntimeError(f"the prediction log writer: {exc}"))

    def _live_writer(self) -> _Writer:
        w = self._writer
        if w is not None and w.proc.poll() is None:
            return w
        if w is not None:
            self._retire(w)
        wait = self._started_at + 1.0 - time.monotonic()
        if wait > 0:  # a writer that keeps dying is restarted once a second at most
            time.sleep(wait)
        self._started_at = time.monotonic()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.Popen([sys.executable, "-m", "state.predlog_writer", self.path,
                                 str(self.max_rows)], cwd=root,  # the package from the layout
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        w = self._writer = _Writer(proc)
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
        if self.health is not None:
            if err:
                self.health.failed("the prediction log", self.path, OSError(err[0], err[1]))
            else:
                self.health.succeeded("the prediction log")
        for seq in msg.get("acks") or ():
            fut = w.acks.pop(seq, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _retire(self, w: _Writer) -> None:
        if w.reader is not None:
            w.reader.join(30)
        self._retired[0] += w.logged
        # texts it was sent and never reported committed or dropped: in flight
        # when it died (its last reports come before its EOF, so a clean stop
        # leaves none)
        lost = w.sent - w.logged - w.dropped
        if lost > 0:
            log.error("prediction log: the writer ended (exit %s) with %d texts not "
                      "committed: dropped", w.proc.returncode, lost)
        self._retired[1] += w.dropped + max(0, lost)
        if self._writer is w:
            self._writer = None

    def _end_writer(self) -> None:
        """EOF to the writer: it commits what it has and ends."""
        w = self._writer
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

    # -- feedback and examples: a thread here, each future resolving on commit --------------
    def _submit(self, kind: str, payload: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._closed:
            fut.set_exception(RuntimeError("the prediction log is closed"))
        else:
            self._q.put((kind, payload, fut))
        return fut

    def add_feedback(self, request_id: str, index: int, label: str, *, model: str,
                     version: Any, text: str, predicted: str | None = None,
                     new_label: bool = False, at: float | None = None
                     ) -> concurrent.futures.Future[Any]:
        """Store (or replace) the truth of logged prediction (request_id, index);
        the future resolves once it is committed."""
        return self.add_feedback_many([(request_id, index, label, model, version, text,
                                        predicted, new_label)], at)

    def add_feedback_many(self, items: list[tuple[Any, ...]], at: float | None = None
                          ) -> concurrent.futures.Future[Any]:
        """items: (request_id, index, label, model, version, text, predicted, new_label)."""
        when = time.time() if at is None else at
        return self._submit("feedback", [(*it[:7], int(bool(it[7])), when) for it in items])

    def add_examples(self, model: str, examples: Iterable[tuple[str, str]],
                     new_labels: Iterable[str] = (), at: float | None = None
                     ) -> concurrent.futures.Future[Any]:
        when = time.time() if at is None else at
        new = set(new_labels)
        return self._submit("examples", [(model, t, lab, int(lab in new), when)
                                         for t, lab in examples])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far is committed: the predictions by the
        writer process, the feedback here (not on the IOLoop)."""
        if self._closed:
            return
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._pq.put(["f", next(self._seq), fut])
        self._wake.set()
        fut.result(timeout)
        self._submit("noop", None).result(timeout)

    def close(self) -> None:
        """Commit what is queued, then stop the writer process and the threads."""
        if self._closed:
            return
        self._closed = True
        self._pq.put(["stop"])
        self._wake.set()
        self._q.put(("stop", None, None))
        self._sender.join(60)
        self._thread.join(30)
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _run(self) -> None:
        conn = self._connect()
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
                conn.execute("BEGIN IMMEDIATE")
                try:
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
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:  # SQLite may have rolled back itself (disk full)
                        conn.execute("ROLLBACK")
                    raise
                if self.health is not None:
                    self.health.succeeded("the prediction log")
        except Exception as exc:  # a full disk: the feedback is refused (507/503)
            log.error("feedback write failed: %s", exc)
            if self.health is not None and isinstance(exc, (OSError, sqlite3.Error)):
                self.health.failed("the prediction log", self.path, as_oserror(exc))
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

    # -- erasure (executor threads) ---------------------------------------------------------
    def erase(self, request_id: str, timeout: float = 60.0,
              erased: dict[str, set[str]] | None = None) -> dict[str, int]:
        """Erase one request's texts everywhere the log holds them: its logged
        answers (every entry under this id, the queued ones too: flushed
        first), the feedback on them, and the free examples with those texts
        of the same model. Erased means unreadable: deleted with SQLite's
        secure_delete (the freed bytes are zeroed) and the WAL checkpointed and
        truncated. Returns what was removed; `erased` gets the texts."""
        rid = request_id.encode()
        return self._erase(timeout, lambda conn: self._erase_request(conn, request_id, rid,
                                                                     erased))

    def purge(self, model: str, timeout: float = 60.0,
              erased: dict[str, set[str]] | None = None) -> dict[str, int]:
        """Erase a model's whole log: its answers, feedback and free examples."""
        def run(conn: sqlite3.Connection) -> dict[str, int]:
            if erased is not None:
                texts = erased.setdefault(model, set())
                for (data,) in conn.execute("SELECT data FROM batches WHERE model = ?",
                                            (model,)):
                    for e in msgpack.unpackb(data, raw=False):
                        texts.update(_unpack(e)[0])
                for table in ("feedback", "examples"):
                    texts.update(r[0] for r in conn.execute(
                        f"SELECT text FROM {table} WHERE model = ?", (model,)))  # nosec B608: table is "feedback" or "examples"
            ids = [r[0] for r in conn.execute("SELECT id FROM batches WHERE model = ?",
                                              (model,))]
            n = conn.execute("SELECT COALESCE(SUM(n), 0) FROM batches WHERE model = ?",
                             (model,)).fetchone()[0]
            for i in range(0, len(ids), 500):
                part = ids[i:i + 500]
                marks = ",".join("?" * len(part))  # only ? marks go into the SQL (bandit B608)
                conn.execute(f"DELETE FROM rids WHERE batch IN ({marks})", part)  # nosec B608
                conn.execute(f"DELETE FROM batches WHERE id IN ({marks})", part)  # nosec B608
            fb = conn.execute("DELETE FROM feedback WHERE model = ?", (model,)).rowcount
            ex = conn.execute("DELETE FROM examples WHERE model = ?", (model,)).rowcount
            return {"predictions": int(n), "feedback": fb, "examples": ex}
        return self._erase(timeout, run)

    def expire(self, ages: dict[str, float], default: float = 0.0,
               now: float | None = None,
               erased: dict[str, set[str]] | None = None) -> dict[str, int]:
        """Erase what is older than its model's age limit (days; `ages` per
        model over `default`; 0: none): answers, feedback and free examples,
        as erase() erases. Returns what was removed."""
        now = time.time() if now is None else now

        def limit(model: str) -> float:
            days = ages.get(model, default)
            return now - float(days) * 86400.0 if days and days > 0 else 0.0

        def run(conn: sqlite3.Connection) -> dict[str, int]:
            removed = {"predictions": 0, "feedback": 0, "examples": 0}
            models = {r[0] for r in conn.execute(
                "SELECT DISTINCT model FROM batches UNION SELECT DISTINCT model FROM feedback "
                "UNION SELECT DISTINCT model FROM examples")}
            for model in sorted(models):
                cut = limit(model)
                if not cut:
                    continue
                old = conn.execute("SELECT id, n FROM batches WHERE model = ? AND at < ?",
                                   (model, cut)).fetchall()
                if erased is not None:
                    texts = erased.setdefault(model, set())
                    for (data,) in conn.execute("SELECT data FROM batches WHERE model = ? "
                                                "AND at < ?", (model, cut)):
                        for e in msgpack.unpackb(data, raw=False):
                            texts.update(_unpack(e)[0])
                    for table in ("feedback", "examples"):
                        texts.update(r[0] for r in conn.execute(
                            f"SELECT text FROM {table} WHERE model = ? AND at < ?",  # nosec B608: table is "feedback" or "examples"
                            (model, cut)))
                for i in range(0, len(old), 500):
                    part = [r[0] for r in old[i:i + 500]]
                    marks = ",".join("?" * len(part))  # only ? marks go into the SQL (bandit B608)
                    conn.execute(f"DELETE FROM rids WHERE batch IN ({marks})", part)  # nosec B608
                    conn.execute(f"DELETE FROM batches WHERE id IN ({marks})", part)  # nosec B608
                removed["predictions"] += sum(r[1] for r in old)
                removed["feedback"] += conn.execute(
                    "DELETE FROM feedback WHERE model = ? AND at < ?", (model, cut)).rowcount
                removed["examples"] += conn.execute(
                    "DELETE FROM examples WHERE model = ? AND at < ?", (model, cut)).rowcount
            return removed
        if not default and not any(v and v > 0 for v in ages.values()):
            return {"predictions": 0, "feedback": 0, "examples": 0}
        return self._erase(60.0, run, flush=False)

    def _erase(self, timeout: float, body: Any, flush: bool = True) -> dict[str, int]:
        if flush:
            self.flush(timeout)  # what is queued for the writer is in the file now
        conn = self._connect()
        try:
            conn.execute("PRAGMA secure_delete=ON")
            conn.execute("BEGIN IMMEDIATE")
            try:
                removed = body(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            # the old pages' images left the WAL: copied back, then the file cut
            deadline = time.monotonic() + timeout
            while conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] and \
                    time.monotonic() < deadline:
                time.sleep(0.05)  # a reader's snapshot holds the WAL a moment
        finally:
            conn.close()
        return removed

    @staticmethod
    def _erase_request(conn: sqlite3.Connection, request_id: str, rid: bytes,
                       erased: dict[str, set[str]] | None = None) -> dict[str, int]:
        texts: dict[str, set[str]] = {}  # model -> the texts erased
        n = 0
        # every batch whose bytes hold the id (then decoded: only exact matches go)
        for bid, model, data in conn.execute(
                "SELECT id, model, data FROM batches WHERE instr(data, ?) > 0",
                (rid,)).fetchall():
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
            if erased is not None:
                erased.setdefault(model, set()).update(gone)
        return {"predictions": n, "feedback": fb, "examples": ex}

    # -- reads (executor threads) ------------------------------------------------------------
    def _batches(self, sql: str, args: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any, list[Any]]]:
        """(model, version, entries) of the batches a query selects (model,
        version, data), decoded one at a time (a caller may stop early)."""
        cur = self._reader().execute(sql, args)
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
        return self._get(request_id, index, self._batches(
            # sql is this function's constant text; the values go in as ? args
            f"SELECT model, version, data FROM batches WHERE id IN ({sql}) ORDER BY id",  # nosec B608
            args))

    @staticmethod
    def _get(request_id: str, index: int | None, batches: Iterator[tuple[str, Any, list[Any]]]
             ) -> list[dict[str, Any]]:
        """The texts of the first logged request with this id (batches in the
        order they were written)."""
        for model, version, ents in batches:
            found: dict[int, dict[str, Any]] = {}
            for e in ents:
                if e[1] != request_id:
                    continue
                texts, preds = _unpack(e)
                for i, (t, p) in enumerate(zip(texts, preds)):
                    if index is None or e[2] + i == index:
                        found[e[2] + i] = _pred(model, version, e, t, p, i)
                if found or index is not None:
                    break  # the first entry of this id is its answer
            if found or any(e[1] == request_id for e in ents):
                return [found[i] for i in sorted(found)]
        return []

    def recent(self, model: str, version: Any = None, limit: int = 1000) -> list[dict[str, Any]]:
        """The newest `limit` predictions, newest first."""
        args: tuple[Any, ...]
        if version is None:
            sql, args = ("SELECT model, version, data FROM batches WHERE model = ? "
                         "ORDER BY id DESC", (model,))
        else:
            sql, args = ("SELECT model, version, data FROM batches WHERE model = ? AND "
                         "version = ? ORDER BY id DESC", (model, int(version)))
        out: list[dict[str, Any]] = []
        if limit <= 0:
            return out
        for m, v, ents in self._batches(sql, args):
            for e in reversed(ents):
                texts, preds = _unpack(e)
                for i in range(len(texts) - 1, -1, -1):
                    out.append(_pred(m, v, e, texts[i], preds[i], i))
                    if len(out) >= limit:
                        return out
        return out

    def fed_back(self, model: str, version: Any = None) -> list[dict[str, Any]]:
        """Feedback on logged predictions, with what was predicted. The prediction
        may have been trimmed: then scores are {} and label the stored one."""
        sql = ("SELECT request_id, idx, version, text, predicted, label AS truth, "
               "at AS fed_at, new_label FROM feedback WHERE model = ?")
        args: tuple[Any, ...] = (model,)
        bsql = "SELECT model, version, data FROM batches WHERE model = ?"
        if version is not None:
            sql += " AND version = ?"
            bsql += " AND version = ?"
            args = (model, int(version))
        rows = self._read(sql + " ORDER BY at", args)
        # the predictions fed back: one pass over the batches they can be in
        rids = {r["request_id"] for r in rows}
        found: dict[tuple[str, int], tuple[float, dict[str, Any]]] = {}
        for _, _, ents in self._batches(bsql + " ORDER BY id", args) if rows else ():
            for e in ents:
                if e[1] in rids:
                    for i, p in enumerate(_unpack(e)[1]):
                        found[(e[1], e[2] + i)] = (e[0], p)
        out = []
        for r in rows:
            at, p = found.get((r["request_id"], r["idx"]), (None, {}))
            out.append({"request_id": r["request_id"], "index": r["idx"],
                        "version": r["version"], "text": r["text"], "label": r["predicted"],
                        "truth": r["truth"], "new_label": bool(r["new_label"]),
                        "scores": {t["label"]: t["score"] for t in p.get("top") or ()},
                        "at": at, "fed_at": r["fed_at"]})
        return out

    def counts(self, model: str) -> dict[Any, dict[str, int]]:
        out: dict[Any, dict[str, int]] = {}
        for r in self._read("SELECT version, SUM(n) AS n FROM batches WHERE model = ? "
                            "GROUP BY version", (model,)):
            out.setdefault(r["version"], {"predictions": 0, "feedback": 0})["predictions"] = r["n"]
        for r in self._read("SELECT version, COUNT(*) AS n FROM feedback WHERE model = ? "
                            "GROUP BY version", (model,)):
            out.setdefault(r["version"], {"predictions": 0, "feedback": 0})["feedback"] = r["n"]
        return out

    def feedback_count(self, model: str, since: float | None = None) -> int:
        """Labels (feedback and free examples) received after `since`."""
        t = 0.0 if since is None else since
        a = self._read("SELECT COUNT(*) FROM feedback WHERE model = ? AND at > ?", (model, t))
        b = self._read("SELECT COUNT(*) FROM examples WHERE model = ? AND at > ?", (model, t))
        return int(a[0][0]) + int(b[0][0])

    def feedback_examples(self, model: str, since: float | None = None
                          ) -> list[tuple[str, str]]:
        """(text, label) of every label fed back for the model, oldest first; a text
        labelled more than once keeps its newest label."""
        t = -1.0 if since is None else since
        rows = self._read(
            "SELECT text, label, at FROM feedback WHERE model = ? AND at > ? UNION ALL "
            "SELECT text, label, at FROM examples WHERE model = ? AND at > ? ORDER BY at",
            (model, t, model, t))
        newest: dict[str, str] = {}
        for r in rows:
            newest.pop(r["text"], None)  # re-insert: dict order follows the newest
            newest[r["text"]] = r["label"]
        return list(newest.items())

    def review(self, model: str, limit: int = 50, strategy: str = "uncertain"
               ) -> list[dict[str, Any]]:
        """Logged predictions with no feedback yet (one per text: for "uncertain",
        its most uncertain prediction; the newest first among equal margins)."""
        fed = {(r[0], r[1]) for r in self._read(
            "SELECT request_id, idx FROM feedback WHERE model = ?", (model,))}
        done = {r[0] for r in self._read(
            "SELECT text FROM feedback WHERE model = ? UNION SELECT text FROM examples "
            "WHERE model = ?", (model, model))}
        # One pass over the model's batches, newest first, keeping only numbers
        # (a margin, and where the text is): no container per text outlives
        # its step, so a log of 100,000 texts costs the collector nothing.
        margins = array.array("d")
        where = array.array("q")  # batch << 40 | entry << 20 | text index
        datas: list[tuple[Any, bytes]] = []  # (version, data) of each batch read
        cur = self._reader().execute("SELECT version, data FROM batches WHERE model = ? "
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
                    margins.append(_margin(preds[i].get("top") or []))
                    where.append(bi << 40 | ei << 20 | i)
        order = list(range(len(margins)))
        if strategy == "uncertain":  # stable: among equal margins, the newest first
            order.sort(key=margins.__getitem__)
        else:
            random.shuffle(order)
        decoded: dict[int, list[Any]] = {}
        out: list[dict[str, Any]] = []
        for k in order:
            w = where[k]
            bi, ei, i = w >> 40, (w >> 20) & 0xFFFFF, w & 0xFFFFF
            if bi not in decoded:
                decoded[bi] = msgpack.unpackb(datas[bi][1], raw=False)
            e = decoded[bi][ei]
            texts, preds = _unpack(e)
            if texts[i] in done:
                continue
            done.add(texts[i])  # a text asked many times is reviewed once
            out.append(_pred(model, datas[bi][0], e, texts[i], preds[i], i))
            if len(out) >= limit:
                break
        return out

    def labels_seen(self, model: str) -> set[str]:
        """Every label fed back for the model (feedback and examples)."""
        rows = self._read("SELECT DISTINCT label FROM feedback WHERE model = ? UNION "
                          "SELECT DISTINCT label FROM examples WHERE model = ?", (model, model))
        return {r[0] for r in rows}
