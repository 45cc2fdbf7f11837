"""GET /metrics (Prometheus text format) and request counting for the apps.

/metrics is served on the management port, behind the admin or review key,
and, when `metrics.port` is set, on a port of its own without a key (for
scrapers that cannot send one; bind it where only they can reach it).
The predict pipeline (frontend/pipeline.py) counts the predictions it
answers, on the lean path of fastpath.py and through RequestHandlers alike;
every other answer of the inference port is counted from the application's
log function, once per answer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from tornado.web import Application

from frontend.base import ApiError, JsonHandler, NotFoundHandler
from frontend.pipeline import PipelineHandler

if TYPE_CHECKING:
    from control.metrics import Metrics
    from state.config import Config


class MetricsHandler(JsonHandler):
    parts: Metrics | None

    def get(self) -> None:
        m = self.parts
        if m is None or not m.enabled:
            raise ApiError(404, "not_found", "metrics are off (metrics.enabled: false)")
        try:
            body, content_type = m.exposition(self.request.headers.get("Accept"))
        except (TypeError, ValueError):  # an unparsable version= in Accept: plain text
            body, content_type = m.exposition(None)
        self.set_header("Content-Type", content_type)
        self.finish(body)


def routes(kw: dict[str, Any], metrics: Metrics | None
           ) -> list[tuple[str, type, dict[str, Any]]]:
    return [(r"/metrics", MetricsHandler, {**kw, "parts": metrics})]


def metrics_app(metrics: Metrics | None, config: Config) -> Application:
    """The app of the optional metrics-only port: GET /metrics, no key."""
    kw = {"config": config}
    return Application(routes(kw, metrics), default_handler_class=NotFoundHandler,
                       default_handler_args=kw)


def counting(m: Metrics | None, log_function: Callable[[Any], None]) -> Callable[[Any], None]:
    """log_function, plus one count per answer of the app it logs for."""
    if m is None or not m.enabled:
        return log_function

    def log_and_count(handler: Any) -> None:
        log_function(handler)
        if isinstance(handler, PipelineHandler) and handler.counted:
            return  # the pipeline counted it
        request = handler.request
        api = getattr(handler, "metric_api", None) or (
            "predict" if request.path == "/predict" else "other")
        model = getattr(handler, "metric_model", None) or {}
        m.observe_request(api, model.get("name", ""), model.get("version"),
                          handler.get_status(), request.request_time())
    return log_and_count
