"""A label with a single example trains (issue 28): kept out of every
cross-validation fold's test side (autoselect.cv_folds), warned about in the
report, the metrics and the data summary; the served model still learns it.
In-process: real scikit-learn and Keras, no service."""
from __future__ import annotations

import numpy as np
import pytest

from state import dataset

pytestmark = pytest.mark.timeout(300)

POS = ["a wonderful film", "great acting and a lovely story", "I loved every minute",
       "brilliant and moving", "a delight from start to end", "superb cast, great fun",
       "beautiful and funny", "really enjoyable, well made"]
NEG = ["a dreadful film", "boring and far too long", "I hated every minute",
       "awful acting, a weak story", "a waste of time", "dull, flat and silly",
       "terrible from start to end", "badly made and tedious"]
SPORT = "the football match ended with a late goal from the striker"
ROWS = ([{"text": t, "label": "pos"} for t in POS] + [{"text": t, "label": "neg"} for t in NEG]
        + [{"text": SPORT, "label": "sport"}])


def test_the_data_check_accepts_and_warns():
    data = dataset.load({"examples": ROWS}, roots=[])
    assert data.counts == {"neg": 8, "pos": 8, "sport": 1}
    summary = data.summary()
    assert summary["single_example_labels"] == ["sport"]
    assert "single example ('sport')" in summary["warnings"][0]
    with pytest.raises(dataset.DataError, match="every label has a single example"):
        dataset.load({"examples": [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}]}, [])


def test_folds_never_test_a_single_example_label():
    from model_worker.autoselect import cv_folds

    y = np.array([0] * 7 + [1] * 5 + [2])
    folds, tested = cv_folds(y, 5, 1)
    assert len(folds) == 5 and list(tested) == list(range(12))
    for train, test in folds:
        assert 12 in train and 12 not in test
        assert set(train) | set(test) == set(range(13)) and not set(train) & set(test)
    # multi-label: the rows holding a label that only one text has
    ym = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 0], [1, 0, 1], [0, 1, 0], [1, 1, 0]])
    folds, tested = cv_folds(ym, 3, 1)
    assert 3 not in tested and all(3 in tr and 3 not in te for tr, te in folds)
    # nothing single: as before, every row tested once
    folds, tested = cv_folds(np.array([0, 0, 1, 1, 0, 1]), 5, 1)
    assert len(folds) == 3 and sorted(np.concatenate([te for _, te in folds])) == list(range(6))


def test_auto_trains_and_predicts_the_single_example_label():
    from model_worker import textmodel

    texts = [r["text"] for r in ROWS]
    labels = [r["label"] for r in ROWS]
    res = textmodel.train_model(texts, labels, {"architecture": "auto", "time_budget_s": 30})
    assert res.labels == ["neg", "pos", "sport"]
    assert res.report is not None and "single example ('sport')" in res.report["warnings"][0]
    assert res.warnings == res.report["warnings"] and res.metrics["single_example_labels"] == ["sport"]
    # the out-of-fold figures cover the 16 tested rows, not the untested one
    assert sum(map(sum, res.report["out_of_fold"]["confusion_matrix"]["rows"])) == 16
    assert res.held_out_rows is not None and 16 not in list(res.held_out_rows)
    probs = textmodel.predict_proba(textmodel.make_predict_fn(res.model),
                                    ["a late goal won the football match", "a lovely story", "tedious"])
    assert [res.labels[i] for i in probs.argmax(1)] == ["sport", "pos", "neg"], probs


def test_multi_label_auto_keeps_the_single_example_row_out_of_the_tests():
    from model_worker import textmodel

    texts = POS + NEG + [SPORT]
    label_sets = [["pos"]] * len(POS) + [["neg"]] * len(NEG) + [["pos", "sport"]]
    res = textmodel.train_model(texts, label_sets, {"architecture": "auto", "time_budget_s": 20,
                                                    "views": ["word"]})
    assert res.labels == ["neg", "pos", "sport"] and res.metrics["multi_label"]
    assert res.report is not None and "single example ('sport')" in res.report["warnings"][0]
    assert res.held_out_rows is not None and len(texts) - 1 not in list(res.held_out_rows)
    assert res.held_out_probs is not None and len(res.held_out_probs) == len(texts) - 1
