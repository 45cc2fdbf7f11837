"""state/storage.py's health figures, reported from many threads at once.

The durable-write thread, the state database's, the prediction log's sender
and the cluster threads report failures and successes while /status and
/metrics read health() on the IOLoop. Real threads; the interpreter is made to
switch between them very often, as when every writer of a failing disk
reports at once."""
from __future__ import annotations

import errno
import sys
import threading

from state.storage import Storage

WRITERS, ROUNDS = 6, 3000


def test_health_is_consistent_while_threads_report(tmp_path):
    storage = Storage(str(tmp_path))
    start = threading.Barrier(WRITERS + 1)
    problems: list[BaseException] = []

    def writer(i: int) -> None:
        start.wait()
        try:
            for n in range(ROUNDS):
                what = f"target-{i}-{n % 7}"  # new keys: the dict changes size
                if n % 2:
                    storage.failed(what, f"/x/{what}", OSError(errno.EIO, "I/O error"))
                else:
                    storage.succeeded(what)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            problems.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
    try:
        for t in threads:
            t.start()
        start.wait()
        reads = 0
        while any(t.is_alive() for t in threads) or reads == 0:
            h = storage.health()
            reads += 1
            # one view: the failing list is the errors' targets, ok iff none
            assert h["failing"] == sorted(e["what"] for e in h["errors"])
            assert h["ok"] == (not h["errors"])
            assert h["last_error"] == (h["errors"][-1] if h["errors"] else None)
            storage.last_error  # noqa: B018 (the other reader)
    finally:
        sys.setswitchinterval(old)
        for t in threads:
            t.join()
        storage.close()
    assert not problems, problems
    h = storage.health()
    assert h["writes"] + h["failures"] == WRITERS * ROUNDS
    assert h["failures"] == WRITERS * ROUNDS // 2
    # each target's last report was a failure (odd n) or a success (even n)
    last = {f"target-{i}-{k}": max(n for n in range(ROUNDS) if n % 7 == k)
            for i in range(WRITERS) for k in range(7)}
    assert set(h["failing"]) == {w for w, n in last.items() if n % 2}
