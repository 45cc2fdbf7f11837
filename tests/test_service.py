"""The serving core end to end: real service process, real workers, real HTTP."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import threading
import time

import pytest

from tests.helpers import Service, pid_gone, wait_for


@pytest.fixture(scope="module", params=["uvloop/httptools", "asyncio/httptools", "uvloop/tornado"])
def serving(request):
    """Every test here runs on both of the supervisor's event loops
    (server.event_loop: uvloop, the default, and asyncio's own) and on both
    of the inference port's HTTP servers (server.http_parser: httptools, the
    default, frontend/httpwire.py; and Tornado's)."""
    return request.param.split("/")


@pytest.fixture(scope="module")
def loop_kind(serving):
    return serving[0]


@pytest.fixture(scope="module")
def parser(serving):
    return serving[1]


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory, loop_kind, parser):
    base = tmp_path_factory.mktemp("svc")
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"  # old workers stop right after a swap (no probation)
    cfg.write_text(f"rollout:\n  probation_s: 0\nserver:\n  event_loop: {loop_kind}\n"
                   f"  http_parser: {parser}\n")
    s = Service(root, args=["--config", str(cfg)])
    yield s
    s.stop()


@pytest.fixture
def fresh(store_copy, tmp_path, loop_kind, parser):
    """A service of its own that nothing was applied on yet (the module's one
    has whatever the tests before applied)."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"rollout:\n  probation_s: 0\nserver:\n  http_parser: {parser}\n")
    s = Service(store_copy, args=["--config", str(cfg), "--event-loop", loop_kind])
    yield s
    s.stop()


def test_runs_on_the_configured_event_loop(svc, loop_kind, parser):
    """The loop asked for (config file here; the command line in `fresh`) is
    the one the supervisor runs on, and the inference port's HTTP server the
    one configured, as its start line reports."""
    line = wait_for(lambda: next((x for x in svc.log().splitlines()
                                  if "management API on" in x), None),
                    30, "the supervisor's start line")
    assert line.endswith(f"(event loop: {loop_kind}, inference HTTP: {parser})"), line


@pytest.fixture
def sent1(svc):
    """The module's service with sent v1 serving (as the default model)."""
    code, body = svc.mpost("/apply", {"name": "sent", "version": 1})
    assert code == 200, body
    assert svc.serving()["version"] == 1
    return svc


def test_not_ready_before_any_apply(fresh):
    svc = fresh
    assert svc.get("/healthz") == (200, {"status": "ok"})
    code, body = svc.get("/readyz")
    assert code == 503 and body["error"]["code"] == "not_ready"
    code, body = svc.predict({"text": "hello"})
    assert code == 503 and body["error"]["code"] == "no_model"


def test_models_listing(svc):
    code, body = svc.mget("/models")
    assert code == 200
    by_name = {m["name"]: m for m in body["models"]}
    assert [v["version"] for v in by_name["sent"]["versions"]] == [1, 2]
    assert by_name["topic"]["versions"][0]["labels"] == ["neg", "other", "pos"]
    assert svc.mget("/models/sent/2")[1]["labels"] == ["neg", "pos"]
    assert svc.mget("/models/nope")[0] == 404


@pytest.mark.parametrize("body,status,code", [
    ({"name": "nope"}, 404, "not_found"),
    ({"name": "sent", "version": 9}, 404, "not_found"),
    ({"name": "../etc"}, 400, "invalid_name"),
    ({"name": "a/b"}, 400, "invalid_name"),
    ({"name": "sent", "version": -1}, 400, "invalid_field"),
    ({"name": "sent", "version": "1"}, 400, "invalid_field"),
    ({"version": 1}, 400, "missing_field"),
    ({"name": "sent", "extra": 1}, 400, "unknown_field"),
])
def test_apply_rejects_bad_requests(svc, body, status, code):
    got_status, got = svc.mpost("/apply", body)
    assert (got_status, got["error"]["code"]) == (status, code), got


def test_apply_then_predict(fresh):
    svc = fresh
    svc.wait_standby()
    standby_pid = svc.status()["standby"]["pid"]
    code, body = svc.mpost("/apply", {"name": "sent", "version": 1})
    assert code == 200, body
    assert body["current"] == {"name": "sent", "version": 1} and body["previous"] is None
    assert body["worker"]["pid"] == standby_pid  # the warm standby took the model
    assert set(body["phases_s"]) >= {"spawn", "swap", "drain_stop"}
    assert svc.get("/readyz")[0] == 200

    code, body = svc.predict({"text": "非常好用"})
    assert code == 200 and body["model"] == {"name": "sent", "version": 1}
    (pred,) = body["predictions"]
    assert pred["label"] == "pos" and pred["top"][0]["label"] == "pos"
    assert abs(sum(t["score"] for t in pred["top"]) - 1.0) < 1e-4

    texts = ["terrible", "love it", "很差", "好评"]
    code, body = svc.predict({"texts": texts, "top_k": 1})
    assert code == 200
    assert [p["label"] for p in body["predictions"]] == ["neg", "pos", "neg", "pos"]
    assert all(len(p["top"]) == 1 for p in body["predictions"])

    with open(os.path.join(svc.models_dir, ".applied.json")) as fh:
        record = json.load(fh)
    assert record["default"] == "sent" and record["models"]["sent"]["version"] == 1


