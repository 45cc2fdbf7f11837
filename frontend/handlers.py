"""Inference and management handlers: validate, call the part that answers
(the serving state, the control plane's applies, the status view, the model
store), answer JSON."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from control.slots import MAX_REPLICAS
from frontend import predictions
from frontend.base import ApiError, JsonHandler, int_field, name_field, service_error
from frontend.pipeline import PipelineHandler
from frontend.rollout_handlers import ROLLOUT_FIELDS, rollout_options
from state.errors import InvalidName

if TYPE_CHECKING:
    from control.applies import Applies
    from control.status import StatusView
    from frontend.service import ServingView
    from state.store import ModelStore


# -- inference port ----------------------------------------------------------------
class PredictHandler(PipelineHandler):
    """POST /predict through Tornado's RequestHandler (frontend/fastpath.py's
    lean path answers it when server.fast_predict is on)."""

    async def post(self) -> None:
        await self.answer(predictions.JSON)


class HealthHandler(JsonHandler):
    def get(self) -> None:
        self.send_json({"status": "ok"})


class ReadyHandler(JsonHandler):
    """Ready when the default model serves."""

    parts: ServingView

    def get(self) -> None:
        serving = self.parts.serving_model()
        if serving is None:
            raise ApiError(503, "not_ready", "the default model is not serving yet")
        self.send_json({"status": "ready",
                        "model": {"name": serving["name"], "version": serving["version"]},
                        "models": self.parts.serving_names()})


# -- management port ---------------------------------------------------------------


class ApplyHandler(JsonHandler):
    """POST /apply {"name", "version"?, "replicas"?, "default"?}: swap that slot."""

    parts: Applies

    async def post(self) -> None:
        data = self.json_object({"name", "version", "replicas", "default", "partial"}
                                | ROLLOUT_FIELDS)
        name = name_field(data)
        version = None  # null or absent: the latest version
        if data.get("version") is not None:
            version = int_field(data, "version", minimum=1)
        replicas = None
        if data.get("replicas") is not None:
            replicas = int_field(data, "replicas", minimum=1, maximum=MAX_REPLICAS)
        default = data.get("default")
        if default is not None and not isinstance(default, bool):
            raise ApiError(400, "invalid_field", "'default' must be true or false")
        partial = data.get("partial", False)  # cluster mode: the ready nodes may switch alone
        if not isinstance(partial, bool):
            raise ApiError(400, "invalid_field", "'partial' must be true or false")
        try:
            result = await self.parts.apply(name, version, replicas=replicas, default=default,
                                            partial=partial, **rollout_options(data))
        except Exception as exc:
            raise service_error(exc) from None
        self.send_json(result)


class UnloadHandler(JsonHandler):
    """POST /unload {"name"}: stop serving a model (the store keeps it)."""

    parts: Applies

    async def post(self) -> None:
        name = name_field(self.json_object({"name"}))
        try:
            result = await self.parts.unload(name)
        except InvalidName:
            raise ApiError(404, "model_not_serving", f"model {name!r} is not serving") from None
        except Exception as exc:
            raise service_error(exc) from None
        self.send_json(result)


class StatusHandler(JsonHandler):
    parts: StatusView

    def get(self) -> None:
        self.send_json(self.parts.status())


@dataclass(frozen=True)
class Catalog:
    """What GET /models reads: the store's models and what serves."""
    store: ModelStore
    serving: ServingView


class ModelsHandler(JsonHandler):
    parts: Catalog

    def get(self) -> None:
        store, serving = self.parts.store, self.parts.serving
        versions = {n: m["version"] for n in serving.serving_names()
                    if (m := serving.serving_model(n)) is not None}
        default = serving.serving_model()
        self.send_json({"models": store.listing(),
                        "serving": default and {"name": default["name"],
                                                "version": default["version"]},
                        "default": serving.default_name, "serving_versions": versions})


class ModelHandler(JsonHandler):
    parts: ModelStore

    def get(self, name: str, version: str | None = None) -> None:
        store = self.parts
        try:
            if version is None:
                models = [m for m in store.listing() if m["name"] == name]
                if not models:
                    store.resolve(name)
                self.send_json(models[0])
            else:
                v, _ = store.resolve(name, int(version))
                self.send_json(store.meta(name, v))
        except InvalidName:  # a lookup of a name that cannot exist: not there
            raise ApiError(404, "not_found", f"no model named {name!r} in the store") from None
        except Exception as exc:
            raise service_error(exc) from None
