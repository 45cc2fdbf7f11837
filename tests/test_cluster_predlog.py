"""Cluster mode's prediction log in Redis (cluster/redis_predlog.py).

1. `RedisPredictionLog` on its own against a real redis-server, beside the
   contract both backends keep (tests/test_predlog_contract.py): trimming,
   a close then a reopen losing nothing, and where Redis differs on purpose
   (counts are per version since the start; a trimmed answer's id is not
   found).
2. The real service, two nodes on one Redis: a prediction answered by node1
   takes its feedback on node2; both nodes' /quality count it; an unknown id
   is 404 on both.
3. Redis down: POST /feedback answers a 503 JSON error at once; predictions
   are still answered; once Redis is back, feedback works again.

Runtime: part 1 takes about a second; the two nodes (started once for the
module) about 30-60 s on a loaded 2-core machine.
"""
from __future__ import annotations

import itertools
import os
import shutil
import time

import pytest

from tests.clusterkit import Node, RedisServer
from tests.helpers import request, wait_for

# a deadline that tells "answers" from "hangs" where Redis is down (a refused
# connection fails in milliseconds); generous on a loaded machine, not a speed claim
NO_HANG = 20.0

pytestmark = pytest.mark.skipif(not shutil.which("redis-server")
                                and not os.path.exists("/usr/bin/redis-server"),
                                reason="redis-server is not installed (.ci/run installs it)")

_prefixes = itertools.count()


def _rows(rid: str, texts: list[str], model: str = "m", version: int = 1,
          scores: list[dict] | None = None) -> list[dict]:
    scores = scores or [{"pos": 0.9, "neg": 0.1}] * len(texts)
    return [{"at": 1.0, "request_id": rid, "index": i, "model": model, "version": version,
             "text": t, "label": max(s, key=s.get), "scores": s}
            for i, (t, s) in enumerate(zip(texts, scores))]


def _answer(plog, rid: str, texts: list[str], model: str = "m", version: int = 1) -> None:
    """What /predict queues: the answer whole."""
    preds = [{"label": "pos", "score": 0.8,
              "top": [{"label": "pos", "score": 0.8}, {"label": "neg", "score": 0.2}]}
             for _ in texts]
    plog.add_answer(time.time(), rid, model, version, texts, preds)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("plog-redis")))
    yield server
    server.stop()


def _log(server, **kw):
    from cluster.redis_predlog import RedisPredictionLog
    return RedisPredictionLog(server.url, prefix=kw.pop("prefix", f"t{next(_prefixes)}"), **kw)


@pytest.fixture
def plog(redis_server):
    p = _log(redis_server, max_rows=50)
    yield p
    p.close()


# -- 1. the log on its own ----------------------------------------------------------------------


def test_a_predict_answer_is_logged_whole(plog):
    _answer(plog, "ans", ["x", "y"], version=7)
    plog.flush(10)
    rows = plog.get("ans")
    assert [(r["index"], r["text"], r["label"], r["version"]) for r in rows] == \
        [(0, "x", "pos", 7), (1, "y", "pos", 7)]
    assert rows[0]["scores"] == {"pos": 0.8, "neg": 0.2}
    assert rows[0]["margin"] == pytest.approx(0.6)


def test_an_answer_logged_as_score_rows_reads_as_its_top_lists(plog):
    """add_scores (the /predict path for models with few labels): the Redis log
    stores the top k of each row, as /predict answered them."""
    plog.add_scores(1.0, "sc", "m", 3, ["x", "y"], ["a", "b", "c"],
                    [[0.2, 0.7, 0.1], [0.5, 0.1, 0.4]], 2)
    plog.flush(10)
    rows = plog.get("sc")
    assert [(r["index"], r["label"], r["version"]) for r in rows] == [(0, "b", 3), (1, "a", 3)]
    assert rows[1]["scores"] == {"a": 0.5, "c": 0.4}
    assert rows[0]["margin"] == pytest.approx(0.5)






