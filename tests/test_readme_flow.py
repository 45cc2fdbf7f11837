"""The README's first train, apply and predict, carried through the learning
loop, as a user does it: a data file placed in `models/data/` and trained by a
relative path, the default keys read from `.textswap/keys.json` beside the
store, feedback past the retrain policy's threshold, and the policy's new
version applied; then `"feedback": true` the same way; and a retrain whose
file is gone (409 data_gone, shown in the policy, said once in the log).
The real service: real trainer and worker processes, real HTTP."""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers import ROOT, Service, keys_file, request, wait_for

DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
PARAMS = {"architecture": "bow", "epochs": 2}

pytestmark = pytest.mark.timeout(900)

CONFIG = ("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n"
          # the gate compares the candidate with the serving version on the hold-out;
          # a tolerance of 1 lets it pass whatever two small models score
          "  gate_tolerance: 1.0\n")


def _rows(start: int, n: int) -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh][start:start + n]


def _write(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


class User:
    """What a user has: the ports, and the keys the service wrote at its first start."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc
        with open(keys_file(svc.models_dir), encoding="utf-8") as fh:
            self.keys = json.load(fh)["keys"]

    def manage(self, method: str, path: str, body=None):
        return request(self.svc.mport, method, path, body, auth=False,
                       headers={"Authorization": f"Bearer {self.keys['admin']}"})

    def public(self, path: str, body, key: str | None = None):
        headers = {"Authorization": f"Bearer {self.keys[key]}"} if key else {}
        return request(self.svc.port, "POST", path, body, auth=False, headers=headers)

    def wait_job(self, job_id: str) -> dict:
        def done():
            code, body = self.manage("GET", f"/train/{job_id}")
            assert code == 200, body
            return body["job"]["state"] in ("succeeded", "failed", "cancelled") and body["job"]
        return wait_for(done, 300, f"job {job_id}", interval=0.25)

    def history(self, name: str) -> list[dict]:
        code, body = self.manage("GET", f"/history?name={name}&limit=200")
        assert code == 200, body
        return body["history"]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    cfg = root / "config.yaml"
    cfg.write_text(CONFIG)
    models = root / "models"
    svc = Service(str(models), args=["--config", str(cfg)])
    # where the README says to put the data: there from the first start, the user's own
    assert os.path.isdir(models / "data") and os.stat(models / "data").st_mode & 0o077 == 0
    yield User(svc)
    svc.stop()


def _train_by_relative_path(user: User, name: str, rows: list[dict]) -> str:
    """The README's step: the file in models/data/, trained by its relative path."""
    path = os.path.join(user.svc.models_dir, "data", f"{name}.jsonl")
    _write(path, rows)
    code, body = user.manage("POST", "/train", {"name": name, "data": {"path": f"{name}.jsonl"},
                                                "params": PARAMS})
    assert code == 202, body
    job = user.wait_job(body["job"]["id"])
    assert job["state"] == "succeeded", job
    return path


def test_the_readme_flow_retrains_through_the_policy_and_feedback_true(user):
    path = _train_by_relative_path(user, "news", _rows(0, 200))
    # the service runs in the repository; the file read is the one under models/data/
    assert not os.path.exists(os.path.join(ROOT, "news.jsonl"))
    with open(os.path.join(user.svc.models_dir, ".loop", "news.json"), encoding="utf-8") as fh:
        recorded = json.load(fh)["last_data"]
    assert recorded["path"] == os.path.realpath(path)
    assert recorded["root"] == os.path.realpath(os.path.join(user.svc.models_dir, "data"))

    code, body = user.manage("POST", "/apply", {"name": "news"})
    assert code == 200, body
    code, body = user.public("/predict", {"text": "质量太差了，退货", "model": "news"})
    assert code == 200 and body["model"] == {"name": "news", "version": 1}, body

    code, body = user.manage("PUT", "/models/news/policy",
                             {"retrain_after_labels": 20, "apply": "gate"})
    assert code == 200, body
    rows = _rows(300, 20)
    code, pred = user.public("/predict", {"texts": [r["text"] for r in rows], "model": "news"})
    assert code == 200, pred
    code, fb = user.public("/feedback", {"request_id": pred["request_id"],
                                         "labels": [r["label"] for r in rows]}, key="feedback")
    assert code == 200 and fb["stored"] == 20, fb

    def finished():
        return [h for h in user.history("news") if h["kind"] in ("retrain_done",
                                                                 "retrain_failed")]
    done = wait_for(finished, 300, "the policy's retraining", interval=0.5)[0]
    assert done["kind"] == "retrain_done" and done["details"]["applied"] is True, done
    assert done["reason"] == "retrain after 20 labels: v2 applied"
    code, body = user.public("/predict", {"text": "质量太差了，退货", "model": "news"})
    assert code == 200 and body["model"]["version"] == 2, body
    code, pol = user.manage("GET", "/models/news/policy")
    assert code == 200 and pol["state"] == "ready" and pol["blocked"] is None, pol

    # POST /train {"feedback": true}: the same file, read again from models/data/
    code, body = user.manage("POST", "/train", {"name": "news", "feedback": True})
    assert code == 202, body
    assert body["job"]["data"]["reused"] == os.path.realpath(path)
    assert body["job"]["data"]["feedback"]["rows"] >= 20 - done["details"]["held_out"]
    job = user.wait_job(body["job"]["id"])
    assert job["state"] == "succeeded" and job["result"]["version"] == 3, job
    assert "Traceback" not in user.svc.log()


def test_a_retrain_whose_file_is_gone_answers_data_gone(user):
    path = _train_by_relative_path(user, "gone", _rows(0, 120))
    code, body = user.manage("POST", "/apply", {"name": "gone"})
    assert code == 200, body
    os.remove(path)
    code, body = user.manage("POST", "/train", {"name": "gone", "feedback": True})
    assert code == 409 and body["error"]["code"] == "data_gone", body
    message = body["error"]["message"]
    assert "'gone'" in message and os.path.realpath(path) in message and "'data'" in message

    code, body = user.manage("PUT", "/models/gone/policy", {"retrain_after_labels": 5})
    assert code == 200, body
    for start in (400, 410):  # past the threshold twice: one history row, one warning
        rows = _rows(start, 6)
        code, pred = user.public("/predict", {"texts": [r["text"] for r in rows],
                                              "model": "gone"})
        assert code == 200, pred
        code, fb = user.public("/feedback", {"request_id": pred["request_id"],
                                             "labels": [r["label"] for r in rows]},
                               key="feedback")
        assert code == 200 and fb["stored"] == 6, fb

        def blocked():
            code, pol = user.manage("GET", "/models/gone/policy")
            assert code == 200, pol
            return pol["state"] == "data_gone" and pol["running_job"] is None and pol
        pol = wait_for(blocked, 60, "the policy's data_gone state", interval=0.2)
    assert pol["blocked"]["code"] == "data_gone" and "'gone'" in pol["blocked"]["message"]
    failed = [h for h in user.history("gone") if h["kind"] == "retrain_failed"]
    assert len(failed) == 1 and failed[0]["details"]["code"] == "data_gone", failed
    log = user.svc.log()
    assert "Traceback" not in log
    assert log.count("retrain policy of gone cannot retrain") == 1

    # the file back: the loop goes on (a retrain without data reads it again)
    _write(path, _rows(0, 120))
    code, body = user.manage("POST", "/train", {"name": "gone", "feedback": True})
    assert code == 202 and body["job"]["data"]["reused"] == os.path.realpath(path), body
    assert user.wait_job(body["job"]["id"])["state"] == "succeeded"
    code, pol = user.manage("GET", "/models/gone/policy")
    assert code == 200 and pol["state"] != "data_gone" and pol["blocked"] is None, pol


def _record(user: User, name: str, last_data: dict) -> None:
    """A model's recorded last training, as .loop/<name>.json holds it."""
    os.makedirs(os.path.join(user.svc.models_dir, ".loop"), exist_ok=True)
    with open(os.path.join(user.svc.models_dir, ".loop", f"{name}.json"), "w",
              encoding="utf-8") as fh:
        json.dump({"last_data": last_data, "last_params": PARAMS}, fh)


def test_a_retrain_reads_only_under_the_data_roots(user, tmp_path):
    """A recorded path outside every data root (a state file edited by hand) is
    never read: 409 data_gone, nothing queued. A record written before the data
    root was kept (a relative path resolved against the working directory, the
    repository here) is read from models/data/."""
    outside = tmp_path / "elsewhere.jsonl"
    _write(str(outside), _rows(0, 50))
    for spec in ({"path": str(outside)}, {"path": str(outside), "root": str(tmp_path)},
                 {"path": "/etc/passwd"}):
        _record(user, "far", spec)
        code, body = user.manage("POST", "/train", {"name": "far"})
        assert code == 409 and body["error"]["code"] == "data_gone", body
        assert "no longer under a data root" in body["error"]["message"], body
    code, jobs = user.manage("GET", "/train")
    assert code == 200 and not [j for j in jobs["jobs"] if j["name"] == "far"], jobs

    data = os.path.join(user.svc.models_dir, "data", "old.jsonl")
    _write(data, _rows(0, 50))
    _record(user, "old", {"path": os.path.join(ROOT, "old.jsonl")})
    code, body = user.manage("POST", "/train", {"name": "old"})
    assert code == 202 and body["job"]["data"]["reused"] == os.path.realpath(data), body
    user.manage("DELETE", f"/train/{body['job']['id']}")
