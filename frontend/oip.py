"""Open Inference Protocol v2 (REST, "KServe v2") on the inference port.

Lets the clients of Triton, KServe, MLServer and the like call the serving
models unchanged. A model here has one input and two outputs:

    input   text    BYTES  [-1]           UTF-8 texts
    output  label   BYTES  [-1]           the top label of each text
    output  scores  FP32   [-1, n_labels] probabilities, in the order of the
                                          model's `labels` parameter
    output  labels  BYTES  [-1]           multi-label models only: each text's
                                          label set (those clearing their
                                          thresholds, best first) as a JSON array

Both tensor encodings are accepted and produced: JSON (`data` arrays) and the
binary tensor data extension, which the official clients use by default: the
body is the JSON header (its length in the `Inference-Header-Content-Length`
header) followed by raw tensors; BYTES elements are each a 4-byte
little-endian length and the bytes, FP32 is little-endian float32. Outputs
come back binary when the request asks (`binary_data` on an output, or
`binary_data_output` on the request). The classification extension
(`classification: k` on the `scores` output) answers the top k as
"score:index:label" strings. Errors are the protocol's `{"error": "..."}`.

The same limits as POST /predict apply: body size, texts per request,
characters per text, no blank texts. Name and version in the URL must be
what serves: another version is a 404 that says which one serves.
"""
from __future__ import annotations

import array
import json
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tornado.web import HTTPError

from frontend import jsonwire, predictions, request_ids
from frontend.base import ApiError, JsonHandler, loads
from frontend.pipeline import (Call, PipelineHandler, PredictPipeline, PredictRequest,
                               Rendered, Routed, Lookup)
from state.texts import text_problem

if TYPE_CHECKING:
    from frontend.service import ServingView
    from state.config import LimitsSettings

SERVER = "textswap"
SERVER_VERSION = "1"
EXTENSIONS = ["binary_tensor_data", "classification"]
PLATFORM = "keras_textswap"
INPUT = "text"
OUTPUTS = ("label", "scores")
MULTI_OUTPUT = "labels"  # multi-label models: each text's label set
HEADER_LENGTH = "Inference-Header-Content-Length"
_LITTLE = sys.byteorder == "little"
_JSON = "application/json; charset=utf-8"


