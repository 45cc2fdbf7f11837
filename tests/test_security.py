"""Lock-down through the real service: keys on by default (the generated key
file, each key's scope on each port, rotation, the dashboard's one-time
code, auth off), no cross-site requests, no secret leaks, file modes.
Most need no model, so these services run without workers (standby off)."""
from __future__ import annotations

import http.client
import json
import os
import stat
import subprocess
import sys
import threading

from helpers import ROOT, Service, keys_file, request, wait_for

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
    from helpers import free_port

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
    assert load_config(None).raw["server"]["manage_host"] == "127.0.0.1"
    assert load_config("config.yaml").raw["server"]["manage_host"] == "127.0.0.1"


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
    another scope, each with a JSON body saying what the route takes."""
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
            (p, "POST", "/feedback", fb,  # the inference port takes the feedback key only
             {"feedback": 404, "admin": 403, "review": 403, "none": 401, "wrong": 401}),
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
