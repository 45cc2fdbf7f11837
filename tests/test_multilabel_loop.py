"""The learning loop for multi-label models: label sets fed back, live quality
with micro/macro/samples-F1, retraining with the sets folded in.

- in process: the label-set encoding of the prediction log's label text, the
  merge of feedback sets into multi-label data, the live figures against
  scikit-learn's, the predicted set recomputed from logged scores;
- through the real service (one multi-label `auto` model trained on small
  data, see tests/test_multilabel.py): POST /feedback with a set for a
  single-text request, with "index", for the whole batch, free examples; the
  400s naming the field; GET /models/<name>/quality against figures computed
  here from the answers and the truths; /metrics; a retraining with
  "feedback": true that counts the feedback rows.
"""
from __future__ import annotations

import re

import pytest
from sklearn.metrics import f1_score
from sklearn.preprocessing import MultiLabelBinarizer

from control import quality
from tests.helpers import Service, request, wait_for
from state import dataset
from tests.test_dashboard import ARTIFACTS, Browser, browser, pw  # noqa: F401 (pw: the fixture)
from tests.test_feedback import TOKEN, _cli, feedback, log_of
from tests.test_multilabel import PROBE, TOPICS, _train, topic_rows

ROWS = topic_rows(90)


# -- in process -------------------------------------------------------------------------
def test_label_sets_encode_canonically_and_decode():
    assert dataset.encode_label_set(["b", "a", "b"]) == '["a","b"]'
    assert dataset.encode_label_set([]) == "[]"
    assert dataset.encode_label_set(["é"]) == '["é"]'  # not escaped
    assert dataset.decode_truth('["a","b"]') == ["a", "b"]
    assert dataset.decode_truth("[]") == []
    # one label stays one label, also one that only looks like a list
    for single in ("sport", "[draft]", '["b","a"]', '[ "a"]', '["a",1]', "[", ""):
        assert dataset.decode_truth(single) == single, single
    assert dataset.is_label_set('["x"]') and not dataset.is_label_set("x")
    assert dataset.decode_truth(None) is None


ML = [{"text": "a", "labels": ["x", "y"]}, {"text": "b", "labels": ["x"]},
      {"text": "c", "labels": ["y"]}, {"text": "d", "labels": ["x", "y"]}]


def test_merge_folds_label_sets_into_multilabel_data():
    data = dataset.load({"examples": ML}, roots=[])
    enc = dataset.encode_label_set
    merged, summary = dataset.merge_feedback(data, [
        ("a", enc(["x"])),            # relabels a training text: the feedback wins
        ("e", enc(["y", "z"])),       # a new text with a new label
        ("f", enc(["z"])),            # z has 2 texts now: a class
        ("g", enc(["x", "w"])),       # w has one text: it waits, g keeps x
        ("h", enc(["w2"])),           # a set left empty by waiting: the text waits
        ("d", enc([])),               # d has no label: out of the training data
        ("b", enc(["y"])), ("b", enc(["x", "y"])),  # the newest wins
    ])
    got = dict(zip(merged.texts, merged.labels))
    assert merged.multi_label
    assert got == {"a": ["x"], "b": ["x", "y"], "c": ["y"], "e": ["y", "z"], "f": ["z"],
                   "g": ["x"]}
    assert merged.counts == {"x": 3, "y": 3, "z": 2}
    assert summary["rows"] == 5 and summary["new_labels"] == ["z"]
    assert summary["new_label_rows"] == 2 and summary["waiting"] == {"w": 1, "w2": 1}
    assert summary["relabelled"] == 3  # a, b, d
    assert summary["added"] == 3 and summary["no_label_rows"] == 1  # e, f, g
    # the data written for the trainer reads back the same
    assert merged.summary()["multi_label"] is True


def test_single_labels_and_label_sets_do_not_mix():
    multi = dataset.load({"examples": ML}, roots=[])
    with pytest.raises(dataset.DataError, match="one label per text cannot be folded into "
                                                "multi-label"):
        dataset.merge_feedback(multi, [("a", '["x"]'), ("b", "x")])
    single = dataset.load({"examples": [{"text": t, "label": lab} for t, lab in
                                        [("a", "x"), ("b", "x"), ("c", "y"), ("d", "y")]]},
                          roots=[])
    with pytest.raises(dataset.DataError, match="label set.* cannot be folded into "
                                                "single-label"):
        dataset.merge_feedback(single, [("a", '["x","y"]')])
    merged, summary = dataset.merge_feedback(single, [("a", "y"), ("e", "x")])
    assert dict(zip(merged.texts, merged.labels))["a"] == "y" and summary["rows"] == 2
    assert not merged.multi_label


