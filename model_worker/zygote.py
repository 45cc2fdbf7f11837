"""The zygote: imports TensorFlow, Keras and the worker and trainer code once,
runs no TensorFlow op, and forks every worker and trainer.

    supervisor --spawn--> zygote (TF imported, 1 thread, no TF context)
        │  fork request {kind, options, env} + SCM_RIGHTS(socket end)
        ▼
    zygote --fork--> intermediate --fork--> worker   (intermediate exits at once)
                                              │
    the worker is re-parented to the supervisor (a child subreaper): the
    supervisor reaps it and reads its exit code itself, its parent-death
    signal refers to the supervisor, and the zygote may die without taking
    any worker with it.

Why fork is safe here: the zygote never creates TensorFlow's eager context
(no thread pools, no session, no device) and runs with one thread (BLAS and
OpenMP helper threads are held at one while it imports, so none exist at a
fork); each child creates its own context, so it is a fresh process with its
own graph that shares the imported code and data copy-on-write. `gc.freeze()`
keeps the collector from writing to the shared objects' pages.

Channel (SOCK_SEQPACKET, one datagram per message, `protocol` framing):
supervisor -> zygote: {t: fork, id, kind: worker|trainer, options, env,
supervisor_pid} with the child's socket end as SCM_RIGHTS; {t: stop}.
zygote -> supervisor: {t: booted, pid, import_s, threads}, {t: forked, id, pid},
{t: error, id, message}. Exit codes: 0 (EOF or stop), 3 the imports failed.
"""
from __future__ import annotations

import array
import gc
import logging
import os
import select
import socket
import struct
import sys
import time
import traceback
from typing import Any

from model_worker import protocol

EXIT_OK = 0
EXIT_BOOT = 3

# helper thread pools of native libraries that start at library load: held at
# one while the zygote imports, restored per child with threadpoolctl
_POOL_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_MAX_MSG = 1 << 20

log = logging.getLogger("textswap.zygote")


