"""Zero-shot versions and single-example labels through the real service (issue 28).

POST /train with "labels": {label: description} and no data trains a
zero-shot version (model_worker/zeroshot.py); it is applied, predicts (the
label whose description matches wins), is logged, takes feedback, and the
retrain policy trains v2 on the fed-back labels plus the descriptions. Bad
"labels" get 4xx JSON errors. A label with a single example trains through
the service and the job says so. One service for the module; real trainer and
worker processes, real TensorFlow."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, Service, request, wait_for
from tests.test_dashboard import ARTIFACTS, Browser, browser, pw  # noqa: F401 (pw: the fixture)

pytestmark = pytest.mark.timeout(900)

DESCRIPTIONS = {
    "sports": "sports: football, tennis, athletics, a match, a team, a goal, players",
    "politics": "politics: government, election, parliament, minister, a vote, a law",
    "technology": "technology: computers, software, the internet, phones, chips, apps",
}
PROBE = {"the striker scored twice in the cup final": "sports",
         "the senate passed the budget bill after a long debate": "politics",
         "the new smartphone has a faster processor and more memory": "technology"}
FEEDBACK = {"the goalkeeper saved a penalty in extra time": "sports",
            "the tennis champion won in straight sets": "sports",
            "the team signed a new coach for the season": "sports",
            "voters chose a new prime minister": "politics",
            "the parliament debated the new immigration law": "politics",
            "the president vetoed the bill": "politics",
            "the company released a software update for its laptops": "technology",
            "a new chip makes phones faster": "technology",
            "the app store removed the malware apps": "technology"}
# the policy retrains from this many labels on; the gate's tolerance of 1 lets no
# accuracy difference refuse v2 (the outcome must not hang on two tiny models)
CONFIG = ("worker:\n  standby: false\ntraining:\n  demo_on_empty_store: false\n"
          "rollout:\n  probation_s: 0\n  gate_tolerance: 1.0\n")


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    base = tmp_path_factory.mktemp("zeroshot")
    cfg = base / "config.yaml"
    cfg.write_text(CONFIG)
    s = Service(str(base / "models"), args=["--config", str(cfg)])
    yield s
    s.stop()


def _wait_job(svc: Service, job_id: str, timeout: float = 400) -> dict:
    def done():
        code, body = svc.mget(f"/train/{job_id}")
        assert code == 200, body
        return body["job"]["state"] in ("succeeded", "failed", "cancelled") and body["job"]
    return wait_for(done, timeout, f"job {job_id}", interval=0.25)


def _meta(svc: Service, name: str, version: int) -> dict:
    with open(os.path.join(svc.models_dir, name, str(version), "meta.json"), encoding="utf-8") as fh:
        return json.load(fh)


def test_bad_labels_are_refused(svc):
    bad = [({"labels": ["sports", "politics"]}, 400, "invalid_labels"),
           ({"labels": {"sports": "games"}}, 400, "invalid_labels"),
           ({"labels": {"sports": "games", "politics": ""}}, 400, "invalid_labels"),
           ({"labels": {"sports": "games", "politics": 3}}, 400, "invalid_labels"),
           ({"labels": {"sports": "games", "politics": "?!"}}, 400, "invalid_labels"),
           ({"labels": {"sports": "games", " ": "votes"}}, 400, "invalid_labels"),
           ({"labels": {"sports": "games", "sports ": "votes"}}, 400, "invalid_labels"),
           ({"labels": None}, 400, "invalid_labels"),
           ({"labels": {"体育": "足球比赛和运动员", "政治": "政府选举和议会"}}, 422,
            "zero_shot_unavailable"),
           ({"labels": DESCRIPTIONS, "params": {"pretrained": False}}, 422,
            "zero_shot_unavailable"),
           ({"labels": DESCRIPTIONS, "feedback": True}, 400, "invalid_field"),
           ({"labels": DESCRIPTIONS, "params": {"views": ["pretrained"], "epochs": 0}}, 400,
            "invalid_params"),
           ({"params": {"architecture": "zero_shot"},
             "data": {"examples": [{"text": "a", "label": "x"}, {"text": "b", "label": "x"},
                                   {"text": "c", "label": "y"}]}}, 400, "invalid_params")]
    for body, status, code in bad:
        got, answer = svc.mpost("/train", {"name": "refused", **body})
        assert got == status and answer["error"]["code"] == code, (body, answer)
        assert answer["error"]["message"], answer
    # nothing was trained (a name of its own: the module's other tests train "topics")
    assert svc.mget("/models/refused")[0] == 404


def test_zero_shot_version_predicts_takes_feedback_and_the_policy_retrains_it(svc):
    code, body = svc.mpost("/train", {"name": "topics", "labels": DESCRIPTIONS, "apply": True,
                                      "params": {"time_budget_s": 15}})
    assert code == 202, body
    job = body["job"]
    assert job["params"]["architecture"] == "zero_shot" and job["data"]["zero_shot"] is True
    assert job["data"]["descriptions"] == DESCRIPTIONS and "warnings" not in job["data"]
    job = _wait_job(svc, job["id"])
    assert job["state"] == "succeeded", job
    assert job["result"]["version"] == 1 and "uncalibrated" in job["result"]["warnings"][0]
    meta = _meta(svc, "topics", 1)
    assert meta["labels"] == ["politics", "sports", "technology"]
    assert meta["params"]["architecture"] == "zero_shot" and meta["report"]["method"] == "zero_shot"
    assert meta["report"]["descriptions"] == DESCRIPTIONS
    assert "Llama 2" in open(os.path.join(svc.models_dir, "topics", "1", "NOTICE"),
                             encoding="utf-8").read()
    wait_for(lambda: (svc.serving() or {}).get("name") == "topics", 120, "topics serving")

    code, pred = svc.predict({"texts": list(PROBE), "model": "topics"})
    assert code == 200 and pred["model"] == {"name": "topics", "version": 1}, pred
    assert [p["label"] for p in pred["predictions"]] == list(PROBE.values()), pred
    code, card = svc.mget("/models/topics/1")
    assert code == 200 and card["report"]["method"] == "zero_shot", card

    code, body = svc.request_put("/models/topics/policy",
                                 {"retrain_after_labels": len(FEEDBACK), "apply": "gate"})
    assert code == 200, body
    code, pred = svc.predict({"texts": list(FEEDBACK), "model": "topics"})
    assert code == 200, pred
    code, fb = request(svc.port, "POST", "/feedback", {"request_id": pred["request_id"],
                                                       "labels": list(FEEDBACK.values())})
    assert code == 200 and fb["stored"] == len(FEEDBACK), fb

    def finished():
        code, body = svc.mget("/history?name=topics&limit=50")
        assert code == 200, body
        return [h for h in body["history"] if h["kind"] in ("retrain_done", "retrain_failed")]
    done = wait_for(finished, 400, "the policy's retraining", interval=0.5)[0]
    assert done["kind"] == "retrain_done", done
    assert done["details"]["version"] == 2 and done["details"]["applied"] is True, done
    code, job = svc.mget(f"/train/{done['details']['job']}")
    data = job["job"]["data"]
    # the feedback (less the gate's hold-out) plus one example per description
    held = done["details"]["held_out"]
    assert data["feedback"]["rows"] == len(FEEDBACK) - held, data
    assert data["examples"] == len(FEEDBACK) - held + len(DESCRIPTIONS), data
    meta = _meta(svc, "topics", 2)
    assert meta["params"]["architecture"] == "auto" and meta["labels"] == meta["labels"]
    assert svc.serving()["version"] == 2
    code, pred = svc.predict({"texts": list(PROBE), "model": "topics"})
    assert code == 200 and pred["model"]["version"] == 2, pred


def test_a_single_example_label_trains_and_is_warned_about_and_descriptions_add_examples(svc):
    pos = ["a wonderful film", "great acting and a lovely story", "I loved every minute",
           "brilliant and moving", "a delight from start to end", "superb cast, great fun"]
    neg = ["a dreadful film", "boring and far too long", "I hated every minute",
           "awful acting, a weak story", "a waste of time", "dull, flat and silly"]
    rows = ([{"text": t, "label": "pos"} for t in pos] + [{"text": t, "label": "neg"} for t in neg]
            + [{"text": "the football match ended with a late goal", "label": "sport"}])
    # with data, a description is one more example of its label
    described = {"pos": "a good film, loved it", "neg": "a bad film, hated it"}
    code, body = svc.mpost("/train", {"name": "films", "data": {"examples": rows},
                                      "labels": described,
                                      "params": {"architecture": "auto", "time_budget_s": 15}})
    assert code == 202, body
    data = body["job"]["data"]
    assert data["examples"] == len(rows) + 2 and data["label_counts"] == {"neg": 7, "pos": 7, "sport": 1}
    assert data["descriptions"] == described and "zero_shot" not in data
    assert data["single_example_labels"] == ["sport"]
    job = _wait_job(svc, body["job"]["id"])
    assert job["state"] == "succeeded", job
    assert "single example ('sport')" in job["result"]["warnings"][0], job["result"]
    meta = _meta(svc, "films", job["result"]["version"])
    assert meta["warnings"] == meta["report"]["warnings"] == job["result"]["warnings"]


def test_the_cli_trains_a_zero_shot_version_from_a_labels_file(svc, tmp_path):
    path = tmp_path / "descriptions.json"
    path.write_text(json.dumps(DESCRIPTIONS), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTSWAP_")}
    env.update(TEXTSWAP_URL=f"http://127.0.0.1:{svc.mport}", TEXTSWAP_KEY=svc.keys["admin"])
    proc = subprocess.run([sys.executable, "-m", "textswap_cli", "--json", "train", "news",
                           "--labels-file", str(path), "--wait"], capture_output=True,
                          text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)["job"]
    assert job["state"] == "succeeded" and job["params"]["architecture"] == "zero_shot", job


@browser
def test_the_dashboards_form_trains_a_zero_shot_version_from_descriptions(svc, pw):
    os.makedirs(ARTIFACTS, exist_ok=True)
    b = Browser(pw)
    try:
        page = b.page
        page.goto(svc.dashboard_url())
        page.locator("#conn.ok").wait_for()
        form = page.locator("#train-form")
        form.locator('input[name="name"]').fill("webtopics")
        form.locator('input[name="source"][value="none"]').check()
        # no data: the path box hides, the descriptions are required, the
        # architecture and epochs (not a zero-shot version's) are off
        assert form.locator(".src-path").is_hidden() and form.locator(".src-csv").is_hidden()
        assert "required" in form.locator(".labels-need").inner_text()
        assert form.locator('select[name="architecture"]').is_disabled()
        submit, msg = form.locator('button[type="submit"]'), form.locator(".form-msg")
        # refused in the page, before any request: no descriptions, a line without a colon
        for text, says in (("", "give each label a description"),
                           ("sports football tennis", "line 1: write it as 'label: description'")):
            form.locator('textarea[name="labels"]').fill(text)
            submit.click()
            msg.filter(has_text=says).wait_for()
            assert "error" in (msg.get_attribute("class") or "")
        lines = "\n".join(f"{label}: {text}" for label, text in DESCRIPTIONS.items())
        form.locator('textarea[name="labels"]').fill(lines + "\n")
        submit.click()
        msg.filter(has_text="Started job").wait_for()
        job_id = msg.inner_text().split("Started job ")[1].split(" ")[0]
        page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-zero-shot-form.png"), full_page=True)
        job = _wait_job(svc, job_id)
        assert job["state"] == "succeeded" and job["params"]["architecture"] == "zero_shot", job
        # the label ends at the first colon: each description arrived whole
        assert job["data"]["descriptions"] == DESCRIPTIONS, job["data"]
        assert _meta(svc, "webtopics", job["result"]["version"])["labels"] == sorted(DESCRIPTIONS)
        assert not b.js_errors and not b.console_errors, (b.js_errors, b.console_errors)
        assert not b.bad_responses, b.bad_responses
    finally:
        b.close()
