"""architecture "auto" through the real service: /train -> search -> publish ->
apply -> /predict, the report in GET /models/<name>/<version>, and the
portable artifact: GET /models/<name>/<version>/artifact, whose SavedModel
is loaded by plain TensorFlow in a process where this project is not
importable, and must answer as the serving worker does."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.helpers import ROOT, Service, wait_for

# above the fixture's 240 s training wait and a 300 s reload
pytestmark = pytest.mark.timeout(600)


DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
PROBE = ["非常好，很满意，推荐购买", "太差了，质量不好，退货", "物流一般，东西还行", "good value"]


def _demo_rows(n: int) -> list[dict]:
    with open(DEMO, encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("auto")
    cfg = base / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\n")
    svc = Service(str(base / "models"), args=["--config", str(cfg)])
    try:
        code, body = svc.mpost("/train", {"name": "shop", "data": {"examples": _demo_rows(150)},
                                          "params": {"time_budget_s": 30, "folds": 3}, "apply": True})
        assert code == 202, body
        job_id = body["job"]["id"]
        seen: list[dict] = []

        def finished():
            code, body = svc.mget(f"/train/{job_id}")
            assert code == 200, body
            job = body["job"]
            seen.append(dict(job["progress"]))
            return job["state"] in ("succeeded", "failed", "cancelled") and job
        job = wait_for(finished, 240, "the auto training job", interval=0.2)
        assert job["state"] == "succeeded", job
        yield svc, job, seen
    finally:
        svc.stop()


def test_auto_end_to_end(trained):
    svc, job, seen = trained
    assert job["params"]["architecture"] == "auto"
    searching = [p for p in seen if p.get("phase") == "search" and p.get("candidate")]
    assert searching, seen
    last = searching[-1]
    assert 1 <= last["candidate"] <= last["of"] and 0 <= last["best_score"] <= 1 and last["best"]

    code, meta = svc.mget("/models/shop/1")
    assert code == 200, meta
    report = meta["report"]
    assert report["method"] == "auto" and report["folds"] == 3 and report["tokenize"] == "char"
    # training.threads' default (2): the trainer fitted two folds at once, one process each
    assert report["fold_processes"] == 2
    assert report["candidates"] and report["chosen"]["members"]
    assert all({"cv_macro_f1", "cv_std", "seconds"} <= c.keys() for c in report["candidates"])
    assert {"ece_before", "ece_after", "temperature"} <= report["calibration"].keys()
    assert report["out_of_fold"]["confusion_matrix"]["labels"] == ["neg", "pos"]
    assert meta["metrics"]["measured_on"] == "cross_validation" and meta["metrics"]["macro_f1"] > 0.6
    assert meta["export_seconds"] > 0

    wait_for(lambda: (svc.serving() or {}).get("name") == "shop", 60, "auto-apply")
    code, body = svc.predict({"texts": PROBE[:2]})
    assert code == 200 and body["model"] == {"name": "shop", "version": 1}
    assert [p["label"] for p in body["predictions"]] == ["pos", "neg"]


LOAD_SAVED_MODEL = """
import importlib.util, json, sys
# the venv holds the project as an editable install (pyproject.toml): its
# finder goes, so that only TensorFlow and the saved files load the model
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
for name in ("model_worker", "state", "control", "frontend", "cluster", "supervisor"):
    assert importlib.util.find_spec(name) is None, f"the project must not be importable: {name}"
import tensorflow as tf
model = tf.saved_model.load(sys.argv[1])
out = model.signatures["serving_default"](tf.constant(json.loads(sys.argv[2])))
print(json.dumps(next(iter(out.values())).numpy().tolist()))
"""


def test_artifact_download_and_portable_savedmodel(trained, tmp_path):
    svc, _, _ = trained
    code, raw = svc.mget("/models/shop/1/artifact", timeout=120)
    assert code == 200 and isinstance(raw, bytes)
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        names = tar.getnames()
        assert {"shop/1/model.keras", "shop/1/meta.json", "shop/1/saved_model/saved_model.pb"} <= set(names)
        assert all(n.startswith("shop/1/") for n in names)
        tar.extractall(tmp_path, filter="data")
    # a clean interpreter: -I ignores PYTHONPATH and the script's folder; the
    # working folder is outside the project, so nothing of it is importable
    out = subprocess.run([sys.executable, "-I", "-c", LOAD_SAVED_MODEL, "shop/1/saved_model", json.dumps(PROBE)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    portable = json.loads(out.stdout.strip().splitlines()[-1])
    code, body = svc.predict({"texts": PROBE, "top_k": 2})
    assert code == 200
    labels = ["neg", "pos"]
    assert len(portable) == len(body["predictions"]) == len(PROBE), (portable, body)
    for row, pred in zip(portable, body["predictions"]):
        assert len(row) == len(labels) == len(pred["top"]), (row, pred)
        served = {t["label"]: t["score"] for t in pred["top"]}
        for i, label in enumerate(labels):
            assert row[i] == pytest.approx(served[label], abs=2e-6)  # served scores have 6 digits


def test_artifact_not_found(trained):
    svc, _, _ = trained
    assert svc.mget("/models/shop/9/artifact")[0] == 404
    code, body = svc.mget("/models/nothere/1/artifact")
    assert code == 404 and body["error"]["code"] == "not_found"