def test_feedback_on_a_batch_at_once_is_all_stored(plog):
    plog.add(_rows("b", ["p", "q", "r"]))
    plog.flush(10)
    plog.add_feedback_many([("b", i, lab, "m", 1, t, "pos", lab == "x")
                            for i, (t, lab) in enumerate(zip("pqr", ["pos", "neg", "x"]))]
                           ).result(10)
    fed = {f["index"]: f for f in plog.fed_back("m")}
    assert sorted(fed) == [0, 1, 2] and fed[2]["new_label"] is True
    assert [fed[i]["truth"] for i in range(3)] == ["pos", "neg", "x"]




def test_oldest_answers_dropped_beyond_max_rows(redis_server):
    p = _log(redis_server, max_rows=10)
    try:
        for i in range(30):
            p.add(_rows(f"r{i}", [f"t{i}"]))
        p.add(_rows("other", ["o"], model="n"))
        p.flush(10)
        kept = p.recent("m", limit=100)
        assert [r["text"] for r in kept] == [f"t{i}" for i in range(29, 19, -1)]
        assert p.get("r0") == [] and p.get("r19") == [] and p.get("r20")
        assert p.get("other")  # another model keeps its rows
        # batches of 5: the bound (in answers) shrinks so that about 10 texts stay
        for i in range(40):
            p.add(_rows(f"b{i}", [f"b{i}-{j}" for j in range(5)]))
            if i % 10 == 9:
                p.flush(10)
        kept = p.recent("m", limit=1000)
        assert 5 <= len(kept) <= 20 and kept[0]["text"] == "b39-4"
        assert p.get("r29") == [] and p.get("b0") == []
        # counts are texts logged per version since the start, not the rows held
        assert p.counts("m") == {1: {"predictions": 230, "feedback": 0}}
    finally:
        p.close()


def test_close_writes_everything_queued_and_a_reopen_reads_it(redis_server):
    p = _log(redis_server, prefix="reopen")
    for i in range(200):
        p.add(_rows(f"r{i}", ["a", "b"]))
    fut = p.add_feedback("r5", 1, "neg", model="m", version=1, text="b")
    p.close()  # no flush before: close itself drains the queue
    assert fut.done() and fut.exception() is None
    q = _log(redis_server, prefix="reopen")
    try:
        assert q.counts("m") == {1: {"predictions": 400, "feedback": 1}}
        assert [r["text"] for r in q.get("r199")] == ["a", "b"]
        assert q.fed_back("m")[0]["scores"] == {"pos": 0.9, "neg": 0.1}
    finally:
        q.close()


def test_two_logs_on_one_redis_see_each_others_answers(redis_server):
    """Two nodes: what one logged, the other finds, and feedback from either joins."""
    a, b = _log(redis_server, prefix="two"), _log(redis_server, prefix="two")
    try:
        a.add(_rows("from-a", ["hello"]))
        a.flush(10)
        assert b.get("from-a")[0]["text"] == "hello"
        b.add_feedback("from-a", 0, "neg", model="m", version=1, text="hello").result(10)
        assert a.fed_back("m")[0]["truth"] == "neg" and a.counts("m")[1]["feedback"] == 1
        # a request id given again (a client's own) keeps its first answer
        b.add(_rows("from-a", ["again"]))
        b.flush(10)
        assert [r["text"] for r in a.get("from-a")] == ["hello"]
    finally:
        a.close()
        b.close()






