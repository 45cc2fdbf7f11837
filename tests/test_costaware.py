"""Serving cost in auto's choice: the one-standard-error rule.

Real scikit-learn and TensorFlow on the small English set of
test_autoselect.py. The rule itself is checked with given speeds (so that
the check cannot depend on the machine's load); the timing with the real
graphs is checked to rank a word-only graph above a word+char one.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from test_autoselect import english


@pytest.fixture(scope="module")
def search():
    from model_worker import autoselect
    from model_worker.params import validate_params

    texts, labels = english()
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    params = validate_params({"time_budget_s": 60, "folds": 3, "seed": 11})
    s = autoselect.Search(texts, y, len(names), params, "word", time.monotonic(), None, None)
    s.search(include_networks=False)
    return s


def test_one_standard_error_rule_with_given_speeds(search, monkeypatch):
    from model_worker import autoselect

    members, temps, _ = autoselect.choose(search)
    best_views = {v for m in members for v in m.candidate.views}

    def fake_speed(s, views, n_members=1, cache=None):  # word-only graphs 10x faster
        return 10_000.0 if tuple(views) == ("word",) else 1_000.0 / n_members

    monkeypatch.setattr(autoselect, "serving_speed", fake_speed)
    picked, picked_t, note = autoselect.cost_aware(search, members, temps)
    best = note["most_accurate"]["cv_macro_f1"]
    folds = members[0].fold_scores if len(members) == 1 else autoselect.fold_f1(
        search, autoselect.oof_probs(members, temps)[1])
    within = [s for s in search.scored if s.score >= best - note["se"] - 1e-9
              and autoselect._tied(folds, s.fold_scores)]
    assert note["paired"] is True
    # paired: a candidate whose every fold is below the best's by the same amount
    # is not tied however large the folds' own spread; the best is tied with itself
    assert not autoselect._tied([0.8, 0.9, 0.7], [0.78, 0.88, 0.68])
    assert autoselect._tied([0.8, 0.9, 0.7], [0.8, 0.9, 0.7])
    assert autoselect._tied([0.8, 0.9, 0.7], [0.81, 0.87, 0.71])
    word_within = [s for s in within if s.candidate.views == ("word",)]
    assert note["se"] > 0 and note["finalists"]
    assert {f["name"] for f in note["finalists"]} == {s.candidate.name for s in within}
    if best_views == {"word"} or not word_within:
        assert not note["applied"] and picked == members
    else:
        assert note["applied"] and len(picked) == 1
        assert picked[0].candidate.views == ("word",)
        # the most accurate of the word-only finalists
        assert picked[0].score == max(s.score for s in word_within)
        assert picked_t[0] > 0 and note["chosen"]["name"] == picked[0].candidate.name
    # all speeds alike: nothing changes (the margin keeps the most accurate)
    monkeypatch.setattr(autoselect, "serving_speed", lambda *a, **k: 5_000.0)
    again, _, note = autoselect.cost_aware(search, members, temps)
    assert again == members and note["applied"] is False


def test_real_graph_speeds_rank_word_above_word_plus_char(search):
    from model_worker import autoselect

    word = autoselect.serving_speed(search, ("word",))
    both = autoselect.serving_speed(search, ("word", "char"), 2)
    assert word > both > 0


def test_report_names_the_most_accurate_and_the_chosen():
    from model_worker import textmodel

    texts, labels = english()
    result = textmodel.train_model(texts, labels, {"time_budget_s": 30, "folds": 3, "seed": 5})
    cost = result.report["serving_cost"]
    assert "most_accurate" in cost and "chosen" in cost and cost["rule"] == "one standard error"
    if cost["applied"]:
        assert cost["chosen"]["cv_macro_f1"] >= cost["most_accurate"]["cv_macro_f1"] - cost["se"] - 1e-9
        assert cost["chosen"]["texts_per_s"] >= cost["margin"] * cost["most_accurate"]["texts_per_s"]
        assert result.report["chosen"]["name"] == cost["chosen"]["name"]
    off = textmodel.train_model(texts, labels, {"time_budget_s": 30, "folds": 3, "seed": 5,
                                                "cost_aware": False})
    assert off.report["serving_cost"]["applied"] is False
    assert off.report["chosen"]["name"] == cost["most_accurate"]["name"]
