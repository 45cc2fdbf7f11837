"""textswap supervisor: the entry point, and the composition root of the control plane.

    python supervisor.py --config config.yaml

`Supervisor` holds the shared state (the slots by model name, the default
model, the record, the pool, jobs, events, the state DB) and composes the
objects that act on it, each in its own module of `control/`:

    router      control/routing.py          requests to workers; the swap
    provision   control/provision.py        workers for a slot: obtain, ready, retire
    applies     control/applies.py          apply, unload, the applied record
    rollouts    control/rollout_control.py  probation, rollback, gate, shadow, canary
    healer      control/healing.py          worker exits, recovery, sweep, recycling
    statusview  control/status.py           /status and the durable history

All state changes happen on the IOLoop (rule 2 of ARCHITECTURE.md): HTTP
handlers, worker exit callbacks, the watcher thread and signal handlers only
call or post to the Supervisor. This process never imports TensorFlow.
"""
from __future__ import annotations

import argparse
import collections
import gc
import logging
import os
import signal
import sys
import time
from typing import Any

from tornado import gen
from tornado.ioloop import IOLoop, PeriodicCallback
from tornado.locks import Event

from state.config import Config, ConfigError, load_config, scrub_secret_env
from state.keys import KeyError_, KeyRing, configured_keys
from control.retention import Retention
from state.predlog import FILENAME as PREDLOG_DB, PredictionLog
from state.predlog_api import PredictionLogBackend
from state.statedb import FILENAME as STATE_DB, StateDB
from state.storage import Storage
from state.store import ModelStore, StoreError
from control import metrics
from control.applies import Applies
from control.events import Events
from control.healing import Healer
from control.jobs import JobManager
from control.policies import Policies
from control.pool import WorkerPool
from control.quality import Quality
from control.provision import Provisioner
from control.rollout_control import RolloutControl
from control.rollouts import GoldenSets
from control.routing import Router
from control.slots import Slot
from control.status import StatusView
from control.watcher import RecordWatcher
from control.workerhandle import State

log = logging.getLogger("textswap.supervisor")

DEMO_NAME = "demo"
DEMO_DATA = "data/demo/sentiment_zh.jsonl"
DEMO_PARAMS: dict[str, Any] = {"architecture": "bow"}  # fixed and fast: predicts ~20 s after a first start


