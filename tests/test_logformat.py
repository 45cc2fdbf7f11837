"""JSON logs (`log_format: json`, `--log-format json`) and TEXTSWAP_DEMO.

The formatter and the relay's JSON lines here; tests/test_image.py reads the
JSON lines of the real service in the image."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import sys

import pytest

from control.childlog import StderrRelay
from state import logformat
from state.config import ConfigError, load_config
from state.options import build_config, parse_args


def _record(msg: str, *args, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("textswap.frontend", logging.WARNING, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_a_record_is_one_json_object_with_time_level_logger_message():
    line = logformat.JsonFormatter().format(_record("%d %s", 404, "GET /nope 中文"))
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "WARNING" and obj["logger"] == "textswap.frontend"
    assert obj["message"] == "404 GET /nope 中文"
    assert obj["time"].endswith("Z") and obj["time"][10] == "T"
    assert "request_id" not in obj


def test_the_request_id_and_a_traceback_go_in_when_there_are_some():
    obj = json.loads(logformat.JsonFormatter().format(_record("x", request_id="abc-1")))
    assert obj["request_id"] == "abc-1"
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec = _record("failed")
        rec.exc_info = sys.exc_info()
    line = logformat.JsonFormatter().format(rec)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exc_info"]


def test_a_childs_lines_become_json_with_its_level():
    own = json.loads(logformat.child_line("worker 7", "2026-12-06 13:40:00,123 INFO x: loaded"))
    assert own["level"] == "INFO" and own["logger"] == "textswap.child.worker 7"
    assert own["message"].endswith("x: loaded")
    assert json.loads(logformat.child_line("zygote", "Traceback (most recent call last):"))[
        "level"] == "ERROR"


def test_the_relay_writes_json_lines_in_json_mode(monkeypatch):
    out = io.StringIO()

    async def relay_lines() -> None:
        relay = StderrRelay("trainer", out)  # on this loop
        monkeypatch.setattr(logformat, "_json", True)
        relay._line("2026-12-06 13:40:00,123 WARNING t: slow")
        monkeypatch.setattr(logformat, "_json", False)
        relay._line("plain")
        relay.close()

    asyncio.run(relay_lines())
    first, second = out.getvalue().splitlines()
    assert json.loads(first)["level"] == "WARNING"
    assert json.loads(first)["logger"] == "textswap.child.trainer"
    assert second == "plain"


def test_log_format_comes_from_config_or_flag_and_is_checked(tmp_path):
    assert load_config(None).log_format == "text"
    assert build_config(parse_args(["--log-format", "json"])).log_format == "json"
    bad = tmp_path / "c.yaml"
    bad.write_text("log_format: xml\n")
    with pytest.raises(ConfigError, match="log_format"):
        load_config(str(bad))
    with pytest.raises(SystemExit):
        parse_args(["--log-format", "xml"])


def test_textswap_demo_overrides_the_config_key(monkeypatch, tmp_path):
    on = tmp_path / "c.yaml"
    on.write_text("training:\n  demo_on_empty_store: true\n")
    monkeypatch.setenv("TEXTSWAP_DEMO", "0")
    assert load_config(str(on)).training.demo_on_empty_store is False
    monkeypatch.setenv("TEXTSWAP_DEMO", "1")
    off = tmp_path / "off.yaml"
    off.write_text("training:\n  demo_on_empty_store: false\n")
    assert load_config(str(off)).training.demo_on_empty_store is True
    monkeypatch.setenv("TEXTSWAP_DEMO", "no")
    with pytest.raises(ConfigError, match="TEXTSWAP_DEMO"):
        load_config(None)
