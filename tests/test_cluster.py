"""Cluster mode with real Redis and real nginx (Debian packages; .ci/run
installs them): three nodes on one shared model store, nginx in front.

Runtime: the Redis-only tests take a second or two. The three-node module
cluster is started once (three supervisors, each with a serving worker and
a preloading standby: about 1-2 minutes on a loaded 2-core machine) and the
tests below run in order on it; about 3-5 minutes in all.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tests.clusterkit import Load, Nginx, Node, RedisServer, have_redis_and_nginx
from tests.helpers import ROOT, free_port, request, wait_for

# above the waits of one test: nodes up (3 x 90 s), a 300 s job
pytestmark = pytest.mark.timeout(900)


# every test but the import check needs the real binaries
needs_redis_and_nginx = pytest.mark.skipif(not have_redis_and_nginx(),
                                           reason="redis-server and nginx are not installed "
                                                  "(.ci/run installs them)")


# -- the Redis side alone (no service, no TensorFlow) ------------------------------------
@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()


def _run(coro):
    return asyncio.run(coro)


def _two_queues(url: str, prefix: str, lease_a: float = 10.0, lease_b: float = 10.0):
    """Nodes "a" and "b" on one Redis and their job queues: (a, b, qa, qb)."""
    from cluster.job_queue import ClusterJobs
    from cluster.record import Cluster

    a, b = Cluster(url, "a", prefix=prefix), Cluster(url, "b", prefix=prefix)
    return a, b, ClusterJobs(a, lease_s=lease_a), ClusterJobs(b, lease_s=lease_b)


@needs_redis_and_nginx
def test_record_updates_are_atomic_and_followed(redis_server, tmp_path):
    from cluster.record import Cluster

    async def main():
        prefix = "t1"
        a = Cluster(redis_server.url, "a", prefix=prefix, cache_path=str(tmp_path / "a.json"),
                    poll_interval=0.2)
        b = Cluster(redis_server.url, "b", prefix=prefix, cache_path=str(tmp_path / "b.json"),
                    poll_interval=0.2)
        got = asyncio.Event()
        seen: list[int] = []

        def on_b(rec):
            seen.append(rec["revision"])
            if rec["revision"] >= 20:
                got.set()
        b.start(on_b, lambda: {"serving": {}})
        a.start(lambda rec: None, lambda: {"serving": {}})

        def put(name):
            def mutate(rec):
                rec["models"][name] = {"version": 1, "replicas": 1}
                rec["default"] = rec["default"] or name
                return rec
            return mutate
        # 20 concurrent read-modify-writes from two clients: none may be lost
        await asyncio.gather(*[(a if i % 2 else b).update_record(put(f"m{i}"))
                               for i in range(20)])
        rec = await a.read_record()
        assert rec["revision"] == 20
        assert sorted(rec["models"]) == sorted(f"m{i}" for i in range(20))
        await asyncio.wait_for(got.wait(), 10)
        # the cache holds the newest record, for a start while Redis is down
        cached = json.load(open(tmp_path / "b.json"))
        assert cached["revision"] == 20
        nodes = await a.nodes()
        assert {n["node"] for n in nodes} == {"a", "b"}
        await a.stop()
        await b.stop()
    _run(main())


@needs_redis_and_nginx
def test_job_queue_claims_race_to_one_winner_each(redis_server):
    async def main():
        a, b, qa, qb = _two_queues(redis_server.url, "t2race")
        ids = [await qa.new_id() for _ in range(3)]
        assert len(set(ids)) == 3
        for job_id in ids:
            await qa.enqueue({"id": job_id, "name": "x", "state": "queued"})
        # each job is claimed by exactly one of many racing claims
        claims = await asyncio.gather(*[q.claim() for q in (qa, qb) * 5])
        claimed = [c["id"] for c in claims if c]
        assert sorted(claimed) == sorted(ids)
        assert sum(c is None for c in claims) == 10 - len(ids)
        for c in claims:
            if c:
                assert c["state"] == "running" and c["node"] in ("a", "b")
        # the first-start demo's lock: one winner among racing nodes, ever
        wins = await asyncio.gather(*[c.once("demo") for c in (a, b) * 3])
        assert sum(wins) == 1 and not await b.once("demo")
        await a.stop()
        await b.stop()
    _run(main())


@needs_redis_and_nginx
def test_job_queue_leases(redis_server):
    """Claims taken in turn (no race: the lease checks always run). a's lease
    outlives the test, so a busy machine cannot expire it; b's is short and b
    never renews it: b "died"."""
    from cluster.job_queue import ClusterJobs

    async def main():
        a, b, qa, qb = _two_queues(redis_server.url, "t2", lease_a=600, lease_b=0.5)
        mine, theirs = await qa.new_id(), await qa.new_id()
        for job_id in (mine, theirs):
            await qa.enqueue({"id": job_id, "name": "x", "state": "queued"})
        # the oldest queued job first
        got = await qa.claim()
        assert (got["id"], got["node"], got["state"]) == (mine, "a", "running")
        got = await qb.claim()
        assert (got["id"], got["node"], got["state"]) == (theirs, "b", "running")
        assert await qa.claim() is None and await qb.claim() is None
        assert await qa.renew(mine) == "ok"
        assert await qb.renew(mine) == "lost"  # not b's lease
        # a cancel asked on another node reaches the runner through its renewal
        assert await qb.cancel(mine) == "requested"
        assert await qa.renew(mine) == "cancel"
        # b "dies": its lease expires and its job becomes interrupted, once
        # (reaped by a node whose lease setting is b's: a reaper waits one
        # lease after it first sees a lease missing); a's job, whose lease
        # holds, is never reaped
        reaper = ClusterJobs(a, lease_s=0.5)
        deadline = time.monotonic() + 30
        reaped: list[str] = []
        while time.monotonic() < deadline and not reaped:
            reaped += await reaper.reap()
            await asyncio.sleep(0.1)
        assert reaped == [theirs]
        assert await qa.reap() == [] and await qb.reap() == []
        assert (await qa.get(theirs))["state"] == "interrupted"
        assert await qb.save({"id": theirs, "state": "succeeded"}, "succeeded") is False
        assert (await qb.get(mine))["state"] == "running"
        assert await qa.save({"id": mine, "name": "x", "state": "succeeded"}, "succeeded")
        assert (await qb.get(mine))["state"] == "succeeded"
        await a.stop()
        await b.stop()
    _run(main())


@needs_redis_and_nginx
def test_a_lease_run_out_unreaped_is_taken_again_and_a_failover_delays_the_reaper(redis_server):
    """A store that was away (a failover) lets every lease run out alike: the
    runner, alive, takes its unreaped lease again at its next renewal, and a
    node that saw the failover reaps nothing for one lease. A job already
    reaped stays lost. The node and the job manager around ClusterTraining
    are stand-ins (a flag and an empty job table): the queue is real Redis."""
    from types import SimpleNamespace

    from cluster.job_queue import ClusterJobs
    from cluster.node import ClusterTraining
    from cluster.record import Cluster

    async def lease_gone(q, job_id):
        deadline = time.monotonic() + 30
        while await q.c.redis.exists(f"t9:lease:{job_id}"):
            assert time.monotonic() < deadline, "the lease never ran out"
            await asyncio.sleep(0.05)

    async def main():
        a = Cluster(redis_server.url, "a", prefix="t9")
        qa = ClusterJobs(a, lease_s=0.3)
        first, second = await qa.new_id(), await qa.new_id()
        for job_id in (first, second):
            await qa.enqueue({"id": job_id, "name": "x", "state": "queued"})
        assert (await qa.claim())["id"] == first
        await lease_gone(qa, first)
        assert await qa.renew(first) == "ok"  # taken again: nobody reaped it
        assert await a.redis.get(f"t9:lease:{first}") in (b"a", "a")
        # a node that saw the failover does not reap for one lease
        training = ClusterTraining(SimpleNamespace(serving=SimpleNamespace(stopping=True)), qa)
        training.attach(SimpleNamespace(jobs={}))  # runs nothing itself
        await lease_gone(qa, first)
        training.after_failover()
        await training._tick()
        assert (await qa.get(first))["state"] == "running"
        deadline = time.monotonic() + 30
        while (await qa.get(first))["state"] == "running":
            assert time.monotonic() < deadline, "never reaped after the grace"
            training._ticking = False
            await training._tick()
            await asyncio.sleep(0.05)
        assert (await qa.get(first))["state"] == "interrupted"
        assert await qa.renew(first) == "lost"  # reaped: never taken again
        # the lease of a job of another node is never taken
        assert (await qa.claim())["id"] == second
        b = Cluster(redis_server.url, "b", prefix="t9")
        assert await ClusterJobs(b, lease_s=0.3).renew(second) == "lost"
        await a.stop()
        await b.stop()
    _run(main())


@needs_redis_and_nginx
def test_a_lease_missing_once_is_not_reaped_before_a_whole_lease(redis_server):
    """A new primary may lack the runner's last renewal (replication is
    asynchronous), and a node may reach it before the runner does: the lease
    key is gone while the runner lives. Here the key is deleted by hand, as
    that new primary would lack it. The reaper ends a job only once it has
    seen its lease missing for a whole lease; a renewal in between keeps it."""
    async def main():
        a, b, qa, qb = _two_queues(redis_server.url, "t10", lease_a=600, lease_b=1.0)
        job_id = await qa.new_id()
        await qa.enqueue({"id": job_id, "name": "x", "state": "queued"})
        assert (await qa.claim())["id"] == job_id
        await a.redis.delete(f"t10:lease:{job_id}")
        assert await qb.reap() == []  # seen missing once: not yet
        assert await qa.renew(job_id) == "ok"  # the runner takes it again
        assert await qb.reap() == []
        assert (await qb.get(job_id))["state"] == "running"
        # missing again, and never renewed: reaped, a lease after it was first seen
        await a.redis.delete(f"t10:lease:{job_id}")
        first_seen = time.monotonic()
        assert await qb.reap() == []
        deadline = first_seen + 30
        reaped: list[str] = []
        while not reaped:
            assert time.monotonic() < deadline, "never reaped"
            reaped = await qb.reap()
            if not reaped:
                await asyncio.sleep(0.05)
        assert time.monotonic() - first_seen >= 1.0
        assert reaped == [job_id]
        assert (await qa.get(job_id))["state"] == "interrupted"
        assert await qa.renew(job_id) == "lost"
        await a.stop()
        await b.stop()
    _run(main())


@needs_redis_and_nginx
def test_a_claim_whose_answer_was_lost_is_taken_up_by_its_node(redis_server):
    """The claim ran on the primary, then the primary died before its answer
    came back (here: the answer is dropped): the job is running under the
    node's name and no runner knows it. The node takes it up (a fresh lease),
    once; another node does not; one a runner started is never taken up (it
    is the reaper's after a crash); one cancelled meanwhile ends cancelled."""
    async def main():
        a, b, qa, qb = _two_queues(redis_server.url, "t11", lease_a=600, lease_b=600)
        job_id = await qa.new_id()
        await qa.enqueue({"id": job_id, "name": "x", "state": "queued"})
        await qa.claim()  # its answer "lost": nothing runs it
        await a.redis.delete(f"t11:lease:{job_id}")  # a new primary may lack the lease too
        assert await qb.unstarted_claims(set()) == []  # not b's
        assert await qa.unstarted_claims({job_id}) == []  # running here already
        got = await qa.unstarted_claims(set())
        assert [d["id"] for d in got] == [job_id] and got[0]["state"] == "running"
        assert await a.redis.get(f"t11:lease:{job_id}") == "a"  # a fresh lease, a's
        # started: the runner's document replaces the submitter's
        assert await qa.save({"id": job_id, "name": "x", "state": "running"})
        assert await qa.unstarted_claims(set()) == []
        # a second lost claim, cancelled before the node took it up
        other = await qa.new_id()
        await qa.enqueue({"id": other, "name": "y", "state": "queued"})
        await qa.claim()
        assert await qb.cancel(other) == "requested"
        assert await qa.unstarted_claims({job_id}) == []
        assert (await qb.get(other))["state"] == "cancelled"
        assert await a.redis.sismember("t11:running", other) == 0
        await a.stop()
        await b.stop()
    _run(main())


@needs_redis_and_nginx
def test_a_record_lost_by_redis_is_written_back_from_a_node(redis_server, tmp_path):
    """Redis restarted without its data: the nodes' cached record comes back."""
    from cluster.record import Cluster

    async def main():
        a = Cluster(redis_server.url, "a", prefix="t4", cache_path=str(tmp_path / "a.json"),
                    poll_interval=0.1)
        rec = await a.update_record(lambda r: {**r, "models": {"x": {"version": 3}},
                                               "default": "x"})
        a.start(lambda r: None, lambda: {"serving": {}})
        await a.redis.delete(a.k_record)  # what an empty Redis looks like to the node
        deadline = time.monotonic() + 10
        back = None
        while time.monotonic() < deadline and back is None:
            await asyncio.sleep(0.1)
            back = await a.read_record()
        assert back is not None and back["revision"] == rec["revision"]
        assert back["models"]["x"]["version"] == 3
        await a.stop()
    _run(main())


@needs_redis_and_nginx
def test_redis_down_answers_unreachable(tmp_path):
    from cluster.record import Cluster, ClusterUnreachable

    server = RedisServer(str(tmp_path))

    async def main():
        c = Cluster(server.url, "a", prefix="t3", cache_path=str(tmp_path / "c.json"))
        await c.update_record(lambda rec: {**rec, "models": {"x": {"version": 2}},
                                           "default": "x"})
        server.kill()
        t = time.monotonic()
        with pytest.raises(ClusterUnreachable) as err:
            await c.update_record(lambda rec: rec)
        assert err.value.status == 503 and "unreachable" in str(err.value)
        assert time.monotonic() - t < 30  # answers, not hangs (no retry loop in the client)
        # a node started now has the cached record
        d = Cluster(server.url, "d", prefix="t3", cache_path=str(tmp_path / "c.json"))
        assert d.record["models"]["x"]["version"] == 2 and d.record["revision"] == 1
        await c.stop()
        await d.stop()
    _run(main())


def test_cluster_modules_never_import_tensorflow():
    code = ("import sys, supervisor, cluster.record, cluster.job_queue, cluster.node, "
            "frontend.clusterapi; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@needs_redis_and_nginx
def test_a_node_refuses_to_start_on_a_store_it_cannot_write(tmp_path, redis_server):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's parent folder should be")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "supervisor.py"), "--models-dir",
                          str(blocker / "models"), "--redis-url", redis_server.url,
                          "--port", str(free_port()), "--manage-port", str(free_port())],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "not writable" in res.stderr and str(blocker / "models") in res.stderr


# -- three nodes, one shared store, Redis, nginx in front -------------------------------
@pytest.fixture(scope="module")
def cl(tiny_store, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("cluster"))
    models = os.path.join(work, "models")
    shutil.copytree(tiny_store, models)
    redis = RedisServer(work)
    extra: list[str] = []
    from state.config import DEFAULTS
    if "rollout" in DEFAULTS:
        # a latency-based automatic rollback is a legitimate record change, but
        # on a loaded test machine it is noise here: these tests are about
        # the cluster following applies
        cfg = os.path.join(work, "config.yaml")
        with open(cfg, "w") as fh:
            fh.write("rollout:\n  max_latency_ratio: 1000.0\n")
        extra = ["--config", cfg]
    nodes = [Node(models, redis.url, f"node{i}", work, extra=extra) for i in (1, 2, 3)]
    for n in nodes:
        n.start(wait=False)
    for n in nodes:
        wait_for(lambda: n.get("/healthz")[0] == 200, 90, f"{n.node_id} /healthz")
    nginx = Nginx(work, [n.port for n in nodes])

    class Cl:
        pass
    c = Cl()
    c.work, c.models, c.redis, c.nodes, c.nginx = work, models, redis, nodes, nginx
    yield c
    nginx.stop()
    for n in nodes:
        n.stop()
    redis.stop()


def _cluster(node: Node) -> dict:
    code, body = node.mget("/cluster")
    assert code == 200, body
    return body


def _view(node: Node) -> dict | None:
    """GET /cluster for a polling predicate: None on a transient non-200."""
    code, body = node.mget("/cluster")
    return body if code == 200 else None


def _job(node: Node, job_id: str) -> dict | None:
    """GET /train/<id> for a polling predicate: None on a transient non-200."""
    code, body = node.mget(f"/train/{job_id}")
    return body["job"] if code == 200 else None


def _all_on(c, version: int, revision: int, nodes: list[Node] | None = None) -> bool:
    """Every given node's heartbeat says it serves sent `version` at `revision` or later."""
    want = {n.node_id for n in (nodes or c.nodes)}
    view = _view((nodes or c.nodes)[0])
    if view is None:
        return False
    beats = {b["node"]: b for b in view["nodes"]}
    return want <= set(beats) and all(
        beats[n]["revision"] >= revision
        and beats[n]["serving"].get("sent", {}).get("version") == version for n in want)


def _settled(c, min_revision: int) -> dict | bool:
    """The record is at min_revision or later and every node serves it: each
    node's view agrees, no stragglers, heartbeats and /status match. (The
    record's version may differ from the one applied: a node's automatic
    rollback is a change of the record too, and every node follows it.)"""
    views = [_view(n) for n in c.nodes]
    if any(v is None for v in views):
        return False
    rec = views[0]["record"]
    if rec is None or rec["revision"] < min_revision:
        return False
    version = rec["models"]["sent"]["version"]
    return all(v["record"] == rec and not v["stragglers"] for v in views) and \
        _all_on(c, version, rec["revision"]) and \
        all(n.serving("sent") == version for n in c.nodes) and rec


def _load_until(load: Load, extra: int, timeout: float = 60) -> None:
    """Let `extra` more requests succeed (proves traffic flowed through the event)."""
    target = load.count() + extra
    try:
        wait_for(lambda: load.count() >= target, timeout, f"{extra} more answered requests")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {len(load.failed)} failed, the last: "
                             f"{load.failed[-3:]}") from None


