"""Test helpers: run the real service as a subprocess and talk HTTP to it."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing is bound to now, and none this process handed out
    before: the ports of services started together (a cluster's nodes) are
    drawn before any of them binds, and the same free port drawn twice had
    two nodes race for one port."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port that was not handed out before")


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll pred() until it returns something truthy, or fail after timeout.

    Only connection errors (a service still starting) are retried: an
    AssertionError or any other error in pred() fails at once, so a wrong
    answer is reported as itself, not as a timeout minutes later."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except (OSError, http.client.HTTPException) as exc:  # e.g. connection refused
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


# The keys of the services the tests started, by port: request() sends the
# port's key (the admin key to a management port; the feedback key to an
# inference port's /feedback, the predict key, when set, to its other paths)
# unless the caller sends an Authorization header itself or says auth=False.
KEYS_BY_PORT: dict[int, Callable[[str], str | None]] = {}


def keys_file(models_dir: str) -> str:
    """The default key file of a service on this store (state/keys.py)."""
    return os.path.join(os.path.dirname(os.path.abspath(models_dir).rstrip(os.sep)),
                        ".textswap", "keys.json")


def request(port: int, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 60.0,
            auth: bool = True) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json"}
        hdrs.update(headers or {})
        key = KEYS_BY_PORT[port](path.split("?")[0]) if auth and port in KEYS_BY_PORT else None
        if key and not any(h.lower() == "authorization" for h in hdrs):
            hdrs["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        payload = resp.read()
        try:
            return resp.status, json.loads(payload) if payload else None
        except ValueError:
            return resp.status, payload
    finally:
        conn.close()


class Service:
    """The real service (python supervisor.py) on free ports."""

    def __init__(self, models_dir: str, *, args: list[str] | None = None,
                 env: dict[str, str] | None = None, log_path: str | None = None,
                 prefix: list[str] | None = None) -> None:
        self.models_dir = models_dir
        self.port = free_port()
        self.mport = free_port()
        self.log_path = log_path or f"{models_dir.rstrip(os.sep)}-service-{self.port}.log"
        cmd = [sys.executable, os.path.join(ROOT, "supervisor.py"), "--models-dir", models_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--manage-port", str(self.mport)]
        self._log = open(self.log_path, "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # prefix: a command that runs the service, e.g. fiu-run (test_faults_disk.py)
        self.proc = subprocess.Popen((prefix or []) + cmd + (args or []), cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=full_env)
        try:
            wait_for(lambda: self.get("/healthz")[0] == 200, 30, "service /healthz")
            self.keys = self.read_keys(env or {})
        except BaseException:  # no test holds it to stop it: a service that did not come up goes
            self.stop()
            raise
        KEYS_BY_PORT[self.mport] = lambda path: self.keys.get("admin")
        KEYS_BY_PORT[self.port] = lambda path: self.keys.get(
            "feedback" if path == "/feedback" else "predict")

    def read_keys(self, env: dict[str, str]) -> dict[str, str]:
        """The service's keys as a client finds them: the generated key file
        beside the store (written before the ports listen), under the keys the
        environment gave it."""
        keys: dict[str, str] = {}
        try:
            with open(keys_file(self.models_dir), encoding="utf-8") as fh:
                keys.update(json.load(fh)["keys"])
        except FileNotFoundError:
            pass
        for name, var in (("admin", "TEXTSWAP_MANAGEMENT_TOKEN"), ("admin", "TEXTSWAP_ADMIN_KEY"),
                          ("review", "TEXTSWAP_REVIEW_KEY"),
                          ("feedback", "TEXTSWAP_FEEDBACK_TOKEN"),
                          ("feedback", "TEXTSWAP_FEEDBACK_KEY"), ("predict", "TEXTSWAP_PREDICT_KEY")):
            if env.get(var):
                keys[name] = env[var]
        return keys

    def auth(self, name: str = "admin") -> dict[str, str]:
        """The Authorization header of one of the service's keys."""
        return {"Authorization": f"Bearer {self.keys[name]}"}

    def dashboard_url(self) -> str:
        """A one-time dashboard URL (POST /auth/code with the admin key): the
        page trades its code for a session, as with the URL printed at start."""
        code, body = self.mpost("/auth/code", {})
        assert code == 200, body
        return f"http://127.0.0.1:{self.mport}/#code={body['code']}"

    # HTTP
    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return request(self.port, "GET", path, **kw)

    def predict(self, body: Any, **kw: Any) -> tuple[int, Any]:
        return request(self.port, "POST", "/predict", body, **kw)

    def mget(self, path: str, **kw: Any) -> tuple[int, Any]:
        return request(self.mport, "GET", path, **kw)

    def mpost(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return request(self.mport, "POST", path, body, **kw)

    def request_put(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return request(self.mport, "PUT", path, body, **kw)

    def request_delete(self, path: str, **kw: Any) -> tuple[int, Any]:
        return request(self.mport, "DELETE", path, **kw)

    def status(self) -> dict[str, Any]:
        code, body = self.mget("/status")
        assert code == 200, body
        return body

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def serving(self) -> dict[str, Any] | None:
        return self.status()["serving"]

    def wait_standby(self, timeout: float = 90) -> dict[str, Any]:
        def booted():
            sb = self.status()["standby"] or {}
            # STANDBY: waiting for a model; READY: it has preloaded a likely one
            return sb.get("state") in ("STANDBY", "READY") and sb
        return wait_for(booted, timeout, "a booted standby worker", interval=0.2)

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if sig == signal.SIGKILL:  # nothing reaps them: a real crash leaves them
            for k in kids:
                try:
                    k.kill()
                except psutil.NoSuchProcess:
                    pass
        self._log.close()

        def alive() -> list[str]:
            out = []
            for k in kids:
                try:
                    if k.is_running() and k.status() != psutil.STATUS_ZOMBIE:
                        out.append(" ".join(k.cmdline())[:200])
                except psutil.NoSuchProcess:
                    pass
            return out
        # helpers (e.g. multiprocess's resource tracker) exit once they see
        # the parent gone; give them a moment before calling them leftovers
        deadline = time.monotonic() + 5
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.leftover = alive()
        return code


def pid_gone(pid: int) -> bool:
    """True once the process has exited and been reaped (a zombie is not gone)."""
    try:
        psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    return False


class ClientLoad:
    """Client threads calling `one(arg)` in a loop until the block ends, one
    thread per arg; `one` appends to `results`. Entering waits (with a
    deadline) until `ready` results came in."""

    ready, ready_s = 10, 60.0

    def __init__(self, args: list[Any]) -> None:
        self.results: list[Any] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(a,)) for a in args]

    def one(self, arg: Any) -> None:
        raise NotImplementedError

    def _run(self, arg: Any) -> None:
        while not self._stop.is_set():
            self.one(arg)

    def __enter__(self):
        for t in self._threads:
            t.start()
        wait_for(lambda: len(self.results) > self.ready, self.ready_s, "load to flow")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


