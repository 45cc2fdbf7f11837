"""The prediction log on the real service (real workers, real HTTP, the real
writer process): its writer process killed or stopped, the 200,000-text queue
bound, `predictions.log: false` and `predictions.sample` (docs/loop.md
"The prediction log").

The writer is the supervisor's child `python -m state.predlog_writer`; the
tests find it by its command line and signal it directly. Each test that
stops or kills it leaves a running writer behind, and every count is
compared as a difference, so the tests do not depend on their order."""
from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import uuid

import psutil
import pytest

from tests.helpers import Service, pid_gone, request, wait_for
from state.predlog import FILENAME as PREDLOG, MAX_QUEUED

BIG = 10_000  # texts in one request for the queue-bound test (limits.max_texts)


def _start(tiny_store: str, base, config: str) -> Service:
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"
    cfg.write_text("rollout:\n  probation_s: 0\nworker:\n  standby_pool: 0\n" + config)
    s = Service(root, args=["--config", str(cfg)])
    code, body = s.mpost("/apply", {"name": "sent"})
    assert code == 200, body
    return s


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    s = _start(tiny_store, tmp_path_factory.mktemp("plogsvc"),
               f"limits:\n  max_texts: {BIG}\n  max_body_bytes: 16777216\n")
    _predict_ok(s, {"text": "start the writer"})  # the writer starts with the first write
    _flushed(s)
    yield s
    s.stop()


def _plog(s: Service) -> dict:
    return s.status()["prediction_log"]


def _writers(s: Service) -> list[psutil.Process]:
    out = []
    for p in s.children():
        try:
            if "state.predlog_writer" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _writer(s: Service) -> psutil.Process:
    """The live writer process (it starts with the first write)."""
    def one():
        live = [p for p in _writers(s) if p.status() != psutil.STATUS_ZOMBIE]
        return live[0] if len(live) == 1 else None
    return wait_for(one, 60, "one prediction log writer process", interval=0.1)


def _flushed(s: Service) -> dict:
    """The log's counts once everything sent so far is committed: feedback for
    an unknown request id flushes the log before it answers 404."""
    code, body = request(s.port, "POST", "/feedback",
                         {"request_id": f"flush-{uuid.uuid4().hex[:8]}", "label": "pos"})
    assert code == 404 and body["error"]["code"] == "unknown_request_id", body
    return _plog(s)


def _delta(after: dict, before: dict) -> tuple[int, int]:
    """(logged, dropped) since `before`."""
    return after["logged"] - before["logged"], after["dropped"] - before["dropped"]


def _predict_ok(s: Service, body: dict) -> dict:
    code, got = s.predict(body)
    assert code == 200, got
    return got


# -- the writer process killed ---------------------------------------------------------------
def test_a_killed_writer_is_replaced_and_logging_resumes(svc):
    old = _writer(svc)
    before = _flushed(svc)
    old.kill()
    wait_for(lambda: pid_gone(old.pid), 30, "the killed writer reaped")
    got = _predict_ok(svc, {"texts": ["很好", "很差"]})
    assert len(got["predictions"]) == 2  # answered with the writer dead
    rid = f"after-kill-{uuid.uuid4().hex[:8]}"
    code, got = request(svc.port, "POST", "/predict", {"text": "喜欢"},
                        headers={"X-Request-Id": rid})
    assert code == 200, got
    new = _writer(svc)
    assert new.pid != old.pid
    # the prediction made after the kill is in the log: feedback finds it
    code, fb = request(svc.port, "POST", "/feedback", {"request_id": rid, "label": "pos"})
    assert code == 200 and fb["stored"] == 1, fb
    # nothing was in flight when it died: nothing lost, the counts go on
    assert _delta(_flushed(svc), before) == (3, 0)


def test_texts_in_flight_when_the_writer_dies_are_counted_as_dropped(svc):
    """Texts handed to a writer that dies before committing them are lost and
    counted as dropped (docs/loop.md), so logged +
    dropped covers every text answered."""
    w = _writer(svc)
    before = _flushed(svc)
    w.suspend()  # SIGSTOP: it reads nothing more, commits nothing more
    try:
        for i in range(5):
            _predict_ok(svc, {"texts": [f"飞行中 {i} 一", f"飞行中 {i} 二"]})
        # the sender took them off the queue and wrote them to the writer's pipe
        wait_for(lambda: _plog(svc)["queued"] == 0, 30, "the texts handed to the writer")
    finally:
        w.kill()
    wait_for(lambda: pid_gone(w.pid), 30, "the killed writer reaped")
    _predict_ok(svc, {"text": "下一个"})  # a new writer logs this one
    assert _delta(_flushed(svc), before) == (1, 10)


