"""Abstaining (min_score) and explanations (explain: k) on /predict.

Real models (tests/featuremodels.py builds an `auto` linear model and a `bow`
one in a child process), a real service with real workers, real HTTP. The
arithmetic of explanations is checked in this process too, on an ensemble
graph of two members over two views.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, Service

TEXTS = ["news about the football match", "spicy noodle soup today", "laptop battery software update",
         "zzz", "完全 unseen 文本"]


@pytest.fixture(scope="module")
def feature_store(feature_models, tmp_path_factory) -> str:
    """This module's copy of the session's trained feature models (conftest.py)."""
    root = str(tmp_path_factory.mktemp("features") / "models")
    shutil.copytree(feature_models, root)
    return root


@pytest.fixture(scope="module")
def svc(feature_store):
    s = Service(feature_store)
    try:
        for name in ("bowm", "lin"):  # lin last: the default model
            code, body = s.mpost("/apply", {"name": name}, timeout=180)
            assert code == 200, body
        yield s
    finally:
        s.stop()


def _check_sum(e: dict) -> None:
    total = sum(f["contribution"] for f in e["features"]) + e["others"] + e["bias"]
    assert total == pytest.approx(e["logit"], abs=1e-4)


# -- abstaining ---------------------------------------------------------------------------
def test_min_score_abstains_with_scores_kept(svc):
    code, plain = svc.predict({"texts": TEXTS})
    assert code == 200 and all("abstained" not in p for p in plain["predictions"])
    code, body = svc.predict({"texts": TEXTS, "min_score": 1.0})
    assert code == 200
    for p, q in zip(body["predictions"], plain["predictions"]):
        assert p["abstained"] is True and p["label"] is None
        assert p["score"] == q["score"] and p["top"] == q["top"]  # the scores are still there
    code, body = svc.predict({"texts": TEXTS, "min_score": 0.0})
    assert [p["abstained"] for p in body["predictions"]] == [False] * len(TEXTS)
    assert [p["label"] for p in body["predictions"]] == [p["label"] for p in plain["predictions"]]
    # a threshold between the scores splits them, by the top score
    scores = sorted(p["score"] for p in plain["predictions"])
    mid = (scores[0] + scores[-1]) / 2
    code, body = svc.predict({"texts": TEXTS, "min_score": mid})
    for p, q in zip(body["predictions"], plain["predictions"]):
        assert p["abstained"] == (q["score"] < mid)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", True, [0.5]])
def test_bad_min_score_is_400(svc, bad):
    code, body = svc.predict({"text": "hello", "min_score": bad})
    assert code == 400 and body["error"]["code"] == "invalid_field", body


def test_policy_min_score_is_the_default():
    """The model's policy (PUT /models/<name>/policy) gives min_score when the
    request does not; a request's own value wins; no policy: no abstaining; a
    policy whose min_score is not a number in (0, 1] (policies are checked
    when set, so only a bug gets there) fails the request instead of quietly
    answering labels its owner said to withhold."""
    from frontend.base import ApiError
    from frontend.pipeline import PredictPipeline, PredictRequest
    from state.config import DEFAULTS, LimitsSettings

    class Stored:  # what the pipeline reads of control/policies.py's Policies
        def __init__(self, policies):
            self.policies = policies

        def get(self, name):
            return self.policies.get(name)

    def threshold(policies, asked):
        pipe = PredictPipeline(None, None, policies, None, None,
                               LimitsSettings(**DEFAULTS["limits"]), 1.0)
        return pipe.min_score(PredictRequest(["t"], None, min_score=asked), "m")

    assert threshold(None, None) is None
    assert threshold(Stored({}), None) is None
    assert threshold(Stored({"m": {"retrain_after_labels": 5}}), None) is None
    assert threshold(Stored({"m": {"min_score": 0.7}}), None) == 0.7
    assert threshold(Stored({"m": {"min_score": 0.7}}), 0.5) == 0.5
    with pytest.raises(ApiError) as err:
        threshold(Stored({"m": {"min_score": "high"}}), None)
    assert (err.value.status_code, err.value.code) == (500, "broken_policy")


def test_a_policys_min_score_makes_predict_abstain_through_the_service(svc):
    """PUT /models/<name>/policy with min_score on the real service: /predict
    abstains below it without the request naming one, a request's own value
    wins, and once the policy is deleted nothing abstains."""
    body = {"texts": TEXTS, "model": "lin"}
    code, plain = svc.predict(body)
    assert code == 200 and all("abstained" not in p for p in plain["predictions"]), plain
    scores = sorted(p["score"] for p in plain["predictions"])
    mid = round((scores[0] + scores[-1]) / 2, 6)  # some texts below it, some above
    assert scores[0] < mid < scores[-1], scores
    code, got = svc.request_put("/models/lin/policy", {"min_score": mid})
    assert code == 200 and got["policy"]["min_score"] == mid, got
    try:
        code, got = svc.predict(body)
        assert code == 200, got
        for p, q in zip(got["predictions"], plain["predictions"], strict=True):
            assert p["abstained"] == (q["score"] < mid), (p, mid)
            assert p["label"] == (None if q["score"] < mid else q["label"])
            assert p["score"] == q["score"]  # the scores are still there
        code, got = svc.predict({**body, "min_score": 0.0})  # the request's own value wins
        assert code == 200 and [p["abstained"] for p in got["predictions"]] == [False] * len(TEXTS)
    finally:
        code, got = svc.request_delete("/models/lin/policy")
        assert code == 200 and got["removed"] is True, got
    code, got = svc.predict(body)
    assert code == 200 and all("abstained" not in p for p in got["predictions"]), got
    assert [p["label"] for p in got["predictions"]] == [p["label"] for p in plain["predictions"]]


def test_report_has_risk_coverage(svc):
    code, meta = svc.mget("/models/lin/1")
    rows = meta["report"]["risk_coverage"]
    assert [r["threshold"] for r in rows] == [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    cover = [r["coverage"] for r in rows]
    assert cover == sorted(cover, reverse=True) and 0 < cover[0] <= 1
    assert all(r["accuracy"] is None or 0 <= r["accuracy"] <= 1 for r in rows)


# -- explanations ---------------------------------------------------------------------------
def test_explain_through_http(svc):
    code, plain = svc.predict({"texts": TEXTS})
    code, body = svc.predict({"texts": TEXTS, "explain": 3})
    assert code == 200, body
    for p, q in zip(body["predictions"], plain["predictions"]):
        assert p["label"] == q["label"] and p["top"] == q["top"]  # same prediction
        e = p["explanation"]
        assert e["label"] == p["label"] and len(e["features"]) <= 3
        contribs = [f["contribution"] for f in e["features"]]
        assert contribs == sorted(contribs, reverse=True)
        for f in e["features"]:
            assert f["contribution"] == pytest.approx(f["value"] * f["weight"], abs=1e-5)
        _check_sum(e)
    football = body["predictions"][0]["explanation"]["features"]
    assert football and all(isinstance(f["ngram"], str) and f["ngram"] for f in football)
    # every n-gram shown comes from the text (character n-grams padded with a
    # space): an unknown word's "[UNK]" column, which weighs nothing, is none
    for text, p in zip(TEXTS, body["predictions"]):
        assert all(f["ngram"].strip() in text and f["value"] != 0
                   for f in p["explanation"]["features"]), (text, p["explanation"])
    assert body["predictions"][3]["explanation"]["features"] == []  # "zzz": no known n-gram
    assert "explanation" not in plain["predictions"][0]
    # all features: they and the bias make the logit
    code, body = svc.predict({"text": TEXTS[0], "explain": 100})
    e = body["predictions"][0]["explanation"]
    assert e["others"] == 0 and len(e["features"]) > 3
    _check_sum(e)


def test_explain_with_abstaining(svc):
    code, body = svc.predict({"texts": TEXTS[:2], "explain": 2, "min_score": 1.0})
    assert code == 200
    assert all(p["abstained"] and p["explanation"]["features"] for p in body["predictions"])


def test_bow_cannot_explain_422(svc):
    code, body = svc.predict({"text": "football", "model": "bowm", "explain": 2})
    assert code == 422 and body["error"]["code"] == "cannot_explain", body
    assert svc.predict({"text": "football", "model": "bowm"})[0] == 200


@pytest.mark.parametrize("bad", [-1, 101, "3", 2.5, True])
def test_bad_explain_is_400(svc, bad):
    code, body = svc.predict({"text": "hello", "explain": bad})
    assert code == 400 and body["error"]["code"] == "invalid_field", body


# -- the arithmetic, on an ensemble ----------------------------------------------------------
def test_ensemble_contributions_sum_to_the_averaged_logit():
    from model_worker import autofeatures, explain, scoring

    texts = ["the quick brown fox", "a lazy dog sleeps", "quick quick dog", "brown bread"] * 3
    views = autofeatures.views_for("word")
    parts = []
    for name in ("word", "char"):
        counts = autofeatures.count_matrix(views[name], texts, 1000)
        parts.append((views[name], counts.vocabulary, autofeatures.idf_weights(counts.matrix)))
    rng = np.random.default_rng(0)
    members = [({v.name: rng.normal(size=(len(vocab), 3)) for v, vocab, _ in parts}, rng.normal(size=3))
               for _ in range(2)]
    model = autofeatures.linear_graph(parts, members)
    probe = ["quick fox", "lazy bread dog", "unseen"]
    probs, explained = explain.Explainer(model)(probe, 10_000)
    np.testing.assert_allclose(probs, scoring.make_predict_fn(model)(probe), atol=1e-6)
    for p, e in zip(probs, explained):
        assert e["label_index"] == int(p.argmax()) and e["others"] == 0
        assert e["bias"] == pytest.approx(np.mean([b[e["label_index"]] for _, b in members]), abs=1e-5)
        _check_sum(e)
    assert len({f["view"] for f in explained[0]["features"]}) == 2  # both views contribute
    # "unseen": only its unknown words' columns, which weigh nothing
    assert not [f for f in explained[2]["features"] if f["view"] == "word"], explained[2]
    # the label to explain given (a worker serving from the lean plan passes
    # its own top label): that label's logit, split exactly
    other = (probs.argmax(axis=1) + 1) % 3
    _, given = explain.Explainer(model)(probe, 10_000, other)
    for c, e in zip(other.tolist(), given):
        assert e["label_index"] == c and e["others"] == 0
        _check_sum(e)


# -- the command line -------------------------------------------------------------------------
def test_cli_predict_explain_and_min_score(svc):
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTSWAP_")}
    env.update({"TEXTSWAP_URL": f"http://127.0.0.1:{svc.mport}",
                "TEXTSWAP_PREDICT_URL": f"http://127.0.0.1:{svc.port}"})
    cmd = [sys.executable, "-m", "textswap_cli", "predict", "--explain", "2", "--min-score", "0.0",
           TEXTS[0], TEXTS[1]]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert [line["text"] for line in lines] == TEXTS[:2]
    for line in lines:
        assert line["abstained"] is False and len(line["explanation"]["features"]) == 2
        _check_sum(line["explanation"])
    bad = subprocess.run([*cmd[:3], "--explain", "0", "x"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2  # a usage error, refused before any request
