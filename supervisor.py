"""textswap supervisor: entry point, and the one owner of workers and jobs.

    python supervisor.py --config config.yaml

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

import psutil
from tornado import gen
from tornado.ioloop import IOLoop, PeriodicCallback
from tornado.locks import Condition, Event, Lock

from config import Config, ConfigError, load_config
from errors import ApplyFailed, NoModel, Overloaded, ServiceError
from jobs import JobManager
from statedb import FILENAME as STATE_DB, StateDB
from store import InvalidArtifact, ModelStore, NotFound, StoreError, check_name
from watcher import RecordWatcher
from workerhandle import (RequestFailed, RequestTimedOut, State, WorkerDied, WorkerError,
                          WorkerHandle)

log = logging.getLogger("textswap.supervisor")

DEMO_DATA = "data/demo/sentiment_zh.jsonl"
DEMO_PARAMS: dict[str, Any] = {}  # the measured defaults


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.wcfg = config["worker"]
        self.store = ModelStore(config.models_dir)
        self.loop = IOLoop.current()
        self.serving: WorkerHandle | None = None
        self.standby: WorkerHandle | None = None
        self.workers: dict[int, WorkerHandle] = {}  # every live process, by generation
        self.apply_lock = Lock()
        self._changed = Condition()  # serving worker swapped or capacity freed
        self._waiters = 0
        self.started = time.time()
        self.stopping = False
        self.stopped = Event()
        self.restarts = 0
        self.exits: collections.deque = collections.deque(maxlen=20)
        self._crashes: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.failed_models: dict[str, dict[str, Any]] = {}
        self.last_good: tuple[str, int] | None = None  # served before the current one
        self.last_apply: dict[str, Any] | None = None
        self._recovering = False
        self._applying = 0  # applies queued or running
        self._standby_failures = 0
        self._bad_guesses: set[tuple[str, int]] = set()
        self.watcher: RecordWatcher | None = None
        self.state = StateDB(os.path.join(self.store.root, STATE_DB))  # jobs, history
        self.jobs = JobManager(self, self.state)
        self._sweeper = PeriodicCallback(self._sweep, 1000)

    # -- start and stop -----------------------------------------------------------
    async def start(self) -> None:
        self.store.ensure()
        self.ensure_standby(nice=False)  # first worker: full speed
        try:
            record = self.store.read_record()
        except StoreError as exc:
            log.error("%s; starting without a model", exc)
            record = None
        if self.cfg["watcher"]["enabled"]:
            self.watcher = RecordWatcher(self.store, self.loop, self.cfg["watcher"]["interval"],
                                         self._on_record_change)
            self.watcher.start((record["name"], record.get("version")) if record else None)
        self._sweeper.start()
        if record:
            self.loop.spawn_callback(self._apply_logged, record["name"], record.get("version"),
                                     "startup")
        elif not self.store.names() and self.cfg["training"]["demo_on_empty_store"]:
            self.loop.spawn_callback(self._train_demo)
        else:
            log.info("no applied model yet: /readyz answers 503 until one is applied")

    async def _train_demo(self) -> None:
        """First start on an empty store: train and apply the bundled demo."""
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEMO_DATA)
        try:
            job = await self.jobs.submit("demo", {"path": path}, DEMO_PARAMS, True,
                                         trusted_path=True)
        except Exception as exc:
            log.error("could not start the demo training: %s", exc)
            return
        log.info("empty model store: training the bundled demo model (job %s); "
                 "/predict answers once it is applied", job.id)

    async def shutdown(self) -> None:
        if self.stopping:
            await self.stopped.wait()
            return
        self.stopping = True
        log.info("shutting down")
        self._sweeper.stop()
        if self.watcher:
            self.watcher.stop()
        await self.jobs.shutdown()
        timeout = self.wcfg["stop_timeout"]
        handles = list(self.workers.values())
        for w in handles:
            if w is self.serving:
                w.set_state(State.DRAINING)
                await w.wait_idle(min(self.wcfg["drain_timeout"], 5.0))
        await gen.multi([w.stop(timeout) for w in handles])
        self.serving = self.standby = None
        self.state.close()  # commits the pending job and history writes
        self.stopped.set()
        log.info("all workers stopped")

    # -- workers --------------------------------------------------------------------
    def _options(self, nice: bool) -> dict[str, Any]:
        w = self.wcfg
        return {"max_batch": w["max_batch"], "batch_wait_ms": w["batch_wait_ms"],
                "intra_op_threads": w["intra_op_threads"],
                "inter_op_threads": w["inter_op_threads"],
                "boot_nice": 10 if nice else 0, "log_level": self.cfg["log_level"],
                "parent_pid": os.getpid()}

    def _spawn(self, nice: bool = False) -> WorkerHandle:
        w = WorkerHandle(self._options(nice), self._on_worker_exit, on_answer=self._on_answer)
        self.workers[w.generation] = w
        return w

    def ensure_standby(self, nice: bool = True, delay: float = 0.0) -> None:
        """Keep one TensorFlow-ready process waiting, so an apply only loads."""
        if not self.wcfg["standby"] or self.stopping:
            return
        if self.standby is not None and self.standby.alive:
            return
        if any(w.state is State.STARTING for w in self.workers.values()):
            return  # one TensorFlow import at a time; the next swap asks again
        if delay:
            self.loop.call_later(delay, self.ensure_standby, nice)
            return
        self.standby = self._spawn(nice=nice)
        self.loop.spawn_callback(self._preload, self.standby)

    # -- preloading a guess into the standby ---------------------------------------
    def _preload_guess(self) -> tuple[str, int] | None:
        """The model most likely applied next: a newer version of the serving
        model (just trained), else the one served before it (a rollback)."""
        if self.serving is None or self.serving.model is None:
            return None
        name, version = self.serving.model["name"], self.serving.model["version"]
        try:
            newer = [v for v in self.store.versions(name) if v > version]
        except StoreError:
            newer = []
        guess = (name, newer[-1]) if newer else self.last_good
        if guess is None or guess == (name, version) or guess in self._bad_guesses:
            return None
        return guess

    async def _preload(self, w: WorkerHandle) -> None:
        """Load the guess into the standby in the background, at its low priority,
        so applying it is only the swap. Any other apply reloads the standby."""
        if not self.wcfg["preload"]:
            return
        try:
            await w.booted
        except WorkerDied:
            return
        guess = self._preload_guess()
        if (w is not self.standby or self.stopping or guess is None or w.loads >= 2
                or w.state not in (State.STANDBY, State.READY)
                or (w.model and (w.model["name"], w.model["version"]) == guess)):
            return
        try:
            version, path = self.store.resolve(*guess)
            self.store.check_artifact(*guess)
        except StoreError:
            self._bad_guesses.add(guess)
            return
        log.info("standby gen %d preloads %s v%s", w.generation, guess[0], version)
        try:
            await w.load(path, guess[0], version, preload=True)
        except WorkerError:
            self._bad_guesses.add(guess)  # it exits; the standby is replaced

    def refresh_preload(self) -> None:
        """A model was published: the standby may want a fresher guess."""
        if self.standby is not None and self.standby.alive:
            self.loop.spawn_callback(self._preload, self.standby)

    async def _booted_worker(self, name: str, version: int) -> tuple[WorkerHandle, bool]:
        """A worker that has imported TensorFlow (the standby, else a new one),
        and whether it already holds (name, version)."""
        w = self.standby if self.standby is not None and self.standby.alive else None
        self.standby = None
        if w is None:
            w = self._spawn()
        deadline = self.loop.time() + self.wcfg["boot_timeout"]
        try:
            await gen.with_timeout(deadline, w.booted, quiet_exceptions=(WorkerDied,))
            if w.state is State.LOADING:  # a preload is under way: let it finish
                try:
                    await gen.with_timeout(deadline, w.ready,
                                           quiet_exceptions=(WorkerDied, RequestFailed))
                except (WorkerDied, RequestFailed):  # the guess was bad: a fresh one
                    w = self._spawn()
                    await gen.with_timeout(deadline, w.booted, quiet_exceptions=(WorkerDied,))
        except (gen.TimeoutError, WorkerDied) as exc:
            w.kill()
            raise ApplyFailed(f"worker process did not start: {exc or 'timeout'}",
                              status=503, code="worker_boot_failed") from exc
        self._standby_failures = 0
        return w, w.state is State.READY and w.model == {"name": name, "version": version}

    def _on_answer(self) -> None:
        if self._waiters:
            self._changed.notify(1)

    def _on_worker_exit(self, w: WorkerHandle) -> None:
        self.workers.pop(w.generation, None)
        self.exits.append({"generation": w.generation, "pid": w.pid, "exitcode": w.exitcode,
                           "state": w.state.value, "model": w.model, "error": w.error,
                           "at": time.time()})
        if self.stopping:
            return
        if w is self.standby:
            self.standby = None
            self._standby_failures += 1
            self.ensure_standby(delay=min(30.0, 0.5 * 2 ** self._standby_failures))
        else:
            self.ensure_standby(delay=1.0)  # e.g. a boot that an apply was waiting on failed
        if w is self.serving:
            self.serving = None
            self.restarts += 1
            log.error("serving worker gen %d (%s) died: exit code %s", w.generation,
                      w.model_label, w.exitcode)
            self._recovering = True  # set now: requests arriving meanwhile must wait
            self._changed.notify_all()
            self.loop.spawn_callback(self._recover, w)

    async def _recover(self, dead: WorkerHandle) -> None:
        """Restart the model of a dead serving worker, or give up on it.

        Every crash (and every failed restart) of a model counts; more than
        max_restarts within restart_window marks the model FAILED and the
        last good model, if any, is applied instead.
        """
        assert dead.model is not None
        key = (dead.model["name"], dead.model["version"])
        window = self.wcfg["restart_window"]
        crashes = self._crashes[key]
        try:
            while not self.stopping and self.serving is None:
                now = time.monotonic()
                crashes.append(now)
                while crashes and now - crashes[0] > window:
                    crashes.popleft()
                if len(crashes) > self.wcfg["max_restarts"]:
                    self._mark_failed(key, f"worker crashed {len(crashes)} times within "
                                           f"{window:.0f}s (last: exit code {dead.exitcode}, "
                                           f"{dead.error})")
                    fallback = self.last_good
                    if fallback and fallback != key:
                        log.info("falling back to last good model %s v%s", *fallback)
                        await self._apply_logged(*fallback, "fallback", persist=True)
                    return
                backoff = 0.0 if len(crashes) <= 1 else min(5.0, 0.25 * 2 ** (len(crashes) - 2))
                if backoff:
                    await gen.sleep(backoff)
                try:
                    await self.apply(*key, source="restart", persist=False)
                    return
                except (ServiceError, StoreError) as exc:
                    log.error("restart of %s v%s failed: %s", *key, exc)
                    if isinstance(exc, StoreError):  # gone from the store: nothing to restart
                        self._mark_failed(key, f"cannot restart: {exc}")
                        return
        finally:
            self._recovering = False
            self._changed.notify_all()

    def _mark_failed(self, key: tuple[str, int], reason: str) -> None:
        log.error("model %s v%s marked FAILED: %s", *key, reason)
        self.failed_models[f"{key[0]} v{key[1]}"] = {
            "name": key[0], "version": key[1], "reason": reason, "at": time.time()}

    def _sweep(self) -> None:
        """Once a second: fail requests past their deadline, kill hung workers."""
        limit = self.wcfg["hang_timeout"]
        for w in list(self.workers.values()):
            w.expire(self.wcfg["request_timeout"])
            if w.state in (State.SERVING, State.DRAINING) and w.oldest_request_age() > limit:
                log.error("worker gen %d has not answered for %.0fs: killing it as hung",
                          w.generation, limit)
                w.error = f"hung: no answer for {limit:.0f}s"
                w.kill()

    # -- apply --------------------------------------------------------------------
    def _on_record_change(self, name: str, version: int | None) -> None:
        self.loop.spawn_callback(self._apply_logged, name, version, "watcher", False)

    async def _apply_logged(self, name: str, version: int | None, source: str,
                            persist: bool = False) -> None:
        try:
            await self.apply(name, version, source=source, persist=persist)
        except ServiceError as exc:
            log.error("apply of %s v%s (%s) failed: %s", name, version, source, exc)
        except StoreError as exc:
            log.error("apply of %s v%s (%s) ignored: %s", name, version, source, exc)

    async def apply(self, name: str, version: int | None = None, *, source: str = "api",
                    persist: bool = True) -> dict[str, Any]:
        """Blue/green swap to (name, version); see rule 3 of ARCHITECTURE.md."""
        check_name(name)
        self.store.resolve(name, version)  # fail fast: 404 before queueing
        t_call = time.monotonic()
        self._applying += 1
        try:
            async with self.apply_lock:
                return await self._apply_locked(name, version, source, persist, t_call)
        finally:
            self._applying -= 1
            self._changed.notify_all()

    async def _apply_locked(self, name: str, version: int | None, source: str, persist: bool,
                            t_call: float) -> dict[str, Any]:
        if self.stopping:
            raise ServiceError("service is shutting down", 503, "stopping")
        version, path = self.store.resolve(name, version)
        if source == "restart" and self.serving is not None:
            return {"previous": None, "current": self.serving.model, "unchanged": True}
        try:
            self.store.check_artifact(name, version)
        except InvalidArtifact as exc:
            raise ServiceError(f"{exc}; still serving "
                               f"{self.serving.model_label if self.serving else 'nothing'}",
                               422, "invalid_model") from None
        if source == "api":  # an operator's explicit choice gets a fresh start
            self._crashes.pop((name, version), None)
            self.failed_models.pop(f"{name} v{version}", None)
        phases: dict[str, float] = {"queued": time.monotonic() - t_call}
        old = self.serving
        previous = dict(old.model) if old and old.model else None
        if old is not None and old.model == {"name": name, "version": version} and (
                source in ("watcher", "restart", "startup")):
            return {"previous": previous, "current": previous, "unchanged": True}
        t = time.monotonic()
        w, preloaded = await self._booted_worker(name, version)
        phases["spawn"] = time.monotonic() - t
        t = time.monotonic()
        try:
            if preloaded:
                ready = w.ready.result()
            else:
                ready = await gen.with_timeout(self.loop.time() + self.wcfg["load_timeout"],
                                               w.load(path, name, version),
                                               quiet_exceptions=(WorkerDied, RequestFailed))
        except (gen.TimeoutError, WorkerError) as exc:
            why = str(exc) or "load deadline passed"
            status = None
            if isinstance(exc, gen.TimeoutError):
                why = f"model did not load and warm up within {self.wcfg['load_timeout']}s"
                status = 504
            w.error = why
            self.loop.spawn_callback(w.stop, 1.0)
            self.ensure_standby(delay=1.0)
            raise ApplyFailed(f"{name} v{version} failed to load: {why}; "
                              f"{'still serving ' + old.model_label if old else 'nothing serves'}",
                              status=status) from exc
        phases["load"] = time.monotonic() - t
        t = time.monotonic()
        # the swap: one assignment moves routing
        w.set_state(State.SERVING)
        self.serving = w
        w.send({"t": "serve"})  # leaves the standby's low priority
        self._changed.notify_all()
        if previous and (previous["name"], previous["version"]) != (name, version):
            self.last_good = (previous["name"], previous["version"])
        if persist:
            if self.watcher:
                self.watcher.note_applied(name, version)
            self.store.write_record(name, version)
        phases["swap"] = time.monotonic() - t
        log.info("now serving %s v%s (worker gen %d, pid %d; %s)", name, version,
                 w.generation, w.pid, source)
        self.ensure_standby(delay=2.0)
        t = time.monotonic()
        drained = True
        if old is not None and old.alive:
            old.set_state(State.DRAINING)
            drained = await old.wait_idle(self.wcfg["drain_timeout"])
        phases["drain"] = time.monotonic() - t
        t = time.monotonic()
        stopped = await old.stop(self.wcfg["stop_timeout"]) if old is not None else None
        phases["stop"] = time.monotonic() - t
        result = {
            "previous": previous,
            "current": {"name": name, "version": version},
            "worker": {"generation": w.generation, "pid": w.pid},
            "phases_s": {k: round(v, 4) for k, v in phases.items()},
            "preloaded": preloaded,
            "load_s": round(ready.get("load_s", 0.0), 4),
            "warmup_s": round(ready.get("warm_s", 0.0), 4),
            "old_worker": None if old is None else {
                "generation": old.generation, "pid": old.pid, "drained": drained,
                "ended": stopped},
            "source": source,
            "total_s": round(time.monotonic() - t_call, 4),
        }
        self.last_apply = result
        return result

    # -- predict --------------------------------------------------------------------
    async def _route(self, deadline: float) -> WorkerHandle:
        """The serving worker, once it has room for one more request."""
        cap = self.wcfg["max_inflight"]
        while True:
            w = self.serving
            if w is not None and w.usable:
                if w.inflight < cap:
                    return w
            elif w is None and not self._recovering and not self._applying:
                raise NoModel("no model is serving; apply one with POST /apply")
            # else: its process is going away; the exit callback starts recovery
            self._waiters += 1
            try:
                woke = await self._changed.wait(timeout=deadline)
            finally:
                self._waiters -= 1
            if not woke:
                if w is None or not w.usable:
                    raise NoModel("no model became available in time")
                raise Overloaded(f"worker is at its limit of {cap} requests in flight; "
                                 "retry later")

    async def predict(self, texts: list[str]) -> tuple[dict[str, Any], list[str], list]:
        """(model, labels, scores) for texts; one retry if the worker dies."""
        deadline = self.loop.time() + self.wcfg["request_timeout"]
        for attempt in (1, 2):
            w = await self._route(deadline)
            try:
                return w.model, w.labels, await w.predict(texts)  # type: ignore[return-value]
            except WorkerDied:
                if attempt == 2:
                    raise ServiceError("the model worker died twice on this request", 503,
                                       "worker_died")
            except RequestFailed as exc:
                raise ServiceError(f"model failed on this request: {exc}", 500,
                                   exc.code) from exc
            except RequestTimedOut as exc:
                raise ServiceError(str(exc), 504, "timeout") from None
        raise AssertionError("unreachable")

    # -- status -----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.serving is not None

    def status(self) -> dict[str, Any]:
        me = psutil.Process()
        workers = [w.describe() for w in sorted(self.workers.values(),
                                               key=lambda w: w.generation)]
        return {
            "supervisor": {"pid": os.getpid(), "uptime_s": round(time.time() - self.started, 3),
                           "rss_bytes": me.memory_info().rss,
                           "models_dir": self.store.root, "stopping": self.stopping},
            "serving": None if self.serving is None else {
                **(self.serving.model or {}), "generation": self.serving.generation,
                "pid": self.serving.pid, "labels": self.serving.labels},
            "workers": workers,
            "draining": [w["generation"] for w in workers if w["state"] == "DRAINING"],
            "standby": None if self.standby is None else self.standby.describe(),
            "restarts": self.restarts,
            "recent_exits": list(self.exits),
            "failed_models": list(self.failed_models.values()),
            "last_apply": self.last_apply,
            "jobs": self.jobs.list(),
        }


# -- entry point ---------------------------------------------------------------------
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
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    server = {k: v for k, v in (("host", args.host), ("port", args.port),
                                ("manage_host", args.manage_host),
                                ("manage_port", args.manage_port)) if v is not None}
    overrides: dict[str, Any] = {"server": server} if server else {}
    if args.models_dir:
        overrides["models_dir"] = args.models_dir
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = build_config(args)
    except (ConfigError, OSError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config["log_level"],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from frontend.app import start_servers  # Tornado apps; no TensorFlow anywhere

    loop = IOLoop.current()
    sup = Supervisor(config)
    exit_code = 0

    def on_signal(signum: int, frame: Any) -> None:
        loop.add_callback_from_signal(stop)

    servers: list = []

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

    # Long-lived startup objects out of the collector's way, and fewer young
    # collections: the request path allocates many short-lived objects.
    gc.freeze()
    gc.set_threshold(20000, 20, 20)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    loop.add_callback(boot)
    loop.start()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