# -- the queue bound -------------------------------------------------------------------------
def test_beyond_200k_queued_texts_new_ones_are_dropped_and_counted(svc):
    """A stopped writer: the sender blocks on its pipe, answers keep coming
    (the request path never waits for the log), the queue stops at MAX_QUEUED
    texts and the rest are dropped and counted; once the writer runs again,
    every queued text is committed."""
    assert MAX_QUEUED == 200_000  # the documented bound
    w = _writer(svc)
    before = _flushed(svc)
    texts = [f"队列上限测试 {i:05d} " + "很好" * 20 for i in range(BIG)]
    sent = 0
    w.suspend()
    try:
        while _plog(svc)["dropped"] == before["dropped"]:
            assert sent < MAX_QUEUED + 5 * BIG, ("nothing dropped", _plog(svc))
            got = _predict_ok(svc, {"texts": texts, "top_k": 1})
            assert len(got["predictions"]) == BIG
            sent += BIG
        full = _plog(svc)
        assert MAX_QUEUED <= full["queued"] < MAX_QUEUED + BIG, full
        # still answered, and the extra ones only counted
        _predict_ok(svc, {"texts": texts, "top_k": 1})
        sent += BIG
        more = _plog(svc)
        assert more["dropped"] - full["dropped"] == BIG and more["queued"] == full["queued"]
    finally:
        w.resume()
    wait_for(lambda: _plog(svc)["queued"] == 0, 120, "the queue written out")
    logged, dropped = _delta(_flushed(svc), before)
    assert 0 < dropped < sent and logged == sent - dropped, (logged, dropped, sent)


# -- predictions.log: false ------------------------------------------------------------------
@pytest.fixture(scope="module")
def off(tiny_store, tmp_path_factory):
    s = _start(tiny_store, tmp_path_factory.mktemp("plogoff"), "predictions:\n  log: false\n")
    yield s
    s.stop()


def test_log_off_keeps_nothing_and_feedback_answers_409(off):
    got = _predict_ok(off, {"texts": ["很好", "很差"]})
    assert got["request_id"]  # ids are still given
    code, body = request(off.port, "POST", "/feedback",
                         {"request_id": got["request_id"], "labels": ["pos", "neg"]})
    assert code == 409 and body["error"]["code"] == "log_off", body
    code, body = request(off.port, "POST", "/feedback",
                         {"model": "sent", "examples": [{"text": "好", "label": "pos"}]})
    assert code == 409 and body["error"]["code"] == "log_off", body
    # the dashboard's twin on the management port: the same handler
    code, body = off.mpost("/feedback", {"request_id": got["request_id"],
                                         "labels": ["pos", "neg"]})
    assert code == 409 and body["error"]["code"] == "log_off", body
    # the Open Inference Protocol's infer is answered and not logged either
    req = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["喜欢"]}]}
    code, body = request(off.port, "POST", "/v2/models/sent/infer", req)
    assert code == 200 and body["outputs"], body
    assert off.status()["prediction_log"] is None
    assert _writers(off) == []  # no writer process ever started
    conn = sqlite3.connect(os.path.join(off.models_dir, PREDLOG))
    try:
        assert conn.execute("SELECT count(*) FROM batches").fetchone()[0] == 0
    finally:
        conn.close()


# -- predictions.sample ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampled(tiny_store, tmp_path_factory):
    s = _start(tiny_store, tmp_path_factory.mktemp("plogsample"),
               "predictions:\n  sample: 0.5\n")
    yield s
    s.stop()


def test_sample_logs_a_share_of_requests_each_whole_or_not_at_all(sampled):
    n = 60
    rids = [f"smp-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    for i, rid in enumerate(rids):
        code, got = request(sampled.port, "POST", "/predict",
                            {"texts": [f"抽样 {i} 一", f"抽样 {i} 二", f"抽样 {i} 三"]},
                            headers={"X-Request-Id": rid})
        assert code == 200 and got["request_id"] == rid, got
    logged = 0
    for rid in rids:  # feedback flushes the log first: a 404 means never logged
        code, fb = request(sampled.port, "POST", "/feedback",
                           {"request_id": rid, "labels": ["pos", "neg", "pos"]})
        if code == 200:
            assert fb["stored"] == 3  # the whole request
            logged += 1
        else:
            assert code == 404 and fb["error"]["code"] == "unknown_request_id", fb
    # 0.5 of 60 requests: all or none logged has a chance of 2 * 2**-60
    assert 0 < logged < n
    wait_for(lambda: _plog(sampled)["logged"] == 3 * logged, 30,
             "the status to count the sampled texts")
