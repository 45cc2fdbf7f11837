"""Training end to end with real trainer processes: train -> publish -> apply ->
predict, bad requests, queueing, cancel and crash."""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.helpers import ROOT, Service, pid_gone, wait_for

DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")


def _demo_rows(n: int) -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh)]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    cfg = base / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\n  max_concurrent: 1\n")
    s = Service(str(base / "models"), args=["--config", str(cfg)])
    yield s
    s.stop()


def _job(svc, job_id):
    code, body = svc.mget(f"/train/{job_id}")
    assert code == 200, body
    return body["job"]


def _wait_job(svc, job_id, states=("succeeded", "failed", "cancelled"), timeout=180):
    return wait_for(lambda: _job(svc, job_id)["state"] in states and _job(svc, job_id),
                    timeout, f"job {job_id} to reach {states}", interval=0.25)


def test_train_publish_apply_predict(svc):
    rows = _demo_rows(400)
    code, body = svc.mpost("/train", {"name": "reviews", "data": {"examples": rows},
                                      "params": {"architecture": "bow", "epochs": 4}, "apply": True})
    assert code == 202, body
    job = body["job"]
    assert job["state"] in ("queued", "running")
    done = _wait_job(svc, job["id"])
    assert done["state"] == "succeeded", done
    assert done["result"] == {"name": "reviews", "version": 1}
    m = done["metrics"]
    assert set(m["per_label"]) == {"neg", "pos"} and 0.5 < m["accuracy"] <= 1.0
    assert 1 <= len(done["history"]) <= 4 and "val_accuracy" in done["history"][-1]

    meta_path = os.path.join(svc.models_dir, "reviews", "1", "meta.json")
    meta = json.load(open(meta_path, encoding="utf-8"))
    assert meta["labels"] == ["neg", "pos"]
    assert meta["data"]["examples"] == 400 and len(meta["data"]["sha256"]) == 64
    assert meta["params"]["epochs"] == 4 and "tensorflow" in meta["versions"]

    # apply: true swaps it in once trained
    wait_for(lambda: (svc.serving() or {}).get("name") == "reviews", 60, "auto-apply")
    code, body = svc.predict({"texts": ["非常好，很满意，推荐购买", "太差了，质量不好，退货"]})
    assert code == 200 and body["model"] == {"name": "reviews", "version": 1}
    assert [p["label"] for p in body["predictions"]] == ["pos", "neg"]


def test_train_from_csv_file_makes_next_version(svc):
    # its own model's v1, serving (the other tests train and apply "reviews")
    code, body = svc.mpost("/train", {"name": "csvrev", "data": {"examples": _demo_rows(300)},
                                      "params": {"architecture": "bow", "epochs": 2},
                                      "apply": True})
    assert code == 202, body
    done = _wait_job(svc, body["job"]["id"])
    assert done["state"] == "succeeded" and done["result"] == {"name": "csvrev", "version": 1}
    wait_for(lambda: (svc.status()["models"].get("csvrev") or {}).get("version") == 1, 60,
             "csvrev v1 serving")
    data_dir = os.path.join(svc.models_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, "reviews.csv")
    with open(path, "w", encoding="utf-8", newline="") as fh:
        import csv
        w = csv.writer(fh)
        w.writerow(["text", "label"])
        for r in _demo_rows(300):
            w.writerow([r["text"], r["label"]])
    code, body = svc.mpost("/train", {"name": "csvrev", "data": {"path": path},
                                      "params": {"architecture": "bow", "epochs": 2}})
    assert code == 202, body
    done = _wait_job(svc, body["job"]["id"])
    assert done["state"] == "succeeded" and done["result"]["version"] == 2
    assert svc.status()["models"]["csvrev"]["version"] == 1  # apply defaults to false
    listed = {m["name"]: m for m in svc.mget("/models")[1]["models"]}
    assert [v["version"] for v in listed["csvrev"]["versions"]] == [1, 2]


