"""Management lock-down: bearer token, warning on a public bind, no token leaks.
No model is needed, so these services run without workers (standby off)."""
from __future__ import annotations

import json

from helpers import request

from helpers import Service

TOKEN = "s3cret-token-value"


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
