"""Serving cost in auto's choice: the one-standard-error rule.

Real scikit-learn and TensorFlow on the small English set of
test_autoselect.py. The rule is checked with given speeds, so that no
outcome depends on the machine's load; the searches have the longest budget
the parameters take, so it never binds. How fast the real graphs serve (a
word-only graph against a word+char one) is measured by
bench/autoserve.py --graph-speeds, not asserted here.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from tests.test_autoselect import REPRODUCIBLE as _REPRODUCIBLE, english

# n-gram views only: the rule is checked between word-only and word+char
# graphs; the pretrained view (which wins on this English set) has its own
# tests in test_pretrained.py
REPRODUCIBLE = {**_REPRODUCIBLE, "pretrained": False}


def _given(speed):
    """autoselect.serving_speeds answering from speed(views, n_members)."""
    def speeds(s, graphs):
        return {(tuple(sorted(views)), n): speed(views, n) for views, n in graphs}
    return speeds


def _faster(kind: str):
    """Given serving speeds: graphs whose views are word only ("word") or that
    read characters ("char") serve 10x faster than the rest."""
    def speed(views, n_members=1):
        fast = tuple(views) == ("word",) if kind == "word" else "char" in views
        return 10_000.0 if fast else 1_000.0 / n_members
    return _given(speed)


@pytest.fixture(scope="module")
def search():
    from model_worker import autoselect
    from model_worker.params import validate_params

    texts, labels = english()
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    params = validate_params(REPRODUCIBLE)
    s = autoselect.Search(texts, y, len(names), params, "word", time.monotonic(), None, None)
    s.search(include_networks=False)
    return s


def test_one_standard_error_rule_with_given_speeds(search, monkeypatch):
    from model_worker import autoselect

    members, temps, _ = autoselect.choose(search)
    best_views = {v for m in members for v in m.candidate.views}
    assert best_views == {"word"}  # on this set and seed a word-only model is the most accurate

    monkeypatch.setattr(autoselect, "serving_speeds", _faster("word"))
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
    assert note["se"] > 0 and note["finalists"]
    assert {f["name"] for f in note["finalists"]} == {s.candidate.name for s in within}
    # the most accurate is word-only, as fast as the fastest: nothing changes
    assert not note["applied"] and picked == members

    # graphs that read characters 10x faster: the most accurate tied finalist of
    # those serves instead
    char_within = [s for s in within if "char" in s.candidate.views]
    assert char_within  # on this set and seed: word+char is tied with the best
    monkeypatch.setattr(autoselect, "serving_speeds", _faster("char"))
    picked, picked_t, note = autoselect.cost_aware(search, members, temps)
    assert note["applied"] and len(picked) == 1
    assert "char" in picked[0].candidate.views
    assert picked[0].score == max(s.score for s in char_within)
    assert picked_t[0] > 0 and note["chosen"]["name"] == picked[0].candidate.name
    # all speeds alike: nothing changes (the margin keeps the most accurate)
    monkeypatch.setattr(autoselect, "serving_speeds", _given(lambda views, n: 5_000.0))
    again, _, note = autoselect.cost_aware(search, members, temps)
    assert again == members and note["applied"] is False


def test_real_graph_speeds_are_measured(search):
    """The real graphs' speeds are measured (positive texts/s); which is faster is
    a timing on a shared machine: bench/autoserve.py --graph-speeds."""
    from model_worker import autoselect

    graphs = [(("word",), 1), (("word", "char"), 2), (("char", "word"), 2)]
    speeds = autoselect.serving_speeds(search, graphs)
    assert set(speeds) == {(("word",), 1), (("char", "word"), 2)}  # one graph timed once
    assert all(isinstance(v, float) and v > 0 for v in speeds.values()), speeds
    assert autoselect.serving_speed(search, ("word",)) > 0


def test_report_names_the_most_accurate_and_the_chosen(monkeypatch):
    from model_worker import autoselect, textmodel

    texts, labels = english()
    monkeypatch.setattr(autoselect, "serving_speeds", _faster("char"))
    result = textmodel.train_model(texts, labels, REPRODUCIBLE)
    cost = result.report["serving_cost"]
    assert "most_accurate" in cost and "chosen" in cost and cost["rule"] == "one standard error"
    assert cost["applied"] is True and "char" in cost["chosen"]["name"], cost
    assert cost["chosen"]["cv_macro_f1"] >= cost["most_accurate"]["cv_macro_f1"] - cost["se"] - 1e-9
    assert cost["chosen"]["texts_per_s"] >= cost["margin"] * cost["most_accurate"]["texts_per_s"]
    assert result.report["chosen"]["name"] == cost["chosen"]["name"]
    off = textmodel.train_model(texts, labels, {**REPRODUCIBLE, "cost_aware": False})
    assert off.report["serving_cost"]["applied"] is False
    assert off.report["chosen"]["name"] == cost["most_accurate"]["name"]


def test_finalists_read_ngrams_when_the_most_accurate_does(search, monkeypatch):
    """A candidate tied with the most accurate choice (n-grams) that reads the
    pretrained view alone is no finalist, however fast its graph: the rule
    trades n-gram views' cost for speed, it does not replace the texts' own
    n-grams with the pretrained vectors on a tie between noisy folds. An
    n-gram candidate with other views than the best's stays one. Candidates
    exactly tied with the best are added by hand (scores given, speeds given,
    so nothing depends on the set or the machine)."""
    from dataclasses import replace

    from model_worker import autoselect

    members, temps, _ = autoselect.choose(search)
    assert len(members) == 1 and set(members[0].candidate.views) == {"word"}
    best = members[0]
    alone = replace(best, candidate=autoselect.Candidate(("pretrained",), "svm", 1.0))
    other = replace(best, candidate=autoselect.Candidate(("punct",), "svm", 1.0))

    def speed(views, n_members=1):
        return {("pretrained",): 50_000.0, ("punct",): 10_000.0}.get(tuple(views), 1_000.0)

    monkeypatch.setattr(autoselect, "serving_speeds", _given(speed))
    monkeypatch.setattr(search, "scored", [*search.scored, alone])
    picked, _, note = autoselect.cost_aware(search, members, temps)
    assert note["finalists_read_ngrams_when_it_does"] is True
    assert "pretrained/svm C=1" not in {f["name"] for f in note["finalists"]}
    assert picked == members and not note["applied"]
    monkeypatch.setattr(search, "scored", [*search.scored, other])
    picked, _, note = autoselect.cost_aware(search, members, temps)
    assert note["applied"] and picked[0].candidate.views == ("punct",)
    assert autoselect._keeps_ngrams(("pretrained",), ("pretrained",))
    assert autoselect._keeps_ngrams(("word", "pretrained"), ("char",))
    assert not autoselect._keeps_ngrams(("char",), ("pretrained",))
