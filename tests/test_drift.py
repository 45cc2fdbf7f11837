"""Drift on the real service: a model trained by the real trainer (bow on
3,000 Chinese reviews of data/demo) gets a profile.json; traffic goes through
POST /predict and is compared with the profile at GET /models/<name>/quality
with the default thresholds (state/config.py `drift`):

- 1,000 unseen reviews (in-domain): no alert, every signal under its threshold;
- then 500 English texts (the standard library's docstrings): the window holds
  500 reviews and 500 English texts, and the alert is on;
- a copy of the version (a fresh window): 1,000 reviews, then 500 Chinese
  program messages (another domain, same language): the alert is on (skipped
  where the machine has no zh_CN gettext catalogues);
- a version without a profile (a tiny test model) reports drift null;
- /metrics carries the signals and the alert.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.helpers import ROOT, Service, predict_in_batches, quality_once_logged, request, wait_for
from bench import drift as traffic
from state.config import DEFAULTS

LIMITS = DEFAULTS["drift"]
TRAIN_N = 3000

pytestmark = pytest.mark.timeout(900)  # above the fixture's waits: a 600 s training, 120 s to serve



@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("drift")
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"
    cfg.write_text("rollout:\n  probation_s: 0\n")
    s = Service(root, args=["--config", str(cfg)])
    rows = traffic.demo_rows()
    code, body = s.mpost("/train", {"name": "rev", "apply": True,
                                    "params": {"architecture": "bow"},
                                    "data": {"examples": rows[:TRAIN_N]}})
    assert code == 202, body
    job = body["job"]["id"]

    def done():
        code, j = s.mget(f"/train/{job}")
        assert j["job"]["state"] not in ("failed", "cancelled"), j
        return j["job"]["state"] == "succeeded" and j
    wait_for(done, 600, "the training job", interval=0.5)
    wait_for(lambda: s.mget("/models")[1]["serving_versions"].get("rev") == 1, 120,
             "rev v1 serving", interval=0.2)
    s.reviews = [r["text"] for r in rows[TRAIN_N:]]
    yield s
    s.stop()


def test_the_trainer_writes_a_profile(svc):
    with open(os.path.join(svc.models_dir, "rev", "1", "profile.json"), encoding="utf-8") as fh:
        prof = json.load(fh)
    assert prof["texts"] == TRAIN_N and prof["known_share"]["measured_on"] == "leave_one_out"
    assert 0.7 < prof["known_share"]["mean"] < 0.98
    assert prof["top_score"]["measured_on"] == "validation"
    assert sum(prof["top_score"]["counts"]) == prof["top_score"]["n"] > 200
    assert set(prof["labels"]["predicted"]) == {"neg", "pos"}


def test_in_domain_is_quiet_then_english_raises_the_alert(svc):
    predict_in_batches(svc, "rev", svc.reviews[:1000])
    v = quality_once_logged(svc, "rev", 1000)["versions"][0]
    d = v["drift"]
    assert v["version"] == 1 and d["texts"] == 1000
    assert d["alert"] is False and d["over"] == [], d
    assert abs(d["unknown_ngram_excess"]) < LIMITS["max_unknown_excess"]
    assert d["label_js"] < LIMITS["max_label_js"] and d["top_score_js"] < LIMITS["max_top_score_js"]

    english = traffic.english_texts(500)
    assert len(english) == 500
    predict_in_batches(svc, "rev", english)
    d = quality_once_logged(svc, "rev", 1500)["versions"][0]["drift"]
    assert d["texts"] == LIMITS["window"] == 1000  # the last 1,000: half reviews, half English
    assert d["alert"] is True and "unknown_ngram_excess" in d["over"], d
    assert d["unknown_ngram_share"] > d["expected_unknown_ngram_share"] + 0.2

    # the same figures in /metrics
    code, text = request(svc.mport, "GET", "/metrics")
    text = text.decode() if isinstance(text, bytes) else text
    assert re.search(r'^textswap_drift_alert\{model="rev",version="1"\} 1\.0$', text, re.M)
    m = re.search(r'^textswap_drift_unknown_ngram_excess\{model="rev",version="1"\} (\S+)$',
                  text, re.M)
    assert m and float(m.group(1)) == pytest.approx(d["unknown_ngram_excess"], abs=1e-6)


def test_another_chinese_domain_raises_the_alert(svc):
    software = traffic.chinese_software_texts(500)
    if len(software) < 500:
        pytest.skip("no zh_CN gettext catalogues on this machine (/usr/share/locale/zh_CN)")
    # a copy of the version under another name: a window of its own
    src = os.path.join(svc.models_dir, "rev", "1")
    dst = os.path.join(svc.models_dir, "rev2", "1")
    shutil.copytree(src, dst)
    meta_path = os.path.join(dst, "meta.json")
    with open(meta_path, encoding="utf-8") as fh:
        meta = json.load(fh)
    with open(meta_path, "w", encoding="utf-8") as fh:
        json.dump({**meta, "name": "rev2"}, fh)
    code, body = svc.mpost("/apply", {"name": "rev2", "default": False})
    assert code == 200, body
    predict_in_batches(svc, "rev2", svc.reviews[1000:2000])
    d = quality_once_logged(svc, "rev2", 1000)["versions"][0]["drift"]
    assert d["alert"] is False, d
    predict_in_batches(svc, "rev2", software)
    d = quality_once_logged(svc, "rev2", 1500)["versions"][0]["drift"]
    assert d["alert"] is True and "unknown_ngram_excess" in d["over"], d


def test_a_version_without_profile_reports_drift_null(svc):
    code, body = svc.mpost("/apply", {"name": "sent", "default": False})
    assert code == 200, body
    predict_in_batches(svc, "sent", ["很好", "太差了", "喜欢"] * 100)
    v = quality_once_logged(svc, "sent", 300)["versions"][0]
    assert v["version"] == 2 and v["drift"] is None and v["predictions"] >= 300
    assert v["live"]["accuracy"] is None  # nothing fed back
