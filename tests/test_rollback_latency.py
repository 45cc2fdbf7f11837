"""The latency-based automatic rollback on the real service (docs/rollouts.md,
control/rollout_control.py `check_probations`): a new version whose p99 in
probation is above `rollout.max_latency_ratio` x the previous version's p99
and more than `rollout.latency_slack_ms` above it is rolled back.

A real Keras model cannot be made slow on purpose, so version 2 of "lat" gets
the test fault `predict:slow` (1 s more per model call, model_worker/worker.py
`fault`); the models are real."""
from __future__ import annotations

import concurrent.futures
import shutil

import pytest

from tests.helpers import Service, wait_for
from tests.test_rollouts import _copy_version


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    base = tmp_path_factory.mktemp("latency")
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    _copy_version(root, "sent/1", "lat", 1)
    _copy_version(root, "sent/2", "lat", 2)
    cfg = base / "config.yaml"
    # the defaults for the ratio (3x) and the slack (20 ms); fewer requests to judge
    cfg.write_text("rollout:\n  probation_s: 300\n  min_requests: 20\n"
                   "worker:\n  standby_pool: 1\n")
    s = Service(root, args=["--config", str(cfg)],
                env={"TEXTSWAP_TEST_FAULT": "predict:slow:lat@2"})
    yield s
    s.stop()


def _predict_many(svc: Service, n: int, threads: int) -> list[dict]:
    def one(i: int) -> dict:
        code, body = svc.predict({"text": f"很好 {i}", "model": "lat"}, timeout=60)
        assert code == 200, body
        return body
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        return list(ex.map(one, range(n)))


def test_a_version_slower_than_the_limits_is_rolled_back_automatically(svc):
    code, body = svc.mpost("/apply", {"name": "lat", "version": 1})
    assert code == 200, body
    # the previous version's p99 is the yardstick once it answered >= 100 requests
    assert {b["model"]["version"] for b in _predict_many(svc, 120, 2)} == {1}
    code, body = svc.mpost("/apply", {"name": "lat", "version": 2})
    assert code == 200, body
    code, ro = svc.mget("/rollouts/lat")
    assert code == 200 and ro["probation"]["version"] == 1, ro
    slow = [b["model"]["version"] for b in _predict_many(svc, 24, 6)]  # 1 s late each
    assert slow.count(2) >= 20 and set(slow) <= {1, 2}  # all answered; judged after 20

    def rolled_back():
        c, r = svc.mget("/rollouts/lat")
        assert c == 200, r
        return [x for x in r["rolled_back"] if x["version"] == 2]
    (info,) = wait_for(rolled_back, 60, "the automatic rollback of lat v2")
    assert info["auto"] is True and "p99 latency" in info["reason"], info
    figures = info["figures"]
    assert figures["new_version"]["p99_ms"] >= 1000
    assert figures["new_version"]["p99_ms"] > 3 * figures["previous_p99_ms"]
    assert figures["new_version"]["errors"] == 0  # not the error-rate rule
    assert svc.status()["models"]["lat"]["version"] == 1
    assert {b["model"]["version"] for b in _predict_many(svc, 5, 1)} == {1}
