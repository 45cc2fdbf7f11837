"""server.event_loop: the choice, the fallback where uvloop does not import, the
refusal of anything else. The service itself runs on both loops in
tests/test_service.py (every test there, once per loop)."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest
from tornado.httpclient import AsyncHTTPClient
from tornado.ioloop import IOLoop
from tornado.web import Application, RequestHandler

from tests.helpers import ROOT
from control import eventloop
from state.config import ConfigError, load_config


def test_default_is_uvloop_and_the_file_can_turn_it_off(tmp_path):
    assert load_config().server.event_loop == "uvloop"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  event_loop: asyncio\n")
    assert load_config(str(cfg)).server.event_loop == "asyncio"
    cfg.write_text("server:\n  event_loop: trio\n")
    with pytest.raises(ConfigError, match="server.event_loop"):
        load_config(str(cfg))


def test_bad_loop_on_the_command_line_is_refused():
    res = subprocess.run([sys.executable, "supervisor.py", "--event-loop", "trio"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--event-loop" in res.stderr


@pytest.mark.parametrize("choice", ["uvloop", "asyncio"])
def test_tornado_serves_on_the_loop_installed(choice):
    """Tornado's IOLoop wraps the installed loop, and HTTP works on it."""
    kind = eventloop.install(choice)
    assert kind == choice
    loop = IOLoop.current()
    try:
        class Hello(RequestHandler):
            def get(self) -> None:
                self.finish({"loop": eventloop.running_kind()})

        server = Application([(r"/", Hello)]).listen(0, address="127.0.0.1")
        port = next(iter(server._sockets.values())).getsockname()[1]

        async def fetch() -> bytes:
            resp = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}/")
            return resp.body

        body = loop.run_sync(fetch, timeout=30)
        server.stop()
        assert body == f'{{"loop": "{choice}"}}'.encode()
        inner = loop.asyncio_loop  # type: ignore[attr-defined]
        assert (type(inner).__module__.startswith("uvloop")) == (choice == "uvloop")
    finally:
        loop.close(all_fds=True)
        asyncio.set_event_loop(None)


def test_without_uvloop_the_service_falls_back_to_asyncio(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    with caplog.at_level(logging.WARNING, logger="textswap.supervisor"):
        loop, kind = eventloop.new_loop("uvloop")
    try:
        assert kind == "asyncio" and not type(loop).__module__.startswith("uvloop")
        assert "does not import" in caplog.text
    finally:
        loop.close()
    with pytest.raises(ValueError):
        eventloop.new_loop("trio")
