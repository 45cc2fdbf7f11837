"""The prediction log's writer process: state/predlog.py starts it and feeds it.

Why a process of its own: the log is written at the rate of the predictions
(thousands of rows a second), and a writer thread in the supervisor shared
its interpreter lock with the IOLoop. Each SQLite call hands that lock back
and forth, and the IOLoop waited for it on every hand-back: a third of the
single-text throughput went (docs/loop.md). Here the supervisor only puts
answers on a queue; its sender thread packs what gathered every ~50 ms with
msgpack and writes it to this process's stdin. Rows are built, inserted and
trimmed here, on another core (or in the idle moments of a busy one: the
process lowers its own CPU priority, see ``NICE``).

Protocol (msgpack objects, one after another, both ways):

    in:  [item, ...]      a batch; item is one of
         ["a", at, request_id, model, version, texts, predictions]   a /predict answer
         ["r", [row, ...]]                                           rows (PredictionLog.add)
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

import json
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
TRIM_SLACK = 0.05  # a model's rows may exceed max_rows by this share before a trim
_INSERT = ("INSERT INTO predictions (at, request_id, idx, model, version, text, label, "
           "scores, margin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")


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


_LABEL_JSON: dict[str, str] = {}  # a label as a JSON string, encoded once


def _scores_json(top: Any) -> str:
    """{label: score, ...} as JSON text, best first (what json.dumps gives, at a
    fraction of its cost: labels are few and encoded once)."""
    enc = _LABEL_JSON
    parts = []
    for t in top:
        label = t["label"]
        key = enc.get(label)
        if key is None:
            key = enc[label] = json.dumps(label, ensure_ascii=False)
        score = float(t["score"])
        parts.append(f"{key}: {score!r}" if abs(score) <= 1e308 else  # not inf, not NaN
                     f"{key}: {json.dumps(score)}")
    return "{" + ", ".join(parts) + "}"


def rows_of(items: list[list[Any]], counts: dict[str, int]) -> list[tuple]:
    """The predictions table's rows from a batch's items (counts: rows per model)."""
    rows: list[tuple] = []
    append = rows.append
    for item in items:
        kind = item[0]
        if kind == "a":
            _, at, rid, model, version, texts, preds = item
            for i, (text, p) in enumerate(zip(texts, preds)):
                top = p.get("top") or ()
                if top:
                    s1 = top[0]["score"]
                    margin = s1 - top[1]["score"] if len(top) > 1 else 2.0 * s1 - 1.0
                    append((at, rid, i, model, version, text, top[0]["label"],
                            _scores_json(top), margin))
                else:
                    append((at, rid, i, model, version, text, p.get("label"), "{}", 1.0))
            counts[model] = counts.get(model, 0) + len(texts)
        elif kind == "r":
            for r in item[1]:
                scores = _scores_map(r.get("scores"))
                append((r.get("at") or time.time(), r["request_id"], r.get("index", 0),
                        r["model"], r.get("version"), r["text"], r.get("label"),
                        json.dumps(scores, ensure_ascii=False), _margin(scores)))
                counts[r["model"]] = counts.get(r["model"], 0) + 1
    return rows


class Writer:
    def __init__(self, path: str, max_rows: int) -> None:
        self.path, self.max_rows = path, max_rows
        self.conn = sqlite3.connect(path, timeout=10.0, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.rows: dict[str, int] = {}  # rows per model, as counted and kept since
        self.logged = self.dropped = 0
        self.error: list[Any] | None = None

    def write(self, items: list[list[Any]]) -> bool:
        """One transaction for the batch (when it fails, its rows are lost and
        counted). Returns whether the error state changed."""
        counts: dict[str, int] = {}
        before = self.error
        try:
            rows = rows_of(items, counts)
        except Exception as exc:  # pragma: no cover - the supervisor sends what it built
            print(f"prediction log: malformed batch skipped: {exc!r}", file=sys.stderr,
                  flush=True)
            return False
        if not rows:
            return False
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(_INSERT, rows)
                for model, n in counts.items():
                    self._trim(model, n)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # SQLite may have rolled back itself (disk full)
                    conn.execute("ROLLBACK")
                raise
        except Exception as exc:  # a full disk: serving goes on, these rows are lost
            self.rows.clear()  # rolled back: count again at the next write
            self.dropped += len(rows)
            err = as_oserror(exc)
            self.error = [err.errno, str(err)]
            print(f"prediction log write failed ({len(rows)} rows lost): {exc}",
                  file=sys.stderr, flush=True)
            return before is None
        self.logged += len(rows)
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
        """Keep the newest max_rows predictions of a model (up to TRIM_SLACK more
        between two trims): the model's row count is kept here (counted once),
        and a trim deletes the oldest rows through the (model, id) index."""
        count = self.rows.get(model)
        if count is None:
            count = self.conn.execute("SELECT COUNT(*) FROM predictions WHERE model = ?",
                                      (model,)).fetchone()[0]
        else:
            count += added
        if count > self.max_rows + int(self.max_rows * TRIM_SLACK):
            self.conn.execute("DELETE FROM predictions WHERE id IN (SELECT id FROM predictions "
                              "WHERE model = ? ORDER BY id LIMIT ?)",
                              (model, count - self.max_rows))
            count = self.max_rows
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
    eof = False
    while not eof:
        try:
            ready = select.select([fd_in], [], [], 1.0)[0]
        except InterruptedError:
            ready = []
        if not ready:
            if stopping or os.getppid() != parent:  # asked to stop, or orphaned
                break
            if writer.probe():
                last_report = time.monotonic()
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
        if acks or changed or now - last_report >= 1.0:
            last_report = now
            if not report(out, writer, acks):
                break  # the supervisor is gone: what was read is committed
        if stopping:
            break
    writer.conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
