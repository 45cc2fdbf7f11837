"""Jobs outlive the service: the state db (statedb.py) under a real service
that is stopped cleanly, killed with -9, and started again on the same store;
plus the db module itself (schema version, history, reader beside writer)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading

import pytest

from tests.helpers import ROOT, Service, wait_for

# above a 240 s wait for a slow job's first epoch, and the service's start
pytestmark = pytest.mark.timeout(600)

from state.statedb import FILENAME, SCHEMA_VERSION, StateDB

DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
# no standby worker: these tests train and restart, they never serve
CONFIG = """\
worker:
  standby: false
training:
  demo_on_empty_store: false
  max_concurrent: {concurrent}
  keep_jobs: {keep}
"""


def _rows(n: int) -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh)]


def _start(base, models: str, concurrent: int = 1, keep: int = 50) -> Service:
    cfg = base / f"config-{concurrent}-{keep}.yaml"
    cfg.write_text(CONFIG.format(concurrent=concurrent, keep=keep))
    return Service(models, args=["--config", str(cfg)])


def _job(svc: Service, job_id: str) -> dict:
    code, body = svc.mget(f"/train/{job_id}")
    assert code == 200, body
    return body["job"]


def _db_row(models: str, job_id: str) -> dict | None:
    """The job as committed to the db, read the way any reader would."""
    conn = sqlite3.connect(os.path.join(models, FILENAME))
    conn.row_factory = sqlite3.Row
    try:
        row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["epochs"] = conn.execute("SELECT count(*) FROM job_epochs WHERE job_id = ?",
                                     (job_id,)).fetchone()[0]
        return out
    finally:
        conn.close()


def test_jobs_survive_clean_restart_and_kill_9(tmp_path):
    models = str(tmp_path / "models")
    svc = _start(tmp_path, models)
    try:
        code, body = svc.mpost("/train", {"name": "reviews", "data": {"examples": _rows(300)},
                                          "params": {"architecture": "bow", "epochs": 3,
                                                     "refit": False}})
        assert code == 202, body
        done_id = body["job"]["id"]
        done = wait_for(lambda: _job(svc, done_id)["state"] in ("succeeded", "failed")
                        and _job(svc, done_id), 240, "the job to finish", interval=0.25)
        assert done["state"] == "succeeded", done
        # a cancelled job stays readable as cancelled
        later = svc.mpost("/train", {"name": "later", "data": {"examples": _rows(40)},
                                     "params": {"epochs": 1}})[1]["job"]
        code, body = svc.request_delete(f"/train/{later['id']}")
        assert code == 200 and body["job"]["state"] == "cancelled"
    finally:
        assert svc.stop() == 0

    # clean restart: both jobs listed, with their figures
    svc = _start(tmp_path, models)
    try:
        listed = {j["id"]: j for j in svc.mget("/train")[1]["jobs"]}
        assert listed[done_id]["state"] == "succeeded"
        assert listed[later["id"]]["state"] == "cancelled"
        again = _job(svc, done_id)
        assert again["result"] == {"name": "reviews", "version": 1}
        assert again["metrics"] == done["metrics"] and again["params"] == done["params"]
        assert again["history"] == done["history"] and len(again["history"]) >= 1
        assert again["data"]["sha256"] == done["data"]["sha256"]

        # a long job, killed with the service mid-training
        code, body = svc.mpost("/train", {"name": "slow", "data": {"examples": _rows(2000)},
                                          "params": {"architecture": "bow", "epochs": 200,
                                                     "early_stopping_patience": 100}})
        assert code == 202, body
        slow_id = body["job"]["id"]
        # the db has its first epoch (the writer thread committed it)
        wait_for(lambda: (_db_row(models, slow_id) or {}).get("epochs", 0) >= 1, 240,
                 "an epoch of the slow job in the db", interval=0.25)
        job_dir = os.path.join(models, ".tmp", "jobs", slow_id)
        assert os.path.exists(os.path.join(job_dir, "train.log"))
    finally:
        svc.stop(signal.SIGKILL)
    assert _db_row(models, slow_id)["state"] == "running"  # what the dead process left

    svc = _start(tmp_path, models)
    try:
        slow = _job(svc, slow_id)
        assert slow["state"] == "interrupted", slow
        assert "service stopped" in slow["error"] and slow["finished_at"] is not None
        assert slow["log_tail"] and "training slow" in slow["log_tail"]
        assert len(slow["history"]) >= 1 and "loss" in slow["history"][0]
        assert not os.path.exists(job_dir)  # its data and log are cleaned
        tmp = os.path.join(models, ".tmp")
        assert not os.path.isdir(tmp) or not [e for e in os.listdir(tmp)
                                              if e.startswith("stage-")]
        assert not os.path.exists(os.path.join(models, "slow"))  # nothing half-published
        assert _job(svc, done_id)["state"] == "succeeded"  # survived the kill -9 too
        assert _db_row(models, slow_id)["state"] == "interrupted"
        # new ids do not collide with the kept ones
        code, body = svc.mpost("/train", {"name": "next", "data": {"examples": _rows(40)},
                                          "params": {"epochs": 1}})
        assert code == 202 and body["job"]["id"] not in (done_id, slow_id)
        assert svc.request_delete(f"/train/{body['job']['id']}")[0] == 200
    finally:
        assert svc.stop() == 0


def test_retention_keeps_the_newest_finished_jobs(tmp_path):
    models = str(tmp_path / "models")
    # max_concurrent 0: jobs queue and never train; cancelling finishes them
    svc = _start(tmp_path, models, concurrent=0, keep=3)
    try:
        ids = []
        for i in range(5):
            code, body = svc.mpost("/train", {"name": f"m{i}", "data": {"examples": _rows(20)}})
            assert code == 202, body
            ids.append(body["job"]["id"])
            assert svc.request_delete(f"/train/{ids[-1]}")[0] == 200
        listed = [j["id"] for j in svc.mget("/train")[1]["jobs"]]
        assert listed == ids[:1:-1]  # newest first, the oldest two dropped
        # no model yet (the first one would be training): an expected 503, not an ERROR
        assert svc.predict({"text": "hello"})[0] == 503
        assert svc.get("/readyz")[0] == 503
        wait_for(lambda: "503 POST /predict" in svc.log(), 10, "the 503 in the log")
        lines = [line for line in svc.log().splitlines() if " 503 " in line]
        assert lines and not [line for line in lines if " ERROR " in line], lines
        # a queued job is never dropped to make room
        code, body = svc.mpost("/train", {"name": "waiting", "data": {"examples": _rows(20)}})
        queued = body["job"]["id"]
        assert len(svc.mget("/train")[1]["jobs"]) == 4
    finally:
        assert svc.stop() == 0
    svc = _start(tmp_path, models, concurrent=0, keep=3)
    try:
        jobs = {j["id"]: j["state"] for j in svc.mget("/train")[1]["jobs"]}
        # the queued one was interrupted by the stop; three finished jobs kept
        assert jobs[queued] == "interrupted" and len(jobs) == 3
        assert set(jobs) == {queued, *ids[3:]}
        assert svc.mget(f"/train/{ids[0]}")[0] == 404
    finally:
        svc.stop()
    conn = sqlite3.connect(os.path.join(models, FILENAME))
    try:
        assert conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == 3
    finally:
        conn.close()


def test_statedb_history_schema_and_readers(tmp_path):
    path = str(tmp_path / "sub" / FILENAME)
    db = StateDB(path)
    try:
        first = db.add_history("news", "apply", source="api", from_version=1, to_version=2,
                               phases={"load": 0.2, "swap": 0.001}, details={"replicas": 2})
        db.add_history("demo", "crash", source="auto", reason="exit code -9")
        db.add_history("news", "rollback", source="api", from_version=2, to_version=1,
                       reason="bad accuracy")
        assert first.result(10) >= 1  # the future gives the new row's id
        db.flush(10)
        news = db.history("news")
        assert [h["kind"] for h in news] == ["rollback", "apply"]  # newest first
        assert news[1]["phases"] == {"load": 0.2, "swap": 0.001}
        assert news[1]["details"] == {"replicas": 2} and news[1]["from_version"] == 1
        assert [h["kind"] for h in db.history(limit=2)] == ["rollback", "crash"]
        assert db.history("nobody") == []

        # writes come from one thread while others read through their own connections
        errors: list[Exception] = []

        def reader() -> None:
            try:
                for _ in range(50):
                    db.jobs()
                    db.history(limit=5)
            except Exception as exc:  # pragma: no cover - the assertion reports it
                errors.append(exc)
        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for i in range(200):
            db.add_history("load", "apply", to_version=i)
        for t in threads:
            t.join(60)
        db.flush(30)
        assert not errors, errors
        assert len(db.history("load", limit=1000)) == 200
    finally:
        db.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    finally:
        conn.close()
    with pytest.raises(Exception, match="newer release"):
        StateDB(path)  # a db from a newer release is refused, not misread
