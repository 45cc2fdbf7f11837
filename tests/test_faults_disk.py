"""When the disk fails: every write path of serving state under real faults.

Real fault injection, no mocks: the model store is a small tmpfs that a
filler file fills up (a real ENOSPC), and the service runs under libfiu's
`fiu-run -x` (Debian fiu-utils), whose POSIX wrappers make fsync or pwrite
fail with EIO/ENOSPC in the supervisor process only, switched on and off
from outside with `fiu-ctrl`. After each fault: serving never stopped, the
operation was refused cleanly (507 insufficient_storage / 503
store_unavailable, nothing changed) or done, the state DB passes
`PRAGMA integrity_check`, writes work again without a restart, and a
restart serves what was last answered 200.

Needs root (mount) and fiu-utils; `.ci/run` installs fiu-utils."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess

import pytest

from tests.helpers import Service, fill_disk, request, small_disk, wait_for
from tests.test_dashboard import ARTIFACTS, Browser, browser

FIU_RUN = shutil.which("fiu-run")
FIU_CTRL = shutil.which("fiu-ctrl")


@pytest.fixture(scope="module")
def disk(tiny_store, tmp_path_factory):
    if FIU_RUN is None or FIU_CTRL is None:
        pytest.skip("fiu-utils (fiu-run, fiu-ctrl) not installed: apt-get install fiu-utils")
    base = tmp_path_factory.mktemp("disk")
    with small_disk(str(base / "mnt"), "16m") as mnt:
        store = os.path.join(mnt, "models")
        shutil.copytree(tiny_store, store)
        yield {"store": store, "mnt": mnt, "base": str(base)}


class Disk:
    """The service under fiu-run on the tmpfs store, restartable."""

    def __init__(self, d: dict) -> None:
        self.d = d
        self.ctl = os.path.join(d["base"], "fiu")
        self.n = 0
        self.svc = self.start()

    def start(self) -> Service:
        self.n += 1
        return Service(self.d["store"], prefix=[FIU_RUN, "-x", "-f", self.ctl],
                       log_path=os.path.join(self.d["base"], f"service-{self.n}.log"),
                       args=["--config", self._config()],
                       env={"TEXTSWAP_PRELOAD_SUPERVISOR_ONLY": "1"})

    def _config(self) -> str:
        path = os.path.join(self.d["base"], "config.yaml")
        with open(path, "w") as fh:  # one worker per model, no standby: less to wait for
            fh.write("worker:\n  standby_pool: 0\nrollout:\n  probation_s: 600\n")
        return path

    def restart(self) -> None:
        assert self.svc.stop() == 0
        self.svc = self.start()

    def fiu(self, command: str) -> None:
        res = subprocess.run([FIU_CTRL, "-f", self.ctl, "-c", command, str(self.svc.proc.pid)],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr

    def serving(self, model: str = "sent") -> int:
        code, got = self.svc.predict({"text": "很好", "model": model})
        assert code == 200, got  # serving never stops
        return got["model"]["version"]

    def fill(self) -> str:
        """Fill the tmpfs to the last byte: a real ENOSPC for every write."""
        return fill_disk(self.d["mnt"])

    def integrity(self) -> str:
        db = os.path.join(self.d["store"], ".state.db")
        conn = sqlite3.connect(db)
        try:
            return conn.execute("PRAGMA integrity_check").fetchone()[0]
        finally:
            conn.close()

    def golden_round_trip(self) -> None:
        """A golden set written and deleted: two durable writes of the store and
        two history rows of the state db (the writes a test makes to see them work)."""
        code, got = self.svc.request_put("/models/sent/golden", {"data": {"examples": [
            {"text": "很好", "label": "pos"}, {"text": "很差", "label": "neg"}] * 2}})
        assert code == 200, got
        assert self.svc.request_delete("/models/sent/golden")[0] == 200

    def serve(self, version: int) -> None:
        """Sent `version` serving: each test starts from the state it names, not
        from what the one before it left (the module's tests run in any order)."""
        code, got = self.svc.mpost("/apply", {"name": "sent", "version": version})
        assert code == 200, got
        assert self.serving() == version

    def record(self) -> dict:
        with open(os.path.join(self.d["store"], ".applied.json")) as fh:
            return json.load(fh)


@pytest.fixture(scope="module")
def svc(disk):
    s = Disk(disk)
    try:
        code, got = s.svc.mpost("/apply", {"name": "sent", "version": 1})
        assert code == 200, got
        yield s
    finally:
        s.svc.stop()


def _refused(code: int, got: dict, status: int, error: str) -> None:
    assert code == status and got["error"]["code"] == error, (code, got)
    assert "nothing changed" in got["error"]["message"], got
    assert got["error"]["path"], got  # says where


def test_full_disk_refuses_every_serving_change_and_a_restart_serves_the_last_200(svc):
    svc.serve(1)
    filler = svc.fill()
    try:
        # the case that answered 500 and had switched: now 507, nothing switched
        code, got = svc.svc.mpost("/apply", {"name": "sent", "version": 2})
        _refused(code, got, 507, "insufficient_storage")
        assert svc.serving() == 1
        assert svc.record()["models"]["sent"]["version"] == 1
        code, got = svc.svc.mpost("/apply", {"name": "topic", "version": 1})
        _refused(code, got, 507, "insufficient_storage")
        assert svc.svc.predict({"text": "x", "model": "topic"})[0] == 404  # not half-applied
        code, got = svc.svc.mpost("/unload", {"name": "sent"})
        _refused(code, got, 507, "insufficient_storage")
        assert svc.serving() == 1
        code, got = svc.svc.request_put("/models/sent/golden", {
            "data": {"examples": [{"text": "很好", "label": "pos"},
                                  {"text": "很差", "label": "neg"}] * 2}})
        _refused(code, got, 507, "insufficient_storage")
        assert svc.svc.mget("/models/sent/golden")[0] == 404
        code, got = svc.svc.mpost("/train", {"name": "sent", "data": {"examples": [
            {"text": "很好", "label": "pos"}, {"text": "很差", "label": "neg"}] * 10}})
        assert code == 507 and got["error"]["code"] == "insufficient_storage", got
        st = svc.svc.status()["storage"]
        assert st["ok"] is False and st["last_error"]["errno_name"] == "ENOSPC", st
        assert svc.svc.mget("/metrics")[0] == 200
    finally:
        os.remove(filler)
    # writes work again without a restart
    code, got = svc.svc.mpost("/apply", {"name": "sent", "version": 2})
    assert code == 200, got
    assert svc.serving() == 2
    svc.golden_round_trip()
    # each target that failed wrote again (the history's next write is async)
    wait_for(lambda: svc.svc.status()["storage"]["ok"], 60, "storage health back to ok")
    assert svc.integrity() == "ok"
    svc.restart()
    assert svc.serving() == 2  # what was answered 200


@browser
def test_dashboard_shows_a_storage_banner_while_writes_fail(svc):
    """In the real browser: the banner appears with the failed write, and
    goes once the store takes writes again."""
    from playwright.sync_api import sync_playwright
    svc.serve(2)
    filler = svc.fill()
    try:
        code, got = svc.svc.mpost("/apply", {"name": "sent", "version": 1})
        assert code == 507, got
        with sync_playwright() as pw:
            b = Browser(pw)
            try:
                b.page.goto(svc.svc.dashboard_url())  # logs the tab in (a one-time code)
                banner = b.page.locator("#storage-banner")
                banner.wait_for(state="visible")
                text = banner.inner_text()
                assert "ENOSPC" in text and "Serving goes on" in text, text
                os.makedirs(ARTIFACTS, exist_ok=True)
                b.page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-storage-banner.png"))
                os.remove(filler)
                filler = ""
                code, got = svc.svc.mpost("/apply", {"name": "sent", "version": 2})
                assert code == 200, got
                svc.golden_round_trip()
                wait_for(lambda: svc.svc.status()["storage"]["ok"], 60, "storage ok again")
                banner.wait_for(state="hidden")
                assert b.js_errors == [], b.js_errors
            finally:
                b.close()
    finally:
        if filler:
            os.remove(filler)


def test_eio_on_fsync_refuses_rollback_and_apply_then_recovers(svc):
    svc.serve(2)
    code, got = svc.svc.mpost("/apply", {"name": "sent", "version": 1})
    assert code == 200, got  # v2 stays loaded in probation
    svc.fiu("enable name=posix/io/sync/fsync,failinfo=5")
    try:
        code, got = svc.svc.mpost("/rollback", {"name": "sent"})
        _refused(code, got, 503, "store_unavailable")
        assert svc.serving() == 1
        assert svc.svc.mget("/rollouts/sent")[1]["probation"] is not None  # still there
        code, got = svc.svc.mpost("/apply", {"name": "topic", "version": 1})
        _refused(code, got, 503, "store_unavailable")
        assert svc.svc.status()["storage"]["last_error"]["errno_name"] == "EIO"
    finally:
        svc.fiu("disable name=posix/io/sync/fsync")
    code, got = svc.svc.mpost("/rollback", {"name": "sent"})
    assert code == 200 and got["instant"] is True, got
    assert svc.serving() == 2
    svc.restart()
    assert svc.serving() == 2
    assert svc.record()["models"]["sent"]["version"] == 2


def test_state_db_faults_leave_it_intact_and_serving_on(svc):
    """SQLite writes with pwrite: ENOSPC and EIO there make the history
    writes fail (logged, shown as storage health); serving and the applies
    (their record is a separate file) go on; the db stays intact."""
    svc.serve(2)
    # No write of the state db may still be queued when the fault is on: after
    # a restart (the feedback test ends with one) the startup apply and its
    # history row come a moment after the service answers; that row met the
    # fault first, on a fresh connection, where SQLite reported the ENOSPC as
    # a "disk I/O error". The db writes in one thread, in order: once this
    # test's own row is in the history, everything queued before it is done.
    svc.golden_round_trip()
    wait_for(lambda: svc.svc.mget("/history?name=sent&limit=1")[1]["history"][0]["kind"]
             == "golden_deleted", 60, "the state db's queued writes done")
    for info, name in ((28, "ENOSPC"), (5, "EIO")):
        svc.fiu(f"enable name=posix/io/rw/pwrite,failinfo={info}")
        try:
            code, got = svc.svc.mpost("/apply", {"name": "sent", "version": 1})
            assert code == 200, got
            assert svc.serving() == 1

            def failed():
                st = svc.svc.status()["storage"]
                # this fault's error (the module's service may show an earlier test's too)
                return next((e for e in st["errors"] if e["what"] == "the state db"
                             and e["errno_name"] == name), None)
            err = wait_for(failed, 60, "the failed history write in the storage health")
            assert err["errno_name"] == name, err
        finally:
            svc.fiu("disable name=posix/io/rw/pwrite")
        code, got = svc.svc.mpost("/apply", {"name": "sent", "version": 2})
        assert code == 200, got
        # a prediction (logged) and the apply's history row: both dbs write again
        wait_for(lambda: svc.serving() and svc.svc.status()["storage"]["ok"], 60,
                 "writes working again")
        assert svc.integrity() == "ok"
        hist = svc.svc.mget("/history?name=sent&limit=5")[1]["history"]
        assert hist[0]["kind"] == "apply" and hist[0]["to_version"] == 2, hist
    svc.restart()
    assert svc.serving() == 2 and svc.integrity() == "ok"


def test_unreadable_model_files_keep_the_old_version_serving(svc, disk):
    bad = os.path.join(disk["store"], "sent", "3")
    shutil.copytree(os.path.join(disk["store"], "sent", "1"), bad)
    with open(os.path.join(bad, "meta.json")) as fh:
        meta = json.load(fh)
    meta["version"] = 3
    with open(os.path.join(bad, "meta.json"), "w") as fh:
        json.dump(meta, fh)
    for fn in os.listdir(bad):  # the model's bytes are garbage: it cannot load
        if fn.endswith(".keras"):
            path = os.path.join(bad, fn)
            size = os.path.getsize(path)
            with open(path, "wb") as fh:
                fh.write(b"\x13" * size)
    svc.serve(2)
    code, got = svc.svc.mpost("/apply", {"name": "sent", "version": 3})
    # garbage bytes are no zip archive: refused by the store's check before a worker
    # is spent on it (state/store.py check_artifact)
    assert code == 422 and got["error"]["code"] == "invalid_model", got
    assert "not a Keras archive" in got["error"]["message"], got
    assert svc.serving() == 2
    svc.restart()
    assert svc.serving() == 2


def test_feedback_under_a_failing_disk_is_refused_then_stored(svc):
    """POST /feedback commits before it answers: under ENOSPC it answers 507
    and stores nothing; once writes work it is stored, and a restart keeps it."""
    svc.serve(2)
    code, got = svc.svc.predict({"text": "很好", "model": "sent"},
                                headers={"X-Request-Id": "disk-fb-1"})
    assert code == 200 and got["request_id"] == "disk-fb-1", got

    def logged():
        c, g = svc.svc.mget("/models/sent/review?limit=500")
        return c == 200 and any(i["request_id"] == "disk-fb-1" for i in g["items"])
    wait_for(logged, 60, "the prediction in the log")
    svc.fiu("enable name=posix/io/rw/pwrite,failinfo=28")
    try:
        code, got = request(svc.svc.port, "POST", "/feedback", {"request_id": "disk-fb-1",
                                                          "label": "neg"})
        assert code == 507 and got["error"]["code"] == "insufficient_storage", got
        assert svc.serving() == 2
    finally:
        svc.fiu("disable name=posix/io/rw/pwrite")
    code, got = request(svc.svc.port, "POST", "/feedback", {"request_id": "disk-fb-1",
                                                      "label": "neg"})
    assert code == 200 and got["stored"] == 1, got
    svc.restart()
    code, got = svc.svc.mget("/models/sent/review?limit=500")
    assert code == 200 and not any(i["request_id"] == "disk-fb-1" for i in got["items"]), got


def test_a_record_the_service_could_not_write_is_written_once_the_disk_works(disk, tmp_path):
    """The service's own switch (an automatic rollback) goes ahead while the
    record cannot be written; the sweep writes it once fsync works again, and
    keeps killing hung workers meanwhile. (The sweep once called a method the
    commit lock does not have: it raised every second while a write was due,
    so the record stayed stale and the rest of the sweep never ran.)"""

    class Faulty(Disk):
        def start(self) -> Service:
            self.n += 1
            cfg = os.path.join(self.d["base"], "config-faulty.yaml")
            with open(cfg, "w") as fh:
                fh.write("worker:\n  standby_pool: 0\nrollout:\n  probation_s: 600\n"
                         "  min_requests: 10\n")
            return Service(self.d["store"], prefix=[FIU_RUN, "-x", "-f", self.ctl],
                           log_path=os.path.join(self.d["base"], f"faulty-{self.n}.log"),
                           args=["--config", cfg],
                           env={"TEXTSWAP_PRELOAD_SUPERVISOR_ONLY": "1",
                                # version 2 of sent fails every prediction
                                "TEXTSWAP_TEST_FAULT": "predict:error:sent@2"})

    d = Faulty(disk)
    try:
        assert d.svc.mpost("/apply", {"name": "sent", "version": 1})[0] == 200
        assert d.svc.mpost("/apply", {"name": "sent", "version": 2})[0] == 200
        assert d.record()["models"]["sent"]["version"] == 2
        d.fiu("enable name=posix/io/sync/fsync,failinfo=5")
        try:
            def rolled_back() -> bool:
                code, got = d.svc.predict({"text": "很好", "model": "sent"})
                return code == 200 and got["model"]["version"] == 1
            wait_for(rolled_back, 120, "the automatic rollback to v1", interval=0.05)
            assert d.record()["models"]["sent"]["version"] == 2  # the write failed
            storage = d.svc.status()["storage"]
            assert storage["record_dirty"] is True
            assert storage["last_error"]["what"] == "the applied-model record"
        finally:
            d.fiu("disable name=posix/io/sync/fsync")
        wait_for(lambda: d.record()["models"]["sent"]["version"] == 1, 60,
                 "the sweep writing the record again")
        assert "AttributeError" not in d.svc.log()
    finally:
        d.svc.stop()
