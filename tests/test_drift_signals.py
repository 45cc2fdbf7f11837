"""The drift alert raised by each of the two distribution signals alone, on
the real service (traffic through POST /predict, the prediction log, GET
/models/<name>/quality with the default thresholds): `label_js` (the mix of
predicted labels moved) and `top_score_js` (the model became less sure, the
label mix unchanged). tests/test_drift.py covers the unknown n-gram signal
with a trained model; here the versions are copies of the tiny `sent` v1
with a profile.json written as the trainer writes it
(model_worker/profile.py `write`): its training texts and labels, and as the
"held-out" predictions the version's own answers on those texts, asked from
the service. So the reference is exactly what in-domain traffic looks like,
and each test moves one thing."""
from __future__ import annotations

import os
import shutil

import pytest

from tests.helpers import Service, predict_in_batches, quality_once_logged, wait_for
from model_worker import profile as prof
from state.config import DEFAULTS
from tests.test_rollouts import _copy_version
from tests.tinymodels import EXAMPLES

LIMITS = DEFAULTS["drift"]
LABELS = ["neg", "pos"]
TRAIN = [(t, lab) for lab in LABELS for t in EXAMPLES[lab]]


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("driftsignals")
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"
    cfg.write_text("rollout:\n  probation_s: 0\nworker:\n  standby_pool: 0\n")
    s = Service(root, args=["--config", str(cfg)])
    code, body = s.mpost("/apply", {"name": "sent", "version": 1})
    assert code == 200, body
    texts = [t for t, _ in TRAIN]
    code, body = s.predict({"texts": texts, "model": "sent", "top_k": 2})
    assert code == 200, body
    rows = [[next(x["score"] for x in p["top"] if x["label"] == lab) for lab in LABELS]
            for p in body["predictions"]]
    for name in ("dlab", "dtop"):
        _copy_version(root, "sent/1", name, 1)
        prof.write(os.path.join(root, name, "1"), texts, [lab for _, lab in TRAIN], LABELS,
                   rows, "validation")
    yield s
    s.stop()


def _drift(svc: Service, model: str, predictions: int) -> dict:
    """The drift report once the log holds `predictions` texts of the version."""
    return wait_for(lambda: quality_once_logged(svc, model, predictions)["versions"][0]["drift"],
                    60, f"the drift report of {model}", interval=0.2)


def test_a_moved_label_mix_raises_the_alert_on_label_js(svc):
    code, body = svc.mpost("/apply", {"name": "dlab", "default": False})
    assert code == 200, body
    # in-domain: the training texts in their own mix; quiet
    predict_in_batches(svc, "dlab", [t for t, _ in TRAIN] * 15)
    d = _drift(svc, "dlab", 210)
    assert d["texts"] == 210 and d["alert"] is False and d["over"] == [], d
    assert d["label_js"] < 0.01 and d["top_score_js"] < 0.01, d
    # then only positive texts: the last 1,000 are all predicted "pos"
    predict_in_batches(svc, "dlab", EXAMPLES["pos"] * 143)
    d = _drift(svc, "dlab", 210 + 1001)
    assert d["texts"] == LIMITS["window"] and d["label_distribution"]["pos"] == 1.0, d
    assert d["label_js"] > LIMITS["max_label_js"], d
    assert d["alert"] is True and d["over"] == ["label_js"], d  # that signal alone


def test_a_less_sure_model_raises_the_alert_on_top_score_js(svc):
    code, body = svc.mpost("/apply", {"name": "dtop", "default": False})
    assert code == 200, body
    # texts of one positive and one negative phrase: known n-grams, unsure answers;
    # asked from `sent` (same model, its own log), then as many of either label
    mixed = [f"{a} {b}" for a in EXAMPLES["pos"] for b in EXAMPLES["neg"]]
    mixed += [f"{b} {a}" for a in EXAMPLES["pos"] for b in EXAMPLES["neg"]]
    code, body = svc.predict({"texts": mixed, "model": "sent", "top_k": 1})
    assert code == 200, body
    unsure = {lab: [t for t, p in zip(mixed, body["predictions"])
                    if p["label"] == lab and p["score"] < 0.9] for lab in LABELS}
    k = min(len(v) for v in unsure.values())
    assert k >= 3, {lab: len(v) for lab, v in unsure.items()}
    traffic = (unsure["neg"][:k] + unsure["pos"][:k]) * (-(-210 // (2 * k)))
    predict_in_batches(svc, "dtop", traffic)
    d = _drift(svc, "dtop", len(traffic))
    assert d["texts"] == len(traffic) >= LIMITS["min_texts"]
    assert d["label_distribution"] == {"neg": 0.5, "pos": 0.5}, d
    assert d["top_score_js"] > LIMITS["max_top_score_js"], d
    assert d["alert"] is True and d["over"] == ["top_score_js"], d  # that signal alone
