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
