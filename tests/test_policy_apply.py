"""A retrain policy's `apply` other than `gate`, in a real retraining (real
trainer and worker processes, real HTTP): `canary` (the new version becomes a
canary candidate), `none` (published only), and `swap` (applied without the
quality gate), the last one set in config.yaml and read at start
(docs/loop.md "The retrain policy", control/policies.py).

Each test trains its own model (bow, one epoch, 80 demo reviews), so the
tests run alone or in any order; six short trainings in all."""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers import ROOT, Service, request, wait_for

DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")


def _demo_rows(start: int, n: int) -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return rows[start:start + n]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    base = tmp_path_factory.mktemp("policyapply")
    cfg = base / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n"
                   "worker:\n  standby_pool: 0\n"
                   "policies:\n  cfgswap: {retrain_after_labels: 3, apply: swap}\n")
    s = Service(str(base / "models"), args=["--config", str(cfg)])
    yield s
    s.stop()


def _ok(answer: tuple[int, dict], *codes: int) -> dict:
    code, body = answer
    assert code in (codes or (200,)), (code, body)
    return body


def _train_v1(svc: Service, name: str) -> None:
    job = _ok(svc.mpost("/train", {"name": name, "data": {"examples": _demo_rows(0, 80)},
                                   "params": {"architecture": "bow", "epochs": 1},
                                   "apply": True}), 202)["job"]

    def applied():
        j = _ok(svc.mget(f"/train/{job['id']}"))["job"]
        assert j["state"] not in ("failed", "cancelled"), j
        return j["state"] == "succeeded" and j.get("applied") is not None and j
    j = wait_for(applied, 240, f"{name} v1 trained and applied", interval=0.25)
    assert j["result"]["version"] == 1 and not (j["applied"] or {}).get("error"), j
    assert _serving_version(svc, name) == 1


def _serving_version(svc: Service, name: str) -> int | None:
    return (_ok(svc.mget("/status"))["models"].get(name) or {}).get("version")


def _label(svc: Service, name: str, n: int) -> None:
    """n free examples: n labels since the last training."""
    examples = [{"text": r["text"], "label": r["label"]} for r in _demo_rows(200, n)]
    body = _ok(request(svc.port, "POST", "/feedback", {"model": name, "examples": examples}))
    assert body["stored"] == n


def _retrain_outcome(svc: Service, name: str) -> tuple[dict, dict]:
    """The policy's `retrain` and `retrain_done` history entries, once it ended."""
    def history() -> list[dict]:
        return _ok(svc.mget(f"/history?name={name}&limit=100"))["history"]

    def ended():
        return [h for h in history() if h["kind"] in ("retrain_done", "retrain_failed")]
    (done,) = wait_for(ended, 300, f"the policy's retraining of {name}", interval=0.5)
    (started,) = [h for h in history() if h["kind"] == "retrain"]
    assert done["kind"] == "retrain_done" and started["source"] == "policy", done
    return started, done


def test_apply_canary_makes_the_new_version_a_canary_candidate(svc):
    _train_v1(svc, "pcanary")
    _ok(svc.request_put("/models/pcanary/policy", {"retrain_after_labels": 4, "apply": "canary"}))
    _label(svc, "pcanary", 4)
    started, done = _retrain_outcome(svc, "pcanary")
    assert started["details"]["apply"] == "canary" and started["details"]["held_out"] == 0
    assert done["reason"] == "retrain after 4 labels: v2 applied", done
    assert done["details"]["applied"] is True
    ro = _ok(svc.mget("/rollouts/pcanary"))
    assert ro["version"] == 1  # v1 still serves...
    assert ro["candidate"]["version"] == 2 and ro["candidate"]["mode"] == "canary", ro
    assert _serving_version(svc, "pcanary") == 1
    _ok(svc.mpost("/promote", {"name": "pcanary"}))  # ... until promoted
    assert _serving_version(svc, "pcanary") == 2


def test_apply_none_publishes_only(svc):
    _train_v1(svc, "pnone")
    _ok(svc.request_put("/models/pnone/policy", {"retrain_after_labels": 4, "apply": "none"}))
    _label(svc, "pnone", 4)
    started, done = _retrain_outcome(svc, "pnone")
    assert started["details"]["apply"] == "none"
    assert done["reason"] == "retrain after 4 labels: v2 published only", done
    assert done["details"]["applied"] is False and done["details"]["version"] == 2
    assert os.path.isfile(os.path.join(svc.models_dir, "pnone", "2", "meta.json"))
    assert _serving_version(svc, "pnone") == 1
    assert _ok(svc.mget("/rollouts/pnone"))["candidate"] is None
    pol = _ok(svc.mget("/models/pnone/policy"))
    assert pol["last_retrain"]["version"] == 2 and pol["last_retrain"]["applied"] is False


def test_a_policy_from_config_yaml_applies_with_swap_past_the_gate(svc):
    _train_v1(svc, "cfgswap")
    pol = _ok(svc.mget("/models/cfgswap/policy"))
    assert pol["source"] == "config", pol
    assert pol["policy"] == {"retrain_after_labels": 3, "apply": "swap", "holdout": 0.2}
    # a golden set that any real model fails (every label the wrong way round,
    # and 100 % required): the gate would refuse v2; swap does not ask it
    wrong = [{"text": r["text"], "label": "neg" if r["label"] == "pos" else "pos"}
             for r in _demo_rows(0, 20)]
    _ok(svc.request_put("/models/cfgswap/golden", {"data": {"examples": wrong},
                                                   "min_accuracy": 1.0}))
    _label(svc, "cfgswap", 3)
    started, done = _retrain_outcome(svc, "cfgswap")
    assert started["reason"] == "retrain after 3 labels"
    assert started["details"]["apply"] == "swap" and started["details"]["held_out"] == 0
    assert done["reason"] == "retrain after 3 labels: v2 applied", done
    assert done["details"]["gate"] == {"skipped": True}, done["details"]
    assert _serving_version(svc, "cfgswap") == 2
    # the same apply through the gate is refused: the golden set does bite
    code, body = svc.mpost("/apply", {"name": "cfgswap", "version": 1})
    assert code == 409 and body["error"]["code"] == "quality_gate", body
