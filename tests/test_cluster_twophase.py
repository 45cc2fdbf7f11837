"""The two-phase cluster apply (cluster/twophase.py) with real Redis, real
nginx and three real nodes on one shared store of tiny models.

An apply first has every live node prepare the version (load and warm it up
beside the serving one); only then does the record write flip them all, and
each node's apply takes its prepared workers (only the swap). A node that
cannot prepare stops the apply (409 not_prepared, nothing switches), unless
"partial": true lets the ready nodes switch.

node3 runs with worker.max_workers 2: one serving worker and one more (a
standby, a probation or a prepared worker) fit, so an apply with two
replicas cannot prepare there. The skew figure (first to last node
answering the new version) is measured in bench/cluster.py; here the tests
check the order of events. The tests run in order on one module cluster;
about 2-4 minutes on a loaded 2-core machine.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from tests.clusterkit import FirstAnswer, Load, Nginx, Node, RedisServer, have_redis_and_nginx
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(not have_redis_and_nginx(),
                                reason="redis-server and nginx are not installed "
                                       "(.ci/run installs them)")

PREPARE_TIMEOUT = 20.0


def _config(path: str, extra: str = "") -> str:
    from state.config import DEFAULTS
    with open(path, "w") as fh:
        fh.write(f"cluster:\n  prepare_timeout: {PREPARE_TIMEOUT}\n")
        if "rollout" in DEFAULTS:
            # a latency-based automatic rollback on a loaded test machine is
            # noise here: these tests are about applies
            # probation_s: the version before stays loaded for the whole test
            # (node3's budget full, as the training test needs), not for 60 s
            fh.write("rollout:\n  max_latency_ratio: 1000.0\n  probation_s: 600\n")
        fh.write(extra)
    return path


@pytest.fixture(scope="module")
def tp(tiny_store, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("twophase"))
    models = os.path.join(work, "models")
    shutil.copytree(tiny_store, models)
    redis = RedisServer(work)
    common = _config(os.path.join(work, "common.yaml"))
    small = _config(os.path.join(work, "small.yaml"), "worker:\n  max_workers: 2\n")
    nodes = [Node(models, redis.url, f"node{i}", work,
                  extra=["--config", small if i == 3 else common]) for i in (1, 2, 3)]
    for n in nodes:
        n.start(wait=False)
    for n in nodes:
        wait_for(lambda: n.get("/healthz")[0] == 200, 120, f"{n.node_id} /healthz")
    for n in nodes:  # a booted standby each: the first apply loads, imports nothing
        wait_for(lambda: any(w["state"] in ("STANDBY", "READY")
                             for w in n.status().get("pool") or []), 120,
                 f"{n.node_id}'s standby")
    nginx = Nginx(work, [n.port for n in nodes])

    class Tp:
        pass
    c = Tp()
    c.work, c.models, c.redis, c.nodes, c.nginx = work, models, redis, nodes, nginx
    yield c
    nginx.stop()
    for n in nodes:
        n.stop()
    redis.stop()


def _view(node: Node) -> dict | None:
    code, body = node.mget("/cluster")
    return body if code == 200 else None


def _serves(node: Node, version: int, replicas: int = 1) -> bool:
    m = (node.status().get("models") or {}).get("sent") or {}
    return m.get("version") == version and m.get("replicas") == replicas


def _all_serve(c, version: int, replicas: int = 1, nodes: list[Node] | None = None) -> bool:
    return all(_serves(n, version, replicas) for n in (nodes or c.nodes))


def _fresh(c, version: int, check=None) -> None:
    """Every node serves sent `version` x1 with nothing in probation: sent is
    unloaded cluster-wide, then applied. The state a test starts from,
    whatever the tests before it left (they run in any order)."""
    n1 = c.nodes[0]
    code, body = n1.mpost("/unload", {"name": "sent"}, timeout=120)
    assert code in (200, 404), body  # 404: not loaded
    wait_for(lambda: all("sent" not in (n.status().get("models") or {}) for n in c.nodes), 60,
             "sent unloaded on every node")
    code, body = n1.mpost("/apply", {"name": "sent", "version": version}, timeout=240)
    assert code == 200, body
    if check:
        check(body)
    wait_for(lambda: _all_serve(c, version), 120, f"all nodes on sent v{version}")


def _revision(c) -> int:
    view = _view(c.nodes[0])
    assert view is not None
    return view["revision"]


def test_an_apply_prepares_every_node_then_flips_them_together_under_load(tp):
    n1, n2, n3 = tp.nodes

    def all_ready(body):
        assert sorted(body["cluster"]["prepare"]["ready"]) == ["node1", "node2", "node3"], body
    _fresh(tp, 1, all_ready)
    load = Load(tp.nginx.port)
    probe = FirstAnswer(tp.nodes, 2)
    try:
        wait_for(lambda: load.count() >= 50, 60, "traffic through nginx")
        t_call = time.time()
        code, body = n2.mpost("/apply", {"name": "sent", "version": 2}, timeout=120)
        assert code == 200, body
        wait_for(lambda: len(probe.first) == 3, 60, "every node answering sent v2",
                 interval=0.05)
        target = load.count() + 50
        wait_for(lambda: load.count() >= target, 60, "traffic after the apply")
    finally:
        probe.stop()
        load.stop()
    prep = body["cluster"]["prepare"]
    assert sorted(prep["ready"]) == ["node1", "node2", "node3"] and prep["not_ready"] == {}
    assert prep["partial"] is False
    # no node answered the new version before every node was prepared
    ready_at = max(a["at"] for a in prep["nodes"].values())
    assert t_call < ready_at <= min(probe.first.values()), (ready_at, probe.first)
    # how far apart the nodes flip (the skew) is a timing: bench/cluster.py --skew-only
    print(f"skew between the first and the last node answering v2: {probe.skew():.3f}s")
    # every node's own apply was only the swap: it took the prepared workers
    for n in tp.nodes:
        last = n.status()["models"]["sent"]["last_apply"]
        assert last["current"] == {"name": "sent", "version": 2}, last
        assert last["preloaded"] or last["from_probation"], (n.node_id, last)
    assert load.failed == []
    assert load.versions[("sent", 1)] > 0 and load.versions[("sent", 2)] > 0
    wait_for(lambda: (_view(n3) or {}).get("converged"), 60, "the cluster converged")


def _ghost(tp, on: bool) -> None:
    """A node that beats but never answers a prepare (hung, or partitioned
    from its own pub/sub): the coordinator must not wait for it forever."""
    import redis
    r = redis.Redis.from_url(tp.redis.url)
    if on:
        r.set("textswap:node:ghost", json.dumps({"node": "ghost", "revision": 0,
                                                  "serving": {}, "time": time.time()}),
              px=600_000)
    else:
        r.delete("textswap:node:ghost")
    r.close()


def test_a_node_that_never_answers_stops_the_apply_unless_partial(tp):
    n3 = tp.nodes[2]
    _fresh(tp, 2)
    rev = _revision(tp)
    _ghost(tp, True)
    try:
        t0 = time.monotonic()
        code, body = n3.mpost("/apply", {"name": "sent", "version": 1}, timeout=120)
        took = time.monotonic() - t0
        assert code == 409, body
        err = body["error"]
        assert err["code"] == "not_prepared" and "ghost" in err["message"]
        assert list(err["not_ready"]) == ["ghost"]
        assert err["not_ready"]["ghost"]["code"] == "prepare_timeout"
        assert sorted(err["ready"]) == ["node1", "node2", "node3"]
        # it waited the prepare timeout for the ghost (the call's own timeout
        # above is the no-hang deadline)
        assert took >= PREPARE_TIMEOUT - 0.5, took
        # nothing switched anywhere, the record did not move
        assert _revision(tp) == rev
        assert _all_serve(tp, 2)
        # partial: the ready nodes switch
        code, body = n3.mpost("/apply", {"name": "sent", "version": 1, "partial": True},
                              timeout=120)
        assert code == 200, body
        prep = body["cluster"]["prepare"]
        assert prep["partial"] is True and list(prep["not_ready"]) == ["ghost"]
        assert sorted(prep["ready"]) == ["node1", "node2", "node3"]
        wait_for(lambda: _all_serve(tp, 1), 60, "all real nodes on sent v1")
    finally:
        _ghost(tp, False)
    assert _revision(tp) > rev


def _job(node: Node, job_id: str) -> dict | None:
    code, body = node.mget(f"/train/{job_id}")
    return body["job"] if code == 200 else None


def _holds(node: Node, version: int) -> bool:
    """A worker of `node` has sent `version` loaded, READY, not serving."""
    return any(w["state"] == "READY" and w.get("model") == {"name": "sent", "version": version}
               for w in node.status().get("pool") or [])


def test_a_version_published_by_training_is_preloaded_on_every_node(tp):
    """A training job (on whichever node claims it) publishes sent v3; the
    nodes with room load it at once, so the apply that follows is the swap.
    node3's budget is full (serving + probation): it preloads nothing, and
    the apply prepares it there."""
    n1, n2, n3 = tp.nodes
    _fresh(tp, 2)
    code, body = n1.mpost("/apply", {"name": "sent", "version": 1}, timeout=240)
    assert code == 200, body  # v2 stays loaded in probation: node3's budget is full
    wait_for(lambda: _all_serve(tp, 1), 60, "all nodes on sent v1")
    examples = [{"text": t, "label": lab} for lab, ts in (
        ("pos", ["很好", "非常好用", "喜欢", "great", "love it", "好评"]),
        ("neg", ["很差", "太差了", "讨厌", "terrible", "hate it", "差评"])) for t in ts]
    code, body = n3.mpost("/train", {"name": "sent", "data": {"examples": examples},
                                     "params": {"architecture": "bow", "epochs": 2,
                                                "refit": False}})
    assert code == 202, body
    job_id = body["job"]["id"]
    job = wait_for(lambda: (lambda j: j and j["state"] in ("succeeded", "failed") and j)(
        _job(n1, job_id)), 300, "the training job to finish", interval=0.5)
    assert job["state"] == "succeeded" and job["result"]["version"] == 3, job
    for n in (n1, n2):
        wait_for(lambda: _holds(n, 3), 120, f"{n.node_id} preloading sent v3 on publish")
        assert "preloaded sent v3 x1 on publish" in n.log()
    assert all(_serves(n, 1) for n in tp.nodes)  # a preload switches nothing
    code, body = n1.mpost("/apply", {"name": "sent", "version": 3}, timeout=120)
    assert code == 200, body
    prep = body["cluster"]["prepare"]
    assert sorted(prep["ready"]) == ["node1", "node2", "node3"]
    for n in ("node1", "node2"):  # took what the publish preloaded: no load
        assert prep["nodes"][n]["s"] < prep["nodes"]["node3"]["s"], prep
    wait_for(lambda: _all_serve(tp, 3), 60, "all nodes on sent v3")


def test_a_node_that_cannot_prepare_stops_the_apply_unless_partial(tp):
    """node3's budget (worker.max_workers 2) cannot hold two more replicas."""
    n1, n2, n3 = tp.nodes
    cur = 1
    _fresh(tp, cur)
    rev = _revision(tp)
    load = Load(tp.nginx.port)
    try:
        wait_for(lambda: load.count() >= 30, 60, "traffic through nginx")
        code, body = n1.mpost("/apply", {"name": "sent", "version": 2, "replicas": 2},
                              timeout=120)
        assert code == 409, body
        err = body["error"]
        assert err["code"] == "not_prepared", body
        assert list(err["not_ready"]) == ["node3"]
        assert err["not_ready"]["node3"]["code"] == "memory_budget"
        assert "node3" in err["message"] and "max_workers" in err["message"]
        assert "nothing switched" in err["message"]
        # nothing switched on any node, the record did not move
        assert _revision(tp) == rev
        assert _all_serve(tp, cur)
        # what nodes 1 and 2 prepared for the refused apply is let go again
        # (beyond the standby pool's one worker)
        for n in (n1, n2):
            wait_for(lambda: sum(1 for w in n.status().get("pool") or []
                                 if w.get("model") == {"name": "sent", "version": 2}) <= 1,
                     60, f"{n.node_id} releasing the prepared workers")
        # partial: nodes 1 and 2 switch; node3 follows the record but cannot load it
        code, body = n1.mpost("/apply", {"name": "sent", "version": 2, "replicas": 2,
                                         "partial": True}, timeout=120)
        assert code == 200, body
        prep = body["cluster"]["prepare"]
        assert list(prep["not_ready"]) == ["node3"] and sorted(prep["ready"]) == [
            "node1", "node2"]
        wait_for(lambda: _all_serve(tp, 2, 2, [n1, n2]), 60, "nodes 1 and 2 on sent v2 x2")
        wait_for(lambda: "apply of sent v2 (watcher) failed" in n3.log(), 60,
                 "node3's own apply of the record to fail")
        view = wait_for(lambda: (lambda v: v and "node3" in v["stragglers"] and v)(_view(n1)),
                        30, "node3 listed as a straggler")
        assert view["revision"] > rev
        assert _serves(n3, cur)  # it kept serving what it had
        target = load.count() + 30
        wait_for(lambda: load.count() >= target, 60, "traffic after the apply")
    finally:
        load.stop()
    assert load.failed == []
