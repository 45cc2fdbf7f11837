"""Inference and management handlers: validate, call the supervisor, answer JSON."""
from __future__ import annotations

from typing import Any

from control.slots import MAX_REPLICAS
from frontend.base import ApiError, JsonHandler, int_field, name_field, service_error
from frontend.rollout_handlers import ROLLOUT_FIELDS, rollout_options
from state.errors import InvalidName


# -- inference port ----------------------------------------------------------------
PREDICT_FIELDS = {"text", "texts", "top_k", "model", "min_score", "explain"}


def predict_request(data: dict[str, Any], lim: dict[str, Any]
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
        if len(texts) > lim["max_texts"]:
            raise ApiError(413, "too_many_texts",
                           f"'texts' has {len(texts)} items; the limit is {lim['max_texts']}")
        what = "'texts'"
    cap = lim["max_text_chars"]
    for i, t in enumerate(texts):
        where = what if len(texts) == 1 and "text" in data else f"{what}[{i}]"
        if not isinstance(t, str):
            raise ApiError(400, "invalid_field", f"{where} must be a string")
        if not t or t.isspace():
            raise ApiError(400, "empty_text", f"{where} is empty")
        if len(t) > cap:
            # a validation error, not 413: that status is about the body's size
            raise ApiError(422, "text_too_long",
                           f"{where} has {len(t)} characters; the limit is {cap}")
        if not t.isascii():
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "bad_text", f"{where} contains an unpaired surrogate "
                                                "escape, which is not valid Unicode") from None
    top_k = int_field(data, "top_k", minimum=1, maximum=lim["max_top_k"],
                      default=lim["default_top_k"])
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "invalid_field", "'model' must be a model name (a string)")
    return texts, top_k, model


class PredictHandler(JsonHandler):
    """POST /predict through Tornado's RequestHandler (see frontend/fastpath.py
    for the lean path that normally answers it)."""

    async def post(self) -> None:
        from frontend import loop, predictions

        rid = loop.request_id(self.request.headers)
        self.set_header(loop.HEADER, rid)
        data = self.json_object(PREDICT_FIELDS)
        texts, top_k, model = predict_request(data, self.limits)
        raw: list[Any] = []
        payload = await predictions.predict(self.sup, texts, top_k, model,
                                            predictions.predict_options(data), raw)
        loop.log_predictions(self.sup, rid, texts, payload, raw)
        self.send_json(payload)


class HealthHandler(JsonHandler):
    def get(self) -> None:
        self.send_json({"status": "ok"})


class ReadyHandler(JsonHandler):
    """Ready when the default model serves."""

    def get(self) -> None:
        serving = self.sup.serving_model()
        if serving is None:
            raise ApiError(503, "not_ready", "the default model is not serving yet")
        self.send_json({"status": "ready",
                        "model": {"name": serving["name"], "version": serving["version"]},
                        "models": self.sup.serving_names()})


# -- management port ---------------------------------------------------------------


class ApplyHandler(JsonHandler):
    """POST /apply {"name", "version"?, "replicas"?, "default"?}: swap that slot."""

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
            result = await self.sup.apply(name, version, replicas=replicas, default=default,
                                          partial=partial, **rollout_options(data))
        except Exception as exc:
            raise service_error(exc) from None
        self.send_json(result)


class UnloadHandler(JsonHandler):
    """POST /unload {"name"}: stop serving a model (the store keeps it)."""

    async def post(self) -> None:
        name = name_field(self.json_object({"name"}))
        try:
            result = await self.sup.unload(name)
        except InvalidName:
            raise ApiError(404, "model_not_serving", f"model {name!r} is not serving") from None
        except Exception as exc:
            raise service_error(exc) from None
        self.send_json(result)


class StatusHandler(JsonHandler):
    def get(self) -> None:
        self.send_json(self.sup.status())


class ModelsHandler(JsonHandler):
    def get(self) -> None:
        serving = {n: self.sup.serving_model(n)["version"] for n in self.sup.serving_names()}
        default = self.sup.serving_model()
        self.send_json({"models": self.sup.store.listing(),
                        "serving": default and {"name": default["name"],
                                                "version": default["version"]},
                        "default": self.sup.default_name, "serving_versions": serving})


class ModelHandler(JsonHandler):
    def get(self, name: str, version: str | None = None) -> None:
        try:
            if version is None:
                models = [m for m in self.sup.store.listing() if m["name"] == name]
                if not models:
                    self.sup.store.resolve(name)
                self.send_json(models[0])
            else:
                v, _ = self.sup.store.resolve(name, int(version))
                self.send_json(self.sup.store.meta(name, v))
        except InvalidName:  # a lookup of a name that cannot exist: not there
            raise ApiError(404, "not_found", f"no model named {name!r} in the store") from None
        except Exception as exc:
            raise service_error(exc) from None
