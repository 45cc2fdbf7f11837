"""The web dashboard (GET / on the management port) in a real headless Chromium.

Playwright's Python API drives the system browser (/usr/bin/chromium from the
Debian package; .ci/run installs it when missing; Playwright's own browser
downloads are never used). Against the real service with real workers and a
real trainer process, the page must: show the serving tiny model; start a
training job from its form and chart the job's epochs live; apply the new
version with its button and show the serving version change, the previous
version kept in probation and a new history row; roll back with the
probation's button (the old version serves again, the history and the
rolled-back list say so); run the new version as a shadow, see its mirrored
requests counted, and promote it; render labels containing markup as text;
log in with the
one-time code of its URL; ask for a key, say clearly when it is wrong, and
send it on every call. No JavaScript
error may reach the console, and no request of the page may fail.

Screenshots (desktop 1280x800 and phone 390x844) and the measured page cost go
to tests/artifacts/ (not committed): look at them after a change to the page.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
import time

import pytest

from tests.helpers import ROOT, Service, wait_for

ARTIFACTS = os.path.join(ROOT, "tests", "artifacts")
DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
TOKEN = "dash-board-token-of-32-characters-or-more"
XSS_LABEL = "<script>window.__xss=1</script>"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage"]


def _chromium() -> str | None:
    for path in ("/usr/bin/chromium", shutil.which("chromium") or "",
                 shutil.which("chromium-browser") or ""):
        if path and os.access(path, os.X_OK):
            return path
    return None


CHROMIUM = _chromium()
try:
    from playwright import sync_api
except ImportError:  # requirements-dev.txt pins it; say so rather than fail to collect
    sync_api = None
browser = pytest.mark.skipif(
    CHROMIUM is None or sync_api is None,
    reason="no Chromium found (/usr/bin/chromium; apt-get install chromium)" if CHROMIUM is None
    else "playwright is not installed (make venv: requirements-dev.txt)")


class Browser:
    """One Chromium with a fresh profile, collecting what would show a bug:
    JavaScript errors, console errors, requests that failed or answered >= 400."""

    def __init__(self, pw, width: int = 1280, height: int = 800) -> None:
        self.profile = tempfile.mkdtemp(prefix="textswap-chromium-")
        self.ctx = pw.chromium.launch_persistent_context(
            self.profile, executable_path=CHROMIUM, headless=True, args=CHROME_ARGS,
            viewport={"width": width, "height": height}, service_workers="block")
        self.page = self.ctx.pages[0] if self.ctx.pages else self.ctx.new_page()
        self.page.set_default_timeout(30000)
        self.js_errors: list[str] = []
        self.console_errors: list[str] = []
        self.bad_responses: list[str] = []
        self.requests: list[tuple[float, str, dict]] = []
        self.page.on("pageerror", lambda e: self.js_errors.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and self.console_errors.append(m.text))
        self.page.on("requestfailed", lambda r: self.bad_responses.append(f"failed {r.url}"))
        self.page.on("response", lambda r: r.status >= 400 and self.bad_responses.append(
            f"{r.status} {r.request.method} {r.url}"))
        self.page.on("request", lambda r: self.requests.append(
            (time.monotonic(), r.url, r.headers)))

    def close(self) -> None:
        self.ctx.close()
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def pw():
    assert sync_api is not None
    with sync_api.sync_playwright() as p:
        yield p


def _demo_csv(n: int) -> str:
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["text", "label"])
    with open(DEMO, encoding="utf-8") as fh:
        for _, line in zip(range(n), fh):
            row = json.loads(line)
            w.writerow([row["text"], row["label"]])
    return out.getvalue()


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("dashboard")
    models = str(base / "models")
    shutil.copytree(tiny_store, models)
    for broken in os.listdir(models):  # the fault-test fixtures would only crowd the page
        if broken not in ("sent", "topic") and not broken.startswith("."):
            shutil.rmtree(os.path.join(models, broken))
    # a version whose report has a confusion matrix (what automatic selection
    # writes) and whose labels hold markup: it must show as text
    src = os.path.join(models, "sent", "1")
    dst = os.path.join(models, "matrix", "1")
    shutil.copytree(src, dst)
    meta_path = os.path.join(dst, "meta.json")
    with open(meta_path, encoding="utf-8") as fh:
        meta = json.load(fh)
    meta.update(name="matrix", version=1, labels=["neg", XSS_LABEL], metrics={
        "accuracy": 0.8, "macro_f1": 0.7917, "measured_on": "cross_validation",
        "per_label": {"neg": {"precision": 0.7143, "recall": 0.8333, "f1": 0.7692, "support": 6},
                      XSS_LABEL: {"precision": 0.875, "recall": 0.7778, "f1": 0.8235,
                                  "support": 9}},
        "confusion_matrix": [[5, 1], [2, 7]]},
        report={"chosen": {"name": "words+chars logreg C=4", "cv_macro_f1": 0.7917},
                "candidates": [{"name": "words logreg C=1", "cv_macro_f1": 0.71, "cv_std": 0.02,
                                "seconds": 0.4},
                               {"name": "words+chars logreg C=4", "cv_macro_f1": 0.7917,
                                "cv_std": 0.03, "seconds": 0.9}]})
    with open(meta_path, "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
    cfg = base / "config.yaml"
    # a long probation: a slow machine must not end it before the test clicks
    cfg.write_text("training:\n  demo_on_empty_store: false\n  max_concurrent: 1\n"
                   "rollout:\n  probation_s: 900\n")
    s = Service(models, args=["--config", str(cfg)])
    code, body = s.mpost("/apply", {"name": "sent", "version": 1})
    assert code == 200, body
    yield s
    s.stop()


def _points(page, job_id: str) -> int:
    got = page.evaluate("(id) => document.querySelector(`.chart[data-job=\"${id}\"]`)"
                        "?.dataset.points ?? null", job_id)
    return int(got) if got else 0


def _page_cost(b: Browser) -> dict:
    """Bytes the first load transferred (encoded), and its request count."""
    sizes = b.page.evaluate("""() => performance.getEntriesByType('resource')
        .concat(performance.getEntriesByType('navigation'))
        .filter(e => e.entryType === 'navigation' || new URL(e.name).pathname.startsWith('/ui/'))
        .map(e => [e.name, e.transferSize, e.decodedBodySize])""")
    return {"files": len(sizes), "transfer_bytes": sum(s[1] for s in sizes),
            "decoded_bytes": sum(s[2] for s in sizes)}


@browser
@pytest.mark.timeout(600)
def test_dashboard_serving_training_apply_history(svc, pw):
    os.makedirs(ARTIFACTS, exist_ok=True)
    b = Browser(pw)
    try:
        page = b.page
        page.goto(svc.dashboard_url())  # logs the tab in (a one-time code)
        slot = page.locator('#slots .slot[data-model="sent"]')
        slot.locator(".slot-version", has_text="v1").wait_for()
        # the code left the address bar; the tab holds the session it bought
        assert "code=" not in page.url
        assert page.evaluate("sessionStorage.getItem('textswap.token')")
        assert "SERVING" in slot.inner_text()
        # the workers table shows the serving worker's pid and memory
        status = svc.status()
        pid = str(status["models"]["sent"]["workers"][0]["pid"] if "models" in status
                  else status["serving"]["pid"])
        page.locator("#workers td", has_text=pid).first.wait_for()
        cost = _page_cost(b)

        # start a job from the form with pasted CSV; its chart gains points live
        form = page.locator("#train-form")
        form.locator('input[name="name"]').fill("sent")
        form.locator('input[name="source"][value="csv"]').check()
        form.locator('textarea[name="csv"]').fill(_demo_csv(2000))
        form.locator('select[name="architecture"]').select_option("bow")  # per-epoch curves
        # long enough (about 10 s here) for the once-a-second page to see it grow
        form.locator('input[name="epochs"]').fill("40")
        form.locator('input[name="params"]').fill(
            '{"early_stopping_patience": 40, "refit": false, "batch_size": 8}')
        form.locator('button[type="submit"]').click()
        msg = form.locator(".form-msg")
        msg.filter(has_text="Started job").wait_for()
        job_id = msg.inner_text().split("Started job ")[1].split(" ")[0]

        seen: list[int] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            n = _points(page, job_id)
            if not seen or n != seen[-1]:
                seen.append(n)
            job = svc.mget(f"/train/{job_id}")[1]["job"]
            if job["state"] not in ("queued", "running"):
                break
            page.wait_for_timeout(200)
        assert job["state"] == "succeeded", job
        wait_for(lambda: _points(page, job_id) == len(job["history"]), 10,
                 "the chart to hold every epoch")
        # live: the chart showed part of the epochs while the job ran, and
        # never lost a point (how many refreshes a busy machine fits in is not
        # the point)
        final = len(job["history"])
        assert seen == sorted(seen) and any(0 < n < final for n in seen), (seen, final)
        chart = page.locator(f'.chart[data-job="{job_id}"]')
        assert chart.locator("canvas").count() >= 1
        legend = chart.locator(".u-legend").inner_text()
        assert "loss" in legend and "val_loss" in legend and "val_accuracy" in legend, legend
        new_version = job["result"]["version"]

        # apply the new version with its button: the slot and the history change,
        # and v1 stays loaded in probation with an instant "Roll back" button
        history = page.locator("#history .timeline > li")
        row = page.locator(f'#models .model[data-model="sent"] tr[data-version="{new_version}"]')
        row.locator("button.apply").click()
        slot.locator(".slot-version", has_text=f"v{new_version}").wait_for(timeout=120000)
        assert svc.serving()["version"] == new_version
        history.filter(has_text=f"v1 → v{new_version}").first.wait_for()
        first = history.first
        assert first.get_attribute("data-kind") == "apply", first.inner_text()
        assert first.locator(".pseg").count() >= 3  # phase timings: queued, spawn, swap...
        row.locator(".dot").wait_for()  # the models list marks the serving version
        probation = slot.locator(".rollout.probation")
        probation.filter(has_text="v1 kept loaded").wait_for()
        probation.locator('[data-f="remaining"]', has_text=" s left").wait_for()

        # roll back: v1 serves again at once, the history and the list say so
        probation.locator("button.rollback").click()
        slot.locator(".slot-version", has_text="v1").wait_for()
        assert svc.serving()["version"] == 1
        probation.wait_for(state="detached")
        rollback = history.filter(has_text=f"v{new_version} → v1").first
        rollback.wait_for()
        assert rollback.get_attribute("data-kind") == "rollback"
        assert "manual rollback" in rollback.inner_text()
        rolled = page.locator(f'#failures .p-rolled_back[data-model="sent"]'
                              f'[data-version="{new_version}"]')
        rolled.wait_for()
        assert "manual" in rolled.inner_text() and "back to v1" in rolled.inner_text()

        # the new version as a shadow beside v1: mirrored requests counted, then promoted
        page.locator('#models .model[data-model="sent"] select.apply-mode').select_option("shadow")
        row.locator("button.apply", has_text="shadow").click()
        shadow = slot.locator('.rollout.candidate[data-mode="shadow"]')
        shadow.wait_for(timeout=120000)
        assert svc.serving()["version"] == 1
        for _ in range(5):
            code, body = svc.predict({"texts": ["很好", "太差了"], "model": "sent"})
            assert code == 200 and body["model"]["version"] == 1, body

        def compared() -> int:
            got = shadow.locator('[data-f="compared"]').inner_text()
            return int(got) if got.isdigit() else 0
        wait_for(lambda: compared() >= 10, 30, "the shadow's compared count to show")
        assert shadow.locator('[data-f="agreement"]').inner_text().endswith("%")
        shadow.locator("button.promote").click()
        slot.locator(".slot-version", has_text=f"v{new_version}").wait_for(timeout=120000)
        shadow.wait_for(state="detached")
        assert svc.serving()["version"] == new_version
        promote = history.filter(has_text=f"v1 → v{new_version}").first
        promote.wait_for()
        wait_for(lambda: promote.get_attribute("data-kind") == "promote", 30, "a promote row")
        assert "from shadow" in promote.inner_text()

        # labels with markup are text: the heat map and per-label table show them
        page.locator('#models .model[data-model="matrix"] button.matrix').click()
        heat = page.locator("#confusion .heat")
        heat.wait_for()
        assert [c.inner_text() for c in heat.locator(".cell").all()] == ["5", "1", "2", "7"]
        assert heat.locator(".head", has_text=XSS_LABEL).count() == 2
        assert page.locator("#confusion td", has_text=XSS_LABEL).count() == 1
        assert page.evaluate("window.__xss") is None
        assert page.evaluate("document.querySelectorAll('script').length") == 2
        assert "words+chars logreg C=4" in page.locator(
            '#models .model[data-model="matrix"]').inner_text()

        # what the open page costs: requests per second while idle (the
        # page counts its own calls; wait_for_timeout keeps events flowing)
        before = page.evaluate("window.textswapDashboard.stats.requests")
        page.wait_for_timeout(6000)
        rate = (page.evaluate("window.textswapDashboard.stats.requests") - before) / 6
        cost["requests_per_s_idle"] = rate
        # live (it keeps asking: about one a second on an idle machine, fewer on
        # a busy one) and never a flood; the figure itself goes to the artifacts
        assert 0 < rate <= 10.0, rate

        page.evaluate("window.scrollTo(0, 0)")  # the sticky header belongs at the top
        page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-desktop.png"), full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_function("document.documentElement.scrollWidth <= 391")
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-phone.png"), full_page=True)
        with open(os.path.join(ARTIFACTS, "dashboard-cost.json"), "w") as fh:
            json.dump(cost, fh, indent=1)

        assert not b.js_errors, b.js_errors
        assert not b.bad_responses, b.bad_responses
        assert not b.console_errors, b.console_errors
    finally:
        b.close()


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    base = tmp_path_factory.mktemp("dashlock")
    cfg = base / "config.yaml"
    cfg.write_text("worker:\n  standby: false\ntraining:\n  demo_on_empty_store: false\n")
    s = Service(str(base / "models"), args=["--config", str(cfg)],
                env={"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN})
    yield s
    s.stop()


@browser
def test_dashboard_asks_for_the_token_and_says_when_it_is_wrong(locked, pw):
    b = Browser(pw, 390, 844)
    try:
        page = b.page
        page.goto(f"http://127.0.0.1:{locked.mport}/")
        auth = page.locator("#auth")
        auth.wait_for(state="visible")
        assert "needs a key" in page.locator("#auth-msg").inner_text()
        assert page.locator("#slots").inner_text() == ""  # nothing shown without it

        page.locator("#auth-token").fill("not-the-token")
        page.locator("#auth-form button").click()
        refused = page.locator("#auth-msg.error", has_text="refused this key")
        refused.wait_for()
        assert auth.is_visible()

        page.locator("#auth-token").fill(TOKEN)
        page.locator("#auth-form button").click()
        auth.wait_for(state="hidden")
        page.locator("#conn.ok").wait_for()
        page.locator("#slots .empty", has_text="No model serves").wait_for()
        assert page.evaluate("sessionStorage.getItem('textswap.token')") == TOKEN
        # asked once: a reload keeps it for this tab, and every API call sends it
        mark = len(b.requests)
        page.reload()
        page.locator("#conn.ok").wait_for()
        assert not auth.is_visible()
        api = [(u, hd) for _, u, hd in b.requests[mark:] if "/ui/" not in u and not
               u.endswith(f":{locked.mport}/")]
        assert api and all(hd.get("authorization") == f"Bearer {TOKEN}" for _, hd in api), api

        assert not b.js_errors, b.js_errors
        # the only failed requests are the 401s that made the page ask
        assert all(r.startswith("401 ") for r in b.bad_responses), b.bad_responses
        assert all("401" in e for e in b.console_errors), b.console_errors
    finally:
        b.close()


@browser
def test_dashboard_reads_prometheus_text_and_pasted_csv(locked, pw):
    """The page's own parsers, run in the browser: live req/s and p50/p99 from
    two /metrics scrapes (bucket differences), and pasted CSV with quoting."""
    b = Browser(pw)
    try:
        b.page.goto(f"http://127.0.0.1:{locked.mport}/")
        got = b.page.evaluate("""async () => {
            const {LiveFigures} = await import('/ui/js/metrics.js');
            const {examplesFrom} = await import('/ui/js/csv.js');
            const scrape = (n, b) => [
              '# TYPE textswap_requests_total counter',
              `textswap_requests_total{api="predict",code="200",model="sent",version="1"} ${n}`,
              'textswap_requests_total{api="predict",code="400",model="",version=""} 3',
              '# TYPE textswap_request_duration_seconds histogram',
              ...['0.001', '0.005', '0.01', '+Inf'].map((le, i) =>
                `textswap_request_duration_seconds_bucket{model="sent",version="1",le="${le}"} ${b[i]}`),
              'textswap_model_seconds_bucket{model="sent",version="1",le="+Inf"} 5', ''].join('\\n');
            const live = new LiveFigures();
            live.addMetrics(scrape(100, [0, 50, 100, 100]));
            live.addMetrics(scrape(300, [0, 150, 296, 300]));
            // exactly two seconds apart, however long the calls took
            live.scrapes[0].t = live.scrapes[1].t - 2000;
            return {fig: live.figures('sent'), none: live.figures('other'),
                    csv: examplesFrom('text,label\\n"a, ""quoted"" text",pos\\nplain,neg\\r\\n"two\\nlines",<b>x</b>\\n'),
                    jsonl: examplesFrom('{"text": "x", "label": "a"}\\n{"text": "y", "label": "b"}')};
        }""")
        fig = got["fig"]
        assert 99 <= fig["rps"] <= 101 and fig["source"] == "metrics", fig
        assert fig["p50"] == pytest.approx(5.0) and fig["p99"] == pytest.approx(10.0), fig
        assert got["none"]["rps"] is None and got["none"]["p50"] is None
        assert got["csv"] == [{"text": 'a, "quoted" text', "label": "pos"},
                              {"text": "plain", "label": "neg"},
                              {"text": "two\nlines", "label": "<b>x</b>"}]
        assert got["jsonl"] == [{"text": "x", "label": "a"}, {"text": "y", "label": "b"}]
        assert not b.js_errors, b.js_errors
    finally:
        b.close()


def _copy_version(store: str, src: str, name: str, version: int,
                  labels: list[str] | None = None) -> None:
    dst = os.path.join(store, name, str(version))
    shutil.copytree(os.path.join(store, src), dst)
    meta_path = os.path.join(dst, "meta.json")
    with open(meta_path, encoding="utf-8") as fh:
        meta = json.load(fh)
    meta.update(name=name, version=version)
    if labels:
        meta["labels"] = labels
    with open(meta_path, "w", encoding="utf-8") as fh:
        json.dump(meta, fh)


@pytest.fixture(scope="module")
def rollout_states(tiny_store, tmp_path_factory):
    """/status and /history of a real service that went through what a short
    UI test cannot click through: a refused quality gate, an automatic
    rollback of an erroring version, a crash that marks a model FAILED, a
    canary with figures, then its promote and the end of the probation that
    follows. (A crashing or erroring version cannot come from a real model:
    TEXTSWAP_TEST_FAULT makes those workers misbehave, as in test_rollouts.py.)
    Returns (status while the canary runs, history at the end)."""
    from tests.tinymodels import EXAMPLES

    base = tmp_path_factory.mktemp("dashstates")
    models = str(base / "models")
    os.makedirs(models)
    for v in (1, 2):
        shutil.copytree(os.path.join(tiny_store, "sent", str(v)), os.path.join(models, "sent", str(v)))
    _copy_version(models, "sent/1", "roll", 1)
    _copy_version(models, "sent/1", "roll", 2, labels=["pos", "neg"])  # a bad model
    _copy_version(models, "sent/2", "roll", 3)  # fails every request (fault)
    _copy_version(models, "sent/2", "roll", 4)
    _copy_version(models, "sent/1", "crashy", 1)  # crashes on use (fault)
    cfg = base / "config.yaml"
    # a probation long enough for the automatic rollback to be judged on a
    # busy machine (5 requests), short enough to see the one after the promote end
    cfg.write_text("training:\n  demo_on_empty_store: false\n"
                   "worker:\n  max_restarts: 0\n  standby_pool: 2\n"
                   f"rollout:\n  probation_s: {PROBATION_S}\n  min_requests: 5\n")
    env = {"TEXTSWAP_TEST_FAULT": "predict:error:roll@3,predict:crash:crashy"}
    s = Service(models, args=["--config", str(cfg)], env=env)
    try:
        def ok(method, path, body=None, want=200):
            code, answer = {"POST": s.mpost, "PUT": s.request_put}[method](path, body, timeout=180)
            assert code == want, (path, code, answer)
            return answer
        examples = [{"text": t, "label": lab} for lab in ("pos", "neg") for t in EXAMPLES[lab]]
        ok("PUT", "/models/roll/golden", {"data": {"examples": examples}})
        ok("POST", "/apply", {"name": "roll", "version": 1})
        answer = ok("POST", "/apply", {"name": "roll", "version": 2}, want=409)
        assert answer["error"]["code"] == "quality_gate", answer
        ok("POST", "/apply", {"name": "roll", "version": 3, "gate": False})

        def rolled_back():
            s.predict({"text": "很好", "model": "roll"})
            return [r for r in s.status()["models"]["roll"]["rolled_back"] if r["version"] == 3]
        wait_for(rolled_back, 60, "the automatic rollback of roll v3", interval=0.1)
        ok("POST", "/apply", {"name": "crashy", "default": False})
        s.predict({"text": "很好", "model": "crashy"})  # its worker dies: FAILED at once
        wait_for(lambda: s.status()["failed_models"], 60, "crashy marked FAILED")
        s.wait_standby(180)
        ok("POST", "/apply", {"name": "roll", "version": 4, "mode": "canary", "fraction": 0.25,
                              "gate": False})
        for _ in range(40):
            assert s.predict({"text": "很好", "model": "roll"})[0] == 200
        status = s.status()
        ok("POST", "/promote", {"name": "roll"})

        def ended():
            rows = s.mget("/history?limit=100")[1]["history"]
            return any(r["kind"] == "probation_ended" for r in rows) and rows
        history = wait_for(ended, PROBATION_S + 120, "the probation after the promote to end",
                           interval=0.5)
        yield status, history
    finally:
        s.stop()


PROBATION_S = 20


def _js_num(x: float, digits: int = 4) -> str:
    """The page's fmtNum: an integral number without decimals."""
    return str(int(x)) if float(x).is_integer() else f"{x:.{digits}f}"
