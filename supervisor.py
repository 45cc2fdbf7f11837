"""textswap supervisor: the entry point, and the composition root of the control plane.

    python supervisor.py --config config.yaml

`Supervisor` picks the backends once (the applied record and the job queue:
a file and this service's own, or Redis shared by a cluster's nodes; the
prediction log: SQLite and its writer process, or Redis streams) and builds
the parts, giving each only what it uses:

    serving     control/serving.py          the slots, the default model, the record (read-only)
    ctl         control/servingctl.py       every change of the serving state (its one writer)
    keeper      control/records.py          persist, then switch (the record's one writer)
    router      control/routing.py          requests to workers
    provision   control/provision.py        workers for a slot: obtain, ready, retire
    applies     control/applies.py          apply, unload, following the record
    rollouts    control/rollout_control.py  probation, rollback, gate, shadow, canary
    healer      control/healing.py          worker exits, recovery, sweep, recycling
    statusview  control/status.py           /status and the durable history
    db          state/statedb.py            jobs and the history, on disk (its writer thread)

All state changes happen on the IOLoop (rule 2 of ARCHITECTURE.md): HTTP
handlers, worker exit callbacks, the watcher thread and signal handlers only
call or post to the parts. The parts are built in dependency order, each
given what it uses at construction; where two need each other one is given
a function of the other, or subscribes to its changes (the cluster node's
heartbeat to the controller's). This process never imports TensorFlow.
"""
from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from tornado import gen
from tornado.ioloop import IOLoop, PeriodicCallback
from tornado.locks import Event

from state import logformat
from state.config import Config, ConfigError, scrub_secret_env
from state.keys import KeyError_, KeyRing, open_keys
from state.options import build_config, parse_args
from control.retention import Retention
from state.predlog import FILENAME as PREDLOG_DB, PredictionLog
from state.predlog_api import PredictionLogBackend
from state.statedb import FILENAME as STATE_DB, StateDB
from state.storage import Storage
from state.store import ModelStore, StoreError
from control import eventloop, metrics
from control.applies import Applies
from control.events import Events
from control.healing import Healer
from control.jobs import JobManager, JobQueue
from control.policies import Policies
from control.pool import WorkerPool
from control.quality import Quality
from control.records import FileRecords, RecordBackend, RecordKeeper
from control.provision import Provisioner
from control.rollout_control import RolloutControl
from control.rollout_state import GoldenSets
from control.routing import Router
from control.serving import ServingState
from control.servingctl import ServingController
from control.status import StatusView
from control.workerhandle import State

log = logging.getLogger("textswap.supervisor")

DEMO_NAME = "demo"
DEMO_DATA = "data/demo/sentiment_zh.jsonl"
DEMO_PARAMS: dict[str, Any] = {"architecture": "bow"}  # fixed and fast: predicts ~20 s after a first start


