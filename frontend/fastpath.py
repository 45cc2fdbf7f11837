"""The lean path for POST /predict, beside Tornado's RequestHandler.

Profiles of the service under single-text load showed about half of the
supervisor's CPU in RequestHandler's own machinery (handler set-up, default
headers, the Date header, flush/finish bookkeeping), not in predicting. This
module answers POST /predict straight from Tornado's HTTP/1 connection
(`HTTPMessageDelegate`): the same checks (`handlers.predict_request`), the
same supervisor call and the same JSON answers and errors, with a fraction
of that overhead. The Open Inference Protocol's infer (POST
/v2/models/<name>[/versions/<v>]/infer) is answered here too, by the same
function as its RequestHandler (`oip.infer`). Every other request (other
paths, other methods) goes to the inference Application untouched, so
/healthz, /readyz, /openapi.json, 404s and 405s behave exactly as before.
"""
from __future__ import annotations

import json
import logging
import re
import time
from typing import Any
from urllib.parse import unquote_to_bytes

from tornado import httputil
from tornado.ioloop import IOLoop
from tornado.iostream import StreamClosedError
from tornado.web import Application

from frontend import loop, oip, predictions
from frontend.base import ApiError, check_object, log_level, parse_json
from frontend.handlers import PREDICT_FIELDS, predict_request

log = logging.getLogger("textswap.http")

_JSON = "application/json; charset=utf-8"
_NO_MODEL: dict[str, Any] = {"name": "", "version": None}
# the Open Inference Protocol's infer, as routed in frontend/oip.py
_OIP_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")


class PredictRouter(httputil.HTTPServerConnectionDelegate):
    """The inference server's delegate: POST /predict here, the rest to `app`."""

    def __init__(self, app: Application, supervisor: Any, config: Any,
                 access: Any = None) -> None:
        self.app = app
        self.access = access  # frontend.auth.Access of the predict key; None: open
        self.sup = supervisor
        self.limits = config["limits"]
        self.metrics = getattr(supervisor, "metrics", None)

    def start_request(self, server_conn: object,
                      request_conn: httputil.HTTPConnection) -> httputil.HTTPMessageDelegate:
        return _Predict(self, server_conn, request_conn)

    def on_close(self, server_conn: object) -> None:
        self.app.on_close(server_conn)


