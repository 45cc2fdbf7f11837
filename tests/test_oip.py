"""Open Inference Protocol v2 on the inference port, called by the official
Triton client (tritonclient[http]) against the live service, plus the error
shapes over plain HTTP. One service for the module, `sent` v1 applied."""
from __future__ import annotations

import gzip
import http.client
import json
import shutil
import socket
import struct
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.helpers import Service, request

CONFIG = """\
limits:
  max_body_bytes: 4096
  max_texts: 8
  max_text_chars: 50
"""
TEXTS = ["非常好用", "terrible", "love it", "很差"]


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    work = tmp_path_factory.mktemp("oip")
    root = str(work / "models")
    shutil.copytree(tiny_store, root)
    cfg = str(work / "config.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        fh.write(CONFIG)
    s = Service(root, args=["--config", cfg])
    try:
        code, body = s.mpost("/apply", {"name": "sent", "version": 1}, timeout=180)
        assert code == 200, body
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(svc):
    # network_timeout: a hang would surface as a timeout error, not as the
    # InferenceServerException the bad-request tests expect
    c = triton.InferenceServerClient(url=f"127.0.0.1:{svc.port}", connection_timeout=30,
                                     network_timeout=30)
    yield c
    c.close()


def _reference(svc: Service, texts: list[str]) -> tuple[list[str], np.ndarray]:
    """Labels and full score rows from POST /predict, in label order."""
    code, body = svc.predict({"texts": texts, "top_k": 100})
    assert code == 200, body
    labels = sorted(t["label"] for t in body["predictions"][0]["top"])
    rows = [[{t["label"]: t["score"] for t in p["top"]}[lab] for lab in labels]
            for p in body["predictions"]]
    return [p["label"] for p in body["predictions"]], np.array(rows, dtype=np.float32)


def _s(x: Any) -> str:
    """A BYTES element: bytes when it came binary, str when it came as JSON."""
    return x.decode() if isinstance(x, bytes) else x


def _text_input(texts: list[str], binary: bool) -> Any:
    inp = triton.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_),
                            binary_data=binary)
    return inp


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "textswap" and "binary_tensor_data" in meta["extensions"]
    assert client.is_model_ready("sent") and client.is_model_ready("sent", "1")
    assert not client.is_model_ready("sent", "2")  # in the store, not serving
    assert not client.is_model_ready("topic") and not client.is_model_ready("nope")
    m = client.get_model_metadata("sent")
    assert m["name"] == "sent" and m["versions"] == ["1"]
    assert m["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert m["outputs"] == [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                            {"name": "scores", "datatype": "FP32", "shape": [-1, 2]}]
    assert m["parameters"]["labels"] == ["neg", "pos"]
    assert client.get_model_metadata("sent", "1") == m


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_both_outputs(svc, client, binary):
    labels, scores = _reference(svc, TEXTS)
    outputs = [triton.InferRequestedOutput("label", binary_data=binary),
               triton.InferRequestedOutput("scores", binary_data=binary)]
    result = client.infer("sent", [_text_input(TEXTS, binary)], outputs=outputs,
                          request_id="r-1")
    got_labels = result.as_numpy("label")
    got_scores = result.as_numpy("scores")
    assert [_s(x) for x in got_labels] == labels
    assert got_scores.dtype == np.float32 and got_scores.shape == (len(TEXTS), 2)
    np.testing.assert_allclose(got_scores, scores, atol=1e-6)
    resp = result.get_response()
    assert resp["model_name"] == "sent" and resp["model_version"] == "1" and resp["id"] == "r-1"
    # the binary extension was really used (or really not)
    assert all(("parameters" in o) == binary for o in resp["outputs"])
    assert labels == ["pos", "neg", "pos", "neg"]


def test_infer_defaults_and_classification(svc, client):
    labels, scores = _reference(svc, TEXTS[:2])
    # no outputs named: the client asks for all of them, in binary
    result = client.infer("sent", [_text_input(TEXTS[:2], True)], model_version="1")
    np.testing.assert_allclose(result.as_numpy("scores"), scores, atol=1e-6)
    assert [x.decode() for x in result.as_numpy("label")] == labels
    # classification extension: top k as "score:index:label"
    result = client.infer("sent", [_text_input(TEXTS[:2], False)],
                          outputs=[triton.InferRequestedOutput("scores", class_count=1,
                                                               binary_data=False)])
    top = result.as_numpy("scores")
    assert top.shape == (2, 1)
    score, index, label = _s(top[0][0]).split(":")
    assert label == labels[0] and ["neg", "pos"][int(index)] == label
    assert abs(float(score) - scores[0][int(index)]) < 1e-5


@pytest.mark.parametrize("call,status,words", [
    (lambda c: c.infer("nope", [_text_input(["x"], True)]), "404", "not serving"),
    (lambda c: c.infer("sent", [_text_input(["x"], True)], model_version="2"), "404",
     "version 1 is"),
    (lambda c: c.infer("sent", [_int_input()]), "400", "BYTES"),
    (lambda c: c.infer("sent", [_text_input(["x"] * 9, True)]), "400", "limit is 8"),
    (lambda c: c.infer("sent", [_text_input(["  "], False)]), "400", "empty"),
    (lambda c: c.infer("sent", [_text_input(["x"], True)],
                       outputs=[triton.InferRequestedOutput("probs")]), "400", "unknown output"),
    (lambda c: c.get_model_metadata("topic"), "404", "serving: 'sent'"),
], ids=["unknown-model", "other-version", "datatype", "too-many", "blank", "output", "meta"])
def test_bad_requests_raise_in_the_client(client, call, status, words):
    with pytest.raises(InferenceServerException) as info:
        call(client)
    assert info.value.status() == status, info.value
    assert words in info.value.message(), info.value


def _int_input() -> Any:
    inp = triton.InferInput("text", [1], "INT32")
    inp.set_data_from_numpy(np.array([1], dtype=np.int32))
    return inp


# -- plain HTTP: the protocol's error shape ----------------------------------------------
def _raw(port: int, path: str, body: bytes, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _bytes(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def _binary_request(raw: bytes, n: int, size: int | None = None) -> tuple[bytes, dict]:
    head = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [n],
                                   "parameters": {"binary_data_size": size or len(raw)}}],
                       "outputs": [{"name": "label"}]}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


