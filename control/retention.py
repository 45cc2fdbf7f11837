"""The age limit of logged texts (predictions.max_age_days): the prediction
log's expire() at start and once a minute, off the IOLoop. Given the log and
its settings only."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tornado.ioloop import IOLoop, PeriodicCallback

from state.predlog_api import PredictionLogBackend

if TYPE_CHECKING:
    from control.policies import Policies
    from state.config import PredictionsSettings

log = logging.getLogger("textswap.retention")


class Retention:
    def __init__(self, predlog: PredictionLogBackend, predictions: "PredictionsSettings",
                 every_s: float = 60.0, policies: "Policies | None" = None) -> None:
        """policies: control/policies.py's Policies, whose copies under .loop/
        (the feedback hold-out, inline-data copies) lose the expired texts too."""
        self.predlog = predlog
        self.policies = policies
        self.cfg = predictions
        self.ages = dict(predictions.max_age_days_by_model)
        self.default = float(predictions.max_age_days)
        self.loop = IOLoop.current()
        self._timer = PeriodicCallback(self.expire, every_s * 1000)

    def start(self) -> None:
        """Says what is kept, then applies the limit now and every minute."""
        p = self.cfg
        if p.log:
            log.info("predicted texts are logged (%s of requests, up to %d texts a model%s) for "
                     "feedback, review and drift; predictions.log: false turns it off, "
                     "DELETE /predictions/<request_id> erases one request's texts",
                     f"{p.sample:.0%}", p.max_rows,
                     f", {self.default:g} days at most" if self.default else "")
        else:
            log.info("the prediction log is off (predictions.log: false): no text is kept")
        self._timer.start()
        self.loop.spawn_callback(self.expire)  # and once now

    def stop(self) -> None:
        self._timer.stop()

    async def expire(self) -> None:
        erased: dict[str, set[str]] = {}
        try:
            removed = await self.loop.run_in_executor(None, self.predlog.expire, self.ages,
                                                      self.default, None, erased)
            if self.policies is not None and any(erased.values()):
                removed = {**removed, **await self.loop.run_in_executor(
                    None, self.policies.forget, erased)}
        except Exception as exc:  # a failing disk or Redis: the next minute tries again
            log.error("prediction log: the age limit could not be applied: %s", exc)
            return
        if any(removed.values()):
            log.info("prediction log: erased past the age limit: %s", removed)