def test_redis_down_fails_fast_with_an_oserror_and_counts_the_drops(tmp_path):
    from cluster.redis_predlog import PredlogUnreachable
    from state.storage import Storage

    server = RedisServer(str(tmp_path))
    p = _log(server)
    p.health = storage = Storage(str(tmp_path))
    try:
        p.add(_rows("up", ["a"]))
        p.flush(10)
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(PredlogUnreachable) as err:
            p.get("up")
        assert isinstance(err.value, OSError) and "unreachable" in str(err.value)
        assert err.value.status == 503 and err.value.errno is None
        fut = p.add_feedback("up", 0, "neg", model="m", version=1, text="a")
        assert isinstance(fut.exception(10), PredlogUnreachable)
        t1 = time.monotonic()
        p.add(_rows("down", ["b", "c"]))  # never blocks, never raises
        try:
            p.flush(10)  # raises when its marker went with the failed write
        except PredlogUnreachable:
            pass
        # a refused connection fails at once (no retry loop: cluster/redis_predlog.py);
        # NO_HANG only tells that from a hang, it is not a speed claim
        assert time.monotonic() - t0 < NO_HANG and t1 - t0 < NO_HANG
        assert p.dropped == 2 and p.logged == 1
        assert "the prediction log" in storage.health()["failing"]
        server.start()  # the sender's ping clears the error once Redis answers
        wait_for(lambda: "the prediction log" not in storage.health()["failing"], 20,
                 "the log's health to clear")
        assert p.get("up")[0]["text"] == "a"  # appendonly: Redis kept it
        p.add_feedback("up", 0, "neg", model="m", version=1, text="a").result(10)
    finally:
        p.close()
        server.stop()


# -- 2. and 3. the real service: two nodes on one Redis -------------------------------------
@pytest.fixture(scope="module")
def two(tiny_store, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("plog-nodes"))
    models = os.path.join(work, "models")
    shutil.copytree(tiny_store, models)
    redis = RedisServer(work)
    cfg = os.path.join(work, "config.yaml")
    with open(cfg, "w") as fh:  # a rollback on a loaded machine is noise here
        fh.write("rollout:\n  max_latency_ratio: 1000.0\n  probation_s: 0\n")
    nodes = [Node(models, redis.url, f"pl{i}", work, extra=["--config", cfg]) for i in (1, 2)]
    for n in nodes:
        n.start(wait=False)
    try:
        for n in nodes:
            wait_for(lambda: n.get("/healthz")[0] == 200, 90, f"{n.node_id} /healthz")
        code, body = nodes[0].mpost("/apply", {"name": "sent", "version": 2}, timeout=180)
        assert code == 200, body
        for n in nodes:
            wait_for(lambda: n.serving("sent") == 2, 180, f"{n.node_id} serving sent v2")
    except BaseException:
        for n in nodes:
            n.stop()
        redis.stop()
        raise

    class Two:
        pass
    t = Two()
    t.redis, t.nodes = redis, nodes
    yield t
    for n in nodes:
        n.stop()
    redis.stop()


def _predict(node: Node, body: dict, rid: str) -> dict:
    code, out = request(node.port, "POST", "/predict", body, headers={"X-Request-Id": rid})
    assert code == 200, out
    assert out["request_id"] == rid
    return out


def _feedback_soon(node: Node, body: dict) -> tuple[int, dict]:
    """POST /feedback until it is not a 404 (at most 10 s): the answering node
    writes to Redis within ~50 ms of its answer."""
    def post():
        code, out = request(node.port, "POST", "/feedback", body)
        return code != 404 and (code, out)
    return wait_for(post, 10, f"feedback for {body['request_id']} taken", interval=0.1)


def _review_ids(node: Node) -> set[str]:
    """The request ids in a node's review queue (node1's sender writes within ~50 ms)."""
    code, rv = node.mget("/models/sent/review?limit=1000")
    assert code == 200, rv
    return {i["request_id"] for i in rv["items"]}


def _fed_back(node: Node) -> int:
    code, body = node.mget("/models/sent/quality")
    assert code == 200, body
    return sum(v["feedback"] for v in body["versions"] if v["version"] == 2)


