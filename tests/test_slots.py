"""Model slots with real processes: several models at once, replicas, unload,
the default model across a restart, the record migration, the worker budget
and recycling. Every service here is the real one (python supervisor.py)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from tests.helpers import ClientLoad, Service, pid_gone, wait_for


# a request this slow hangs: an idle machine answers in milliseconds, and a
# loaded one well within seconds (latency during a replacement is measured as
# a ratio by bench/slots.py, not asserted here)
HANG_S = 30.0


class Load(ClientLoad):
    """Client threads predicting for given models; records every outcome and
    how long each request took."""

    ready = 20

    def __init__(self, svc: Service, models: list[str | None], text: str = "很好") -> None:
        super().__init__(models)
        self.svc, self.text = svc, text

    def one(self, model: str | None) -> None:
        body = {"text": self.text} if model is None else {"text": self.text, "model": model}
        t0 = time.monotonic()
        try:
            code, answer = self.svc.predict(body, timeout=HANG_S)
        except OSError as exc:  # a timeout: recorded as a failure, the thread goes on
            code, answer = None, repr(exc)
        self.results.append((model, code, answer, time.monotonic() - t0))

    def count(self) -> int:
        return len(self.results)

    @property
    def failed(self) -> list:
        return [r for r in self.results if r[1] != 200]


def _start(tiny_store: str, base) -> Service:
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    # no probation: a kill -9 here must be met by a replacement replica, not by
    # the automatic rollback that probation adds (tested in test_rollouts.py)
    cfg = base / "config.yaml"
    cfg.write_text("rollout:\n  probation_s: 0\n")
    s = Service(root, args=["--config", str(cfg)])
    s.cfg = str(cfg)
    return s


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    s = _start(tiny_store, tmp_path_factory.mktemp("slots"))
    yield s
    s.stop()


@pytest.fixture
def own_svc(tiny_store, tmp_path):
    """A service of the test's own, for a test that stops it."""
    s = _start(tiny_store, tmp_path)
    yield s
    s.stop()


def _slot(svc: Service, name: str) -> dict:
    return svc.status()["models"].get(name) or {}


def test_two_models_serve_at_once_and_swap_independently(svc):
    svc.wait_standby()
    assert svc.mpost("/apply", {"name": "sent", "version": 1})[0] == 200
    code, body = svc.mpost("/apply", {"name": "topic", "default": False})
    assert code == 200 and body["default"] is False, body
    st = svc.status()
    assert st["default"] == "sent" and set(st["models"]) == {"sent", "topic"}
    topic_pids = {w["pid"] for w in st["models"]["topic"]["workers"]}

    with Load(svc, ["sent", "topic", None, "topic"]) as load:
        for version in (2, 1):
            n = load.count()
            code, body = svc.mpost("/apply", {"name": "sent", "version": version})
            assert code == 200 and body["current"]["version"] == version, body
            wait_for(lambda: load.count() > n + 20, 60, "load on the new version")
    assert load.failed == []
    for model, _, answer, _ in load.results:
        served = answer["model"]
        if model == "topic":
            assert served == {"name": "topic", "version": 1}
        else:  # named or the default: sent, on a version that was serving
            assert served["name"] == "sent" and served["version"] in (1, 2)
    assert {a["model"]["version"] for m, _, a, _ in load.results if m == "sent"} == {1, 2}
    # topic's slot was never touched by sent's swaps
    assert {w["pid"] for w in _slot(svc, "topic")["workers"]} == topic_pids


def _both(svc) -> None:
    """sent (the default) and topic serving, whatever the tests before left."""
    code, body = svc.mpost("/apply", {"name": "sent", "version": 1})
    assert code == 200, body
    code, body = svc.mpost("/apply", {"name": "topic", "default": False})
    assert code == 200, body
    st = svc.status()
    assert st["default"] == "sent" and set(st["models"]) == {"sent", "topic"}, st