class Supervisor:
    """The composition root: builds the parts, picks the backends, starts and stops."""

    def __init__(self, config: Config, keys: KeyRing | None = None) -> None:
        """keys: the API keys (None: auth is off)."""
        self.cfg = config
        self.wcfg = config.worker
        self.store = ModelStore(config.models_dir)
        self.storage = Storage(self.store.root)  # durable writes off the IOLoop; health
        self.loop = loop = IOLoop.current()
        self.serving = serving = ServingState()  # slots, the default model, the record
        self.ctl = ctl = ServingController(serving, config, loop)  # its one writer
        self.pool = pool = WorkerPool(config, self.store, lambda w: self.healer.on_worker_exit(w),
                                      lambda: self.provision.preload_guesses())
        self.provision = Provisioner(serving, config, loop, self.store, pool,
                                     end_probation=ctl.cancel_probation)
        self.events = Events()
        self.golden = GoldenSets(self.store.root)
        self.stopped = Event()
        self.keys = keys
        # the backends, chosen once: the applied record and the job queue (a
        # file and this service's own, or Redis shared by the cluster's nodes),
        # the state db, the prediction log (SQLite and its writer, or Redis)
        pcfg = config.predictions  # the learning loop (docs/loop.md)
        self.records: RecordBackend
        self.predlog: PredictionLogBackend
        queue: JobQueue | None = None
        node = None
        if config.cluster.redis_url:
            from cluster.node import ClusterNode, node_state_path
            from cluster.connect import RedisTarget
            from cluster.redis_predlog import RedisPredictionLog
            node = ClusterNode(config, ctl, self.store, self.events, self.provision, pool)
            self.records, queue = node, node.training
            state_path = node_state_path(self.store.root, node.node_id)  # the store is shared
            ccfg = config.cluster  # one log: feedback sent to any node finds the prediction
            self.predlog = RedisPredictionLog(RedisTarget.of(ccfg), prefix=ccfg.key_prefix,
                                              enabled=pcfg.log, max_rows=pcfg.max_rows,
                                              feedback_rows=config.feedback.max_rows,
                                              example_rows=config.feedback.max_example_rows,
                                              health=self.storage)
        else:
            self.records = FileRecords(self.store, self.storage, loop, config.watcher)
            state_path = os.path.join(self.store.root, STATE_DB)
            self.predlog = PredictionLog(os.path.join(self.store.root, PREDLOG_DB),
                                         enabled=pcfg.log, max_rows=pcfg.max_rows,
                                         feedback_rows=config.feedback.max_rows,
                                         example_rows=config.feedback.max_example_rows,
                                         health=self.storage)
        self.db = StateDB(state_path, health=self.storage)  # jobs, history
        # the parts of the control plane, each given what it uses; the applies
        # and the rollouts, and the policies and the jobs, call each other:
        # the one built first is given a function of the other
        self.metrics = metrics.build(config, self.events)  # Prometheus (control/metrics.py)
        self.router = Router(serving, config, loop, lambda: self.rollouts.check_probations())
        self.keeper = keeper = RecordKeeper(ctl, loop, self.records)  # persist, then switch
        self.policies = Policies(config.policies or {}, self.store.root, serving,
                                 self.predlog, self.db,
                                 lambda *a, **kw: self.applies.apply(*a, **kw),
                                 lambda *a, **kw: self.jobs.submit(*a, **kw),
                                 lambda name, spec: self.jobs.reusable(name, spec))
        self.rollouts = RolloutControl(ctl, config, loop, self.store, pool, self.events,
                                       self.golden, self.provision, self.router, keeper,
                                       lambda *a, **kw: self.applies.apply(*a, **kw),
                                       self.policies.gate_set)
        self.applies = Applies(ctl, config, loop, self.store, pool, self.events,
                               self.records, keeper, self.provision, self.router, self.rollouts)
        self.healer = Healer(ctl, config, loop, self.store, pool, self.events,
                             self.provision, self.applies, self.rollouts, keeper)
        self.quality = Quality(config.drift, self.store, self.predlog, serving, loop)
        self.jobs = JobManager(config, self.store, serving, self.db, pool, self.policies,
                               self.predlog, self.applies.apply, queue)
        self.statusview = StatusView(serving, self.store, pool, self.db, self.storage,
                                     keeper, self.jobs, self.records, self.predlog)
        self.events.subscribe(self.statusview.to_history)
        self.metrics.attach(metrics.Sources(serving, pool, self.storage, self.jobs, self.quality))
        self._sweeper = PeriodicCallback(self.healer.sweep, 1000)
        self.retention = Retention(self.predlog, config.predictions,  # max_age_days
                                   policies=self.policies)
        # what the predict pipeline routes through (frontend/pipeline.py Serving);
        # the other routes get the parts themselves (frontend/app.py)
        self.predict = self.router.predict
        self.serving_names, self.serving_model = serving.serving_names, serving.serving_model

    # -- start and stop -----------------------------------------------------------
    async def start(self) -> None:
        self.store.ensure(wipe_tmp=self.records.wipe_tmp)
        self.pool.ensure(nice=False)  # first worker: full speed
        try:
            record = await self.records.load()  # cluster: Redis, else this node's cache
        except StoreError as exc:
            log.error("%s; starting without a model", exc)
            record = None
        if record:
            self.ctl.start_from(record)  # checked when read
        self.records.start(record, self.applies.on_record_change)
        self._sweeper.start()
        self.retention.start()
        if record and record["models"]:
            for name, entry in record["models"].items():
                self.loop.spawn_callback(
                    self.applies.apply_logged, name, entry["version"], "startup",
                    replicas=entry["replicas"], explicit=entry["explicit"])
        elif not self.store.names() and self.cfg.training.demo_on_empty_store:
            self.loop.spawn_callback(self._train_demo)
        else:
            log.info("no applied model yet: /readyz answers 503 until one is applied")

    async def _train_demo(self) -> None:
        """First start on an empty store: train and apply the bundled demo."""
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEMO_DATA)
        if not await self.records.claim_demo():
            log.info("cluster: the first-start demo is trained once, by another node")
            return
        self.ctl.set_demo_training(True)
        try:
            job = await self.jobs.submit(DEMO_NAME, {"path": path}, DEMO_PARAMS, True,
                                         trusted_path=True)
        except Exception as exc:
            self.ctl.set_demo_training(False)
            log.error("could not start the demo training: %s", exc)
            return
        log.info("empty model store: training the bundled demo model (job %s); "
                 "/predict answers once it is applied", job.id)

    async def shutdown(self) -> None:
        if self.serving.stopping:
            await self.stopped.wait()
            return
        self.ctl.stop()
        self.pool.stop_starting()
        log.info("shutting down")
        self._sweeper.stop()
        self.retention.stop()
        self.records.stop()
        await self.jobs.shutdown()
        await self.records.close()
        timeout = self.wcfg.stop_timeout
        serving = [w for s in self.serving.slots.values() for w in s.replicas]
        for w in serving:
            w.set_state(State.DRAINING)
        await gen.multi([w.wait_idle(min(self.wcfg.drain_timeout, 5.0)) for w in serving])
        await gen.multi([w.stop(timeout) for w in list(self.pool.workers.values())])
        self.ctl.clear_routing()
        self.db.close()  # commits the pending job and history writes
        self.predlog.close()  # and the queued predictions and feedback
        self.storage.close()
        self.stopped.set()
        log.info("all workers stopped")