@needs_redis_and_nginx
def test_an_apply_on_node2_reaches_all_nodes_under_load(cl):
    n1, n2, n3 = cl.nodes
    code, body = n1.mpost("/apply", {"name": "sent", "version": 1}, timeout=180)
    assert code == 200, body
    assert body["cluster"]["node"] == "node1" and "node1" in body["cluster"]["nodes_serving"]
    wait_for(lambda: _all_on(cl, 1, body["cluster"]["revision"]), 180, "all nodes on sent v1")
    view = _cluster(n3)
    assert {b["node"] for b in view["nodes"]} == {"node1", "node2", "node3"}
    assert view["stragglers"] == [] and view["converged"]
    assert view["record"]["models"]["sent"]["version"] == 1
    load = Load(cl.nginx.port)
    try:
        _load_until(load, 50)
        code, body = n2.mpost("/apply", {"name": "sent", "version": 2}, timeout=60)
        assert code == 200, body
        rev = body["cluster"]["revision"]
        assert body["cluster"]["node"] == "node2" and rev > view["record"]["revision"]
        # it reaches the other nodes, by a swap where a standby preloaded v2,
        # else by a load (a bound about not hanging, as for v1 above: how fast
        # it spreads, against the apply's own time, is measured in bench/cluster.py)
        wait_for(lambda: _all_on(cl, 2, rev), 180, "all nodes on sent v2", interval=0.05)
        _load_until(load, 50)
    finally:
        load.stop()
    # each node's own view agrees with the record (and with its heartbeat)
    wait_for(lambda: _settled(cl, rev), 60, "every node on the record")
    assert load.failed == []
    assert load.versions[("sent", 2)] > 0 and load.versions[("sent", 1)] > 0


