"""The dashboard's "Live quality and drift" section in a real headless Chromium
(the Playwright set-up of tests/test_dashboard.py: the system browser, a fresh
profile, every JavaScript error, console error and failed request collected).

Against the real service with the tiny real models: `sent` v2 gets
predictions and true labels through POST /predict and POST /feedback, and
the page must show its live accuracy (as /quality computes it) beside the
training figure, and "no profile" for its drift; `prof` (a copy of sent v1
given a training profile of Chinese reviews) gets English texts, and the page
must show its drift signals, the signal over its threshold, and the alert.
Screenshots go to tests/artifacts/ (not committed): look at them.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers import ROOT, Service, request, wait_for
from tests.test_dashboard import ARTIFACTS, Browser, browser, sync_api  # noqa: F401  (the set-up)

DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")


@pytest.fixture(scope="module")
def pw():
    assert sync_api is not None
    with sync_api.sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    from bench.drift import english_texts
    from model_worker import profile

    base = tmp_path_factory.mktemp("dashq")
    models = str(base / "models")
    shutil.copytree(tiny_store, models)
    for other in os.listdir(models):
        if other not in ("sent", "topic") and not other.startswith("."):
            shutil.rmtree(os.path.join(models, other))
    dst = os.path.join(models, "prof", "1")
    shutil.copytree(os.path.join(models, "sent", "1"), dst)
    with open(os.path.join(dst, "meta.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    meta.update(name="prof", version=1,
                metrics={"accuracy": 0.84, "macro_f1": 0.83, "measured_on": "validation"})
    with open(os.path.join(dst, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
    with open(DEMO, encoding="utf-8") as fh:
        rows = [json.loads(line) for _, line in zip(range(2000), fh)]
    profile.write(dst, [r["text"] for r in rows], [r["label"] for r in rows], ["neg", "pos"])
    cfg = base / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\nrollout:\n  probation_s: 0\n")
    s = Service(models, args=["--config", str(cfg)])
    for body in ({"name": "sent"}, {"name": "prof", "default": False}):
        code, answer = s.mpost("/apply", body)
        assert code == 200, answer
    # sent: predictions with known true labels
    texts = ["很好", "非常好用", "喜欢", "很差", "太差了", "讨厌", "桌子", "今天下雨"] * 3
    truth = ["pos", "pos", "pos", "neg", "neg", "neg", "neg", "pos"] * 3
    code, answer = s.predict({"model": "sent", "texts": texts})
    assert code == 200, answer
    code, fb = request(s.port, "POST", "/feedback",
                       {"request_id": answer["request_id"], "labels": truth})
    assert code == 200, fb
    # prof: English traffic against a profile of Chinese reviews
    english = english_texts(250)
    for i in range(0, 250, 50):
        code, answer = s.predict({"model": "prof", "texts": english[i:i + 50]})
        assert code == 200, answer

    def counted():
        a = s.mget("/models/sent/quality")[1]["versions"][0]
        b = s.mget("/models/prof/quality")[1]["versions"][0]
        return a["feedback"] == len(texts) and b["predictions"] == 250 and (a, b)
    s.expected = wait_for(counted, 60, "the log to hold the traffic", interval=0.2)
    yield s
    s.stop()


@browser
@pytest.mark.timeout(300)
def test_quality_section_shows_live_accuracy_drift_and_alert(svc, pw):
    os.makedirs(ARTIFACTS, exist_ok=True)
    sent, prof = svc.expected
    assert prof["drift"]["alert"] is True and sent["drift"] is None
    b = Browser(pw)
    try:
        page = b.page
        page.goto(svc.dashboard_url())  # logs the tab in (a one-time code)
        card = page.locator('#quality .q-card[data-model="prof"]')
        card.locator(".badge.q-alert", has_text="drift alert").wait_for()
        row = card.locator('tr[data-version="1"]')
        assert row.locator(".q-drift").inner_text().strip() == "DRIFT"
        unknown = row.locator(".q-unknown .q-over")  # the signal over its threshold, in red
        assert float(unknown.inner_text()) == pytest.approx(
            prof["drift"]["unknown_ngram_excess"], abs=1e-3)
        assert "train 84.0%" in row.locator(".q-acc").inner_text()

        srow = page.locator('#quality .q-card[data-model="sent"] tr[data-version="2"]')
        srow.wait_for()
        live = f"{100 * sent['live']['accuracy']:.1f}%"
        acc = srow.locator(".q-acc").inner_text()
        assert acc.startswith(live) and "train" in acc, acc
        assert srow.locator(".q-drift").inner_text().strip() == "no profile"
        cells = srow.locator("td").all_inner_texts()
        assert cells[1].strip() == str(sent["predictions"]) and cells[2].strip() == "24"

        page.locator("#quality-sec").scroll_into_view_if_needed()
        page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-quality.png"), full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.locator("#quality-sec").scroll_into_view_if_needed()
        page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-quality-phone.png"))
        assert not b.js_errors, b.js_errors
        assert not b.console_errors, b.console_errors
        assert not b.bad_responses, b.bad_responses
    finally:
        b.close()
