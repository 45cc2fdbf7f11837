"""The predict pipeline: every way in to a prediction runs

    parse -> validate -> route -> log -> metrics -> answer

in `PredictPipeline.answer`, and brings only its own parse and render, a
`Wire`:

- `predictions.JSON`: the /predict JSON body, answered by the lean path
  (fastpath.py) and by PredictHandler;
- `predictions.TRY`: the same body on the management port's POST /try (the
  dashboard's "Try it"): not logged, no request id, not counted;
- `oip.INFER`: the Open Inference Protocol's infer, JSON or binary tensors,
  answered by the lean path and by InferHandler.

A transport (fastpath.py's HTTP/1 delegate, or a Tornado RequestHandler
through `PipelineHandler`) reads the body into a `Call` and writes the
`Reply`. Every refusal is an ApiError, rendered by the wire in its own shape;
anything else is a 500 with its traceback in the log. Imports no TensorFlow.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Protocol

from frontend import request_ids
from frontend.base import ApiError, JsonHandler, declared_json, own_origin, service_error
from state.errors import ServiceError, StoreError

if TYPE_CHECKING:
    from control.metrics import Metrics
    from control.policies import Policy
    from state.config import LimitsSettings, ServerSettings
    from state.predlog_api import PredictionLogBackend
    from state.store import ModelStore

log = logging.getLogger("textswap.http")

NO_MODEL: dict[str, Any] = {"name": "", "version": None}
RAW_MAX_LABELS = 32  # up to this many labels, a model's score rows are logged as they are
_INFO_CAP = 256


@dataclass(slots=True)
class Call:
    """What a transport read of one request."""
    headers: Any  # tornado.httputil.HTTPHeaders
    body: bytes
    path: str
    args: tuple[str | None, ...] = ()  # path arguments, decoded
    refused: ApiError | None = None  # found while reading (413 too large, 400 bad path)
    data: dict[str, Any] | None = None  # a JSON body its transport already decoded
    denied: ApiError | None = None  # the key check's refusal: answered before anything else
    namespace: str | None = None  # a predict key's namespace for the client's request id


@dataclass(slots=True)
class PredictRequest:
    """A parsed and checked request, whatever its protocol."""
    texts: list[str]
    model: str | None  # None: the default model
    top_k: int = 1
    min_score: float | None = None  # None: the model's policy decides
    explain: int = 0
    request_id: str | None = None  # None: not logged
    log_k: int = 5  # top labels the log keeps of a row it cannot keep whole
    chosen: str | None = None  # who chose the id: "header", "body" (OIP's "id"), None: the service


@dataclass(slots=True)
class Routed:
    """What the model answered: its scores, and what the answering version is."""
    model: dict[str, Any]  # {"name", "version", ...} of the version that answered
    labels: list[str]
    scores: list[list[float]]
    explained: list[Any] | None
    info: dict[str, Any]  # describe_meta of that version


@dataclass(slots=True)
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]
    model: dict[str, Any]  # the version that answered; NO_MODEL on a refusal


Rendered = tuple[bytes, dict[str, str], list[dict[str, Any]] | None]


class Wire(Protocol):
    """One protocol's parse and render."""

    @property
    def api(self) -> str | None:
        """The request metrics' label; None: the pipeline counts nothing."""

    def request_id(self, call: Call) -> str | None:
        """The request id known before parsing (to answer even a refusal with), or None."""

    def parse(self, pipe: PredictPipeline, call: Call, rid: str | None) -> PredictRequest:
        """The checked request; an ApiError (4xx) for any bad input."""

    def render(self, pipe: PredictPipeline, req: PredictRequest, routed: Routed) -> Rendered:
        """(body, headers, the predictions as answered when the log should keep
        them instead of score rows, else None); may refuse what it cannot answer."""

    def error(self, exc: ApiError, rid: str | None) -> tuple[bytes, dict[str, str]]:
        """A refusal's body and headers."""


class Lookup(Protocol):
    """What serves, by name (control/serving.py ServingState)."""

    def serving_model(self, name: str | None = None) -> dict[str, Any] | None: ...

    def serving_names(self) -> list[str]: ...


class Serving(Lookup, Protocol):
    """What the pipeline routes through: the supervisor's facade over
    control/routing.py's Router."""

    def predict(self, texts: list[str], model: str | None = None,
                options: dict[str, Any] | None = None
                ) -> Awaitable[tuple[dict[str, Any], list[str], list[Any]]]: ...


class PolicyView(Protocol):
    """The retrain policies as the pipeline reads them (control/policies.py)."""

    def get(self, name: str) -> "Policy | None": ...


