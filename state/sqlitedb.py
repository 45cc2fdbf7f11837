"""SQLite connections as the service's databases use them: the state DB
(state/statedb.py) and the prediction log (state/predlog.py).

Every connection: autocommit mode (transactions are explicit, ``BEGIN
IMMEDIATE``: see `transaction`), the WAL journal, ``synchronous=NORMAL``,
rows as `sqlite3.Row`. `ThreadConnections` keeps one connection per thread
(a writer thread's own, or an executor thread's for reads). Imports nothing
above state/.
"""
from __future__ import annotations

import contextlib
import sqlite3
import threading
from typing import Iterator


def connect(path: str, *, any_thread: bool = False) -> sqlite3.Connection:
    """A connection to `path` (any_thread: usable from a thread other than its
    maker's, as a connection closed by another thread at a stop must be)."""
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None,
                           check_same_thread=not any_thread)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.row_factory = sqlite3.Row
    return conn


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE, then COMMIT; on any error ROLLBACK (unless SQLite rolled
    back itself, as on a full disk) and the error raised."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


class ThreadConnections:
    """One connection to a database per thread, opened on first use."""

    def __init__(self, path: str, *, any_thread: bool = False) -> None:
        self.path = path
        self.any_thread = any_thread
        self._local = threading.local()

    def get(self) -> sqlite3.Connection:
        """The calling thread's connection."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = connect(self.path, any_thread=self.any_thread)
        return conn

    def close_mine(self) -> None:
        """Close the calling thread's connection, if it has one."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
