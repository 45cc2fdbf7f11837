"""Retraining with the labels: POST /train with "feedback": true and without
data (the last training's reused), the per-model retrain policy (its routes
with bad input, its persistence), and a policy that retrains on fed-back
labels, gates the result on the feedback hold-out and records why. Real
trainer and worker processes."""
from __future__ import annotations

import json
import os
import signal

import pytest

from control.policies import PolicyError, held_out, validate
from tests.helpers import ROOT, Service, request, wait_for

DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
PARAMS = {"architecture": "bow", "epochs": 3}


def _demo_rows(start: int, n: int) -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return rows[start:start + n]


# each test trains what it needs on its own service: a retraining, a policy or a
# restart in one test changes nothing another one sees, in any order
pytestmark = pytest.mark.timeout(900)  # above the waits of one test: start, training, retrain

CONFIG = ("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n"
          # the gate compares the candidate with the serving version on the hold-out;
          # a tolerance of 1 lets no accuracy difference refuse it, so the gate passes
          # and the outcome does not depend on how well two small models happen to do
          "  gate_tolerance: 1.0\n")


@pytest.fixture
def svc(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG)
    s = Service(str(tmp_path / "models"), args=["--config", str(cfg)])
    s.cfg = str(cfg)
    yield s
    s.stop()


def _train_rev(svc, rows: list[dict], params: dict = PARAMS) -> None:
    """rev v1, trained on `rows` and serving."""
    code, body = svc.mpost("/train", {"name": "rev", "data": {"examples": rows},
                                      "params": params, "apply": True})
    assert code == 202, body
    assert _wait_job(svc, body["job"]["id"])["state"] == "succeeded"
    wait_for(lambda: (svc.serving() or {}).get("name") == "rev", 60, "rev serving")


def _wait_job(svc, job_id, timeout=240):
    def done():
        code, body = svc.mget(f"/train/{job_id}")
        assert code == 200, body
        return body["job"]["state"] in ("succeeded", "failed", "cancelled") and body["job"]
    return wait_for(done, timeout, f"job {job_id}", interval=0.25)


def _history(svc, name):
    code, body = svc.mget(f"/history?name={name}&limit=200")
    assert code == 200, body
    return body["history"]


def _free_examples() -> tuple[list[dict], dict]:
    spam = [{"text": f"加微信领红包 {i} 号", "label": "spam"} for i in range(4)]
    first = _demo_rows(0, 1)[0]
    return spam, {"text": first["text"], "label": "neg" if first["label"] == "pos" else "pos"}


def test_policy_validation():
    assert validate({"retrain_after_labels": 200, "apply": "gate"}) == {
        "retrain_after_labels": 200, "apply": "gate", "holdout": 0.2}
    assert validate({"min_score": 1})["min_score"] == 1.0
    for bad in ({"apply": "sometimes"}, {"retrain_after_labels": 0},
                {"retrain_after_labels": True}, {"retrain_after_labels": 2.5},
                {"min_score": 0}, {"min_score": 1.5}, {"min_score": "0.5"},
                {"min_score": float("nan")}, {"holdout": 0.9}, {"color": "red"}, [], "gate"):
        with pytest.raises(PolicyError):
            validate(bad)
    # the hold-out is a stable share, by the text
    texts = [f"text {i}" for i in range(2000)]
    share = sum(held_out(t, 0.2) for t in texts) / len(texts)
    assert 0.15 < share < 0.25 and [held_out(t, 0.2) for t in texts[:50]] == [
        held_out(t, 0.2) for t in texts[:50]]
    assert not any(held_out(t, 0.0) for t in texts)


def test_train_with_feedback_reuses_the_last_data(svc):
    _train_rev(svc, _demo_rows(0, 300))
    # no data and no earlier training: nothing to reuse
    code, body = svc.mpost("/train", {"name": "never", "feedback": True})
    assert code == 400 and "no earlier training" in body["error"]["message"]
    for bad in ({"name": "rev", "feedback": "yes"}, {"name": "rev", "data": None},
                {"data": {"examples": []}}):
        code, body = svc.mpost("/train", bad)
        assert code == 400 and body["error"]["message"], bad
    # labels without a logged prediction: a new class and a relabelled training row
    spam, flipped = _free_examples()
    code, fb = request(svc.port, "POST", "/feedback",
                       {"model": "rev", "examples": spam + [flipped]})
    assert code == 200 and fb["new_labels"] == ["spam"], fb
    code, body = svc.mpost("/train", {"name": "rev", "feedback": True})
    assert code == 202, body
    data = body["job"]["data"]
    assert data["feedback"]["rows"] == 5 and data["feedback"]["new_labels"] == ["spam"]
    assert data["feedback"]["new_label_rows"] == 4 and data["feedback"]["relabelled"] == 1
    assert data["examples"] == 304 and data["reused"]
    assert body["job"]["params"]["epochs"] == 3  # the last training's parameters
    done = _wait_job(svc, body["job"]["id"])
    assert done["state"] == "succeeded", done
    meta = json.load(open(os.path.join(svc.models_dir, "rev", "2", "meta.json"),
                          encoding="utf-8"))
    assert "spam" in meta["labels"]
    assert svc.serving()["version"] == 1  # apply: false by default


