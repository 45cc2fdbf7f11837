"""Lock-down through the real service: keys on by default (the generated key
file, each key's scope on each port, rotation, the dashboard's one-time
code, auth off), no cross-site requests, no secret leaks, file modes.
Most need no model, so these services run without workers (standby off)."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from typing import Any

import pytest

from tests.helpers import ROOT, Service, keys_file, request, wait_for

TOKEN = "s3cret-token-value-of-32-characters-or-more"


def _config(tmp_path, extra: str = "") -> str:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("worker:\n  standby: false\ntraining:\n  demo_on_empty_store: false\n" + extra)
    return str(cfg)


def test_token_guards_every_management_request(tmp_path):
    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)],
                  env={"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN})
    try:
        for method, path, body in (("GET", "/status", None), ("GET", "/models", None),
                                   ("POST", "/apply", {"name": "x"}), ("GET", "/train", None),
                                   ("POST", "/train", {"name": "x"}),
                                   ("DELETE", "/train/1", None)):
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": f"Basic {TOKEN}"}):
                code, got = request(svc.mport, method, path, body, headers=headers, auth=False)
                assert code == 401 and got["error"]["code"] == "unauthorized", (path, got)
        ok = {"Authorization": f"Bearer {TOKEN}"}
        code, status = svc.mget("/status", headers=ok)
        assert code == 200
        assert svc.mget("/models", headers=ok)[0] == 200
        assert svc.get("/healthz")[0] == 200  # the inference port needs no token
        assert TOKEN not in json.dumps(status)
    finally:
        svc.stop()
    assert TOKEN not in svc.log()


def test_open_management_beyond_loopback_refuses_to_start(tmp_path):
    """auth.enabled: false with the management API bound beyond loopback: the
    service refuses to start, unless --insecure-no-auth, and then it says so."""
    from tests.helpers import free_port

    cfg = _config(tmp_path, "auth:\n  enabled: false\n")
    cmd = [sys.executable, os.path.join(ROOT, "supervisor.py"), "--config", cfg,
           "--models-dir", str(tmp_path / "models"), "--host", "127.0.0.1",
           "--port", str(free_port()), "--manage-port", str(free_port()),
           "--manage-host", "0.0.0.0"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "--insecure-no-auth" in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "models")  # refused before anything was made
    svc = Service(str(tmp_path / "models"),
                  args=["--config", cfg, "--manage-host", "0.0.0.0", "--insecure-no-auth"])
    try:
        assert svc.mget("/status", auth=False)[0] == 200  # open, as asked
    finally:
        svc.stop()
    assert "INSECURE: auth is off" in svc.log()
    # a key under 32 characters is a config error at start
    p = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**os.environ, "TEXTSWAP_ADMIN_KEY": "too-short"})
    assert p.returncode == 2 and "at least 32" in p.stderr, p.stderr
    assert "too-short" not in p.stderr


def test_default_management_bind_is_loopback(tmp_path):
    from state.config import load_config
    assert load_config(None).server.manage_host == "127.0.0.1"
    assert load_config("config.yaml").server.manage_host == "127.0.0.1"


def test_no_child_process_gets_the_services_secrets(store_copy, tmp_path):
    """Tokens and the Redis URL given in the environment are read at start and
    taken out of it: the zygote, workers and the prediction log's writer (and
    whatever they start) never hold them; ps shows none."""
    import psutil

    secrets = {"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN + "-m",
               "TEXTSWAP_FEEDBACK_TOKEN": TOKEN + "-feedback"}
    svc = Service(store_copy, args=["--config", _config(tmp_path)], env=secrets)
    ok = {"Authorization": f"Bearer {secrets['TEXTSWAP_MANAGEMENT_TOKEN']}"}
    try:
        # the tokens work: they were read before they left the environment
        assert svc.mpost("/apply", {"name": "sent"}, headers=ok, timeout=240)[0] == 200
        assert svc.mget("/status", auth=False)[0] == 401
        code, _ = svc.predict({"text": "fine"})
        assert code == 200
        workers = {w["pid"] for w in svc.mget("/status", headers=ok)[1]["workers"]}
        # the audit trail: the apply's history entry names the key that made it
        hist = svc.mget("/history", headers=ok)[1]["history"]
        apply = next(h for h in hist if h["kind"] == "apply" and h["source"] == "api")
        assert apply["details"]["key"] == "admin", apply
        kids = wait_for(lambda: (lambda k: len(k) >= 3 and k)(svc.children()), 60,
                        "the zygote, a worker and the log writer")
        assert workers <= {k.pid for k in kids}
        for p in [psutil.Process(svc.proc.pid), *kids]:
            try:
                environ = open(f"/proc/{p.pid}/environ", "rb").read().decode(errors="replace")
                cmdline = " ".join(p.cmdline())
            except (psutil.NoSuchProcess, FileNotFoundError):
                continue
            for name, value in secrets.items():
                assert value not in cmdline, (p.pid, cmdline)
                if p.pid != svc.proc.pid:  # the supervisor's own start-time copy is the kernel's
                    assert name not in environ and value not in environ, (p.pid, name)
    finally:
        svc.stop()
    assert not any(v in svc.log() for v in secrets.values())


def test_no_cross_site_request_drives_the_management_api(tmp_path):
    """A page of another site can send a form POST or a no-cors fetch (no
    preflight, no Authorization header), and a DNS-rebinding page sends its
    own Host: all refused. curl -d with the Bearer header keeps working."""
    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)],
                  env={"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN})
    ok = {"Authorization": f"Bearer {TOKEN}"}
    body = {"name": "x", "bogus": 1}  # parsed: a 400 names the unknown field
    try:
        for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
            headers = {"Content-Type": ctype or ""}  # "": none declared
            code, got = svc.mpost("/apply", None, raw=json.dumps(body).encode(),
                                  headers={**headers}, auth=False)
            assert code == 401, (ctype, got)  # no key: refused before the body is read
            code, got = svc.mpost("/apply", None, raw=json.dumps(body).encode(),
                                  headers={**headers, **ok})
            if ctype == "text/plain":  # never JSON, with a token or without
                assert code == 415 and got["error"]["code"] == "unsupported_media_type", got
            else:  # curl -d (a form), or none declared: JSON read with the token
                assert code == 400 and got["error"]["code"] == "unknown_field", (ctype, got)
        # a rebinding page: the right port under a foreign name
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
            code, got = svc.mget("/status", headers={**ok, "Host": host})
            assert code == 403 and got["error"]["code"] == "forbidden_host", (host, got)
        code, got = svc.mget("/", headers={"Host": "evil.example"})  # the page too
        assert code == 403
        # another site's page, even with the right Host
        for origin in ("http://evil.example", "null", "file://"):
            code, got = svc.mpost("/apply", body, headers={**ok, "Origin": origin})
            assert code == 403 and got["error"]["code"] == "forbidden_origin", (origin, got)
        # this service's own page (same origin), and localhost names
        for origin in (f"http://127.0.0.1:{svc.mport}", f"http://localhost:{svc.mport}"):
            code, got = svc.mpost("/apply", body, headers={**ok, "Origin": origin})
            assert code == 400 and got["error"]["code"] == "unknown_field", (origin, got)
        assert svc.mget("/status", headers={**ok, "Host": f"localhost:{svc.mport}"})[0] == 200
    finally:
        svc.stop()


def test_with_auth_off_a_form_body_is_refused_and_public_feedback_is_off(tmp_path):
    """auth.enabled: false on loopback: the management port takes JSON only
    (no Authorization header can vouch for a form), and the inference port's
    POST /feedback is off (403), not open."""
    svc = Service(str(tmp_path / "models"),
                  args=["--config", _config(tmp_path, "auth:\n  enabled: false\n")])
    body = json.dumps({"name": "x", "bogus": 1}).encode()
    try:
        assert not os.path.exists(keys_file(svc.models_dir))  # no keys made
        for ctype in ("application/x-www-form-urlencoded", "text/plain", ""):
            code, got = svc.mpost("/apply", None, raw=body, headers={"Content-Type": ctype})
            assert code == 415 and got["error"]["code"] == "unsupported_media_type", got
        code, got = svc.mpost("/apply", None, raw=body,
                              headers={"Content-Type": "application/json"})
        assert code == 400 and got["error"]["code"] == "unknown_field", got
        code, got = request(svc.port, "POST", "/feedback", {"request_id": "x", "label": "a"})
        assert code == 403 and got["error"]["code"] == "feedback_off", got
        # POST /feedback from another site's page: its Origin is refused first
        code, got = request(svc.port, "POST", "/feedback", {"request_id": "x", "label": "a"},
                            headers={"Origin": "http://evil.example"})
        assert code == 403 and got["error"]["code"] == "forbidden_origin", got
    finally:
        svc.stop()


def test_feedback_rate_limit_buckets():
    """The per-caller buckets, on a given clock."""
    from frontend.loop_handlers import RateLimit

    limit = RateLimit(rate=2.0, burst=3)
    assert [limit.take("a", now=10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limit.take("a", now=10.0) == 0.5  # one token comes back in 0.5 s
    assert limit.take("b", now=10.0) == 0.0  # another caller has its own budget
    assert limit.take("a", now=10.5) == 0.0
    assert limit.take("a", now=10.5) == 0.5
    assert limit.take("a", now=100.0) == 0.0  # refilled, to the burst at most
    assert [limit.take("a", now=100.0) for _ in range(3)] == [0.0, 0.0, 0.5]
    assert RateLimit(rate=0, burst=1).take("a") == 0.0  # off


def test_feedback_over_its_rate_is_429_with_retry_after(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("worker:\n  standby: false\ntraining:\n  demo_on_empty_store: false\n"
                   "feedback:\n  token: " + TOKEN + "-fb\n  rate_per_s: 0.2\n  burst: 3\n")
    svc = Service(str(tmp_path / "models"), args=["--config", str(cfg)])
    key = {"Authorization": f"Bearer {TOKEN}-fb"}
    body = {"request_id": "never-logged", "label": "a"}
    try:
        codes = [request(svc.port, "POST", "/feedback", body, headers=key)[0] for _ in range(3)]
        assert codes == [404] * 3  # within the burst: answered (that id was never logged)
        conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=30)
        conn.request("POST", "/feedback", body=json.dumps(body),
                     headers={**key, "Content-Type": "application/json"})
        resp = conn.getresponse()
        got = json.loads(resp.read())
        conn.close()
        assert resp.status == 429 and got["error"]["code"] == "rate_limited", got
        assert 1 <= int(resp.getheader("Retry-After")) <= 5
        assert 0 < got["error"]["retry_after_s"] <= 5
        # a request without the key is refused before it counts against anyone
        assert request(svc.port, "POST", "/feedback", body)[0] == 401
    finally:
        svc.stop()


def test_store_files_are_the_users_alone_and_the_log_says_texts_are_kept(store_copy, tmp_path):
    """Files the service creates are 0600 and its folders 0700 (umask 077 in
    the supervisor and every child); the start log says texts are logged."""
    svc = Service(store_copy, args=["--config", _config(tmp_path)])
    try:
        assert svc.mpost("/apply", {"name": "sent"}, timeout=240)[0] == 200
        assert svc.predict({"text": "fine"})[0] == 200
        made = [os.path.join(store_copy, f) for f in (".applied.json", ".predictions.db", ".state.db")]
        for path in made:
            assert os.path.exists(path), path
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, (path, oct(os.stat(path).st_mode))
    finally:
        svc.stop()
    assert "predicted texts are logged" in svc.log() and "predictions.log: false" in svc.log()


def test_logged_texts_past_the_age_limit_are_erased(store_copy, tmp_path):
    """predictions.max_age_days: what the log holds from before the limit is
    erased when the service starts (and every minute after)."""
    import time

    from state.predlog import FILENAME, PredictionLog

    now = time.time()
    plog = PredictionLog(os.path.join(store_copy, FILENAME))
    preds = [{"label": "pos", "score": 0.9, "top": [{"label": "pos", "score": 0.9}]}]
    plog.add_answer(now - 10 * 86400, "ten-days-old", "sent", 1, ["old text"], preds)
    plog.add_answer(now - 60, "a-minute-old", "sent", 1, ["new text"], preds)
    plog.close()
    cfg = tmp_path / "config.yaml"
    cfg.write_text("worker:\n  standby: false\ntraining:\n  demo_on_empty_store: false\n"
                   "predictions:\n  max_age_days: 7\n")
    svc = Service(store_copy, args=["--config", str(cfg)])
    try:
        wait_for(lambda: "erased past the age limit" in svc.log(), 60, "the age limit applied")
    finally:
        svc.stop()
    plog = PredictionLog(os.path.join(store_copy, FILENAME))
    try:
        assert plog.get("ten-days-old") == []
        assert [r["text"] for r in plog.get("a-minute-old")] == ["new text"]
    finally:
        plog.close()


# -- keys on by default ----------------------------------------------------------------
def test_every_state_change_names_its_key_in_the_history(store_copy, tmp_path):
    """The audit trail: training, cancelling, golden sets and policies (as
    applies do) leave a history entry naming the key that made the change;
    the review key may make none of them."""
    svc = Service(store_copy, args=["--config", _config(tmp_path)])
    try:
        review = svc.auth("review")
        examples = [{"text": t, "label": l} for t, l in (
            ("很好", "pos"), ("不错", "pos"), ("太差了", "neg"), ("很糟糕", "neg"))]
        calls = [("PUT", "/models/sent/policy", {"retrain_after_labels": 500, "apply": "none"}),
                 ("DELETE", "/models/sent/policy", None),
                 ("PUT", "/models/sent/golden", {"data": {"examples": examples}}),
                 ("DELETE", "/models/sent/golden", None)]
        for method, path, body in calls:
            assert request(svc.mport, method, path, body, headers=review)[0] == 403, path
            code, got = request(svc.mport, method, path, body)
            assert code == 200, (path, got)
        code, got = svc.mpost("/train", {"name": "audited", "data": {"examples": examples},
                                         "params": {"architecture": "bow", "epochs": 1}})
        assert code == 202, got
        job = got["job"]["id"]
        cancelled = request(svc.mport, "DELETE", f"/train/{job}")[0]
        assert cancelled in (200, 409)  # 409: it ended first
        code, got = svc.mget("/history?limit=50")
        assert code == 200, got
        rows = [h for h in got["history"] if h["source"] == "api"]
        kinds = {h["kind"]: h for h in rows}
        want = {"policy", "policy_deleted", "golden", "golden_deleted", "train"} | (
            {"cancel"} if cancelled == 200 else set())
        assert want <= set(kinds), [h["kind"] for h in rows]
        assert all(kinds[k]["details"]["key"] == "admin" for k in want), rows
        assert kinds["train"]["name"] == "audited" and kinds["train"]["details"]["job"] == job
        assert kinds["golden"]["details"]["examples"] == 4
        assert kinds["policy"]["details"]["policy"]["retrain_after_labels"] == 500
    finally:
        svc.stop()


def _key_file(svc) -> dict[str, str]:
    with open(keys_file(svc.models_dir), encoding="utf-8") as fh:
        return json.load(fh)["keys"]


def test_generated_keys_file_and_each_keys_scope_on_each_port(tmp_path):
    """A first start with no key configured writes admin, review and feedback
    keys into a 0600 file beside the store (not in it), logs where, never a
    key. On the management port admin may do everything and review may read
    and label; on the inference port only the feedback key takes POST
    /feedback. 401 without a key or with a wrong one, 403 with one of
    another scope on the management port (401 on the public one), each with
    a JSON body saying what the route takes."""
    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)])
    try:
        path = keys_file(svc.models_dir)
        keys = _key_file(svc)
        assert set(keys) == {"admin", "review", "feedback"}
        assert all(len(k) >= 32 for k in keys.values()) and len(set(keys.values())) == 3
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert os.path.commonpath([path, svc.models_dir]) != svc.models_dir  # not in the store
        bearer = {name: {"Authorization": f"Bearer {k}"} for name, k in keys.items()}
        bearer["none"], bearer["wrong"] = {}, {"Authorization": "Bearer " + "x" * 43}

        def code_of(port, method, path, body, who):
            code, got = request(port, method, path, body, headers=bearer[who], auth=False)
            if code in (401, 403):
                want = {401: "unauthorized", 403: "wrong_key"}[code]
                assert got["error"]["code"] == want and got["error"]["takes"], got
            return code

        m, p = svc.mport, svc.port
        fb = {"request_id": "never-logged", "label": "a"}
        cases = [  # (port, method, path, body): {who: status}
            (m, "GET", "/status", None,
             {"admin": 200, "review": 200, "feedback": 403, "none": 401, "wrong": 401}),
            (m, "GET", "/history", None, {"admin": 200, "review": 200, "feedback": 403}),
            (m, "POST", "/apply", {"name": "nope"},  # 404: the key passed, no such model
             {"admin": 404, "review": 403, "feedback": 403, "none": 401}),
            (m, "POST", "/train", {"name": "x", "bogus": 1},
             {"admin": 400, "review": 403, "feedback": 403}),
            (m, "DELETE", "/predictions/never-logged", None,  # nothing to erase: 200
             {"review": 403, "none": 401, "admin": 200}),
            (m, "POST", "/feedback", fb,  # the review queue's labels: 404, no such id
             {"admin": 404, "review": 404, "feedback": 403, "none": 401}),
            (p, "POST", "/feedback", fb,  # the inference port takes the feedback key only,
             # and tells no other key from an unknown one
             {"feedback": 404, "admin": 401, "review": 401, "none": 401, "wrong": 401}),
            (p, "POST", "/predict", {"text": "x"}, {"none": 503}),  # open: no predict key
        ]
        for port, method, path, body, want in cases:
            got = {who: code_of(port, method, path, body, who) for who in want}
            assert got == want, (port, method, path, got)
    finally:
        svc.stop()
    log = svc.log()
    assert path in log and not any(k in log for k in keys.values())
    assert "POST /apply by the admin key" in log  # every state-changing call, by key name
    assert "DELETE /predictions/never-logged by the admin key" in log  # erasures too


def test_a_predict_key_guards_predict_and_v2(tmp_path):
    """predict is off by default; set, /predict (the lean path too) and /v2
    take it, and nothing else; the probes stay open."""
    pkey = "p" * 40
    for fast in ("true", "false"):
        base = tmp_path / fast
        base.mkdir()
        svc = Service(str(base / "models"), env={"TEXTSWAP_PREDICT_KEY": pkey},
                      args=["--config", _config(base, f"server:\n  fast_predict: {fast}\n")])
        try:
            keys = _key_file(svc)  # the other keys were still generated
            for method, path, body in (("POST", "/predict", {"text": "x"}), ("GET", "/v2", None),
                                       ("POST", "/v2/models/x/infer", {"inputs": []})):
                assert request(svc.port, method, path, body, auth=False)[0] == 401, path
                code, _ = request(svc.port, method, path, body,
                                  headers={"Authorization": f"Bearer {keys['feedback']}"})
                assert code in (401, 403), (path, code)  # OIP errors carry no code field
                code, _ = request(svc.port, method, path, body,
                                  headers={"Authorization": f"Bearer {pkey}"})
                assert code not in (401, 403), (path, code)
            for path in ("/healthz", "/v2/health/live"):
                assert request(svc.port, "GET", path, auth=False)[0] == 200
            # the inference document says which routes take the key
            code, doc = request(svc.port, "GET", "/openapi.json", auth=False)
            assert code == 200 and doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
            guarded = {p for p, item in doc["paths"].items()
                       for m, op in item.items() if m != "parameters" and op.get("security")}
            assert {"/predict", "/v2", "/v2/models/{name}/infer", "/feedback"} <= guarded, guarded
            assert not guarded & {"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready",
                                  "/openapi.json"}, guarded
            assert doc["paths"]["/predict"]["post"]["responses"]["401"]
        finally:
            svc.stop()


def test_nodes_starting_together_agree_on_one_key_file(tmp_path):
    """Three services started at once with one key file (as nodes on one shared
    store find the one beside it; here auth.keys_file names it, each service
    on a store of its own): one writes it (created whole, exclusively), the
    others read it; every one takes its keys."""
    shared = str(tmp_path / "shared" / "keys.json")
    cfg = _config(tmp_path, f"auth:\n  keys_file: {shared}\n")
    svcs: list[Service] = []
    errors: list[BaseException] = []

    def start(i: int) -> None:
        try:
            (tmp_path / f"node{i}").mkdir()
            svcs.append(Service(str(tmp_path / f"node{i}" / "models"), args=["--config", cfg]))
        except BaseException as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        with open(shared, encoding="utf-8") as fh:
            keys = json.load(fh)["keys"]
        for svc in svcs:
            assert svc.mget("/status", headers={"Authorization": f"Bearer {keys['admin']}"})[0] == 200
            assert not os.path.exists(keys_file(svc.models_dir))  # the configured file only
        logs = [svc.log() for svc in svcs]
        assert sum("generated API keys" in log for log in logs) == 1, logs
        # the others found it made, while starting or before
        assert sum("another node generated" in log or "API keys from" in log
                   for log in logs) == 2, logs
        assert not [f for f in os.listdir(os.path.dirname(shared)) if f.endswith(".tmp")]
    finally:
        for svc in svcs:
            svc.stop()
    # the race itself, in processes released at once: one file, the winner's
    path = str(tmp_path / "race" / "keys.json")
    code = ("import sys, json; from state.keys import new_key, write_keys_file; "
            "keys = {'admin': new_key()}; sys.stdin.read(); "
            "print(json.dumps([write_keys_file(sys.argv[1], keys, replace=False), keys]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, path], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(6)]
    for p in procs:  # each has imported and waits on its stdin: release them together
        p.stdin.write("go")
    for p in procs:
        p.stdin.close()
    outs = []
    for p in procs:
        outs.append(json.loads(p.stdout.read()))
        assert p.wait(60) == 0
    winners = [keys for won, keys in outs if won]
    assert len(winners) == 1, outs
    with open(path, encoding="utf-8") as fh:
        assert json.load(fh)["keys"] == winners[0]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_keys_rotate_takes_effect_without_a_restart(tmp_path):
    """`textswap keys rotate` writes a new key file whole (a new inode, 0600);
    the running service takes the new keys and refuses the old ones."""
    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)])
    try:
        path = keys_file(svc.models_dir)
        old = _key_file(svc)
        inode = os.stat(path).st_ino
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTSWAP_")}
        p = subprocess.run([sys.executable, "-m", "textswap_cli", "--keys-file", path,
                            "keys", "rotate"], capture_output=True, text=True, timeout=60,
                           cwd=ROOT, env=env)
        assert p.returncode == 0, p.stderr
        assert not any(k in p.stdout + p.stderr for k in old.values())
        new = _key_file(svc)
        assert set(new) == set(old) and not set(new.values()) & set(old.values())
        assert os.stat(path).st_ino != inode and stat.S_IMODE(os.stat(path).st_mode) == 0o600

        def status_with(key):
            return svc.mget("/status", headers={"Authorization": f"Bearer {key}"})[0]
        wait_for(lambda: status_with(new["admin"]) == 200, 10, "the new admin key taken")
        assert status_with(old["admin"]) == 401
        fb = {"request_id": "never-logged", "label": "a"}
        assert request(svc.port, "POST", "/feedback", fb,
                       headers={"Authorization": f"Bearer {old['feedback']}"})[0] == 401
        assert request(svc.port, "POST", "/feedback", fb,
                       headers={"Authorization": f"Bearer {new['feedback']}"})[0] == 404
        # the CLI finds the key in the key file (TEXTSWAP_KEYS_FILE) by itself
        p = subprocess.run([sys.executable, "-m", "textswap_cli", "--url",
                            f"http://127.0.0.1:{svc.mport}", "status", "--json"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env={**env, "TEXTSWAP_KEYS_FILE": path})
        assert p.returncode == 0 and json.loads(p.stdout)["supervisor"], p.stderr
        p = subprocess.run([sys.executable, "-m", "textswap_cli", "--url",
                            f"http://127.0.0.1:{svc.mport}", "dashboard"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env={**env, "TEXTSWAP_KEYS_FILE": path})
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith(f"http://127.0.0.1:{svc.mport}/#code="), p.stdout
        # a predict key added by rotation guards /predict (and says so) at once
        def predict_doc_guarded() -> bool:
            return bool(request(svc.port, "GET", "/openapi.json", auth=False)[1]["paths"]
                        ["/predict"]["post"].get("security"))
        assert request(svc.port, "POST", "/predict", {"text": "x"}, auth=False)[0] not in (401, 403)
        assert not predict_doc_guarded()
        p = subprocess.run([sys.executable, "-m", "textswap_cli", "--keys-file", path,
                            "keys", "rotate", "predict"], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env=env)
        assert p.returncode == 0, p.stderr
        pkey = _key_file(svc)["predict"]
        wait_for(lambda: request(svc.port, "POST", "/predict", {"text": "x"},
                                 auth=False)[0] == 401, 10, "the new predict key asked for")
        assert predict_doc_guarded()
        assert request(svc.port, "POST", "/predict", {"text": "x"},
                       headers={"Authorization": f"Bearer {pkey}"})[0] not in (401, 403)
        new["predict"] = pkey
    finally:
        svc.stop()
    assert not any(k in svc.log() for k in [*old.values(), *new.values()])


def test_the_start_urls_one_time_code_works_once(tmp_path):
    """The dashboard URL printed at start carries a code in its #fragment: it
    buys one session (admin scope), once."""
    import re

    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)])
    try:
        m = wait_for(lambda: re.search(r"http://127\.0\.0\.1:(\d+)/#code=([\w-]+)", svc.log()),
                     30, "the dashboard URL in the log")
        assert int(m.group(1)) == svc.mport
        code, got = svc.mpost("/auth/session", {"code": m.group(2)}, auth=False)
        assert code == 200 and got["scope"] == "admin", got
        session = {"Authorization": f"Bearer {got['token']}"}
        assert svc.mget("/status", headers=session)[0] == 200
        assert svc.mpost("/apply", {"name": "nope"}, headers=session)[0] == 404  # admin scope
        code, again = svc.mpost("/auth/session", {"code": m.group(2)}, auth=False)
        assert code == 401 and again["error"]["code"] == "unauthorized", again
        assert svc.mpost("/auth/session", {"code": "made-up"}, auth=False)[0] == 401
        # a new one-time URL takes the admin key; the review key may not make one
        assert svc.mpost("/auth/code", {}, headers=svc.auth("review"))[0] == 403
        assert svc.dashboard_url().startswith(f"http://127.0.0.1:{svc.mport}/#code=")
    finally:
        svc.stop()


# -- the second pass: cross-site bodies, bad bodies, no oracle, modes, sessions -----------
XSITE = "http://evil.example"


@pytest.fixture(scope="module")
def served(tiny_store, tmp_path_factory):
    """One service for the module with `sent` v1 serving (the lean predict
    path, the default), started with the CLI's key variable and other key
    variables in its environment."""
    work = tmp_path_factory.mktemp("served")
    root = str(work / "models")
    shutil.copytree(tiny_store, root)
    env = {"TEXTSWAP_KEY": TOKEN + "-cli", "TEXTSWAP_EXTRA_TOKEN": TOKEN + "-extra",
           "TEXTSWAP_PREDICT_PASSWORD": TOKEN + "-pw"}
    svc = Service(root, args=["--config", _config(work)], env=env)
    svc.secrets = env
    try:
        code, got = svc.mpost("/apply", {"name": "sent"}, timeout=240)
        assert code == 200, got
        yield svc
    finally:
        svc.stop()


def _raw(port: int, path: str, body: bytes, headers: dict[str, str]):
    """POST exactly these headers (no Content-Type unless given): status,
    headers, JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data) if data else None
    finally:
        conn.close()