INFER = "/v2/models/sent/infer"


def test_json_infer_nested_shape_and_gzip(svc):
    req = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1],
                       "data": [["非常好用"], ["terrible"]]}]}
    code, body = request(svc.port, "POST", INFER, req)
    assert code == 200, body
    label, scores = body["outputs"]
    assert label == {"name": "label", "datatype": "BYTES", "shape": [2], "data": ["pos", "neg"]}
    assert scores["shape"] == [2, 2] and len(scores["data"]) == 4
    zipped = gzip.compress(json.dumps(req).encode())
    code, _, raw = _raw(svc.port, INFER, zipped, {"Content-Encoding": "gzip"})
    assert code == 200 and json.loads(raw)["outputs"][0]["data"] == ["pos", "neg"]


def test_binary_output_framing(svc):
    raw, headers = _binary_request(_bytes("好评".encode(), b"awful"), 2)
    req = json.loads(raw[:int(headers["Inference-Header-Content-Length"])])
    req["outputs"] = [{"name": "label", "parameters": {"binary_data": True}},
                      {"name": "scores", "parameters": {"binary_data": True}}]
    head = json.dumps(req).encode()
    code, hdrs, body = _raw(svc.port, INFER, head + _bytes("好评".encode(), b"awful"),
                            {"Inference-Header-Content-Length": str(len(head))})
    assert code == 200, body
    n = int(hdrs["inference-header-content-length"])
    meta = json.loads(body[:n])
    sizes = [o["parameters"]["binary_data_size"] for o in meta["outputs"]]
    assert n + sum(sizes) == len(body)
    labels = body[n:n + sizes[0]]
    assert labels == _bytes(b"pos", b"neg")
    scores = np.frombuffer(body[n + sizes[0]:], dtype="<f4").reshape(2, 2)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("body,headers,status,words", [
    (b"{not json", {}, 400, "not valid JSON"),
    (b"[]", {}, 400, "JSON object"),
    (b'{"inputs": []}', {}, 400, "one input"),
    (*_binary_request(_bytes(b"ok"), 1), 200, None),
    (*_binary_request(_bytes(b"ok"), 2), 400, "shape says 2"),
    (*_binary_request(_bytes(b"ok")[:-1], 1), 400, "claims 2 bytes"),
    (*_binary_request(_bytes(b"\xff\xfe"), 1), 400, "not valid UTF-8"),
    (*_binary_request(_bytes(b"ok"), 1, size=99), 400, "binary_data_size 99"),
    (_binary_request(_bytes(b"ok"), 1)[0], {"Inference-Header-Content-Length": "9999"}, 400,
     "outside the body"),
    (json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                             "data": ["x" * 51]}]}).encode(), {}, 422, "limit is 50"),
    (json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                             "data": ["\ud800"]}]}).encode(), {}, 400, "not valid Unicode"),
    (json.dumps({"inputs": [{"name": "txt", "datatype": "BYTES", "shape": [1],
                             "data": ["x"]}]}).encode(), {}, 400, "unknown input"),
    (b"x" * 5000, {}, 413, "exceeds the limit"),
    (b"garbage", {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
    (gzip.compress(b" " * 10000), {"Content-Encoding": "gzip"}, 413, "decompressed"),
], ids=["json", "array", "no-input", "ok", "count", "truncated", "utf8", "size", "header-len",
        "long", "surrogate", "input-name", "body", "gzip", "gzip-bomb"])