def test_unknown_model_is_404_naming_what_serves(svc):
    _both(svc)
    for name in ("nope", "../x", "sent2"):
        code, body = svc.predict({"text": "x", "model": name})
        assert code == 404 and body["error"]["code"] == "model_not_serving", body
        assert "sent" in body["error"]["message"] and "topic" in body["error"]["message"]
    code, body = svc.predict({"text": "x", "model": 3})
    assert code == 400 and body["error"]["code"] == "invalid_field"
    code, body = svc.mpost("/apply", {"name": "sent", "replicas": 0})
    assert code == 400 and body["error"]["code"] == "invalid_field"
    code, body = svc.mpost("/apply", {"name": "sent", "default": "yes"})
    assert code == 400 and body["error"]["code"] == "invalid_field"
    code, body = svc.mpost("/unload", {"name": "nope"})
    assert code == 404, body


def test_replica_killed_under_load_right_after_applies(svc):
    """Two replicas; a burst of applies; then kill -9 of one replica under
    load: no request fails or hangs, and a replacement replica takes the
    killed one's place."""
    for version in (2, 1, 2):
        code, body = svc.mpost("/apply", {"name": "sent", "version": version, "replicas": 2})
        assert code == 200 and body["replicas"] == 2, body
    with Load(svc, ["sent"] * 4) as load:
        victim = _slot(svc, "sent")["workers"][0]["pid"]
        n = load.count()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: load.count() > n + 100, 60, "load after the kill")
        wait_for(lambda: len(_slot(svc, "sent").get("workers", [])) == 2 and victim not in
                 {w["pid"] for w in _slot(svc, "sent")["workers"]}, 120,
                 "a replacement replica")
        n = load.count()
        wait_for(lambda: load.count() > n + 20, 60, "load on both replicas")
    assert load.failed == []  # a request over HANG_S is a failure too
    assert all(r[2]["model"] == {"name": "sent", "version": 2} for r in load.results)
    wait_for(lambda: pid_gone(victim), 10, "the killed replica to be reaped")


def test_unload_stops_a_model_and_keeps_it_in_the_store(svc):
    _both(svc)
    pids = {w["pid"] for w in _slot(svc, "topic")["workers"]}
    code, body = svc.mpost("/unload", {"name": "topic"})
    assert code == 200 and body["unloaded"]["name"] == "topic", body
    assert body["default"] == "sent"
    code, body = svc.predict({"text": "x", "model": "topic"})
    assert code == 404 and "sent" in body["error"]["message"]
    assert "topic" not in svc.status()["models"]
    for pid in pids:
        wait_for(lambda: pid_gone(pid), 30, f"topic's worker {pid} to stop")
    assert "topic" in [m["name"] for m in svc.mget("/models")[1]["models"]]
    with open(os.path.join(svc.models_dir, ".applied.json")) as fh:
        assert list(json.load(fh)["models"]) == ["sent"]
    assert svc.predict({"text": "很好"})[0] == 200  # the default is untouched


def test_default_model_survives_a_restart(own_svc):
    svc = own_svc
    assert svc.mpost("/apply", {"name": "topic", "default": False})[0] == 200
    assert svc.mpost("/apply", {"name": "sent", "version": 1, "replicas": 1})[0] == 200
    assert svc.stop() == 0
    again = Service(svc.models_dir, args=["--config", svc.cfg])
    try:
        wait_for(lambda: again.get("/readyz")[0] == 200, 120, "the restarted service")
        wait_for(lambda: set(again.status()["models"]) == {"sent", "topic"} and all(
            m["state"] == "SERVING" for m in again.status()["models"].values()), 120,
            "both models after the restart")
        st = again.status()
        assert st["default"] == "sent" and st["models"]["sent"]["version"] == 1
        assert again.predict({"text": "很好"})[1]["model"] == {"name": "sent", "version": 1}
        code, body = again.predict({"text": "今天下雨", "model": "topic"})
        assert code == 200 and body["model"]["name"] == "topic"
    finally:
        assert again.stop() == 0