class OipError(ApiError):
    """A refusal; its message is the whole protocol error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, "oip", message)
        self.status = status


# -- what serves ---------------------------------------------------------------------------
def _not_serving(sup: Lookup, name: str, version: str | None = None) -> OipError:
    names = sup.serving_names()
    serving = ", ".join(repr(n) for n in names) if names else "none"
    if version is not None:
        m = sup.serving_model(name)
        if m is not None:
            return OipError(404, f"version {version} of model '{name}' is not serving; "
                                 f"version {m['version']} is")
    return OipError(404, f"model '{name}' is not serving here (serving: {serving})")


def resolve(sup: Lookup, name: str, version: str | None) -> dict[str, Any]:
    """The serving model named in the URL, or a 404 that says what serves."""
    m = sup.serving_model(name)
    if m is None:
        raise _not_serving(sup, name)
    if version is not None and version != str(m["version"]):
        raise _not_serving(sup, name, version)
    return m


def model_metadata(m: dict[str, Any], info: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {
        "name": m["name"], "versions": [str(m["version"])], "platform": PLATFORM,
        "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                    {"name": "scores", "datatype": "FP32", "shape": [-1, len(m["labels"])]}],
        "parameters": {"labels": list(m["labels"])},
    }
    if info is not None and info["multi_label"]:
        out["outputs"].append({"name": MULTI_OUTPUT, "datatype": "BYTES", "shape": [-1]})
        out["parameters"].update(multi_label=True, thresholds=info["thresholds"],
                                 min_labels=info["min_labels"])
    return out


# -- requests ------------------------------------------------------------------------------
def _decompress(body: bytes, encoding: str | None, cap: int) -> bytes:
    """The body without its Content-Encoding, refusing more than cap bytes out."""
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc not in ("gzip", "deflate"):
        raise OipError(415, f"unsupported Content-Encoding '{enc}'; gzip, deflate or none")
    d = zlib.decompressobj(wbits=31 if enc == "gzip" else 15)
    try:
        out = d.decompress(body, cap + 1)
    except zlib.error as exc:
        raise OipError(400, f"body is not valid {enc} data: {exc}") from None
    if len(out) > cap or d.unconsumed_tail:
        raise OipError(413, f"decompressed body exceeds the limit of {cap} bytes")
    return out


def _split(body: bytes, header_length: str | None) -> tuple[Any, memoryview]:
    """(JSON header, binary section) of an infer body."""
    if header_length is None:
        head, rest = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise OipError(400, f"{HEADER_LENGTH} must be an integer") from None
        if not 0 < n <= len(body):
            raise OipError(400, f"{HEADER_LENGTH} {n} is outside the body of "
                                f"{len(body)} bytes")
        head, rest = body[:n], body[n:]
    try:
        data = loads(head)  # orjson; nesting past base.MAX_DEPTH: 400 too_deep
    except UnicodeDecodeError as exc:
        raise OipError(400, f"inference header is not valid UTF-8: {exc}") from None
    except ValueError as exc:
        raise OipError(400, f"inference header is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OipError(400, "the inference request must be a JSON object")
    return data, memoryview(rest)


def _decode_bytes(raw: memoryview, count: int) -> list[str]:
    """count BYTES elements (4-byte little-endian length + bytes each) as text."""
    out: list[str] = []
    pos, end = 0, len(raw)
    while pos < end:
        if pos + 4 > end:
            raise OipError(400, "binary BYTES tensor: truncated element length")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > end:
            raise OipError(400, f"binary BYTES tensor: element {len(out)} claims {n} bytes, "
                                f"only {end - pos} remain")
        try:
            out.append(str(raw[pos:pos + n], "utf-8"))
        except UnicodeDecodeError:
            raise OipError(400, f"input '{INPUT}' element {len(out)} is not valid "
                                "UTF-8") from None
        pos += n
    if len(out) != count:
        raise OipError(400, f"input '{INPUT}' has {len(out)} elements in its binary data "
                            f"but its shape says {count}")
    return out


def _flatten(data: Any, shape: list[int]) -> list[Any]:
    """The elements of `data`: flat, or nested rows of one for a [n, 1] shape."""
    if not isinstance(data, list):
        raise OipError(400, f"input '{INPUT}': 'data' must be an array of strings")
    if len(shape) == 2 and data and all(isinstance(x, list) for x in data):
        if any(len(x) != 1 for x in data):
            raise OipError(400, f"input '{INPUT}': nested rows must hold one element each "
                                "for shape [n, 1]")
        return [x[0] for x in data]
    return data


def _params(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise OipError(400, f"{where}: 'parameters' must be an object")
    return params


def _texts(inp: Any, binary: memoryview, limits: LimitsSettings) -> list[str]:
    if not isinstance(inp, dict):
        raise OipError(400, "each input must be an object")
    if inp.get("name") != INPUT:
        raise OipError(400, f"unknown input {inp.get('name')!r}; this model has one "
                            f"input, '{INPUT}' (BYTES)")
    if inp.get("datatype") != "BYTES":
        raise OipError(400, f"input '{INPUT}' must have datatype BYTES, "
                            f"got {inp.get('datatype')!r}")
    shape = inp.get("shape")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 2 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)
            or (len(shape) == 2 and shape[1] != 1)):
        raise OipError(400, f"input '{INPUT}' shape must be [n] (or [n, 1]), got {shape!r}")
    count = shape[0]
    if count == 0:
        raise OipError(400, f"input '{INPUT}' has no elements")
    if count > limits.max_texts:
        raise OipError(400, f"input '{INPUT}' has {count} elements; the limit is "
                            f"{limits.max_texts}")
    params = _params(inp, f"input '{INPUT}'")
    size = params.get("binary_data_size")
    if size is not None:
        if "data" in inp:
            raise OipError(400, f"input '{INPUT}' has both 'data' and binary_data_size")
        if isinstance(size, bool) or not isinstance(size, int) or size != len(binary):
            raise OipError(400, f"input '{INPUT}' binary_data_size {size!r} does not match "
                                f"the {len(binary)} bytes after the inference header")
        texts = _decode_bytes(binary, count)
    else:
        if len(binary):
            raise OipError(400, "binary data after the inference header, but no input "
                                "declares binary_data_size")
        if "data" not in inp:
            raise OipError(400, f"input '{INPUT}' has neither 'data' nor binary_data_size")
        texts = _flatten(inp["data"], shape)
        if len(texts) != count:
            raise OipError(400, f"input '{INPUT}' has {len(texts)} elements but its shape "
                                f"says {count}")
    cap = limits.max_text_chars
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise OipError(400, f"input '{INPUT}' element {i} must be a string")
        problem = text_problem(t, f"input '{INPUT}' element {i}", cap)
        if problem is not None:  # /predict's rule and statuses; OIP's error body
            raise OipError(problem[0], problem[2])
    return texts


def _flag(params: dict[str, Any], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise OipError(400, f"parameter '{key}' must be a boolean")
    return value


def _outputs(req: dict[str, Any], binary_default: bool, multi: bool = False
             ) -> list[tuple[str, bool, int]]:
    """(name, binary, classification k or 0) of each output to answer."""
    names = OUTPUTS + ((MULTI_OUTPUT,) if multi else ())
    if "outputs" not in req:
        return [(name, binary_default, 0) for name in names]
    wanted = req["outputs"]
    if not isinstance(wanted, list) or not wanted:
        raise OipError(400, "'outputs' must be a non-empty array")
    out = []
    for o in wanted:
        if not isinstance(o, dict) or o.get("name") not in names:
            name = o.get("name") if isinstance(o, dict) else o
            why = (f"; '{MULTI_OUTPUT}' is for multi-label models only" if name == MULTI_OUTPUT
                   else "")
            raise OipError(400, f"unknown output {name!r}; outputs: {', '.join(names)}{why}")
        params = _params(o, f"output '{o['name']}'")
        k = params.get("classification", 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise OipError(400, "'classification' must be a non-negative integer")
        if k and o["name"] != "scores":
            raise OipError(400, "'classification' applies to the 'scores' output only")
        out.append((o["name"], _flag(params, "binary_data", binary_default), k))
    return out


def parse_infer(body: bytes, headers: Any, limits: LimitsSettings, multi: bool = False
                ) -> tuple[list[str], list[tuple[str, bool, int]], Any]:
    """(texts, outputs, request id) of an infer request, or an OipError."""
    body = _decompress(body, headers.get("Content-Encoding"), limits.max_body_bytes)
    req, binary = _split(body, headers.get(HEADER_LENGTH))
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1:
        raise OipError(400, f"'inputs' must be an array with one input, '{INPUT}' (BYTES)")
    texts = _texts(inputs[0], binary, limits)
    params = _params(req, "the request")
    outputs = _outputs(req, _flag(params, "binary_data_output", False), multi)
    rid = req.get("id")
    if "id" in req and not isinstance(rid, str):
        raise OipError(400, "'id' must be a string")
    return texts, outputs, rid


# -- responses -----------------------------------------------------------------------------
def _bytes_tensor(items: list[str]) -> bytes:
    parts = []
    for s in items:
        b = s.encode("utf-8")
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def _fp32(values: list[float]) -> bytes:
    a = array.array("f", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def infer_response(model: dict[str, Any], labels: list[str], scores: list[list[float]],
                   outputs: list[tuple[str, bool, int]], rid: Any,
                   info: dict[str, Any] | None = None) -> tuple[bytes, int | None]:
    """(body, JSON header length or None when all outputs are JSON)."""
    n, width = len(scores), len(labels)
    tensors, blobs = [], []
    for name, binary, k in outputs:
        if name == MULTI_OUTPUT:
            data: Any = [json.dumps([labels[i] for i in predictions.label_set(row, info)],  # type: ignore[arg-type]  # given with it
                                    ensure_ascii=False)
                         for row in scores]
            t: dict[str, Any] = {"name": name, "datatype": "BYTES", "shape": [n]}
        elif name == "label":
            data = [labels[max(range(width), key=row.__getitem__)] for row in scores]
            t = {"name": name, "datatype": "BYTES", "shape": [n]}
        elif k:
            k = min(k, width)
            data = []
            for row in scores:
                top = sorted(range(width), key=row.__getitem__, reverse=True)[:k]
                data.extend(f"{row[i]:f}:{i}:{labels[i]}" for i in top)
            t = {"name": name, "datatype": "BYTES", "shape": [n, k]}
        else:
            data = [x for row in scores for x in row]
            t = {"name": name, "datatype": "FP32", "shape": [n, width]}
        if binary:
            blob = _bytes_tensor(data) if t["datatype"] == "BYTES" else _fp32(data)
            t["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            t["data"] = data
        tensors.append(t)
    answer: dict[str, Any] = {"model_name": model["name"],
                              "model_version": str(model["version"]), "outputs": tensors}
    if rid is not None:
        answer["id"] = rid
    head = jsonwire.dumps(answer)
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)


@dataclass(slots=True)
class InferRequest(PredictRequest):
    """An infer request: the texts, and what its answer is to hold."""
    served: dict[str, Any] = field(default_factory=dict)  # what served when it came
    version: str | None = None  # the version its URL names
    outputs: list[tuple[str, bool, int]] = field(default_factory=list)
    echo_id: Any = None  # the body's "id", answered back


class InferWire:
    """POST /v2/models/<name>[/versions/<v>]/infer: JSON or binary tensors in
    and out; errors as {"error": "<message>"}."""

    api = "oip_infer"

    def request_id(self, call: Call) -> str | None:
        return None  # the body's "id" may give it: known after parsing

    def parse(self, pipe: PredictPipeline, call: Call, rid: str | None) -> PredictRequest:
        if call.refused is not None:
            raise call.refused
        name, version = call.args
        assert name is not None  # the route's pattern always has it
        served = resolve(pipe.serving, name, version)  # 404 before parsing: it must serve
        info = pipe.info(served)
        pipe.check_declared(call, oip=True)
        texts, outputs, echo = parse_infer(call.body, call.headers, pipe.limits,
                                           info["multi_label"])
        # X-Request-Id, else the body's id (in the key's namespace when a predict key is set)
        request_id: str | None = request_ids.request_id(call.headers, echo, call.namespace)
        if pipe.foreign(call):
            request_id = None  # another site's page: answered, never logged
        return InferRequest(texts, name, request_id=request_id, log_k=5, served=served,
                            version=version, outputs=outputs, echo_id=echo,
                            chosen=request_ids.chosen(call.headers, echo))

    def render(self, pipe: PredictPipeline, req: PredictRequest, routed: Routed) -> Rendered:
        assert isinstance(req, InferRequest)
        model, name = routed.model, req.model
        assert name is not None
        if req.version is not None and str(model["version"]) != req.version:
            # an apply swapped versions while this request waited: say so, don't mislabel
            raise _not_serving(pipe.serving, name, req.version)
        if (any(o[0] == MULTI_OUTPUT for o in req.outputs)
                and model.get("version") != req.served.get("version")
                and not routed.info["multi_label"]):  # an apply swapped versions meanwhile
            raise OipError(409, f"model '{name}' is no longer multi-label (a new version "
                                "serves)")
        out, head = infer_response(model, routed.labels, routed.scores, req.outputs,
                                   req.echo_id, routed.info)
        headers = ({"Content-Type": _JSON} if head is None else
                   {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(head)})
        if req.request_id is not None:  # None: not logged (another site's page sent it)
            headers[request_ids.HEADER] = req.request_id
        return out, headers, None

    def error(self, exc: ApiError, rid: str | None) -> tuple[bytes, dict[str, str]]:
        return (json.dumps({"error": exc.message}, ensure_ascii=False).encode(),
                {"Content-Type": _JSON})


INFER = InferWire()


# -- handlers ------------------------------------------------------------------------------
class OipHandler(JsonHandler):
    """Errors in the protocol's shape: {"error": "<message>"}."""

    metric_api = "oip"

    def oip_json(self, data: Any, status: int = 200) -> None:
        self.send_json(data, status)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ApiError):
            message = exc.message
        elif isinstance(exc, HTTPError):
            message = exc.log_message or self._reason
        else:
            message = "internal error"
        self.set_header("Content-Type", "application/json; charset=utf-8")
        if status_code == 405:
            self.set_header("Allow", ", ".join(self.allowed_methods()))
        self.finish(json.dumps({"error": message}, ensure_ascii=False))