def tf_context_started() -> bool:
    """True once TensorFlow's eager context (thread pools, devices) exists."""
    from tensorflow.python.eager import context

    ctx = context.context_safe()
    return ctx is not None and ctx._context_handle is not None


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One datagram and the fds that came with it; (None, []) at EOF."""
    fds = array.array("i")
    data, anc, _flags, _addr = sock.recvmsg(_MAX_MSG, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    msgs = list(protocol.FrameDecoder().feed(data))
    return (msgs[0] if msgs else {}), list(fds)


def _reply(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.send(protocol.encode(msg))


# -- the child ---------------------------------------------------------------------

def _restore_thread_pools(env: dict[str, str]) -> None:
    """Give the child the BLAS/OpenMP threads its environment asks for (the
    zygote imported them at one; the env var alone is read only at load)."""
    want = next((env[v] for v in _POOL_VARS if env.get(v)), None)
    try:
        n = max(1, int(want)) if want else (os.cpu_count() or 1)
    except ValueError:
        n = os.cpu_count() or 1
    if n == 1:
        return
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(n)
    except Exception as exc:  # only a speed matter
        log.debug("thread pools stay at one: %s", exc)


# fds the zygote got from its own start (its channel, multiprocess's sentinel
# pipe and tracker): a child must not hold them, or the supervisor would not
# see the zygote's exit. Set by main().
_OWN_FDS: list[int] = []


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)  # the listing's own directory fd is closed again by now
    except OSError:
        return False
    return True


def _close_own_fds() -> None:
    for fd in _OWN_FDS:
        try:
            os.close(fd)
        except OSError:
            pass


def _run_child(msg: dict[str, Any], fd: int, tf_level: str, intermediate: int) -> None:
    """The worker or trainer, forked. Never returns."""
    code = EXIT_BOOT
    try:
        # 1. wait until the intermediate has exited: then this process is the
        #    supervisor's child (the kernel re-parents before it signals the pidfd)
        poller = select.poll()
        poller.register(intermediate, select.POLLIN)
        poller.poll()
        os.close(intermediate)
        from model_worker.worker import die_with_parent

        sup = int(msg["supervisor_pid"])
        if os.getppid() != sup:
            os._exit(EXIT_OK)  # the supervisor is gone (or is not our reaper)
        # 2. the parent-death signal, now meaning the supervisor's death
        die_with_parent(sup)
        # 3. the environment the supervisor has now, as a spawned child would get it
        env = dict(msg.get("env") or {})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", tf_level)
        os.environ.clear()
        os.environ.update(env)
        _restore_thread_pools(env)
        sock = socket.socket(fileno=fd)
        logging.root.handlers.clear()  # the child's basicConfig names it, not the zygote
        if msg["kind"] == "trainer":
            from model_worker.trainer import main as target
        else:
            from model_worker.worker import main as target  # type: ignore[assignment]  # its 2nd parameter is "options"
        target(sock, msg["options"])  # ends with os._exit
        code = EXIT_OK
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    try:
        sys.stderr.flush()
    finally:
        os._exit(code)


def _intermediate(sock: socket.socket, msg: dict[str, Any], fd: int, w: int,
                  tf_level: str) -> None:
    """Forks the child and exits, so that the child is re-parented to the
    supervisor. Never returns."""
    try:
        _close_own_fds()  # its channel and sentinel stay the zygote's
        me = os.pidfd_open(os.getpid())
        child = os.fork()
        if child == 0:
            os.close(w)
            _run_child(msg, fd, tf_level, me)
        os.write(w, struct.pack("=i", child))
    finally:
        os._exit(0)


def fork_child(sock: socket.socket, msg: dict[str, Any], fds: list[int], tf_level: str) -> None:
    rid = msg.get("id")
    if len(fds) != 1 or msg.get("kind") not in ("worker", "trainer"):
        for fd in fds:
            os.close(fd)
        _reply(sock, {"t": "error", "id": rid, "message": "a fork needs a kind and one socket"})
        return
    fd = fds[0]
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        for x in (r, w, fd):
            os.close(x)
        _reply(sock, {"t": "error", "id": rid, "message": f"fork failed: {exc}"})
        return
    if pid == 0:
        os.close(r)
        _intermediate(sock, msg, fd, w, tf_level)
    os.close(w)
    os.close(fd)
    data = b""
    while len(data) < 4:
        chunk = os.read(r, 4 - len(data))
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    if len(data) == 4:
        _reply(sock, {"t": "forked", "id": rid, "pid": struct.unpack("=i", data)[0]})
    else:
        _reply(sock, {"t": "error", "id": rid, "message": "the intermediate process failed"})


# -- the zygote --------------------------------------------------------------------

def main(sock: socket.socket, options: dict[str, Any],
         stderr: socket.socket | None = None) -> None:
    """Process entry point (spawned by the supervisor's WorkerPool). `stderr`:
    the supervisor's relay (control/childlog.py), fd 2 here and in every child."""
    from model_worker.worker import adopt_stderr, die_with_parent, quiet_tensorflow, tf_log_level

    adopt_stderr(stderr)

    _OWN_FDS[:] = [fd for fd in map(int, os.listdir("/proc/self/fd")) if fd > 2 and _is_open(fd)]
    level = options.get("log_level", "INFO")
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s [zygote %(process)d] %(message)s")
    die_with_parent(options.get("parent_pid"))
    quiet_tensorflow(level)
    tf_level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", tf_log_level(level))
    saved = {v: os.environ.get(v) for v in _POOL_VARS}
    for v in _POOL_VARS:
        os.environ[v] = "1"
    t0 = time.monotonic()
    try:
        import keras  # noqa: F401
        import numpy  # noqa: F401
        import tensorflow  # noqa: F401
        import threadpoolctl  # noqa: F401

        # the worker's and the trainer's code, and what they import lazily
        from model_worker import autoselect, lean, textmodel, trainer, worker  # noqa: F401
        from state import store  # noqa: F401

        # the lean engine's compiled patterns and tables, shared by every worker
        lean.text_ops()

        worker.quiet_absl(level)
        if tf_context_started():
            raise RuntimeError("TensorFlow's context was created during the imports")
    except Exception as exc:
        log.error("zygote imports failed: %s", exc)
        os._exit(EXIT_BOOT)
    for v, value in saved.items():
        if value is None:
            os.environ.pop(v, None)
        else:
            os.environ[v] = value
    import_s = time.monotonic() - t0
    gc.collect()
    gc.freeze()  # the collector would write to every shared object's page
    threads = thread_count()
    if threads != 1:
        log.warning("zygote has %d threads before forking", threads)
    try:
        _reply(sock, {"t": "booted", "pid": os.getpid(), "import_s": import_s,
                      "threads": threads})
        while True:
            msg, fds = recv(sock)
            if msg is None or msg.get("t") == "stop":
                break
            if msg.get("t") == "fork":
                fork_child(sock, msg, fds, tf_level)
            else:
                for fd in fds:
                    os.close(fd)
                _reply(sock, {"t": "error", "id": msg.get("id"),
                              "message": f"unknown message {msg.get('t')!r}"})
    except (BrokenPipeError, ConnectionResetError):
        pass  # the supervisor went away
    sys.stderr.flush()
    os._exit(EXIT_OK)
