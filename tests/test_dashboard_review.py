"""The dashboard's Review panel and "Try it" box, in a real headless Chromium.

Real models (tests/featuremodels.py trains an `auto` linear model "lin" and
a `bow` model "bowm" in a child process), a real service with real workers,
real HTTP. The service has an admin key (the older management token), a
DIFFERENT feedback key, and the generated review key: the page holds only
the review key (what a person labelling the queue gets), so its labels must
reach the prediction log through the management port's POST /feedback
(frontend/dashboard_routes.py), which takes it.

Review: the queue shows the logged predictions least sure first, as
GET /models/<name>/review lists them; a click on another label, the Enter key
(confirm the predicted label) and a digit key (pick a label) each store
feedback that GET /models/<name>/quality counts, with the label chosen (its
confusion matrix and accuracy), and so does a new label typed after the n
key; a labelled item leaves the queue; a text holding markup shows as text.

Try it: the label of a text with its n-grams highlighted (the same
prediction and explanation as /predict), abstaining under a min score, the
422 cannot_explain message for a bow model with its prediction still shown,
and nothing asked there is logged (the models' logged predictions do not grow).

No JavaScript error, and no failed request except the one expected 422.
Screenshots go to tests/artifacts/ (not committed).
"""
from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.helpers import Service, request, wait_for
from tests.test_dashboard import ARTIFACTS, Browser, browser, pw  # noqa: F401 (pw: the fixture)

TOKEN = "review-board-token-of-32-characters-or-more"
FEEDBACK_TOKEN = "only-for-clients-a-key-of-32-characters"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MARKUP = "<img src=x onerror=window.__xss=1> football"
SINGLE = ["cheap phone deals", "tennis racket battery", "the game was delicious",
          "pizza and football", "new laptop with a fast cpu", "noodle soup recipe", MARKUP]
BATCH = ["a cake for the team", "goal keeper app", "rice with chips"]
TRY_TEXT = "Football match news: the striker scored twice, then we ate"


@pytest.fixture(scope="module")
def feature_store(feature_models, tmp_path_factory) -> str:
    """This module's copy of the session's trained feature models (conftest.py)."""
    root = str(tmp_path_factory.mktemp("reviewpanel") / "models")
    shutil.copytree(feature_models, root)
    return root


