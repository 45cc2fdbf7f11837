"""The supervisor's side of one worker process: start, frames, futures, exit.

A WorkerHandle lives on the IOLoop. It owns the process object and one end
of a socketpair (a bidirectional pipe; the child holds the other end). Reads
are non-blocking through a Tornado IOStream, decoded incrementally, and each
answer resolves the future of its request id. The process's exit is watched
through a pidfd (a child forked from the zygote) or its sentinel fd (a
spawned one), so a kill -9 is noticed at once, not at the next request.
Imports no TensorFlow: the zygote or the spawned child does that.
"""
from __future__ import annotations

import enum
import itertools
import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, TypedDict, cast

import multiprocess
import psutil
from tornado import gen
from tornado.concurrent import Future
from tornado.ioloop import IOLoop
from tornado.iostream import IOStream, StreamClosedError

from control.childlog import StderrRelay
from model_worker import protocol

if TYPE_CHECKING:
    from control.slots import Slot
    from control.zygote_client import Launch, Zygote


class LoadedModel(TypedDict):
    """The model a worker has (or is loading)."""
    name: str
    version: int


class Frame(TypedDict, total=False):
    """A frame a worker or trainer sends (model_worker/protocol.py): its type
    `t` and the fields that type carries; a trainer's progress frame carries
    its figures too (read as the frame's items)."""
    t: str
    id: int
    scores: object  # a predict's answer, handed to the request as it came
    bn: int  # a result's model call: texts, seconds
    bs: float
    labels: list[str]
    code: str
    message: str
    load_s: float  # a worker's ready frame
    warm_s: float
    version: int  # a trainer's done frame
    warnings: list[str]
    metrics: dict[str, object]

log = logging.getLogger("textswap.workers")

_spawn = multiprocess.get_context("spawn")


class State(enum.Enum):
    STARTING = "STARTING"  # being forked (or spawned: importing TensorFlow)
    STANDBY = "STANDBY"    # TensorFlow imported, waiting for a model
    LOADING = "LOADING"    # loading + warming up a model
    READY = "READY"        # model answered its warm-up, not routed yet
    SERVING = "SERVING"    # receives predictions
    IDLE = "IDLE"          # probation: loaded, gets no requests, may serve again
    DRAINING = "DRAINING"  # no new requests; finishing in-flight ones
    STOPPED = "STOPPED"    # process exited after being asked to
    FAILED = "FAILED"      # died, failed to load, or was killed


_ALLOWED = {
    State.STARTING: {State.STANDBY},
    State.STANDBY: {State.LOADING, State.STOPPED},
    State.LOADING: {State.READY},
    State.READY: {State.SERVING, State.STOPPED, State.LOADING},  # a standby may reload
    State.SERVING: {State.DRAINING, State.IDLE},
    State.IDLE: {State.SERVING, State.DRAINING, State.STOPPED},
    State.DRAINING: {State.STOPPED},
    State.STOPPED: set(),
    State.FAILED: set(),
}


class WorkerError(Exception):
    """A request could not be answered by this worker."""


class WorkerDied(WorkerError):
    """The process went away with the request in flight (safe to retry)."""


class RequestTimedOut(WorkerError):
    """No answer within the request deadline."""


