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


def test_descriptions_are_checked_and_become_examples():
    got = dataset.check_descriptions({" pos ": " good ", "neg": "bad"})
    assert got == {"pos": "good", "neg": "bad"}
    for bad, words in (([], "object"), ({"pos": "good"}, "between 2"), ({"pos": "", "neg": "x"}, "non-empty"),
                       ({"pos": "good", "neg": "..."}, "no word"), ({"pos": "a", " pos": "b"}, "twice"),
                       ({"pos": "a", "": "b"}, "empty label"), ({"pos": "a", "neg": "x" * 2001}, "limit")):
        with pytest.raises(dataset.DataError, match=words):
            dataset.check_descriptions(bad)
    zero = dataset.from_descriptions(got)
    assert zero.texts == ["bad", "good"] and zero.labels == ["neg", "pos"]
    more = dataset.add_descriptions(dataset.load({"examples": ROWS}, roots=[]), {"pos": "nice", "meh": "so so"})
    assert more.counts == {"meh": 1, "neg": 2, "pos": 3} and more.texts[-2:] == ["so so", "nice"]
