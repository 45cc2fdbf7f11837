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
from typing import TYPE_CHECKING, Any

from state import dataset
from frontend.base import JsonHandler
from frontend.handlers import MAX_REPLICAS
from frontend.oip_spec import oip_paths
from control.jobs import STATES
# the validation tables themselves, so the document cannot drift from them
from model_worker.params import _BOOL_FIELDS, _CHOICES, _FLOAT_RANGES, _INT_RANGES, AUTO_VIEWS, DEFAULT_PARAMS
from state.store import NAME_RE

if TYPE_CHECKING:
    from state.config import Config

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
        "type": "object", "required": ["code", "message"],
        "description": "some errors add details beside code and message: 'serving' (the "
                       "models that serve) on model_not_serving, 'gate' (the figures) on "
                       "quality_gate, the worker counts on memory_budget, 'this_node' on a "
                       "cluster error",
        "properties": {"code": {"type": "string", "example": "invalid_field"},
                       "message": {"type": "string"}}}},
}
# a number from 0 to 1 (NaN and infinities are not JSON)
FRACTION: S = {"type": "number", "minimum": 0, "maximum": 1}


def _json(schema: S, description: str, headers: S | None = None) -> S:
    out: S = {"description": description, "content": {JSON: {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _err(description: str) -> S:
    return _json({"$ref": "#/components/schemas/Error"}, description)


def _body(schema: S, required: bool = True) -> S:
    return {"required": required, "content": {JSON: {"schema": schema}}}


def _body_errors(cfg: Config) -> S:
    """What JsonHandler.json_body / json_object answer for any JSON body."""
    return {
        "413": _err(f"body over limits.max_body_bytes ({cfg.limits.max_body_bytes} "
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
    unauthorized = _err("no 'Authorization: Bearer <key>', or a key that is none of this "
                        "service's")
    wrong_key = _err("a key of another scope (wrong_key): GET routes take the admin or "
                     "review key, the others the admin key (POST /feedback and /try: admin "
                     "or review)")
    for path, item in paths.items():
        for method, op in item.items():
            if method == "parameters":
                continue
            # e.g. GET /models/{name} -> get_models_name; links refer to these
            op["operationId"] = "_".join([method, *re.findall(r"\w+", path)])
            no_key = op.pop("x-no-key", None)  # e.g. POST /auth/session
            if security and no_key:
                op["security"] = []
            elif security:
                op["responses"]["401"] = unauthorized
                op["responses"]["403"] = wrong_key
    return doc


def _get(summary: str, ok: S, **more: S) -> S:
    return {"get": {"summary": summary, "responses": {"200": ok, **more}}}


HEALTH = _get("Liveness: the process answers.",
              _json({"type": "object", "required": ["status"],
                     "properties": {"status": {"type": "string", "enum": ["ok"]}}}, "alive"))
SPEC = _get("This OpenAPI document.", _json(ANY_OBJECT, "OpenAPI 3.0 document"))


# -- inference API -----------------------------------------------------------------------
def inference_spec(cfg: Config, predict_key: bool = False) -> S:
    """The inference port's document; predict_key: a predict key guards
    /predict and the protocol's model routes (frontend/auth.py accesses)."""
    lim = cfg.limits
    text: S = {"type": "string", "minLength": 1, "maxLength": lim.max_text_chars,
               "pattern": r"\S", "description": "not blank; valid Unicode"}
    request: S = {
        "type": "object", "additionalProperties": False,
        "description": "exactly one of 'text' or 'texts'",
        "oneOf": [{"required": ["text"]}, {"required": ["texts"]}],
        "properties": {
            "text": text,
            "texts": {"type": "array", "items": text, "minItems": 1,
                      "maxItems": lim.max_texts},
            "top_k": {"type": "integer", "minimum": 1, "maximum": lim.max_top_k,
                      "default": lim.default_top_k,
                      "description": "entries in 'top' (at most the number of labels)"},
            "model": {"type": "string", "nullable": True, "example": "sent",
                      "description": "the serving model to ask (null or absent: the default "
                                     "model); 404 model_not_serving when it does not serve"},
            "min_score": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True,
                          "description": "abstain below this top score: 'label' null, "
                                         "'abstained' true, scores kept (absent: the model "
                                         "policy's min_score, else never)"},
            "explain": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                  {"type": "boolean", "enum": [False]}],
                        "nullable": True, "default": 0,
                        "description": "give each prediction its k strongest n-grams "
                                       "(auto's linear models; bow/cnn: 422 cannot_explain); "
                                       "0, false or null: off"},
        },
        "example": {"text": "非常好用", "top_k": 2},
    }
    scored: S = {"type": "object", "required": ["label", "score"],
                 "properties": {"label": {"type": "string"}, "score": {"type": "number"}}}
    feature: S = {"type": "object", "properties": {
        "ngram": {"type": "string"}, "view": {"type": "string"}, "value": {"type": "number"},
        "weight": {"type": "number"}, "contribution": {"type": "number"}}}
    explanation: S = {"type": "object", "required": ["label", "logit", "bias", "features", "others"],
                      "description": "features + others + bias = logit (the label's, averaged "
                                     "over an ensemble's members)",
                      "properties": {"label": {"type": "string"}, "logit": {"type": "number"},
                                     "bias": {"type": "number"}, "others": {"type": "number"},
                                     "features": {"type": "array", "items": feature}}}
    prediction: S = {"type": "object", "required": ["label", "score", "top"],
                     "properties": {"label": {"type": "string", "nullable": True,
                                              "description": "null when abstained"},
                                    "score": {"type": "number"},
                                    "top": {"type": "array", "items": scored, "minItems": 1},
                                    "abstained": {"type": "boolean",
                                                  "description": "present when a min_score applies"},
                                    "labels": {"type": "array", "items": scored,
                                               "description": "multi-label models: every label "
                                                              "over its threshold"},
                                    "explanation": explanation}}
    response: S = {"type": "object", "required": ["model", "predictions"],
                   "properties": {"model": MODEL_REF,
                                  "predictions": {"type": "array", "items": prediction}}}
    paths: S = {
        "/predict": {"post": {
            "summary": "Classify one text or a batch with the serving model.",
            "requestBody": _body({"$ref": "#/components/schemas/PredictRequest"}),
            "responses": {
                "200": _json({"$ref": "#/components/schemas/PredictResponse"},
                              "one prediction per text, in order", REQUEST_ID_HEADER),
                "400": _err("not JSON, not an object, unknown field, both or neither of "
                            "text/texts, a blank or non-string text, bad top_k, "
                            "min_score or explain; nested past 64 (code too_deep)"),
                **_body_errors(cfg),
                "415": _err("Content-Type is not application/json (or */*+json): a form, "
                            "text/plain or none is read only with an Authorization header"),
                "413": _err(f"body over limits.max_body_bytes, or more than "
                            f"{lim.max_texts} texts"),
                "404": _err("'model' names a model that does not serve here (code "
                            "model_not_serving; 'serving' lists those that do)"),
                "409": _err("the X-Request-Id was used before (code request_id_taken): "
                            "each id answers once"),
                "422": _err(f"a text over limits.max_text_chars ({lim.max_text_chars} "
                            "characters; code text_too_long), or explain asked of a model "
                            "that cannot explain (code cannot_explain)"),
                "500": _err("the model failed on this request (the worker lives on)"),
                "503": _err("no model serving, the worker is overloaded, or it died twice"),
                "504": _err("no answer within worker.request_timeout"),
            }}},
        "/healthz": HEALTH,
        "/readyz": _get("Readiness: a model is serving.",
                        _json({"type": "object", "required": ["status", "model"],
                               "properties": {"status": {"type": "string", "enum": ["ready"]},
                                              "model": MODEL_REF,
                                              "models": {"type": "array",
                                                         "items": {"type": "string"},
                                                         "description": "every serving "
                                                                        "model"}}},
                               "the default model serves"),
                        **{"503": _err("the default model is not serving (yet)")}),
        "/openapi.json": SPEC,
    }
    oip, oip_schemas = oip_paths(lim, text, NAME)  # Open Inference Protocol v2
    paths.update(oip)
    response["properties"]["request_id"] = REQUEST_ID  # the learning loop (docs/loop.md)
    paths.update(loop_inference_paths(cfg, text))
    doc = _doc("textswap inference API", "Predictions from the applied model.", paths,
               {"PredictRequest": request, "PredictResponse": response, **oip_schemas},
               security=False)
    return predict_security(loop_security(doc, cfg), predict_key)


# -- management API ----------------------------------------------------------------------
def _params_schema() -> S:
    props: S = {}
    low: float  # and high: an int range's, or a float range's
    high: float
    for field, default in DEFAULT_PARAMS.items():
        if field == "views":
            props[field] = {"type": "array", "minItems": 1, "uniqueItems": True,
                            "items": {"type": "string", "enum": list(AUTO_VIEWS)}}
        elif field in _INT_RANGES:
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
        if default is None:  # "folds": null lets the service choose (see params.py)
            props[field]["nullable"] = True
        props[field]["default"] = default
    return {"type": "object", "additionalProperties": False, "properties": props,
            "description": "training parameters; absent ones take the defaults"}


# a valid data set: fuzzing's examples phase trains one tiny model and
# registers one golden set with it
_EXAMPLE_TEXTS = {"pos": ["great, love it", "works well"], "neg": ["broken again", "awful"]}
EXAMPLE_DATA: S = {"examples": [{"text": t, "label": label}
                                for label, ts in _EXAMPLE_TEXTS.items() for t in ts]}


def _data_schema() -> S:
    """The 'data' field of POST /train and PUT /models/{name}/golden (dataset.load)."""
    example: S = {"type": "object", "required": ["text"],
                  "description": "'label', or 'labels' (a multi-label set: every row of "
                                 "the data then gives one)",
                  "oneOf": [{"required": ["label"]}, {"required": ["labels"]}],
                  "properties": {"text": {"type": "string", "minLength": 1,
                                          "maxLength": dataset.MAX_TEXT_CHARS,
                                          "pattern": r"\S"},
                                 "label": {"oneOf": [{"type": "string", "pattern": r"\S"},
                                                     {"type": "integer"}]},
                                 "labels": {"type": "array", "minItems": 1,
                                            "items": {"type": "string", "pattern": r"\S"}}}}
    data: S = {
        "type": "object", "additionalProperties": False,
        "description": "exactly one of 'path' (a UTF-8 .jsonl/.csv/.tsv file under the "
                       "configured data roots) or inline 'examples'; at least two labels, "
                       "one of them with two examples or more (a label with a single "
                       "example trains, is never tested, and is warned about)",
        "oneOf": [{"required": ["path"]}, {"required": ["examples"]}],
        "properties": {
            "path": {"type": "string", "minLength": 1, "pattern": r"\S"},
            "examples": {"type": "array", "minItems": dataset.CV_MIN_PER_LABEL + 1,
                         "maxItems": dataset.MAX_EXAMPLES, "items": example},
            "label_separator": {"type": "string", "minLength": 1, "default": "|",
                                "description": "splits a CSV 'labels' column into a "
                                               "multi-label set"},
            "labels": {"type": "array", "uniqueItems": True, "minItems": 2,
                       "items": {"type": "string", "pattern": r"\S"},
                       "nullable": True,
                       "description": "the declared label set (null or absent: not "
                                      "declared); compared after trimming spaces; every "
                                      "declared label needs examples, and every example's "
                                      "label must be declared"},
        },
    }
    data["example"] = copy.deepcopy(EXAMPLE_DATA)
    return data


def _train_request_loop(schema: S) -> S:
    """POST /train's additions of the learning loop: "feedback", and "data" optional."""
    schema["required"] = ["name"]
    schema["properties"]["feedback"] = {
        "type": "boolean", "default": False,
        "description": "fold the model's fed-back labels into the data (a feedback label "
                       "wins over the data's for the same text); the job's data reports "
                       "how many rows came from feedback and how many were new labels"}
    schema["properties"]["data"]["description"] = (
        "leave out to reuse the data (and, without params, the parameters) of the model's "
        "last training, or to train a zero-shot version from 'labels'")
    schema["properties"]["labels"] = {
        "type": "object", "minProperties": 2, "additionalProperties": {
            "type": "string", "minLength": 1, "pattern": r"\S"},
        "description": "{label: description}. Without 'data': a zero-shot version (architecture "
                       "'zero_shot'): a text's scores are softmax(cosine(text, description) / "
                       "0.07) of mean pretrained word vectors, uncalibrated (no labelled data); "
                       "422 when the pretrained view is off or the descriptions are CJK. With "
                       "'data': each description is one more example of its label"}
    return schema


def _train_request() -> S:
    request_example = {"name": "example", "apply": False, "params": {"epochs": 1},
                       "data": copy.deepcopy(EXAMPLE_DATA)}
    return {"type": "object", "additionalProperties": False, "required": ["name", "data"],
            "example": request_example,
            "properties": {"name": NAME, "data": _data_schema(),
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


def management_spec(cfg: Config) -> S:
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
    nullable_obj: S = {"type": "object", "nullable": True}
    workers: S = {"type": "array", "items": ANY_OBJECT}
    apply_request: S = {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {
            "name": NAME,
            "version": {**VERSION, "nullable": True, "description": "null or absent: latest"},
            "replicas": {"type": "integer", "minimum": 1, "maximum": MAX_REPLICAS,
                         "nullable": True,
                         "description": "worker processes for the model (null or absent: "
                                        "its current count, else serving.replicas)"},
            "default": {"type": "boolean", "nullable": True,
                        "description": "whether the model becomes the default one (null or "
                                       "absent: yes)"},
            "mode": {"type": "string", "enum": ["normal", "shadow", "canary"],
                     "default": "normal",
                     "description": "normal: blue/green swap; shadow: the version gets a "
                                    "copy of a share of the requests, compared off the "
                                    "request path; canary: it answers a share of them"},
            "fraction": {**FRACTION, "exclusiveMinimum": True, "nullable": True,
                         "description": "the share of requests of a shadow or canary "
                                        "(null or absent: 1 for shadow, 0.1 for canary); "
                                        "only with mode shadow or canary"},
            "keep_examples": {"type": "integer", "minimum": 0, "maximum": 100, "default": 0,
                              "description": "shadow: disagreements to keep"},
            "gate": {"type": "boolean", "default": True,
                     "description": "false skips the quality gate"},
            "min_accuracy": {**FRACTION, "nullable": True,
                             "description": "the gate's accuracy floor on the golden set "
                                            "(null or absent: the golden set's own); needs "
                                            "a golden set"},
            "partial": {"type": "boolean", "default": False,
                        "description": "cluster mode: when some nodes cannot prepare the "
                                       "version within cluster.prepare_timeout, the ready "
                                       "ones switch anyway (false: nothing switches, 409 "
                                       "not_prepared); ignored on one node"},
        },
        # a numeric fraction needs mode shadow or canary
        "anyOf": [{"not": {"required": ["fraction"],
                           "properties": {"fraction": {"type": "number"}}}},
                  {"required": ["mode"],
                   "properties": {"mode": {"type": "string", "enum": ["shadow", "canary"]}}}],
        "example": {"name": "sent", "version": 1}}
    apply_result: S = {"type": "object", "required": ["previous", "current"],
                       "properties": {"previous": {**MODEL_REF, "nullable": True},
                                      "current": MODEL_REF, "replicas": {"type": "integer"},
                                      "default": {"type": "boolean"}, "phases_s": ANY_OBJECT,
                                      "probation": nullable_obj, "gate": nullable_obj,
                                      "total_s": {"type": "number"}}}
    candidate_result: S = {"type": "object",
                           "required": ["name", "mode", "serving", "candidate", "fraction"],
                           "properties": {"name": {"type": "string"},
                                          "mode": {"type": "string",
                                                   "enum": ["shadow", "canary"]},
                                          "serving": MODEL_REF, "candidate": MODEL_REF,
                                          "fraction": {"type": "number"}, "workers": workers,
                                          "total_s": {"type": "number"}}}
    name_request: S = {"type": "object", "additionalProperties": False, "required": ["name"],
                       "properties": {"name": NAME}, "example": {"name": "sent"}}
    name_errors: S = {
        "400": _err("not JSON, not an object, unknown field, 'name' missing or not a string"),
        "404": _err("no model of that name serves here (code model_not_serving)"),
        **_body_errors(cfg)}
    version_or_null: S = {"type": "integer", "nullable": True}
    rollback_result: S = {"type": "object",
                          "required": ["name", "from_version", "to_version", "instant", "took_s"],
                          "properties": {"name": {"type": "string"},
                                         "from_version": version_or_null,
                                         "to_version": {"type": "integer"},
                                         "instant": {"type": "boolean"},
                                         "took_s": {"type": "number"},
                                         "apply": apply_result}}
    promote_result: S = {"type": "object",
                         "required": ["name", "from_version", "to_version", "mode", "swap_s"],
                         "properties": {"name": {"type": "string"},
                                        "from_version": version_or_null,
                                        "to_version": {"type": "integer"},
                                        "mode": {"type": "string", "enum": ["shadow", "canary"]},
                                        "swap_s": {"type": "number"}, "gate": nullable_obj,
                                        "old_workers": workers, "figures": ANY_OBJECT}}
    abort_result: S = {"type": "object", "required": ["name", "aborted_version", "mode"],
                       "properties": {"name": {"type": "string"},
                                      "aborted_version": {"type": "integer"},
                                      "mode": {"type": "string", "enum": ["shadow", "canary"]},
                                      "figures": ANY_OBJECT, "workers": workers}}
    unload_result: S = {"type": "object", "required": ["unloaded", "default", "was_default"],
                        "properties": {"unloaded": {"type": "object", "required": ["name"],
                                                    "properties": {
                                                        "name": {"type": "string"},
                                                        "version": version_or_null}},
                                       "workers": workers,
                                       "default": {"type": "string", "nullable": True},
                                       "was_default": {"type": "boolean"}}}
    rollout: S = {"type": "object",
                  "required": ["name", "version", "previous_version", "probation", "candidate",
                               "serving", "rolled_back"],
                  "properties": {"name": {"type": "string"}, "version": version_or_null,
                                 "previous_version": version_or_null,
                                 "probation": nullable_obj, "candidate": nullable_obj,
                                 "serving": ANY_OBJECT,
                                 "rolled_back": {"type": "array", "items": ANY_OBJECT}}}
    golden: S = {"type": "object", "required": ["golden"], "properties": {"golden": {
        "type": "object",
        "required": ["name", "examples", "label_counts", "source", "sha256", "min_accuracy",
                     "created_at"],
        "properties": {"name": {"type": "string"}, "examples": {"type": "integer"},
                       "label_counts": {"type": "object",
                                        "additionalProperties": {"type": "integer"}},
                       "source": {"type": "string"}, "sha256": {"type": "string"},
                       "min_accuracy": {"type": "number", "nullable": True},
                       "created_at": {"type": "number"}}}}}
    golden_request: S = {
        "type": "object", "additionalProperties": False, "required": ["data"],
        "properties": {"data": _data_schema(),
                       "min_accuracy": {**FRACTION, "nullable": True,
                                        "description": "the gate's accuracy floor for this "
                                                       "model (null or absent: none)"}},
        "example": {"data": copy.deepcopy(EXAMPLE_DATA)}}
    nullable_str: S = {"type": "string", "nullable": True}
    history_row: S = {"type": "object",
                      "required": ["id", "at", "name", "kind", "source", "from_version",
                                   "to_version", "phases", "reason", "details"],
                      "properties": {"id": {"type": "integer"}, "at": {"type": "number"},
                                     "name": nullable_str, "kind": {"type": "string"},
                                     "source": nullable_str, "from_version": version_or_null,
                                     "to_version": version_or_null, "phases": nullable_obj,
                                     "reason": nullable_str, "details": nullable_obj}}
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
            "description": "mode normal swaps the model's slot (the previous version "
                           "stays loaded in probation: POST /rollback is then instant); "
                           "shadow and canary load the version beside the serving one "
                           "until POST /promote or POST /abort. With a golden set, the "
                           "quality gate scores the version before it serves.",
            "requestBody": _body(apply_request),
            "responses": {
                "200": _json({"anyOf": [apply_result, candidate_result]},
                             "mode normal: now serving, previous, current and phase "
                             "times; shadow or canary: the candidate beside the serving "
                             "version"),
                "400": _err("not JSON, unknown field, missing or invalid name, a field of "
                            "the wrong type or out of range, fraction without mode shadow "
                            "or canary"),
                "404": _err("no such model or version in the store"),
                "409": _err("refused by the service's state: the quality gate (code "
                            "quality_gate, with the figures), worker.max_workers (code "
                            "memory_budget), a shadow or canary of a model that does not "
                            "serve yet (not_serving) or of the version that serves "
                            "(already_serving), the model was unloaded meanwhile, "
                            "cluster mode: a node could not prepare the version (code "
                            "not_prepared, not_ready names each node and why; "
                            "nothing switched)"),
                **_body_errors(cfg),
                "422": _err("the version's files are invalid, the model failed to load "
                            "or warm up (the serving model serves on), or min_accuracy "
                            "without a golden set (code no_golden_set)"),
                "503": _err("no worker process could be started in time (worker."
                            "boot_timeout), the service is shutting down, or the cluster "
                            "store is unreachable"),
                "504": _err("the model did not load and warm up within "
                            "worker.load_timeout"),
            }}},
        "/unload": {"post": {
            "summary": "Stop serving a model (the store keeps its versions).",
            # examples of their own: the fuzzer's examples phase unloads `topic`, and
            # `sent` (NAME's example) keeps serving for the rollout routes
            "requestBody": _body({**name_request, "example": {"name": "topic"},
                                  "properties": {"name": {**NAME, "example": "topic"}}}),
            "responses": {"200": _json(unload_result, "unloaded; its workers drained"),
                          **name_errors,
                          "503": _err("the cluster store is unreachable")}}},
        "/rollback": {"post": {
            "summary": "The previous version serves again.",
            "description": "Within probation one routing assignment (instant: true); "
                           "after it, an apply of the previous version.",
            "requestBody": _body(name_request),
            "responses": {
                "200": _json(rollback_result, "rolled back"),
                **name_errors,
                "409": _err("no previous version (code no_previous), or the apply back "
                            "was refused (memory_budget, ...)"),
                "422": _err("the previous version failed to load again"),
                "503": _err("no worker process could be started in time"),
                "504": _err("the previous version did not load within "
                            "worker.load_timeout")}}},
        "/promote": {"post": {
            "summary": "The shadow or canary candidate serves all traffic.",
            "requestBody": _body({**name_request, "properties": {
                "name": NAME, "gate": {"type": "boolean", "default": True,
                                       "description": "false skips the quality gate"}}}),
            "responses": {
                "200": _json(promote_result, "promoted"),
                **name_errors,
                "409": _err("no candidate (code no_candidate), or the quality gate "
                            "refused it (quality_gate)")}}},
        "/abort": {"post": {
            "summary": "Drop the shadow or canary candidate.",
            "requestBody": _body(name_request),
            "responses": {"200": _json(abort_result, "the candidate's workers stopped"),
                          **name_errors,
                          "409": _err("no candidate (code no_candidate)")}}},
        "/rollouts/{name}": {
            "parameters": [name_param],
            **_get("Probation, candidate and serving figures, rollbacks of a serving "
                   "model.", _json(rollout, "the model's rollout state"),
                   **{"400": bad_path, "404": _err("the model does not serve here")})},
        "/history": {"get": {
            "summary": "Applies, rollbacks, unloads, crashes... newest first (durable).",
            "parameters": [
                {"name": "name", "in": "query", "required": False, "schema": NAME,
                 "description": "only this model's events"},
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 1000,
                            "default": 100}}],
            "responses": {
                "200": _json({"type": "object", "required": ["history"],
                              "properties": {"history": {"type": "array",
                                                         "items": history_row}}},
                             "the events"),
                "400": _err("an invalid model name or limit")}}},
        "/cluster": _get("Cluster mode: the record, every node, what each serves, "
                         "stragglers.",
                         _json(ANY_OBJECT, "the cluster"),
                         **{"404": _err("cluster mode is off"),
                            "503": _err("the cluster store is unreachable (the error "
                                        "holds this node's own view, this_node)")}),
        "/metrics": _get(
            "Prometheus figures (the text exposition format; OpenMetrics when Accept "
            "asks for application/openmetrics-text).",
            {"description": "the exposition",
             "content": {"text/plain": {"schema": {"type": "string"}},
                         "application/openmetrics-text": {"schema": {"type": "string"}}}},
            **{"404": _err("metrics are off (metrics.enabled: false)")}),
        "/status": _get("Supervisor, workers, standby, restarts, jobs.", _json(status, "status")),
        "/models": _get("Every model in the store, and what serves.",
                        _json({"type": "object", "required": ["models", "serving"],
                               "properties": {"models": {"type": "array", "items": model},
                                              "serving": {**MODEL_REF, "nullable": True,
                                                          "description": "the default "
                                                                         "model"},
                                              "default": nullable_str,
                                              "serving_versions": {
                                                  "type": "object",
                                                  "additionalProperties": {
                                                      "type": "integer"},
                                                  "description": "name -> version of "
                                                                 "every serving model"}}},
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
        "/models/{name}/golden": {
            "parameters": [name_param],
            "put": {"summary": "Register the golden set of the model's quality gate.",
                    "description": "Later applies of the model are scored on it first; "
                                   "one that scores below the serving version (minus "
                                   "rollout.gate_tolerance) or below min_accuracy is "
                                   "refused with 409 quality_gate.",
                    "requestBody": _body(golden_request),
                    "responses": {"200": _json(golden, "registered (replaces any)"),
                                  "400": _err("not JSON, unknown field, 'data' missing or "
                                              "invalid (as for POST /train), bad "
                                              "min_accuracy; or a path not valid UTF-8"),
                                  "404": _err("an invalid model name"),
                                  **_body_errors(cfg)}},
            "get": {"summary": "The golden set's summary.",
                    "responses": {"200": _json(golden, "the golden set"), "400": bad_path,
                                  "404": _err("no golden set for this name")}},
            "delete": {"summary": "Remove the golden set.",
                       "responses": {"200": _json({"type": "object", "required": ["deleted"],
                                                   "properties": {"deleted": {
                                                       "type": "string"}}}, "removed"),
                                     "400": bad_path,
                                     "404": _err("no golden set for this name")}},
        },
        **quality_paths(name_param, bad_path),  # GET /models/{name}/quality
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
                    "400": _err("not JSON, unknown field, invalid name, params, data or "
                                "labels"),
                    "409": _err("data_gone: a retrain without 'data' whose last "
                                "training's file is gone or outside the data roots"),
                    "422": _err("zero-shot ('labels' without 'data') is unavailable: the "
                                "pretrained view is off, or the descriptions are CJK text"),
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
        **loop_management_paths(name_param),  # review queue, retrain policy (docs/loop.md)
        **dashboard_paths(cfg),  # POST /feedback, /try (frontend/dashboard_routes.py)
    }
    return _doc("textswap management API",
                "Apply, roll out and roll back models, inspect the store and the service, "
                "train.", paths,
                {"TrainRequest": _train_request_loop(_train_request()),
                 "TrainParams": _params_schema(),
                 "Job": _job_schema(), **dashboard_schemas(cfg)},
                security=bool(cfg.auth.enabled))


# -- live quality and drift (frontend/quality_handlers.py, control/quality.py) ------------
def quality_paths(name_param: S, bad_path: S) -> S:
    """GET /models/{name}/quality."""
    num: S = {"type": "number", "nullable": True}
    live: S = {"type": "object", "required": ["accuracy", "macro_f1", "per_label", "confusion"],
               "properties": {
                   "accuracy": num, "macro_f1": num,
                   "per_label": {"type": "object", "additionalProperties": {
                       "type": "object", "properties": {
                           "precision": {"type": "number"}, "recall": {"type": "number"},
                           "f1": {"type": "number"}, "support": {"type": "integer"},
                           "predicted": {"type": "integer"}}}},
                   "confusion": {"type": "object", "nullable": True,
                                 "description": "rows: the true label, columns: the "
                                                "predicted one, both in `labels` order",
                                 "properties": {"labels": {"type": "array",
                                                           "items": {"type": "string"}},
                                                "rows": {"type": "array", "items": {
                                                    "type": "array",
                                                    "items": {"type": "integer"}}}}},
                   "coverage": {**num, "description": "answered / fed back (abstentions "
                                                      "are not answered)"},
                   "multi_label": {"type": "boolean",
                                   "description": "a multi-label version: micro_f1, "
                                                  "samples_f1, exact-match accuracy, "
                                                  "per-label counts; confusion is null"},
                   "micro_f1": num, "samples_f1": num, "labels_per_text": num,
                   "answered": {"type": "integer"}}}
    drift: S = {"type": "object", "nullable": True, "required": ["alert"],
                "description": "null when the version has no training profile",
                "properties": {
                    "alert": {"type": "boolean"}, "texts": {"type": "integer"},
                    "unknown_ngram_share": num, "expected_unknown_ngram_share": num,
                    "unknown_ngram_excess": num, "label_js": num, "top_score_js": num,
                    "over": {"type": "array", "items": {"type": "string"}},
                    "thresholds": {"type": "object",
                                   "additionalProperties": {"type": "number"}}}}
    version: S = {"type": "object",
                  "required": ["version", "predictions", "feedback", "live", "drift"],
                  "properties": {"version": {"type": "integer"},
                                 "serving": {"type": "boolean"},
                                 "predictions": {"type": "integer"},
                                 "feedback": {"type": "integer"}, "live": live,
                                 "training": {"type": "object", "nullable": True},
                                 "drift": drift}}
    body: S = {"type": "object", "required": ["model", "versions"],
               "properties": {"model": {"type": "string"},
                              "serving_version": {"type": "integer", "nullable": True},
                              "versions": {"type": "array", "items": version}}}
    return {"/models/{name}/quality": {
        "parameters": [name_param],
        **_get("Live quality (on fed-back predictions) and drift (the last drift.window "
               "texts against the training profile) per version.",
               _json(body, "per version, newest first"),
               **{"400": bad_path,
                  "404": _err("neither the store nor the prediction log knows the model")})}}


# -- the handlers ------------------------------------------------------------------------
class InferenceSpecHandler(JsonHandler):
    parts: Any  # the predict routes' Access (frontend/auth.py), or None

    def get(self) -> None:
        # as the routes are now: a predict key added by rotation guards them at once
        self.send_json(inference_spec(self.cfg, bool(self.parts and self.parts.required())))


class ManagementSpecHandler(JsonHandler):
    def get(self) -> None:
        self.send_json(management_spec(self.cfg))


# -- the learning loop (frontend/request_ids.py, frontend/loop_handlers.py; docs/loop.md) ---------
REQUEST_ID: S = {"type": "string", "pattern": r"^[A-Za-z0-9._:-]{1,80}$",
                 "description": "this request's id (the client's X-Request-Id when it sent "
                                "one, up to 64 characters, behind its predict key's "
                                "'<namespace>:' while a predict key is set): POST /feedback "
                                "names predictions by it",
                 "example": "ticket-4711"}
REQUEST_ID_HEADER: S = {"X-Request-Id": {"schema": REQUEST_ID, "required": True}}
_LABEL: S = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 200, "pattern": r"\S"},
                       {"type": "integer", "description": "taken as its decimal string"}],
             "example": "pos"}