@needs_redis_and_nginx
def test_racing_applies_end_on_one_revision(cl):
    n1, n2, _ = cl.nodes
    answers: dict[str, tuple] = {}

    def apply(node: Node, version: int) -> None:
        answers[node.node_id] = node.mpost("/apply", {"name": "sent", "version": version},
                                           timeout=180)
    threads = [threading.Thread(target=apply, args=(n1, 1)),
               threading.Thread(target=apply, args=(n2, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert all(code == 200 for code, _ in answers.values()), answers
    revs = sorted(body["cluster"]["revision"] for _, body in answers.values())
    assert revs[0] != revs[1]  # two atomic updates, neither lost

    rec = wait_for(lambda: _settled(cl, revs[1]), 120, "every node on the record's revision",
                   interval=0.2)
    for n in cl.nodes:
        assert n.serving("sent") == rec["models"]["sent"]["version"]
        assert n.status()["record_revision"] >= rec["revision"]


@needs_redis_and_nginx
def test_a_job_submitted_on_node1_runs_once_and_every_node_shows_it(cl):
    n1 = cl.nodes[0]
    examples = [{"text": t, "label": lab} for lab, ts in (
        ("pos", ["很好", "非常好用", "喜欢", "great", "love it", "好评"]),
        ("neg", ["很差", "太差了", "讨厌", "terrible", "hate it", "差评"])) for t in ts]
    code, body = n1.mpost("/train", {"name": "clusterjob", "data": {"examples": examples},
                                     "params": {"architecture": "bow", "epochs": 2,
                                                "refit": False}})
    assert code == 202, body
    job_id = body["job"]["id"]

    def done():
        jobs = [_job(n, job_id) for n in cl.nodes]
        if any(j is None for j in jobs):
            return False
        states = {j["state"] for j in jobs}
        return states <= {"succeeded", "failed"} and len(states) == 1 and jobs
    jobs = wait_for(done, 300, "the job finished, seen from every node", interval=0.5)
    assert jobs[0]["state"] == "succeeded", jobs[0]
    runner = jobs[0]["node"]
    assert runner in {"node1", "node2", "node3"}
    assert all(j["node"] == runner and j["result"] == {"name": "clusterjob", "version": 1}
               for j in jobs)
    # exactly once: one node claimed it, one version was published
    claimed = [n.node_id for n in cl.nodes if f"job {job_id} (clusterjob) claimed" in n.log()]
    assert claimed == [runner]
    assert sorted(os.listdir(os.path.join(cl.models, "clusterjob"))) == ["1"]
    for n in cl.nodes:  # listed on every node
        code, body = n.mget("/train")
        assert code == 200 and job_id in [j["id"] for j in body["jobs"]]


@needs_redis_and_nginx
def test_a_job_cancelled_on_another_node_stops_where_it_runs(cl):
    n1, _, n3 = cl.nodes
    examples = [{"text": f"{w} {i}", "label": lab} for lab, w in (("a", "好"), ("b", "差"))
                for i in range(20)]
    code, body = n1.mpost("/train", {"name": "cancelme", "data": {"examples": examples},
                                     "params": {"architecture": "bow", "epochs": 500,
                                                "early_stopping_patience": 100}})
    assert code == 202, body
    job_id = body["job"]["id"]
    job = wait_for(lambda: (lambda j: j and j["state"] == "running" and j)(_job(n3, job_id)),
                   120, "the job running on some node")
    # cancel it from a node that does not run it: the runner learns it from Redis
    other = next(n for n in cl.nodes if n.node_id != job["node"])
    code, body = request(other.mport, "DELETE", f"/train/{job_id}")
    assert code == 200, body
    wait_for(lambda: all((_job(n, job_id) or {}).get("state") == "cancelled"
                         for n in cl.nodes), 60, "the job cancelled, seen from every node")
    assert not os.path.exists(os.path.join(cl.models, "cancelme"))  # nothing published
    code, body = request(n3.mport, "DELETE", f"/train/{job_id}")
    assert code == 409 and body["error"]["code"] == "conflict"


def _listed(cl) -> set[str] | None:
    """The nodes node1 lists as alive (their heartbeats); None on a transient error."""
    view = _view(cl.nodes[0])
    return {b["node"] for b in view["nodes"]} if view else None


def _serving_sent(c) -> dict:
    """The scene for a test under load: every node serves `sent` as the
    default (tests run in any order; the store starts with nothing applied).
    Returns the record."""
    n1 = c.nodes[0]
    rec = _cluster(n1)["record"]
    if not rec or "sent" not in rec["models"] or rec["default"] != "sent":
        code, body = n1.mpost("/apply", {"name": "sent", "version": 1}, timeout=180)
        assert code == 200, body
        rec = _cluster(n1)["record"]
    version = rec["models"]["sent"]["version"]
    wait_for(lambda: _all_on(c, version, rec["revision"]), 180, f"all nodes on sent v{version}")
    return rec


@needs_redis_and_nginx
def test_kill_9_of_a_node_under_load_fails_no_request(cl):
    n3 = cl.nodes[2]
    _serving_sent(cl)
    load = Load(cl.nginx.port)
    try:
        try:
            _load_until(load, 100)
            n3.kill()
            _load_until(load, 300)
        finally:
            load.stop()
        assert load.failed == []
        # its heartbeat expires: the other nodes stop listing it
        wait_for(lambda: (lambda got: got is not None and "node3" not in got)(_listed(cl)), 30,
                 "node3's heartbeat to expire")
    finally:  # node3 back for the tests after this one (they run in any order)
        if n3.proc is not None and n3.proc.poll() is not None:
            n3.start()
        wait_for(lambda: "node3" in (_listed(cl) or set()), 60, "node3 listed")


@needs_redis_and_nginx
def test_redis_outage_keeps_serving_refuses_changes_then_converges(cl):
    n1, n2, n3 = cl.nodes
    before = _serving_sent(cl)
    n3.kill()  # it restarts during the outage
    serving = before["models"]["sent"]["version"]
    other = 1 if serving == 2 else 2
    load = Load(cl.nginx.port)
    try:
        _load_until(load, 50)
        cl.redis.kill()
        code, body = n1.mpost("/apply", {"name": "sent", "version": other}, timeout=30)
        assert code == 503 and body["error"]["code"] == "cluster_unreachable", body
        assert "unreachable" in body["error"]["message"]
        code, body = n2.mpost("/train", {"name": "x", "data": {"examples": [
            {"text": "a", "label": "p"}, {"text": "b", "label": "p"},
            {"text": "c", "label": "n"}, {"text": "d", "label": "n"}]}})
        assert code == 503 and body["error"]["code"] == "cluster_unreachable", body
        assert n1.mget("/cluster")[0] == 503
        # a node started while Redis is down serves its last known record
        n3.start()
        wait_for(lambda: n3.get("/readyz")[0] == 200, 180, "node3 ready from its cache")
        code, body = request(n3.port, "POST", "/predict", {"text": "很好"})
        assert code == 200 and body["model"] == {"name": "sent", "version": serving}
        _load_until(load, 100)
        cl.redis.start()
        # once Redis is back, an apply goes through and reaches every node
        def applied():
            code, body = n1.mpost("/apply", {"name": "sent", "version": other}, timeout=60)
            assert code in (200, 503), body
            return code == 200 and body
        body = wait_for(applied, 60, "an apply after Redis came back", interval=0.5)
        rev = body["cluster"]["revision"]
        assert rev > before["revision"]
        assert body["current"] == {"name": "sent", "version": other}
        wait_for(lambda: _settled(cl, rev), 120, "all nodes on the record after the outage")
        _load_until(load, 50)
    finally:
        load.stop()
    assert load.failed == []


@needs_redis_and_nginx
def test_a_hostile_job_from_redis_is_refused_and_deletes_nothing(cl):
    """A job document in the Redis queue is untrusted: an id that is a path
    (absolute, or out of the jobs folder) would have become the job's folder,
    deleted when it ends. The node that claims it fails it, naming why."""
    import redis as redis_lib

    from state.store import TMP

    victim = os.path.join(cl.work, "victim")
    os.makedirs(victim, exist_ok=True)
    with open(os.path.join(victim, "keep.txt"), "w") as fh:
        fh.write("must survive")
    jobs_root = os.path.join(cl.models, TMP, "jobs")
    good = {"name": "hostile", "params": {"architecture": "bow", "epochs": 1},
            "data": {"count": 0}, "apply": False}
    hostile = {"abs": {**good, "id": victim},
               "rel": {**good, "id": os.path.relpath(victim, jobs_root)},
               "params": {**good, "id": "20260101000000-77",
                            "params": {"architecture": "bow", "epochs": -5}}}
    r = redis_lib.Redis.from_url(cl.redis.url, decode_responses=True)
    for doc in hostile.values():
        with r.pipeline(transaction=True) as pipe:
            pipe.hset(f"textswap:job:{doc['id']}", mapping={"doc": json.dumps(doc),
                                                           "state": "queued", "node": ""})
            pipe.rpush("textswap:queue", doc["id"])
            pipe.rpush("textswap:joblist", doc["id"])
            pipe.publish("textswap:events", "jobs")
            pipe.execute()

    def refused():
        states = [r.hget(f"textswap:job:{d['id']}", "state") for d in hostile.values()]
        return all(s == "failed" for s in states) and states
    wait_for(refused, 60, "the hostile jobs failed by the node that claimed them")
    for doc in hostile.values():
        saved = json.loads(r.hget(f"textswap:job:{doc['id']}", "doc"))
        assert saved["state"] == "failed" and saved["error"].startswith("refused: "), saved
    assert "not a job id" in json.loads(r.hget(f"textswap:job:{victim}", "doc"))["error"]
    assert open(os.path.join(victim, "keep.txt")).read() == "must survive"
    assert not os.path.exists(os.path.join(cl.models, "hostile"))  # nothing trained
    r.close()


@needs_redis_and_nginx
def test_redis_needs_its_password_and_no_node_shows_it(cl):
    """The test Redis (as `make cluster`'s) is bound to loopback with a
    generated password (AUTH); the nodes got the URL in their environment: it
    is on no command line, in no log, in no /status or /cluster body."""
    import psutil
    import redis as redis_lib

    password = cl.redis.password
    plain = redis_lib.Redis(host="127.0.0.1", port=cl.redis.port)
    with pytest.raises(redis_lib.AuthenticationError):  # NOAUTH: the password is needed
        plain.get("textswap:record")
    plain.close()
    for n in cl.nodes:
        for p in [psutil.Process(n.proc.pid), *psutil.Process(n.proc.pid).children(True)]:
            try:
                assert password not in " ".join(p.cmdline())
                if p.pid != n.proc.pid:
                    assert password not in open(f"/proc/{p.pid}/environ", "rb").read().decode(
                        errors="replace")
            except (psutil.NoSuchProcess, FileNotFoundError):
                continue
        for path in ("/status", "/cluster"):
            code, body = n.mget(path)
            assert code == 200 and password not in json.dumps(body), path
        assert _cluster(n)["this_node"]["redis"] == f"redis://:***@127.0.0.1:{cl.redis.port}/0"
        assert password not in n.log()