class PredictPipeline:
    """The one way a prediction is made and answered."""

    def __init__(self, serving: Serving, store: ModelStore, policies: PolicyView | None,
                 predlog: PredictionLogBackend | None, metrics: Metrics | None,
                 limits: LimitsSettings, sample: float,
                 server: ServerSettings | None = None) -> None:
        self.server = server  # the service's server section (own_origin); None: no check
        self.serving = serving
        self.store = store
        self.policies = policies
        self.predlog = predlog
        self.metrics = metrics if metrics is not None and metrics.enabled else None
        self.limits = limits
        self.sample = sample
        self._info: dict[tuple[str, Any], dict[str, Any]] = {}
        self._broken: set[tuple[str, str]] = set()  # (model, min_score) already reported
        self._broken_meta: set[tuple[str, Any]] = set()  # versions whose meta.json failed
        # client-chosen request ids, each answered once (frontend/request_ids.py)
        self.ids = (request_ids.ClientIds(predlog)
                    if predlog is not None and predlog.enabled else None)

    async def answer(self, wire: Wire, call: Call, started: float) -> Reply:
        """The whole pipeline for one request; started: its time.monotonic()."""
        rid = None
        model = NO_MODEL
        held = None  # a client's id this request holds until it is answered
        try:
            if call.denied is not None:
                raise call.denied
            rid = wire.request_id(call)
            req = wire.parse(self, call, rid)
            if req.chosen and req.request_id is not None and self.ids is not None:
                held = await self._claim(req)
            routed = await self.route(req)
            body, headers, shown = wire.render(self, req, routed)
            if req.request_id is not None and self.predlog is not None and self.predlog.enabled:
                self.log(req, routed, shown)
            status, model = 200, routed.model
            held = None
        except ApiError as exc:
            status = exc.status_code
            body, headers = wire.error(exc, rid)
        except Exception:  # never an HTML page or a dropped connection
            log.exception("POST %s failed", call.path)
            status = 500
            body, headers = wire.error(ApiError(500, "internal", "internal error"), rid)
        if held is not None and self.ids is not None:  # not answered: the id is free again
            self.ids.release(held)
        if wire.api is not None and self.metrics is not None:
            self.metrics.observe_request(wire.api, model["name"], model["version"], status,
                                         time.monotonic() - started)
        return Reply(status, body, headers, model)

    async def _claim(self, req: PredictRequest) -> str | None:
        """Hold the id a client chose: a used one is 409 request_id_taken when
        it came as X-Request-Id; an OIP body's "id" used before is answered
        and logged under a new id (the X-Request-Id header names it; the body
        echoes the client's "id", as the protocol says)."""
        assert self.ids is not None and req.request_id is not None
        if await self.ids.claim(req.request_id):
            return req.request_id
        if req.chosen == "body":
            req.request_id = request_ids.new_id()
            return None
        raise ApiError(409, "request_id_taken",
                       f"the request id {req.request_id!r} was used before; send a new "
                       f"{request_ids.HEADER} (or none: the service makes one)")

    # -- cross-site --------------------------------------------------------------------------
    def check_declared(self, call: Call, oip: bool = False) -> None:
        """The inference port's body rule, as the management port's: a body
        is read when declared JSON (an OIP infer: also the binary type, or
        none, as the official clients send), or with an Authorization header,
        which a cross-site form or no-cors fetch cannot send; 415 otherwise."""
        if call.data is not None or call.headers.get("Authorization"):
            return
        ctype = call.headers.get("Content-Type")
        media = (ctype or "").split(";")[0].strip().lower()
        if declared_json(ctype) or (oip and (
                media in ("", "application/octet-stream")
                or call.headers.get("Inference-Header-Content-Length") is not None)):
            return
        raise ApiError(415, "unsupported_media_type",
                       f"a body declared {media or 'as nothing'!r} is read here only with an "
                       "'Authorization: Bearer <key>' header; send 'Content-Type: "
                       "application/json'")

    def foreign(self, call: Call) -> bool:
        """Whether a page of another site sent it (an Origin not this
        service's own): answered, never logged for review."""
        origin = call.headers.get("Origin")
        if origin is None or self.server is None:
            return False
        return not own_origin(origin, call.headers.get("Host") or "", self.server)

    # -- route --------------------------------------------------------------------------------
    async def route(self, req: PredictRequest) -> Routed:
        """The model's answer through the router (least-in-flight, retry,
        canary, shadow); an explanation is an option the router passes on."""
        options = None
        if req.explain:
            serving = self.serving.serving_model(req.model)
            if serving is not None:
                info = self.info(serving)
                if not info["explainable"]:
                    raise ApiError(422, "cannot_explain", info["why"])
            options = {"x": req.explain}  # the router answers 422 cannot_explain itself too
        try:
            model, labels, out = await self.serving.predict(req.texts, req.model, options)
        except (ServiceError, StoreError) as exc:
            raise service_error(exc) from None
        if isinstance(out, dict):
            return Routed(model, labels, out["scores"], out.get("explain"), self.info(model))
        return Routed(model, labels, out, None, self.info(model))

    def info(self, model: dict[str, Any]) -> dict[str, Any]:
        """describe_meta of a served version, read once per version.
        An unreadable meta.json answers as a plain single-label classifier this
        time (the worker serves it, so it was readable when loaded) and is read
        again next time."""
        key = (model["name"], model["version"])
        info = self._info.get(key)
        if info is not None:
            return info
        try:
            meta = self.store.meta(model["name"], int(model["version"]))
        except StoreError as exc:
            if key not in self._broken_meta:  # once, not once per request
                self._broken_meta.add(key)
                log.warning("answering %s v%s as a single-label model: %s", model["name"],
                            model["version"], exc)
            return describe_meta({})
        info = describe_meta(meta)
        if len(self._info) >= _INFO_CAP:
            self._info.clear()
        self._info[key] = info
        return info

    def min_score(self, req: PredictRequest, model: str) -> float | None:
        """The abstain threshold of a request: its own, else its model's policy's.
        Policies are checked when set (control/policies.py validate), so one that
        is not a number in (0, 1] here is a bug: the request fails (500) rather
        than answering labels its owner said to withhold."""
        if req.min_score is not None or self.policies is None:
            return req.min_score
        policy = self.policies.get(model)
        value = None if policy is None else policy.get("min_score")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0.0 < value <= 1.0):
            if (model, repr(value)) not in self._broken:  # once, not once per request
                self._broken.add((model, repr(value)))
                log.error("the policy of %s has min_score %r, not a number in (0, 1]: its "
                          "predictions are refused until the policy is fixed", model, value)
            raise ApiError(500, "broken_policy", f"the retrain policy of model {model!r} has "
                                                 f"an invalid min_score {value!r}; fix it with "
                                                 f"PUT /models/{model}/policy")
        return float(value)

    # -- log ----------------------------------------------------------------------------------
    def log(self, req: PredictRequest, routed: Routed,
            shown: list[dict[str, Any]] | None) -> None:
        """The answer to the prediction log (sampled by predictions.sample):
        score rows as they are when the model has few labels (packing a float
        row costs a fraction of packing the objects built from it), else the
        predictions as answered, else the top log_k labels of each row."""
        plog = self.predlog
        if plog is None or (self.sample < 1.0 and random.random() >= self.sample):
            return
        rid = req.request_id
        assert rid is not None  # logged requests have one
        model, labels, scores = routed.model, routed.labels, routed.scores
        now = time.time()
        k = min(req.log_k, len(labels))
        if len(labels) <= RAW_MAX_LABELS and isinstance(scores, list) and (
                not scores or type(scores[0]) is list):
            plog.add_scores(now, rid, model["name"], model["version"], req.texts, labels,
                            scores, k)
        elif shown is not None:
            plog.add_answer(now, rid, model["name"], model["version"], req.texts, shown)
        else:
            rows = []
            for i, (t, row) in enumerate(zip(req.texts, scores)):
                order = sorted(range(len(labels)), key=row.__getitem__, reverse=True)[:k]
                rows.append({"at": now, "request_id": rid, "index": i, "model": model["name"],
                             "version": model["version"], "text": t,
                             "label": labels[order[0]],
                             "scores": {labels[j]: float(row[j]) for j in order}})
            plog.add(rows)