def loop_inference_paths(cfg: Config, text: S) -> S:
    cap = cfg.feedback.max_items
    label_set: S = {"type": "array", "maxItems": 1000, "items": _LABEL,
                    "description": "a multi-label model's truth for one text: its label "
                                   "set ([] for none of the labels)"}
    index: S = {"type": "integer", "minimum": 0, "maximum": 1000000,
                "description": "the text's place in a batch (0-based)"}
    on_prediction: S = {
        "type": "object", "additionalProperties": False, "required": ["request_id", "label"],
        "properties": {"request_id": REQUEST_ID, "label": _LABEL, "index": index}}
    on_prediction_set: S = {
        "type": "object", "additionalProperties": False, "required": ["request_id", "labels"],
        "description": "a multi-label model: one text's label set (with 'index' inside a "
                       "batch)",
        "properties": {"request_id": REQUEST_ID, "labels": label_set, "index": index}}
    on_batch: S = {
        "type": "object", "additionalProperties": False, "required": ["request_id", "labels"],
        "properties": {"request_id": REQUEST_ID,
                       "labels": {"type": "array", "minItems": 1, "maxItems": cap,
                                  "items": {"anyOf": [_LABEL, label_set]},
                                  "description": "one per text of the request, in order "
                                                 "(a label set each for a multi-label "
                                                 "model)"}}}
    free: S = {
        "type": "object", "additionalProperties": False, "required": ["model", "examples"],
        "properties": {"model": NAME, "examples": {
            "type": "array", "minItems": 1, "maxItems": cap,
            "items": {"type": "object", "additionalProperties": False,
                      "required": ["text"],
                      "description": "'label', or 'labels' (a set) for a multi-label model",
                      "properties": {"text": text, "label": _LABEL, "labels": label_set}}}},
        "example": {"model": "sent", "examples": [{"text": "love it", "label": "pos"}]}}
    names: S = {"type": "array", "items": {"type": "string"}}
    item: S = {"type": "object", "required": ["new_label"],
               "description": "'label' and 'predicted' are strings, or for a multi-label "
                              "model 'labels' and 'predicted' are label sets",
               "properties": {"request_id": REQUEST_ID, "index": {"type": "integer"},
                              "label": {"type": "string"}, "labels": names,
                              "predicted": {"nullable": True,
                                            "anyOf": [{"type": "string"}, names]},
                              "correct": {"type": "boolean"},
                              "new_label": {"type": "boolean"}, "new_labels": names}}
    answer: S = {"type": "object", "required": ["stored", "new_label", "items"],
                 "properties": {"stored": {"type": "integer"},
                                "new_label": {"type": "boolean",
                                              "description": "a label the model does not "
                                                             "know (a class at the next "
                                                             "training)"},
                                "new_labels": names, "multi_label": {"type": "boolean"},
                                "request_id": REQUEST_ID, "model": {},
                                "items": {"type": "array", "items": item}}}
    op: S = {
        "summary": "True labels for logged predictions, or labelled examples.",
        "description": "By request id (and index inside a batch), for a whole batch "
                       "('labels', in order), or free examples for a model. Feedback for "
                       "the same (request id, index) replaces the earlier one. It becomes "
                       "training data: it takes the feedback key (with auth off, "
                       "auth.enabled: false, it is off: 403 feedback_off).",
        "requestBody": _body({"anyOf": [on_prediction, on_prediction_set, on_batch, free]}),
        "responses": {
            "200": _json(answer, "stored (committed before this answer)"),
            "400": _err("not JSON, unknown field, malformed request id, a bad label, 'labels' "
                        "of the wrong length, or a batch's label without 'index'"),
            "401": _err("no 'Authorization: Bearer <key>', or not a key of this service"),
            "403": _err("a key of another scope (wrong_key; only the feedback key is taken "
                        "here), a foreign Host or Origin, or auth off (feedback_off)"),
            "404": _err("no logged prediction has this request id (or index), or no such "
                        "model"),
            "409": _err("the prediction log is off (predictions.log: false)"),
            **_body_errors(cfg),
            "413": _err(f"more than feedback.max_items ({cap}) labels, more than "
                        f"feedback.max_examples ({cfg.feedback.max_examples}) free "
                        "examples, or a body over limits.max_body_bytes"),
            "422": _err("a text over limits.max_text_chars"),
            "429": _err("over this caller's budget of requests, labels or body bytes "
                        "(rate_limited; 'limit' names it, Retry-After says when)"),
        }}
    return {"/feedback": {"post": op}}


