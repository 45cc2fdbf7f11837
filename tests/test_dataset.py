"""dataset.py's checks of /train data that the OpenAPI schema promises (the
declared label set is compared the way example labels are: trimmed)."""
from __future__ import annotations

import pytest

from state import dataset
ROWS = [{"text": "good", "label": "pos "}, {"text": "fine", "label": "pos"},
        {"text": "bad", "label": " neg"}, {"text": "awful", "label": "neg"}]


def test_declared_labels_are_trimmed_like_example_labels():
    data = dataset.load({"examples": ROWS, "labels": [" pos", "neg "]}, roots=[])
    assert data.counts == {"neg": 2, "pos": 2}


@pytest.mark.parametrize("labels, words", [
    (["pos", " "], "empty label"),
    (["pos", "neg", "pos "], "distinct"),
    (["pos", "neg", "meh"], "meh"),
    (["pos"], "undeclared"),
    ("pos,neg", "list"),
])
def test_bad_declared_labels_are_refused(labels, words):
    with pytest.raises(dataset.DataError, match=words):
        dataset.load({"examples": ROWS, "labels": labels}, roots=[])