class _Predict(httputil.HTTPMessageDelegate):
    def __init__(self, router: PredictRouter, server_conn: object,
                 conn: httputil.HTTPConnection) -> None:
        self.router = router
        self.server_conn = server_conn
        self.conn = conn
        self.inner: httputil.HTTPMessageDelegate | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.too_large: str | None = None
        self.closed = False
        self.oip: tuple[str, str | None] | None = None  # (name, version) of an OIP infer

    def headers_received(self, start_line: Any, headers: httputil.HTTPHeaders) -> Any:
        path = start_line.path.split("?", 1)[0]
        if start_line.method == "POST" and path != "/predict" and path.startswith("/v2/"):
            m = _OIP_INFER.match(path)
            self.oip = m.groups() if m else None  # type: ignore[assignment]  # the pattern's 2 groups
        if start_line.method != "POST" or (path != "/predict" and self.oip is None):
            self.inner = self.router.app.start_request(self.server_conn, self.conn)
            return self.inner.headers_received(start_line, headers)
        self.start_line, self.headers = start_line, headers
        self.started = time.monotonic()
        cap = self.router.limits["max_body_bytes"]
        length = headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > cap:
            # read and drop it, then answer 413 (refusing at once makes most
            # clients see a reset instead of the answer)
            self.too_large = f"request body of {int(length)} bytes exceeds the limit of {cap}"
        return None

    def data_received(self, chunk: bytes) -> Any:
        if self.inner is not None:
            return self.inner.data_received(chunk)
        self.size += len(chunk)
        if self.too_large is None:
            cap = self.router.limits["max_body_bytes"]
            if self.size > cap:
                self.too_large = f"request body exceeds the limit of {cap} bytes"
                self.chunks = []
            else:
                self.chunks.append(chunk)
        return None

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()
            return
        IOLoop.current().spawn_callback(self._answer_oip if self.oip else self._answer)

    def on_connection_close(self) -> None:
        if self.inner is not None:
            self.inner.on_connection_close()
        self.closed = True

    async def _answer(self) -> None:
        status, rid = 200, None
        try:
            if self.router.access is not None:
                self.router.access.check("POST", self.headers)
            rid = loop.request_id(self.headers)
            if self.too_large:
                raise ApiError(413, "body_too_large", self.too_large)
            body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
            data = check_object(parse_json(body, self.headers.get("Content-Type")),
                                PREDICT_FIELDS)
            texts, top_k, model = predict_request(data, self.router.limits)
            raw: list[Any] = []
            payload: Any = await predictions.predict(self.router.sup, texts, top_k, model,
                                                     predictions.predict_options(data), raw)
            loop.log_predictions(self.router.sup, rid, texts, payload, raw)
        except ApiError as exc:
            status = exc.status_code
            payload = {"error": {**exc.details, "code": exc.code, "message": exc.message}}
        except Exception:  # never an HTML page or a dropped connection
            log.exception("POST /predict failed")
            status = 500
            payload = {"error": {"code": "internal", "message": "internal error"}}
        out = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
        m = self.router.metrics
        if m is not None:
            ref = payload["model"] if status == 200 else _NO_MODEL
            m.observe_request("predict", ref["name"], ref["version"], status,
                              time.monotonic() - self.started)
        if status >= 400:  # a 503 while no model serves yet is expected: not ERROR
            log.log(log_level(status), "%d POST /predict %.1fms", status,
                    1000 * (time.monotonic() - self.started))
        self._write(status, out, {"Content-Type": _JSON} if rid is None
                    else {"Content-Type": _JSON, loop.HEADER: rid})

    async def _answer_oip(self) -> None:
        """POST /v2/models/<name>[/versions/<v>]/infer: frontend/oip.py's infer,
        with the same answers as its RequestHandler, less the overhead."""
        status, headers, model = 200, {"Content-Type": _JSON}, _NO_MODEL
        try:
            if self.router.access is not None:
                self.router.access.check("POST", self.headers)
            if self.too_large:
                raise ApiError(413, "body_too_large", self.too_large)
            try:  # as Tornado decodes path arguments
                name, version = (None if x is None else unquote_to_bytes(x).decode("utf-8")
                                 for x in self.oip)  # type: ignore[union-attr]  # an OIP infer: set
            except UnicodeDecodeError:
                raise ApiError(400, "bad_path", "the path is not valid UTF-8") from None
            body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
            model, out, head = await oip.infer(self.router.sup, self.router.limits, name,  # type: ignore[arg-type]  # the name group always matches
                                               version, self.headers, body)
            if head is not None:
                headers = {"Content-Type": "application/octet-stream",
                           oip.HEADER_LENGTH: str(head)}
            headers[loop.HEADER] = model["request_id"]
        except ApiError as exc:
            status = exc.status_code
            out = json.dumps({"error": exc.message}, ensure_ascii=False).encode()
        except Exception:  # never an HTML page or a dropped connection
            log.exception("POST %s failed", self.start_line.path)
            status, out = 500, b'{"error": "internal error"}'
        m = self.router.metrics
        if m is not None:
            m.observe_request("oip_infer", model["name"], model["version"], status,
                              time.monotonic() - self.started)
        if status >= 400:
            log.log(log_level(status), "%d POST %s %.1fms", status, self.start_line.path,
                    1000 * (time.monotonic() - self.started))
        self._write(status, out, headers)

    def _write(self, status: int, out: bytes, fields: dict[str, str]) -> None:
        if self.closed:
            return
        headers = httputil.HTTPHeaders({**fields, "Content-Length": str(len(out))})
        try:
            self.conn.write_headers(
                httputil.ResponseStartLine(self.start_line.version, status,
                                           httputil.responses.get(status, "Unknown")),
                headers, out)
            self.conn.finish()
        except StreamClosedError:
            pass  # the client went away; nothing to tell it
