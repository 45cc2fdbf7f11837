"""The `textswap` command (textswap_cli/), run as a real subprocess against a real
service with a management token: train --wait, apply, predict from stdin,
status, models, jobs, logs, rollback, shadow/canary with promote and abort,
rollout, history, golden sets and the quality gate, and the exit codes
scripts rely on.

One service for the module; the trained models come from module fixtures and
each test first puts the service in the state it needs, so any test runs
alone or in any order."""
from __future__ import annotations

import csv
import http.server
import json
import os
import subprocess
import sys
import threading
import types

import pytest

from tests.helpers import ROOT, Service, free_port, request, wait_for

DEMO = os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl")
TOKEN = "cli-token-of-at-least-32-characters"

# above the fixtures' waits: three train --wait runs of up to 300 s each
pytestmark = pytest.mark.timeout(1200)



def textswap_cmd() -> list[str]:
    """The console script `make` installs into the venv (python -m as a fallback
    for a venv made before pyproject.toml existed)."""
    script = os.path.join(os.path.dirname(sys.executable), "textswap")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "textswap_cli"]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    cfg = base / "config.yaml"
    cfg.write_text("training:\n  demo_on_empty_store: false\n")
    s = Service(str(base / "models"), args=["--config", str(cfg)],
                env={"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN})
    yield s
    s.stop()


def run(svc: Service, *args: str, stdin: str | None = None, token: str | None = TOKEN,
        timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTSWAP_")}
    env.update({"TEXTSWAP_URL": f"http://127.0.0.1:{svc.mport}",
                "TEXTSWAP_PREDICT_URL": f"http://127.0.0.1:{svc.port}", "COLUMNS": "200"})
    if token:
        env["TEXTSWAP_MANAGEMENT_TOKEN"] = token
    return subprocess.run([*textswap_cmd(), *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=os.path.dirname(ROOT))


@pytest.fixture(scope="module")
def data_csv(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("clidata") / "reviews.csv")
    with open(DEMO, encoding="utf-8") as src, open(path, "w", encoding="utf-8",
                                                   newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "label"])
        for _, line in zip(range(300), src):
            row = json.loads(line)
            w.writerow([row["text"], row["label"]])
    return path


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def api(svc: Service, method: str, path: str, body=None) -> dict:
    code, answer = request(svc.mport, method, path, body, headers=AUTH, timeout=300)
    assert code == 200, (method, path, code, answer)
    return answer


@pytest.fixture(scope="module")
def reviews(svc, data_csv) -> dict:
    """`train --wait` of reviews v1 (the CSV is read by the CLI: it is outside
    the server's data roots); the finished job."""
    p = run(svc, "train", "reviews", data_csv, "--param", "epochs=3", "-p", "refit=false",
            "-p", "architecture=bow",
            "--wait", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["job"]


@pytest.fixture(scope="module")
def rb(svc, data_csv) -> list[dict]:
    """rb v1 and v2, each by `train --apply --wait`; the two finished jobs."""
    jobs = []
    for version in (1, 2):
        p = run(svc, "train", "rb", data_csv, "-p", "architecture=bow", "-p", "epochs=1",
                "--apply", "--wait", "--json")
        assert p.returncode == 0, p.stderr
        job = json.loads(p.stdout)["job"]
        assert job["result"]["version"] == version
        jobs.append(job)
    return jobs


def rb_swapped(svc) -> dict:
    """rb v2 serves after a swap from v1, which stays loaded in probation; no
    candidate, no golden set. The answer of the apply of v2."""
    request(svc.mport, "DELETE", "/models/rb/golden", headers=AUTH)
    if api(svc, "GET", "/rollouts/rb")["candidate"]:
        api(svc, "POST", "/abort", {"name": "rb"})
    api(svc, "POST", "/apply", {"name": "rb", "version": 1})
    return api(svc, "POST", "/apply", {"name": "rb", "version": 2})


def served_by(svc, text: str = "好") -> int:
    p = run(svc, "predict", "--model", "rb", text)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["model"]["version"]


def test_train_wait_apply_predict_status(svc, reviews):
    job = reviews
    assert job["state"] == "succeeded" and job["result"] == {"name": "reviews", "version": 1}
    assert job["params"]["epochs"] == 3 and job["params"]["refit"] is False
    assert job["data"]["examples"] == 300 and job["data"]["source"] == "inline"

    p = run(svc, "apply", "reviews", "1")
    assert p.returncode == 0, p.stderr
    assert "now serving reviews v1" in p.stdout

    texts = ["非常好，很满意，推荐购买", "", "太差了，质量不好，退货"]
    p = run(svc, "predict", stdin="\n".join(texts) + "\n")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert [x["text"] for x in lines] == [texts[0], texts[2]]  # blank lines skipped
    assert [x["label"] for x in lines] == ["pos", "neg"]
    assert all(x["model"] == {"name": "reviews", "version": 1} for x in lines)
    assert all(0 < x["score"] <= 1 and x["top"] for x in lines)

    # more texts than one batch: several requests, order kept
    many = [f"{t} {i}" for i in range(7) for t in (texts[0], texts[2])]
    p = run(svc, "predict", "--batch-size", "3", "--top-k", "1", *many)
    assert p.returncode == 0, p.stderr
    out = [json.loads(line) for line in p.stdout.splitlines()]
    assert [x["text"] for x in out] == many and all(len(x["top"]) == 1 for x in out)

    p = run(svc, "status")
    assert p.returncode == 0, p.stderr
    assert "reviews" in p.stdout and "SERVING" in p.stdout
    p = run(svc, "status", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["supervisor"]["pid"] == svc.proc.pid

    p = run(svc, "models")
    assert p.returncode == 0 and "reviews" in p.stdout, p.stderr
    p = run(svc, "jobs")
    assert p.returncode == 0 and job["id"] in p.stdout and "succeeded" in p.stdout
    p = run(svc, "--json", "jobs")
    assert job["id"] in [j["id"] for j in json.loads(p.stdout)["jobs"]]
    p = run(svc, "logs", job["id"])
    assert p.returncode == 0 and "val_accuracy" in p.stdout and "reviews v1" in p.stdout


def test_refusals_and_exit_codes(svc, data_csv, tmp_path):
    # a bad input the server refuses: one label only -> exit 1, the reason shown
    one_label = tmp_path / "one.jsonl"
    one_label.write_text("".join(json.dumps({"text": f"t{i}", "label": "a"}) + "\n"
                                 for i in range(5)), encoding="utf-8")
    p = run(svc, "train", "x", str(one_label))
    assert p.returncode == 1 and "two labels" in p.stderr, (p.stdout, p.stderr)
    p = run(svc, "train", "x", str(one_label), "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["error"]["code"] == "invalid_data"
    p = run(svc, "train", "x", data_csv, "-p", "epochs=0")
    assert p.returncode == 1 and "epochs" in p.stderr
    p = run(svc, "apply", "nosuchmodel")
    assert p.returncode == 1 and "404" in p.stderr
    p = run(svc, "predict", "--model", "nosuchmodel", "hello")
    assert p.returncode == 1 and p.stdout == ""
    # local input problems and usage errors: exit 2, nothing sent
    p = run(svc, "train", "x", str(tmp_path / "missing.csv"))
    assert p.returncode == 2 and "cannot read" in p.stderr
    bad_header = tmp_path / "bad.csv"
    bad_header.write_text("words,tag\nhello,a\n", encoding="utf-8")
    p = run(svc, "train", "x", str(bad_header))
    assert p.returncode == 2 and "'text' and 'label'" in p.stderr
    p = run(svc, "train", "x", data_csv, "-p", "noequals")
    assert p.returncode == 2 and "KEY=VALUE" in p.stderr
    p = run(svc, "apply", "reviews", "zero")
    assert p.returncode == 2
    p = run(svc, "predict", stdin="\n\n")
    assert p.returncode == 2 and "no texts" in p.stderr
    # no token: exit 4; nothing listening: exit 3
    p = run(svc, "status", token=None)
    assert p.returncode == 4 and "TEXTSWAP_KEY" in p.stderr
    p = run(svc, "--url", f"http://127.0.0.1:{free_port()}", "status")
    assert p.returncode == 3 and "cannot reach" in p.stderr
    # rollback of a model that does not serve: the server's 404, with the reason
    # (nothing to roll back to: test_train_apply_wait_then_rollback; a server
    # without POST /rollback: test_rollback_on_a_server_without_the_route)
    p = run(svc, "rollback", "nosuchmodel")
    assert p.returncode == 1 and "'nosuchmodel' is not serving" in p.stderr, p.stderr


def test_progress_line_for_epochs_and_candidates(monkeypatch):
    """The live bar and the tables read both progress shapes the trainer sends:
    Keras epochs, and the model search's candidates (figures as frames carry them)."""
    from rich.console import Console

    from textswap_cli import render

    epoch = {"epoch": 2, "epochs": 10, "loss": 0.5, "val_accuracy": 0.75}
    search = {"phase": "search", "candidate": 3, "of": 17, "name": "word/svm C=1",
              "score": 0.8, "best_score": 0.81}
    assert render._where(epoch) == "epoch 2/10"
    assert render._where(search) == "candidate 3/17"
    assert "loss 0.5000" in render._figures(epoch) and "0.7500" in render._figures(epoch)
    assert "word/svm C=1" in render._figures(search) and "0.8100" in render._figures(search)
    for progress, done, total in ((epoch, 2, 10), (search, 3, 17)):
        bar = render.JobProgress("j-1")
        bar.update({"state": "running", "progress": progress, "history": [progress]})
        task = bar.progress.tasks[0]
        assert (task.completed, task.total) == (done, total)
    monkeypatch.setattr(render, "out", Console(record=True, width=200))
    render.job_log({"id": "j-1", "name": "m", "state": "succeeded", "history": [search],
                    "data": {"examples": 40}})
    text = render.out.export_text()
    assert "candidate" in text and "word/svm C=1" in text and "best_score" in text


def test_export_writes_the_artifact(svc, reviews, tmp_path):
    """`export` unpacks GET /models/<name>/<version>/artifact into DIR, and
    refuses a DIR that is not empty."""
    code, doc = request(svc.mport, "GET", "/openapi.json", headers=AUTH)
    assert code == 200 and "/models/{name}/{version}/artifact" in doc["paths"], doc.get("paths")
    out = tmp_path / "exported"
    p = run(svc, "export", "reviews", "1", str(out))
    assert p.returncode == 0, p.stderr
    assert (out / "model.keras").is_file() and (out / "meta.json").is_file()
    assert (out / "saved_model" / "saved_model.pb").is_file()
    assert not (out / "reviews").exists()  # the <name>/<version>/ prefix is stripped
    meta = json.loads((out / "meta.json").read_text())
    assert meta["labels"] == ["neg", "pos"] and meta["version"] == 1
    p = run(svc, "export", "reviews", "1", str(out))  # DIR not empty: refused locally
    assert p.returncode == 2 and "not empty" in p.stderr


class OlderServer:
    """An older server: every request answers the 404 the real service gives for
    an unknown endpoint (`answer`), and its path is recorded."""

    def __init__(self, answer: dict) -> None:
        body = json.dumps(answer).encode()
        self.paths: list[str] = []
        paths = self.paths

        class Older(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                paths.append(self.path)
                self.send_response(404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815 (http.server's names)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Older)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """The CLI against this server (both ports)."""
        try:
            return run(types.SimpleNamespace(port=self.port, mport=self.port), *args)
        finally:
            self.server.shutdown()
            self.server.server_close()


def test_export_refused_by_a_server_without_the_route(svc, tmp_path):
    """A server without the artifact route (an older one) answers the CLI with
    the 404 the real service gives for an unknown endpoint: `export` says the
    server does not support it, exits 1 and writes nothing."""
    code, missing = request(svc.mport, "GET", "/no/such/route", headers=AUTH)
    assert code == 404 and missing["error"]["message"].startswith("no such endpoint"), missing
    older = OlderServer(missing)
    out = tmp_path / "exported"
    p = older.run("export", "reviews", "1", str(out))
    assert older.paths == ["/models/reviews/1/artifact"], older.paths
    assert p.returncode == 1 and "does not support artifact export" in p.stderr, p.stderr
    assert not out.exists()


def test_rollback_on_a_server_without_the_route(svc):
    """A server without POST /rollback (an older one) answers 404 for the route
    itself: `rollback` says the server does not support it and exits 1."""
    code, missing = request(svc.mport, "POST", "/no/such/route", {}, headers=AUTH)
    assert code == 404 and missing["error"]["message"].startswith("no such endpoint"), missing
    older = OlderServer(missing)
    p = older.run("rollback", "rb")
    assert older.paths == ["/rollback"], older.paths
    assert p.returncode == 1 and "does not support rollback" in p.stderr, p.stderr


def test_train_apply_wait_then_rollback(svc, rb):
    """--apply --wait returns once the new version serves; `rollback` brings the
    previous one back at once (still loaded in probation), and `history`,
    `rollout` and `status` say so."""
    assert all(j["applied"] and "error" not in j["applied"] for j in rb)
    applied = rb_swapped(svc)
    assert served_by(svc) == 2
    p = run(svc, "rollout", "rb")
    assert p.returncode == 0, p.stderr
    assert "rb: probation, v1 kept loaded" in p.stdout, p.stdout

    p = run(svc, "rollback", "rb")
    assert p.returncode == 0, p.stderr
    assert "rolled back rb v2 -> v1 instantly" in p.stdout, p.stdout
    assert served_by(svc) == 1
    # v1 is no longer kept anywhere: nothing left to roll back to
    p = run(svc, "rollback", "rb")
    assert p.returncode == 1 and "no previous version" in p.stderr, p.stderr

    p = run(svc, "rollout", "rb", "--json")
    assert p.returncode == 0, p.stderr
    state = json.loads(p.stdout)
    assert state["version"] == 1 and state["probation"] is None
    assert [(r["version"], r["back_to"], r["auto"]) for r in state["rolled_back"]] == [
        (2, 1, False)]
    p = run(svc, "status")
    assert "rb: v2 rolled back to v1 (manual" in p.stdout, p.stdout

    def newest():
        p = run(svc, "history", "--name", "rb", "--limit", "3", "--json")
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["history"]
    rows = wait_for(lambda: (lambda h: h if h and h[0]["kind"] == "rollback" else None)(
        newest()), 30, "the rollback in the history")  # written by a thread: poll
    assert len(rows) == 3 and all(r["name"] == "rb" for r in rows)
    assert (rows[0]["from_version"], rows[0]["to_version"], rows[0]["source"]) == (2, 1, "api")
    assert rows[1]["kind"] == "apply" and (rows[1]["from_version"], rows[1]["to_version"]) == (
        1, 2)
    assert rows[1]["phases"] == applied["phases_s"]  # the apply's own timings, kept
    p = run(svc, "history", "--name", "rb", "--limit", "2")
    assert p.returncode == 0, p.stderr
    assert "rollback" in p.stdout and "v2 -> v1" in p.stdout and "manual rollback" in p.stdout
    p = run(svc, "history", "--limit", "0")
    assert p.returncode == 2


def test_shadow_promote_canary_abort(svc, rb):
    """`apply --mode shadow` runs v2 beside v1 (v1 answers; v2's answers are
    compared), `promote` makes it serve; `apply --mode canary --fraction`
    and `abort` drop a candidate again. `history` lists each step."""
    rb_swapped(svc)
    api(svc, "POST", "/apply", {"name": "rb", "version": 1})  # v1 serves, no candidate
    p = run(svc, "apply", "rb", "2", "--mode", "shadow")
    assert p.returncode == 0, p.stderr
    assert "rb v2 runs as a shadow beside rb v1" in p.stdout, p.stdout
    texts = [f"很好，推荐 {i}" for i in range(6)]
    p = run(svc, "predict", "--model", "rb", *texts)
    assert p.returncode == 0 and all(json.loads(x)["model"]["version"] == 1
                                     for x in p.stdout.splitlines()), p.stdout

    def compared():
        c = api(svc, "GET", "/rollouts/rb")["candidate"]
        return c if c and c["compared"] >= len(texts) else None
    cand = wait_for(compared, 30, "the shadow's answers to be compared")
    assert cand["mode"] == "shadow" and cand["version"] == 2 and cand["mirrored"] >= 1
    p = run(svc, "rollout", "rb")
    assert p.returncode == 0 and "shadow candidate v2" in p.stdout and "agreement" in p.stdout
    p = run(svc, "promote", "rb")
    assert p.returncode == 0, p.stderr
    assert "promoted rb v2 from shadow" in p.stdout and "compared" in p.stdout, p.stdout
    assert served_by(svc) == 2

    p = run(svc, "apply", "rb", "1", "--mode", "canary", "--fraction", "0.5", "--json")
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)
    assert (answer["mode"], answer["fraction"], answer["candidate"]["version"]) == (
        "canary", 0.5, 1)
    p = run(svc, "status")
    assert "rb: canary candidate v1 (50.0%)" in p.stdout, p.stdout
    p = run(svc, "abort", "rb")
    assert p.returncode == 0 and "aborted the canary of rb v1" in p.stdout, p.stdout
    assert api(svc, "GET", "/rollouts/rb")["candidate"] is None and served_by(svc) == 2
    # nothing to promote or abort now; --fraction alone is a usage error
    p = run(svc, "abort", "rb")
    assert p.returncode == 1 and "no_candidate" in p.stderr, p.stderr
    p = run(svc, "promote", "rb", "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["error"]["code"] == "no_candidate"
    p = run(svc, "apply", "rb", "1", "--fraction", "0.5")
    assert p.returncode == 2 and "--mode" in p.stderr

    def kinds():
        rows = json.loads(run(svc, "history", "--name", "rb", "--limit", "6", "--json"
                              ).stdout)["history"]
        # (a probation that ran out meanwhile is listed too)
        got = [r["kind"] for r in rows if r["kind"] != "probation_ended"][:4]
        return got if got[0] == "abort" else None
    assert wait_for(kinds, 30, "the abort in the history") == [
        "abort", "canary", "promote", "shadow"]


def test_golden_set_gates_apply(svc, rb, tmp_path):
    """`golden NAME DATA` registers a golden set; an apply that scores below
    its min accuracy is refused (exit 1, the server's reason), --no-gate
    applies anyway; `golden --delete` removes it."""
    rb_swapped(svc)
    api(svc, "POST", "/apply", {"name": "rb", "version": 1})
    # the labels are flipped: any real model scores far below 0.9 on them
    flipped = tmp_path / "golden.jsonl"
    with open(DEMO, encoding="utf-8") as src, open(flipped, "w", encoding="utf-8") as fh:
        for _, line in zip(range(40), src):
            row = json.loads(line)
            row["label"] = {"pos": "neg", "neg": "pos"}[row["label"]]
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    try:
        p = run(svc, "golden", "rb", str(flipped), "--min-accuracy", "0.9")
        assert p.returncode == 0, p.stderr
        assert "golden set of rb: 40 examples" in p.stdout and "min accuracy 0.9" in p.stdout
        p = run(svc, "golden", "rb", "--json")
        assert json.loads(p.stdout)["golden"]["examples"] == 40

        p = run(svc, "apply", "rb", "2", "--json")
        assert p.returncode == 1 and "quality gate refused rb v2" in p.stderr, p.stderr
        assert json.loads(p.stdout)["error"]["code"] == "quality_gate"
        assert served_by(svc) == 1
        p = run(svc, "apply", "rb", "2", "--no-gate")
        assert p.returncode == 0, p.stderr
        assert "now serving rb v2" in p.stdout and "quality gate: skipped" in p.stdout
        assert "`textswap rollback rb` is instant" in p.stdout, p.stdout
        assert served_by(svc) == 2
        rows = json.loads(run(svc, "history", "--name", "rb", "--limit", "10", "--json"
                              ).stdout)["history"]
        assert "gate_refused" in [r["kind"] for r in rows]
    finally:
        p = run(svc, "golden", "rb", "--delete")
    assert p.returncode == 0 and "removed" in p.stdout, p.stderr
    p = run(svc, "golden", "rb")
    assert p.returncode == 1 and "404" in p.stderr
    p = run(svc, "golden", "rb", "--delete", str(flipped))
    assert p.returncode == 2


def test_ctrl_c_during_wait_offers_to_cancel(svc, tmp_path):
    """On a terminal, Ctrl-C while following a job asks whether to cancel it;
    'y' cancels it on the server and the command exits 130."""
    import pty
    import signal
    import threading

    from tests.helpers import wait_for

    rows = [json.loads(line) for _, line in zip(range(2000), open(DEMO, encoding="utf-8"))]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    master, slave = pty.openpty()
    env = {**os.environ, "TEXTSWAP_URL": f"http://127.0.0.1:{svc.mport}",
           "TEXTSWAP_MANAGEMENT_TOKEN": TOKEN}
    proc = subprocess.Popen([*textswap_cmd(), "train", "long", str(data), "-p",
                             "architecture=bow", "-p", "epochs=200", "-p",
                             "early_stopping_patience=100", "--wait"],
                            stdin=slave, stdout=slave, stderr=slave, env=env,
                            # a test run started in the background inherits SIGINT
                            # ignored: give the command a terminal's default
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    seen = bytearray()

    def drain() -> None:  # the live bar redraws: keep the terminal's buffer empty
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        def running_job():
            jobs = request(svc.mport, "GET", "/train",
                           headers={"Authorization": f"Bearer {TOKEN}"})[1]["jobs"]
            return next((j for j in jobs if j["name"] == "long" and j["state"] == "running"
                         and (j["progress"].get("epoch") or 0) >= 1), None)
        job = wait_for(running_job, 240, "the job to train", interval=0.25)
        # the command follows the job once it draws its bar: a forked trainer
        # can reach epoch 1 before the command has started following it
        wait_for(lambda: b"epoch" in seen, 60, "the command's progress bar")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: b"Cancel job" in seen, 30, "the cancel prompt")
        os.write(master, b"y\n")
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    code, body = request(svc.mport, "GET", f"/train/{job['id']}",
                         headers={"Authorization": f"Bearer {TOKEN}"})
    assert code == 200 and body["job"]["state"] == "cancelled", body
