"""The dashboard's two inference-side routes, on the management port.

The dashboard page is served by the management port and may only call its
own origin (its Content-Security-Policy says ``connect-src 'self'``), with the
one key it knows: the admin or review key (or a session with the admin
scope). Two of its panels need what lives on the inference port, so the
management port answers them itself, through the same code:

- ``POST /feedback``: the very handler of the inference port's POST /feedback
  (frontend/loop_handlers.py, control/feedback.py's FeedbackService), but
  taking the admin or review key (labelling the review queue is what the
  review key is for); the inference port's /feedback takes only the
  feedback key.
  The Review panel posts ``{"request_id", "index", "label"}`` here.
- ``POST /try``: a /predict body (text or texts, model, top_k, min_score,
  explain) answered by the same pipeline as /predict (frontend/pipeline.py,
  with the wire ``predictions.TRY``), but NOT logged: a text typed by a person to look at a model is not traffic, and
  must not enter the prediction log, the review queue, live quality or the
  drift window. No request id either (nothing to give feedback on). The
  "Try it" box uses it with ``explain``.

Why not CORS from the page to the inference port: the page would need that
port's address (which a proxy or another host may hide), the feedback key
(never given to a person's page), and a looser CSP; and its Try-it texts would be
logged as traffic.
"""
from __future__ import annotations

from typing import Any

from control.feedback import FeedbackService
from frontend import predictions
from frontend.base import JsonHandler
from frontend.loop_handlers import FeedbackHandler
from frontend.pipeline import PipelineHandler, PredictPipeline


class ManagementFeedbackHandler(FeedbackHandler):
    """POST /feedback on the management port: the admin or review key."""

    review_may_post = True


class TryHandler(PipelineHandler):
    """POST /try: a prediction for a person to look at (not logged); the admin
    or review key. The body is read as on every management route."""

    review_may_post = True

    async def post(self) -> None:
        await self.answer(predictions.TRY, data=self.json_object(predictions.PREDICT_FIELDS))


def routes(kw: dict[str, Any], pipeline: PredictPipeline, feedback: FeedbackService
           ) -> list[Any]:
    return [(r"/feedback", ManagementFeedbackHandler, {**kw, "parts": feedback}),
            (r"/try", TryHandler, {**kw, "parts": pipeline})]