# -- budget, migration, recycling: a service with a small worker budget ---------
@pytest.fixture(scope="module")
def budget(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("budget")
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    with open(os.path.join(root, ".applied.json"), "w") as fh:  # an old-format record
        json.dump({"name": "sent", "version": 1, "applied_at": "2026-01-01T00:00:00Z"}, fh)
    cfg = base / "config.yaml"
    cfg.write_text("worker:\n  max_workers: 3\n  standby_pool: 1\n  max_requests: 150\n"
                   "rollout:\n  probation_s: 0\n")
    s = Service(root, args=["--config", str(cfg)])
    yield s
    s.stop()


def test_old_record_is_migrated(budget):
    _ready(budget)
    st = budget.status()
    assert st["default"] == "sent" and st["models"]["sent"]["version"] == 1
    assert budget.predict({"text": "很好"})[1]["model"] == {"name": "sent", "version": 1}


def test_budget_refuses_what_would_exceed_it(budget):
    _ready(budget)
    budget.wait_standby()
    before = {w["pid"] for w in budget.status()["workers"]}
    code, body = budget.mpost("/apply", {"name": "topic", "replicas": 3})
    assert code == 409 and body["error"]["code"] == "memory_budget", body
    message = body["error"]["message"]
    assert "limit of 3" in message and "needs 2 more" in message, message
    assert body["error"]["max_workers"] == 3
    st = budget.status()
    assert len(st["workers"]) <= 3 and {w["pid"] for w in st["workers"]} == before
    assert "topic" not in st["models"] and st["default"] == "sent"


def _ready(budget) -> None:
    """The migrated record's model serving (the service loads it after its start)."""
    wait_for(lambda: budget.get("/readyz")[0] == 200, 120, "the migrated record's model")


def test_recycling_replaces_workers_without_a_failed_request(budget):
    _ready(budget)
    first = _slot(budget, "sent")["workers"][0]["pid"]
    seen: set[int] = set()

    def pids() -> set[int]:
        ws = _slot(budget, "sent").get("workers", [])
        seen.update(w["pid"] for w in ws)
        return seen - {first}
    with Load(budget, ["sent", None]) as load:
        wait_for(pids, 180, "a recycled successor", interval=0.2)
        n = load.count()
        wait_for(lambda: load.count() > n + 20, 60, "load on the successor")
    assert load.failed == []
    wait_for(lambda: pid_gone(first), 30, "the recycled worker to exit")
    assert all(len(budget.status()["workers"]) <= 3 for _ in range(3))


def test_a_load_waits_for_a_draining_worker_rather_than_refuse(store_copy, tmp_path):
    """With the budget full of a worker that is draining on its way out (an
    unload waiting for an in-flight request), a load of another model waits
    for it to exit (drain_timeout + stop_timeout at most) instead of answering
    409 memory_budget. The worker is held in its drain by SIGSTOP (a request
    it cannot answer), then let go."""
    import threading

    cfg = tmp_path / "config.yaml"
    cfg.write_text("worker:\n  max_workers: 1\n  standby: false\n  drain_timeout: 120\n"
                   "training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n")
    s = Service(store_copy, args=["--config", str(cfg)])
    answers: dict[str, tuple] = {}

    def call(key: str, fn, *args, **kw) -> threading.Thread:
        t = threading.Thread(target=lambda: answers.__setitem__(key, fn(*args, **kw)))
        t.start()
        return t

    try:
        assert s.mpost("/apply", {"name": "sent"}, timeout=180)[0] == 200
        (worker,) = _slot(s, "sent")["workers"]
        pid = worker["pid"]
        os.kill(pid, signal.SIGSTOP)
        threads = []
        try:
            threads.append(call("predict", s.predict, {"text": "很好"}, timeout=240))
            wait_for(lambda: any(w["pid"] == pid and w["inflight"] >= 1
                                 for w in s.status()["workers"]), 30, "the request in flight")
            threads.append(call("unload", s.mpost, "/unload", {"name": "sent"}, timeout=240))
            wait_for(lambda: any(w["pid"] == pid and w["state"] == "DRAINING"
                                 for w in s.status()["workers"]), 30, "the worker draining")
            threads.append(call("apply", s.mpost, "/apply", {"name": "topic"}, timeout=240))
            wait_for(lambda: "waits for 1 draining worker(s) to exit" in s.log(), 30,
                     "the load waiting for the draining worker")
            assert "apply" not in answers  # it waits; it did not refuse
        finally:
            os.kill(pid, signal.SIGCONT)
        for t in threads:
            t.join(240)
        assert answers["predict"][0] == 200, answers["predict"]  # drained: answered
        assert answers["unload"][0] == 200, answers["unload"]
        assert answers["apply"][0] == 200, answers["apply"]
        wait_for(lambda: pid_gone(pid), 30, "the drained worker gone")
        assert s.predict({"text": "x", "model": "topic"})[0] == 200
    finally:
        s.stop()
