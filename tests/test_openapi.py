"""The OpenAPI documents at /openapi.json, fuzzed against the live service.

schemathesis (its CLI, `st run`, in a subprocess) reads each API's document
from the running service, generates requests from it (schema examples,
boundary "coverage" cases, random positive and negative data, and stateful
chains such as POST /train -> GET/DELETE /train/{id}) and checks every answer:
no 5xx, a documented status code, the documented content type, headers and
body schema, invalid data rejected with 4xx, a 405 with an Allow header for
undeclared methods, and 401 without the management token. Each request has a
timeout, so a hang fails the run.

Cost control, for `make test` on 2 cores (one service, a config for fuzzing):
- Small limits (texts per request, characters, body bytes). The documents
  are built from the config, so generated data stays small and the 413
  boundaries are reached quickly: with the default limits hypothesis spends
  most of its time building 20,000-character strings.
- training.max_concurrent 0: POST /train is fuzzed for real (validation,
  the 202 answer with its Location header, the job schema, GET and DELETE of
  the job through the stateful phase), but queued jobs never start a trainer,
  so no generated request can load the machine with training. The spec's
  request example is valid on purpose, so that path is always reached.
- worker.boot_timeout 3: a valid /apply takes the warm standby worker (the
  test waits for one first); once it is used, the next one needs ~15 s of CPU
  to import TensorFlow, and an apply that would wait for it answers 503
  (documented, code worker_boot_failed) within 3 s instead. The serving
  model is never dropped.
- worker.max_workers 5 (two serving models, a standby, a version kept in
  probation, one more): POST /apply takes up to 64 replicas, and a count
  beyond the budget is refused at once with 409 memory_budget instead of
  starting dozens of TensorFlow processes. With room for the probation,
  the examples phase's apply of sent v1 keeps v2 loaded and its POST
  /rollback is the instant one.
- Only the well-behaved tiny models are in the store: the fuzzer learns
  names from GET /models and would otherwise apply the crashing ones.
- Both `sent` (the default) and `topic` serve when fuzzing starts, so
  /predict's "model", /unload (its example unloads `topic`), /rollouts and
  /rollback reach their 200 answers. The fuzzer may unload any model it
  names, the default too: /predict then answers 503 and /readyz 503, which
  the documents allow. The management run is the last one; after it the
  test checks from GET /history that an unload through the API is why the
  default stopped serving (any other reason fails), then applies it again.
- The test runs CASES cases per API; bench/fuzz.py runs 1,000+ per API with
  the same code and prints the counts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import Service, request, wait_for

TOKEN = "fuzz-token-a-key-of-32-characters-or-more"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CASES = int(os.environ.get("TEXTSWAP_FUZZ_CASES", "150"))  # per API, at least (bench/fuzz.py: more)
SEED = os.environ.get("TEXTSWAP_FUZZ_SEED", "1")  # "random": a new seed each run
REQUEST_TIMEOUT = 60.0  # an /apply may wait for a worker to boot TensorFlow on a busy box
MODELS = ("sent", "topic")  # the tiny models the fuzzer may apply
# the Open Inference Protocol's seven GET routes only look a name up: fewer cases
OIP_GET_CASES = 25

SERVICE_CONFIG = """\
limits:
  max_body_bytes: 8192
  max_texts: 8
  max_text_chars: 200
  max_top_k: 10
  default_top_k: 3
worker:
  boot_timeout: 3.0
  max_workers: 5
training:
  max_concurrent: 0
  demo_on_empty_store: false
"""

# Every built-in check runs on every answer; the exceptions, and why:
# - negative_data_rejection: too many texts or a too-large body is refused
#   with 413, a too-long text with 422 (not in schemathesis's default list).
# - positive_data_acceptance on POST /train: schema-valid data can still be
#   refused with 400 for what a schema cannot say (each label needs two
#   examples; a data file must exist under the data roots).
# - positive_data_acceptance on the Open Inference Protocol's infer: a
#   schema-valid tensor can still be refused with 400 when its element count
#   does not match its shape, which a schema cannot say.
# - positive_data_acceptance on PUT /models/{name}/golden: its 'data' is
#   checked as POST /train's is (400 for what a schema cannot say).
# - positive_data_acceptance on POST /apply also expects 422: min_accuracy
#   without a golden set registered is refused with 422 no_golden_set, and
#   whether one is registered is state, not schema.
# - not_a_server_error on POST /apply and POST /rollback (which applies the
#   previous version once probation is over): 503 worker_boot_failed is the
#   documented answer that worker.boot_timeout above provokes on purpose.
# - POST /auth/session answers 429 rate_limited to more than a few code
#   exchanges a second from one address (the security pass's throttle): the
#   fuzzer sends hundreds, so 429 is expected of any body there.
# - use_after_free (excluded on the command line): DELETE /train/{id}
#   cancels a job and keeps its record, so GET /train/{id} still answers 200.
# Per-operation settings are repeated per phase: schemathesis reads a
# phase's check settings before the operation's.
def _per_phase(setting: str) -> str:
    return "\n".join(f"{prefix}{setting}" for prefix in (
        "", "phases.examples.", "phases.coverage.", "phases.fuzzing.", "phases.stateful."))


SCHEMATHESIS_CONFIG = f"""\
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "404", "405", "409", "413", "415", "422"]

