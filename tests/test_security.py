"""Management lock-down: bearer token, warning on a public bind, no token leaks.
No model is needed, so these services run without workers (standby off)."""
from __future__ import annotations

import http.client
import json

from helpers import request

from helpers import Service

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
                code, got = request(svc.mport, method, path, body, headers=headers)
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


def test_public_management_bind_without_token_warns(tmp_path):
    svc = Service(str(tmp_path / "models"),
                  args=["--config", _config(tmp_path), "--manage-host", "0.0.0.0"])
    try:
        assert svc.mget("/status")[0] == 200
    finally:
        svc.stop()
    assert "without a token" in svc.log()


def test_default_management_bind_is_loopback(tmp_path):
    from state.config import load_config
    assert load_config(None).raw["server"]["manage_host"] == "127.0.0.1"
    assert load_config("config.yaml").raw["server"]["manage_host"] == "127.0.0.1"


def test_no_child_process_gets_the_services_secrets(store_copy, tmp_path):
    """Tokens and the Redis URL given in the environment are read at start and
    taken out of it: the zygote, workers and the prediction log's writer (and
    whatever they start) never hold them; ps shows none."""
    import psutil

    from helpers import wait_for

    secrets = {"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN + "-m",
               "TEXTSWAP_FEEDBACK_TOKEN": TOKEN + "-feedback"}
    svc = Service(store_copy, args=["--config", _config(tmp_path)], env=secrets)
    ok = {"Authorization": f"Bearer {secrets['TEXTSWAP_MANAGEMENT_TOKEN']}"}
    try:
        # the tokens work: they were read before they left the environment
        assert svc.mpost("/apply", {"name": "sent"}, headers=ok, timeout=240)[0] == 200
        assert svc.mget("/status")[0] == 401
        code, _ = svc.predict({"text": "fine"})
        assert code == 200
        workers = {w["pid"] for w in svc.mget("/status", headers=ok)[1]["workers"]}
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
                                  headers={**headers})
            assert code == 401, (ctype, got)  # no token: refused before the body is read
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


def test_without_a_token_a_form_body_is_refused_and_json_is_answered(tmp_path):
    svc = Service(str(tmp_path / "models"), args=["--config", _config(tmp_path)])
    body = json.dumps({"name": "x", "bogus": 1}).encode()
    try:
        for ctype in ("application/x-www-form-urlencoded", "text/plain", ""):
            code, got = svc.mpost("/apply", None, raw=body, headers={"Content-Type": ctype})
            assert code == 415 and got["error"]["code"] == "unsupported_media_type", got
        code, got = svc.mpost("/apply", None, raw=body,
                              headers={"Content-Type": "application/json"})
        assert code == 400 and got["error"]["code"] == "unknown_field", got
        # POST /feedback on the public port, from another site's page
        code, got = request(svc.port, "POST", "/feedback", None, raw=body,
                            headers={"Content-Type": "text/plain"})
        assert code == 415, got
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
    import os
    import stat

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
    import os
    import time

    from helpers import wait_for
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