def loop_security(doc: S, cfg: Config) -> S:
    """POST /feedback's key (the feedback key), when auth is on."""
    if cfg.auth.enabled:
        doc["components"].setdefault("securitySchemes", {})["bearer"] = {
            "type": "http", "scheme": "bearer"}
        doc["paths"]["/feedback"]["post"]["security"] = [{"bearer": []}]
    return doc


# the protocol's probes answer without the predict key (like /healthz and /readyz)
_OPEN_V2 = ("/v2/health/live", "/v2/health/ready")


def predict_security(doc: S, predict_key: bool) -> S:
    """With a predict key: POST /predict and the protocol's routes but its
    probes take it (401 without it, 403 with a key of another scope)."""
    if not predict_key:
        return doc
    doc["components"].setdefault("securitySchemes", {})["bearer"] = {
        "type": "http", "scheme": "bearer"}
    for path, item in doc["paths"].items():
        if not (path == "/predict" or path.startswith("/v2")) or path in _OPEN_V2:
            continue
        oip = path.startswith("/v2")
        shape = "#/components/schemas/OipError" if oip else "#/components/schemas/Error"
        for method, op in item.items():
            if method == "parameters":
                continue
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = _json({"$ref": shape}, "no 'Authorization: Bearer "
                                           "<key>', or a key that is none of this service's")
            op["responses"]["403"] = _json({"$ref": shape}, "a key of another scope "
                                           "(wrong_key): this route takes the predict key")
    return doc