def test_live_multilabel_figures_match_scikit_learn():
    import random
    rng = random.Random(5)
    names = ["a", "b", "c", "d"]
    rows = []
    for _ in range(200):
        truth = sorted(rng.sample(names, rng.choice([1, 1, 2, 3])))
        pred = sorted({x for x in truth if rng.random() < 0.8}
                      | {x for x in names if rng.random() < 0.15}) or [rng.choice(names)]
        rows.append({"truth": truth, "label": pred})
    live = quality.live_figures_multi(rows)
    mlb = MultiLabelBinarizer(classes=names)
    y, p = mlb.fit_transform([r["truth"] for r in rows]), mlb.transform([r["label"] for r in rows])
    assert live["multi_label"] is True and live["confusion"] is None
    assert live["micro_f1"] == pytest.approx(f1_score(y, p, average="micro"), abs=1e-6)
    assert live["macro_f1"] == pytest.approx(f1_score(y, p, average="macro"), abs=1e-6)
    assert live["samples_f1"] == pytest.approx(f1_score(y, p, average="samples"), abs=1e-6)
    assert live["accuracy"] == pytest.approx(sum(r["truth"] == r["label"] for r in rows) / 200)
    assert live["per_label"]["a"]["support"] == sum("a" in r["truth"] for r in rows)
    assert live["per_label"]["a"]["predicted"] == sum("a" in r["label"] for r in rows)
    # both sets empty counts as a perfect text (as the training report counts it)
    assert quality.live_figures_multi([{"truth": [], "label": []}])["samples_f1"] == 1.0


def test_predicted_set_from_logged_scores():
    t = {"a": 0.5, "b": 0.3, "c": 0.9}
    assert quality.predicted_set({"a": 0.6, "b": 0.31, "c": 0.2}, t, 1) == ["a", "b"]
    assert quality.predicted_set({"a": 0.1, "b": 0.2, "c": 0.3}, t, 1) == ["c"]  # the best
    assert quality.predicted_set({"a": 0.1, "b": 0.2, "c": 0.3}, t, 0) == []
    assert quality.predicted_set({}, t, 1, "b") == ["b"]  # trimmed row: the logged label


# -- the real service -------------------------------------------------------------------------
# Two models trained alike on the same rows: "tags" takes the feedback of the tests
# below (in any order), "tagsq" only the fixed feedback of `given`, so its live
# quality and its retraining have one expected outcome whatever ran before.
pytestmark = pytest.mark.timeout(1500)  # above the fixture's two trainings and a retraining


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    base = tmp_path_factory.mktemp("mlloop")
    cfg = base / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n"
                   f"feedback:\n  token: {TOKEN}\n")
    s = Service(str(base / "models"), args=["--config", str(cfg)])
    try:
        for name in ("tagsq", "tags"):  # "tags" last: the default model
            _train(s, name, ROWS, {})
            code, body = s.mpost("/apply", {"name": name}, timeout=180)
            assert code == 200, body
        yield s
    finally:
        s.stop()


def _predict(svc, texts: list[str], model: str | None = None) -> dict:
    code, body = svc.predict({"texts": texts, **({"model": model} if model else {})})
    assert code == 200, body
    return body


def _answered(p: dict) -> list[str]:
    return sorted(x["label"] for x in p["labels"])


NEWS = [r["text"] + " extra" for r in topic_rows(12, seed=11)]
NEWS_TRUTH = [r["labels"] for r in topic_rows(12, seed=11)]
FREE = [{"text": "rain at the bakery n900", "labels": ["weather", "food"]},
        {"text": "stock market coach n901", "labels": ["money", "sport", "money"]}]


@pytest.fixture(scope="module")
def given(svc) -> dict[tuple[str, int], tuple[list[str], list[str], str]]:
    """15 label sets fed back on "tagsq"'s answers, and 2 free examples:
    (request id, index) -> (truth, answered, text)."""
    out: dict[tuple[str, int], tuple[list[str], list[str], str]] = {}

    def give(texts: list[str], truths: list[list[str] | None]) -> None:
        body = _predict(svc, texts, "tagsq")
        for i, truth in enumerate(truths):
            if truth is None:
                continue
            code, fb = feedback(svc, {"request_id": body["request_id"], "index": i,
                                      "labels": truth})
            assert code == 200, fb
            out[(body["request_id"], i)] = (sorted(set(truth)),
                                            _answered(body["predictions"][i]), texts[i])
    give([PROBE[2]], [["money", "food"]])
    first = [NEWS_TRUTH[i] for i in range(6)]
    first[1] = []  # the text truly has none of the labels
    give(NEWS[:6], first)
    second = [NEWS_TRUTH[6 + i] for i in range(6)]
    second[0] = second[0] + ["chess"]  # a label with one text: it waits at retraining
    give(NEWS[6:12], second)
    give([PROBE[0] + " twice", PROBE[2] + " twice"], [["food"], ["food", "money"]])
    code, fb = feedback(svc, {"model": "tagsq", "examples": FREE})
    assert code == 200 and fb["stored"] == 2, fb
    assert len(out) == 15
    return out


