"""The /predict JSON protocol: the body's parse and the answer's render
(`JSON`, and `TRY` for the dashboard's POST /try), run by frontend/pipeline.py
for the lean path (fastpath.py), PredictHandler and TryHandler. The answer
beyond the ranked labels: abstaining, explanations, multi-label sets.
`label_set` serves the Open Inference Protocol (oip.py) too. Imports no
TensorFlow.

- `min_score` (request, else the model's policy `min_score`): a prediction
  whose top score is below it answers `"label": null, "abstained": true`,
  with its score and `top` still there.
- `explain: k`: each prediction gets the k n-grams that pushed its label most
  (`explanation`), computed in the worker next to the prediction
  (model_worker/explain.py). Asked only then: a request without it costs
  no more than one without the field.
- Multi-label models (meta.json `multi_label`): `labels` lists every label
  whose score clears its threshold (chosen by cross-validation), best first;
  at least `min_labels` (0 or 1) of them.
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from frontend import jsonwire, request_ids
from frontend.base import ApiError, check_object, int_field, parse_json
from frontend.pipeline import Call, PredictRequest, Rendered, Routed
from state.texts import text_problem

if TYPE_CHECKING:
    from frontend.pipeline import PredictPipeline
    from state.config import LimitsSettings

PREDICT_FIELDS = {"text", "texts", "top_k", "model", "min_score", "explain"}
MAX_EXPLAIN = 100
_JSON = "application/json; charset=utf-8"


def predict_request(data: dict[str, Any], lim: LimitsSettings
                    ) -> tuple[list[str], int, str | None]:
    """(texts, top_k, model) of a checked /predict body, or an ApiError naming
    the problem. model None means the default model."""
    if ("text" in data) == ("texts" in data):
        raise ApiError(400, "bad_request", "give exactly one of 'text' (a string) or "
                                           "'texts' (a list of strings)")
    if "text" in data:
        texts = [data["text"]]
        if not isinstance(texts[0], str):
            raise ApiError(400, "invalid_field", "'text' must be a string")
        what = "'text'"
    else:
        texts = data["texts"]
        if not isinstance(texts, list):
            raise ApiError(400, "invalid_field", "'texts' must be a list of strings")
        if not texts:
            raise ApiError(400, "invalid_field", "'texts' must not be empty")
        if len(texts) > lim.max_texts:
            raise ApiError(413, "too_many_texts",
                           f"'texts' has {len(texts)} items; the limit is {lim.max_texts}")
        what = "'texts'"
    cap = lim.max_text_chars
    for i, t in enumerate(texts):
        where = what if len(texts) == 1 and "text" in data else f"{what}[{i}]"
        if not isinstance(t, str):
            raise ApiError(400, "invalid_field", f"{where} must be a string")
        problem = text_problem(t, where, cap)
        if problem is not None:
            raise ApiError(*problem)
    top_k = int_field(data, "top_k", minimum=1, maximum=lim.max_top_k,
                      default=lim.default_top_k)
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "invalid_field", "'model' must be a model name (a string)")
    return texts, top_k, model


def predict_options(data: dict[str, Any]) -> tuple[float | None, int]:
    """(min_score or None, explain) of a /predict body; 400 when bad."""
    min_score = data.get("min_score")
    if min_score is not None:
        if isinstance(min_score, bool) or not isinstance(min_score, (int, float)) or not (
                0.0 <= float(min_score) <= 1.0) or math.isnan(float(min_score)):
            raise ApiError(400, "invalid_field", "'min_score' must be a number between 0 and 1")
        min_score = float(min_score)
    explain = data.get("explain", 0)
    if explain is None or explain is False:
        explain = 0
    if isinstance(explain, bool) or not isinstance(explain, int) or not 0 <= explain <= MAX_EXPLAIN:
        raise ApiError(400, "invalid_field",
                       f"'explain' must be an integer between 0 (off) and {MAX_EXPLAIN}")
    return min_score, explain


class JsonWire:
    """POST /predict's JSON body and answer. logged: the answer carries a
    request id (the client's X-Request-Id, else a new one) and goes to the
    prediction log; api: the request metrics' label (None: not counted)."""

    def __init__(self, api: str | None, logged: bool) -> None:
        self.api = api
        self.logged = logged

    def request_id(self, call: Call) -> str | None:
        return (request_ids.request_id(call.headers, namespace=call.namespace)
                if self.logged else None)

    def parse(self, pipe: PredictPipeline, call: Call, rid: str | None) -> PredictRequest:
        if call.refused is not None:
            raise call.refused
        data = call.data
        if self.logged:  # the inference port's /predict
            pipe.check_declared(call)
            if pipe.foreign(call):
                rid = None  # answered, not logged: no request id to give feedback on
        if data is None:
            data = check_object(parse_json(call.body, call.headers.get("Content-Type")),
                                PREDICT_FIELDS)
        texts, top_k, model = predict_request(data, pipe.limits)
        min_score, explain = predict_options(data)
        return PredictRequest(texts, model, top_k, min_score, explain, rid, top_k,
                              request_ids.chosen(call.headers) if rid is not None else None)

    def render(self, pipe: PredictPipeline, req: PredictRequest, routed: Routed) -> Rendered:
        labels, info = routed.labels, routed.info
        min_score = pipe.min_score(req, routed.model["name"])
        k = min(req.top_k, len(labels))
        shown = [prediction(row, labels, k, info, min_score) for row in routed.scores]
        if routed.explained is not None:
            for p, e in zip(shown, routed.explained):
                p["explanation"] = e
        payload: dict[str, Any] = {"model": routed.model, "predictions": shown}
        if req.request_id is None:
            return jsonwire.dumps(payload), \
                {"Content-Type": _JSON}, shown
        payload["request_id"] = req.request_id
        return (jsonwire.dumps(payload),
                {"Content-Type": _JSON, request_ids.HEADER: req.request_id}, shown)

    def error(self, exc: ApiError, rid: str | None) -> tuple[bytes, dict[str, str]]:
        body = json.dumps({"error": {**exc.details, "code": exc.code, "message": exc.message}},
                          ensure_ascii=False, default=str).encode()
        headers = {**exc.headers, "Content-Type": _JSON}
        if rid is not None:
            headers[request_ids.HEADER] = rid
        return body, headers


JSON = JsonWire("predict", logged=True)  # POST /predict on the inference port
# POST /try on the management port: a text a person typed to look at a model is
# not traffic: not logged (no request id), not in the request metrics
TRY = JsonWire(None, logged=False)


# -- the answer ---------------------------------------------------------------------------
def label_set(row: list[float], info: dict[str, Any], min_score: float | None = None,
              order: list[int] | None = None) -> list[int]:
    """A multi-label model's labels for one row of scores, best first: those
    that clear their threshold (and min_score), at least min_labels of them
    unless min_score is given."""
    if order is None:
        order = sorted(range(len(row)), key=row.__getitem__, reverse=True)
    floor = min_score if min_score is not None else 0.0
    chosen = [i for i in order if row[i] >= max(info["thresholds"][i], floor)]
    if not chosen and info["min_labels"] > 0 and min_score is None:
        chosen = order[:1]  # at least one label: the best, though under its threshold
    return chosen


def prediction(row: list[float], labels: list[str], k: int, info: dict[str, Any],
               min_score: float | None) -> dict[str, Any]:
    order = sorted(range(len(labels)), key=row.__getitem__, reverse=True)
    top: list[dict[str, Any]] = [{"label": labels[i], "score": row[i]} for i in order[:k]]
    p: dict[str, Any] = {"label": top[0]["label"], "score": top[0]["score"], "top": top}
    if info["multi_label"]:
        chosen = label_set(row, info, min_score, order)
        p["labels"] = [{"label": labels[i], "score": row[i]} for i in chosen]
        if min_score is not None:
            p["abstained"] = not chosen
            if not chosen:
                p["label"] = None
    elif min_score is not None:
        p["abstained"] = top[0]["score"] < min_score
        if p["abstained"]:
            p["label"] = None
    return p