def test_feedback_on_another_node_finds_the_prediction(two):
    a, b = two.nodes
    before = _fed_back(a)
    answer = _predict(a, {"texts": ["很好", "很差"]}, "cross-node-1")
    # sent at once: node2's flush waits PEER_LAG_S for node1's sender; a loaded
    # machine may take longer, so a 404 may repeat for a moment, nothing else
    code, fb = _feedback_soon(b, {"request_id": "cross-node-1", "labels": ["pos", "neg"]})
    assert code == 200, fb
    assert fb["stored"] == 2 and fb["model"] == {"name": "sent", "version": 2}
    assert [i["predicted"] for i in fb["items"]] == \
        [p["label"] for p in answer["predictions"]]
    # the other way round, one text
    _predict(b, {"text": "喜欢"}, "cross-node-2")
    code, fb = _feedback_soon(a, {"request_id": "cross-node-2", "label": "pos"})
    assert code == 200 and fb["stored"] == 1 and fb["index"] == 0, fb
    # either node's quality report counts all three
    assert _fed_back(a) == before + 3 and _fed_back(b) == before + 3
    code, q = b.mget("/models/sent/quality")
    v2 = next(v for v in q["versions"] if v["version"] == 2)
    assert v2["predictions"] >= 3 and v2["live"]["answered"] >= 3
    # the review queue on either node shows the other node's unlabelled predictions
    _predict(a, {"text": "numbers 123"}, "cross-node-3")

    ids = wait_for(lambda: (lambda got: "cross-node-3" in got and got)(_review_ids(b)), 10,
                   "node1's prediction in node2's review queue")
    assert not {"cross-node-1", "cross-node-2"} & ids


def test_an_unknown_request_id_is_404_on_every_node(two):
    for n in two.nodes:
        code, body = request(n.port, "POST", "/feedback",
                             {"request_id": "never-asked", "label": "pos"})
        assert code == 404 and body["error"]["code"] == "unknown_request_id", body
    _predict(two.nodes[0], {"texts": ["很好", "很差"]}, "two-texts")
    code, body = request(two.nodes[1].port, "POST", "/feedback",
                         {"request_id": "two-texts", "index": 5, "label": "pos"})
    assert code == 404 and body["error"]["code"] == "unknown_index", body


def test_redis_down_feedback_answers_503_and_predictions_go_on(two):
    a, b = two.nodes
    _predict(a, {"text": "the train leaves at noon"}, "before-outage")
    wait_for(lambda: "before-outage" in _review_ids(b), 10, "the answer written to Redis")
    two.redis.kill()
    try:
        for n in (a, b):
            t0 = time.monotonic()
            code, body = request(n.port, "POST", "/feedback",
                                 {"request_id": "before-outage", "label": "pos"}, timeout=30)
            assert time.monotonic() - t0 < NO_HANG  # answers, does not hang
            assert code == 503, body
            assert body["error"]["code"] == "store_unavailable"
            assert "Redis" in body["error"]["message"] and "unreachable" in body["error"]["message"]
            code, body = request(n.mport, "GET", "/models/sent/review")
            assert code == 503 and body["error"]["code"] == "store_unavailable", body
            code, body = request(n.mport, "GET", "/models/sent/quality")
            assert code == 503 and body["error"]["code"] == "store_unavailable", body
            assert "unreachable" in body["error"]["message"]
            for i in range(5):
                out = _predict(n, {"text": "很差"}, f"during-outage-{n.node_id}-{i}")
                assert out["model"] == {"name": "sent", "version": 2}
        # the predictions above could not be logged: the storage health says so
        wait_for(lambda: "the prediction log" in a.status()["storage"]["failing"], 10,
                 "the prediction log failing in /status")
    finally:
        two.redis.start()
    # back: the error clears (the sender pings) and feedback is taken again
    wait_for(lambda: "the prediction log" not in a.status()["storage"]["failing"], 30,
             "the prediction log's health to clear")
    code, body = request(b.port, "POST", "/feedback",
                         {"request_id": "before-outage", "label": "pos"})
    assert code == 200 and body["stored"] == 1, body
