"""Safe rollouts with real processes, each under load: instant rollback in
probation, automatic rollback of a crashing and of an erroring version, the
quality gate, shadow and canary candidates, promote and abort, and the
durable history across a kill -9.

Versions that crash or fail every request cannot come from a real Keras
model in safe mode, so this module sets TEXTSWAP_TEST_FAULT for two versions
of the model "roll" (see model_worker/worker.py `fault`); everything else is
real.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest

from tests.helpers import ClientLoad, Service, pid_gone, wait_for
from tests.tinymodels import EXAMPLES


class Load(ClientLoad):
    """Client threads predicting for one model; records (start, end, code, body)."""

    def __init__(self, svc: Service, model: str, threads: int = 3, text: str = "很好") -> None:
        super().__init__([None] * threads)
        self.svc, self.body = svc, {"text": text, "model": model}

    def one(self, _arg: None) -> None:
        t0 = time.monotonic()
        code, body = self.svc.predict(self.body, timeout=60)
        self.results.append((t0, time.monotonic(), code, body))

    def more(self, n: int = 30) -> None:
        start = len(self.results)
        wait_for(lambda: len(self.results) > start + n, 60, f"{n} more requests")


def _copy_version(store: str, src: str, name: str, version: int,
                  labels: list[str] | None = None) -> None:
    dst = os.path.join(store, name, str(version))
    shutil.copytree(os.path.join(store, src), dst)
    meta_path = os.path.join(dst, "meta.json")
    with open(meta_path) as fh:
        meta = json.load(fh)
    meta.update(name=name, version=version)
    if labels:
        meta["labels"] = labels
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)


def _config(base: str) -> str:
    cfg = os.path.join(base, "config.yaml")
    with open(cfg, "w") as fh:
        fh.write("rollout:\n  probation_s: 120\n  min_requests: 20\n"
                 "worker:\n  standby_pool: 2\n")
    return cfg


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("rollouts")
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    # roll: v1 good, v2 crashes on use, v3 fails every request (test faults)
    _copy_version(root, "sent/1", "roll", 1)
    _copy_version(root, "sent/2", "roll", 2)
    _copy_version(root, "sent/2", "roll", 3)
    # gated: v1 good, v2 answers with its labels swapped (a bad model), v3 good
    _copy_version(root, "sent/1", "gated", 1)
    _copy_version(root, "sent/1", "gated", 2, labels=["pos", "neg"])
    _copy_version(root, "sent/2", "gated", 3)
    cfg = _config(str(base))
    env = {"TEXTSWAP_TEST_FAULT": "predict:crash:roll@2,predict:error:roll@3"}
    s = Service(root, args=["--config", cfg], env=env)
    yield s
    s.stop()


def _rollouts(svc: Service, name: str) -> dict:
    code, body = svc.mget(f"/rollouts/{name}")
    assert code == 200, body
    return body


def _sent_v1(svc: Service) -> None:
    """sent v1 serving, nothing in probation, no candidate: the state a test
    of sent starts from, whatever the tests before it left (any order)."""
    code, body = svc.mpost("/unload", {"name": "sent"})
    assert code in (200, 404), body  # 404: not loaded
    code, body = svc.mpost("/apply", {"name": "sent", "version": 1})
    assert code == 200, body
    got = _rollouts(svc, "sent")
    assert got["probation"] is None and got["candidate"] is None, got


def test_rollback_within_probation_is_one_assignment(svc):
    svc.wait_standby()
    _sent_v1(svc)
    code, body = svc.mpost("/apply", {"name": "sent", "version": 2})
    assert code == 200 and body["probation"]["version"] == 1, body
    old_pids = {w["pid"] for w in body["old_workers"]}
    with Load(svc, "sent") as load:
        load.more()
        t_call = time.monotonic()
        code, body = svc.mpost("/rollback", {"name": "sent"})
        t_answer = time.monotonic()
        assert code == 200 and body["instant"] is True, body
        assert (body["from_version"], body["to_version"]) == (2, 1)
        # one routing assignment, timed by the server: within the call as seen from
        # here (its speed is measured by bench/rollouts.py, not asserted)
        assert isinstance(body["took_s"], float), body
        assert 0 < body["took_s"] <= t_answer - t_call, (body, t_answer - t_call)
        load.more()
    assert [r for r in load.results if r[2] != 200] == []
    after = [r[3]["model"]["version"] for r in load.results if r[0] > t_answer]
    assert after and set(after) == {1}
    before = [r[3]["model"]["version"] for r in load.results if r[1] < t_call]
    assert set(before) == {2}
    st = svc.status()["models"]["sent"]
    assert st["version"] == 1 and {w["pid"] for w in st["workers"]} == old_pids
    assert st["rolled_back"][-1]["version"] == 2 and st["rolled_back"][-1]["auto"] is False


def test_unload_stops_the_version_in_probation_too(svc):
    """Unloading a model stops its workers, the ones kept in probation as well:
    they do not hold the memory budget until probation_s (120 s here) ends."""
    _sent_v1(svc)
    code, body = svc.mpost("/apply", {"name": "sent", "version": 2})
    assert code == 200 and body["probation"]["version"] == 1, body
    kept = {w["pid"] for w in body["old_workers"]}
    assert kept and all(not pid_gone(pid) for pid in kept)
    code, body = svc.mpost("/unload", {"name": "sent"})
    assert code == 200, body
    assert kept <= {w["pid"] for w in body["workers"]}, body
    for pid in kept:
        wait_for(lambda: pid_gone(pid), 30, f"probation worker {pid} to stop")


def test_apply_back_to_the_version_in_probation_reuses_its_workers(svc):
    svc.wait_standby()
    _sent_v1(svc)
    v1_pids = {w["pid"] for w in svc.status()["models"]["sent"]["workers"]}
    code, body = svc.mpost("/apply", {"name": "sent", "version": 2})
    assert code == 200 and body["from_probation"] is False
    assert {w["pid"] for w in body["old_workers"]} == v1_pids, body
    for _ in range(3):
        assert svc.predict({"text": "很好", "model": "sent"})[0] == 200
    code, body = svc.mpost("/apply", {"name": "sent", "version": 1})
    assert code == 200 and body["from_probation"] is True, body
    # 3 requests make no p99 to judge v1's latency by (it would be their max)
    assert body["probation"]["previous_p99_ms"] is None, body
    # no process was started: v1's own workers serve again (the speed of
    # this against a cold apply: bench/rollouts.py)
    assert {w["pid"] for w in svc.status()["models"]["sent"]["workers"]} == v1_pids
    assert svc.predict({"text": "很好", "model": "sent"})[1]["model"]["version"] == 1


def _auto_rollback_in_history(svc: Service, version: int) -> None:
    def row():
        code, body = svc.mget("/history?name=roll&limit=500")
        assert code == 200, body
        return [r for r in body["history"] if r["kind"] == "rollback"
                and r["source"] == "auto" and r["from_version"] == version]
    wait_for(row, 30, f"roll v{version}'s automatic rollback in the history")  # async write


def test_crashing_new_version_is_rolled_back_automatically(svc):
    assert svc.mpost("/apply", {"name": "roll", "version": 1, "default": False})[0] == 200
    with Load(svc, "roll") as load:
        code, body = svc.mpost("/apply", {"name": "roll", "version": 2, "default": False})
        assert code == 200, body

        def rolled_back():
            return [r for r in _rollouts(svc, "roll")["rolled_back"] if r["version"] == 2]
        (info,) = wait_for(rolled_back, 60, "the automatic rollback of roll v2")
        load.more()
    assert info["auto"] is True and "crashed" in info["reason"], info
    _auto_rollback_in_history(svc, 2)
    assert [r for r in load.results if r[2] != 200] == [], "the rollback failed requests"
    assert load.results[-1][3]["model"] == {"name": "roll", "version": 1}
    # neither the watcher nor preloading brings it back
    record = os.path.join(svc.models_dir, ".applied.json")
    with open(record) as fh:
        rec = json.load(fh)
    rec["models"]["roll"]["version"] = 2
    with open(record + ".op", "w") as fh:
        json.dump(rec, fh)
    os.replace(record + ".op", record)
    wait_for(lambda: "was rolled back automatically" in svc.log(), 30,
             "the watcher to refuse roll v2")
    assert svc.status()["models"]["roll"]["version"] == 1
    assert all(not (w["model"] or {}) == {"name": "roll", "version": 2}
               for w in svc.status()["pool"])


def test_erroring_new_version_is_rolled_back_automatically(svc):
    assert svc.mpost("/apply", {"name": "roll", "version": 1, "default": False})[0] == 200
    with Load(svc, "roll") as load:
        code, body = svc.mpost("/apply", {"name": "roll", "version": 3, "default": False})
        assert code == 200, body

        def rolled_back():
            return [r for r in _rollouts(svc, "roll")["rolled_back"] if r["version"] == 3]
        (info,) = wait_for(rolled_back, 60, "the automatic rollback of roll v3")
        t_back = time.monotonic()
        load.more()
    assert info["auto"] is True and "error rate" in info["reason"], info
    _auto_rollback_in_history(svc, 3)
    assert info["figures"]["new_version"]["errors"] >= 20
    failed = [r for r in load.results if r[2] != 200]
    # only the failing version's own answers failed; none after the rollback
    assert all(r[3]["error"]["code"] == "predict_failed" for r in failed)
    assert [r for r in failed if r[0] > t_back] == []
    # judged as soon as min_requests (20) were counted, not at the next
    # once-a-second sweep: at most the 3 clients' in-flight requests more
    assert len(failed) <= 20 + 3, len(failed)
    assert load.results[-1][3]["model"] == {"name": "roll", "version": 1}


def test_quality_gate_refuses_and_passes(svc):
    examples = [{"text": t, "label": lab} for lab in ("pos", "neg") for t in EXAMPLES[lab]]
    code, body = svc.request_put("/models/gated/golden", {"data": {"examples": examples}})
    assert code == 200 and body["golden"]["examples"] == len(examples), body
    code, body = svc.mpost("/apply", {"name": "gated", "version": 1, "default": False})
    assert code == 200 and body["gate"]["passed"] and body["gate"]["serving"] is None, body
    assert body["gate"]["candidate"]["accuracy"] >= 0.9
    with Load(svc, "gated") as load:
        code, body = svc.mpost("/apply", {"name": "gated", "version": 2, "default": False})
        assert code == 409 and body["error"]["code"] == "quality_gate", body
        gate = body["error"]["gate"]
        assert gate["candidate"]["accuracy"] < gate["serving"]["accuracy"]
        assert gate["serving"]["version"] == 1 and gate["candidate"]["version"] == 2
        assert set(gate["per_label_changes"]) == {"pos", "neg"}
        code, body = svc.mpost("/apply", {"name": "gated", "version": 3, "default": False,
                                          "min_accuracy": 1.01})
        assert code == 400, body  # not a fraction
        code, body = svc.mpost("/apply", {"name": "gated", "version": 3, "default": False,
                                          "min_accuracy": 0.5})
        assert code == 200 and body["gate"]["passed"], body
        load.more(10)
    assert [r for r in load.results if r[2] != 200] == []
    code, body = svc.mpost("/apply", {"name": "gated", "version": 2, "default": False,
                                      "gate": False})
    assert code == 200 and body["gate"] == {"skipped": True}, body
    kinds = [h["kind"] for h in svc.mget("/history?name=gated")[1]["history"]]
    assert "gate_refused" in kinds and kinds.count("apply") == 3


def test_shadow_compares_without_slowing_clients(svc):
    _sent_v1(svc)

    def predict_n(n: int = 60) -> None:
        for _ in range(n):
            code, body = svc.predict({"text": "很好", "model": "sent"})
            assert code == 200 and body["model"] == {"name": "sent", "version": 1}, body
    predict_n()
    code, body = svc.mpost("/apply", {"name": "sent", "version": 2, "mode": "shadow",
                                      "fraction": 1.0, "keep_examples": 5})
    assert code == 200 and body["candidate"]["version"] == 2, body
    # the clients keep getting v1's answers (the latency the shadow adds, or
    # not, is a ratio in bench/rollouts.py)
    predict_n()
    for text in ("terrible", "今天下雨", "love it"):
        body = svc.predict({"text": text, "model": "sent"})[1]
        assert body["model"]["version"] == 1  # the serving version answers
    figures = wait_for(lambda: (c := _rollouts(svc, "sent")["candidate"]) and
                       c["compared"] >= 60 and c, 30, "shadow comparisons")
    assert figures["mode"] == "shadow" and figures["mirrored"] >= 60
    assert 0.0 <= figures["agreement_rate"] <= 1.0 and figures["mean_score_diff"] >= 0.0
    assert figures["candidate"]["requests"] >= 60 and figures["candidate"]["p50_ms"] > 0
    assert len(figures["disagreements"]) <= 5
    cand_pids = figures["workers"]
    code, body = svc.mpost("/abort", {"name": "sent"})
    assert code == 200 and body["aborted_version"] == 2, body
    assert _rollouts(svc, "sent")["candidate"] is None
    for pid in cand_pids:
        wait_for(lambda: pid_gone(pid), 30, "the shadow's worker to stop")


def test_canary_share_and_promote(svc):
    _sent_v1(svc)
    code, body = svc.mpost("/apply", {"name": "sent", "version": 2, "mode": "canary",
                                      "fraction": 0.5})
    assert code == 200, body
    svc.wait_standby()
    code, body = svc.mpost("/apply", {"name": "sent", "version": 2, "mode": "canary",
                                      "fraction": 0.1})
    assert code == 200, body
    # the replaced candidate is in the history, with its figures
    (replaced,) = [h for h in svc.mget("/history?name=sent&limit=5")[1]["history"]
                   if h["kind"] == "abort" and h["source"] == "api"
                   and h["reason"] == "replaced by a canary of v2"]
    assert replaced["details"]["fraction"] == 0.5 and replaced["to_version"] == 2
    versions: list[int] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        for _ in range(n):
            code, body = svc.predict({"text": "很好", "model": "sent"})
            assert code == 200, body
            with lock:
                versions.append(body["model"]["version"])
    threads = [threading.Thread(target=client, args=(500,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(versions) == 2000
    share = versions.count(2) / len(versions)
    assert 0.07 <= share <= 0.13, share
    figures = _rollouts(svc, "sent")["candidate"]
    cand_pids = set(figures["workers"])
    assert cand_pids and figures["candidate"]["requests"] == versions.count(2)
    assert figures["serving"]["requests"] >= versions.count(1)
    t_call = time.monotonic()
    code, body = svc.mpost("/promote", {"name": "sent"})
    t_answer = time.monotonic()
    assert code == 200 and body["to_version"] == 2, body
    assert isinstance(body["swap_s"], float), body  # timed by the server, within the call
    assert 0 < body["swap_s"] <= t_answer - t_call, (body, t_answer - t_call)
    # the candidate's own worker now serves: promoted, not started anew
    assert {w["pid"] for w in svc.status()["models"]["sent"]["workers"]} == cand_pids
    assert svc.predict({"text": "很好", "model": "sent"})[1]["model"]["version"] == 2
    assert _rollouts(svc, "sent")["probation"]["version"] == 1
    code, body = svc.mpost("/promote", {"name": "sent"})
    assert code == 409 and body["error"]["code"] == "no_candidate"
    code, body = svc.mpost("/abort", {"name": "sent"})
    assert code == 409


def test_history_survives_kill_9(store_copy):
    """Its own service: it is killed, and the rows it checks are its own."""
    svc = Service(store_copy, args=["--config", _config(os.path.dirname(store_copy))])
    killed = False
    try:
        _sent_v1(svc)
        assert svc.mpost("/apply", {"name": "sent", "version": 2})[0] == 200
        assert svc.mpost("/rollback", {"name": "sent"})[0] == 200

        def written():
            code, body = svc.mget("/history?limit=500")
            assert code == 200, body
            rows = body["history"]
            return {r["kind"] for r in rows} >= {"apply", "rollback"} and rows
        rows = wait_for(written, 30, "the apply and rollback rows")  # written by a thread
        assert svc.mget("/history?limit=0")[0] == 400
        assert svc.mget("/history?name=../x")[0] == 400
        svc.stop(signal.SIGKILL)
        killed = True
        again = Service(svc.models_dir, args=["--config", _config(os.path.dirname(store_copy))])
        try:
            code, body = again.mget("/history?limit=500")
            assert code == 200
            kept = {r["id"] for r in body["history"]}
            assert {r["id"] for r in rows} <= kept
        finally:
            again.stop()
    finally:
        if not killed:
            svc.stop()
