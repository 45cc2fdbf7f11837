"""The `textswap` commands that tests/test_cli.py does not reach, run as real
subprocesses against a real service: `unload`, `train --feedback` and
`serve` (docs/cli.md).

One service for the module (tiny real models, a management token); each test
builds the state it needs, so any test runs alone or in any order."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid

import pytest

from tests.helpers import Service, free_port, keys_file, request, wait_for
from tests.test_cli import DEMO, TOKEN, run, textswap_cmd

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("climore")
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n"
                   "worker:\n  standby_pool: 0\n")
    s = Service(root, args=["--config", str(cfg)],
                env={"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN, "TEXTSWAP_FEEDBACK_KEY": TOKEN + "-feedback"})
    yield s
    s.stop()


def api(svc: Service, method: str, path: str, body=None) -> dict:
    code, answer = request(svc.mport, method, path, body, headers=AUTH, timeout=300)
    assert code in (200, 202), (method, path, code, answer)
    return answer


def _status(svc: Service) -> dict:
    return api(svc, "GET", "/status")


def test_unload_stops_serving_the_model(svc):
    api(svc, "POST", "/apply", {"name": "topic", "default": False})
    assert svc.predict({"text": "桌子", "model": "topic"})[0] == 200
    pids = [w["pid"] for w in _status(svc)["workers"] if (w["model"] or {}).get("name") == "topic"]
    assert pids
    p = run(svc, "unload", "topic")
    assert p.returncode == 0, p.stderr
    assert "unloaded topic" in p.stdout
    assert "topic" not in _status(svc)["models"]
    code, body = svc.predict({"text": "桌子", "model": "topic"})
    assert code == 404 and body["error"]["code"] == "model_not_serving", body
    # its workers drain and exit
    wait_for(lambda: not [w for w in _status(svc)["workers"] if w["pid"] in pids], 60,
             "topic's workers gone")
    # again: the server refuses (exit code 1), with its reason
    p = run(svc, "unload", "topic")
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "topic" in p.stderr


def test_unload_json_is_the_servers_answer(svc):
    api(svc, "POST", "/apply", {"name": "topic", "default": False})
    p = run(svc, "--json", "unload", "topic")
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)
    assert answer["unloaded"] == {"name": "topic", "version": 1}, answer
    assert "topic" not in _status(svc)["models"]


def _rows(n: int) -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh)]


def _wait_job(svc: Service, job_id: str) -> dict:
    def done():
        j = api(svc, "GET", f"/train/{job_id}")["job"]
        return j["state"] in ("succeeded", "failed", "cancelled") and j
    return wait_for(done, 240, f"job {job_id}", interval=0.25)


def test_train_feedback_folds_the_labels_into_the_last_data(svc):
    name = f"fb{uuid.uuid4().hex[:6]}"
    rows = _rows(80)
    job = api(svc, "POST", "/train", {"name": name, "data": {"examples": rows},
                                      "params": {"architecture": "bow", "epochs": 1}})["job"]
    job = _wait_job(svc, job["id"])
    assert job["state"] == "succeeded", job
    api(svc, "POST", "/apply", {"name": name, "default": False})
    # feedback: a training text relabelled, and a new text
    first = rows[0]
    flipped = "neg" if first["label"] == "pos" else "pos"
    for rid, text, label in ((f"{name}-a", first["text"], flipped),
                             (f"{name}-b", "这是一条全新的评论 完全没见过", "pos")):
        code, got = request(svc.port, "POST", "/predict", {"text": text, "model": name},
                            headers={"X-Request-Id": rid})
        assert code == 200, got
        code, fb = request(svc.port, "POST", "/feedback", {"request_id": rid, "label": label},
                           headers=svc.auth("feedback"))
        assert code == 200 and fb["stored"] == 1, fb
    # no DATA: refused as a usage error unless --feedback
    p = run(svc, "train", name)
    assert p.returncode == 2 and "--feedback" in p.stderr, (p.stdout, p.stderr)
    p = run(svc, "train", name, "--feedback", "--wait", "--json")
    assert p.returncode == 0, p.stderr
    job = json.loads(p.stdout)["job"]
    assert job["state"] == "succeeded" and job["result"]["version"] == 2, job
    folded = job["data"]["feedback"]
    assert folded["rows"] == 2 and folded["relabelled"] == 1 and folded["added"] == 1, folded
    assert job["data"]["examples"] == len(rows) + 1, job["data"]
    assert job["params"]["architecture"] == "bow"  # the last training's params too


def test_serve_runs_the_service_with_paths_relative_to_the_caller(svc, tiny_store, tmp_path):
    """`textswap serve` execs the service in the foreground (same pid, signals
    go straight to it); a relative --models-dir is the caller's folder's."""
    shutil.copytree(tiny_store, str(tmp_path / "here"))
    cfg = tmp_path / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\nworker:\n  standby_pool: 0\n")
    port, mport = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTSWAP_")}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([*textswap_cmd(), "serve", "--config", "config.yaml",
                             "--models-dir", "here", "--host", "127.0.0.1",
                             "--port", str(port), "--manage-port", str(mport)],
                            cwd=str(tmp_path), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: request(port, "GET", "/healthz")[0] == 200, 60, "the served /healthz")
        # the keys it generated, beside the caller's ./here
        with open(keys_file(str(tmp_path / "here")), encoding="utf-8") as fh:
            admin = {"Authorization": "Bearer " + json.load(fh)["keys"]["admin"]}
        code, body = request(mport, "POST", "/apply", {"name": "sent", "version": 1},
                             headers=admin)
        assert code == 200, body
        code, got = request(port, "POST", "/predict", {"text": "很好"})
        assert code == 200 and got["model"] == {"name": "sent", "version": 1}, got
        # the store is the caller's ./here: the applied record is written there
        with open(tmp_path / "here" / ".applied.json") as fh:
            assert json.load(fh)["models"]["sent"]["version"] == 1
        code, st = request(mport, "GET", "/status", headers=admin)
        assert code == 200 and st["supervisor"]["pid"] == proc.pid  # exec'd, not a child
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