class RequestFailed(WorkerError):
    """The worker answered with an error frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


_generations = itertools.count(1)


class ChildProcess:
    """A child with a frame connection; the base of workers and jobs.

    Forked from the zygote when one is given (control/zygote_client.py): the pid is
    known a few milliseconds later (0 until then; seconds while the zygote
    boots), and the exit is watched through a pidfd and read with
    waitid(P_PIDFD), since the child is re-parented to this process.
    Otherwise spawned with multiprocess and watched through its sentinel.
    """

    def __init__(self, target: Callable[..., None], options: dict[str, object], kind: str,
                 on_exit: Callable[[Any], None], zygote: "Zygote | None" = None) -> None:
        self.generation = next(_generations)
        self.options = options
        self.kind = kind
        self.on_exit = on_exit
        self.exitcode: int | None = None
        self.error: str | None = None
        self.created = time.time()
        self.exited: Future[int | None] = Future()
        self.forked = zygote is not None
        self.pid: int = 0
        self.process: Any = None
        self._uss: tuple[float, int, int | None] = (0.0, 0, None)  # (read at, pid, bytes)
        self._pidfd: int | None = None
        self._launch: "Launch | None" = None
        self._zygote = zygote
        self._kill_pending: int | None = None
        self._decoder = protocol.FrameDecoder()
        self._out: list[bytes] = []
        self._loop = IOLoop.current()
        parent, child = socket.socketpair()
        self.stream = IOStream(parent, max_write_buffer_size=256 * 1024 * 1024)
        if zygote is not None:
            # frames sent before the fork wait in the socket buffer
            self._launch = zygote.launch(kind, child, options, self._on_forked,
                                         self._on_fork_failed)
        else:
            relay = StderrRelay("tensorflow")  # its stderr, read by the supervisor
            self.process = _spawn.Process(target=target, args=(child, options, relay.child_end),
                                          daemon=True, name=f"textswap-{kind}-{self.generation}")
            try:
                self.process.start()
            finally:
                relay.started()
            child.close()  # the child has its own copy; EOF now means it is gone
            self.pid = self.process.pid
            self._loop.add_handler(self.process.sentinel, self._on_sentinel, IOLoop.READ)
            log.info("%s gen %d spawned, pid %d", kind, self.generation, self.pid)
        self._loop.spawn_callback(self._read_loop)

    # -- a forked child's start and exit -------------------------------------------
    def _on_forked(self, pid: int) -> None:
        self.pid = pid
        self._launch = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError as exc:  # cannot happen for our own unreaped child
            log.error("%s gen %d: no pidfd for pid %d: %s", self.kind, self.generation, pid, exc)
            os.kill(pid, signal.SIGKILL)
            self._finish(None, f"no pidfd: {exc}")
            return
        self._loop.add_handler(self._pidfd, self._on_pidfd, IOLoop.READ)
        log.info("%s gen %d forked, pid %d", self.kind, self.generation, pid)
        if self._kill_pending is not None:
            self.kill(self._kill_pending)

    def _on_fork_failed(self, code: int | None, why: str) -> None:
        self._launch = None
        if self._kill_pending is not None:
            code = -self._kill_pending
        self.error = self.error or why
        log.error("%s gen %d was not started: %s", self.kind, self.generation, why)
        self._finish(code, why)

    def _on_pidfd(self, fd: int, events: int) -> None:
        self._loop.remove_handler(fd)
        self._reap(time.monotonic() + 10.0)

    def _reap(self, deadline: float) -> None:
        """Read the exit status off the pidfd (this reaps it: no zombie)."""
        assert self._pidfd is not None
        try:
            res = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            res = None  # not re-parented to us (yet): only in a fork's first instant
        if res is None and time.monotonic() < deadline:
            self._loop.call_later(0.01, self._reap, deadline)
            return
        os.close(self._pidfd)
        self._pidfd = None
        if res is None:
            code = None
            log.error("%s gen %d (pid %d): exit status unknown", self.kind, self.generation,
                      self.pid)
        elif res.si_code == os.CLD_EXITED:
            code = res.si_status
        else:  # killed or dumped: as multiprocess reports it
            code = -res.si_status
        self._finish(code, None)

    def _finish(self, code: int | None, why: str | None) -> None:
        self.exitcode = code
        self.stream.close()
        self.on_closed()
        self.on_process_exit()
        log.info("%s gen %d (pid %d) exited with code %s", self.kind, self.generation,
                 self.pid, self.exitcode)
        if not self.exited.done():
            self.exited.set_result(self.exitcode)
        self.on_exit(self)

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    @property
    def usable(self) -> bool:
        """Alive and connected: a request sent now can be answered."""
        return not self.exited.done() and not self.stream.closed()

    def send(self, msg: dict[str, object]) -> None:
        """Queue a frame; frames queued in one IOLoop pass go out in one write."""
        if self.stream.closed():
            raise WorkerDied(f"{self.kind} gen {self.generation} is gone")
        self._out.append(protocol.encode(msg))
        if len(self._out) == 1:
            self._loop.add_callback(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.stream.closed():
            try:
                self.stream.write(b"".join(out))
            except StreamClosedError:
                pass  # the exit path fails what was pending

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self.stream.read_bytes(1 << 16, partial=True)
                for msg in self._decoder.feed(data):
                    try:
                        self.on_frame(cast(Frame, msg))
                    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                        # a missing key, a wrong type, an illegal state change:
                        # the child can no longer be trusted; it counts as a crash
                        raise protocol.ProtocolError(
                            f"malformed {msg.get('t')!r} frame: {exc!r}") from exc
        except StreamClosedError:
            if self._decoder.pending:
                log.error("%s gen %d: connection closed inside a frame (%d bytes)",
                          self.kind, self.generation, self._decoder.pending)
        except protocol.ProtocolError as exc:
            log.error("%s gen %d sent a bad frame (%s); killing it", self.kind,
                      self.generation, exc)
            self.error = f"protocol error: {exc}"
            self.kill()
            self.stream.close()  # nothing more goes to or comes from it
        self.on_closed()

    def on_frame(self, msg: Frame) -> None:
        raise NotImplementedError

    def on_closed(self) -> None:
        """The connection ended (the process is gone or going)."""

    def _on_sentinel(self, fd: int, events: int) -> None:
        self._loop.remove_handler(fd)
        self.process.join(timeout=1.0)  # reaps it: no zombie
        self._finish(self.process.exitcode, None)

    def on_process_exit(self) -> None:
        pass

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if not self.alive:
            return
        if not self.pid:  # not forked yet: kill it as soon as it is
            self._kill_pending = sig
            if (self._launch is not None and self._zygote is not None
                    and self._zygote.cancel(self._launch)):
                self._on_fork_failed(-sig, "killed before it was forked")
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    async def stop(self, timeout: float) -> str:
        """Ask to exit, then SIGTERM, then SIGKILL. Returns how it ended."""
        if not self.alive:
            return "exited"
        try:
            self.send({"t": "stop"})
        except WorkerError:
            pass
        for how, sig in (("stopped", None), ("terminated", signal.SIGTERM),
                         ("killed", signal.SIGKILL)):
            if sig is not None:
                self.kill(sig)
            try:
                await gen.with_timeout(self._loop.time() + timeout, self.exited)
                return how
            except gen.TimeoutError:
                continue
        return "unkillable"

    def uss(self, max_age: float = 5.0) -> int | None:
        """Private memory (unique set size), refreshed at most every max_age s:
        reading it walks the process's page maps, too slow for every call."""
        now = time.monotonic()
        at, pid, value = self._uss
        if now - at > max_age or pid != self.pid or value is None:
            # a process not started yet, or one that could not be read, is
            # asked again at the next call: no None kept for max_age seconds
            value = None
            try:
                if self.alive and self.pid:
                    value = psutil.Process(self.pid).memory_full_info().uss
            except psutil.Error:
                pass
            self._uss = (now, self.pid, value)
        return value

    def rss(self) -> int | None:
        try:
            return psutil.Process(self.pid).memory_info().rss if self.alive and self.pid else None
        except psutil.Error:
            return None


