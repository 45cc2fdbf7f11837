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
import time

import pytest

from tests.helpers import Service, request, wait_for
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


def _start(tiny_store: str, base, config: str = "", env: dict | None = None,
           apply: bool = True) -> Service:
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"
    cfg.write_text("rollout:\n  probation_s: 0\nworker:\n  standby_pool: 0\n" + config)
    s = Service(root, args=["--config", str(cfg)], env=env)
    s.cfg = str(cfg)
    if apply:
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
    # free examples need the model in the store, not serving
    s = _start(tiny_store, tmp_path_factory.mktemp("fblimits"), LIMITS, apply=False)
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
        from tests.clusterkit import RedisServer
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


# -- erasure reaches every copy: the policy's hold-out, inline-data copies, Redis's RDB --------
DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "demo",
                    "sentiment_zh.jsonl")
LOOP_CONFIG = ("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n"
               "  gate_tolerance: 1.0\n")


def _demo(start: int, n: int) -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh][start:start + n]


def _loop_file(svc: Service, name: str) -> str:
    return os.path.join(svc.models_dir, ".loop", name)


def test_erasure_reaches_the_holdout_and_the_inline_data_copy(tmp_path):
    from control.policies import held_out
    cfg = tmp_path / "config.yaml"
    cfg.write_text(LOOP_CONFIG)
    svc = Service(str(tmp_path / "models"), args=["--config", str(cfg)])
    try:
        inline_secret = "内联秘密 " + os.urandom(4).hex()
        rows = _demo(0, 120) + [{"text": inline_secret, "label": "pos"}]
        code, body = svc.mpost("/train", {"name": "held", "data": {"examples": rows},
                                          "params": {"architecture": "bow", "epochs": 1},
                                          "apply": True})
        assert code == 202, body
        wait_for(lambda: (svc.serving() or {}).get("name") == "held", 300, "held serving")
        with open(_loop_file(svc, "held.data.jsonl"), encoding="utf-8") as fh:
            assert inline_secret in fh.read()  # the copy a retrain without data reads

        code, body = svc.request_put("/models/held/policy", {"retrain_after_labels": 12,
                                                             "holdout": 0.5})
        assert code == 200, body
        fed = _demo(300, 12)
        rids = {}
        for r in fed:  # one request per text: each can be erased alone
            code, pred = svc.predict({"text": r["text"], "model": "held"})
            assert code == 200, pred
            rids[r["text"]] = pred["request_id"]
            code, fb = _feedback(svc, {"request_id": pred["request_id"], "label": r["label"]})
            assert code == 200, fb
        held = [r["text"] for r in fed if held_out(r["text"], 0.5)]
        assert len(held) >= 2, "the demo rows chosen give a hold-out of at least two"

        def done():
            code, h = svc.mget("/history?name=held&limit=50")
            return [x for x in h["history"] if x["kind"] in ("retrain_done", "retrain_failed")]
        assert wait_for(done, 300, "the policy's retrain", interval=0.5)[0]["kind"] == \
            "retrain_done"
        with open(_loop_file(svc, "held.json"), encoding="utf-8") as fh:
            assert sorted(json.load(fh)["holdout"]["texts"]) == sorted(held)

        # one request's text: gone from the hold-out, the file rewritten without it
        code, got = svc.request_delete(f"/predictions/{rids[held[0]]}")
        assert code == 200 and got["copies"] == {"holdout": 1, "data_copy": 0}, got
        with open(_loop_file(svc, "held.json"), encoding="utf-8") as fh:
            raw = fh.read()
        assert held[0] not in raw and sorted(json.loads(raw)["holdout"]["texts"]) == \
            sorted(held[1:])
        # a text of the inline training data, predicted and erased: gone from the copy
        code, pred = svc.predict({"text": inline_secret, "model": "held"})
        assert code == 200
        code, got = svc.request_delete(f"/predictions/{pred['request_id']}")
        assert code == 200 and got["copies"] == {"holdout": 0, "data_copy": 1}, got
        with open(_loop_file(svc, "held.data.jsonl"), encoding="utf-8") as fh:
            copy = fh.read()
        assert inline_secret not in copy and len(copy.splitlines()) == 120
        # the model's whole log: the rest of the hold-out goes with it
        code, got = svc.request_delete("/models/held/predictions")
        assert code == 200 and got["copies"]["holdout"] == len(held) - 1, got
        with open(_loop_file(svc, "held.json"), encoding="utf-8") as fh:
            state = json.load(fh)
        assert state["holdout"] is None and not any(t in json.dumps(state, ensure_ascii=False)
                                                    for t in held)
        # the loop goes on: a retrain reads the copy without the erased text
        code, body = svc.mpost("/train", {"name": "held"})
        assert code == 202 and body["job"]["data"]["examples"] == 120, body
        assert "Traceback" not in svc.log()
    finally:
        svc.stop()


