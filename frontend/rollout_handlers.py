"""Management handlers for safe rollouts: rollback, promote, abort, the
rollout figures of a model, golden sets for the quality gate, and the
durable history."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from tornado.ioloop import IOLoop

from state import dataset
from state.errors import InvalidName, ServiceError
from frontend.base import ApiError, JsonHandler, int_field, name_field, service_error
from state.store import check_name

if TYPE_CHECKING:
    from control.jobs import JobManager
    from control.rollout_control import RolloutControl
    from control.rollout_state import GoldenSets
    from control.status import StatusView
    from state.storage import Storage


def _bool(data: dict[str, Any], key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, "invalid_field", f"'{key}' must be true or false")
    return value


def _fraction(data: dict[str, Any], key: str, default: float | None) -> float | None:
    value = data.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ApiError(400, "invalid_field", f"'{key}' must be a number from 0 to 1")
    return float(value)


def rollout_options(data: dict[str, Any]) -> dict[str, Any]:
    """The rollout fields of POST /apply, checked."""
    mode = data.get("mode", "normal")
    if mode not in ("normal", "shadow", "canary"):
        raise ApiError(400, "invalid_field", "'mode' must be 'normal', 'shadow' or 'canary'")
    fraction = _fraction(data, "fraction", None)
    if mode == "normal" and fraction is not None:
        raise ApiError(400, "invalid_field", "'fraction' needs 'mode' shadow or canary")
    if fraction is not None and fraction <= 0.0:
        raise ApiError(400, "invalid_field", "'fraction' must be above 0")
    return {"mode": mode, "fraction": fraction,
            "keep_examples": int_field(data, "keep_examples", minimum=0, maximum=100, default=0),
            "gate": _bool(data, "gate", True),
            "min_accuracy": _fraction(data, "min_accuracy", None)}


ROLLOUT_FIELDS = {"mode", "fraction", "keep_examples", "gate", "min_accuracy"}


class _NameAction(JsonHandler):
    parts: RolloutControl
    fields: set[str]  # each subclass sets its body's fields, and defines act()
    act: Callable[[str, dict[str, Any]], Awaitable[Any]]

    async def post(self) -> None:
        data = self.json_object(self.fields)
        name = name_field(data)
        try:
            self.send_json(await self.act(name, data))
        except InvalidName:
            raise ApiError(404, "model_not_serving", f"model {name!r} is not serving") from None
        except ApiError:
            raise
        except Exception as exc:
            raise service_error(exc) from None


class RollbackHandler(_NameAction):
    """POST /rollback {"name"}: the previous version serves again."""
    fields = {"name"}

    async def act(self, name: str, data: dict[str, Any]) -> Any:
        return await self.parts.rollback(name)


class PromoteHandler(_NameAction):
    """POST /promote {"name", "gate"?}: the shadow/canary candidate serves."""
    fields = {"name", "gate"}

    async def act(self, name: str, data: dict[str, Any]) -> Any:
        return await self.parts.promote(name, gate=_bool(data, "gate", True))


class AbortHandler(_NameAction):
    """POST /abort {"name"}: drop the shadow/canary candidate."""
    fields = {"name"}

    async def act(self, name: str, data: dict[str, Any]) -> Any:
        return await self.parts.abort(name)


class RolloutHandler(JsonHandler):
    """GET /rollouts/<name>: probation, candidate figures, rollbacks."""

    parts: RolloutControl

    def get(self, name: str) -> None:
        try:
            self.send_json(self.parts.rollout_status(name))
        except Exception as exc:
            raise service_error(exc) from None


@dataclass(frozen=True)
class GoldenParts:
    """What the golden-set routes use: the sets, durable writes, and where
    a `{"path": ...}` may be read from (the job manager's data roots)."""
    golden: GoldenSets
    storage: Storage
    jobs: JobManager


class GoldenHandler(JsonHandler):
    """PUT/GET/DELETE /models/<name>/golden: the quality gate's golden set."""

    parts: GoldenParts

    def _name(self, name: str) -> str:
        try:
            return check_name(name)
        except InvalidName as exc:
            raise ApiError(404, "not_found", str(exc)) from None

    async def put(self, name: str) -> None:
        name = self._name(name)
        data = self.json_object({"data", "min_accuracy"})
        if "data" not in data:
            raise ApiError(400, "missing_field", "'data' is required (as for /train)")
        floor = _fraction(data, "min_accuracy", None)
        try:
            ds = await IOLoop.current().run_in_executor(None, dataset.load, data["data"],
                                                        self.parts.jobs.data_roots)
        except dataset.DataError as exc:
            raise ApiError(getattr(exc, "status", 400), getattr(exc, "code", "invalid_data"),
                           str(exc)) from None
        # persisted (off the IOLoop) before the answer; a failed write: 507/503
        try:
            golden = self.parts.golden
            entry = await self.parts.storage.write(
                f"the golden set of {name}", golden.path(name), golden.put,
                name, ds.texts, ds.labels, ds.source, ds.sha256, floor)
        except ServiceError as exc:
            raise service_error(exc) from None
        self.audit(name, "golden", {"examples": len(ds.texts), "sha256": ds.sha256,
                                    "min_accuracy": floor})
        self.send_json({"golden": entry})

    def get(self, name: str) -> None:
        from control.rollout_state import summary
        entry = self.parts.golden.get(self._name(name))
        if entry is None:
            raise ApiError(404, "not_found", f"no golden set for {name!r}")
        self.send_json({"golden": summary(entry)})

    async def delete(self, name: str) -> None:
        name = self._name(name)
        try:
            golden = self.parts.golden
            deleted = await self.parts.storage.write(f"the golden set of {name}",
                                                     golden.path(name), golden.delete, name)
        except ServiceError as exc:
            raise service_error(exc) from None
        if not deleted:
            raise ApiError(404, "not_found", f"no golden set for {name!r}")
        self.audit(name, "golden_deleted")
        self.send_json({"deleted": name})


class HistoryHandler(JsonHandler):
    """GET /history?name=&limit=: applies, rollbacks, crashes..., newest first."""

    parts: StatusView

    async def get(self) -> None:
        name = self.get_query_argument("name", None)
        if name is not None:
            try:
                check_name(name)
            except InvalidName as exc:
                raise ApiError(400, "invalid_name", str(exc)) from None
        raw = self.get_query_argument("limit", "100")
        # ASCII digits only: str.isdigit() also takes '²', which int() refuses
        if not re.fullmatch(r"[0-9]{1,4}", raw) or not 1 <= int(raw) <= 1000:
            raise ApiError(400, "invalid_field", "'limit' must be an integer from 1 to 1000")
        rows = await IOLoop.current().run_in_executor(None, self.parts.history, name,
                                                      int(raw))
        self.send_json({"history": rows})


def routes(kw: dict[str, Any], rollouts: RolloutControl, golden: GoldenParts,
           status: StatusView) -> list[Any]:
    rkw = {**kw, "parts": rollouts}
    return [
        (r"/rollback", RollbackHandler, rkw),
        (r"/promote", PromoteHandler, rkw),
        (r"/abort", AbortHandler, rkw),
        (r"/rollouts/([^/]+)", RolloutHandler, rkw),
        (r"/models/([^/]+)/golden", GoldenHandler, {**kw, "parts": golden}),
        (r"/history", HistoryHandler, {**kw, "parts": status}),
    ]