def _infer_body(text: str) -> bytes:
    return json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": [text]}]}).encode()


def test_public_port_reads_no_cross_site_body_and_logs_no_foreign_page(served):
    """POST /predict and OIP infer read a body declared as a form, text/plain
    or nothing only with an Authorization header (a cross-site form or no-cors
    fetch cannot send one); a request from another site's page (its Origin)
    is answered but never logged, so it never reaches the review queue."""
    svc = served
    body = json.dumps({"text": "很好"}).encode()
    form = "application/x-www-form-urlencoded"
    for ctype in (form, "text/plain", "multipart/form-data; boundary=x", None):
        headers = {} if ctype is None else {"Content-Type": ctype}
        code, _, got = _raw(svc.port, "/predict", body, headers)
        assert code == 415 and got["error"]["code"] == "unsupported_media_type", (ctype, got)
        if ctype is not None:  # none: what OIP clients send, read (below)
            code, _, got = _raw(svc.port, "/v2/models/sent/infer", _infer_body("x"), headers)
            assert code == 415 and "Authorization" in got["error"], (ctype, got)
    # `curl -d` with a Bearer header is read, as on the management port
    code, _, got = _raw(svc.port, "/predict", body,
                        {"Content-Type": form, "Authorization": "Bearer anything"})
    assert code == 200, got
    code, _, got = _raw(svc.port, "/v2/models/sent/infer", _infer_body("x"), {})
    assert code == 200, got  # what tritonclient sends for JSON tensors
    label = got["outputs"][0]["data"][0]

    # another site's page: answered, with no request id, and not logged
    code, headers, got = _raw(svc.port, "/predict", body,
                              {"Content-Type": "application/json", "Origin": XSITE,
                               "X-Request-Id": "xsite-predict"})
    assert code == 200 and "request_id" not in got and "X-Request-Id" not in headers, got
    code, headers, got = _raw(svc.port, "/v2/models/sent/infer", _infer_body("很好"),
                              {"Content-Type": "application/json", "Origin": "null",
                               "X-Request-Id": "xsite-infer"})
    assert code == 200 and "X-Request-Id" not in headers, got
    # a page of this service (its own origin) is logged; sent after the others,
    # so once its answer is in the log, theirs would be too
    own = f"http://127.0.0.1:{svc.port}"
    for rid, path, raw in (("own-predict", "/predict", body),
                           ("own-infer", "/v2/models/sent/infer", _infer_body("很好"))):
        code, headers, got = _raw(svc.port, path, raw, {"Content-Type": "application/json",
                                                        "Origin": own, "X-Request-Id": rid})
        assert code == 200 and headers["X-Request-Id"] == rid, got
    fb = svc.auth("review")
    for rid in ("own-predict", "own-infer"):
        wait_for(lambda: request(svc.mport, "POST", "/feedback", {"request_id": rid,
                                                                  "label": label},
                                 headers=fb)[0] == 200, 30, f"{rid} logged")
    for rid in ("xsite-predict", "xsite-infer"):
        code, got = request(svc.mport, "POST", "/feedback", {"request_id": rid, "label": label},
                            headers=fb)
        assert code == 404, (rid, got)


