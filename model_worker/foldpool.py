"""Cross-validation folds fitted at once, one process each (auto's search).

`auto` fits a learner once per fold (model_worker/autoselect.py,
Search.run). The folds do not depend on each other, so with `processes`
above 1 that many are fitted at once, each in a child forked for it, which
inherits the fold's matrices (copy-on-write), fits, and sends back only
what the search keeps: the held-out rows' decision values (rows x labels,
as .npy bytes through a pipe: no pickles).
A child that ends starts the next fold's; the search reads the results in
fold order and may stop early (racing, the budget), which kills the rest.

Processes, not threads: liblinear (LinearSVC, and so NB-SVM) draws its
coordinate order from one generator per process, so two fits in threads
interleave their draws and their models differ from run to run in the
last digits. A child has its own generator, seeded as a sequential fit
seeds it: the same fold gives the same numbers whatever the process
count, and the search stays reproducible (autoselect's docstring).

A child dies with its parent (PR_SET_PDEATHSIG: a trainer killed mid-search
leaves no fit running), inherits the trainer's idle priority and its
one-thread BLAS, and never touches TensorFlow.

How many: training.threads (config.yaml; the trainer calls set_processes),
1 where the platform has no fork.
"""
from __future__ import annotations

import io
import os
import select
import signal
from typing import Callable, Iterable, Iterator

import numpy as np

_processes = 1


def set_processes(n: int) -> None:
    """Folds fitted at once from now on in this process (0: one per CPU)."""
    global _processes
    _processes = max(1, int(n) if n else (os.cpu_count() or 1))


def processes() -> int:
    return _processes if hasattr(os, "fork") else 1


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _fork(job: Callable[[], np.ndarray], parent: int) -> tuple[int, int]:
    """(pid, read end of its pipe) of a child running `job`: it sends the
    array as .npy bytes (or the job's exception as text) and exits without
    running anything of the parent's."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:
        status = 0
        try:
            os.close(r)
            _die_with_parent(parent)
            buf = io.BytesIO()
            np.save(buf, np.asarray(job(), dtype=np.float64), allow_pickle=False)
            payload = b"A" + buf.getvalue()
        except BaseException as exc:  # noqa: BLE001: reported to the parent
            status = 1
            payload = b"E" + f"a fold's fit failed in its process: {exc!r}".encode("utf-8", "replace")
        try:
            with os.fdopen(w, "wb") as out:
                out.write(payload)
        finally:
            os._exit(status)
    os.close(w)
    return pid, r


def _result(data: bytes) -> object:
    """A child's message: "A" and an .npy array (no pickles), or "E" and
    what went wrong."""
    if not data:
        return RuntimeError("a fold's process ended without a result")
    if data[:1] == b"E":
        return RuntimeError(data[1:].decode("utf-8", "replace"))
    try:
        if data[:1] != b"A":
            raise ValueError("not a result")
        return np.load(io.BytesIO(data[1:]), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001: a truncated result
        return RuntimeError(f"a fold's result could not be read: {exc!r}")


def ordered(jobs: Iterable[Callable[[], np.ndarray]]) -> Iterator[np.ndarray]:
    """Each job's array, in the jobs' order, as soon as it and those before
    it are done. With processes() 1, each job runs here when its result is
    asked for. Above 1, each runs in a child forked for it, that many at
    once: a job is taken from `jobs` (and so built) just before its child
    is forked, and a child that ends starts the next. A job's exception is
    raised here when its turn comes (a child's as a RuntimeError naming
    it). Closing the iterator early (the caller stops: racing, the budget)
    kills the children still running; every child is reaped. A fold whose
    process cannot be forked (memory, limits) runs here instead."""
    n = processes()
    if n <= 1:
        for one in jobs:
            yield one()
        return
    parent = os.getpid()
    pending = iter(jobs)
    running: dict[int, tuple[int, int, bytearray]] = {}  # index -> pid, pipe, bytes so far
    done: dict[int, object] = {}
    started = given = 0
    more = True
    try:
        while True:
            while more and len(running) < n:
                following = next(pending, None)
                if following is None:
                    more = False
                    break
                try:
                    pid, fd = _fork(following, parent)
                except OSError:  # no process to be had (memory, limits): this fold here
                    done[started] = following()
                else:
                    running[started] = (pid, fd, bytearray())
                started += 1
            if given in done:
                res = done.pop(given)
                given += 1
                if isinstance(res, BaseException):
                    raise res
                yield res  # type: ignore[misc]  # an array: errors were raised
                continue
            if not running:
                return
            by_fd = {fd: i for i, (_, fd, _) in running.items()}
            for fd in select.select(list(by_fd), [], [])[0]:
                i = by_fd[fd]
                pid, _, data = running[i]
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    data.extend(chunk)
                    continue
                os.close(fd)
                os.waitpid(pid, 0)
                del running[i]
                done[i] = _result(bytes(data))
    finally:
        for pid, fd, _ in running.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(fd)
            os.waitpid(pid, 0)
