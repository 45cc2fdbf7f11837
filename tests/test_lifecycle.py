"""Process-level guarantees: no TensorFlow in the supervisor, clean shutdown,
restart serves the last applied model, start time and memory."""
from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from tests.helpers import ROOT, Service, pid_gone, wait_for


def test_supervisor_and_frontend_never_import_tensorflow():
    code = ("import sys, supervisor, frontend.app, frontend.handlers, state.store, control.watcher, "
            "control.workerhandle, state.config, cluster.node, cluster.job_queue; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras')]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_restart_serves_last_applied_and_shutdown_is_clean(store_copy):
    svc = Service(store_copy)  # waits (with a deadline) for /healthz
    try:
        sup = psutil.Process(svc.proc.pid)
        # the running supervisor has no TensorFlow library mapped
        maps = open(f"/proc/{svc.proc.pid}/maps").read()
        assert "libtensorflow" not in maps
        # behavioural bounds, not speed claims: the supervisor holds about 40 MB
        # (a TensorFlow import alone adds over 300 MB); a serving worker holds
        # about 700 MB. How fast it answers /healthz: bench/serving.py
        rss_mb = sup.memory_info().rss / 2**20
        assert rss_mb < 200, f"supervisor RSS {rss_mb:.0f} MB"
        assert svc.mpost("/apply", {"name": "topic"})[0] == 200
        wpid = svc.serving()["pid"]
        worker_rss = psutil.Process(wpid).memory_info().rss / 2**20
        assert 100 < worker_rss < 3 * 1024, f"worker RSS {worker_rss:.0f} MB"
        assert rss_mb < worker_rss / 3, (rss_mb, worker_rss)
        kids = [p.pid for p in svc.children()]
        assert wpid in kids
    finally:
        code = svc.stop(signal.SIGTERM)
    assert code == 0
    for pid in kids:
        wait_for(lambda: pid_gone(pid), 10, f"child {pid} to be gone")
    assert "all workers stopped" in svc.log()

    # a fresh start serves topic v1 again without any call
    svc2 = Service(store_copy)
    try:
        wait_for(lambda: svc2.get("/readyz")[0] == 200, 90, "restart to serve the model")
        code, body = svc2.predict({"text": "今天下雨"})
        assert code == 200 and body["model"] == {"name": "topic", "version": 1}
    finally:
        assert svc2.stop(signal.SIGINT) == 0  # Ctrl-C is a clean stop too
    assert not svc2.leftover


def test_cli_help_documents_overrides():
    res = subprocess.run([sys.executable, "supervisor.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0
    for flag in ("--config", "--host", "--port", "--manage-host", "--manage-port",
                 "--models-dir"):
        assert flag in res.stdout


def test_bad_config_is_reported(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("worker:\n  max_bacth: 3\n")
    res = subprocess.run([sys.executable, "supervisor.py", "--config", str(cfg)], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "worker.max_bacth" in res.stderr


def test_the_exit_after_a_shutdown_is_bounded_and_names_the_stuck_thread():
    """supervisor.bound_exit: a thread that never ends (the interpreter joins
    non-daemon threads at exit) cannot keep a stopped service alive; the
    stacks go to stderr and the process exits with the shutdown's code."""
    code = ("import threading, supervisor\n"
            "threading.Thread(target=threading.Event().wait, name='stuck').start()\n"
            "supervisor.bound_exit(3, after=1.0)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3, p.stderr[-2000:]
    assert "had not exited" in p.stderr and "_shutdown" in p.stderr, p.stderr[-2000:]