class ServerMetadataHandler(OipHandler):
    def get(self) -> None:
        self.oip_json({"name": SERVER, "version": SERVER_VERSION, "extensions": EXTENSIONS})


class LiveHandler(OipHandler):
    needs_key = False  # a probe, like /healthz: no predict key

    def get(self) -> None:
        self.oip_json({"live": True})


class ServerReadyHandler(OipHandler):
    needs_key = False  # a probe, like /readyz: no predict key
    parts: ServingView

    def get(self) -> None:
        # the protocol: 200 means ready, a 4xx means not (Triton answers 400)
        ready = bool(self.parts.ready)
        self.oip_json({"ready": ready}, 200 if ready else 400)


class ModelMetadataHandler(OipHandler):
    parts: PredictPipeline  # its serving view resolves the model, its info() describes it

    def get(self, name: str, version: str | None = None) -> None:
        m = resolve(self.parts.serving, name, version)
        self.metric_model = m
        self.oip_json(model_metadata(m, self.parts.info(m)))


class ModelReadyHandler(OipHandler):
    parts: ServingView

    def get(self, name: str, version: str | None = None) -> None:
        m = resolve(self.parts, name, version)
        self.metric_model = m
        self.oip_json({"name": m["name"], "version": str(m["version"]), "ready": True})


