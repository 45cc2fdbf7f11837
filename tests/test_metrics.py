"""Prometheus metrics of the live service, read with prometheus_client's own
parser: the token on the management port, the token-less metrics port, and
counters that move by exactly what was sent. One service for the module."""
from __future__ import annotations

import http.client
import os
import shutil
import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Service, free_port, request, wait_for

TOKEN = "metrics-token-a-key-of-32-characters-or-more"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    work = tmp_path_factory.mktemp("metrics")
    root = str(work / "models")
    shutil.copytree(tiny_store, root)
    port = free_port()
    cfg = str(work / "config.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        # no trainer ever starts: jobs stay queued (cheap to test the job gauge)
        fh.write(f"metrics:\n  port: {port}\n  host: 127.0.0.1\n"
                 "training:\n  max_concurrent: 0\n")
    s = Service(root, args=["--config", cfg], env={"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN})
    s.metrics_port = port
    try:
        code, body = s.mpost("/apply", {"name": "sent", "version": 1}, headers=AUTH,
                             timeout=180)
        assert code == 200, body
        yield s
    finally:
        s.stop()


def _get(port: int, path: str, headers: dict[str, str] | None = None
         ) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        conn.close()


def scrape(svc: Service) -> Samples:
    code, ctype, text = _get(svc.mport, "/metrics", AUTH)
    assert code == 200, text
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def exact(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value; a missing sample fails (where value() would say 0)."""
    key = (name, frozenset(labels.items()))
    assert key in samples, (name, labels, sorted(k for k in samples if k[0] == name))
    return samples[key]


def family_names(svc: Service) -> set[str]:
    """Every metric family the scrape declares (a gauge with no sample still has
    its HELP and TYPE lines)."""
    code, _, text = _get(svc.mport, "/metrics", AUTH)
    assert code == 200, text
    return {f.name for f in text_string_to_metric_families(text)}


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every sample of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_token_and_metrics_port(svc):
    code, _, body = _get(svc.mport, "/metrics")
    assert code == 401 and "unauthorized" in body
    assert _get(svc.mport, "/metrics", {"Authorization": "Bearer wrong"})[0] == 401
    assert scrape(svc)
    # Prometheus asks for OpenMetrics: negotiated from the Accept header
    code, ctype, text = _get(svc.mport, "/metrics", {
        **AUTH, "Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"})
    assert code == 200 and ctype.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")
    assert [f.name for f in text_string_to_metric_families(text.replace("# EOF\n", ""))]
    # the separate port: no token, and nothing but /metrics
    code, ctype, text = _get(svc.metrics_port, "/metrics")
    assert code == 200 and "# HELP textswap_requests" in text, text[:500]
    assert _get(svc.metrics_port, "/status")[0] == 404


def _sent_v1(svc) -> None:
    """sent v1 serving, applied fresh (nothing in probation to fall back to),
    whatever the tests before left: the counters below are keyed by version 1."""
    code, body = svc.mpost("/unload", {"name": "sent"}, headers=AUTH)
    assert code in (200, 404), body  # 404: not loaded
    code, body = svc.mpost("/apply", {"name": "sent", "version": 1}, headers=AUTH, timeout=180)
    assert code == 200, body


def test_counters_move_by_exactly_what_was_sent(svc):
    _sent_v1(svc)
    before = scrape(svc)
    texts = 0
    for i in range(7):
        code, _ = svc.predict({"texts": ["很好", "awful", f"text {i}"][: 1 + i % 3]})
        assert code == 200
        texts += 1 + i % 3
    for _ in range(3):
        assert svc.predict({"text": ""})[0] == 400
    infer = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                         "data": ["love it", "很差"]}]}
    for _ in range(5):
        code, body = request(svc.port, "POST", "/v2/models/sent/infer", infer)
        assert code == 200, body
        texts += 2
    assert request(svc.port, "POST", "/v2/models/nope/infer", infer)[0] == 404
    after = scrape(svc)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ok = {"model": "sent", "version": "1"}
    assert delta("textswap_requests_total", api="predict", code="200", **ok) == 7
    assert delta("textswap_requests_total", api="predict", code="400", model="",
                 version="") == 3
    assert delta("textswap_requests_total", api="oip_infer", code="200", **ok) == 5
    assert delta("textswap_requests_total", api="oip_infer", code="404", model="",
                 version="") == 1
    assert delta("textswap_request_duration_seconds_count", api="predict", **ok) == 7
    assert delta("textswap_request_duration_seconds_count", api="oip_infer", **ok) == 5
    assert delta("textswap_request_duration_seconds_sum", api="predict", **ok) > 0
    # requests were sent one at a time: every text went through the model once,
    # and each model call was timed in the worker
    assert delta("textswap_batch_size_sum", **ok) == texts
    calls = delta("textswap_batch_size_count", **ok)
    assert 12 <= calls <= texts and delta("textswap_model_seconds_count", **ok) == calls
    assert 0 < delta("textswap_model_seconds_sum", **ok) < delta(
        "textswap_request_duration_seconds_sum", api="predict", **ok) + delta(
        "textswap_request_duration_seconds_sum", api="oip_infer", **ok)
    # cumulative buckets end at +Inf == count
    assert value(after, "textswap_batch_size_bucket", le="+Inf", **ok) == value(
        after, "textswap_batch_size_count", **ok)


def test_gauges(svc):
    s = scrape(svc)
    assert exact(s, "textswap_workers", state="SERVING") == 1
    # idle: the in-flight gauge is declared and has no non-zero sample (a
    # worker with nothing in flight adds none); the queue of "sent" is there, at 0
    assert {"textswap_requests_in_flight", "textswap_requests_queued"} <= family_names(svc)
    assert total(s, "textswap_requests_in_flight") == 0
    assert exact(s, "textswap_requests_queued", model="sent") == 0
    serving = [ls for (n, ls), v in s.items()
               if n == "textswap_worker_rss_bytes" and ("state", "SERVING") in ls]
    assert len(serving) == 1 and ("model", "sent") in serving[0]
    assert s[("textswap_worker_rss_bytes", serving[0])] > 50e6  # TensorFlow is in there
    assert 0 < s[("textswap_worker_uss_bytes", serving[0])] <= s[
        ("textswap_worker_rss_bytes", serving[0])]
    assert total(s, "process_resident_memory_bytes") > 0  # the supervisor's own
    # a job that cannot start (max_concurrent 0), then cancelled
    examples = [{"text": t, "label": lab} for lab, ts in
                (("a", ["x one", "x two"]), ("b", ["y one", "y two"])) for t in ts]
    code, body = svc.mpost("/train", {"name": "gauge", "data": {"examples": examples}},
                           headers=AUTH)
    assert code == 202, body
    job = body["job"]["id"]
    assert value(scrape(svc), "textswap_training_jobs", state="queued") >= 1
    assert svc.request_delete(f"/train/{job}", headers=AUTH)[0] == 200
    assert value(scrape(svc), "textswap_training_jobs", state="cancelled") >= 1


def test_crashes_restarts_applies(svc):
    # sent v1 applied fresh (no earlier version to fall back to): a crash of its
    # worker is answered by a restart
    _sent_v1(svc)
    key = {"model": "sent", "version": "1"}
    crashes = value(scrape(svc), "textswap_worker_crashes_total", **key)
    restarts = value(scrape(svc), "textswap_worker_restarts_total", **key)
    status = svc.mget("/status", headers=AUTH)[1]
    (pid,) = [w["pid"] for w in status["workers"] if w["state"] == "SERVING"]
    os.kill(pid, signal.SIGKILL)

    def replaced() -> Samples | None:
        now = scrape(svc)
        return now if value(now, "textswap_worker_restarts_total", **key) > restarts else None
    s = wait_for(replaced, 180, "the crashed replica's replacement", interval=0.5)
    assert value(s, "textswap_worker_crashes_total", **key) == crashes + 1
    assert value(s, "textswap_worker_restarts_total", **key) == restarts + 1
    assert svc.predict({"text": "很好"})[0] == 200

    before = scrape(svc)
    code, body = svc.mpost("/apply", {"name": "sent", "version": 2}, headers=AUTH,
                           timeout=180)
    assert code == 200, body
    s = scrape(svc)
    assert value(s, "textswap_applies_total", model="sent", source="api", outcome="ok") == \
        value(before, "textswap_applies_total", model="sent", source="api", outcome="ok") + 1
    assert total(s, "textswap_apply_phase_seconds_count") > total(
        before, "textswap_apply_phase_seconds_count")
    code, body = svc.mpost("/apply", {"name": "sent", "version": 99}, headers=AUTH)
    assert code == 404  # refused before an apply starts: not counted as one
    assert total(scrape(svc), "textswap_applies_total") == total(s, "textswap_applies_total")
