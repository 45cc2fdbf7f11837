"""Run a local cluster: Redis, nginx and three textswap nodes on one machine.

    python deploy/localcluster.py [--dir DIR] [--nodes 3] [--port 8000]

(`make cluster`.) Everything gets its own folder under DIR (default
./cluster-run): the shared model store, Redis's data, nginx's config and
logs, each node's log. nginx listens on --port and spreads POST /predict
over the nodes' inference ports; each node's management API is on its own
port (printed at start). Ctrl-C stops everything. On an empty store the
first node to start trains the demo model once for the whole cluster.

The RedisServer and Nginx classes are also what tests/test_cluster.py and
bench/cluster.py use: real binaries from the Debian packages, run in the
foreground as our children, on free ports.
"""
from __future__ import annotations

import argparse
import os
import shutil
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)


def have_redis_and_nginx() -> bool:
    return bool(_which("redis-server") and _which("nginx"))


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class RedisServer:
    """redis-server on a free port; appendonly with fsync always, so a
    kill -9 and restart keeps the data (as a production setup should)."""

    def __init__(self, workdir: str, port: int | None = None) -> None:
        self.dir = os.path.join(workdir, "redis")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.port = port or free_port()
        # a generated password, in a 0600 config file: never on a command line
        self.password = secrets.token_urlsafe(24)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        """The URL with the password: for the nodes' environment
        (TEXTSWAP_REDIS_URL), never for a command line or a log."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        conf = os.path.join(self.dir, "redis.conf")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\nsave \"\"\n"
                     "appendonly yes\nappendfsync always\ndaemonize no\n"
                     f"requirepass {self.password}\n")
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen([_which("redis-server") or "redis-server", conf],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for(lambda: _accepts(self.port), 20, f"redis-server on port {self.port}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


NGINX_CONF = os.path.join(ROOT, "deploy", "nginx.conf")


def nginx_config(listen: int, upstreams: list[int], workdir: str) -> str:
    """deploy/nginx.conf with this run's ports and folders filled in."""
    with open(NGINX_CONF, encoding="utf-8") as fh:
        text = fh.read()
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;"
                        for p in upstreams)
    text = text.replace("        server 127.0.0.1:8080 max_fails=1 fail_timeout=2s;\n"
                        "        server 127.0.0.1:8090 max_fails=1 fail_timeout=2s;\n"
                        "        server 127.0.0.1:8100 max_fails=1 fail_timeout=2s;", servers)
    text = text.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{listen};")
    text = text.replace("/tmp/textswap-nginx", workdir)
    return text


class Nginx:
    def __init__(self, workdir: str, upstreams: list[int], port: int | None = None) -> None:
        self.dir = os.path.join(workdir, "nginx")
        os.makedirs(os.path.join(self.dir, "logs"), exist_ok=True)
        self.port = port or free_port()
        self.conf = os.path.join(self.dir, "nginx.conf")
        with open(self.conf, "w", encoding="utf-8") as fh:
            fh.write(nginx_config(self.port, upstreams, self.dir))
        log = open(os.path.join(self.dir, "logs", "stderr.log"), "ab")
        self.proc = subprocess.Popen(
            [_which("nginx") or "nginx", "-p", self.dir, "-c", self.conf,
             "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for(lambda: _accepts(self.port) or self.proc.poll() is not None, 20,
                 f"nginx on port {self.port}")
        if self.proc.poll() is not None:
            raise RuntimeError("nginx did not start: " + open(
                os.path.join(self.dir, "logs", "stderr.log")).read()[-2000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish open requests
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Redis + nginx + N textswap nodes on this machine")
    p.add_argument("--dir", default=os.path.join(ROOT, "cluster-run"),
                   help="working folder (store, logs, configs); default ./cluster-run")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--port", type=int, default=8000, help="nginx port (default 8000)")
    p.add_argument("--models-dir", help="shared model store (default DIR/models)")
    args = p.parse_args(argv)
    if not have_redis_and_nginx():
        print("redis-server and nginx are needed: apt-get install redis-server nginx",
              file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    models = os.path.abspath(args.models_dir or os.path.join(args.dir, "models"))
    redis = RedisServer(args.dir)
    nodes: list[tuple[subprocess.Popen, int, int]] = []
    nginx = None
    try:
        for i in range(1, args.nodes + 1):
            port, mport = free_port(), free_port()
            log = open(os.path.join(args.dir, f"node{i}.log"), "ab")
            proc = subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "supervisor.py"), "--models-dir", models,
                 "--host", "127.0.0.1", "--port", str(port), "--manage-port", str(mport),
                 "--node-id", f"node{i}"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "TEXTSWAP_REDIS_URL": redis.url})  # not on a command line
            log.close()
            nodes.append((proc, port, mport))
        nginx = Nginx(args.dir, [port for _, port, _ in nodes], port=args.port)
        print(f"redis     127.0.0.1:{redis.port}, password in {redis.dir}/redis.conf")
        print(f"nginx     http://127.0.0.1:{nginx.port}/predict  -> nodes' inference ports")
        for i, (proc, port, mport) in enumerate(nodes, 1):
            print(f"node{i}     inference :{port}  management http://127.0.0.1:{mport} "
                  f"(/apply /train /cluster)  log {args.dir}/node{i}.log")
        # the nodes share the key file beside the store (the first to start writes it)
        keys = os.path.join(os.path.dirname(models), ".textswap", "keys.json")
        print(f"store     {models}\nkeys      {keys} (0600; management calls take the admin "
              "key: 'Authorization: Bearer <key>'; each node's log has a one-time dashboard "
              "URL)\nCtrl-C stops everything.")
        stop = []
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
        while not stop and all(proc.poll() is None for proc, _, _ in nodes):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if nginx is not None:
            nginx.stop()
        for proc, _, _ in nodes:
            if proc.poll() is None:
                proc.terminate()
        for proc, _, _ in nodes:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
