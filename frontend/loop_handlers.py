"""The learning loop's routes (docs/loop.md): they parse and render; the
feedback and the review queue are control/feedback.py's FeedbackService.

Inference port:  POST /feedback                (the feedback key: frontend/auth.py;
                                                a rate limit per caller)
Management port: GET /models/<name>/review     (the review queue)
                 GET/PUT/DELETE /models/<name>/policy   (the retrain policy)
                 DELETE /predictions/<request_id>, DELETE /models/<name>/predictions
                                                (erasure)

The prediction log's and the store's blocking calls run in the executor of
control/feedback.py (`off_loop`), awaited.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from control.feedback import FeedbackService, off_loop
from frontend.base import ApiError, JsonHandler, service_error
from frontend.request_ids import check_id
from state.errors import InvalidName, NotFound, ServiceError

if TYPE_CHECKING:
    from control.policies import Policies
    from state.config import Config
    from state.predlog_api import PredictionLogBackend
    from state.store import ModelStore

FEEDBACK_FIELDS = {"request_id", "index", "label", "labels", "model", "examples"}
T = TypeVar("T")


class RateLimit:
    """Token buckets, one per caller: `rate` units a second on average, bursts
    of up to `burst`. POST /feedback's callers are told apart by the key they
    send (by its hash; the client's address when none is needed), so one
    caller cannot flood the log with labels that retraining uses. Three are
    kept (feedback_limits): requests, labels and body bytes."""

    def __init__(self, rate: float, burst: float, max_callers: int = 10_000) -> None:
        self.rate, self.burst, self.max_callers = rate, max(burst, 1.0), max_callers
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, at)

    def take(self, caller: str, now: float | None = None, cost: float = 1.0) -> float:
        """0.0 when the request may go on (its cost taken), else the seconds
        until it may. A cost over the burst needs a full bucket, and empties it."""
        if self.rate <= 0:
            return 0.0
        cost = min(max(cost, 0.0), self.burst)
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.get(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < cost:
            self._buckets[caller] = (tokens, now)
            return (cost - tokens) / self.rate
        if caller not in self._buckets and len(self._buckets) >= self.max_callers:
            # forget the fullest buckets: they are the callers that waited longest
            for old in sorted(self._buckets, key=lambda c: self._buckets[c][1])[:1000]:
                del self._buckets[old]
        self._buckets[caller] = (tokens - cost, now)
        return 0.0


@dataclass(frozen=True)
class FeedbackLimits:
    requests: RateLimit
    labels: RateLimit
    bytes: RateLimit


_LIMITS: dict[int, FeedbackLimits] = {}  # one per config (the service has one)


def feedback_limits(config: Config) -> FeedbackLimits:
    limit = _LIMITS.get(id(config))
    if limit is None:
        fb = config.feedback
        limit = _LIMITS[id(config)] = FeedbackLimits(
            RateLimit(fb.rate_per_s, fb.burst),
            RateLimit(fb.labels_per_s, fb.label_burst),
            RateLimit(fb.bytes_per_s, fb.byte_burst))
    return limit


def feedback_limit(config: Config) -> RateLimit:
    """The requests' bucket (feedback_limits has the labels' and bytes' too)."""
    return feedback_limits(config).requests


def labels_in(data: dict[str, Any]) -> int:
    """The labels a feedback body carries: its examples, its batch's labels, or one."""
    for key in ("examples", "labels"):
        value = data.get(key)
        if isinstance(value, list) and (key == "examples" or "request_id" in data):
            return max(1, len(value))
    return 1


async def _run(fn: Callable[..., T], *args: Any, what: str = "the prediction log",
               path: str = "") -> T:
    """fn(*args) off the IOLoop (control/feedback.py off_loop); a failed durable
    write answers 507 insufficient_storage or 503 store_unavailable."""
    try:
        return await off_loop(fn, *args, what=what, path=path)
    except ServiceError as exc:
        raise service_error(exc) from None


class FeedbackHandler(JsonHandler):
    """POST /feedback: true labels for logged predictions, or free examples."""

    guarded = True  # on the public port too: labels train models
    parts: FeedbackService  # the service's one (frontend/app.py)

    def _caller(self) -> str:
        auth = self.request.headers.get("Authorization", "")
        if self.authorized and auth:  # the key, not the address: one key, one budget
            return "key:" + hashlib.sha256(auth.encode()).hexdigest()[:16]
        return "addr:" + (self.request.remote_ip or "")

    def _limit(self, bucket: RateLimit, cost: float, what: str, rate: tuple[str, float],
               burst: tuple[str, float]) -> None:
        """rate and burst: the settings' names and values (feedback.<name>)."""
        wait = bucket.take(self._caller(), cost=cost)
        if wait:
            raise ApiError(429, "rate_limited",
                           f"too many feedback {what} from this caller (feedback.{rate[0]}: "
                           f"{rate[1]:g}, {burst[0]} {burst[1]:g}); retry after {wait:.1f}s",
                           {"retry_after_s": round(wait, 3), "limit": what},
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})

    async def post(self) -> None:
        limits, fb = feedback_limits(self.cfg), self.cfg.feedback
        self._limit(limits.requests, 1, "requests", ("rate_per_s", fb.rate_per_s),
                    ("burst", fb.burst))
        self._limit(limits.bytes, len(self.body), "bytes", ("bytes_per_s", fb.bytes_per_s),
                    ("byte_burst", fb.byte_burst))
        data = self.json_object(FEEDBACK_FIELDS)
        self._limit(limits.labels, labels_in(data), "labels", ("labels_per_s", fb.labels_per_s),
                    ("label_burst", fb.label_burst))
        try:
            answer = await self.parts.feedback(data)
        except ServiceError as exc:
            raise service_error(exc) from None
        self.send_json(answer)