def _nested(depth: int, kind: str = "[") -> bytes:
    if kind == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def test_deeply_nested_bodies_get_400_too_deep_everywhere(served):
    """A body nested 100,000 deep (and anything past 64) is a 400 too_deep on
    the lean predict path, OIP infer and the management routes: never a 500,
    never a traceback in the log. 64 deep is parsed (and refused for what it
    says)."""
    svc = served
    ok = {"Content-Type": "application/json"}
    for depth in (65, 1000, 100_000):
        for kind in ("[", "{"):
            raw = _nested(depth, kind)
            code, _, got = _raw(svc.port, "/predict", raw, ok)
            assert code == 400 and got["error"]["code"] == "too_deep", (depth, kind, got)
            code, _, got = _raw(svc.port, "/v2/models/sent/infer", raw, ok)
            assert code == 400 and "deep" in got["error"], (depth, kind, got)
            for path in ("/train", "/apply", "/feedback"):
                code, got = request(svc.mport, "POST", path, raw=raw)
                assert code == 400 and got["error"]["code"] == "too_deep", (path, got)
            code, got = request(svc.mport, "PUT", "/models/sent/policy", raw=raw)
            assert code == 400 and got["error"]["code"] == "too_deep", got
    # deep inside a valid body, and exactly at the bound
    inner = b'{"text": "x", "model": ' + _nested(70) + b"}"
    code, _, got = _raw(svc.port, "/predict", inner, ok)
    assert code == 400 and got["error"]["code"] == "too_deep", got
    code, _, got = _raw(svc.port, "/predict", _nested(64), ok)
    assert code == 400 and got["error"]["code"] == "bad_request", got  # not an object
    log = svc.log()
    assert "Traceback" not in log and "RecursionError" not in log
    assert " 500 " not in log