def test_infer_errors_have_the_protocol_shape(svc, body, headers, status, words):
    code, hdrs, raw = _raw(svc.port, INFER, body, headers)
    answer = json.loads(raw)
    assert code == status, answer
    if words is None:
        # the one output asked for, holding the label /predict gives for "ok"
        labels, _ = _reference(svc, ["ok"])
        assert answer["outputs"] == [{"name": "label", "datatype": "BYTES", "shape": [1],
                                      "data": labels}], answer
    else:
        assert set(answer) == {"error"} and isinstance(answer["error"], str)
        assert words in answer["error"], answer


def test_other_routes_and_methods(svc):
    assert request(svc.port, "GET", "/v2/health/live") == (200, {"live": True})
    assert request(svc.port, "GET", "/v2/health/ready") == (200, {"ready": True})
    code, body = request(svc.port, "GET", "/v2/models/sent/versions/1/ready")
    assert (code, body["ready"]) == (200, True)
    code, body = request(svc.port, "GET", "/v2/models/sent/versions/7")
    assert code == 404 and "version 7 of model 'sent' is not serving" in body["error"]
    code, hdrs, raw = _raw(svc.port, INFER, b"", method="PUT")
    assert code == 405 and hdrs["allow"] == "POST" and set(json.loads(raw)) == {"error"}
    code, hdrs, raw = _raw(svc.port, "/v2/models/sent", b"", method="POST")
    assert code == 405 and hdrs["allow"] == "GET"