def loop_management_paths(name_param: S) -> S:
    policy: S = {
        "type": "object", "additionalProperties": False,
        "properties": {
            "retrain_after_labels": {"type": "integer", "minimum": 1, "maximum": 10000000,
                                     "nullable": True,
                                     "description": "retrain (feedback folded in) once this "
                                                    "many labels arrived since the last "
                                                    "training; null: never"},
            "apply": {"type": "string", "enum": ["gate", "canary", "swap", "none"],
                      "default": "gate"},
            "min_score": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                          "maximum": 1, "description": "default abstain threshold of /predict"},
            "holdout": {"type": "number", "minimum": 0, "maximum": 0.5, "default": 0.2,
                        "description": "share of the feedback held back as the gate's "
                                       "golden set"}},
        "example": {"retrain_after_labels": 200, "apply": "gate"}}
    described: S = {"type": "object", "required": ["name", "policy"],
                    "properties": {"name": {"type": "string"},
                                   "policy": {"type": "object", "nullable": True},
                                   "source": {"type": "string", "nullable": True},
                                   "running_job": {"type": "string", "nullable": True},
                                   "last_retrain": {"type": "object", "nullable": True},
                                   "state": {"type": "string",
                                             "enum": ["ready", "running", "data_gone"]},
                                   "blocked": {"type": "object", "nullable": True},
                                   "removed": {"type": "boolean"}}}
    review_item: S = {"type": "object",
                      "required": ["request_id", "index", "text", "label", "top"],
                      "properties": {"request_id": REQUEST_ID, "index": {"type": "integer"},
                                     "text": {"type": "string"},
                                     "label": {"type": "string", "nullable": True},
                                     "top": {"type": "array", "items": ANY_OBJECT}}}
    no_model = _err("no such model in the store")
    counts = {"type": "object", "required": ["predictions", "feedback", "examples"],
              "properties": {k: {"type": "integer", "minimum": 0}
                             for k in ("predictions", "feedback", "examples")}}
    erased: S = {"type": "object", "required": ["removed", "copies"],
                 "properties": {"request_id": REQUEST_ID, "model": {"type": "string"},
                                "removed": counts,
                                "copies": {"type": "object",
                                           "description": "rows removed from the retrain "
                                                          "policy's feedback hold-out and "
                                                          "the inline-data copy (.loop/)",
                                           "properties": {"holdout": {"type": "integer"},
                                                          "data_copy": {"type": "integer"}}}}}
    return {
        "/models/{name}/review": {
            "parameters": [name_param],
            "get": {"summary": "The review queue: logged predictions with no feedback yet.",
                    "parameters": [
                        {"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": 1000,
                                    "default": 50}},
                        {"name": "strategy", "in": "query", "required": False,
                         "schema": {"type": "string", "enum": ["uncertain", "random"],
                                    "default": "uncertain"},
                         "description": "uncertain: smallest margin between the top two "
                                        "scores first"}],
                    "responses": {"200": _json({"type": "object", "required": ["items"],
                                                "properties": {"items": {
                                                    "type": "array", "items": review_item}}},
                                               "the queue"),
                                  "400": _err("a bad limit, strategy or query argument"),
                                  "404": no_model}}},
        "/models/{name}/policy": {
            "parameters": [name_param],
            "get": {"summary": "The model's retrain policy.",
                    "responses": {"200": _json(described, "the policy (null: none)"),
                                  "404": no_model}},
            "put": {"summary": "Set the model's retrain policy (persisted, then used).",
                    "requestBody": _body(policy),
                    "responses": {"200": _json(described, "stored"),
                                  "400": _err("not JSON, not an object, unknown key, bad value"),
                                  "404": no_model, "507": _err("the store cannot be written"),
                                  "413": _err("body over limits.max_body_bytes"),
                                  "415": _err("Content-Type is not application/json")}},
            "delete": {"summary": "Remove the stored policy (config's, if any, applies again).",
                       "responses": {"200": _json(described, "removed"), "404": no_model,
                                     "507": _err("the store cannot be written")}}},
        "/predictions/{request_id}": {
            "parameters": [{"name": "request_id", "in": "path", "required": True,
                            "schema": REQUEST_ID}],
            "delete": {"summary": "Erase one request's texts: its logged answers (queued "
                                  "ones too), the feedback on them, the model's free "
                                  "examples, policy hold-out rows and inline-data copy "
                                  "rows with those texts.",
                       "responses": {"200": _json(erased, "what was removed (zeros: "
                                                          "nothing held that id)"),
                                     "400": _err("not a request id"),
                                     "409": _err("the service keeps no prediction log"),
                                     "503": _err("the log's store cannot be reached"),
                                     "507": _err("the log cannot be written")}}},
        "/models/{name}/predictions": {
            "parameters": [name_param],
            "delete": {"summary": "Erase a model's whole prediction log, feedback and free "
                                  "examples, its policy hold-out, and the inline-data copy's "
                                  "rows with those texts.",
                       "responses": {"200": _json(erased, "what was removed"),
                                     "400": _err("not a model name"),
                                     "409": _err("the service keeps no prediction log"),
                                     "503": _err("the log's store cannot be reached"),
                                     "507": _err("the log cannot be written")}}},
    }


