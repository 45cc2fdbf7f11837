"""The two Tornado applications (inference, management) and their servers."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tornado.httpserver import HTTPServer
from tornado.web import Application

from frontend import handlers as h
from frontend import rollout_handlers
from frontend import quality_handlers
from frontend import metrics_http
from frontend import artifact, auth, clusterapi, loop_handlers, oip, openapi, training
from frontend import dashboard_routes
from control.feedback import FeedbackService
from frontend.base import NotFoundHandler, log_level
from frontend.pipeline import PredictPipeline

if TYPE_CHECKING:
    from frontend.service import Service
    from state.config import Config

log = logging.getLogger("textswap.http")

# Tornado must not cut a connection before a handler can answer 413 with a
# JSON body: the real cap (limits.max_body_bytes) is checked by the handlers,
# which read and drop an over-large body up to this size; beyond it the
# connection is closed.
_MIN_TRANSPORT_CAP = 64 * 1024 * 1024


def inference_app(sup: Service, config: Config, pipeline: PredictPipeline,
                  feedback: FeedbackService) -> Application:
    # each route gets the config, its key check, the history and the one part it uses
    kw = {"config": config, "history": sup.db}
    access = auth.accesses(sup.keys, config)
    pkw = {**kw, "auth": access["predict"]}  # open while no predict key exists
    return Application([
        (r"/predict", h.PredictHandler, {**pkw, "parts": pipeline}),
        (r"/healthz", h.HealthHandler, kw),
        (r"/readyz", h.ReadyHandler, {**kw, "parts": sup.serving}),
        (r"/openapi.json", openapi.InferenceSpecHandler, {**kw, "parts": access["predict"]}),
        *oip.routes(pkw, pipeline, sup.serving),  # Open Inference Protocol v2
        # POST /feedback (docs/loop.md): the feedback key
        *loop_handlers.inference_routes({**kw, "auth": access["feedback"]}, feedback),
    ], default_handler_class=NotFoundHandler, default_handler_args=kw,
        log_function=metrics_http.counting(sup.metrics, _log))  # what the predict pipeline does not count


def management_app(sup: Service, config: Config, pipeline: PredictPipeline,
                   feedback: FeedbackService) -> Application:
    # guard: Host and Origin checked, no cross-site bodies (frontend/base.py check_site)
    # auth: the admin key, or the review key for reading (frontend/auth.py)
    access = auth.accesses(sup.keys, config)
    kw = {"config": config, "history": sup.db, "auth": access["management"], "guard": True}
    store, applies = sup.store, sup.applies
    routes: list[Any] = [
        *auth.routes(kw, sup.keys),  # POST /auth/session: the start URL's one-time code
        (r"/apply", h.ApplyHandler, {**kw, "parts": applies}),
        (r"/unload", h.UnloadHandler, {**kw, "parts": applies}),
        (r"/status", h.StatusHandler, {**kw, "parts": sup.statusview}),
        (r"/models", h.ModelsHandler, {**kw, "parts": h.Catalog(store, sup.serving)}),
        (r"/models/([^/]+)", h.ModelHandler, {**kw, "parts": store}),
        (r"/models/([^/]+)/([0-9]{1,9})", h.ModelHandler, {**kw, "parts": store}),
        *artifact.routes(kw, store),  # GET /models/<name>/<version>/artifact (.tar.gz)
        (r"/healthz", h.HealthHandler, kw),
        (r"/openapi.json", openapi.ManagementSpecHandler, kw),
        # rollback, promote, abort, rollouts, golden, history
        *rollout_handlers.routes(kw, sup.rollouts, rollout_handlers.GoldenParts(
            sup.golden, sup.storage, sup.jobs), sup.statusview),
        *quality_handlers.routes(kw, sup.quality),  # GET /models/<name>/quality (live quality, drift)
        *metrics_http.routes(kw, sup.metrics),  # GET /metrics (Prometheus)
        *clusterapi.routes(kw, sup.records),  # GET /cluster (cluster mode; 404 otherwise)
        # review queue, retrain policy, erasure
        *loop_handlers.management_routes(kw, feedback, loop_handlers.PolicyParts(
            store, sup.policies), sup.predlog),
        # POST /feedback, /try for the dashboard's panels
        *dashboard_routes.routes(kw, pipeline, feedback),
    ]
    routes += training.routes(kw, sup.jobs)
    from frontend import dashboard  # GET / and /ui/*: the web page (no data, no key)
    routes += dashboard.routes(kw)
    return Application(routes, default_handler_class=NotFoundHandler, default_handler_args=kw,
                        log_function=_audit_log)


def _log(handler: Any) -> None:
    status = handler.get_status()
    if status >= 400:  # expected refusals (503 while no model serves) are not errors
        log.log(log_level(status, handler.request.path), "%d %s %.1fms", status,
                handler._request_summary(), 1000.0 * handler.request.request_time(),
                extra={"request_id": handler._headers.get("X-Request-Id")})


def _audit_log(handler: Any) -> None:
    """The management port's log: refusals as _log, and every state-changing
    call with the name of the key that made it (the history records it too,
    in the entries the call made)."""
    _log(handler)
    name = getattr(handler, "key_name", None)
    if name and handler.request.method not in ("GET", "HEAD", "OPTIONS"):
        log.info("%d %s %s by the %s key", handler.get_status(), handler.request.method,
                 handler.request.path, name)


def _wire_server(inference: Any, config: Config, cap: int) -> Any:
    """The inference port's httptools server (frontend/httpwire.py), or None:
    Tornado's HTTPServer serves it (server.http_parser: tornado, or httptools
    does not import)."""
    s = config.server
    if s.http_parser != "httptools":
        return None
    try:
        from frontend.httpwire import WireServer
    except ImportError as exc:
        log.warning("server.http_parser is httptools but it does not import (%s): "
                    "Tornado's HTTP server serves the inference port", exc)
        return None
    return WireServer(inference, max_body_size=cap, body_timeout=float(s.body_timeout_s),
                      header_timeout=float(s.header_timeout_s),
                      idle_timeout=float(s.idle_timeout_s))


def start_servers(sup: Service, config: Config) -> list[Any]:
    s = config.server
    servers = []
    # one predict pipeline and one feedback service for both ports (their
    # caches: models' labels and policies), each given only what it uses
    pipeline = PredictPipeline(sup, sup.store, sup.policies, sup.predlog, sup.metrics,
                               config.limits, config.predictions.sample, s)
    feedback = FeedbackService(sup.predlog, sup.store, sup.policies,
                               config.feedback.max_items, config.limits.max_text_chars,
                               config.feedback.max_examples)
    inference: Any = inference_app(sup, config, pipeline, feedback)
    if s.fast_predict:
        from frontend.fastpath import PredictRouter
        inference = PredictRouter(inference, pipeline, config.limits,
                                  auth.accesses(sup.keys, config)["predict"])
    cap = max(_MIN_TRANSPORT_CAP, 2 * config.limits.max_body_bytes)

    def tornado(app: Any) -> HTTPServer:
        return HTTPServer(app, max_body_size=cap, xheaders=False,
                          body_timeout=float(s.body_timeout_s))

    for server, host, port in ((_wire_server(inference, config, cap) or tornado(inference),
                                s.host, s.port),
                               (tornado(management_app(sup, config, pipeline, feedback)),
                                s.manage_host, s.manage_port)):
        server.listen(port, address=host)
        servers.append(server)
    m = config.metrics
    if m.enabled and m.port:  # for scrapers that cannot send a key
        server = HTTPServer(metrics_http.metrics_app(sup.metrics, config))
        server.listen(m.port, address=m.host)
        servers.append(server)
    return servers