class InferHandler(PipelineHandler, OipHandler):
    """The infer through Tornado's RequestHandler (fastpath.py answers it
    with less overhead when server.fast_predict is on)."""

    metric_api = "oip_infer"

    async def post(self, name: str, version: str | None = None) -> None:
        await self.answer(INFER, (name, version))


_MODEL = r"/v2/models/([^/]+)"
_VERSION = r"/versions/([^/]+)"
# infer's routes, (name) and (name, version): the RequestHandlers' and the lean
# path's (frontend/fastpath.py), which Tornado's routing does not see
INFER_PATHS = (_MODEL + r"/infer", _MODEL + _VERSION + r"/infer")


def routes(kw: dict[str, Any], pipeline: PredictPipeline, serving: ServingView
           ) -> list[tuple[str, type, dict[str, Any]]]:
    pkw = {**kw, "parts": pipeline}
    skw = {**kw, "parts": serving}
    return [
        (r"/v2", ServerMetadataHandler, kw),
        (r"/v2/health/live", LiveHandler, kw),
        (r"/v2/health/ready", ServerReadyHandler, skw),
        (_MODEL, ModelMetadataHandler, pkw),
        (_MODEL + _VERSION, ModelMetadataHandler, pkw),
        (_MODEL + r"/ready", ModelReadyHandler, skw),
        (_MODEL + _VERSION + r"/ready", ModelReadyHandler, skw),
        *((path, InferHandler, pkw) for path in INFER_PATHS),
    ]