def test_status_shape(fresh):
    svc = fresh
    assert svc.mpost("/apply", {"name": "sent", "version": 1})[0] == 200
    for text in ("很好", "很差"):
        assert svc.predict({"text": text})[0] == 200
    st = svc.status()
    assert st["serving"]["name"] == "sent"
    assert st["supervisor"]["rss_bytes"] > 0 and st["supervisor"]["uptime_s"] > 0
    (w,) = [w for w in st["workers"] if w["state"] == "SERVING"]
    assert w["served"] >= 2 and w["rss_bytes"] > 0 and w["inflight"] == 0
    assert st["restarts"] == 0


def _score_of(svc, text):
    return svc.predict({"text": text})[1]


def test_swaps_under_load_lose_nothing_and_label_versions_truly(svc):
    """Repeated applies under concurrent load: no failure, honest versions.

    sent v1 and v2 are different trained weights, so a fixed text gets a
    different score from each: every response's score must match the score of
    the version it names."""
    probe = "还不错吧 ok"
    expected = {}
    for v in (2, 1):
        assert svc.mpost("/apply", {"name": "sent", "version": v})[0] == 200
        expected[v] = _score_of(svc, probe)["predictions"][0]["score"]
    assert abs(expected[1] - expected[2]) > 1e-4

    stop = threading.Event()
    results, errors = [], []

    def client():
        while not stop.is_set():
            code, body = svc.predict({"text": probe})
            if code != 200:
                errors.append((code, body))
            else:
                results.append((body["model"]["version"], body["predictions"][0]["score"]))

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    old_pids = []
    try:
        for i in range(2):  # each apply boots a fresh process; 20 run in bench/chaos.py
            wait_for(lambda: len(results) > 20 * (i + 1), 30, "load to flow")
            before = svc.serving()["pid"]
            code, body = svc.mpost("/apply", {"name": "sent", "version": 2 if i % 2 == 0 else 1})
            assert code == 200, body
            assert body["old_worker"]["pid"] == before and body["old_worker"]["drained"]
            old_pids.append(before)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert {v for v, _ in results} == {1, 2}
    for version, score in results:
        assert abs(score - expected[version]) < 1e-5, (version, score)
    for pid in old_pids:  # old workers have exited and been reaped
        wait_for(lambda: pid_gone(pid), 10, f"old worker {pid} to be gone")


def test_watcher_follows_record_written_from_outside(sent1):
    svc, target = sent1, 2
    record = os.path.join(svc.models_dir, ".applied.json")
    tmp = record + ".op"
    with open(tmp, "w") as fh:  # an operator's atomic edit, in the current format
        json.dump({"default": "sent", "models": {"sent": {"version": target}}}, fh)
    os.replace(tmp, record)
    wait_for(lambda: svc.serving()["version"] == target, 30, "watcher to apply the record")
    assert svc.predict({"text": "ok"})[1]["model"]["version"] == target

    # a record naming a missing model: logged, ignored, current model serves on
    with open(tmp, "w") as fh:
        json.dump({"name": "ghost", "version": 3}, fh)
    os.replace(tmp, record)
    wait_for(lambda: "ghost" in svc.log(), 10, "the watcher to log the missing model")
    assert svc.serving()["version"] == target
    assert svc.predict({"text": "ok"})[0] == 200


def test_killed_worker_is_replaced_and_requests_survive(sent1):
    svc = sent1
    svc.wait_standby()
    st = svc.status()
    victim, restarts = st["serving"]["pid"], st["restarts"]
    stop = threading.Event()
    codes = []

    def client():
        while not stop.is_set():
            codes.append(svc.predict({"text": "很好"})[0])

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(codes) > 20, 30, "load to flow")
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: (svc.serving() or {}).get("pid") not in (None, victim), 60,
                 "a replacement worker")
        recovery = time.monotonic() - t0
        n = len(codes)
        wait_for(lambda: len(codes) > n + 20, 30, "load to flow on the replacement")
    finally:
        stop.set()
        for t in threads:
            t.join()
    print(f"recovered from kill -9 in {recovery:.2f}s over {len(codes)} requests")
    assert set(codes) == {200}
    st = svc.status()
    assert st["restarts"] == restarts + 1
    assert any(e["pid"] == victim and e["exitcode"] == -9 for e in st["recent_exits"])
    wait_for(lambda: pid_gone(victim), 10, "the killed worker to be reaped")