class WorkerHandle(ChildProcess):
    # (model, texts, seconds) of each model call a worker reports in its result
    # frames; set once by metrics.py (one supervisor per process), else None
    on_batch: Callable[["LoadedModel | None", int, float], None] | None = None

    def __init__(self, options: dict[str, object], on_exit: Callable[["WorkerHandle"], None],
                 on_answer: Callable[[], None] | None = None, zygote: "Zygote | None" = None) -> None:
        from model_worker.worker import main as target

        self.on_answer = on_answer or (lambda: None)
        self.state = State.STARTING
        self.model: "LoadedModel | None" = None  # {"name", "version"}
        self.labels: list[str] = []
        self.engine = "keras"  # how its model is computed: "lean" or "keras" (its ready frame)
        self.pending: dict[int, tuple[Future[Any], float]] = {}
        self.served = 0
        self.slot: "Slot | None" = None  # the Slot it serves in, once it does
        self.recycle_after = 0.0
        self.loads = 0  # models loaded by this process (a standby may preload a guess)
        self.booted: Future[Any] = Future()
        self.ready: Future[Frame] = Future()
        self._ids = itertools.count(1)
        self._idle_waiters: list[Future[None]] = []
        super().__init__(target, options, "worker", on_exit, zygote)

    # -- state -----------------------------------------------------------------
    def set_state(self, new: State) -> None:
        old = self.state
        if new is not State.FAILED and new not in _ALLOWED[old]:
            raise RuntimeError(f"worker gen {self.generation}: illegal transition "
                               f"{old.value} -> {new.value}")
        if old is new:
            return
        self.state = new
        log.info("worker gen %d (pid %d%s): %s -> %s", self.generation, self.pid,
                 f", {self.model_label}" if self.model else "", old.value, new.value)

    @property
    def model_label(self) -> str:
        return f"{self.model['name']} v{self.model['version']}" if self.model else "-"

    @property
    def inflight(self) -> int:
        return len(self.pending)

    # -- frames ------------------------------------------------------------------
    def on_frame(self, msg: Frame) -> None:
        kind = msg["t"]
        if kind == "result" or (kind == "error" and msg.get("id") is not None):
            if "bs" in msg and self.on_batch is not None:
                self.on_batch(self.model, msg["bn"], msg["bs"])
            entry = self.pending.pop(msg.get("id"), None)  # type: ignore[arg-type]  # no id: None
            if entry is None:
                log.warning("worker gen %d answered unknown id %r", self.generation, msg.get("id"))
                return
            fut = entry[0]
            if not fut.done():
                if kind == "result":
                    self.served += 1
                    fut.set_result(msg["scores"])
                else:
                    fut.set_exception(RequestFailed(msg.get("code", "error"),
                                                    msg.get("message", "")))
            if not self.pending:
                self._wake_idle()
            self.on_answer()
        elif kind == "booted":
            self.set_state(State.STANDBY)
            if not self.booted.done():
                self.booted.set_result(msg)
        elif kind == "ready":
            self.labels = list(msg["labels"])
            self.engine = str(msg.get("engine", "keras"))
            self.set_state(State.READY)
            if not self.ready.done():
                self.ready.set_result(msg)
        elif kind == "error":  # an error about the process itself (e.g. load)
            self.error = f"{msg.get('code')}: {msg.get('message')}"
            if not self.ready.done():
                self.ready.set_exception(RequestFailed(msg.get("code", "error"),
                                                       msg.get("message", "")))
        elif kind == "pong":
            entry = self.pending.pop(msg.get("id"), None)  # type: ignore[arg-type]  # no id: None
            if entry and not entry[0].done():
                entry[0].set_result(None)
        else:
            log.warning("worker gen %d sent unknown frame type %r", self.generation, kind)

    # -- requests ------------------------------------------------------------------
    def predict(self, texts: list[str], options: dict[str, object] | None = None) -> Future[Any]:
        """options: more to ask of the worker in the frame (e.g. {"x": k}: explain)."""
        rid = next(self._ids)
        fut: Future[Any] = Future()
        msg = {"t": "predict", "id": rid, "texts": texts}
        if options:
            msg.update(options)
        self.send(msg)
        self.pending[rid] = (fut, time.monotonic())
        return fut

    def expire(self, timeout: float) -> int:
        """Fail requests older than timeout (the per-request deadline, swept
        once a second instead of a timer per request on the hot path)."""
        now = time.monotonic()
        old = [rid for rid, (_, t) in self.pending.items() if now - t > timeout]
        for rid in old:
            fut, _ = self.pending.pop(rid)
            if not fut.done():
                fut.set_exception(RequestTimedOut(f"no answer within {timeout:.0f}s"))
        if old and not self.pending:
            self._wake_idle()
        return len(old)

    def oldest_request_age(self) -> float:
        if not self.pending:
            return 0.0
        now = time.monotonic()
        return max(now - t for _, t in self.pending.values())

    def load(self, path: str, name: str, version: int, preload: bool = False) -> Future[Frame]:
        """Send a load order; the returned future resolves with the ready frame."""
        if self.ready.done():
            self.ready = Future()
        self.model = {"name": name, "version": version}
        self.loads += 1
        self.set_state(State.LOADING)
        self.send({"t": "load", "path": path, "name": name, "version": version,
                   "preload": preload})
        return self.ready

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight; False when the timeout passed first."""
        if not self.pending:
            return True
        fut: Future[None] = Future()
        self._idle_waiters.append(fut)
        try:
            await gen.with_timeout(self._loop.time() + timeout, fut)
            return True
        except gen.TimeoutError:
            return False

    def _wake_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _fail_pending(self, why: str) -> None:
        pending, self.pending = self.pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(why))
        self._wake_idle()
        for f in (self.booted, self.ready):
            if not f.done():
                f.set_exception(WorkerDied(self.error or why))
                f.exception()  # nobody may be waiting: don't log it as lost

    # -- exit ------------------------------------------------------------------
    def on_closed(self) -> None:
        self._fail_pending(f"worker gen {self.generation} closed its connection")

    def on_process_exit(self) -> None:
        self._fail_pending(f"worker gen {self.generation} exited with {self.exitcode}")
        if self.state not in (State.STOPPED, State.FAILED):
            if self.state in (State.DRAINING, State.STANDBY, State.READY,
                              State.IDLE) and self.exitcode == 0:
                self.set_state(State.STOPPED)
            else:
                self.error = self.error or f"process exited with code {self.exitcode}"
                self.set_state(State.FAILED)

    async def stop(self, timeout: float) -> str:
        if self.alive and self.state is State.STARTING:
            self.kill(signal.SIGKILL)  # still importing TensorFlow: nothing to lose
            await self.exited
            return "killed"
        return await super().stop(timeout)

    def describe(self) -> dict[str, object]:
        return {
            "generation": self.generation,
            "kind": self.kind,
            "pid": self.pid or None,
            "forked": self.forked,
            "state": self.state.value,
            "model": self.model,
            "engine": self.engine if self.model else None,
            "served": self.served,
            "inflight": self.inflight,
            "rss_bytes": self.rss(),
            "uss_bytes": self.uss(),
            "started_at": self.created,
            "exitcode": self.exitcode,
            "error": self.error,
        }
