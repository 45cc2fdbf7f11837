"""Cluster test kit: service nodes on fixed ports and a load generator.

Redis and nginx themselves come from deploy/localcluster.py (real binaries
from the Debian packages; `.ci/run` installs them).
"""
from __future__ import annotations

import collections
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

from tests.helpers import KEYS_BY_PORT, ROOT, free_port, keys_file, request, wait_for


def read_keys_file(models_dir: str) -> dict[str, str]:
    """The keys of the key file beside a store (none when there is none)."""
    try:
        with open(keys_file(models_dir), encoding="utf-8") as fh:
            return json.load(fh)["keys"]
    except FileNotFoundError:
        return {}

from deploy.localcluster import Nginx, RedisServer, have_redis_and_nginx  # noqa: E402,F401


class Node:
    """One service node (python supervisor.py) in cluster mode, on fixed
    ports so that it can be restarted behind the same nginx upstream."""

    def __init__(self, models_dir: str, redis_url: str, node_id: str, logdir: str,
                 port: int | None = None, mport: int | None = None,
                 extra: list[str] | None = None) -> None:
        self.models_dir, self.redis_url, self.node_id = models_dir, redis_url, node_id
        self.port = port or free_port()
        self.mport = mport or free_port()
        self.log_path = os.path.join(logdir, f"{node_id}.log")
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> "Node":
        cmd = [sys.executable, os.path.join(ROOT, "supervisor.py"), "--models-dir",
               self.models_dir, "--host", "127.0.0.1", "--port", str(self.port),
               "--manage-port", str(self.mport), "--node-id", self.node_id, *self.extra]
        log = open(self.log_path, "ab")
        # the URL holds Redis's password: in the environment, not on the command line
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1",
                                          "TEXTSWAP_REDIS_URL": self.redis_url})
        log.close()
        # the nodes share the store, so the key file beside it (written by the
        # first node to start): read when a request goes out
        KEYS_BY_PORT[self.mport] = lambda path: read_keys_file(self.models_dir).get("admin")
        KEYS_BY_PORT[self.port] = lambda path: read_keys_file(self.models_dir).get(
            "feedback") if path == "/feedback" else None
        if wait:
            wait_for(lambda: self.get("/healthz")[0] == 200, 60, f"{self.node_id} /healthz")
        return self

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return request(self.port, "GET", path, **kw)

    def mget(self, path: str, **kw: Any) -> tuple[int, Any]:
        return request(self.mport, "GET", path, **kw)

    def mpost(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return request(self.mport, "POST", path, body, **kw)

    def status(self) -> dict[str, Any]:
        code, body = self.mget("/status")
        assert code == 200, body
        return body

    def serving(self, name: str) -> int | None:
        """The version this node serves of `name`, or None."""
        m = (self.status().get("models") or {}).get(name) or {}
        return m.get("version") if m.get("workers") or m.get("replicas") else None

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def kill(self) -> None:
        """kill -9 of the supervisor; its workers follow (parent-death signal)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        for k in kids:
            try:
                k.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


class Load:
    """Steady POST /predict traffic through one port from a few threads,
    counting every answer that is not 200 (and transport errors)."""

    def __init__(self, port: int, threads: int = 2, texts: list[str] | None = None) -> None:
        self.port = port
        self.texts = texts or ["很好", "terrible", "love it", "差评"]
        self.ok = 0
        self.failed: list[Any] = []
        self.versions: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        conn = None
        n = 0
        while not self._stop.is_set():
            body = json.dumps({"text": self.texts[(i + n) % len(self.texts)]}).encode()
            n += 1
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request("POST", "/predict", body=body,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                payload = resp.read()
                if resp.status == 200:
                    model = json.loads(payload)["model"]
                    with self._lock:
                        self.ok += 1
                        self.versions[(model["name"], model["version"])] += 1
                else:
                    with self._lock:
                        self.failed.append((resp.status, payload[:300]))
            except (OSError, http.client.HTTPException) as exc:
                with self._lock:
                    self.failed.append(("transport", repr(exc)))
                if conn is not None:
                    conn.close()
                conn = None

    def count(self) -> int:
        with self._lock:
            return self.ok

    def stop(self) -> "Load":
        self._stop.set()
        for t in self._threads:
            t.join(40)
        return self


class FirstAnswer:
    """One thread per node POSTing /predict to the node itself (not through
    nginx) in a loop: `first[node_id]` is the wall-clock time of the first
    answer from `version` of the model (the two-phase apply's skew is the
    spread of these)."""

    def __init__(self, nodes: list[Node], version: int, text: str = "很好") -> None:
        self.version = version
        self.first: dict[str, float] = {}
        self._body = json.dumps({"text": text}).encode()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True)
                         for n in nodes]
        for t in self._threads:
            t.start()

    def _run(self, node: Node) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
        while not self._stop.is_set() and node.node_id not in self.first:
            try:
                conn.request("POST", "/predict", body=self._body,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                payload = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
                continue
            at = time.time()
            if resp.status == 200 and json.loads(payload)["model"]["version"] == self.version:
                self.first[node.node_id] = at
        conn.close()

    def skew(self) -> float:
        """Seconds between the first and the last node answering the version."""
        return max(self.first.values()) - min(self.first.values())

    def stop(self) -> "FirstAnswer":
        self._stop.set()
        for t in self._threads:
            t.join(40)
        return self
