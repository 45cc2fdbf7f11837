"""The Open Inference Protocol routes in the inference API's OpenAPI document.

Only the JSON form of an infer request can be described here; the binary
tensor extension (a JSON header plus raw tensors) is the same request with
`binary_data_size` parameters, see frontend/oip.py. The schemas bound what
the handlers accept (so schema-invalid requests are refused); what a schema
cannot say (the element count must match the shape) is refused with 400.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from frontend.oip import HEADER_LENGTH, INPUT, OUTPUTS

if TYPE_CHECKING:
    from state.config import LimitsSettings

JSON = "application/json"
S = dict[str, Any]

ERROR: S = {"type": "object", "required": ["error"],
            "properties": {"error": {"type": "string"}},
            "description": "the protocol's error shape"}


def _ok(schema: S, description: str) -> S:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _err(description: str) -> S:
    return _ok({"$ref": "#/components/schemas/OipError"}, description)


def oip_paths(lim: LimitsSettings, text: S, name: S) -> tuple[S, S]:
    """(paths, component schemas) of the protocol's REST routes."""
    name_param = {"name": "name", "in": "path", "required": True, "schema": name}
    version_param = {"name": "version", "in": "path", "required": True,
                     "schema": {"type": "string", "pattern": "^[0-9]{1,9}$", "example": "1"}}
    not_serving = _err("the model (or that version of it) is not serving; the message "
                       "names what serves")
    tensor_meta: S = {"type": "object", "required": ["name", "datatype", "shape"],
                      "properties": {"name": {"type": "string"},
                                     "datatype": {"type": "string"},
                                     "shape": {"type": "array", "items": {"type": "integer"}}}}
    metadata: S = {"type": "object",
                   "required": ["name", "versions", "platform", "inputs", "outputs"],
                   "properties": {"name": {"type": "string"},
                                  "versions": {"type": "array", "items": {"type": "string"}},
                                  "platform": {"type": "string"},
                                  "inputs": {"type": "array", "items": tensor_meta},
                                  "outputs": {"type": "array", "items": tensor_meta},
                                  "parameters": {"type": "object", "properties": {
                                      "labels": {"type": "array",
                                                 "items": {"type": "string"}}}}}}
    ready: S = {"type": "object", "required": ["name", "ready"],
                "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                               "ready": {"type": "boolean"}}}
    single = {"type": "array", "items": text, "minItems": 1, "maxItems": 1}
    infer_input: S = {
        "type": "object", "required": ["name", "datatype", "shape", "data"],
        "properties": {
            "name": {"type": "string", "enum": [INPUT]},
            "datatype": {"type": "string", "enum": ["BYTES"]},
            "shape": {"type": "array", "minItems": 1, "maxItems": 2,
                      "items": {"type": "integer", "minimum": 1,
                                "maximum": lim.max_texts},
                      "description": "[n] or [n, 1]; n texts"},
            "data": {"type": "array", "minItems": 1, "maxItems": lim.max_texts,
                     "items": {"anyOf": [text, single]},
                     "description": "n texts, flat (or as rows of one for shape [n, 1])"},
            "parameters": {"type": "object", "properties": {}},
        }}
    output: S = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "enum": list(OUTPUTS)},
        "parameters": {"type": "object", "properties": {
            "binary_data": {"type": "boolean",
                            "description": "answer this output as binary tensor data"},
            "classification": {"type": "integer", "minimum": 0,
                               "description": "scores only: the top k as "
                                              "'score:index:label' strings"}}}}}
    request: S = {
        "type": "object", "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "items": infer_input},
            "outputs": {"type": "array", "minItems": 1, "items": output,
                        "description": "absent: every output"},
            "parameters": {"type": "object", "properties": {
                "binary_data_output": {"type": "boolean"}}},
        },
        "example": {"id": "1", "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [2],
                                           "data": ["非常好用", "terrible"]}],
                    "outputs": [{"name": "label"}, {"name": "scores"}]},
    }
    out_tensor: S = {"type": "object", "required": ["name", "datatype", "shape"],
                     "properties": {"name": {"type": "string"},
                                    "datatype": {"type": "string"},
                                    "shape": {"type": "array", "items": {"type": "integer"}},
                                    "data": {"type": "array"},
                                    "parameters": {"type": "object"}}}
    response: S = {"type": "object", "required": ["model_name", "model_version", "outputs"],
                   "properties": {"model_name": {"type": "string"},
                                  "model_version": {"type": "string"},
                                  "id": {"type": "string"},
                                  "outputs": {"type": "array", "items": out_tensor}}}
    infer_op: S = {"post": {
        "summary": "Open Inference Protocol inference (JSON tensors here; the binary "
                   f"tensor extension with the {HEADER_LENGTH} header works too).",
        "requestBody": {"required": True, "content": {JSON: {
            "schema": {"$ref": "#/components/schemas/InferRequest"}}}},
        "responses": {
            "200": {"description": "the outputs; binary tensor data after the JSON header "
                                   "when any output was asked for as binary",
                    "headers": {HEADER_LENGTH: {"schema": {"type": "integer"},
                                                "description": "length of the JSON header "
                                                               "(binary answers only)"}},
                    "content": {JSON: {"schema": {"$ref": "#/components/schemas/"
                                                          "InferResponse"}},
                                "application/octet-stream": {
                                    "schema": {"type": "string", "format": "binary"}}}},
            "400": _err("malformed request: JSON, tensor names, datatype, shape, element "
                        "count, binary framing, blank texts or texts that are not valid "
                        f"Unicode, more than {lim.max_texts} texts"),
            "404": not_serving,
            "413": _err(f"body (or its decompressed form) over {lim.max_body_bytes} bytes"),
            "422": _err(f"a text over limits.max_text_chars ({lim.max_text_chars} "
                        "characters), as on POST /predict"),
            "415": _err("a Content-Encoding other than gzip or deflate"),
            "500": _err("the model failed on this request"),
            "503": _err("no model serving, or overloaded"),
            "504": _err("no answer within worker.request_timeout"),
        }}}

    def get(summary: str, ok: S, **more: S) -> S:
        return {"get": {"summary": summary, "responses": {"200": ok, **more}}}

    model_meta = get("Model metadata: the input, the outputs, the labels.",
                     _ok({"$ref": "#/components/schemas/ModelMetadata"}, "metadata"),
                     **{"404": not_serving})
    model_ready = get("Model readiness: 200 while it serves.", _ok(ready, "serving"),
                      **{"404": not_serving})
    paths: S = {
        "/v2": get("Server metadata.", _ok({
            "type": "object", "required": ["name", "version", "extensions"],
            "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                           "extensions": {"type": "array", "items": {"type": "string"}}}},
            "name, version, protocol extensions")),
        "/v2/health/live": get("Liveness.", _ok({"type": "object", "required": ["live"],
                                                 "properties": {"live": {"type": "boolean"}}},
                                                "alive")),
        "/v2/health/ready": get(
            "Readiness: 200 while the default model serves, else 400 (as the protocol says: "
            "a 4xx means not ready).",
            _ok({"type": "object", "required": ["ready"],
                 "properties": {"ready": {"type": "boolean"}}}, "ready"),
            **{"400": _ok({"type": "object", "required": ["ready"],
                           "properties": {"ready": {"type": "boolean"}}}, "not ready")}),
        "/v2/models/{name}": {"parameters": [name_param], **model_meta},
        "/v2/models/{name}/versions/{version}": {"parameters": [name_param, version_param],
                                                 **model_meta},
        "/v2/models/{name}/ready": {"parameters": [name_param], **model_ready},
        "/v2/models/{name}/versions/{version}/ready": {
            "parameters": [name_param, version_param], **model_ready},
        "/v2/models/{name}/infer": {"parameters": [name_param], **infer_op},
        "/v2/models/{name}/versions/{version}/infer": {
            "parameters": [name_param, version_param], **infer_op},
    }
    schemas = {"OipError": ERROR, "ModelMetadata": metadata, "InferRequest": request,
               "InferResponse": response}
    return paths, schemas
