"""Run a local cluster: Redis, nginx and three textswap nodes on one machine.

    python -m deploy.localcluster [--dir DIR] [--nodes 3] [--port 8000] [--sentinel]

(`make cluster`; `make cluster SENTINEL=1` for --sentinel: a Redis primary,
one replica and three Sentinels in place of the one Redis, the nodes
following the primary through failovers: kill -9 the primary to watch one.) Everything gets its own folder under DIR (default
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
    kill -9 and restart keeps the data (as a production setup should).
    replica_of: a replica of that server (same password); name: its folder."""

    def __init__(self, workdir: str, port: int | None = None, *, name: str = "redis",
                 password: str | None = None, replica_of: "RedisServer | None" = None) -> None:
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.port = port or free_port()
        # a generated password, in a 0600 config file: never on a command line
        self.password = password or (replica_of.password if replica_of else
                                     secrets.token_urlsafe(24))
        self.replica_of = replica_of
        self.proc: subprocess.Popen | None = None
        self.conf = os.path.join(self.dir, "redis.conf")
        self._write_conf()
        self.start()

    def _write_conf(self) -> None:
        """Once: Sentinel rewrites it on a failover (who replicates whom),
        and a restart keeps what it wrote."""
        fd = os.open(self.conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\nsave \"\"\n"
                     "appendonly yes\nappendfsync always\ndaemonize no\n"
                     f"requirepass {self.password}\nmasterauth {self.password}\n"
                     # a replica that (re)joins syncs at once, not after 5 s
                     "repl-diskless-sync-delay 0\n")
            if self.replica_of is not None:
                fh.write(f"replicaof 127.0.0.1 {self.replica_of.port}\n")

    @property
    def url(self) -> str:
        """The URL with the password: for the nodes' environment
        (TEXTSWAP_REDIS_URL), never for a command line or a log."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, replica_of_port: int | None = None) -> None:
        """replica_of_port: start as a replica of that server (a former
        primary coming back after a failover: its start script asks the
        Sentinels for the primary, SentinelSetup.restart)."""
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        extra = ["--replicaof", "127.0.0.1", str(replica_of_port)] if replica_of_port else []
        self.proc = subprocess.Popen([_which("redis-server") or "redis-server", self.conf,
                                      *extra], stdout=log, stderr=subprocess.STDOUT)
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


SENTINEL_SERVICE = "textswap"


class SentinelServer:
    """`redis-server --sentinel` on a free port, watching `primary` under the
    service name textswap; down-after-milliseconds 1000 (a dead primary is
    replaced within a few seconds); quorum 2 of the three a setup runs. It
    takes the primary's password (clients and the other Sentinels give it)."""

    def __init__(self, workdir: str, primary: RedisServer, index: int,
                 port: int | None = None, down_after_ms: int = 1000) -> None:
        self.dir = os.path.join(workdir, f"sentinel{index}")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.port = port or free_port()
        self.conf = os.path.join(self.dir, "sentinel.conf")
        pw = primary.password
        fd = os.open(self.conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\ndaemonize no\n"
                     f"requirepass {pw}\n"
                     f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary.port} 2\n"
                     f"sentinel auth-pass {SENTINEL_SERVICE} {pw}\n"
                     f"sentinel sentinel-pass {pw}\n"
                     f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {down_after_ms}\n"
                     f"sentinel failover-timeout {SENTINEL_SERVICE} 10000\n"
                     f"sentinel parallel-syncs {SENTINEL_SERVICE} 1\n")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(os.path.join(self.dir, "sentinel.log"), "ab")
        self.proc = subprocess.Popen([_which("redis-server") or "redis-server", self.conf,
                                      "--sentinel"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for(lambda: _accepts(self.port), 20, f"redis sentinel on port {self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class SentinelSetup:
    """A primary, `replicas` replicas and three Sentinels (the failover
    test's topology; `make cluster SENTINEL=1`). The nodes get the URL (the
    password only) in their environment and the Sentinels' addresses in
    their config (`cluster.sentinels`)."""

    def __init__(self, workdir: str, replicas: int = 1, sentinels: int = 3,
                 down_after_ms: int = 1000) -> None:
        self.servers = [RedisServer(workdir, name="redis0")]
        for i in range(replicas):
            self.servers.append(RedisServer(workdir, name=f"redis{i + 1}",
                                            replica_of=self.servers[0]))
        self.password = self.servers[0].password
        wait_for(lambda: self.acked(self.servers[0]) >= replicas, 30,
                 "the replicas to sync and acknowledge a write")
        self.sentinels = [SentinelServer(workdir, self.servers[0], i + 1,
                                         down_after_ms=down_after_ms)
                          for i in range(sentinels)]

    @property
    def url(self) -> str:
        """The password and the db; the host is not used (the Sentinels name it)."""
        return f"redis://:{self.password}@sentinel/0"

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.sentinels]

    def cli(self, port: int, *args: str) -> str:
        """redis-cli against one server or Sentinel (the password in the
        environment, not on the command line)."""
        out = subprocess.run([_which("redis-cli") or "redis-cli", "-p", str(port), *args],
                             capture_output=True, text=True, timeout=10,
                             env={**os.environ, "REDISCLI_AUTH": self.password})
        return out.stdout.strip()

    def primary_port(self) -> int | None:
        """The primary's port as a quorum of the running Sentinels names it."""
        votes: dict[int, int] = {}
        for s in self.sentinels:
            if s.proc is None or s.proc.poll() is not None:
                continue
            lines = self.cli(s.port, "SENTINEL", "get-master-addr-by-name",
                             SENTINEL_SERVICE).split()
            if len(lines) == 2 and lines[1].isdigit():
                votes[int(lines[1])] = votes.get(int(lines[1]), 0) + 1
        best = max(votes.items(), key=lambda kv: kv[1], default=(None, 0))
        return best[0] if best[1] >= 2 else None

    def restart(self, server: RedisServer) -> None:
        """Start a killed server again, as a replica of the primary the
        Sentinels name now (what a start script beside Sentinel does: else the
        Sentinels turn a returning old primary into a replica only at their
        next look at it, up to 10 s later)."""
        primary = self.primary_port()
        server.start(primary if primary and primary != server.port else None)

    def server(self, port: int | None) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def replicas_online(self, server: RedisServer) -> int:
        info = self.cli(server.port, "INFO", "replication")
        for line in info.splitlines():
            if line.startswith("connected_slaves:"):
                return int(line.split(":")[1])
        return 0

    def acked(self, server: RedisServer) -> int:
        """Replicas that acknowledge a write on `server` within 0.2 s (WAIT)."""
        import redis  # the service's client (the venv); only this needs it
        r = redis.Redis(port=server.port, password=self.password, socket_timeout=2)
        try:
            r.set("textswap-setup-probe", str(time.time()))
            return int(r.wait(len(self.servers) - 1, 200))
        finally:
            r.close()

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for r in self.servers:
            r.stop()


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
    p.add_argument("--sentinel", action="store_true",
                   help="a primary, one replica and three Sentinels instead of one Redis")
    args = p.parse_args(argv)
    if not have_redis_and_nginx():
        print("redis-server and nginx are needed: apt-get install redis-server nginx",
              file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    models = os.path.abspath(args.models_dir or os.path.join(args.dir, "models"))
    redis: Any
    node_args: list[str] = []
    if args.sentinel:
        redis = SentinelSetup(args.dir)
        conf = os.path.join(args.dir, "node-config.yaml")
        with open(conf, "w", encoding="utf-8") as fh:
            fh.write("cluster:\n  sentinels: [" + ", ".join(
                f'"{a}"' for a in redis.addresses) + "]\n  sentinel_service: "
                f"{SENTINEL_SERVICE}\n")
        node_args = ["--config", conf]
    else:
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
                 "--node-id", f"node{i}", *node_args],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "TEXTSWAP_REDIS_URL": redis.url})  # not on a command line
            log.close()
            nodes.append((proc, port, mport))
        nginx = Nginx(args.dir, [port for _, port, _ in nodes], port=args.port)
        if args.sentinel:
            for r in redis.servers:
                print(f"redis     127.0.0.1:{r.port} (pid {r.proc.pid}), password in "
                      f"{r.dir}/redis.conf")
            print(f"sentinels {', '.join(redis.addresses)} (service {SENTINEL_SERVICE}; "
                  "GET /cluster shows the primary and the failovers seen)")
        else:
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