class ReviewHandler(JsonHandler):
    """GET /models/<name>/review?limit=50&strategy=uncertain|random"""

    parts: FeedbackService

    async def get(self, name: str) -> None:
        args = {k: self.get_query_argument(k) for k in self.request.query_arguments}
        unknown = sorted(set(args) - {"limit", "strategy"})
        if unknown:
            raise ApiError(400, "unknown_field", f"unknown query argument(s) {unknown}; "
                                                 "allowed: limit, strategy")
        try:
            limit = int(args.get("limit", "50"))
        except ValueError:
            raise ApiError(400, "invalid_field", "'limit' must be an integer") from None
        try:
            answer = await self.parts.review(name, limit, args.get("strategy", "uncertain"))
        except ServiceError as exc:
            raise service_error(exc) from None
        self.send_json(answer)


@dataclass(frozen=True)
class PolicyParts:
    store: ModelStore  # the model must exist
    policies: Policies


class PolicyHandler(JsonHandler):
    """GET/PUT/DELETE /models/<name>/policy: the model's retrain policy."""

    parts: PolicyParts

    async def _known(self, name: str) -> None:
        def check() -> None:
            try:
                self.parts.store.resolve(name)
            except (NotFound, InvalidName):
                raise ApiError(404, "not_found", f"no model named {name!r} in the store") from None
        await _run(check)

    async def get(self, name: str) -> None:
        await self._known(name)
        self.send_json(self.parts.policies.describe(name))

    async def put(self, name: str) -> None:
        from control.policies import PolicyError

        data = self.json_body()
        await self._known(name)
        try:
            await _run(self.parts.policies.put, name, data, what=f"the policy of {name}",
                       path=getattr(self.parts.policies, "path", ""))
        except PolicyError as exc:
            raise ApiError(400, "invalid_policy", str(exc)) from None
        policy = self.parts.policies.describe(name)
        self.audit(name, "policy", {"policy": policy.get("policy")})
        self.send_json(policy)
        self.parts.policies.labels_arrived(name)  # labels may be waiting already

    async def delete(self, name: str) -> None:
        await self._known(name)
        removed = await _run(self.parts.policies.delete, name, what=f"the policy of {name}",
                             path=getattr(self.parts.policies, "path", ""))
        if removed:
            self.audit(name, "policy_deleted")
        self.send_json({**self.parts.policies.describe(name), "removed": removed})


@dataclass(frozen=True)
class ErasureParts:
    predlog: PredictionLogBackend | None
    policies: Policies | None  # its copies under .loop/ are erased too


class _Erasure(JsonHandler):
    """Erasure of logged texts; the answer says what was removed (`copies`:
    the rows of the policy's hold-out and of the inline-data copy under
    .loop/ that held the texts), and the history records the erasure (not the
    texts)."""

    parts: ErasureParts

    def _predlog(self) -> PredictionLogBackend:
        plog = self.parts.predlog
        if plog is None:
            raise ApiError(409, "log_off", "the service keeps no prediction log")
        return plog

    async def _copies(self, erased: dict[str, set[str]], whole: bool = False
                      ) -> dict[str, int]:
        policies = self.parts.policies
        if policies is None:
            return {"holdout": 0, "data_copy": 0}
        return await _run(policies.forget, erased, whole, what="the policies' copies",
                          path=getattr(policies, "dir", ""))


class RequestErasureHandler(_Erasure):
    """DELETE /predictions/<request_id>: one request's texts erased from the
    log (what is still queued for its writer too), from the feedback on it and
    from the model's free examples with those texts."""

    async def delete(self, request_id: str) -> None:
        plog = self._predlog()
        rid = check_id(request_id, "the request id")
        erased: dict[str, set[str]] = {}
        removed = await _run(plog.erase, rid, 60.0, erased, what="the prediction log",
                             path=getattr(plog, "path", ""))
        answer = {"request_id": rid, "removed": removed, "copies": await self._copies(erased)}
        self.audit(None, "erase", answer)
        self.send_json(answer)


class ModelErasureHandler(_Erasure):
    """DELETE /models/<name>/predictions: a model's whole log, feedback and
    free examples."""

    async def delete(self, name: str) -> None:
        plog = self._predlog()
        model = name_of(name)
        erased: dict[str, set[str]] = {}
        removed = await _run(plog.purge, model, 60.0, erased, what="the prediction log",
                             path=getattr(plog, "path", ""))
        answer = {"model": model, "removed": removed,
                  "copies": await self._copies(erased, whole=True)}
        self.audit(model, "erase", answer)
        self.send_json(answer)


def name_of(value: Any) -> str:
    from state.store import check_name
    try:
        return check_name(value)
    except InvalidName as exc:
        raise ApiError(400, "invalid_name", str(exc)) from None


def inference_routes(kw: dict[str, Any], feedback: FeedbackService) -> list[Any]:
    return [(r"/feedback", FeedbackHandler, {**kw, "parts": feedback})]  # kw's auth: the feedback key


def management_routes(kw: dict[str, Any], feedback: FeedbackService, policies: PolicyParts,
                      predlog: PredictionLogBackend | None) -> list[Any]:
    return [(r"/models/([^/]+)/review", ReviewHandler, {**kw, "parts": feedback}),
            (r"/models/([^/]+)/policy", PolicyHandler, {**kw, "parts": policies}),
            (r"/predictions/([^/]+)", RequestErasureHandler,
             {**kw, "parts": ErasureParts(predlog, policies.policies)}),
            (r"/models/([^/]+)/predictions", ModelErasureHandler,
             {**kw, "parts": ErasureParts(predlog, policies.policies)})]