def test_a_label_set_for_a_single_text_request(svc):
    text = PROBE[2]  # money and food
    body = _predict(svc, [text])
    code, fb = feedback(svc, {"request_id": body["request_id"], "labels": ["money", "food"]})
    assert code == 200, fb
    assert fb["multi_label"] is True and fb["labels"] == ["food", "money"]
    assert fb["predicted"] == _answered(body["predictions"][0])
    assert fb["correct"] == (fb["predicted"] == ["food", "money"])
    assert fb["new_label"] is False and fb["stored"] == 1
    plog = log_of(svc)
    try:
        row = [r for r in plog.fed_back("tags") if r["request_id"] == body["request_id"]][0]
        assert row["truth"] == '["food","money"]'  # the canonical encoding
        assert dataset.decode_truth(row["label"]) == fb["predicted"]
    finally:
        plog.close()


def test_label_sets_by_index_and_for_the_whole_batch(svc):
    body = _predict(svc, NEWS[:6])
    rid = body["request_id"]
    code, fb = feedback(svc, {"request_id": rid, "index": 3, "labels": ["sport", "chess"]})
    assert code == 200, fb
    assert fb["index"] == 3 and fb["labels"] == ["chess", "sport"]
    assert fb["new_label"] is True and fb["items"][0]["new_labels"] == ["chess"]
    # the whole batch replaces it (same request id and index)
    truths = [NEWS_TRUTH[i] for i in range(6)]
    truths[1] = []  # the text truly has none of the labels
    code, fb = feedback(svc, {"request_id": rid, "labels": truths})
    assert code == 200, fb
    assert fb["stored"] == 6 and fb["new_label"] is False
    assert [i["labels"] for i in fb["items"]] == [sorted(t) for t in truths]
    assert [i["predicted"] for i in fb["items"]] == [_answered(p) for p in body["predictions"]]
    # another batch: one text fed back with an unknown label (it waits at retraining)
    body = _predict(svc, NEWS[6:12])
    rid = body["request_id"]
    truths = [NEWS_TRUTH[6 + i] for i in range(6)]
    truths[0] = truths[0] + ["chess"]
    code, fb = feedback(svc, {"request_id": rid, "labels": truths})
    assert code == 200, fb
    assert [i["new_label"] for i in fb["items"]] == [True] + [False] * 5


def test_free_examples_with_label_sets(svc):
    code, fb = feedback(svc, {"model": "tags", "examples": [
        {"text": "rain at the bakery n900", "labels": ["weather", "food"]},
        {"text": "stock market coach n901", "labels": ["money", "sport", "money"]}]})
    assert code == 200, fb
    assert fb["multi_label"] is True and fb["stored"] == 2 and fb["new_labels"] == []
    assert [i["labels"] for i in fb["items"]] == [["food", "weather"], ["money", "sport"]]
    plog = log_of(svc)
    try:
        got = dict(plog.feedback_examples("tags"))
        assert got["stock market coach n901"] == '["money","sport"]'
    finally:
        plog.close()


@pytest.mark.parametrize("body, field", [
    ({"label": "sport"}, "'labels'"),                         # one label: the model takes sets
    ({"labels": "sport"}, "'labels'"),
    ({"labels": [["sport"], "weather"]}, "'labels'"),         # a mix
    ({"labels": [["sport"], ["weather", 3.5]]}, "'labels[1][1]'"),
    ({"labels": ["sport", ""]}, "'labels[1]'"),
    ({"labels": [["sport"]] * 2}, "wrong_length"),
    ({"index": 0, "labels": [["sport"]]}, "'labels'"),        # with index: one set
    ({"labels": ["sport"]}, "'index'"),                       # which of the batch's texts?
])
def test_a_wrong_shape_is_a_400_naming_the_field(svc, body, field):
    sent = _predict(svc, PROBE[:3])
    code, fb = feedback(svc, {"request_id": sent["request_id"], **body})
    assert code == 400, fb
    if field == "wrong_length":  # a code of its own, with the length expected
        assert fb["error"]["code"] == field and fb["error"]["expected"] == 3, fb
    else:  # the message names the field
        assert field in fb["error"]["message"], fb