def _serve(store: str):
    """The service on `store` with bowm and lin applied (lin: the default model)."""
    cfg = os.path.join(os.path.dirname(store), "config.yaml")
    with open(cfg, "w") as fh:
        fh.write("training:\n  demo_on_empty_store: false\n"
                 f"feedback:\n  token: {FEEDBACK_TOKEN}\n")
    s = Service(store, args=["--config", cfg],
                env={"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN})
    try:
        for name in ("bowm", "lin"):  # lin last: the default model
            code, body = s.mpost("/apply", {"name": name}, headers=AUTH, timeout=180)
            assert code == 200, body
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def svc(feature_store):
    yield from _serve(feature_store)


@pytest.fixture
def own_svc(feature_models, tmp_path):
    """A service of the test's own: nothing logged or fed back before it (the
    review queue and the feedback counts are the test's alone)."""
    store = str(tmp_path / "models")
    shutil.copytree(feature_models, store)
    yield from _serve(store)


def _open(pw, svc, width: int = 1280, height: int = 900) -> Browser:
    b = Browser(pw, width, height)
    # the tab already holds the review key (tests/test_dashboard.py covers asking for a key)
    b.ctx.add_init_script(f"sessionStorage.setItem('textswap.token', {svc.keys['review']!r})")
    b.page.goto(f"http://127.0.0.1:{svc.mport}/")
    b.page.locator("#conn.ok").wait_for()
    return b


def _quality(svc) -> dict:
    code, body = svc.mget("/models/lin/quality", headers=AUTH)
    assert code == 200, body
    return body


def _logged(svc, name: str) -> int:
    code, body = svc.mget(f"/models/{name}/quality", headers=AUTH)
    assert code == 200, body
    return sum(v["predictions"] for v in body["versions"])


def _fed_back(svc) -> int:
    return sum(v["feedback"] for v in _quality(svc)["versions"])


def _queue(svc) -> list[dict]:
    code, body = svc.mget("/models/lin/review?limit=1000", headers=AUTH)
    assert code == 200, body
    return body["items"]


@browser
def test_review_panel_labels_by_click_and_keys(own_svc, pw):
    svc = own_svc
    # traffic: single texts and one batch (its texts addressed by index)
    for text in SINGLE:
        assert svc.predict({"text": text, "model": "lin"})[0] == 200
    code, body = svc.predict({"texts": BATCH, "model": "lin"})
    assert code == 200
    batch_id = body["request_id"]
    # the inference port's /feedback takes only the feedback key: not the
    # admin's, which it answers as an unknown key (no oracle)
    assert request(svc.port, "POST", "/feedback", {"request_id": batch_id, "index": 0,
                                                   "label": "food"}, headers=AUTH)[0] == 401
    queue = _queue(svc)
    assert len(queue) == len(SINGLE) + len(BATCH)
    assert _fed_back(svc) == 0

    os.makedirs(ARTIFACTS, exist_ok=True)
    b = _open(pw, svc)
    try:
        page = b.page
        panel = page.locator("#review")
        items = panel.locator("li.rv-item")
        wait_for(lambda: items.count() == len(queue), 30, "the queue on the page")
        assert panel.locator("select.rv-model").input_value() == "lin"  # the default model
        # least sure first, as the service orders it
        shown = [items.nth(i).locator(".rv-text").inner_text() for i in range(items.count())]
        assert shown == [it["text"] for it in queue]
        margins = [it["margin"] for it in queue]
        assert margins == sorted(margins)
        first = queue[0]
        assert first["label"] in items.first.locator(".rv-pred").inner_text()
        assert "left" in panel.locator(".rv-counts").inner_text()
        page.locator("#review-sec").screenshot(path=os.path.join(ARTIFACTS, "review-panel.png"))

        truth: dict[str, tuple[str, str]] = {}  # text -> (true label, predicted)

        # 1. a click on another label than the predicted one
        other = next(lab for lab in ("food", "sport", "tech") if lab != first["label"])
        li = panel.locator(f'li[data-request-id="{first["request_id"]}"]'
                           f'[data-index="{first["index"]}"]')
        li.locator(f'button.pick[data-label="{other}"]').click()
        li.wait_for(state="detached")
        truth[first["text"]] = (other, first["label"])
        wait_for(lambda: _fed_back(svc) == 1, 30, "the click's feedback to be counted")
        assert first["text"] not in [it["text"] for it in _queue(svc)]

        # 2. Enter on the selected item confirms its predicted label
        second = _queue(svc)[0]
        li = panel.locator(f'li[data-request-id="{second["request_id"]}"]'
                           f'[data-index="{second["index"]}"]')
        li.locator(".rv-text").click()  # selects (and focuses) the item
        page.keyboard.press("Enter")
        li.wait_for(state="detached")
        truth[second["text"]] = (second["label"], second["label"])
        wait_for(lambda: _fed_back(svc) == 2, 30, "Enter's feedback to be counted")

        # 3. a digit picks a label, on a text inside the batch (index > 0);
        # then j moves on without labelling
        third = next(it for it in _queue(svc) if it["request_id"] == batch_id and it["index"] > 0)
        li = panel.locator(f'li[data-request-id="{batch_id}"][data-index="{third["index"]}"]')
        li.locator(".rv-text").click()
        labels = [x.get_attribute("data-label") for x in li.locator("button.pick").all()]
        assert labels == ["food", "sport", "tech"]  # 1, 2, 3: the model's labels
        page.keyboard.press("3")
        li.wait_for(state="detached")
        truth[third["text"]] = ("tech", third["label"])
        wait_for(lambda: _fed_back(svc) == 3, 30, "the digit's feedback to be counted")
        cur = panel.locator("li.rv-item.cur").get_attribute("data-key")
        page.keyboard.press("j")
        wait_for(lambda: panel.locator("li.rv-item.cur").get_attribute("data-key") != cur, 10,
                 "j to move to the next item")

        # 4. n types a label the model does not know yet
        fourth_key = panel.locator("li.rv-item.cur").get_attribute("data-key")
        fourth = next(it for it in _queue(svc)
                      if f'{it["request_id"]}#{it["index"]}' == fourth_key)
        page.keyboard.press("n")
        page.keyboard.type("weather")
        page.keyboard.press("Enter")
        panel.locator(f'li.rv-item[data-key="{fourth_key}"]').wait_for(state="detached")
        truth[fourth["text"]] = ("weather", fourth["label"])
        wait_for(lambda: _fed_back(svc) == 4, 30, "the new label's feedback to be counted")

        # what the service counts is what was chosen: its confusion matrix and accuracy
        version = _quality(svc)["versions"][0]
        assert version["feedback"] == 4
        live = version["live"]
        right = sum(t == p for t, p in truth.values())
        assert live["accuracy"] == pytest.approx(right / 4)
        cm = live["confusion"]
        got = {(cm["labels"][i], cm["labels"][j]): n for i, row in enumerate(cm["rows"])
               for j, n in enumerate(row) if n}
        want: dict[tuple[str, str], int] = {}
        for pair in truth.values():
            want[pair] = want.get(pair, 0) + 1
        assert got == want
        left = _queue(svc)
        assert not set(truth) & {it["text"] for it in left}
        wait_for(lambda: items.count() == len(left), 10, "the page's queue to match")
        counts = panel.locator(".rv-counts").inner_text()
        assert "4 labelled here" in counts and f"{len(left)} left" in counts, counts
        # texts are text: markup in one shows as its characters and never runs
        if MARKUP not in truth:
            panel.locator(".rv-text", has_text="<img src=x").wait_for()
        assert page.evaluate("window.__xss") is None
        assert panel.locator("img").count() == 0
        page.locator("#review-sec").screenshot(path=os.path.join(ARTIFACTS,
                                                                 "review-panel-after.png"))

        assert not b.js_errors, b.js_errors
        assert not b.bad_responses, b.bad_responses
        assert not b.console_errors, b.console_errors
    finally:
        b.close()


@browser
def test_try_it_shows_label_highlights_abstaining_and_cannot_explain(svc, pw):
    code, want = svc.predict({"text": TRY_TEXT, "model": "lin", "explain": 8})
    assert code == 200, want
    want = want["predictions"][0]
    code, plain = svc.predict({"text": TRY_TEXT, "model": "bowm"})
    assert code == 200, plain
    logged = {name: _logged(svc, name) for name in ("lin", "bowm")}
    b = _open(pw, svc)
    try:
        page = b.page
        box = page.locator("#tryit")
        box.locator("textarea").fill(TRY_TEXT)
        box.locator("select").select_option("lin")
        box.locator("button[type=submit]").click()
        marks = box.locator("mark.hl")
        marks.first.wait_for()
        assert box.locator(".try-label").inner_text() == want["label"]
        e = want["explanation"]
        # every n-gram that occurs as whole words is highlighted, and only text is marked
        marked = " ".join(m.inner_text() for m in marks.all()).lower()
        words = [f["ngram"] for f in e["features"]
                 if f["view"] == "word" and " " not in f["ngram"] and f["ngram"] != "[UNK]"]
        assert words and all(re.search(rf"\b{re.escape(w)}\b", marked) for w in words), (words, marked)
        assert all(m.evaluate("el => el.closest('.try-text') !== null") for m in marks.all())
        # positive contributions are green, and the bias and logit are shown
        assert all(float(m.get_attribute("data-contribution")) >= 0 for m in marks.all()
                   if "pos" in m.get_attribute("class"))
        total = box.locator(".try-sum").inner_text()
        assert f"{abs(e['bias']):.3f}" in total and f"{abs(e['logit']):.3f}" in total, total
        rows = box.locator("table.try-features tbody tr")
        assert rows.count() == len(e["features"])
        assert rows.first.locator("code").inner_text() == e["features"][0]["ngram"]
        page.locator("#try-sec").screenshot(path=os.path.join(ARTIFACTS, "try-it.png"))

        # abstaining under a min score: label withheld, scores and explanation kept
        box.locator('input[name="min_score"]').fill("1")
        box.locator("button[type=submit]").click()
        box.locator(".try-label.abstained").wait_for()
        assert "below the min score" in box.locator(".try-head").inner_text()
        marks.first.wait_for()
        box.locator('input[name="min_score"]').fill("")

        # a bow model cannot explain: its 422 message, and the prediction without it
        code, err = request(svc.mport, "POST", "/try", {"text": TRY_TEXT, "model": "bowm",
                                                        "explain": 8}, headers=AUTH)
        assert code == 422 and err["error"]["code"] == "cannot_explain", err
        box.locator("select").select_option("bowm")
        box.locator("button[type=submit]").click()
        note = box.locator(".try-note")
        note.wait_for()
        assert err["error"]["message"] in note.inner_text()
        assert box.locator(".try-label").inner_text() == plain["predictions"][0]["label"]
        assert box.locator("mark.hl").count() == 0
        assert "bowm v1" in box.locator(".try-head").inner_text()
        page.locator("#try-sec").screenshot(path=os.path.join(ARTIFACTS, "try-it-bow.png"))

        # the highlighter on other shapes of n-grams, in the page's own module
        got = page.evaluate("""async () => {
            const {highlight} = await import('/ui/js/tryit.js');
            const marked = (text, fs) => highlight(text, fs).filter((p) => p.features.length).map((p) => [p.text, +p.sum.toFixed(3)]);
            return {
              words: marked('Then THE end, the-end', [{ngram: 'the', view: 'word', contribution: 1},
                                                       {ngram: 'the end', view: 'word', contribution: -0.5}]),
              chars: marked('soup soupy', [{ngram: ' soup ', view: 'char', contribution: 2}, {ngram: 'py ', view: 'char', contribution: 1}]),
              chinese: marked('这个很好用！', [{ngram: '好 用', view: 'word', contribution: 1.5}, {ngram: '[UNK]', view: 'word', contribution: 0}]),
              markup: marked('<b>x</b>', [{ngram: '<b>', view: 'punct', contribution: 1}]),
            };
        }""")
        # "the" is a word (not the start of "Then"); "the end" spans the separator
        assert got["words"] == [["THE", 0.5], [" end", -0.5], ["the", 0.5], ["-end", -0.5]], got
        assert got["chars"] == [["soup", 2], ["py", 1]], got
        assert got["chinese"] == [["好用", 1.5]], got
        assert got["markup"] == [["<b>", 1]], got

        # what was asked here is not logged: the models logged nothing more
        assert {name: _logged(svc, name) for name in ("lin", "bowm")} == logged

        assert not b.js_errors, b.js_errors
        # the only failed request: the bow model's 422 cannot_explain, which the page shows
        assert len(b.bad_responses) == 1 and b.bad_responses[0].startswith("422 POST "), \
            b.bad_responses
        assert b.bad_responses[0].endswith("/try")
        assert all("422" in m for m in b.console_errors), b.console_errors
    finally:
        b.close()


@browser
def test_panels_fit_a_phone(svc, pw):
    b = _open(pw, svc, 390, 844)
    try:
        page = b.page
        page.locator("#review li.rv-item, #review li.empty").first.wait_for()
        box = page.locator("#tryit")
        box.locator("textarea").fill("spicy noodle soup for the football team")
        box.locator("select").select_option("lin")
        box.locator("button[type=submit]").click()
        box.locator("mark.hl").first.wait_for()
        page.wait_for_function("document.documentElement.scrollWidth <= 391")
        page.locator("#try-sec").screenshot(path=os.path.join(ARTIFACTS, "try-it-phone.png"))
        page.locator("#review-sec").screenshot(path=os.path.join(ARTIFACTS, "review-phone.png"))
        assert not b.js_errors, b.js_errors
        assert not b.bad_responses, b.bad_responses
    finally:
        b.close()