# -- entry point ---------------------------------------------------------------------
EXIT_GRACE_S = 10.0  # from the end of the shutdown to the process's exit, at most


def bound_exit(code: int, after: float = EXIT_GRACE_S) -> None:
    """The exit after a shutdown is bounded: a thread that never ends (a call
    blocked in an executor thread, which the interpreter joins at exit) must
    not keep a stopped service alive past its grace period (Kubernetes'
    terminationGracePeriodSeconds, a test's stop). After `after` seconds the
    threads' stacks go to stderr, as an error to fix, and the process exits
    with `code`. The timer is a daemon thread: a normal exit ends it."""
    def fire() -> None:
        threading.Event().wait(after)
        log.error("the process had not exited %.0f s after its shutdown: every "
                  "thread's stack follows; exiting now", after)
        faulthandler.dump_traceback(all_threads=True)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=fire, name="exit-bound", daemon=True).start()


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
    logformat.setup(config.log_level, config.log_format)
    if config.cluster.redis_url:  # nodes share the store: it must be writable
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

    # uvloop (where it imports) or asyncio's loop, before the IOLoop wraps one
    loop_kind = eventloop.install(config.server.event_loop)
    loop = IOLoop.current()
    try:
        sup = Supervisor(config, keys)
    except ConfigError as exc:  # e.g. a bad retrain policy in config
        print(f"config error: {exc}", file=sys.stderr)
        return 2
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
        s = config.server
        http = "httptools" if any(type(x).__name__ == "WireServer" for x in servers) else "tornado"
        log.info("inference API on http://%s:%d, management API on http://%s:%d "
                 "(event loop: %s, inference HTTP: %s)", s.host, s.port, s.manage_host,
                 s.manage_port, loop_kind, http)
        if keys is not None:  # one-time code: the page trades it for a session
            # an any-address bind is shown as localhost (no bind here)
            anywhere = ("0.0.0.0", "::", "")  # nosec B104 # names compared, nothing bound
            host = s.manage_host if s.manage_host not in anywhere else "localhost"
            host = f"[{host}]" if ":" in host else host
            # once, at WARNING (seen at every log level); the code works once,
            # within auth.code_minutes: `textswap dashboard` makes a new one
            log.warning("dashboard (the link logs you in once, within %g minutes): "
                        "http://%s:%d/#code=%s", config.auth.code_minutes,
                        host, s.manage_port, keys.new_code())

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
    bound_exit(exit_code)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