class Supervisor:
    """Owns the shared state; composes routing, applies, rollouts, healing, status."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.wcfg = config["worker"]
        self.store = ModelStore(config.models_dir)
        self.storage = Storage(self.store.root)  # durable writes off the IOLoop; health
        self.loop = IOLoop.current()
        self.pool = WorkerPool(config, self.store, lambda w: self.healer.on_worker_exit(w),
                               lambda: self.provision.preload_guesses())
        # the shared state: the parts below read and change it on the IOLoop
        self.slots: dict[str, Slot] = {}
        self.default_name: str | None = None
        self.previous_default: str | None = None  # the default before the last change
        self.record: dict[str, Any] = {"default": None, "models": {}, "revision": 0}
        self.events = Events()
        self.golden = GoldenSets(self.store.root)
        self.started = time.time()
        self.stopping = False
        self.stopped = Event()
        self.restarts = 0
        self.exits: collections.deque[Any] = collections.deque(maxlen=20)
        self.failed_models: dict[str, dict[str, Any]] = {}
        self.last_apply: dict[str, Any] | None = None
        self._demo_training = False
        self.watcher: RecordWatcher | None = None
        self.keys: KeyRing | None = None  # the API keys (main sets them); None: auth off
        # the parts of the control plane
        self.router = Router(self)
        self.provision = Provisioner(self)
        self.applies = Applies(self)
        self.rollouts = RolloutControl(self)
        self.healer = Healer(self)
        self.statusview = StatusView(self)
        self.metrics = metrics.build(self, config)  # Prometheus figures (control/metrics.py)
        self.quality = Quality(self)  # live quality and drift per version (control/quality.py)
        # what the handlers, jobs and the cluster node call
        self.predict = self.router.predict
        self.serving_names, self.serving_model = self.router.serving_names, self.router.serving_model
        self.apply, self.unload = self.applies.apply, self.applies.unload
        self.rollback, self.promote = self.rollouts.rollback, self.rollouts.promote
        self.abort, self.rollout_status = self.rollouts.abort, self.rollouts.rollout_status
        self.status, self.history = self.statusview.status, self.statusview.history
        # cluster mode (cluster.redis_url; cluster/node.py): the record lives in
        # Redis and stands in for the file watcher; jobs queue in Redis; each
        # node keeps its own state db (the store is shared)
        self.cluster: Any = None
        state_path = os.path.join(self.store.root, STATE_DB)
        if config["cluster"]["redis_url"]:
            from cluster.node import ClusterNode, node_state_path
            self.cluster = ClusterNode(self)
            state_path = node_state_path(self.store.root, self.cluster.node_id)
        self.state = StateDB(state_path)  # jobs, history
        pcfg = config["predictions"]  # the learning loop (docs/loop.md)
        self.predlog: PredictionLogBackend  # chosen here, once (state/predlog_api.py)
        if self.cluster is None:
            self.predlog = PredictionLog(os.path.join(self.store.root, PREDLOG_DB),
                                         enabled=pcfg["log"], max_rows=pcfg["max_rows"])
        else:  # one log for the cluster: feedback sent to any node finds the prediction
            from cluster.predlog import RedisPredictionLog
            ccfg = config["cluster"]
            self.predlog = RedisPredictionLog(ccfg["redis_url"], prefix=ccfg["key_prefix"],
                                              enabled=pcfg["log"], max_rows=pcfg["max_rows"])
        self.policies = Policies(self)  # retrain policies; `policies` in config
        self.state.health = self.predlog.health = self.storage
        self.events.subscribe(self.statusview.to_history)
        self.jobs = JobManager(self, self.state)
        if self.cluster is not None:
            self.jobs.cluster = self.cluster.training
        self._sweeper = PeriodicCallback(self.healer.sweep, 1000)
        self.retention = Retention(self.predlog, config["predictions"])  # max_age_days

    @property
    def ready(self) -> bool:
        """The default model serves (what /readyz reports)."""
        return self.router.ready

    def refresh_preload(self) -> None:
        self.pool.refresh()

    # -- start and stop -----------------------------------------------------------
    async def start(self) -> None:
        self.store.ensure(wipe_tmp=self.cluster is None)  # other nodes' staging is theirs
        self.pool.ensure(nice=False)  # first worker: full speed
        try:
            record = (self.store.read_record() if self.cluster is None
                      else await self.cluster.load())  # Redis, else this node's cache
        except StoreError as exc:
            log.error("%s; starting without a model", exc)
            record = None
        if record:
            self.record = record
            self.default_name = record["default"]
        if self.cluster is not None:  # follows the Redis record instead of the file
            self.watcher = self.cluster
            self.cluster.start(record)
        elif self.cfg["watcher"]["enabled"]:
            self.watcher = RecordWatcher(self.store, self.loop, self.cfg["watcher"]["interval"],
                                         self.applies.on_record_change)
            self.watcher.start(record)
        self._sweeper.start()
        self.retention.start()
        if record and record["models"]:
            for name, entry in record["models"].items():
                self.loop.spawn_callback(
                    self.applies.apply_logged, name, entry["version"], "startup",
                    replicas=entry["replicas"], explicit=entry["explicit"])
        elif not self.store.names() and self.cfg["training"]["demo_on_empty_store"]:
            self.loop.spawn_callback(self._train_demo)
        else:
            log.info("no applied model yet: /readyz answers 503 until one is applied")

    async def _train_demo(self) -> None:
        """First start on an empty store: train and apply the bundled demo."""
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEMO_DATA)
        if self.cluster is not None and not await self.cluster.claim_demo():
            log.info("cluster: the first-start demo is trained once, by another node")
            return
        self._demo_training = True
        try:
            job = await self.jobs.submit(DEMO_NAME, {"path": path}, DEMO_PARAMS, True,
                                         trusted_path=True)
        except Exception as exc:
            self._demo_training = False
            log.error("could not start the demo training: %s", exc)
            return
        log.info("empty model store: training the bundled demo model (job %s); "
                 "/predict answers once it is applied", job.id)

    async def shutdown(self) -> None:
        if self.stopping:
            await self.stopped.wait()
            return
        self.stopping = True
        self.pool.stopping = True
        log.info("shutting down")
        self._sweeper.stop()
        self.retention.stop()
        if self.watcher:
            self.watcher.stop()
        await self.jobs.shutdown()
        if self.cluster is not None:
            await self.cluster.close()
        timeout = self.wcfg["stop_timeout"]
        serving = [w for s in self.slots.values() for w in s.replicas]
        for w in serving:
            w.set_state(State.DRAINING)
        await gen.multi([w.wait_idle(min(self.wcfg["drain_timeout"], 5.0)) for w in serving])
        await gen.multi([w.stop(timeout) for w in list(self.pool.workers.values())])
        for s in self.slots.values():
            s.replicas = []
        self.state.close()  # commits the pending job and history writes
        self.predlog.close()  # and the queued predictions and feedback
        self.storage.close()
        self.stopped.set()
        log.info("all workers stopped")


# -- entry point ---------------------------------------------------------------------
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def open_keys(config: Config, insecure_no_auth: bool) -> KeyRing | None:
    """The API keys (state/keys.py), generated on a first start; None with auth
    off, which a management bind beyond loopback refuses unless the
    --insecure-no-auth flag says otherwise (then it warns, every start)."""
    manage_host = config["server"]["manage_host"]
    if config["auth"]["enabled"]:
        return KeyRing.open(config)
    configured_keys(config)  # a key too short is an error even while auth is off
    if manage_host not in LOOPBACK:
        if not insecure_no_auth:
            raise ConfigError(f"auth is off (auth.enabled: false) and the management API would "
                              f"be bound to {manage_host}, beyond loopback: anyone who reaches "
                              "it could train, apply and read logged texts. Turn auth on, bind "
                              "it to 127.0.0.1, or start with --insecure-no-auth")
        log.warning("INSECURE: auth is off and the management API is bound to %s "
                    "(--insecure-no-auth): anyone who reaches it can train, apply, unload and "
                    "read logged texts", manage_host)
    else:
        log.warning("auth is off (auth.enabled: false): the management API on %s takes no "
                    "key, and POST /feedback on the inference port is off", manage_host)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="textswap: train short-text classifiers and serve them with "
                    "zero-downtime model switching.")
    p.add_argument("--config", help="YAML config file (built-in defaults when omitted)")
    p.add_argument("--host", help="inference API bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="inference API port (default 8080)")
    p.add_argument("--manage-host", help="management API bind address (default 127.0.0.1)")
    p.add_argument("--manage-port", type=int, help="management API port (default 8081)")
    p.add_argument("--models-dir", help="model store folder (default ./models)")
    p.add_argument("--redis-url", help="cluster mode: the cluster store, e.g. "
                                       "redis://host:6379/0 (default: off)")
    p.add_argument("--node-id", help="cluster mode: this node's name (default hostname:port)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="start with auth off (auth.enabled: false) although the management "
                        "API is bound beyond loopback: anyone who reaches it can drive the "
                        "service (refused without this flag)")
    p.add_argument("--log-level", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="log level (default INFO); debug also shows TensorFlow's C++ logs "
                        "of workers and trainers")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    server = {k: v for k, v in (("host", args.host), ("port", args.port),
                                ("manage_host", args.manage_host),
                                ("manage_port", args.manage_port)) if v is not None}
    overrides: dict[str, Any] = {"server": server} if server else {}
    if args.models_dir:
        overrides["models_dir"] = args.models_dir
    cluster = {k: v for k, v in (("redis_url", args.redis_url), ("node_id", args.node_id))
               if v is not None}
    if cluster:
        overrides["cluster"] = cluster
    if getattr(args, "log_level", None):
        overrides["log_level"] = args.log_level
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.pop("TEXTSWAP_PRELOAD_SUPERVISOR_ONLY", None):
        # fault injection (tests/test_faults_disk.py runs this process under
        # libfiu's fiu-run): the preload is for this process, not its workers
        os.environ.pop("LD_PRELOAD", None)
    try:
        config = build_config(args)
    except (ConfigError, OSError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    scrub_secret_env()  # read into config: no child process gets them
    # the store, the logs' databases, the records: this user's alone (files
    # 0600, folders 0700), in this process and every child it starts
    os.umask(0o077)
    logging.basicConfig(level=config["log_level"],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config["cluster"]["redis_url"]:  # nodes share the store: it must be writable
        from cluster.node import check_store_writable
        try:
            check_store_writable(config.models_dir)
        except RuntimeError as exc:
            print(f"cannot start: {exc}", file=sys.stderr)
            return 2
    try:
        keys = open_keys(config, args.insecure_no_auth)
    except (ConfigError, KeyError_) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from frontend.app import start_servers  # Tornado apps; no TensorFlow anywhere

    loop = IOLoop.current()
    try:
        sup = Supervisor(config)
    except ConfigError as exc:  # e.g. a bad retrain policy in config
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    sup.keys = keys
    exit_code = 0

    servers: list[Any] = []

    async def stop() -> None:
        for server in servers:  # no new connections; in-flight requests finish below
            server.stop()
        await sup.shutdown()
        loop.stop()

    async def boot() -> None:
        nonlocal exit_code
        try:
            servers.extend(start_servers(sup, config))
        except OSError as exc:
            log.error("cannot listen: %s", exc)
            exit_code = 1
            await sup.shutdown()
            loop.stop()
            return
        await sup.start()
        s = config["server"]
        log.info("inference API on http://%s:%d, management API on http://%s:%d",
                 s["host"], s["port"], s["manage_host"], s["manage_port"])
        if keys is not None:  # one-time code: the page trades it for a session
            host = s["manage_host"] if s["manage_host"] not in ("0.0.0.0", "::", "") \
                else "localhost"
            host = f"[{host}]" if ":" in host else host
            log.info("dashboard (the link logs you in once): http://%s:%d/#code=%s",
                     host, s["manage_port"], keys.new_code())

    # Long-lived startup objects out of the collector's way, and fewer young
    # collections: the request path allocates many short-lived objects.
    gc.freeze()
    gc.set_threshold(20000, 20, 20)
    # the event loop's own signal handling: the handler runs on the loop
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.asyncio_loop.add_signal_handler(  # type: ignore[attr-defined]  # asyncio-backed IOLoop
            signum, lambda: loop.spawn_callback(stop))
    loop.add_callback(boot)
    loop.start()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