def test_fuzzed_bodies_never_get_a_500(served):
    """Random JSON values (nested deep and wide), broken JSON and random bytes
    to every body-reading route kind, through real HTTP: always a JSON
    answer below 500."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    svc = served
    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
    values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                          max_leaves=30).map(lambda v: json.dumps(v).encode())
    deep = st.tuples(st.integers(1, 3000), st.sampled_from(["[", "{"]),
                     st.booleans()).map(lambda t: _nested(t[0], t[1])[: None if t[2] else -1])
    bodies = values | deep | st.binary(max_size=300) | values.map(lambda b: b[:-1])
    targets = [(svc.port, "/predict"), (svc.port, "/v2/models/sent/infer"),
               (svc.mport, "/train"), (svc.mport, "/feedback"), (svc.mport, "/try")]

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies, target=st.sampled_from(targets),
           ctype=st.sampled_from(["application/json", "application/x-www-form-urlencoded"]))
    def one(body, target, ctype):
        port, path = target
        headers = {"Content-Type": ctype}
        if port == svc.mport:
            headers.update(svc.auth("admin"))
        code, _, got = _raw(port, path, body, headers)
        assert code < 500 and isinstance(got, dict) and "error" in got or code == 200, \
            (path, body[:200], code, got)

    one()
    assert "Traceback" not in svc.log()


def test_no_child_gets_the_cli_key_or_any_key_variable(served):
    """TEXTSWAP_KEY (the CLI's) and every TEXTSWAP_*_KEY/_TOKEN/_PASSWORD are
    taken out of the environment before the zygote, workers and the log
    writer start."""
    import psutil

    kids = wait_for(lambda: (lambda k: len(k) >= 3 and k)(served.children()), 60,
                    "the zygote, a worker and the log writer")
    for p in kids:
        try:
            environ = open(f"/proc/{p.pid}/environ", "rb").read().decode(errors="replace")
        except (psutil.NoSuchProcess, FileNotFoundError):
            continue
        for name, value in served.secrets.items():
            assert f"{name}=" not in environ and value not in environ, (p.pid, name)
    assert not any(v in served.log() for v in served.secrets.values())


def test_the_public_port_is_no_key_oracle(tmp_path):
    """On the inference port a key of another scope (admin, review, a
    dashboard session) gets exactly the 401 of an unknown key: a stolen key
    cannot be confirmed there."""
    pkey = "p" * 40
    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)],
                  env={"TEXTSWAP_PREDICT_KEY": pkey})
    try:
        keys = _key_file(svc)
        code, got = svc.mpost("/auth/session", {"code": svc.dashboard_url().split("=")[1]},
                              auth=False)
        assert code == 200, got
        session = got["token"]
        fb = {"request_id": "never-logged", "label": "a"}
        for method, path, body, own in (("POST", "/feedback", fb, keys["feedback"]),
                                        ("POST", "/predict", {"text": "x"}, pkey),
                                        ("GET", "/v2", None, pkey)):
            answers = {}
            for who, key in (("unknown", "u" * 43), ("admin", keys["admin"]),
                             ("review", keys["review"]), ("session", session),
                             ("predict/feedback", keys["feedback"] if own == pkey else pkey)):
                answers[who] = request(svc.port, method, path, body,
                                       headers={"Authorization": f"Bearer {key}"})
            assert all(a == answers["unknown"] for a in answers.values()), (path, answers)
            assert answers["unknown"][0] == 401, answers
            assert request(svc.port, method, path, body,
                           headers={"Authorization": f"Bearer {own}"})[0] not in (401, 403)
        # the management port still says which key a route takes
        code, got = svc.mpost("/apply", {"name": "x"}, headers=svc.auth("review"))
        assert code == 403 and got["error"]["code"] == "wrong_key", got
    finally:
        svc.stop()
    assert session not in svc.log()


def _start(tmp_path, models: str, cfg: str, env: dict[str, str] | None = None):
    """supervisor.py run to its refusal (or its start): the finished process."""
    from tests.helpers import free_port

    cmd = [sys.executable, os.path.join(ROOT, "supervisor.py"), "--config", cfg,
           "--models-dir", models, "--host", "127.0.0.1", "--port", str(free_port()),
           "--manage-port", str(free_port())]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_key_folder_modes_are_enforced_at_start(tmp_path):
    """The key folder open to others (0777, 0750) is refused at start; one
    that would sit directly in a world-writable folder (as the temporary
    folder is) is refused with a message naming auth.keys_file; set there,
    the service starts and makes its folder 0700."""
    cfg = _config(tmp_path)
    for mode in (0o777, 0o750):
        base = tmp_path / f"open{mode:o}"
        (base / ".textswap").mkdir(parents=True)
        os.chmod(base / ".textswap", mode)
        p = _start(tmp_path, str(base / "models"), cfg)
        assert p.returncode == 2 and "open to others" in p.stderr and "chmod 700" in p.stderr, \
            p.stderr
        assert not os.path.exists(base / ".textswap" / "keys.json")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # what /tmp is
    p = _start(tmp_path, str(shared / "models"), cfg)
    assert p.returncode == 2 and "auth.keys_file" in p.stderr and str(shared) in p.stderr, \
        p.stderr
    assert not os.path.exists(shared / ".textswap")
    own = tmp_path / "own" / "keys" / "keys.json"
    svc = Service(str(shared / "models"), args=["--config", _config(
        tmp_path, f"auth:\n  keys_file: {own}\n")])
    try:
        assert svc.mget("/status", headers={"Authorization": f"Bearer "
                                                             f"{json.loads(own.read_text())['keys']['admin']}"})[0] == 200
        assert stat.S_IMODE(os.stat(own.parent).st_mode) == 0o700
    finally:
        svc.stop()


def test_redis_url_file_must_be_private_and_its_password_never_shown(tmp_path):
    """cluster.redis_url_file readable by others is refused at start; a URL
    giving its password as ?password= works, and /status and /cluster show
    it as ***."""
    if not os.path.exists("/usr/bin/redis-server") and not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    from deploy.localcluster import RedisServer

    redis = RedisServer(str(tmp_path / "redis"))
    try:
        url_file = tmp_path / "redis.url"
        url_file.write_text(f"redis://127.0.0.1:{redis.port}/0?password={redis.password}\n")
        os.chmod(url_file, 0o644)
        cfg = _config(tmp_path, f"cluster:\n  redis_url_file: {url_file}\n")
        p = _start(tmp_path, str(tmp_path / "models"), cfg)
        assert p.returncode == 2 and "chmod 600" in p.stderr, p.stderr
        os.chmod(url_file, 0o600)
        svc = Service(str(tmp_path / "models"), args=["--config", cfg])
        try:
            for path in ("/status", "/cluster"):
                code, got = svc.mget(path)
                assert code == 200, (path, got)
                text = json.dumps(got)
                assert redis.password not in text and "password=***" in text, (path, text)
        finally:
            svc.stop()
        assert redis.password not in svc.log()
    finally:
        redis.stop()


def _exchange(svc, code: str) -> tuple[int, Any]:
    return svc.mpost("/auth/session", {"code": code}, auth=False)


def test_sessions_end_with_rotation_logout_and_revocation(tmp_path):
    """The start URL is logged once, at WARNING; a new admin key (textswap
    keys rotate) ends every session and unused code made before it; POST
    /auth/logout ends the caller's session; DELETE /auth/sessions (admin)
    ends them all; POST /auth/session is throttled per address."""
    import re

    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)])
    try:
        lines = wait_for(lambda: [ln for ln in svc.log().splitlines() if "#code=" in ln], 30,
                         "the dashboard URL in the log")
        assert len(lines) == 1 and " WARNING " in lines[0] and "10 minutes" in lines[0], lines
        start_code = re.search(r"#code=([\w-]+)", lines[0]).group(1)
        code, got = _exchange(svc, start_code)
        assert code == 200, got
        old_session = {"Authorization": f"Bearer {got['token']}"}
        assert svc.mget("/status", headers=old_session)[0] == 200
        code, made = svc.mpost("/auth/code", {})
        assert code == 200 and made["expires_in_s"] == 600, made
        path = keys_file(svc.models_dir)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTSWAP_")}
        p = subprocess.run([sys.executable, "-m", "textswap_cli", "--keys-file", path,
                            "keys", "rotate"], capture_output=True, text=True, timeout=60,
                           cwd=ROOT, env=env)
        assert p.returncode == 0, p.stderr
        svc.keys = _key_file(svc)
        wait_for(lambda: svc.mget("/status", headers=old_session)[0] == 401, 10,
                 "the session ended by the new admin key")
        assert _exchange(svc, made["code"])[0] == 401  # the unused code too
        # logout ends the caller's own session, and no other
        tokens = []
        for _ in range(3):
            code, got = _exchange(svc, svc.mpost("/auth/code", {})[1]["code"])
            assert code == 200, got
            tokens.append({"Authorization": f"Bearer {got['token']}"})
        code, got = svc.mpost("/auth/logout", {}, headers=tokens[0])
        assert code == 200 and got["ended"] is True, got
        assert svc.mget("/status", headers=tokens[0])[0] == 401
        assert svc.mget("/status", headers=tokens[1])[0] == 200
        code, got = svc.mpost("/auth/logout", {})  # the admin key is no session
        assert code == 400 and got["error"]["code"] == "not_a_session", got
        # revocation: every session and unused code; the review key may not
        pending = svc.mpost("/auth/code", {})[1]["code"]
        assert request(svc.mport, "DELETE", "/auth/sessions",
                       headers=svc.auth("review"))[0] == 403
        code, got = request(svc.mport, "DELETE", "/auth/sessions")
        assert code == 200 and got["ended"] == {"sessions": 2, "codes": 1}, got
        assert svc.mget("/status", headers=tokens[1])[0] == 401
        assert svc.mget("/status", headers=tokens[2])[0] == 401
        assert _exchange(svc, pending)[0] == 401
        # the exchange is throttled per client address
        answers = [_exchange(svc, "made-up") for _ in range(12)]
        assert answers[-1][0] == 429 and answers[-1][1]["error"]["code"] == "rate_limited", \
            answers[-1]
        assert all(code in (401, 429) for code, _ in answers)
    finally:
        svc.stop()
    log = svc.log()
    assert log.count("#code=") == 1
    assert "dashboard session(s) and" in log


def test_one_time_codes_expire_after_code_minutes(tmp_path):
    """auth.code_minutes: a code not traded in time is refused (0.02 minutes
    here: the test waits on the clock the code is checked against)."""
    import time

    svc = Service(str(tmp_path / "models"),
                  args=["--config", _config(tmp_path, "auth:\n  code_minutes: 0.02\n")])
    try:
        code, made = svc.mpost("/auth/code", {})
        assert code == 200 and made["expires_in_s"] == 1, made
        fresh = svc.mpost("/auth/code", {})[1]["code"]
        assert _exchange(svc, fresh)[0] == 200  # in time
        deadline = time.time() + 1.3  # 1.2 s after it was made, and a margin
        while time.time() < deadline:
            time.sleep(deadline - time.time())
        code, got = _exchange(svc, made["code"])
        assert code == 401 and got["error"]["code"] == "unauthorized", got
    finally:
        svc.stop()


def test_origin_port_and_scheme_are_compared(tmp_path):
    """An Origin naming this service on another port, or https where the
    service speaks http, is another site's; a proxy's name
    (server.allowed_hosts) may come as https on its default port."""
    svc = Service(str(tmp_path / "models"), args=["--config", _config(
        tmp_path, "server:\n  allowed_hosts: [svc.example]\n")])
    try:
        m = svc.mport
        for origin, host, want in (
                (f"http://localhost:{m}", None, 200), (f"http://127.0.0.1:{m}", None, 200),
                ("http://localhost:9999", None, 403), (f"http://127.0.0.1:{m + 1}", None, 403),
                (f"https://127.0.0.1:{m}", None, 403), ("http://localhost", None, 403),
                (f"ftp://127.0.0.1:{m}", None, 403),
                ("https://svc.example", "svc.example", 200),
                ("http://svc.example", "svc.example", 200),
                ("https://svc.example:8443", "svc.example", 403),
                ("https://svc.example:8443", "svc.example:8443", 200),
                ("https://evil.example", "svc.example", 403)):
            headers = {"Origin": origin, **({"Host": host} if host else {})}
            code, got = svc.mget("/status", headers={**headers, **svc.auth()})
            assert code == want, (origin, host, got)
            if want == 403:
                assert got["error"]["code"] == "forbidden_origin", got
    finally:
        svc.stop()


def test_a_body_sent_too_slowly_is_cut_off(tmp_path):
    """server.body_timeout_s: a client that sends headers and then only part
    of its body (holding a connection and a handler) is cut off: on the
    inference port (frontend/httpwire.py) with a JSON 408, on the management
    port (Tornado's server) with no answer."""
    import socket
    import time

    svc = Service(str(tmp_path / "models"), args=["--config", _config(
        tmp_path, "server:\n  body_timeout_s: 1\n")])
    try:
        for port, path in ((svc.port, "/predict"), (svc.mport, "/train")):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                             b"Authorization: Bearer %s\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                             b'{"text": ' % (path.encode(), port, svc.keys["admin"].encode()))
                started = time.monotonic()
                got = b""
                while chunk := sock.recv(4096):  # until the service closes it
                    got += chunk
                assert time.monotonic() - started < 20
                if port == svc.port:
                    head, _, body = got.partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head, got
                    assert json.loads(body)["error"]["code"] == "request_timeout", got
                else:
                    assert got == b"", got  # closed by the service, no answer
        assert svc.predict({"text": "x"})[0] == 503  # whole bodies are read as before
    finally:
        svc.stop()


def test_labels_from_data_are_echoed_as_a_short_escaped_sample(tmp_path):
    """A data file's labels in an error are cut to a short sample, quoted
    with control characters escaped (a label may be long or hostile)."""
    data_dir = tmp_path / "models" / "data"
    data_dir.mkdir(parents=True)
    hostile = "\x1b[31m" + "x" * 5000
    rows = [{"text": f"t{i}", "label": lab} for i, lab in enumerate(
        ["pos", "pos", "neg", "neg", hostile] + [f"extra{i}" for i in range(40)])]
    with open(data_dir / "bad.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)])
    try:
        for data in ({"path": "bad.jsonl", "labels": ["pos", "neg"]},
                     {"examples": rows, "labels": ["pos", "neg"]},
                     {"examples": [{"text": "t", "label": hostile}]}):
            code, got = svc.mpost("/train", {"name": "x", "data": data})
            if code == 202:  # checked by the job: its error
                job = got["job"]["id"]
                got = wait_for(lambda: (lambda j: j["job"]["state"] in ("failed", "error")
                                        and j)(svc.mget(f"/train/{job}")[1]), 60, "the job")
                message = json.dumps(got)
            else:
                assert code == 400, got
                message = got["error"]["message"]
            assert "x" * 100 not in message and "\x1b" not in message, message
            assert len(message) < 600, message
    finally:
        svc.stop()


def test_the_tornado_predict_path_reads_bodies_the_same_way(tmp_path):
    """server.fast_predict: false answers /predict and OIP infer through
    Tornado's RequestHandler, with the same body rule and depth bound as the
    lean path (the pipeline's); no model serves, so a body that is read gets
    503 and one that is not gets 4xx first."""
    svc = Service(str(tmp_path / "models"), args=["--config", _config(
        tmp_path, "server:\n  fast_predict: false\n")])
    try:
        body = json.dumps({"text": "x"}).encode()
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        code, _, got = _raw(svc.port, "/predict", body, form)
        assert code == 415 and got["error"]["code"] == "unsupported_media_type", got
        assert _raw(svc.port, "/predict", body, {**form, "Authorization": "Bearer k"})[0] == 503
        code, _, got = _raw(svc.port, "/predict", _nested(100_000),
                            {"Content-Type": "application/json"})
        assert code == 400 and got["error"]["code"] == "too_deep", got
    finally:
        svc.stop()
    assert "Traceback" not in svc.log()
