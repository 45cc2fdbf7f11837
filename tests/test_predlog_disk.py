"""The prediction log's writer process on a failing disk, then a recovered
one, on the real service (docs/loop.md): the model store is a small tmpfs
that a filler file fills up (a real ENOSPC, no fault library: the writer is
a child process of its own).
Predictions are still answered, the texts of the failed write are counted
as dropped, /status `storage` names the prediction log; once the disk takes
writes again the writer's probe clears the error and logging resumes.

Needs root (mount), like tests/test_faults_disk.py."""
from __future__ import annotations

import os
import shutil
import uuid

import pytest

from tests.helpers import Service, fill_disk, request, small_disk, wait_for


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("plogdisk")
    with small_disk(str(base / "mnt"), "32m") as mnt:
        store = os.path.join(mnt, "models")
        shutil.copytree(tiny_store, store)
        cfg = base / "config.yaml"
        cfg.write_text("rollout:\n  probation_s: 0\nworker:\n  standby_pool: 0\n")
        s = Service(store, args=["--config", str(cfg)],
                    log_path=str(base / "service.log"))
        s.mnt = mnt
        try:
            code, body = s.mpost("/apply", {"name": "sent", "version": 1})
            assert code == 200, body
            yield s
        finally:
            s.stop()


def _flushed(s: Service) -> dict:
    """/status prediction_log once everything sent is committed (feedback for
    an unknown id flushes the log before its 404)."""
    code, body = request(s.port, "POST", "/feedback",
                         {"request_id": f"flush-{uuid.uuid4().hex[:8]}", "label": "pos"})
    assert code == 404 and body["error"]["code"] == "unknown_request_id", body
    return s.status()["prediction_log"]


def _plog_error(s: Service) -> dict | None:
    errors = s.status()["storage"]["errors"]
    return next((e for e in errors if e["what"] == "the prediction log"), None)


def test_a_full_disk_drops_and_counts_then_logging_resumes(svc):
    code, got = svc.predict({"texts": ["很好", "很差"]})
    assert code == 200, got
    before = _flushed(svc)
    assert _plog_error(svc) is None
    big = [f"满盘 {i} " + "很好" * 4000 for i in range(40)]  # ~1 MB: the WAL must grow
    filler = fill_disk(svc.mnt)
    try:
        code, got = svc.predict({"texts": big})
        assert code == 200 and len(got["predictions"]) == 40, got  # serving goes on
        err = wait_for(lambda: _plog_error(svc), 60, "the writer's disk error in /status")
        assert err["errno_name"] == "ENOSPC", err
        after = svc.status()["prediction_log"]
        assert after["dropped"] - before["dropped"] == 40, after
        assert after["logged"] == before["logged"]
    finally:
        os.unlink(filler)
    # the writer probes the disk each idle second: the error clears by itself
    wait_for(lambda: _plog_error(svc) is None, 60, "the prediction log's error to clear")
    rid = f"disk-ok-{uuid.uuid4().hex[:8]}"
    code, got = request(svc.port, "POST", "/predict", {"texts": ["喜欢", "讨厌"]},
                        headers={"X-Request-Id": rid})
    assert code == 200, got
    code, fb = request(svc.port, "POST", "/feedback", {"request_id": rid,
                                                       "labels": ["pos", "neg"]})
    assert code == 200 and fb["stored"] == 2, fb  # logged again: feedback finds it
    final = _flushed(svc)
    assert final["logged"] - before["logged"] == 2
    assert final["dropped"] - before["dropped"] == 40