def test_bad_train_requests_are_refused_up_front(svc, tmp_path):
    good = _demo_rows(20)
    latin1 = os.path.join(svc.models_dir, "data", "latin1.csv")
    os.makedirs(os.path.dirname(latin1), exist_ok=True)
    with open(latin1, "wb") as fh:
        fh.write("text,label\ncaf\xe9,a\nna\xefve,b\n".encode("latin-1"))
    cases = [
        ({"name": "x", "data": {"path": os.path.join(svc.models_dir, "data", "nope.csv")}},
         "invalid_data", "does not exist"),
        ({"name": "x", "data": {"path": "/etc/passwd"}}, "invalid_data", "outside"),
        ({"name": "x", "data": {"path": latin1}}, "invalid_data", "UTF-8"),
        ({"name": "x", "data": {"examples": [{"text": "a"}, {"text": "b", "label": "y"}]}},
         "invalid_data", "label"),
        ({"name": "x", "data": {"examples": [{"text": "a", "label": "p"}] * 5}},
         "invalid_data", "two labels"),
        ({"name": "x", "data": {"examples": good, "labels": ["neg", "pos", "meh"]}},
         "invalid_data", "meh"),
        ({"name": "x", "data": {"examples": good + [{"text": "  ", "label": "pos"}]}},
         "invalid_data", "empty"),
        ({"name": "x", "data": {"examples": "nope"}}, "invalid_data", "list"),
        ({"name": "x", "data": {"examples": good}, "params": {"epochs": 0}},
         "invalid_params", "epochs"),
        ({"name": "x", "data": {"examples": good}, "params": {"learning_rate": "fast"}},
         "invalid_params", "learning_rate"),
        ({"name": "x", "data": {"examples": good}, "params": {"architecture": "rnn"}},
         "invalid_params", "architecture"),
        ({"name": "x", "data": {"examples": good}, "params": {"colour": 1}},
         "invalid_params", "colour"),
        ({"name": "../up", "data": {"examples": good}}, "invalid_name", "name"),
        ({"name": "data", "data": {"examples": good}}, "invalid_name", "data folder"),
        ({"name": "x", "data": {"examples": good}, "apply": "yes"}, "invalid_field", "apply"),
        ({"data": {"examples": good}}, "missing_field", "name"),
    ]
    before = len(svc.mget("/train")[1]["jobs"])
    for body, code, words in cases:
        status, got = svc.mpost("/train", body)
        assert status == 400 and got["error"]["code"] == code, (body, got)
        assert words in got["error"]["message"], got
    assert len(svc.mget("/train")[1]["jobs"]) == before  # nothing was started
    assert svc.mget("/train/nope")[0] == 404


def test_queue_cancel_and_crash(svc):
    serving_before = svc.serving()
    rows = _demo_rows(3000)
    long = {"name": "slow", "data": {"examples": rows}, "params": {"architecture": "bow", "epochs": 200,
                                                                   "early_stopping_patience": 100}}
    a = svc.mpost("/train", long)[1]["job"]
    b = svc.mpost("/train", long)[1]["job"]
    assert _job(svc, b["id"])["state"] == "queued"  # max_concurrent is 1
    # cancel the queued one: it never starts
    code, body = svc.request_delete(f"/train/{b['id']}")
    assert code == 200 and body["job"]["state"] == "cancelled"
    # cancel the running one once it is training: process stopped, nothing published
    running = wait_for(lambda: (_job(svc, a["id"])["progress"].get("epoch") or 0) >= 1
                       and _job(svc, a["id"]), 120, "job a to train")
    code, body = svc.request_delete(f"/train/{a['id']}")
    assert code == 200 and body["job"]["state"] == "cancelled"
    wait_for(lambda: pid_gone(running["pid"]), 10, "the trainer to be gone")
    assert not os.path.exists(os.path.join(svc.models_dir, "slow"))
    assert svc.request_delete(f"/train/{a['id']}")[0] == 409

    # a trainer that crashes: the job fails with its exit code and log tail
    c = svc.mpost("/train", long)[1]["job"]
    running = wait_for(lambda: _job(svc, c["id"])["progress"].get("phase") == "training"
                       and _job(svc, c["id"]), 60, "job c to start training")
    os.kill(running["pid"], signal.SIGKILL)
    failed = _wait_job(svc, c["id"])
    assert failed["state"] == "failed" and failed["exitcode"] == -9
    assert "exited with code -9" in failed["error"] and failed["log_tail"] is not None
    staging = os.path.join(svc.models_dir, ".tmp")
    assert not [e for e in os.listdir(staging) if e.startswith("stage-")]
    assert svc.serving() == serving_before  # serving untouched


def test_data_paths_are_read_from_the_store_data_folder_never_the_working_directory(svc):
    """A relative data.path is read from models/data/; the service's working
    directory (its config, an .env file) is not a data root."""
    data_dir = os.path.join(svc.models_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "rel.jsonl"), "w", encoding="utf-8") as fh:
        for r in _demo_rows(40):
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    code, body = svc.mpost("/train", {"name": "relpath", "data": {"path": "rel.jsonl"},
                                      "params": {"architecture": "bow", "epochs": 1}})
    assert code == 202, body
    assert _wait_job(svc, body["job"]["id"])["state"] == "succeeded"
    cwd_file = os.path.join(ROOT, "config.yaml")  # the service runs in ROOT
    for path, why in (("config.yaml", "does not exist"), (cwd_file, "outside"),
                      ("../../config.yaml", "outside")):
        code, body = svc.mpost("/train", {"name": "x", "data": {"path": path}})
        assert code == 400 and why in body["error"]["message"], (path, body)