# -- a small disk that fills up (tests/test_faults_disk.py, tests/test_predlog_disk.py) ---
@contextlib.contextmanager
def small_disk(path: str, size: str) -> Iterator[str]:
    """A tmpfs of `size` (e.g. "16m") mounted at `path`, unmounted after; the
    test is skipped where mounting is not allowed (it needs root)."""
    import pytest

    os.makedirs(path, exist_ok=True)
    # mode: a tmpfs is 1777 by default, and the service refuses a key folder
    # directly in a world-writable folder
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill_disk(folder: str) -> str:
    """Fill the file system of `folder` to the last byte (a real ENOSPC for
    every write after it); returns the filler file, whose removal frees it."""
    filler = os.path.join(folder, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for chunk in (1 << 20, 65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


# -- the learning loop's reports (tests/test_drift.py, tests/test_drift_signals.py) -----
def predict_in_batches(svc: "Service", model: str, texts: list[str], batch: int = 100) -> None:
    """POST /predict every text for `model`, `batch` at a time (each answered 200)."""
    for i in range(0, len(texts), batch):
        code, body = svc.predict({"model": model, "texts": texts[i:i + batch]})
        assert code == 200, body


def quality_once_logged(svc: "Service", model: str, predictions: int) -> dict[str, Any]:
    """GET /models/<model>/quality once the log holds `predictions` texts of its
    newest version (the log is written off the request path)."""
    def logged() -> Any:
        code, body = svc.mget(f"/models/{model}/quality")
        assert code == 200, body
        return body["versions"][0]["predictions"] >= predictions and body
    return wait_for(logged, 60, f"{predictions} logged predictions of {model}", interval=0.2)