def test_bad_predict_requests(sent1):
    svc = sent1
    cases = [
        ({"text": ""}, 400, "empty_text"),
        ({"text": "   "}, 400, "empty_text"),
        ({"text": 5}, 400, "invalid_field"),
        ({"texts": []}, 400, "invalid_field"),
        ({"texts": ["a", 3]}, 400, "invalid_field"),
        ({"texts": "abc"}, 400, "invalid_field"),
        ({"text": "a", "texts": ["b"]}, 400, "bad_request"),
        ({}, 400, "bad_request"),
        ({"text": "a", "top_k": 0}, 400, "invalid_field"),
        ({"text": "a", "top_k": True}, 400, "invalid_field"),
        ({"text": "a", "top_k": 10**6}, 400, "invalid_field"),
        ({"text": "a", "bogus": 1}, 400, "unknown_field"),
        ({"texts": ["a"] * 5000}, 413, "too_many_texts"),
        ({"text": "长" * 30000}, 422, "text_too_long"),  # a small body: not 413
        ([1, 2], 400, "bad_request"),
    ]
    for body, status, code in cases:
        got_status, got = svc.predict(body)
        assert (got_status, got["error"]["code"]) == (status, code), (body, got)
    assert svc.predict(None, raw=b"{not json")[1]["error"]["code"] == "bad_json"
    assert svc.predict(None, raw=b'{"text": "\xff\xfe"}')[1]["error"]["code"] == "bad_encoding"
    assert svc.predict(None, raw=b'{"text": "\\ud800"}')[1]["error"]["code"] == "bad_text"
    code, got = svc.predict(None, raw=b"x" * (5 * 1024 * 1024))
    assert code == 413 and got["error"]["code"] == "body_too_large"
    code, got = svc.predict({"text": "a"}, headers={"Content-Type": "text/plain"})
    assert code == 415
    assert svc.get("/nope")[0] == 404
    code, got = svc.get("/predict")
    assert code == 405 and "error" in got
    # odd but valid text is answered
    code, got = svc.predict({"texts": ["\x00\x01 ctrl", "emoji 😀👍 混合 mixed"], "top_k": 50})
    assert code == 200 and len(got["predictions"]) == 2
    assert len(got["predictions"][0]["top"]) == 2  # top_k is capped at the label count


def test_json_sent_as_a_form_is_read_only_with_an_authorization_header(sent1):
    """`curl -d '{...}'` sends Content-Type application/x-www-form-urlencoded,
    as a cross-site form does: /predict reads such a body only with an
    Authorization header (which a form cannot send), as the management port
    does; `-H 'Content-Type: application/json'` is what the README sends."""
    svc = sent1
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    code, plain = svc.predict({"text": "good"})
    assert code == 200, plain
    code, got = svc.predict({"text": "good"}, headers=form)
    assert code == 415 and got["error"]["code"] == "unsupported_media_type", got
    assert "application/json" in got["error"]["message"]
    code, got = svc.predict({"text": "good"}, headers={**form, "Authorization": "Bearer k"})
    assert code == 200 and got["predictions"] == plain["predictions"], got
    code, got = svc.predict(None, raw=b"text=good", headers={**form, "Authorization": "Bearer k"})
    assert code == 415 and got["error"]["code"] == "unsupported_media_type", got
    # the management port takes a form body only with a valid Authorization
    # header (test_security.py): a cross-site form cannot send one; curl -d
    # with the admin key can
    code, got = svc.mpost("/apply", {"name": "sent", "version": 1}, headers=form, auth=False)
    assert code == 401 and got["error"]["code"] == "unauthorized", got
    code, got = svc.mpost("/apply", {"name": "sent", "version": 1}, headers=form)
    assert code == 200, got
    # the bytes `curl -H 'Content-Type: application/json' -d '{"text": "good"}' URL`
    # sends, written here so the test does not depend on curl
    body = b'{"text": "good"}'
    with socket.create_connection(("127.0.0.1", svc.port), timeout=60) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                     b"User-Agent: curl/8.5.0\r\nAccept: */*\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s"
                     % (svc.port, len(body), body))
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        answer = json.loads(resp.read())
    assert resp.status == 200 and answer["predictions"] == plain["predictions"], answer
