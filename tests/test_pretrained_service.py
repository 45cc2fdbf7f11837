"""The pretrained view through the real service: /train with it, apply,
predict, the model card naming the view and the weights' origin, the Llama 2
notice in the version folder; and training.pretrained: false keeping every
job off it. Real trainer processes, real TensorFlow."""
from __future__ import annotations

import os

import pytest

from tests.helpers import Service, wait_for

pytestmark = pytest.mark.timeout(900)

POS = ["a wonderful film", "great acting and a lovely story", "I loved every minute",
       "brilliant and moving", "a delight from start to end", "superb cast, great fun",
       "beautiful and funny", "really enjoyable, well made", "an excellent picture",
       "charming and warm", "a fantastic watch", "pure joy to see"]
NEG = ["a dreadful film", "boring and far too long", "I hated every minute",
       "awful acting, a weak story", "a waste of time", "dull, flat and silly",
       "terrible from start to end", "badly made and tedious", "a poor picture",
       "cold and clumsy", "an unbearable watch", "pure misery to sit through"]
EXAMPLES = [{"text": t, "label": "pos"} for t in POS] + [{"text": t, "label": "neg"} for t in NEG]


def _service(tmp_path, extra: str = "") -> Service:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("worker:\n  standby: false\ntraining:\n  demo_on_empty_store: false\n"
                   + extra)
    return Service(str(tmp_path / "models"), args=["--config", str(cfg)])


def _train(svc: Service, params: dict) -> dict:
    code, body = svc.mpost("/train", {"name": "films", "data": {"examples": EXAMPLES},
                                      "params": params})
    assert code == 202, body
    job_id = body["job"]["id"]
    return wait_for(lambda: (lambda j: j if j["state"] in ("succeeded", "failed") else None)(
        svc.mget(f"/train/{job_id}")[1]["job"]), 600, "the training job")


def test_train_apply_predict_with_the_pretrained_view(tmp_path):
    svc = _service(tmp_path)
    try:
        job = _train(svc, {"architecture": "auto", "views": ["pretrained"]})
        assert job["state"] == "succeeded", job
        version = job["result"]["version"]
        code, body = svc.mpost("/apply", {"name": "films", "version": version}, timeout=240)
        assert code == 200, body
        code, body = svc.predict({"texts": ["a lovely, moving story", "tedious and awful"]})
        assert code == 200 and body["model"] == {"name": "films", "version": version}, body
        assert [p["label"] for p in body["predictions"]] == ["pos", "neg"], body
        code, card = svc.mget(f"/models/films/{version}")
        assert code == 200, card
        pre = card["report"]["pretrained"]
        assert pre["used"] is True and "WordLlama" in pre["origin"], pre
        # a version holding a word table carries the Llama 2 notice
        # and the licence agreement with its acceptable use policy
        folder = os.path.join(svc.models_dir, "films", str(version))
        assert "Llama 2" in open(os.path.join(folder, "NOTICE"), encoding="utf-8").read()
        with open(os.path.join(folder, "LLAMA2-COMMUNITY-LICENSE.txt"), encoding="utf-8") as fh:
            assert fh.read().startswith("LLAMA 2 COMMUNITY LICENSE AGREEMENT")
        assert os.path.getsize(os.path.join(folder, "LLAMA2-ACCEPTABLE-USE-POLICY.md")) > 1000
    finally:
        svc.stop()


def test_the_service_switch_keeps_every_job_off_the_view(tmp_path):
    svc = _service(tmp_path, "  pretrained: false\n")
    try:
        code, body = svc.mpost("/train", {"name": "films", "data": {"examples": EXAMPLES},
                                          "params": {"pretrained": True}})
        assert code == 400 and "training.pretrained: false" in body["error"]["message"], body
        job = _train(svc, {"architecture": "auto"})
        assert job["state"] == "succeeded", job
        code, card = svc.mget(f"/models/films/{job['result']['version']}")
        assert card["report"]["pretrained"] == {"used": False, "why": "pretrained is false"}
        assert not os.path.exists(os.path.join(svc.models_dir, "films", "1", "NOTICE"))
        assert not os.path.exists(os.path.join(svc.models_dir, "films", "1",
                                               "LLAMA2-COMMUNITY-LICENSE.txt"))
    finally:
        svc.stop()