def test_policy_routes_refuse_bad_input(store_copy):
    svc = Service(store_copy)  # the tiny store: "sent" is a model, no training needed
    try:
        _refuse_bad_policies(svc)
    finally:
        svc.stop()


def _refuse_bad_policies(svc):
    put = svc.request_put
    for body, code in (({"retrain_after_labels": 0}, 400), ({"apply": "later"}, 400),
                       ({"min_score": 0}, 400), ({"min_score": 2}, 400),
                       ({"unknown": 1}, 400), ([1], 400)):
        got, answer = put("/models/sent/policy", body)
        assert got == code and answer["error"]["code"] == "invalid_policy", (body, answer)
    got, answer = put("/models/sent/policy", raw=b"{not json")
    assert got == 400 and answer["error"]["code"] == "bad_json"
    assert put("/models/nosuch/policy", {"apply": "gate"})[0] == 404
    assert svc.mget("/models/nosuch/policy")[0] == 404
    code, body = svc.mget("/models/sent/policy")
    assert code == 200 and body["policy"] is None  # nothing set yet: unchanged by the 400s
    code, body = put("/models/sent/policy", {"retrain_after_labels": 100000, "min_score": 0.4})
    assert code == 200 and body["policy"]["apply"] == "gate" and body["source"] == "api"
    code, body = svc.request_delete("/models/sent/policy")
    assert code == 200 and body["removed"] is True and body["policy"] is None


def test_the_policy_retrains_gates_on_the_holdout_and_records_the_cause(svc):
    _train_rev(svc, _demo_rows(0, 300))
    spam, flipped = _free_examples()  # fed back before the policy: in its retraining too
    code, fb = request(svc.port, "POST", "/feedback",
                       {"model": "rev", "examples": spam + [flipped]})
    assert code == 200 and fb["stored"] == 5, fb
    code, body = svc.request_put("/models/rev/policy",
                                 {"retrain_after_labels": 30, "apply": "gate"})
    assert code == 200, body
    rows = _demo_rows(300, 30)
    code, pred = svc.predict({"texts": [r["text"] for r in rows], "model": "rev"})
    assert code == 200
    code, fb = request(svc.port, "POST", "/feedback", {"request_id": pred["request_id"],
                                                       "labels": [r["label"] for r in rows]})
    assert code == 200 and fb["stored"] == 30

    def finished():
        return [h for h in _history(svc, "rev") if h["kind"] in ("retrain_done",
                                                                  "retrain_failed")]
    done = wait_for(finished, 300, "the policy's retraining", interval=0.5)[0]
    started = [h for h in _history(svc, "rev") if h["kind"] == "retrain"]
    # counted since v1 was trained: the 5 free examples and the 30 labels
    assert started and started[0]["reason"] == "retrain after 35 labels"
    assert started[0]["source"] == "policy"
    texts = [r["text"] for r in rows] + [e["text"] for e in spam] + [flipped["text"]]
    held = sum(held_out(t, 0.2) for t in texts)
    assert started[0]["details"]["held_out"] == held
    assert started[0]["details"]["feedback"] == 35 - held
    assert done["kind"] == "retrain_done", done
    d = done["details"]
    assert d["version"] == 2 and done["reason"] == "retrain after 35 labels: v2 applied"
    gate = d["gate"]
    assert gate["golden_examples"] == held > 0  # the hold-out was the gate's golden set
    assert gate["passed"] and gate["tolerance"] == 1.0  # see CONFIG
    assert gate["serving"]["version"] == 1 and gate["candidate"]["version"] == 2
    assert d["applied"] is True and svc.serving()["version"] == 2
    code, job = svc.mget(f"/train/{d['job']}")
    fed = job["job"]["data"]["feedback"]
    assert fed["rows"] + sum(fed["waiting"].values()) == 35 - held
    code, pol = svc.mget("/models/rev/policy")
    assert pol["last_retrain"]["version"] == 2 and pol["running_job"] is None


def test_policies_survive_a_restart(svc):
    _train_rev(svc, _demo_rows(0, 60), {"architecture": "bow", "epochs": 1})
    code, body = svc.request_put("/models/rev/policy", {"retrain_after_labels": 30})
    assert code == 200, body
    code, body = svc.mget("/models/rev/policy")
    assert code == 200 and body["policy"]["retrain_after_labels"] == 30
    root, cfg = svc.models_dir, svc.cfg
    assert svc.stop(signal.SIGTERM) == 0
    again = Service(root, args=["--config", cfg])
    try:
        code, body = again.mget("/models/rev/policy")
        assert code == 200 and body["policy"] == {"retrain_after_labels": 30, "apply": "gate",
                                                  "holdout": 0.2}
        # a retrain without data still finds the last training's data after a restart
        code, body = again.mpost("/train", {"name": "rev"})
        assert code == 202 and body["job"]["data"]["reused"], body
        again.request_delete(f"/train/{body['job']['id']}")
    finally:
        again.stop()


def test_a_bad_policy_in_config_stops_the_start(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("policies:\n  news: {apply: often}\n")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, os.path.join(ROOT, "supervisor.py"), "--config",
                          str(cfg), "--models-dir", str(tmp_path / "m"), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "policies.news" in out.stderr