def test_lean_path_and_handler_answer_alike(svc, tiny_store, tmp_path):
    """server.fast_predict false sends infer and POST /predict through the
    RequestHandlers (InferHandler, PredictHandler) instead of the lean path:
    same statuses, headers, bytes, each request counted once."""
    root = str(tmp_path / "models")
    shutil.copytree(tiny_store, root)
    cfg = str(tmp_path / "config.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        fh.write(CONFIG + "server:\n  fast_predict: false\n")
    slow = Service(root, args=["--config", cfg])
    try:
        code, body = slow.mpost("/apply", {"name": "sent", "version": 1}, timeout=180)
        assert code == 200, body
        binary, bheaders = _binary_request(_bytes("好评".encode(), b"awful"), 2)
        cases = [
            (INFER, binary, bheaders),
            ("/v2/models/sent/versions/1/infer", json.dumps({
                "id": "x", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                       "data": ["love it"]}],
                "outputs": [{"name": "scores", "parameters": {"classification": 2}},
                            {"name": "label", "parameters": {"binary_data": True}}]}).encode(),
             {}),
            (INFER, b"{not json", {}),
            ("/v2/models/nope/infer", binary, bheaders),
            ("/v2/models/sent/versions/3/infer", binary, bheaders),
            (INFER, b"x" * 5000, {}),
        ]
        for path, body, headers in cases:
            fast = _raw(svc.port, path, body, headers)
            handler = _raw(slow.port, path, body, headers)
            assert fast[0] == handler[0], (path, fast, handler)
            for h in ("content-type", "inference-header-content-length"):
                assert fast[1].get(h) == handler[1].get(h), (path, h, fast[1], handler[1])
            assert fast[2] == handler[2], (path, fast[2], handler[2])
        assert _raw(svc.port, "/v2/models/%ff/infer", binary, bheaders)[0] == 400
        assert _raw(slow.port, "/v2/models/%ff/infer", binary, bheaders)[0] == 400
        # POST /predict: the lean path and PredictHandler run the same pipeline
        js = {"Content-Type": "application/json"}
        predicts = [
            (b'{"text": "love it", "top_k": 2}', {**js, "X-Request-Id": "same-1"}),
            (b'{"texts": ["a", "b"], "min_score": 0.99}', {**js, "X-Request-Id": "same-2"}),
            (b'{"text": "   "}', {**js, "X-Request-Id": "same-3"}),
            (b'{"text": "x", "model": "nope"}', {**js, "X-Request-Id": "same-4"}),
            (b'{"text": "x", "explain": 3}', {**js, "X-Request-Id": "same-5"}),
            (b"{not json", js),
            (b'{"text": "x"}', {**js, "X-Request-Id": "bad id!"}),
            (b'{"text": "' + b"x" * 5000 + b'"}', js),
        ]
        before = _predict_counts(slow)
        for body, headers in predicts:
            fast = _raw(svc.port, "/predict", body, headers)
            handler = _raw(slow.port, "/predict", body, headers)
            assert fast[0] == handler[0], (body, fast, handler)
            assert fast[1]["content-type"] == handler[1]["content-type"], (body, fast, handler)
            if "X-Request-Id" in headers:  # else each made its own
                assert fast[1].get("x-request-id") == handler[1].get("x-request-id"), body
            else:
                assert len(fast[1]["x-request-id"]) == len(handler[1]["x-request-id"]) == 42
            assert fast[2] == handler[2], (body, fast[2], handler[2])
        after = _predict_counts(slow)
        assert sum(after.values()) - sum(before.values()) == len(predicts)  # each once
        assert after.get(("sent", "200"), 0) - before.get(("sent", "200"), 0) == 2
        # a Content-Length that is not a number: the same JSON 400 on both paths
        # (the httptools server refuses it as it parses; under Tornado's server
        # the handlers and the lean path answer it alike: test_httpwire.py)
        for path in ("/predict", INFER):
            fast = _bad_length(svc.port, path)
            handler = _bad_length(slow.port, path)
            assert fast == handler, (path, fast, handler)
            assert fast[0] == 400 and b"Content-Length" in fast[2], (path, fast)
            assert json.loads(fast[2])["error"]["code"] == "bad_request", fast
    finally:
        slow.stop()


def _bad_length(port: int, path: str) -> tuple[int, str | None, bytes]:
    """(status, Content-Type, body) of a POST declaring `Content-Length: ten`
    (http.client writes a right one itself, hence the socket)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     "Content-Type: application/json\r\nContent-Length: ten\r\n\r\n"
                     '{"text": "x"}'.encode())
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.getheader("Content-Type"), resp.read()


def _predict_counts(svc: Service) -> dict[tuple[str, str], float]:
    """textswap_requests_total of api="predict" by (model, code)."""
    code, _, raw = _raw(svc.mport, "/metrics", b"", svc.auth(), method="GET")
    assert code == 200
    out: dict[tuple[str, str], float] = {}
    for line in raw.decode().splitlines():
        if line.startswith("textswap_requests_total{") and 'api="predict"' in line:
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:
                                                           line.index("}")].split(","))
            key = (labels["model"].strip('"'), labels["code"].strip('"'))
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