def describe_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """{"multi_label", "thresholds", "min_labels", "explainable", "why"} of a
    version's meta.json; a plain single-label classifier for {}."""
    labels = meta.get("labels") or []
    thresholds: Any = meta.get("thresholds")  # {label: threshold} when multi-label
    multi = bool(meta.get("multi_label")) and isinstance(thresholds, dict)
    params = meta.get("params") or {}
    arch = params.get("architecture")
    chosen = ((meta.get("report") or {}).get("chosen") or {}).get("members") or []
    explainable, why = True, ""
    if arch in ("bow", "cnn"):
        explainable = False
        why = (f"a {arch} model cannot explain its predictions exactly (only the linear "
               "models that architecture 'auto' builds can)")
    elif arch != "auto" or any(m.get("learner") in ("bow", "cnn") for m in chosen):
        explainable = False
        why = "this model is not one of auto's linear models, which alone can explain exactly"
    return {"multi_label": multi,
            "thresholds": [float(thresholds.get(lab, 0.5)) for lab in labels] if multi else None,
            "min_labels": int(meta.get("min_labels", 1)) if multi else 1,
            "explainable": explainable, "why": why}


class PipelineHandler(JsonHandler):
    """A RequestHandler way in: reads the body, runs the pipeline, writes the
    reply. The pipeline counts the request (frontend/metrics_http.py's
    counting leaves it out); errors before it (the body's headers) are
    answered and counted as on any route."""

    counted = False

    parts: PredictPipeline  # the service's one pipeline (frontend/app.py)

    async def answer(self, wire: Wire, args: tuple[str | None, ...] = (),
                     data: dict[str, Any] | None = None) -> None:
        started = time.monotonic() - self.request.request_time()
        refused = (ApiError(413, "body_too_large", self._too_large) if self._too_large
                   else None)
        body = b"" if refused is not None or data is not None else self.body
        namespace = (request_ids.key_namespace(self.request.headers) if self.authorized and
                     getattr(self.auth, "where", None) == "predict" else None)
        reply = await self.parts.answer(
            wire, Call(self.request.headers, body, self.request.path, args, refused, data,
                       namespace=namespace),
            started)
        self.counted = wire.api is not None
        self.set_status(reply.status)
        for name, value in reply.headers.items():
            self.set_header(name, value)
        self.finish(reply.body)