[[operations]]
include-path = "/train"
include-method = "POST"
{_per_phase("checks.positive_data_acceptance.enabled = false")}

[[operations]]
include-path-regex = "/infer$"
include-method = "POST"
{_per_phase("checks.positive_data_acceptance.enabled = false")}

[[operations]]
include-path-regex = "^/v2"
include-method = "GET"
generation.max-examples = {OIP_GET_CASES}

[[operations]]
include-path = "/models/{{name}}/golden"
include-method = "PUT"
{_per_phase("checks.positive_data_acceptance.enabled = false")}

[[operations]]
include-path = "/apply"
include-method = "POST"
{_per_phase('checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]')}
{_per_phase('checks.positive_data_acceptance.expected-statuses = '
            '["2xx", "401", "404", "409", "422", "5xx"]')}

[[operations]]
include-path = "/auth/session"
include-method = "POST"
{_per_phase('checks.negative_data_rejection.expected-statuses = '
            '["400", "401", "404", "405", "409", "413", "415", "422", "429"]')}
{_per_phase('checks.positive_data_acceptance.expected-statuses = '
            '["2xx", "401", "403", "404", "409", "429"]')}

[[operations]]
include-path = "/rollback"
include-method = "POST"
{_per_phase('checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]')}
"""


def st_command() -> list[str]:
    st = os.path.join(os.path.dirname(sys.executable), "st")
    return [st] if os.path.exists(st) else [sys.executable, "-m", "schemathesis.cli"]


def run_schemathesis(url: str, workdir: str, *, max_examples: int, seed: str = SEED,
                     headers: dict[str, str] | None = None, phases: str | None = None,
                     timeout: float = 480) -> dict[str, Any]:
    """Run `st run` against one live API; returns its JSON report plus the text output.

    Runs in workdir, where schemathesis keeps its caches and reports."""
    os.makedirs(workdir, exist_ok=True)
    config = os.path.join(workdir, "schemathesis.toml")
    with open(config, "w", encoding="utf-8") as fh:
        fh.write(SCHEMATHESIS_CONFIG)
    report = os.path.join(workdir, "report.json")
    cmd = [*st_command(), "--config-file", config, "run", url,
           "--exclude-checks", "use_after_free",
           "--max-examples", str(max_examples), "--request-timeout", str(REQUEST_TIMEOUT),
           "--continue-on-failure", "--workers", "1", "--output-truncate", "true",
           "--warnings", "off",
           "--report", "json", "--report-json-path", report, "--wait-for-schema", "10"]
    if seed != "random":
        cmd += ["--seed", seed]
    if phases:
        cmd += ["--phases", phases]
    for name, value in (headers or {}).items():
        cmd += ["-H", f"{name}: {value}"]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "NO_COLOR": "1"})
    output = proc.stdout + proc.stderr
    with open(os.path.join(workdir, "output.txt"), "w", encoding="utf-8") as fh:
        fh.write(output)
    if not os.path.exists(report):
        raise AssertionError(f"schemathesis wrote no report (exit {proc.returncode}):\n"
                             f"{output[-4000:]}")
    with open(report, encoding="utf-8") as fh:
        result = json.load(fh)
    result["output"] = output
    result["returncode"] = proc.returncode
    return result


def summarize(result: dict[str, Any]) -> str:
    cases = result["test_cases"]
    line = (f"{cases['generated']} cases, {cases['with_failures']} with failures, "
            f"{cases['errored']} errored; seed {result['seed']}")
    problems = result["failures"] + result["errors"]
    if problems:
        line += "\n" + "\n".join(json.dumps(p) for p in problems)
    return line


def restore_default(svc: Service) -> str | None:
    """After a management run: if the default model `sent` no longer serves,
    the history must show that the fuzzer unloaded it through the API (any
    other way of losing it is a bug); apply it again. Returns what happened."""
    if svc.get("/readyz")[0] == 200:
        return None
    code, body = svc.mget("/history?name=sent&limit=1000", headers=AUTH)
    assert code == 200, body
    unloads = [e for e in body["history"] if e["kind"] == "unload" and e["source"] == "api"]
    assert unloads, ("the default model stopped serving without an API unload: "
                     f"{body['history'][:10]}")
    def applied() -> bool:  # a standby may still be booting: 503 until it is
        return svc.mpost("/apply", {"name": "sent", "default": True, "gate": False},
                         headers=AUTH, timeout=120)[0] == 200
    wait_for(applied, 180, "the default model applied again", interval=2.0)
    return f"the fuzzer unloaded sent ({len(unloads)} time(s)); applied again"


def server_errors(log: str) -> list[str]:
    """Lines where the service logged a 500 answer or an exception a handler let
    escape (documented 503/504 answers are fine)."""
    return [line for line in log.splitlines()
            if re.search(r"textswap\.http: 500 |Uncaught exception", line)]


def start_service(tiny_store: str, workdir: str) -> Service:
    """The service on free ports with the fuzzing config and a management token,
    a warm standby worker, `sent` applied (the default) and `topic` beside it."""
    store = os.path.join(workdir, "models")
    os.makedirs(store)
    for name in MODELS:
        shutil.copytree(os.path.join(tiny_store, name), os.path.join(store, name))
    cfg = os.path.join(workdir, "config.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        fh.write(SERVICE_CONFIG)
    svc = Service(store, args=["--config", cfg], env={"TEXTSWAP_MANAGEMENT_TOKEN": TOKEN})
    def standby_booted() -> bool:
        standby = svc.mget("/status", headers=AUTH)[1]["standby"] or {}
        return standby.get("state") == "STANDBY"

    try:
        for name, default in (("sent", True), ("topic", False)):
            wait_for(standby_booted, 120, "a booted standby worker", interval=0.2)
            code, body = svc.mpost("/apply", {"name": name, "default": default},
                                   headers=AUTH, timeout=120)
            assert code == 200, body
        # the apply used the standby: let its successor boot before fuzzing
        wait_for(standby_booted, 120, "the next standby worker", interval=0.2)
    except BaseException:
        svc.stop()
        raise
    return svc


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    s = start_service(tiny_store, str(tmp_path_factory.mktemp("openapi")))
    yield s
    s.stop()
    assert not s.leftover, s.leftover


def test_documents_are_served_and_match_the_routes(svc):
    code, doc = svc.get("/openapi.json")
    assert code == 200 and doc["openapi"].startswith("3.0")
    oip = {"/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}",
           "/v2/models/{name}/versions/{version}", "/v2/models/{name}/ready",
           "/v2/models/{name}/versions/{version}/ready", "/v2/models/{name}/infer",
           "/v2/models/{name}/versions/{version}/infer"}
    assert set(doc["paths"]) == {"/predict", "/healthz", "/readyz", "/openapi.json",
                                 "/feedback"} | oip
    predict = doc["components"]["schemas"]["PredictRequest"]
    assert predict["properties"]["texts"]["maxItems"] == 8  # from the config's limits
    assert set(predict["properties"]) == {"text", "texts", "top_k", "model", "min_score", "explain"}
    assert predict["additionalProperties"] is False
    assert svc.mget("/openapi.json", auth=False)[0] == 401  # the management document needs a key
    code, doc = svc.mget("/openapi.json", headers=AUTH)
    assert code == 200
    # every route of frontend/app.py's management_app except the dashboard's
    # static page (GET / and /ui/*: no token, no data; tests/test_dashboard.py)
    assert set(doc["paths"]) == {
        "/apply", "/unload", "/status", "/models", "/models/{name}", "/models/{name}/{version}",
        "/models/{name}/{version}/artifact", "/models/{name}/golden", "/rollback", "/promote",
        "/abort", "/rollouts/{name}", "/history", "/cluster", "/metrics", "/train",
        "/train/{id}", "/healthz", "/openapi.json",
        "/models/{name}/review", "/models/{name}/policy", "/models/{name}/quality",  # the loop
        "/predictions/{request_id}", "/models/{name}/predictions",  # erasure
        "/feedback", "/try",  # the dashboard's panels (frontend/dashboard_routes.py)
        "/auth/session", "/auth/code", "/auth/logout",  # the dashboard's sessions
        "/auth/sessions"}  # (frontend/auth.py)
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/apply"]["post"]["responses"]["401"]
    apply = doc["paths"]["/apply"]["post"]["requestBody"]["content"]["application/json"]
    props = apply["schema"]["properties"]
    assert set(props) == {"name", "version", "replicas", "default", "mode", "fraction",
                          "keep_examples", "gate", "min_accuracy", "partial"}
    assert props["mode"]["enum"] == ["normal", "shadow", "canary"]
    assert props["replicas"]["maximum"] == 64 and props["fraction"]["maximum"] == 1
    assert set(doc["paths"]["/models/{name}/golden"]) == {"parameters", "put", "get", "delete"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {
        "text/plain", "application/openmetrics-text"}


def test_405_names_the_allowed_methods(svc):
    code, body = request(svc.port, "PUT", "/predict", {"text": "x"})
    assert code == 405 and body["error"]["code"] == "method_not_allowed"
    conn_headers = _headers(svc.mport, "DELETE", "/models", AUTH)
    assert conn_headers["status"] == 405 and conn_headers["allow"] == "GET"
    assert _headers(svc.mport, "PATCH", "/train/x", AUTH)["allow"] == "GET, DELETE"


def test_odd_inputs_get_4xx_or_a_fallback(svc):
    """Each of these answered 500 once (found reading the handlers while
    describing them; the fuzzer's generators do not reach them)."""
    # str.isdigit() takes '²' (int() does not)
    code, body = svc.mget("/history?limit=%C2%B2", headers=AUTH)
    assert code == 400 and body["error"]["code"] == "invalid_field", body
    # a lone surrogate in a data path (JSON "\ud800"): not valid Unicode, for a
    # golden set as for training
    data = {"path": "/tmp/\ud800.jsonl"}
    code, body = svc.request_put("/models/sent/golden", {"data": data}, headers=AUTH)
    assert code == 400 and "surrogate" in body["error"]["message"], body
    code, body = svc.mpost("/train", {"name": "x", "data": data}, headers=AUTH)
    assert code == 400 and "surrogate" in body["error"]["message"], body
    # an Accept version prometheus_client cannot parse: the text format
    for accept in ("application/openmetrics-text; version=abc", "text/plain; version=x"):
        code, body = request(svc.mport, "GET", "/metrics",
                             headers={**AUTH, "Accept": accept})
        assert code == 200 and b"textswap_" in body, (accept, body[:200])


def _headers(port: int, method: str, path: str, headers: dict[str, str]) -> dict[str, Any]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return {"status": resp.status, "allow": resp.getheader("Allow")}
    finally:
        conn.close()


@pytest.mark.timeout(600)  # above run_schemathesis's 480 s wait and the fixtures' waits
@pytest.mark.parametrize("api", ["inference", "management"])
def test_fuzz(svc, api, tmp_path):
    phases = None
    if api == "inference":
        port, headers, per_operation = svc.port, None, CASES
        # no stateful phase: no call here makes a resource another one uses (it
        # would only chain the protocol's name lookups, for minutes)
        phases = "examples,coverage,fuzzing"
    else:
        # twenty operations, and the stateful phase adds chains of calls
        port, headers, per_operation = svc.mport, AUTH, max(10, CASES // 10)
    log_before = len(svc.log())
    result = run_schemathesis(f"http://127.0.0.1:{port}/openapi.json", str(tmp_path / api),
                              max_examples=per_operation, headers=headers, phases=phases)
    summary = summarize(result)
    print(f"{api}: {summary}")
    assert result["test_cases"]["generated"] >= CASES, summary
    assert not result["failures"] and not result["errors"], (
        summary + "\n" + result["output"][-6000:])
    assert result["returncode"] == 0, result["output"][-6000:]
    assert not server_errors(svc.log()[log_before:])
    if api == "management":
        print(restore_default(svc) or "the default model served throughout")
    assert svc.get("/healthz")[0] == 200 and svc.get("/readyz")[0] == 200
    if api == "management":  # jobs were queued and cancelled, never trained
        jobs = svc.mget("/train", headers=AUTH)[1]["jobs"]
        assert {j["state"] for j in jobs} <= {"queued", "cancelled"}, jobs