@pytest.mark.parametrize("example, field", [
    ({"text": "a b", "label": "sport"}, "'examples[0]'"),
    ({"text": "a b", "labels": "sport"}, "'examples[0].labels'"),
    ({"text": "a b", "labels": [["sport"]]}, "'examples[0].labels[0]'"),
])
def test_a_wrong_free_example_is_a_400_naming_the_field(svc, example, field):
    code, fb = feedback(svc, {"model": "tags", "examples": [example]})
    assert code == 400 and field in fb["error"]["message"], fb
    if "label" in example:
        assert "multi-label" in fb["error"]["message"]


def test_cli_sends_a_label_set(svc):
    """textswap feedback REQUEST_ID --label-set a,b [--index N]."""
    import json
    texts = [PROBE[0] + " by cli", PROBE[2] + " by cli"]
    body = _predict(svc, texts)
    rid = body["request_id"]
    out = _cli(svc, "--json", "feedback", rid, "--label-set", "food, money", "--index", "1")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["labels"] == ["food", "money"] and got["index"] == 1 and got["stored"] == 1, got
    out = _cli(svc, "feedback", rid, "--label-set", "food", "--index", "0")
    assert out.returncode == 0 and f"{rid}#0: food (predicted" in out.stdout, (out.stdout,
                                                                                out.stderr)
    out = _cli(svc, "feedback", rid, "food", "--label-set", "food")
    assert out.returncode != 0 and "LABEL" in out.stderr


def test_review_items_carry_the_answered_label_set(svc):
    texts = [PROBE[1] + " for review", PROBE[3] + " for review"]
    body = _predict(svc, texts)
    code, got = svc.mget("/models/tags/review?limit=1000&strategy=random")
    assert code == 200, got
    mine = {i["index"]: i for i in got["items"] if i["request_id"] == body["request_id"]}
    assert sorted(mine) == [0, 1], got
    for i, p in enumerate(body["predictions"]):
        assert mine[i]["labels"] == _answered(p) and mine[i]["label"] == p["label"]


def _expected(given) -> dict:
    pairs = [(set(t), set(p)) for t, p, _ in given.values()]
    names = sorted(set().union(*(t | p for t, p in pairs)))
    tp = sum(len(t & p) for t, p in pairs)
    fp = sum(len(p - t) for t, p in pairs)
    fn = sum(len(t - p) for t, p in pairs)
    f1s = []
    for n in names:
        a = sum(1 for t, p in pairs if n in t and n in p)
        pr = a / max(1, sum(n in p for _, p in pairs))
        rc = a / max(1, sum(n in t for t, _ in pairs))
        f1s.append(2 * pr * rc / (pr + rc) if pr + rc else 0.0)
    samples = [2 * len(t & p) / (len(t) + len(p)) if t or p else 1.0 for t, p in pairs]
    return {"micro_f1": 2 * tp / (2 * tp + fp + fn), "macro_f1": sum(f1s) / len(f1s),
            "samples_f1": sum(samples) / len(samples),
            "accuracy": sum(t == p for t, p in pairs) / len(pairs), "names": names}


def test_live_quality_of_a_multilabel_version(svc, given):
    code, report = svc.mget("/models/tagsq/quality")
    assert code == 200, report
    assert set(report) >= {"model", "versions"}
    v = [x for x in report["versions"] if x["version"] == 1][0]
    assert v["feedback"] == 15 and v["predictions"] >= 15 and "drift" in v
    live = v["live"]
    want = _expected(given)
    assert live["multi_label"] is True and live["confusion"] is None
    for key in ("micro_f1", "macro_f1", "samples_f1", "accuracy"):
        assert live[key] == pytest.approx(want[key], abs=1e-6), (key, live, want)
    assert sorted(live["per_label"]) == want["names"] and "chess" in want["names"]
    assert live["per_label"]["chess"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0,
                                          "support": 1, "predicted": 0}
    assert live["per_label"]["sport"]["support"] == sum(
        "sport" in t for t, _, _ in given.values())
    assert v["training"]["micro_f1"] is not None
    # /metrics: exact-match accuracy and micro-F1
    code, text = request(svc.mport, "GET", "/metrics")
    text = text.decode() if isinstance(text, bytes) else text
    m = re.search(r'^textswap_live_micro_f1\{model="tagsq",version="1"\} (\S+)$', text, re.M)
    assert m and float(m.group(1)) == pytest.approx(want["micro_f1"], abs=1e-6)
    m = re.search(r'^textswap_live_accuracy\{model="tagsq",version="1"\} (\S+)$', text, re.M)
    assert m and float(m.group(1)) == pytest.approx(want["accuracy"], abs=1e-6)


