"""The zygote: workers forked from one process that imported TensorFlow once.

Real processes and real TensorFlow, with the tiny models of tinymodels.py.
The first tests drive control.zygote_client.Zygote and WorkerHandle on an IOLoop in
this process (which becomes a child subreaper for that, as the supervisor
does); the last ones run the real service. This process never imports
TensorFlow: the zygote does.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import time
from typing import Any, Awaitable, Callable

import psutil
import pytest

from tests.helpers import Service, pid_gone, wait_for

from control import zygote_client as zmod
from control.workerhandle import State, WorkerHandle

pytestmark = pytest.mark.skipif(not zmod.supported(), reason="needs Linux pidfds (5.3+)")

TEXTS = ["a wonderful, moving film", "dull and far too long", "今天下雨"]
BOOT = 240.0  # a cold TensorFlow import on a busy 2-core machine
STEP = 120.0  # a fork, a load, a prediction, an exit: generous on a shared machine
# what TensorFlow's C++ logging writes (glog/absl style lines and its import notices)
TF_CPP_LOG = re.compile(r"^[IWEF]\d{4} |tensorflow/core/|cpu_feature_guard|"
                        r"oneDNN custom operations|absl::InitializeLog", re.M)


PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _subreaper() -> int:
    import ctypes
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    flag = ctypes.c_int(0)
    assert libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0
    return flag.value


def _helper(p: psutil.Process) -> bool:
    """multiprocess's resource tracker: a helper of this process that it keeps
    (started with the first zygote), not a leftover of a test."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" in " ".join(
            p.cmdline())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def undo_subreaper():
    """_run makes this process a child subreaper (as the supervisor is). After
    each test: back to the flag it had, and every child the test left (an
    orphaned grandchild re-parented here, alive or a zombie) killed and reaped,
    so later tests' pid_gone waits see no zombies of ours."""
    import ctypes
    before = _subreaper()
    kids = {p.pid for p in psutil.Process().children()}
    yield
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, before, 0, 0, 0) == 0
    left = [p for p in psutil.Process().children() if p.pid not in kids and not _helper(p)]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    for p in left:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if os.waitpid(p.pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # reaped already
                break
            time.sleep(0.02)
    assert _subreaper() == before
    assert all(pid_gone(p.pid) for p in left), [p.pid for p in left]


def _options(**kw: Any) -> dict[str, Any]:
    return {"max_batch": 256, "batch_wait_ms": 0.0, "intra_op_threads": 1,
            "inter_op_threads": 1, "boot_nice": 0, "log_level": "INFO",
            "parent_pid": os.getpid(), **kw}


def _same(a: list[list[float]], b: list[list[float]]) -> bool:
    """Equal scores (to rounding) for the same texts."""
    return len(a) == len(b) and all(
        x == pytest.approx(y, abs=1e-5) for x, y in zip(a, b, strict=True))


async def _within(aw: Awaitable[Any], timeout: float = STEP) -> Any:
    return await asyncio.wait_for(asyncio.ensure_future(aw), timeout)


async def _until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll pred() on the loop until truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _run(test: Callable[[zmod.Zygote, list[WorkerHandle]], Awaitable[Any]],
         log_level: str = "INFO") -> Any:
    """Run test(zygote, workers) on a fresh IOLoop; every worker it adds to
    `workers` and the zygote are gone afterwards."""
    async def main() -> Any:
        assert zmod.become_subreaper()
        z = zmod.Zygote({"log_level": log_level, "parent_pid": os.getpid()})
        workers: list[WorkerHandle] = []
        try:
            return await test(z, workers)
        finally:
            for w in workers:
                w.kill(signal.SIGKILL)
            for w in workers:
                await _within(w.exited, 30)
            z.close()
            if z.process is not None:
                await _until(lambda: not z.process.is_alive(), 30, "the zygote to stop")
    return asyncio.run(main())


async def _worker(z: zmod.Zygote, workers: list[WorkerHandle], timeout: float = STEP,
                  **kw: Any) -> WorkerHandle:
    w = WorkerHandle(_options(**kw), lambda w: None, zygote=z)
    workers.append(w)
    await _within(w.booted, timeout)
    return w


async def _serve(w: WorkerHandle, store: str, name: str, version: int = 1) -> list[list[float]]:
    await _within(w.load(os.path.join(store, name, str(version)), name, version))
    return await _within(w.predict(TEXTS))


@pytest.mark.timeout(900)  # above its BOOT and STEP waits together
def test_worker_forked_after_many_others_predicts_correctly(tiny_store):
    async def test(z: zmod.Zygote, workers: list[WorkerHandle]) -> None:
        first = await _worker(z, workers, BOOT)
        expect = {"sent": await _serve(first, tiny_store, "sent"),
                  "topic": None}
        # a zygote fit to fork: one thread, TensorFlow's context never created
        assert z.threads == 1, z.describe()
        # many forks, loads and exits, some beside each other, some after
        alive: list[WorkerHandle] = []
        for i in range(12):
            w = await _worker(z, workers)
            name = "sent" if i % 2 else "topic"
            scores = await _serve(w, tiny_store, name)
            if expect[name] is None:
                expect[name] = scores
            assert _same(scores, expect[name]), (i, name)
            assert psutil.Process(w.pid).ppid() == os.getpid()  # ours, not the zygote's
            alive.append(w)
            if len(alive) > 3:  # bounded memory on a small machine
                old = alive.pop(0)
                assert await _within(old.stop(10)) == "stopped"
                assert old.exitcode == 0
        last = await _worker(z, workers)
        assert _same(await _serve(last, tiny_store, "sent"), expect["sent"])
        assert _same(await _serve(first, tiny_store, "topic"), expect["topic"])
        assert z.forks >= 14 and z.starts == 1
        labels = last.labels
        assert len(labels) == len(expect["sent"][0])
    _run(test)


@pytest.mark.timeout(900)  # above its BOOT and STEP waits together
def test_a_lean_plan_is_served_without_tensorflow(feature_models, tmp_path):
    """A version with a lean plan (model_worker/lean.py) is answered from it:
    the ready frame says so, the scores are the Keras engine's for the same
    version (worker.engine: keras), and the worker runs no TensorFlow: none
    of its threads is one of the pools TensorFlow's context starts ("tf_..."),
    which the Keras worker has. An explanation still comes:
    the first one loads the Keras model. A damaged plan is passed over for
    model.keras."""
    def thread_names(pid: int) -> list[str]:
        names = []
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/comm", encoding="utf-8") as fh:
                names.append(fh.read().strip())
        return names

    async def test(z: zmod.Zygote, workers: list[WorkerHandle]) -> None:
        path = os.path.join(feature_models, "lin", "1")
        assert os.path.isfile(os.path.join(path, "lean.npz"))
        lean_w = await _worker(z, workers, BOOT)
        keras_w = await _worker(z, workers, engine="keras")
        ready = [await _within(w.load(path, "lin", 1)) for w in (lean_w, keras_w)]
        assert [r["engine"] for r in ready] == ["lean", "keras"]
        texts = ["the striker scored a late goal", "new phone chip", "", "Café -- ΟΔΟΣ 很好!"]
        for _ in range(3):
            got = await _within(lean_w.predict(texts))
            want = await _within(keras_w.predict(texts))
            assert _same(got, want)
        tf_threads = [n for n in thread_names(keras_w.pid) if n.startswith("tf_")]
        assert tf_threads, thread_names(keras_w.pid)  # TensorFlow's pools ("tf_Compute", ...)
        assert not [n for n in thread_names(lean_w.pid) if n.startswith("tf_")], thread_names(lean_w.pid)
        explained = await _within(lean_w.predict(texts[:1], {"x": 3}))
        assert _same(explained["scores"], got[:1]) and explained["explain"][0]["features"]
        # a plan that cannot be read: logged, and model.keras serves
        damaged = os.path.join(str(tmp_path), "lin", "1")
        shutil.copytree(path, damaged)
        with open(os.path.join(damaged, "lean.npz"), "wb") as fh:
            fh.write(b"PK\x03\x04 not a zip archive")
        fresh = await _worker(z, workers)
        assert (await _within(fresh.load(damaged, "lin", 1)))["engine"] == "keras"
        assert _same(await _within(fresh.predict(texts)), want)
    _run(test)


def test_kill9_of_a_forked_worker_is_seen_with_its_exit_status(tiny_store):
    async def test(z: zmod.Zygote, workers: list[WorkerHandle]) -> None:
        w = await _worker(z, workers, BOOT)
        await _serve(w, tiny_store, "sent")
        pid = w.pid
        os.kill(pid, signal.SIGKILL)  # from outside, as an operator or the OOM killer
        assert await _within(w.exited) == -signal.SIGKILL
        assert w.state is State.FAILED
        assert pid_gone(pid)  # reaped by us: no zombie left

        # a model that fails to load: the worker's own exit code 4
        bad = await _worker(z, workers)
        with pytest.raises(Exception):
            await _within(bad.load(os.path.join(tiny_store, "corrupt", "1"), "corrupt", 1))
        assert await _within(bad.exited) == 4

        # a clean stop: 0
        ok = await _worker(z, workers)
        assert await _within(ok.stop(10)) == "stopped" and ok.exitcode == 0

        # killed while it is still being forked: no process is left behind
        early = WorkerHandle(_options(), lambda w: None, zygote=z)
        workers.append(early)
        early.kill(signal.SIGKILL)
        assert await _within(early.exited) == -signal.SIGKILL
        assert early.pid == 0 or pid_gone(early.pid)
    _run(test)


@pytest.mark.timeout(900)  # above its BOOT and STEP waits together
def test_zygote_killed_is_restarted_and_running_workers_keep_serving(tiny_store):
    async def test(z: zmod.Zygote, workers: list[WorkerHandle]) -> None:
        w = await _worker(z, workers, BOOT)
        before = await _serve(w, tiny_store, "sent")
        old = z.pid
        os.kill(old, signal.SIGKILL)
        # a launch asked while it is dead or booting waits for the new one
        await _until(lambda: z.pid != old, STEP, "the zygote to be restarted")
        queued = WorkerHandle(_options(), lambda w: None, zygote=z)
        workers.append(queued)
        for _ in range(20):  # the running worker answers all along
            assert _same(await _within(w.predict(TEXTS)), before)
        assert psutil.Process(w.pid).ppid() == os.getpid()
        await _within(queued.booted, BOOT)
        assert z.ready and z.starts == 2
        assert _same(await _serve(queued, tiny_store, "sent"), before)
        assert w.alive and w.state is State.READY
    _run(test)


def test_tensorflow_cpp_logs_are_moved_to_the_debug_log(tiny_store, capfd, caplog, monkeypatch):
    """TensorFlow's C++ lines (oneDNN's notice, absl's pre-init line) reach no
    stderr at the default level, in a forked and in a spawned worker; they are
    in the supervisor's debug log (test_childlog.py: other lines still reach stderr).

    oneDNN's notice only shows by default on CPUs with AVX512-VNNI or AMX:
    TF_ENABLE_ONEDNN_OPTS=1 forces it, so there is a line to silence on any CPU."""
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
    caplog.set_level(logging.DEBUG, logger="textswap.tensorflow")

    async def test(z: zmod.Zygote, workers: list[WorkerHandle]) -> None:
        forked = await _worker(z, workers, BOOT, log_level=z.options["log_level"])
        spawned = WorkerHandle(_options(log_level=z.options["log_level"]), lambda w: None)
        workers.append(spawned)
        await _within(spawned.booted, BOOT)
        for w in (forked, spawned):
            await _serve(w, tiny_store, "sent")  # the worker's TensorFlow context too
            assert await _within(w.stop(10)) == "stopped"

    for level in ("INFO", "DEBUG"):
        caplog.clear()
        _run(test, log_level=level)
        err = capfd.readouterr().err
        assert not TF_CPP_LOG.search(err), (level, TF_CPP_LOG.search(err))
        moved = [r.getMessage() for r in caplog.records if r.name == "textswap.tensorflow"]
        assert any("oneDNN custom operations" in m for m in moved), (level, moved)
        assert all(r.levelno == logging.DEBUG for r in caplog.records
                   if r.name == "textswap.tensorflow")


def _zygote_pid(svc: Service) -> int:
    """The service's child that is neither a worker, multiprocess's tracker nor
    the prediction log's writer."""
    workers = {w["pid"] for w in svc.status()["workers"]}
    for p in psutil.Process(svc.proc.pid).children():
        try:
            cmd = " ".join(p.cmdline())
            if p.pid not in workers and "resource_tracker" not in cmd and "predlog_writer" not in cmd:
                return p.pid
        except psutil.NoSuchProcess:
            continue
    return 0


@pytest.mark.timeout(900)  # above its BOOT and STEP waits together
def test_service_zygote_restart_and_parent_death(store_copy):
    # TensorFlow's oneDNN notice forced on (as on CPUs with AVX512-VNNI or AMX)
    svc = Service(store_copy, env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    killed = False
    try:
        assert svc.mpost("/apply", {"name": "topic"}, timeout=BOOT)[0] == 200
        wpid = svc.serving()["pid"]
        zpid = wait_for(lambda: _zygote_pid(svc), STEP, "the zygote")
        assert psutil.Process(wpid).ppid() == svc.proc.pid
        os.kill(zpid, signal.SIGKILL)
        wait_for(lambda: _zygote_pid(svc) not in (0, zpid), STEP, "a new zygote")
        code, body = svc.predict({"text": "今天下雨"})
        assert code == 200 and svc.serving()["pid"] == wpid  # the same worker serves
        # a worker forked from the new zygote serves another model
        assert svc.mpost("/apply", {"name": "sent", "default": False}, timeout=BOOT)[0] == 200
        code, body = svc.predict({"text": "fine", "model": "sent"})
        assert code == 200, body
        # the service log holds no TensorFlow C++ line from the zygote or a worker
        assert not TF_CPP_LOG.search(svc.log()), TF_CPP_LOG.search(svc.log())
        zpid2 = _zygote_pid(svc)
        pids = [w["pid"] for w in svc.status()["workers"]] + [zpid2]
        # the supervisor dies: every worker and the zygote go with it
        svc.proc.send_signal(signal.SIGKILL)
        svc.proc.wait(30)
        killed = True
        for pid in pids:
            wait_for(lambda: pid_gone(pid) or psutil.Process(pid).status() == "zombie",
                     60, f"process {pid} to die with the supervisor")
    finally:
        svc.stop(signal.SIGKILL if killed else signal.SIGTERM)


def test_a_worker_gives_freed_heap_pages_back():
    """model_worker.worker.release_free_memory (called after a load and when
    idle after a large call): pages that glibc keeps after free() (here 64 MB
    of small blocks, held in by one block above them, as a load's copies
    are) leave the process's USS. A fresh interpreter: the test's own heap is
    not touched."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = r"""
import ctypes, json, psutil
from model_worker import worker
assert worker._TRIM is not None, "no malloc_trim: not glibc"
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
uss = lambda: psutil.Process().memory_full_info().uss / 2**20
blocks = [libc.malloc(1024) for _ in range(65536)]
for b in blocks:
    ctypes.memset(b, 1, 1024)
top = libc.malloc(1024)  # keeps the freed blocks below the heap's top
for b in blocks:
    libc.free(b)
before = uss()
took = worker.release_free_memory()
print(json.dumps({"before": before, "after": uss(), "took": took}))
"""
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["before"] - got["after"] > 32, got   # most of the 64 MB went back


def test_a_worker_fixes_mallocs_thresholds_before_its_load():
    """model_worker.worker.fix_malloc_thresholds (worker.main's first step):
    a block of 8 MB comes from the heap (not a fresh mapping, faulted in
    and zeroed, as the batches' scratch arrays were), the heap keeps it
    after free(), and release_free_memory gives it back. Without the call
    (the baseline, so the test can fail), a fresh interpreter maps such a
    block and unmaps it at free(). Each in a fresh interpreter: the first
    freed mapping would move glibc's own thresholds."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = r"""
import ctypes, json, sys
from model_worker import worker
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
out = {"fixed": worker.fix_malloc_thresholds() if sys.argv[1] == "fix" else None}
b = libc.malloc(8 << 20)
ctypes.memset(b, 1, 8 << 20)
out["mapped"] = libc.mallinfo2().hblkhd
libc.free(b)
out["free_in_heap"] = libc.mallinfo2().fordblks
worker.release_free_memory()
out["trimmed"] = libc.mallinfo2().fordblks
print(json.dumps(out))
"""
    root = Path(__file__).resolve().parent.parent
    got = {}
    for how in ("default", "fix"):
        res = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=60,
                             cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)})
        assert res.returncode == 0, res.stderr[-2000:]
        got[how] = json.loads(res.stdout.strip().splitlines()[-1])
    mb = 1 << 20
    assert got["default"]["mapped"] >= 8 * mb and got["default"]["free_in_heap"] < 8 * mb, got
    assert got["fix"]["fixed"] is True
    assert got["fix"]["mapped"] < 8 * mb and got["fix"]["free_in_heap"] >= 8 * mb, got
    assert got["fix"]["trimmed"] < 8 * mb, got