MARKUP_NAME = "<b>x</b>"
MARKUP_REASON = "cannot load: <img src=x onerror=window.__xss=1>"


def _with_markup(status: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """The real shapes, with markup put where a name or a reason is shown (the
    service refuses such names; the page must not trust that)."""
    status = json.loads(json.dumps(status))
    slot = status["models"].pop("crashy")
    slot["name"] = slot["failed"]["name"] = MARKUP_NAME
    slot["failed"]["reason"] = MARKUP_REASON
    status["models"][MARKUP_NAME] = slot
    for f in status["failed_models"]:
        if f["name"] == "crashy":
            f["name"], f["reason"] = MARKUP_NAME, MARKUP_REASON
    history = json.loads(json.dumps(history))
    for row in history:
        if row["name"] == "crashy":
            row["name"] = MARKUP_NAME
        if row["kind"] == "probation_ended":
            row["name"] = MARKUP_NAME
    return status, history


@browser
def test_dashboard_renders_rollout_shapes_as_text(locked, rollout_states, pw):
    """The serving panel and the timeline, run in the browser on /status and
    /history as a real service wrote them (rollout_states: a refused gate, an
    automatic rollback, a FAILED slot after a crash, a canary, a promote and
    the end of its probation), with markup in names and reasons: it shows as
    text. A change of those shapes that the page does not follow fails here."""
    real_status, real_history = rollout_states
    roll = real_status["models"]["roll"]
    cand = roll["candidate"]
    assert cand and cand["mode"] == "canary" and cand["version"] == 4, roll
    (back,) = [r for r in roll["rolled_back"] if r["version"] == 3]
    assert back["auto"] is True and back["back_to"] == 1, back
    kinds = [r["kind"] for r in real_history]
    for kind in ("gate_refused", "crash", "rollback", "apply", "canary", "promote",
                 "probation_ended", "failed"):
        assert kind in kinds, (kind, kinds)
    status, history = _with_markup(real_status, real_history)
    b = Browser(pw)
    try:
        b.page.goto(f"http://127.0.0.1:{locked.mport}/")
        got = b.page.evaluate("""async ([status, records]) => {
            const {renderServing} = await import('/ui/js/serving.js');
            const {renderHistory} = await import('/ui/js/history.js');
            const root = document.createElement('div');
            for (const id of ['slots', 'workers', 'pool', 'failures', 'history', 'sup']) {
              const el = document.createElement('div'); el.id = id; root.appendChild(el);
            }
            const live = {figures: () => ({rps: null, p50: null, p99: null})};
            const clicked = [];
            const actions = {rollback: (n) => clicked.push('rollback ' + n),
                             promote: (n) => clicked.push('promote ' + n),
                             abort: (n) => clicked.push('abort ' + n), unload: () => {}};
            renderServing(root, status, live, actions, new Set());
            renderHistory(root, records, null, '');
            const q = (s) => root.querySelector(s);
            const canary = q('.slot[data-model="roll"] .rollout.candidate');
            canary.querySelector('button.promote').click();
            canary.querySelector('button.abort').click();
            const back = q('.slot[data-model="roll"] button.rollback');
            if (back) back.click();
            return {
              canary: canary.textContent, mode: canary.dataset.mode, clicked,
              rollbackButton: back ? back.textContent : null,
              failedSlot: q('.slot[data-model="<b>x</b>"]').textContent,
              problems: [...root.querySelectorAll('#failures li')].map((li) => [li.className, li.dataset.model, li.dataset.version, li.textContent]),
              rows: [...root.querySelectorAll('#history .timeline > li')].map((li) => [li.dataset.kind, li.textContent]),
              markup: root.querySelectorAll('#slots b, #failures b, #history b, img').length,
            };
        }""", [status, history])
        assert got["mode"] == "canary" and "v4 beside v1: answers 25% of requests" in got["canary"]
        c, sv = cand["candidate"], cand["serving"]
        assert c["requests"] > 0 and sv["requests"] > 0, cand
        assert f"{c['requests']} req · {c['errors']} errors" in got["canary"], (got["canary"], c)
        assert f"{sv['requests']} req · {sv['errors']} errors" in got["canary"], (got["canary"], sv)
        prev = roll.get("previous_version")
        assert got["clicked"] == ["promote roll", "abort roll"] + (
            ["rollback roll"] if prev is not None else [])
        assert got["rollbackButton"] == (f"Roll back to v{prev}" if prev is not None else None)
        assert "FAILED" in got["failedSlot"] and "<img src=x onerror=" in got["failedSlot"]
        problems = {(k, m, v): t for k, m, v, t in got["problems"]}
        assert set(problems) == {("problem p-failed", MARKUP_NAME, "1"),
                                 ("problem p-rolled_back", "roll", "3")}, got["problems"]
        auto = problems[("problem p-rolled_back", "roll", "3")]
        assert "auto" in auto and "roll v3 → back to v1" in auto and "error rate" in auto, auto
        assert [k for k, _ in got["rows"]] == [r["kind"] for r in history]
        text: dict[str, list[str]] = {}
        for kind, t in got["rows"]:
            text.setdefault(kind, []).append(t)
        (gate,) = text["gate_refused"]
        g = [r for r in history if r["kind"] == "gate_refused"][0]["details"]["gate"]
        assert "v2 refused, v1 serves on" in gate, gate
        assert (f"accuracy {_js_num(g['candidate']['accuracy'])} vs "
                f"{_js_num(g['serving']['accuracy'])} for v1 on {g['golden_examples']} "
                "golden examples") in gate, (gate, g)
        crash = [r for r in history if r["kind"] == "crash"][0]
        assert any(f"pid {crash['details']['pid']} · exit code {crash['details']['exitcode']}"
                   in t for t in text["crash"]), (text["crash"], crash)
        assert any("v3 → v1" in t and "auto" in t for t in text["rollback"]), text["rollback"]
        assert any(MARKUP_NAME in t and "v1 unloaded, v4 kept" in t
                   for t in text["probation_ended"]), text["probation_ended"]
        assert any("v4 beside v1" in t for t in text["canary"]), text["canary"]
        # the API's own changes are in the timeline too, with the key that made them
        golden = [r for r in history if r["kind"] == "golden"][0]
        assert golden["source"] == "api" and golden["details"]["key"] == "admin", golden
        (shown,) = text["golden"]
        assert (f"{golden['details']['examples']} golden examples" in shown
                and "api · admin" in shown), shown
        assert got["markup"] == 0 and b.page.evaluate("window.__xss") is None
        assert not b.js_errors, b.js_errors
    finally:
        b.close()


def test_page_and_assets_are_static_strict_and_hold_no_data(locked):
    """No browser needed: what the handler answers for the page and its files."""
    import gzip
    import http.client

    def get(path, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", locked.mport, timeout=30)
        try:
            conn.request("GET", path, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    code, hd, body = get("/")  # no token: the page, which holds no data
    assert code == 200 and hd["content-type"].startswith("text/html")
    assert "script-src 'self'" in hd["content-security-policy"]
    assert hd["x-frame-options"] == "DENY" and hd["x-content-type-options"] == "nosniff"
    assert b"/ui/js/main.js" in body and b"<script>" not in body  # no inline script
    assert get("/", {"If-None-Match": hd["etag"]})[0] == 304
    code, hd, body = get("/ui/vendor/uPlot.iife.min.js", {"Accept-Encoding": "gzip"})
    assert code == 200 and hd["content-encoding"] == "gzip"
    assert gzip.decompress(body).startswith(b"/*! https://github.com/leeoniya/uPlot")
    for path in ("/ui/../supervisor.py", "/ui/js/../../dashboard.py", "/ui/nope.js", "/ui/"):
        code, hd, body = get(path)
        assert code == 404 and json.loads(body)["error"]["code"] == "not_found", path
    assert get("/status")[0] == 401  # the data still needs a key


@browser
def test_forget_key_ends_the_dashboard_session(locked, pw):
    """A tab logged in by a one-time URL holds a session token; "Forget key"
    ends that session on the service (POST /auth/logout), so a copy of the
    token is refused from then on."""
    b = Browser(pw)
    try:
        page = b.page
        code, got = locked.mpost("/auth/code", {}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert code == 200, got
        page.goto(got["url"].replace("localhost", "127.0.0.1"))
        page.locator("#conn.ok").wait_for()
        token = page.evaluate("sessionStorage.getItem('textswap.token')")
        assert token and token != TOKEN
        session = {"Authorization": f"Bearer {token}"}
        assert locked.mget("/status", headers=session)[0] == 200
        page.locator("#forget").click()
        wait_for(lambda: locked.mget("/status", headers=session)[0] == 401, 15,
                 "the session ended")
        # the tab drops its copy once the logout's answer is in (after the
        # service ended the session, which the poll above may see first)
        page.wait_for_function("sessionStorage.getItem('textswap.token') === null", timeout=15_000)
        assert not b.js_errors, b.js_errors
    finally:
        b.close()
