"""OpenAPI 3.0 documents of the two APIs, served at GET /openapi.json on each port.

The documents are built from the running config, so the limits they state
(body size, texts per request, characters per text, top_k) are the ones the
handlers enforce, and the management API declares its bearer token only when
one is configured. Every status a handler can answer is listed with the one
error body shape ``{"error": {"code", "message"}}`` that ``write_error``
writes. tests/test_openapi.py fuzzes both live APIs against these documents:
when a handler changes what it accepts or answers, change this file with it.
"""
from __future__ import annotations

import copy
import re
from typing import Any

import dataset
from frontend.base import JsonHandler
from frontend.oip_spec import oip_paths
from jobs import STATES
# the validation tables themselves, so the document cannot drift from them
from model_worker.params import _BOOL_FIELDS, _CHOICES, _FLOAT_RANGES, _INT_RANGES, DEFAULT_PARAMS
from store import NAME_RE

JSON = "application/json"
S = dict[str, Any]

# -- building blocks -------------------------------------------------------------------
# store.check_name: NAME_RE (fullmatch, so anchored here: JSON Schema patterns
# search), no "..", and no newline (Python's "$" also matches before a final one).
# Same schema in the path and in bodies.
NAME: S = {"type": "string", "pattern": f"^{NAME_RE.pattern}$", "maxLength": 64,
           "not": {"pattern": r"\.\.|\n"},
           "description": "letters, digits, '_', '-', '.'; starts with a letter or digit; "
                          "no '..'", "example": "sent"}
VERSION: S = {"type": "integer", "minimum": 1, "example": 1}
MODEL_REF: S = {"type": "object", "required": ["name", "version"],
                "properties": {"name": {"type": "string"}, "version": {"type": "integer"}}}
ANY_OBJECT: S = {"type": "object"}

ERROR: S = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["code", "message"], "additionalProperties": False,
        "properties": {"code": {"type": "string", "example": "invalid_field"},
                       "message": {"type": "string"}}}},
}


