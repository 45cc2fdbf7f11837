"""A multi-label model with /predict's options, on the real service (one auto
multi-label model trained as a job, real worker, real HTTP): `min_score`
from the request and from the model's policy, and `explain`
(docs/models.md "Answers": with `min_score` a label must clear both its
threshold and min_score, and no label at all is `"abstained": true`;
explanations explain the top label's logit)."""
from __future__ import annotations

import pytest

from tests.helpers import Service
from tests.test_explain import _check_sum
from tests.test_multilabel import PROBE, _train, topic_rows


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    base = tmp_path_factory.mktemp("mloptions")
    cfg = base / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\nworker:\n  standby_pool: 0\n")
    s = Service(str(base / "models"), args=["--config", str(cfg)])
    try:
        _train(s, "mtags", topic_rows(90), {})
        code, body = s.mpost("/apply", {"name": "mtags"}, timeout=180)
        assert code == 200, body
        yield s
    finally:
        s.stop()


def _predict(svc: Service, **extra) -> list[dict]:
    code, body = svc.predict({"texts": PROBE, "top_k": 4, "model": "mtags", **extra})
    assert code == 200, body
    return body["predictions"]


def _meta(svc: Service) -> dict:
    code, meta = svc.mget("/models/mtags/1")
    assert code == 200 and meta["multi_label"] is True and meta["min_labels"] == 1, meta
    return meta


def test_min_score_keeps_only_labels_above_it_and_abstains_on_none(svc):
    meta = _meta(svc)
    plain = _predict(svc)
    assert all("abstained" not in p for p in plain)
    two = plain[2]  # the food and money text: two labels
    assert sorted(x["label"] for x in two["labels"]) == ["food", "money"], two
    lo, hi = sorted(x["score"] for x in two["labels"])
    floor = (lo + hi) / 2
    got = _predict(svc, min_score=floor)
    for p, q in zip(got, plain):
        assert p["top"] == q["top"]  # the scores are kept
        want = [x["label"] for x in q["top"]
                if x["score"] >= max(floor, meta["thresholds"][x["label"]])]
        assert [x["label"] for x in p["labels"]] == want, (p, floor)
        assert p["abstained"] is (not want)
        assert p["label"] == (q["label"] if want else None)
    assert len(got[2]["labels"]) == 1 and got[2]["labels"][0]["score"] == hi
    # "zzz qqq": no label clears its threshold; min_labels 1 gives it the best one
    # without min_score, but with min_score it abstains
    assert len(plain[3]["labels"]) == 1
    assert all(x["score"] < meta["thresholds"][x["label"]] for x in plain[3]["top"])
    low = _predict(svc, min_score=0.0)
    assert low[3]["labels"] == [] and low[3]["abstained"] is True and low[3]["label"] is None
    assert low[2]["abstained"] is False and len(low[2]["labels"]) == 2


def test_the_policy_min_score_is_the_default_for_a_multilabel_model(svc):
    meta = _meta(svc)
    plain = _predict(svc)
    floor = sorted(p["score"] for p in plain)[1]  # the second lowest top score
    code, body = svc.request_put("/models/mtags/policy", {"min_score": floor})
    assert code == 200, body
    try:
        got = _predict(svc)
        assert [p["top"] for p in got] == [p["top"] for p in plain]
        for p, q in zip(got, plain):
            want = [x for x in q["top"]
                    if x["score"] >= max(floor, meta["thresholds"][x["label"]])]
            assert p["labels"] == want and p["abstained"] is (not want), (p, floor)
        assert 1 <= sum(p["abstained"] for p in got) < len(got)
        again = _predict(svc, min_score=0.0)  # the request's own wins
        assert [x["label"] for x in again[2]["labels"]] == \
            [x["label"] for x in plain[2]["labels"]]
    finally:
        code, body = svc.request_delete("/models/mtags/policy")
        assert code == 200, body
    assert all("abstained" not in p for p in _predict(svc))


def test_explain_explains_the_top_label_of_a_multilabel_model(svc):
    plain = _predict(svc)
    got = _predict(svc, explain=3)
    for text, p, q in zip(PROBE, got, plain):
        assert p["top"] == q["top"] and p["labels"] == q["labels"]  # same prediction
        e = p["explanation"]
        assert e["label"] == p["label"] == p["top"][0]["label"], e
        assert len(e["features"]) <= 3
        contribs = [f["contribution"] for f in e["features"]]
        assert contribs == sorted(contribs, reverse=True)
        assert all(f["ngram"].strip() in text for f in e["features"]), (text, e)
        _check_sum(e)
    assert got[0]["explanation"]["features"]  # the sport text: n-grams made its label