def test_single_label_feedback_forms_are_refused_for_a_multilabel_model(svc):
    sent = _predict(svc, PROBE[:1])
    code, fb = feedback(svc, {"request_id": sent["request_id"], "label": "sport"})
    assert code == 400 and "multi-label" in fb["error"]["message"], fb


def test_retraining_folds_the_label_sets_in(svc, given):
    code, body = svc.mpost("/train", {"name": "tagsq", "feedback": True})
    assert code == 202, body
    job_id = body["job"]["id"]
    code, job = svc.mget(f"/train/{job_id}")
    assert code == 200, job
    data = job["job"]["data"]
    fed = data["feedback"]
    # texts fed back: 15 on predictions, 2 free examples; one has no label, and
    # "chess" (one text) waits
    texts = {text: truth for truth, _, text in given.values()}
    assert len(texts) == 15
    assert fed["multi_label"] is True
    assert fed["rows"] == 15 - 1 + 2 and fed["no_label_rows"] == 1
    assert fed["waiting"] == {"chess": 1} and fed["new_labels"] == []
    assert data["examples"] == len(ROWS) + fed["rows"]  # every fed-back text is new

    def finished():
        code, job = svc.mget(f"/train/{job_id}")
        assert code == 200, job
        return job["job"]["state"] in ("succeeded", "failed", "cancelled") and job["job"]
    job = wait_for(finished, 300, "the retraining", interval=0.3)
    assert job["state"] == "succeeded", job
    code, meta = svc.mget("/models/tagsq/2")
    assert code == 200 and meta["multi_label"] is True
    assert meta["data"]["examples"] == len(ROWS) + 16


@browser
def test_review_panel_sends_label_sets(svc, pw):  # noqa: F811 (pw: the fixture)
    """In the real browser: a multi-label item shows the set it answered; the
    label buttons toggle labels in or out, the send button posts the set, and
    Enter on an item confirms its answered set. /quality counts both."""
    import os
    texts = [PROBE[0] + " on the page", PROBE[2] + " on the page"]
    body = _predict(svc, texts)
    rid = body["request_id"]
    answered = [_answered(p) for p in body["predictions"]]
    before = [x for x in svc.mget("/models/tags/quality")[1]["versions"] if x["version"] == 1][0]
    b = Browser(pw)
    try:
        page = b.page
        page.goto(svc.dashboard_url())  # logs the tab in (a one-time code)
        panel = page.locator("#review")
        panel.locator("select.rv-model").select_option("tags")
        first = panel.locator(f'li[data-request-id="{rid}"][data-index="0"]')
        first.wait_for()
        assert ", ".join(answered[0]) in first.locator(".rv-label").inner_text()
        extra = next(t for t in sorted(TOPICS) if t not in answered[0])
        first.locator(f'button.toggle[data-label="{extra}"]').click()
        first = panel.locator(f'li[data-request-id="{rid}"][data-index="0"]')
        assert first.locator(f'button.toggle[data-label="{extra}"]').get_attribute(
            "aria-pressed") == "true"
        want0 = sorted(answered[0] + [extra])
        assert first.locator("button.send-set").inner_text() == "Send " + ", ".join(want0)
        os.makedirs(ARTIFACTS, exist_ok=True)
        page.locator("#review-sec").screenshot(path=os.path.join(ARTIFACTS,
                                                                 "review-panel-multilabel.png"))
        first.locator("button.send-set").click()
        first.wait_for(state="detached")
        second = panel.locator(f'li[data-request-id="{rid}"][data-index="1"]')
        second.locator(".rv-text").click()
        second.press("Enter")
        second.wait_for(state="detached")
        assert not b.js_errors and not b.bad_responses, (b.js_errors, b.bad_responses)
    finally:
        b.close()
    plog = log_of(svc)
    try:
        fed = {r["index"]: r for r in plog.fed_back("tags") if r["request_id"] == rid}
    finally:
        plog.close()
    assert dataset.decode_truth(fed[0]["truth"]) == want0
    assert dataset.decode_truth(fed[1]["truth"]) == answered[1]
    after = [x for x in svc.mget("/models/tags/quality")[1]["versions"] if x["version"] == 1][0]
    assert after["feedback"] == before["feedback"] + 2
