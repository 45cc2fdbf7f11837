"""GET /models/<name>/quality: live quality and drift per version (management
port; computed by control/quality.py on an executor thread)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from frontend.base import ApiError, JsonHandler, service_error
from state.errors import InvalidName
from state.store import check_name

if TYPE_CHECKING:
    from control.quality import Quality


class QualityHandler(JsonHandler):
    """Per version: predictions logged, feedback, live accuracy/macro-F1/per-label/
    confusion on the fed-back predictions (a multi-label version: micro-, macro-,
    samples-F1, exact-match accuracy, per-label counts, no confusion matrix),
    drift signals and the alert."""

    parts: Quality | None

    async def get(self, name: str) -> None:
        try:
            check_name(name)
        except InvalidName as exc:
            raise ApiError(400, "invalid_name", str(exc)) from None
        quality = self.parts
        if quality is None:
            raise ApiError(404, "not_found", "live quality is not available on this service")
        try:
            self.send_json(await quality.report(name))
        except Exception as exc:
            raise service_error(exc) from None


def routes(kw: dict[str, Any], quality: Quality | None) -> list[Any]:
    return [(r"/models/([^/]+)/quality", QualityHandler, {**kw, "parts": quality})]