# -- the dashboard's routes on the management port (frontend/dashboard_routes.py) ---------
def dashboard_paths(cfg: Config) -> S:
    """POST /feedback (the inference port's, taking the admin or review key),
    POST /try (a /predict that is not logged) and POST /auth/session (the
    start URL's one-time code for a session token)."""
    inference = inference_spec(cfg)
    feedback = copy.deepcopy(inference["paths"]["/feedback"]["post"])
    feedback.pop("security", None)
    feedback.pop("operationId", None)
    feedback["description"] = ("The inference port's POST /feedback (same bodies, same "
                               "answers), taking the admin or review key: the dashboard's "
                               "Review panel posts here.")
    feedback["responses"].pop("401", None)  # the management document adds its own
    feedback["responses"].pop("403", None)
    predict = copy.deepcopy(inference["paths"]["/predict"]["post"])
    predict.pop("operationId", None)
    predict["summary"] = ("Try a model: the /predict body and answer, not logged (no "
                          "request id, not in the review queue, live quality or drift).")
    predict["responses"].pop("409", None)  # not logged: no request id
    ok = predict["responses"]["200"]
    ok.pop("headers", None)
    ok["content"][JSON]["schema"] = {"$ref": "#/components/schemas/TryResponse"}
    session: S = {
        "summary": "The one-time code of the dashboard URL printed at start, for a session "
                   "token (admin scope; a code works once). No key needed.",
        "x-no-key": True,
        "requestBody": _body({"type": "object", "additionalProperties": False,
                              "required": ["code"], "properties": {"code": {"type": "string"}}}),
        "responses": {
            "200": _json({"type": "object", "properties": {
                "token": {"type": "string"}, "scope": {"type": "string"},
                "expires_in_s": {"type": "integer"}}}, "the session token (send it as "
                                                       "'Authorization: Bearer <token>')"),
            "400": _err("not JSON, or no code"),
            "401": _err("the code is unknown, used or expired"),
            "409": _err("auth is off (auth.enabled: false)"),
            **_body_errors(cfg)}}
    code: S = {
        "summary": "A new one-time dashboard URL (its code works once, for POST "
                   "/auth/session): for when the start URL's code is used.",
        "responses": {
            "200": _json({"type": "object", "properties": {
                "code": {"type": "string"}, "url": {"type": "string"}}},
                "the code and the URL with it in its #fragment"),
            "409": _err("auth is off (auth.enabled: false)"),
            **_body_errors(cfg)}}
    logout: S = {
        "summary": "End the dashboard session whose token the request is sent with.",
        "responses": {
            "200": _json({"type": "object", "properties": {"ended": {"type": "boolean"}}},
                         "the session ended"),
            "400": _err("the Authorization header carries a key, not a session (code "
                        "not_a_session)"),
            "409": _err("auth is off (auth.enabled: false)"),
            **_body_errors(cfg)}}
    sessions: S = {
        "summary": "End every dashboard session and unused one-time code (a new admin key "
                   "does too).",
        "responses": {
            "200": _json({"type": "object", "properties": {"ended": {
                "type": "object", "properties": {"sessions": {"type": "integer"},
                                                 "codes": {"type": "integer"}}}}},
                         "how many sessions and codes ended"),
            "409": _err("auth is off (auth.enabled: false)")}}
    session["responses"]["429"] = _err("too many exchanges from this address (Retry-After)")
    return {"/feedback": {"post": feedback}, "/try": {"post": predict},
            "/auth/session": {"post": session}, "/auth/code": {"post": code},
            "/auth/logout": {"post": logout}, "/auth/sessions": {"delete": sessions}}


def dashboard_schemas(cfg: Config) -> S:
    """The /predict schemas that POST /try refers to."""
    schemas = inference_spec(cfg)["components"]["schemas"]
    answer = copy.deepcopy(schemas["PredictResponse"])
    answer["properties"].pop("request_id", None)
    return {"PredictRequest": copy.deepcopy(schemas["PredictRequest"]), "TryResponse": answer}
