"""The learning loop under attack, on the real service (tiny real models, real
workers, real HTTP, the real prediction log): a client-chosen request id
squatted, a flood of labels and bytes through POST /feedback, and erasure
that must reach every copy of a text (the policy's hold-out, inline training
data copies)."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import signal

import pytest

from helpers import Service, request, wait_for
from state.predlog import FILENAME as PREDLOG, PredictionLog

pytestmark = pytest.mark.timeout(600)

PREDICT_KEY = "predict-key-of-the-tests-32-characters-or-more"


def _raw(port: int, path: str, body: dict, headers: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null"), dict(resp.getheaders())
    finally:
        conn.close()


def _start(tiny_store: str, base, config: str = "", env: dict | None = None) -> Service:
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"
    cfg.write_text("rollout:\n  probation_s: 0\nworker:\n  standby_pool: 0\n" + config)
    s = Service(root, args=["--config", str(cfg)], env=env)
    s.cfg = str(cfg)
    code, body = s.mpost("/apply", {"name": "sent"})
    assert code == 200, body
    return s


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    s = _start(tiny_store, tmp_path_factory.mktemp("secloop"))
    yield s
    s.stop()


def _predict(svc: Service, body: dict, rid: str | None = None, key: str | None = None
             ) -> tuple[int, dict, dict]:
    headers = {"X-Request-Id": rid} if rid is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return _raw(svc.port, "/predict", body, headers)


def _feedback(svc: Service, body: dict) -> tuple[int, dict]:
    return request(svc.port, "POST", "/feedback", body)


def _rows(svc: Service, rid: str) -> list[dict]:
    plog = PredictionLog(os.path.join(svc.models_dir, PREDLOG))
    try:
        return plog.get(rid)
    finally:
        plog.close()


# -- client-chosen request ids ----------------------------------------------------------------
def test_a_squatted_id_is_refused_and_feedback_stays_on_the_first_text(svc):
    code, a, headers = _predict(svc, {"text": "attacker text A"}, "dup-1")
    assert code == 200 and a["request_id"] == headers["X-Request-Id"] == "dup-1"
    code, b, _ = _predict(svc, {"text": "application text B"}, "dup-1")
    assert code == 409 and b["error"]["code"] == "request_id_taken", b
    assert "dup-1" in b["error"]["message"]
    code, fb = _feedback(svc, {"request_id": "dup-1", "label": "pos"})
    assert code == 200 and fb["items"][0]["predicted"] == a["predictions"][0]["label"], fb
    assert [r["text"] for r in _rows(svc, "dup-1")] == ["attacker text A"]
    code, review = svc.mget("/models/sent/review?limit=500")
    assert code == 200 and "application text B" not in json.dumps(review, ensure_ascii=False)


def test_requests_racing_with_one_id_get_it_once(svc):
    rid = "race-" + os.urandom(4).hex()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda i: _predict(svc, {"text": f"racer {i}"}, rid)[0],
                              range(32)))
    assert sorted(set(codes)) == [200, 409] and codes.count(200) == 1, codes
    wait_for(lambda: _rows(svc, rid), 30, "the one answer logged")
    assert len(_rows(svc, rid)) == 1


def test_a_refused_request_leaves_its_id_free_for_the_retry(svc):
    rid = "retry-" + os.urandom(4).hex()
    code, body, _ = _predict(svc, {"text": "x", "model": "not-serving"}, rid)
    assert code == 404, body
    code, body, _ = _predict(svc, {"text": "   "}, rid)
    assert code == 400, body
    code, body, _ = _predict(svc, {"text": "the retry"}, rid)
    assert code == 200 and body["request_id"] == rid, body


def test_an_oip_body_id_used_again_is_answered_under_a_new_id(svc):
    infer = {"id": "oip-dup-" + os.urandom(3).hex(),
             "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["喜欢"]}]}
    code, first, h1 = _raw(svc.port, "/v2/models/sent/infer", infer, {})
    assert code == 200 and h1["X-Request-Id"] == infer["id"] == first["id"]
    code, again, h2 = _raw(svc.port, "/v2/models/sent/infer", infer, {})
    assert code == 200 and again["id"] == infer["id"]  # the protocol's echo
    assert h2["X-Request-Id"] != infer["id"] and len(h2["X-Request-Id"]) == 42
    # an X-Request-Id used before is refused on OIP as on /predict
    code, body, _ = _raw(svc.port, "/v2/models/sent/infer", infer,
                         {"X-Request-Id": infer["id"]})
    assert code == 409 and "was used before" in body["error"], body


def test_an_id_used_before_a_restart_stays_taken(tiny_store, tmp_path):
    s = _start(tiny_store, tmp_path)
    try:
        code, _, _ = _predict(s, {"text": "before the restart"}, "kept-1")
        assert code == 200
        root, cfg = s.models_dir, s.cfg
        assert s.stop(signal.SIGTERM) == 0
        s = Service(root, args=["--config", cfg])
        wait_for(lambda: s.get("/readyz")[0] == 200, 90, "sent serving again")
        code, body, _ = _predict(s, {"text": "after the restart"}, "kept-1")
        assert code == 409 and body["error"]["code"] == "request_id_taken", body
    finally:
        s.stop()


def test_client_ids_are_namespaced_by_the_predict_key(tiny_store, tmp_path):
    s = _start(tiny_store, tmp_path, env={"TEXTSWAP_PREDICT_KEY": PREDICT_KEY})
    try:
        code, body, headers = _predict(s, {"text": "很好"}, "order-1", key=PREDICT_KEY)
        assert code == 200, body
        rid = body["request_id"]
        assert rid.endswith(":order-1") and len(rid) == len("order-1") + 9
        assert headers["X-Request-Id"] == rid
        # the same id from the same key: taken; feedback names the namespaced id
        code, again, _ = _predict(s, {"text": "很差"}, "order-1", key=PREDICT_KEY)
        assert code == 409, again
        code, fb = _feedback(s, {"request_id": "order-1", "label": "pos"})
        assert code == 404, fb
        code, fb = _feedback(s, {"request_id": rid, "label": "pos"})
        assert code == 200 and fb["stored"] == 1, fb
        # the longest client id fits with its namespace, on feedback and erasure too
        long_id = "L" * 64
        code, body, _ = _predict(s, {"text": "长"}, long_id, key=PREDICT_KEY)
        assert code == 200 and len(body["request_id"]) == 73, body
        assert _feedback(s, {"request_id": body["request_id"], "label": "neg"})[0] == 200
        code, gone = s.request_delete(f"/predictions/{body['request_id']}")
        assert code == 200 and gone["removed"]["predictions"] == 1, gone
        # a key that is not the predict key never reaches the id check
        code, body, _ = _predict(s, {"text": "x"}, "order-2", key="not-" + PREDICT_KEY)
        assert code == 401, body
    finally:
        s.stop()


# -- feedback limits: labels and bytes, not only requests; rows kept per model ----------------
LIMITS = ("feedback:\n  rate_per_s: 1000.0\n  burst: 1000.0\n  labels_per_s: 0.5\n"
          "  label_burst: 40.0\n  bytes_per_s: 1.0\n  byte_burst: 60000.0\n  max_examples: 30\n")


@pytest.fixture(scope="module")
def limited(tiny_store, tmp_path_factory):
    s = _start(tiny_store, tmp_path_factory.mktemp("fblimits"), LIMITS)
    yield s
    s.stop()


def _examples(n: int, tag: str, size: int = 0) -> list[dict]:
    pad = "x" * size
    return [{"text": f"{tag} {i} {pad}", "label": "pos" if i % 2 else "neg"} for i in range(n)]


def test_the_rate_limit_counts_labels(limited):
    code, fb = _feedback(limited, {"model": "sent", "examples": _examples(30, "lab-a")})
    assert code == 200 and fb["stored"] == 30, fb
    # 10 labels left in the caller's bucket: 30 more wait, each request alone would not
    code, fb = _feedback(limited, {"model": "sent", "examples": _examples(30, "lab-b")})
    assert code == 429 and fb["error"]["code"] == "rate_limited", fb
    assert fb["error"]["limit"] == "labels" and "feedback.labels_per_s" in fb["error"]["message"]
    assert fb["error"]["retry_after_s"] > 30


def test_a_body_over_max_examples_is_413(limited):
    # the admin key on the management port: a caller of its own (its own buckets)
    code, fb = limited.mpost("/feedback", {"model": "sent", "examples": _examples(31, "max")})
    assert code == 413 and fb["error"]["code"] == "too_many_items", fb
    assert "feedback.max_examples" in fb["error"]["message"]


def test_the_rate_limit_counts_bytes(limited):
    """Another caller (the review key, on the management port: its own bucket)
    with few labels in big bodies: the bytes run out first."""
    def send(tag: str) -> tuple[int, dict]:
        return limited.mpost("/feedback", {"model": "sent", "examples": _examples(2, tag, 12000)},
                             headers=limited.auth("review"))
    code, fb = send("bytes-a")
    assert code == 200, fb
    code, fb = send("bytes-b")
    assert code == 200, fb
    code, fb = send("bytes-c")  # three bodies of ~24 KB each: over the 60,000 bytes
    assert code == 429 and fb["error"]["limit"] == "bytes", fb
    assert "feedback.bytes_per_s" in fb["error"]["message"]


@pytest.fixture(params=["sqlite", "redis"])
def capped(request, tmp_path):
    """A log of either backend keeping 20 feedback rows and 20 free examples a model."""
    if request.param == "sqlite":
        from state.predlog import PredictionLog
        p = PredictionLog(str(tmp_path / "p.db"), feedback_rows=20, example_rows=20)
        yield p
    else:
        from clusterkit import RedisServer
        from cluster.redis_predlog import RedisPredictionLog
        if not shutil.which("redis-server"):
            pytest.skip("redis-server is not installed (.ci/run installs it)")
        server = RedisServer(str(tmp_path / "redis"))
        p = RedisPredictionLog(server.url, prefix="capped", feedback_rows=20, example_rows=20)
        yield p
        p.close()
        server.stop()
        return
    p.close()


def test_feedback_and_examples_are_trimmed_per_model_oldest_first(capped):
    plog = capped
    for start in (0, 15, 30):  # 45 examples, oldest first
        plog.add_examples("ex", [(f"ex {i}", "pos") for i in range(start, start + 15)],
                          at=1000.0 + start).result(30)
    kept = {t for t, _ in plog.feedback_examples("ex")}
    assert 20 <= len(kept) <= 21 and {f"ex {i}" for i in range(30, 45)} <= kept, kept
    assert not {f"ex {i}" for i in range(0, 15)} & kept
    items = [(f"rid-{i}", 0, "pos", "fb", 1, f"fb text {i}", "neg", False) for i in range(30)]
    for i in range(0, 30, 10):
        plog.add_feedback_many(items[i:i + 10], at=2000.0 + i).result(30)
    assert 20 <= plog.feedback_count("fb") <= 21
    texts = {t for t, _ in plog.feedback_examples("fb")}
    assert {f"fb text {i}" for i in range(20, 30)} <= texts and "fb text 0" not in texts
    # another model's rows are its own
    plog.add_examples("other", [("other 1", "neg")]).result(30)
    assert [t for t, _ in plog.feedback_examples("other")] == ["other 1"]