def _json(schema: S, description: str, headers: S | None = None) -> S:
    out: S = {"description": description, "content": {JSON: {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _err(description: str) -> S:
    return _json({"$ref": "#/components/schemas/Error"}, description)


def _body(schema: S, required: bool = True) -> S:
    return {"required": required, "content": {JSON: {"schema": schema}}}


def _body_errors(cfg: Any) -> S:
    """What JsonHandler.json_body / json_object answer for any JSON body."""
    return {
        "413": _err(f"body over limits.max_body_bytes ({cfg['limits']['max_body_bytes']} "
                    "bytes)"),
        "415": _err("Content-Type is not application/json (or */*+json)"),
    }


def _doc(title: str, description: str, paths: S, schemas: S, security: bool) -> S:
    paths = copy.deepcopy(paths)  # the shared pieces below must stay unchanged
    doc: S = {
        "openapi": "3.0.3",
        "info": {"title": title, "version": "1", "description": description},
        "paths": paths,
        "components": {"schemas": {"Error": ERROR, **schemas}},
    }
    if security:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    unauthorized = _err("missing or wrong 'Authorization: Bearer <token>'")
    for path, item in paths.items():
        for method, op in item.items():
            if method == "parameters":
                continue
            # e.g. GET /models/{name} -> get_models_name; links refer to these
            op["operationId"] = "_".join([method, *re.findall(r"\w+", path)])
            if security:
                op["responses"]["401"] = unauthorized
    return doc


def _get(summary: str, ok: S, **more: S) -> S:
    return {"get": {"summary": summary, "responses": {"200": ok, **more}}}


HEALTH = _get("Liveness: the process answers.",
              _json({"type": "object", "required": ["status"],
                     "properties": {"status": {"type": "string", "enum": ["ok"]}}}, "alive"))
SPEC = _get("This OpenAPI document.", _json(ANY_OBJECT, "OpenAPI 3.0 document"))


# -- inference API -----------------------------------------------------------------------
def inference_spec(cfg: Any) -> S:
    lim = cfg["limits"]
    text: S = {"type": "string", "minLength": 1, "maxLength": lim["max_text_chars"],
               "pattern": r"\S", "description": "not blank; valid Unicode"}
    request: S = {
        "type": "object", "additionalProperties": False,
        "description": "exactly one of 'text' or 'texts'",
        "oneOf": [{"required": ["text"]}, {"required": ["texts"]}],
        "properties": {
            "text": text,
            "texts": {"type": "array", "items": text, "minItems": 1,
                      "maxItems": lim["max_texts"]},
            "top_k": {"type": "integer", "minimum": 1, "maximum": lim["max_top_k"],
                      "default": lim["default_top_k"],
                      "description": "entries in 'top' (at most the number of labels)"},
        },
        "example": {"text": "非常好用", "top_k": 2},
    }
    scored: S = {"type": "object", "required": ["label", "score"],
                 "properties": {"label": {"type": "string"}, "score": {"type": "number"}}}
    prediction: S = {"type": "object", "required": ["label", "score", "top"],
                     "properties": {"label": {"type": "string"}, "score": {"type": "number"},
                                    "top": {"type": "array", "items": scored, "minItems": 1}}}
    response: S = {"type": "object", "required": ["model", "predictions"],
                   "properties": {"model": MODEL_REF,
                                  "predictions": {"type": "array", "items": prediction}}}
    paths: S = {
        "/predict": {"post": {
            "summary": "Classify one text or a batch with the serving model.",
            "requestBody": _body({"$ref": "#/components/schemas/PredictRequest"}),
            "responses": {
                "200": _json({"$ref": "#/components/schemas/PredictResponse"},
                              "one prediction per text, in order"),
                "400": _err("not JSON, not an object, unknown field, both or neither of "
                            "text/texts, a blank or non-string text, bad top_k"),
                **_body_errors(cfg),
                "413": _err(f"body over limits.max_body_bytes, or more than "
                            f"{lim['max_texts']} texts"),
                "422": _err(f"a text over limits.max_text_chars ({lim['max_text_chars']} "
                            "characters; code text_too_long)"),
                "500": _err("the model failed on this request (the worker lives on)"),
                "503": _err("no model serving, the worker is overloaded, or it died twice"),
                "504": _err("no answer within worker.request_timeout"),
            }}},
        "/healthz": HEALTH,
        "/readyz": _get("Readiness: a model is serving.",
                        _json({"type": "object", "required": ["status", "model"],
                               "properties": {"status": {"type": "string", "enum": ["ready"]},
                                              "model": MODEL_REF}}, "serving"),
                        **{"503": _err("no model is serving yet")}),
        "/openapi.json": SPEC,
    }
    oip, oip_schemas = oip_paths(lim, text, NAME)  # Open Inference Protocol v2
    paths.update(oip)
    return _doc("textswap inference API", "Predictions from the applied model.", paths,
                {"PredictRequest": request, "PredictResponse": response, **oip_schemas},
                security=False)


# -- management API ----------------------------------------------------------------------
def _params_schema() -> S:
    props: S = {}
    for field, default in DEFAULT_PARAMS.items():
        if field in _INT_RANGES:
            low, high = _INT_RANGES[field]
            props[field] = {"type": "integer", "minimum": low, "maximum": high}
        elif field in _FLOAT_RANGES:
            low, high, exclusive = _FLOAT_RANGES[field]
            props[field] = {"type": "number", "minimum": low, "maximum": high,
                            "exclusiveMinimum": exclusive}
        elif field in _BOOL_FIELDS:
            props[field] = {"type": "boolean"}
        else:
            props[field] = {"type": "string", "enum": list(_CHOICES[field])}
        props[field]["default"] = default
    return {"type": "object", "additionalProperties": False, "properties": props,
            "description": "training parameters; absent ones take the defaults"}


def _train_request() -> S:
    example: S = {"type": "object", "required": ["text", "label"],
                  "properties": {"text": {"type": "string", "minLength": 1,
                                          "maxLength": dataset.MAX_TEXT_CHARS,
                                          "pattern": r"\S"},
                                 "label": {"oneOf": [{"type": "string", "pattern": r"\S"},
                                                     {"type": "integer"}]}}}
    data: S = {
        "type": "object", "additionalProperties": False,
        "description": "exactly one of 'path' (a UTF-8 .jsonl/.csv/.tsv file under the "
                       "configured data roots) or inline 'examples'; at least two labels "
                       "with two examples each",
        "oneOf": [{"required": ["path"]}, {"required": ["examples"]}],
        "properties": {
            "path": {"type": "string", "minLength": 1, "pattern": r"\S"},
            "examples": {"type": "array", "minItems": 2 * dataset.MIN_PER_LABEL,
                         "maxItems": dataset.MAX_EXAMPLES, "items": example},
            "labels": {"type": "array", "uniqueItems": True, "minItems": 2,
                       "items": {"type": "string", "pattern": r"\S"},
                       "nullable": True,
                       "description": "the declared label set (null or absent: not "
                                      "declared); compared after trimming spaces; every "
                                      "declared label needs examples, and every example's "
                                      "label must be declared"},
        },
    }
    # a valid request: fuzzing's examples phase trains one tiny model with it
    texts = {"pos": ["great, love it", "works well"], "neg": ["broken again", "awful"]}
    request_example = {"name": "example", "apply": False, "params": {"epochs": 1},
                       "data": {"examples": [{"text": t, "label": label}
                                             for label, ts in texts.items() for t in ts]}}
    data["example"] = request_example["data"]
    return {"type": "object", "additionalProperties": False, "required": ["name", "data"],
            "example": request_example,
            "properties": {"name": NAME, "data": data,
                           "params": {"allOf": [{"$ref": "#/components/schemas/TrainParams"}],
                                      "nullable": True, "description": "null: the defaults"},
                           "apply": {"type": "boolean", "default": False,
                                     "description": "apply the model once trained"}}}


def _job_schema() -> S:
    nullable_obj: S = {"type": "object", "nullable": True}
    return {"type": "object",
            "required": ["id", "name", "state", "apply", "data", "progress", "created_at",
                         "started_at", "finished_at", "elapsed_s", "result", "metrics", "error",
                         "exitcode", "log_tail", "applied", "pid"],
            "properties": {
                "id": {"type": "string"}, "name": {"type": "string"},
                "state": {"type": "string", "enum": list(STATES)},
                "apply": {"type": "boolean"}, "params": ANY_OBJECT, "data": ANY_OBJECT,
                "progress": ANY_OBJECT, "history": {"type": "array", "items": ANY_OBJECT},
                "created_at": {"type": "number"},
                "started_at": {"type": "number", "nullable": True},
                "finished_at": {"type": "number", "nullable": True},
                "elapsed_s": {"type": "number", "nullable": True},
                "result": {**MODEL_REF, "nullable": True}, "metrics": nullable_obj,
                "error": {"type": "string", "nullable": True},
                "exitcode": {"type": "integer", "nullable": True},
                "log_tail": {"type": "string", "nullable": True},
                "applied": nullable_obj, "pid": {"type": "integer", "nullable": True}}}


def management_spec(cfg: Any) -> S:
    job_ref = {"$ref": "#/components/schemas/Job"}
    one_job = _json({"type": "object", "required": ["job"], "properties": {"job": job_ref}},
                    "the job")
    model_version: S = {"type": "object", "required": ["version"],
                        "properties": {"version": {"type": "integer"},
                                       "labels": {"type": "array",
                                                  "items": {"type": "string"}}}}
    model: S = {"type": "object", "required": ["name", "latest", "versions"],
                "properties": {"name": {"type": "string"}, "latest": {"type": "integer"},
                               "versions": {"type": "array", "items": model_version}}}
    name_param = {"name": "name", "in": "path", "required": True, "schema": NAME}
    version_param = {"name": "version", "in": "path", "required": True,
                     "schema": {**VERSION, "maximum": 999_999_999}}
    id_param = {"name": "id", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": "^[^/]{1,64}$"}}
    bad_path = _err("invalid model name, or a path not valid UTF-8 once %-decoded")
    apply_request: S = {"type": "object", "additionalProperties": False, "required": ["name"],
                        "properties": {"name": NAME,
                                       "version": {**VERSION, "nullable": True,
                                                   "description": "null or absent: latest"}},
                        "example": {"name": "sent", "version": 1}}
    apply_result: S = {"type": "object", "required": ["previous", "current"],
                       "properties": {"previous": {**MODEL_REF, "nullable": True},
                                      "current": MODEL_REF, "phases_s": ANY_OBJECT,
                                      "total_s": {"type": "number"}}}
    status: S = {"type": "object", "required": ["supervisor", "serving", "workers", "standby",
                                                "restarts", "failed_models", "jobs"],
                 "properties": {"supervisor": ANY_OBJECT,
                                "serving": {"type": "object", "nullable": True},
                                "workers": {"type": "array", "items": ANY_OBJECT},
                                "standby": {"type": "object", "nullable": True},
                                "restarts": {"type": "integer"},
                                "failed_models": {"type": "array", "items": ANY_OBJECT},
                                "jobs": {"type": "array", "items": ANY_OBJECT}}}
    paths: S = {
        "/apply": {"post": {
            "summary": "Blue/green switch to a model version (the latest when none given).",
            "requestBody": _body(apply_request),
            "responses": {
                "200": _json(apply_result, "now serving; previous, current and phase times"),
                "400": _err("not JSON, unknown field, missing or invalid name, bad version"),
                "404": _err("no such model or version in the store"),
                **_body_errors(cfg),
                "422": _err("the version's files are invalid, or the model failed to "
                            "load or warm up; the serving model serves on"),
                "503": _err("no worker process could be started in time (worker."
                            "boot_timeout), or the service is shutting down"),
                "504": _err("the model did not load and warm up within "
                            "worker.load_timeout"),
            }}},
        "/status": _get("Supervisor, workers, standby, restarts, jobs.", _json(status, "status")),
        "/models": _get("Every model in the store, and the serving one.",
                        _json({"type": "object", "required": ["models", "serving"],
                               "properties": {"models": {"type": "array", "items": model},
                                              "serving": {**MODEL_REF, "nullable": True}}},
                              "the store")),
        "/models/{name}": {
            "parameters": [name_param],
            **_get("One model and its versions.", _json(model, "the model"),
                   **{"400": bad_path, "404": _err("no such model")})},
        "/models/{name}/{version}": {
            "parameters": [name_param, version_param],
            **_get("meta.json of one version.", _json(ANY_OBJECT, "the version's meta.json"),
                   **{"400": bad_path, "404": _err("no such model or version"),
                      "500": _err("the version's meta.json is unreadable")})},
        "/models/{name}/{version}/artifact": {
            "parameters": [name_param, version_param],
            **_get("The version folder as a .tar.gz (model.keras, meta.json, saved_model/: "
                   "a TensorFlow SavedModel that loads without this project).",
                   {"description": "the archive; members named <name>/<version>/...",
                    "content": {"application/gzip": {"schema": {"type": "string",
                                                                "format": "binary"}}}},
                   **{"400": bad_path, "404": _err("no such model or version")})},
        "/train": {
            "post": {
                "summary": "Queue a training job.",
                "requestBody": _body({"$ref": "#/components/schemas/TrainRequest"}),
                "responses": {
                    "202": {**_json({"type": "object", "required": ["job"],
                                     "properties": {"job": job_ref}}, "queued",
                                    headers={"Location": {"schema": {"type": "string"},
                                                          "required": True}}),
                            "links": {op: {"operationId": op,
                                           "parameters": {"id": "$response.body#/job/id"}}
                                      for op in ("get_train_id", "delete_train_id")}},
                    "400": _err("not JSON, unknown field, invalid name, params or data"),
                    **_body_errors(cfg)}},
            "get": {"summary": "Recent jobs, newest first.",
                    "responses": {"200": _json({
                        "type": "object", "required": ["jobs"],
                        "properties": {"jobs": {"type": "array", "items": ANY_OBJECT}}},
                        "the jobs")}},
        },
        "/train/{id}": {
            "parameters": [id_param],
            "get": {"summary": "One job: state, progress, history, result.",
                    "responses": {"200": one_job, "400": bad_path,
                                  "404": _err("no such job")}},
            "delete": {"summary": "Cancel a queued or running job.",
                       "description": "The trainer process (if any) is stopped and nothing "
                                      "is published. The job is not deleted: it stays "
                                      "readable at GET /train/{id} and in GET /train with "
                                      "state `cancelled` (the answer already shows it), "
                                      "until training.keep_jobs newer jobs have finished.",
                       "responses": {"200": one_job, "400": bad_path,
                                     "404": _err("no such job"),
                                     "409": _err("the job has already finished")}},
        },
        "/healthz": HEALTH,
        "/openapi.json": SPEC,
    }
    return _doc("textswap management API",
                "Apply models, inspect the store and the service, train.", paths,
                {"TrainRequest": _train_request(), "TrainParams": _params_schema(),
                 "Job": _job_schema()}, security=bool(cfg.token))


# -- the handlers ------------------------------------------------------------------------
class InferenceSpecHandler(JsonHandler):
    def get(self) -> None:
        self.send_json(inference_spec(self.cfg))


class ManagementSpecHandler(JsonHandler):
    def get(self) -> None:
        self.send_json(management_spec(self.cfg))
