"""The supervisor's side of the zygote (model_worker/zygote.py): starts it,
asks it to fork workers and trainers, restarts it when it dies.

A launch hands the zygote one end of the child's socketpair (SCM_RIGHTS over
a SOCK_SEQPACKET pair) and gets the new pid back. The child is re-parented
to this process, which is made a child subreaper for that (PR_SET_CHILD_SUBREAPER):
the supervisor then watches each child through a pidfd and reaps it with
waitid(P_PIDFD), so a kill -9 is seen at once with its real exit status,
and a dead zygote takes no worker with it. Launches asked while the zygote
boots (its TensorFlow import, seconds) wait for it; launches it never
confirmed fail when it dies, queued ones go to its successor. After
`MAX_BOOT_FAILURES` boots in a row that end before `booted`, queued launches
fail with exit code 3 (like a spawned worker whose TensorFlow import failed)
until a later launch tries again. Imports no TensorFlow.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, TypedDict, cast

import multiprocess
from tornado.ioloop import IOLoop

from control.childlog import StderrRelay
from model_worker import protocol

log = logging.getLogger("textswap.zygote")


class ZygoteFrame(TypedDict, total=False):
    """A frame the zygote sends: booted (import_s, threads), forked (id,
    pid), failed (id, message)."""
    t: str
    import_s: float
    threads: int
    id: int
    pid: int
    message: str

_spawn = multiprocess.get_context("spawn")
_PR_SET_CHILD_SUBREAPER = 36
EXIT_BOOT = 3
MAX_BOOT_FAILURES = 3

OnForked = Callable[[int], None]
OnFailed = Callable[[int | None, str], None]


def supported() -> bool:
    """Linux with pidfds (5.3+) and the Python calls for them."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open") \
            or not hasattr(os, "P_PIDFD"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def become_subreaper() -> bool:
    """Orphaned descendants (every forked child) are re-parented here."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Launch:
    """One fork asked of the zygote."""

    def __init__(self, rid: int, kind: str, child: socket.socket, options: dict[str, object],
                 on_forked: OnForked, on_failed: OnFailed) -> None:
        self.id, self.kind, self.child, self.options = rid, kind, child, options
        self.on_forked, self.on_failed = on_forked, on_failed
        self.env = dict(os.environ)  # what a child spawned now would inherit
        self.asked = time.monotonic()

    def close(self) -> None:
        try:
            self.child.close()
        except OSError:
            pass


class Zygote:
    def __init__(self, options: dict[str, object]) -> None:
        self.options = options  # log_level, parent_pid
        self.loop = IOLoop.current()
        self.state = "stopped"  # stopped | booting | ready | closed
        self.process: Any = None
        self.pid: int | None = None
        self.sock: socket.socket | None = None
        self.starts = 0
        self.boot_failures = 0
        self.import_s: float | None = None
        self.threads: int | None = None
        self.forks = 0
        self._ids = itertools.count(1)
        self._queued: list[Launch] = []
        self._sent: dict[int, Launch] = {}
        self._restart_at: float | None = None

    # -- the process -----------------------------------------------------------------
    def start(self) -> None:
        if self.state in ("booting", "ready", "closed"):
            return
        from model_worker.zygote import main as target

        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # its stderr, and every forked child's, is read by the supervisor
        relay = StderrRelay("tensorflow")
        self.process = _spawn.Process(target=target, args=(child, self.options, relay.child_end),
                                      daemon=True, name="textswap-zygote")
        try:
            self.process.start()
        finally:
            relay.started()
        child.close()
        parent.setblocking(False)
        self.sock, self.pid, self.state = parent, self.process.pid, "booting"
        self.starts += 1
        self._restart_at = None
        self.loop.add_handler(parent.fileno(), self._on_readable, IOLoop.READ)
        self.loop.add_handler(self.process.sentinel, self._on_exit, IOLoop.READ)
        log.info("zygote started, pid %d", self.pid)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def close(self) -> None:
        """Stop it for good (the service stops); running children are not touched."""
        if self.state == "closed":
            return
        was = self.state
        self.state = "closed"
        for launch in self._queued + list(self._sent.values()):
            self._fail(launch, None, "the service is stopping")
        self._queued, self._sent = [], {}
        if was in ("booting", "ready") and self.process is not None:
            try:
                self.sock.send(protocol.encode({"t": "stop"}))  # type: ignore[union-attr]  # started: sock is set
            except OSError:
                pass
            try:
                os.kill(self.process.pid, signal.SIGKILL if was == "booting" else signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.state in ("booting", "ready"):
            try:
                os.kill(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def describe(self) -> dict[str, object]:
        return {"state": self.state, "pid": self.pid, "starts": self.starts,
                "forks": self.forks, "import_s": self.import_s, "threads": self.threads,
                "queued": len(self._queued) + len(self._sent)}

    # -- launches --------------------------------------------------------------------
    def launch(self, kind: str, child: socket.socket, options: dict[str, object],
               on_forked: OnForked, on_failed: OnFailed) -> Launch:
        """Ask for a fork; exactly one callback runs later, on the IOLoop. The
        zygote owns `child` from here on (closed once forked or failed)."""
        launch = Launch(next(self._ids), kind, child, options, on_forked, on_failed)
        if self.state == "closed":
            self.loop.add_callback(self._fail, launch, None, "the service is stopping")
        elif self.state == "ready":
            self._send(launch)
        else:
            self._queued.append(launch)
            if self.state == "stopped" and self._restart_at is None:
                self.start()
        return launch

    def cancel(self, launch: Launch) -> bool:
        """Drop a launch not sent yet; False when the zygote may be forking it."""
        if launch in self._queued:
            self._queued.remove(launch)
            launch.close()
            return True
        return False

    def _send(self, launch: Launch) -> None:
        msg = {"t": "fork", "id": launch.id, "kind": launch.kind, "options": launch.options,
               "env": launch.env, "supervisor_pid": os.getpid()}
        try:
            self.sock.sendmsg([protocol.encode(msg)],  # type: ignore[union-attr]  # started: sock is set
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                bytes(memoryview(_fd_array(launch.child.fileno()))))])
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:  # this request, not the channel
                self._fail(launch, EXIT_BOOT, f"fork request too large: {exc}")
                return
            # a full or broken channel: it is dying or stuck; its exit retries
            log.warning("zygote: fork request %d not sent (%s)", launch.id, exc)
            self._queued.append(launch)
            self.kill()
            return
        self._sent[launch.id] = launch

    def _on_readable(self, fd: int, events: int) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)  # type: ignore[union-attr]  # started: sock is set
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.loop.remove_handler(fd)
                return  # the sentinel reports the exit
            for msg in protocol.FrameDecoder().feed(data):
                self._on_message(cast(ZygoteFrame, msg))

    def _on_message(self, msg: ZygoteFrame) -> None:
        kind = msg.get("t")
        if kind == "booted":
            self.state, self.boot_failures = "ready", 0
            self.import_s, self.threads = msg.get("import_s"), msg.get("threads")
            log.info("zygote pid %d booted in %.1f s (%s thread%s)", self.pid,
                     self.import_s or 0.0, self.threads, "" if self.threads == 1 else "s")
            queued, self._queued = self._queued, []
            for launch in queued:
                self._send(launch)
            return
        launch = self._sent.pop(msg.get("id"), None)  # type: ignore[arg-type]  # no id: None
        if launch is None:
            log.warning("zygote answered unknown request %r", msg.get("id"))
        elif kind == "forked":
            launch.close()
            self.forks += 1
            log.debug("zygote forked %s pid %d in %.0f ms", launch.kind, msg["pid"],
                      (time.monotonic() - launch.asked) * 1000)
            launch.on_forked(int(msg["pid"]))
        else:
            self._fail(launch, EXIT_BOOT, f"zygote: {msg.get('message')}")

    def _fail(self, launch: Launch, code: int | None, why: str) -> None:
        launch.close()
        launch.on_failed(code, why)

    def _on_exit(self, fd: int, events: int) -> None:
        self.loop.remove_handler(fd)
        try:
            self.loop.remove_handler(self.sock.fileno())  # type: ignore[union-attr]  # started: sock is set
        except (KeyError, ValueError, OSError):
            pass
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        self.sock.close()  # type: ignore[union-attr]  # started: sock is set
        booted = self.state == "ready"
        if self.state == "closed":
            log.info("zygote pid %s stopped (code %s)", self.pid, code)
            return
        log.error("zygote pid %s exited with code %s%s; restarting it", self.pid, code,
                  "" if booted else " before it booted")
        self.state = "stopped"
        # a fork it never confirmed may have happened: a retry on the same
        # socket could give it two processes, so those fail (and are replaced)
        sent, self._sent = list(self._sent.values()), {}
        for launch in sent:
            self._fail(launch, EXIT_BOOT, "the zygote died during the fork")
        if booted:
            self.start()  # the running children are unaffected
            return
        self.boot_failures += 1
        if self.boot_failures >= MAX_BOOT_FAILURES:
            queued, self._queued = self._queued, []
            for launch in queued:
                self._fail(launch, EXIT_BOOT, f"the zygote failed to boot (exit code {code})")
            self.boot_failures = 0
            return  # the next launch starts it again
        delay = min(30.0, 0.5 * 2 ** self.boot_failures)
        self._restart_at = self.loop.time() + delay
        self.loop.call_later(delay, self._restart)

    def _restart(self) -> None:
        self._restart_at = None
        if self.state == "stopped":
            self.start()


def _fd_array(fd: int) -> Any:
    import array

    return array.array("i", [fd])