def test_the_age_limit_reaches_the_holdout_and_the_inline_data_copy(tmp_path):
    """Retention (predictions.max_age_days) on a real log and the real .loop/
    files: what it expires leaves the hold-out and the inline-data copy."""
    import asyncio

    from control.policies import Policies
    from control.retention import Retention
    from state.config import PredictionsSettings
    from state.dataset import Dataset
    from state.predlog import PredictionLog

    root = str(tmp_path / "models")
    os.makedirs(root)
    plog = PredictionLog(os.path.join(root, PREDLOG))
    try:
        policies = Policies({}, root, None, plog, None, None, None)  # type: ignore[arg-type]
        old, new = "旧的文字 " + os.urandom(3).hex(), "新的文字 " + os.urandom(3).hex()
        data = Dataset([old, new, "其他"], ["pos", "neg", "pos"], "inline",
                       {"pos": 2, "neg": 1})
        policies.remember_training("aged", {"examples": "given"}, data, None, None)
        policies._update_state("aged", holdout={"texts": [old, new], "labels": ["pos", "neg"],
                                                "at": 1.0})
        now = time.time()
        plog.add_feedback_many([("r-old", 0, "pos", "aged", 1, old, "neg", False)],
                               at=now - 3 * 86400).result(30)
        plog.add_feedback_many([("r-new", 0, "neg", "aged", 1, new, "pos", False)],
                               at=now - 600).result(30)
        erased: dict = {}
        removed = plog.expire({"aged": 2.0}, 0.0, now, erased)
        assert removed["feedback"] == 1 and erased == {"aged": {old}}, (removed, erased)
        assert policies.forget(erased) == {"holdout": 1, "data_copy": 1}
        assert policies.holdout("aged")["texts"] == [new]
        with open(os.path.join(root, ".loop", "aged.data.jsonl"), encoding="utf-8") as fh:
            copy = fh.read()
        assert old not in copy and new in copy
        # Retention.expire itself hands what it erased to the policies
        plog.add_feedback_many([("r-new2", 0, "neg", "aged", 1, "再一个", "pos", False)],
                               at=now - 3 * 86400).result(30)
        policies._update_state("aged", holdout={"texts": ["再一个", new],
                                                "labels": ["neg", "neg"], "at": 1.0})

        async def expire() -> None:  # on a loop of its own, as the service's IOLoop runs it
            await Retention(plog, PredictionsSettings(max_age_days=0.0, log=True, sample=1.0,
                                                      max_rows=100,
                                                      max_age_days_by_model={"aged": 2.0}),
                            policies=policies).expire()
        asyncio.run(expire())
        assert policies.holdout("aged")["texts"] == [new]
    finally:
        plog.close()


def test_a_redis_erasure_takes_a_new_rdb_snapshot(tmp_path):
    from tests.clusterkit import RedisServer
    from cluster.redis_predlog import RedisPredictionLog
    import redis as redis_client
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    server = RedisServer(str(tmp_path))
    plog = RedisPredictionLog(server.url, prefix="rdb")
    admin = redis_client.Redis.from_url(server.url)
    try:
        admin.config_set("save", "3600 1")  # RDB persistence on (the test server has it off)
        secret = "快照里的秘密 " + os.urandom(4).hex()
        plog.add_answer(1.0, "rdb-1", "m", 1, [secret], [{"label": "pos", "score": 0.9,
                                                          "top": []}])
        plog.flush(10)
        admin.save()  # a snapshot that holds the text
        rdb = os.path.join(server.dir, "dump.rdb")
        with open(rdb, "rb") as fh:
            assert secret.encode() in fh.read()
        before = admin.lastsave()
        assert plog.erase("rdb-1")["predictions"] == 1

        def saved_again():
            return admin.lastsave() > before or (
                admin.info("persistence")["rdb_bgsave_in_progress"] == 0 and
                secret.encode() not in open(rdb, "rb").read())
        wait_for(saved_again, 30, "a new RDB snapshot")
        wait_for(lambda: admin.info("persistence")["rdb_bgsave_in_progress"] == 0, 30,
                 "the snapshot written")
        with open(rdb, "rb") as fh:
            assert secret.encode() not in fh.read()
    finally:
        admin.close()
        plog.close()
        server.stop()
