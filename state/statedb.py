"""The service's own state on disk: training jobs and the rollout history.

One SQLite database per model store, ``<models_dir>/.state.db`` (stdlib
``sqlite3``, WAL journal), so that what the service did outlives the process:
finished jobs and their per-epoch figures are listed again after a restart,
and every apply, rollback, unload, crash... is kept in ``history``.

Threading (why it looks like this): the supervisor's IOLoop must never wait
on disk, so every write is handed to ONE background thread (a single-thread
executor, which also keeps SQLite's single-writer rule without lock
contention) and the caller gets a ``concurrent.futures.Future`` it may ignore
or wait on. Writes happen in call order. Reads open their own connection per
call (WAL lets readers run beside the writer); they see what the writer has
committed, so a caller that needs its own write first waits on ``flush()``.

Durability: WAL with ``synchronous=NORMAL``: a committed write survives the
process being killed (kill -9); only a power cut may lose the last ones.
Imports no TensorFlow.
"""
from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import os
import sqlite3
import time
from typing import Any, Callable, Mapping

from state.keys import ACTOR
from state.sqlitedb import ThreadConnections, connect, transaction
from state.storage import Health

log = logging.getLogger("textswap.statedb")

FILENAME = ".state.db"
SCHEMA_VERSION = 1

# user_version -> the statements that bring the schema from the previous one
_MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE jobs (
               id TEXT PRIMARY KEY,
               name TEXT NOT NULL,
               state TEXT NOT NULL,
               apply INTEGER NOT NULL DEFAULT 0,
               params TEXT,            -- JSON: the validated training parameters
               data TEXT,              -- JSON: source, examples, label counts, sha256
               created_at REAL NOT NULL,
               started_at REAL,
               finished_at REAL,
               progress TEXT,          -- JSON: the last progress frame's figures
               result_version INTEGER, -- the published version, once succeeded
               metrics TEXT,           -- JSON
               error TEXT,
               exitcode INTEGER,
               log_tail TEXT,
               applied TEXT            -- JSON: the apply's answer (apply: true)
           )""",
        "CREATE INDEX jobs_created ON jobs (created_at)",
        """CREATE TABLE job_epochs (
               job_id TEXT NOT NULL,
               idx INTEGER NOT NULL,   -- epoch or search-candidate index, in arrival order
               figures TEXT NOT NULL,  -- JSON: loss, val_loss, val_accuracy...
               PRIMARY KEY (job_id, idx)
           )""",
        """CREATE TABLE history (
               id INTEGER PRIMARY KEY AUTOINCREMENT,
               at REAL NOT NULL,
               name TEXT,
               kind TEXT NOT NULL,     -- apply, rollback, promote, abort, gate_refused,
                                       -- unload, crash, restart...
               source TEXT,            -- api, watcher, train, auto, startup...
               from_version INTEGER,
               to_version INTEGER,
               phases TEXT,            -- JSON: phase -> seconds
               reason TEXT,
               details TEXT            -- JSON
           )""",
        "CREATE INDEX history_name ON history (name, id)",
    ],
}

JOB_COLUMNS = ("id", "name", "state", "apply", "params", "data", "created_at", "started_at",
               "finished_at", "progress", "result_version", "metrics", "error", "exitcode",
               "log_tail", "applied")
_JSON_COLUMNS = {"params", "data", "progress", "metrics", "applied"}


class StateDBError(Exception):
    pass


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, allow_nan=False,
                                                 default=str)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class StateDB:
    """The state database of one model store; see the module docstring."""

    def __init__(self, path: str, health: Health | None = None) -> None:
        """health: where write outcomes go (state/storage.py's Storage)."""
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._conns = ThreadConnections(self.path)  # the writer thread's
        self._closed = False
        self.health = health
        # schema first, synchronously: a start that cannot open its state fails loudly
        conn = self._connect()
        try:
            self._migrate(conn)
        finally:
            conn.close()
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="statedb-writer")

    # -- connections -------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        return connect(self.path)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        if current > SCHEMA_VERSION:
            raise StateDBError(f"{self.path} has schema version {current}; this code knows "
                               f"up to {SCHEMA_VERSION} (a newer release wrote it)")
        for version in range(current + 1, SCHEMA_VERSION + 1):
            with transaction(conn):
                for statement in _MIGRATIONS[version]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {version}")
            log.info("state db %s: schema version %d", self.path, version)

    # -- writes (one background thread) ---------------------------------------------------
    def submit(self, fn: Callable[[sqlite3.Connection], Any]) -> concurrent.futures.Future[Any]:
        """Run fn(conn) in one transaction on the writer thread; errors are logged."""
        if self._closed:
            raise StateDBError("the state db is closed")

        def run() -> Any:
            with transaction(self._conns.get()) as conn:
                return fn(conn)

        future = self._writer.submit(run)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: concurrent.futures.Future[Any]) -> None:
        """Every write's outcome: failures logged and, with `health` set
        (state/storage.py's Storage), shown as the storage health."""
        exc = future.exception()
        if exc is not None:  # e.g. a full disk: the service serves on
            log.error("state db write failed: %s: %s", type(exc).__name__, exc)
        if self.health is None:
            return
        if exc is None:
            self.health.succeeded("the state db")
        elif isinstance(exc, (OSError, sqlite3.Error)):
            self.health.failed("the state db", self.path, as_oserror(exc))

    def save_job(self, record: Mapping[str, object]) -> concurrent.futures.Future[Any]:
        """Insert or replace a job's row (keys: JOB_COLUMNS; others ignored)."""
        row = tuple(_dumps(record.get(c)) if c in _JSON_COLUMNS else record.get(c)
                    for c in JOB_COLUMNS)
        sql = (f"INSERT OR REPLACE INTO jobs ({', '.join(JOB_COLUMNS)}) "
               f"VALUES ({', '.join('?' * len(JOB_COLUMNS))})")
        return self.submit(lambda conn: conn.execute(sql, row))

    def add_epoch(self, job_id: str, idx: int, figures: dict[str, Any]
                  ) -> concurrent.futures.Future[Any]:
        text = _dumps(figures)
        return self.submit(lambda conn: conn.execute(
            "INSERT OR REPLACE INTO job_epochs (job_id, idx, figures) VALUES (?, ?, ?)",
            (job_id, idx, text)))

    def delete_jobs(self, job_ids: list[str]) -> concurrent.futures.Future[Any]:
        ids = [(i,) for i in job_ids]

        def run(conn: sqlite3.Connection) -> None:
            conn.executemany("DELETE FROM job_epochs WHERE job_id = ?", ids)
            conn.executemany("DELETE FROM jobs WHERE id = ?", ids)
        return self.submit(run)

    def add_history(self, name: str | None, kind: str, *, source: str | None = None,
                    from_version: int | None = None, to_version: int | None = None,
                    phases: dict[str, Any] | None = None, reason: str | None = None,
                    details: dict[str, Any] | None = None, at: float | None = None
                    ) -> concurrent.futures.Future[Any]:
        """Append one rollout event; the future's result is its id. An entry
        an API call made (source "api") names the key that made the call
        (details.key; state/keys.py ACTOR), when the call came with one."""
        actor = ACTOR.get()
        if source == "api" and actor is not None:
            details = {**(details or {}), "key": actor}
        row = (time.time() if at is None else at, name, kind, source, from_version, to_version,
               _dumps(phases), reason, _dumps(details))
        return self.submit(lambda conn: conn.execute(
            "INSERT INTO history (at, name, kind, source, from_version, to_version, phases, "
            "reason, details) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row).lastrowid)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every write handed over so far is committed (not for the IOLoop)."""
        if not self._closed:
            self._writer.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Commit what is pending, then stop the writer thread."""
        if self._closed:
            return
        self._closed = True

        self._writer.submit(self._conns.close_mine)
        self._writer.shutdown(wait=True)

    # -- reads (a connection of their own) -------------------------------------------------
    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        conn = self._connect()
        try:
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()

    def jobs(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Job rows, oldest first (the newest `limit` when given)."""
        sql = "SELECT * FROM jobs ORDER BY created_at DESC, rowid DESC"
        rows = self._read(sql + (" LIMIT ?" if limit is not None else ""),
                          (limit,) if limit is not None else ())
        return [self._job_dict(r) for r in reversed(rows)]

    def job(self, job_id: str) -> dict[str, Any] | None:
        rows = self._read("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return self._job_dict(rows[0]) if rows else None

    def epochs(self, job_id: str) -> list[dict[str, Any]]:
        rows = self._read("SELECT figures FROM job_epochs WHERE job_id = ? ORDER BY idx",
                          (job_id,))
        return [json.loads(r["figures"]) for r in rows]

    def all_epochs(self) -> dict[str, list[dict[str, Any]]]:
        """Every job's epochs in one query (start-up reload), by job id."""
        out: dict[str, list[dict[str, Any]]] = {}
        for r in self._read("SELECT job_id, figures FROM job_epochs ORDER BY job_id, idx"):
            out.setdefault(r["job_id"], []).append(json.loads(r["figures"]))
        return out

    def history(self, name: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The newest `limit` events (of one model when name is given), newest first."""
        where, args = ("WHERE name = ? ", (name,)) if name is not None else ("", ())
        # where is one of two constant texts; the name goes in as a ? arg
        rows = self._read(f"SELECT * FROM history {where}ORDER BY id DESC LIMIT ?",  # nosec B608
                          (*args, limit))
        out = []
        for r in rows:
            d = dict(r)
            d["phases"], d["details"] = _loads(d["phases"]), _loads(d["details"])
            out.append(d)
        return out

    @staticmethod
    def _job_dict(row: sqlite3.Row) -> dict[str, Any]:
        d = dict(row)
        for c in _JSON_COLUMNS:
            d[c] = _loads(d[c])
        d["apply"] = bool(d["apply"])
        return d


def as_oserror(exc: BaseException) -> OSError:
    """SQLite's disk errors as the OSError they stand for (SQLITE_FULL is a
    full disk, SQLITE_IOERR an I/O error), so they map to 507/503 alike."""
    if isinstance(exc, OSError):
        return exc
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    no = errno.ENOSPC if primary == 13 else errno.EIO
    return OSError(no, f"{os.strerror(no)} ({exc})")
