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

Threading: writes (add, add_feedback, add_examples, trimming) run on ONE
writer thread with its own connection, in call order; `add` only puts the
rows on a queue, so the IOLoop never waits on disk. Read methods open a
connection per thread (thread-local), so they are safe from executor threads;
they must not run on the IOLoop. Storage: SQLite, WAL, ``synchronous=NORMAL``
(``<models_dir>/.predictions.db``): a clean stop commits everything queued;
a kill -9 may lose the predictions of the last few tens of milliseconds, never
an answered feedback (its future resolves after the commit). Texts are
stored: ``predictions.log: false`` turns the log off. Imports no TensorFlow.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from typing import Any, Iterable

from state.statedb import as_oserror

log = logging.getLogger("textswap.predlog")

FILENAME = ".predictions.db"
SCHEMA_VERSION = 1
_BATCH_WAIT_S = 0.05  # the writer gathers rows this long between transactions
_TRIM_EVERY = 2000    # rows inserted for a model between two trims

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS predictions (
           id INTEGER PRIMARY KEY AUTOINCREMENT,
           at REAL NOT NULL,
           request_id TEXT NOT NULL,
           idx INTEGER NOT NULL,
           model TEXT NOT NULL,
           version INTEGER,
           text TEXT NOT NULL,
           label TEXT,
           scores TEXT,           -- JSON {label: score}, best first
           margin REAL            -- top score minus the second (uncertainty)
       )""",
    "CREATE INDEX IF NOT EXISTS predictions_rid ON predictions (request_id, idx)",
    "CREATE INDEX IF NOT EXISTS predictions_model ON predictions (model, id)",
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
    """CREATE TABLE IF NOT EXISTS examples (
           model TEXT NOT NULL,
           text TEXT NOT NULL,
           label TEXT NOT NULL,
           new_label INTEGER NOT NULL DEFAULT 0,
           at REAL NOT NULL,
           PRIMARY KEY (model, text)
       )""",
]


def _scores_map(scores: Any) -> dict[str, float]:
    if isinstance(scores, dict):
        return scores
    if isinstance(scores, list):
        return {s["label"]: s["score"] for s in scores}
    return {}


def _margin(scores: dict[str, float]) -> float:
    vals = sorted(scores.values(), reverse=True)
    if not vals:
        return 1.0
    if len(vals) == 1:  # only the top one was asked for: its distance to a tie
        return 2.0 * vals[0] - 1.0
    return vals[0] - vals[1]


class PredictionLog:
    """See the module docstring."""

    def __init__(self, path: str, *, enabled: bool = True, max_rows: int = 100_000) -> None:
        self.path = os.path.abspath(path)
        self.health: Any = None  # state/storage.py's Storage, set by the supervisor
        self.enabled = enabled
        self.max_rows = max_rows
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        conn = self._connect()
        try:
            current = conn.execute("PRAGMA user_version").fetchone()[0]
            if current > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} has schema version {current}; this code "
                                   f"knows up to {SCHEMA_VERSION}")
            for stmt in _SCHEMA:
                conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        finally:
            conn.close()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._local = threading.local()
        self._closed = False
        self._since_trim: dict[str, int] = {}
        self.dropped = 0   # rows not written (a write failed)
        self.logged = 0    # rows written
        self._thread = threading.Thread(target=self._run, name="predlog-writer", daemon=True)
        self._thread.start()

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

    def _read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        return self._reader().execute(sql, args).fetchall()

    # -- writes ---------------------------------------------------------------------------
    def add(self, rows: list[dict[str, Any]]) -> None:
        """Queue predictions for the writer thread (never blocks)."""
        if self.enabled and not self._closed and rows:
            self._q.put(("rows", rows, None))

    def add_answer(self, at: float, request_id: str, model: str, version: Any,
                   texts: list[str], predictions: list[dict[str, Any]]) -> None:
        """Queue a /predict answer whole (its rows are built on the writer thread:
        the request path pays one queue put)."""
        if self.enabled and not self._closed and texts:
            self._q.put(("answer", (at, request_id, model, version, texts, predictions), None))

    def _submit(self, kind: str, payload: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            fut.set_exception(RuntimeError("the prediction log is closed"))
        else:
            self._q.put((kind, payload, fut))
        return fut

    def add_feedback(self, request_id: str, index: int, label: str, *, model: str,
                     version: Any, text: str, predicted: str | None = None,
                     new_label: bool = False, at: float | None = None
                     ) -> concurrent.futures.Future:
        """Store (or replace) the truth of logged prediction (request_id, index);
        the future resolves once it is committed."""
        return self.add_feedback_many([(request_id, index, label, model, version, text,
                                        predicted, new_label)], at)

    def add_feedback_many(self, items: list[tuple], at: float | None = None
                          ) -> concurrent.futures.Future:
        """items: (request_id, index, label, model, version, text, predicted, new_label)."""
        when = time.time() if at is None else at
        return self._submit("feedback", [(*it[:7], int(bool(it[7])), when) for it in items])

    def add_examples(self, model: str, examples: Iterable[tuple[str, str]],
                     new_labels: Iterable[str] = (), at: float | None = None
                     ) -> concurrent.futures.Future:
        when = time.time() if at is None else at
        new = set(new_labels)
        return self._submit("examples", [(model, t, lab, int(lab in new), when)
                                         for t, lab in examples])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far is committed (not on the IOLoop)."""
        if not self._closed:
            self._submit("noop", None).result(timeout)

    def close(self) -> None:
        """Commit what is queued, then stop the writer thread."""
        if self._closed:
            return
        self._q.put(("stop", None, None))
        self._closed = True
        self._thread.join(30)
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _run(self) -> None:
        conn = self._connect()
        stop = False
        while not stop:
            item = self._q.get()
            batch = [item]
            if item[0] == "rows":  # gather more: fewer, bigger transactions
                time.sleep(_BATCH_WAIT_S)
            while True:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = any(b[0] == "stop" for b in batch)
            self._write(conn, batch)
        conn.close()

    def _write(self, conn: sqlite3.Connection, batch: list[tuple]) -> None:
        rows: list[tuple] = []
        models: dict[str, int] = {}
        dumps = json.dumps
        for kind, payload, _ in batch:
            if kind == "answer":
                at, rid, model, version, texts, preds = payload
                for i, (text, p) in enumerate(zip(texts, preds)):
                    top = p.get("top") or ()
                    scores = {t["label"]: t["score"] for t in top}
                    s1 = top[0]["score"] if top else 1.0
                    margin = s1 - top[1]["score"] if len(top) > 1 else 2.0 * s1 - 1.0
                    rows.append((at, rid, i, model, version, text,
                                 top[0]["label"] if top else p.get("label"),
                                 dumps(scores, ensure_ascii=False), margin))
                models[model] = models.get(model, 0) + len(texts)
            elif kind == "rows":
                for r in payload:
                    scores = _scores_map(r.get("scores"))
                    rows.append((r.get("at") or time.time(), r["request_id"], r.get("index", 0),
                                 r["model"], r.get("version"), r["text"], r.get("label"),
                                 json.dumps(scores, ensure_ascii=False), _margin(scores)))
                    models[r["model"]] = models.get(r["model"], 0) + 1
        futures = [f for _, _, f in batch if f is not None]
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if rows:
                    conn.executemany(
                        "INSERT INTO predictions (at, request_id, idx, model, version, text, "
                        "label, scores, margin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
                for kind, payload, _ in batch:
                    if kind == "feedback":
                        conn.executemany(
                            "INSERT OR REPLACE INTO feedback (request_id, idx, label, model, "
                            "version, text, predicted, new_label, at) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", payload)
                    elif kind == "examples":
                        conn.executemany(
                            "INSERT OR REPLACE INTO examples (model, text, label, new_label, at) "
                            "VALUES (?, ?, ?, ?, ?)", payload)
                for model, n in models.items():
                    self._since_trim[model] = self._since_trim.get(model, 0) + n
                    if self._since_trim[model] >= min(_TRIM_EVERY, self.max_rows):
                        self._since_trim[model] = 0
                        self._trim(conn, model)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # SQLite may have rolled back itself (disk full)
                    conn.execute("ROLLBACK")
                raise
            self.logged += len(rows)
            if self.health is not None:
                self.health.succeeded("the prediction log")
        except Exception as exc:  # a full disk: serving goes on, the rows are lost
            self.dropped += len(rows)
            log.error("prediction log write failed (%d rows lost): %s", len(rows), exc)
            if self.health is not None and isinstance(exc, (OSError, sqlite3.Error)):
                self.health.failed("the prediction log", self.path, as_oserror(exc))
            for f in futures:
                if not f.done():
                    f.set_exception(exc)
            return
        for f in futures:
            if not f.done():
                f.set_result(None)

    def _trim(self, conn: sqlite3.Connection, model: str) -> None:
        """Keep the newest max_rows predictions of a model."""
        row = conn.execute("SELECT id FROM predictions WHERE model = ? ORDER BY id DESC "
                           "LIMIT 1 OFFSET ?", (model, self.max_rows)).fetchone()
        if row is not None:
            conn.execute("DELETE FROM predictions WHERE model = ? AND id <= ?", (model, row[0]))

    # -- reads (executor threads) ------------------------------------------------------------
    @staticmethod
    def _pred(r: sqlite3.Row) -> dict[str, Any]:
        return {"at": r["at"], "request_id": r["request_id"], "index": r["idx"],
                "model": r["model"], "version": r["version"], "text": r["text"],
                "label": r["label"], "scores": json.loads(r["scores"] or "{}"),
                "margin": r["margin"]}

    def get(self, request_id: str, index: int | None = None) -> list[dict[str, Any]]:
        if index is None:
            rows = self._read("SELECT * FROM predictions WHERE request_id = ? ORDER BY idx",
                              (request_id,))
        else:
            rows = self._read("SELECT * FROM predictions WHERE request_id = ? AND idx = ?",
                              (request_id, index))
        return [self._pred(r) for r in rows]

    def recent(self, model: str, version: Any = None, limit: int = 1000) -> list[dict[str, Any]]:
        if version is None:
            rows = self._read("SELECT * FROM predictions WHERE model = ? ORDER BY id DESC "
                              "LIMIT ?", (model, limit))
        else:
            rows = self._read("SELECT * FROM predictions WHERE model = ? AND version = ? "
                              "ORDER BY id DESC LIMIT ?", (model, int(version), limit))
        return [self._pred(r) for r in rows]

    def fed_back(self, model: str, version: Any = None) -> list[dict[str, Any]]:
        """Feedback on logged predictions, with what was predicted. The prediction
        row may have been trimmed: then scores are {} and label the stored one."""
        sql = ("SELECT f.request_id, f.idx, f.version, f.text, f.predicted, f.label AS truth, "
               "f.at AS fed_at, f.new_label, p.scores, p.at FROM feedback f LEFT JOIN "
               "predictions p ON p.request_id = f.request_id AND p.idx = f.idx "
               "WHERE f.model = ?")
        args: tuple = (model,)
        if version is not None:
            sql += " AND f.version = ?"
            args = (model, int(version))
        out = []
        for r in self._read(sql + " ORDER BY f.at", args):
            out.append({"request_id": r["request_id"], "index": r["idx"],
                        "version": r["version"], "text": r["text"], "label": r["predicted"],
                        "truth": r["truth"], "new_label": bool(r["new_label"]),
                        "scores": json.loads(r["scores"] or "{}"), "at": r["at"],
                        "fed_at": r["fed_at"]})
        return out

    def counts(self, model: str) -> dict[Any, dict[str, int]]:
        out: dict[Any, dict[str, int]] = {}
        for r in self._read("SELECT version, COUNT(*) AS n FROM predictions WHERE model = ? "
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
        """Logged predictions with no feedback yet (one per text: the newest)."""
        order = "p.margin ASC, p.id DESC" if strategy == "uncertain" else "RANDOM()"
        rows = self._read(
            "SELECT p.* FROM predictions p LEFT JOIN feedback f ON f.request_id = p.request_id "
            "AND f.idx = p.idx WHERE p.model = ? AND f.request_id IS NULL "
            f"ORDER BY {order} LIMIT ?", (model, 4 * limit + 200))
        done = {r[0] for r in self._read(
            "SELECT text FROM feedback WHERE model = ? UNION SELECT text FROM examples "
            "WHERE model = ?", (model, model))}
        out: list[dict[str, Any]] = []
        for r in rows:
            if r["text"] in done:
                continue
            done.add(r["text"])  # a text asked many times is reviewed once
            out.append(self._pred(r))
            if len(out) >= limit:
                break
        return out

    def labels_seen(self, model: str) -> set[str]:
        """Every label fed back for the model (feedback and examples)."""
        rows = self._read("SELECT DISTINCT label FROM feedback WHERE model = ? UNION "
                          "SELECT DISTINCT label FROM examples WHERE model = ?", (model, model))
        return {r[0] for r in rows}
