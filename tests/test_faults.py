"""Faults with real processes: hung, garbage-sending and crash-looping workers,
broken artifacts under load, kill -9 of the whole service, a full disk.

Hang, garbage and crash-on-every-request cannot come from a real Keras model
loaded in safe mode, so those tests set TEXTSWAP_TEST_FAULT, which makes the
worker process itself misbehave (see model_worker/worker.py `fault`). That is
the one stand-in here; the processes, pipes and recovery are all real.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from tests.helpers import ClientLoad, Service, pid_gone, wait_for


HANG_TIMEOUT = 20.0


class Load(ClientLoad):
    """Steady predict load from a few client threads; records every outcome."""

    ready_s = 30.0

    def __init__(self, svc: Service, threads: int = 2, text: str = "很好") -> None:
        super().__init__([None] * threads)
        self.svc, self.text = svc, text

    def one(self, _arg: None) -> None:
        self.results.append(self.svc.predict({"text": self.text}))

    @property
    def failed(self) -> list:
        return [r for r in self.results if r[0] != 200]


@pytest.fixture(scope="module")
def faulty(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"
    # hang_timeout: the default (20 s), far above what a request needs on a busy
    # machine, so only the injected hang is ever taken for one
    cfg.write_text(f"worker:\n  hang_timeout: {HANG_TIMEOUT}\n  request_timeout: 90.0\n"
                   "  max_restarts: 2\n  restart_window: 120.0\n")
    once = str(base / "once")
    env = {"TEXTSWAP_TEST_FAULT": ",".join([
        f"predict:hang:hangs:{once}-hang",
        f"predict:garbage:topic:{once}-garbage",
        "predict:crash:crashy",
    ])}
    s = Service(root, args=["--config", str(cfg)], env=env)
    yield s
    s.stop()


def test_broken_artifacts_are_refused_while_serving_goes_on(faulty):
    assert faulty.mpost("/apply", {"name": "sent", "version": 1})[0] == 200
    cases = [
        ("corrupt", 422, "invalid_model", "not a Keras archive"),
        ("nolabels", 422, "invalid_model", "labels"),
        ("nometa", 404, "not_found", "no model named"),
        ("mismatch", 422, "model_load_failed", "3 labels"),
        ("lambda", 422, "model_load_failed", "safe"),
    ]
    with Load(faulty) as load:
        for name, status, code, words in cases:
            got_status, body = faulty.mpost("/apply", {"name": name})
            assert (got_status, body["error"]["code"]) == (status, code), body
            assert words in body["error"]["message"], body
            assert faulty.serving()["name"] == "sent"
    assert load.failed == [] and len(load.results) > 20
    assert {r[1]["model"]["name"] for r in load.results} == {"sent"}


def test_hung_worker_is_killed_and_request_retried(faulty):
    faulty.wait_standby()
    assert faulty.mpost("/apply", {"name": "hangs"})[0] == 200
    before = faulty.status()
    victim = before["serving"]["pid"]
    t0 = time.monotonic()
    code, body = faulty.predict({"text": "很好"}, timeout=HANG_TIMEOUT + 90)  # hangs once
    took = time.monotonic() - t0
    assert code == 200 and body["model"]["name"] == "hangs", body
    # answered only after the hang was detected: by the hang check, not by chance
    assert took >= HANG_TIMEOUT, took
    st = faulty.status()
    hung = [e for e in st["recent_exits"] if "hung" in (e.get("error") or "")]
    assert [e["pid"] for e in hung] == [victim], st["recent_exits"]
    assert hung[0]["exitcode"] == -9
    assert st["restarts"] == before["restarts"] + 1
    assert faulty.serving()["pid"] != victim
    wait_for(lambda: pid_gone(victim), 10, "the hung worker to be reaped")


def test_garbage_frame_kills_worker_and_request_is_retried(faulty):
    faulty.wait_standby()
    assert faulty.mpost("/apply", {"name": "topic"})[0] == 200
    victim = faulty.serving()["pid"]
    code, body = faulty.predict({"text": "今天下雨"})  # the worker answers garbage once
    assert code == 200 and body["model"]["name"] == "topic", body
    exit_ = [e for e in faulty.status()["recent_exits"] if e["pid"] == victim][0]
    assert "protocol error" in exit_["error"]


def test_crash_loop_marks_model_failed_and_last_good_serves(faulty):
    faulty.wait_standby()
    assert faulty.mpost("/apply", {"name": "sent", "version": 2})[0] == 200
    faulty.wait_standby()
    assert faulty.mpost("/apply", {"name": "crashy"})[0] == 200  # loads fine, dies on use
    codes = []

    def failed_marked():
        codes.append(faulty.predict({"text": "x"})[0])
        return [m for m in faulty.status()["failed_models"] if m["name"] == "crashy"]

    (failed,) = wait_for(failed_marked, 150, "crashy to be marked FAILED", interval=0.2)
    assert "crashed 3 times" in failed["reason"]
    wait_for(lambda: (faulty.serving() or {}).get("name") == "sent", 60, "fallback to sent v2")
    assert faulty.serving()["version"] == 2
    code, body = faulty.predict({"text": "很好"})
    assert code == 200 and body["model"] == {"name": "sent", "version": 2}
    assert set(codes) <= {200, 503}  # requests during the loop fail cleanly, never hang


def _trainer_pid(svc):
    for child in svc.children():
        if "trainer" in " ".join(child.cmdline()) or child.name().startswith("textswap-trainer"):
            return child.pid
    return None


def test_kill_9_service_mid_publish_and_mid_apply(store_copy):
    # topic's load hangs (test fault), so its apply is really in flight at the kill
    svc = Service(store_copy, env={"TEXTSWAP_TEST_FAULT": "load:hang:topic"})
    try:
        assert svc.mpost("/apply", {"name": "sent", "version": 1})[0] == 200
        rows = [json.loads(line) for _, line in zip(range(3000), open(
            os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "demo",
                         "sentiment_zh.jsonl"), encoding="utf-8"))]
        code, body = svc.mpost("/train", {"name": "fresh", "data": {"examples": rows},
                                          "params": {"architecture": "bow", "epochs": 100}})
        assert code == 202
        jid = body["job"]["id"]
        wait_for(lambda: svc.mget(f"/train/{jid}")[1]["job"]["progress"].get("epoch", 0) >= 1,
                 120, "training to run")

        def apply_topic():
            try:
                svc.mpost("/apply", {"name": "topic"})
            except OSError:
                pass  # the service is killed under it: that is the point

        threading.Thread(target=apply_topic, daemon=True).start()

        def topic_loading():
            st = svc.status()
            return (st["models"].get("topic", {}).get("state") == "APPLYING" and
                    any(w["state"] == "LOADING" and (w["model"] or {}).get("name") == "topic"
                        for w in st["workers"]))
        wait_for(topic_loading, 60, "the apply of topic to be loading")
        kids = svc.children()
    finally:
        svc.stop(signal.SIGKILL)
    for k in kids:  # children die with their supervisor (no orphans, no late publish)
        wait_for(lambda: pid_gone(k.pid), 15, f"child {k.pid} to die with the supervisor")
    assert not os.path.exists(os.path.join(store_copy, "fresh"))
    with open(os.path.join(store_copy, ".applied.json")) as fh:
        record = json.load(fh)
    # the interrupted apply never swapped: the record still names what served
    assert record["default"] == "sent" and list(record["models"]) == ["sent"]
    record = {"name": "sent", "version": record["models"]["sent"]["version"]}
    assert record["version"] == 1

    svc2 = Service(store_copy)
    try:
        wait_for(lambda: svc2.get("/readyz")[0] == 200, 90, "the restarted service to serve")
        code, body = svc2.predict({"text": "ok"})
        assert code == 200 and body["model"] == {"name": record["name"], "version": 1}
        tmp = os.path.join(store_copy, ".tmp")
        assert not os.path.exists(tmp) or not [e for e in os.listdir(tmp)
                                               if e.startswith("stage-")]
        assert "fresh" not in [m["name"] for m in svc2.mget("/models")[1]["models"]]
    finally:
        assert svc2.stop() == 0


def test_full_disk_fails_the_job_and_serving_is_untouched(tiny_store, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m,mode=0755", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here to fill: {res.stderr.strip()}")
    try:
        root = str(mnt / "models")
        shutil.copytree(os.path.join(tiny_store, "sent"), os.path.join(root, "sent"))
        svc = Service(root, log_path=str(tmp_path / "svc.log"))
        try:
            assert svc.mpost("/apply", {"name": "sent", "version": 1})[0] == 200
            rows = [{"text": f"样本{i} {'好' if i % 2 else '差'} {i * 7919 % 1000}",
                     "label": "pos" if i % 2 else "neg"} for i in range(400)]
            code, body = svc.mpost("/train", {"name": "big", "data": {"examples": rows},
                                              "params": {"architecture": "bow", "epochs": 30}})
            assert code == 202, body
            jid = body["job"]["id"]
            wait_for(lambda: svc.mget(f"/train/{jid}")[1]["job"]["progress"].get("epoch", 0)
                     >= 1, 120, "training to run")
            with open(mnt / "filler", "wb") as fh:  # now fill the disk
                try:
                    while True:
                        fh.write(b"\0" * (1 << 20))
                        fh.flush()
                except OSError:
                    pass
            job = wait_for(lambda: (j := svc.mget(f"/train/{jid}")[1]["job"])["state"] in (
                "failed", "succeeded") and j, 180, "the job to end")
            assert job["state"] == "failed", job
            assert "No space left" in job["error"], job["error"]
            assert not os.path.exists(os.path.join(root, "big"))
            code, body = svc.predict({"text": "很好"})
            assert code == 200 and body["model"]["name"] == "sent"
        finally:
            svc.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
