"""The lean path for POST /predict, beside Tornado's RequestHandler.

Profiles of the service under single-text load showed about half of the
supervisor's CPU in RequestHandler's own machinery (handler set-up, default
headers, the Date header, flush/finish bookkeeping), not in predicting. This
module answers POST /predict straight from Tornado's HTTP/1 connection
(`HTTPMessageDelegate`) through the same predict pipeline as the
RequestHandlers (frontend/pipeline.py: the same checks, routing, log,
metrics, answers and errors; the same body cap, frontend/base.py
`declared_too_large`), with a fraction of that overhead. The Open
Inference Protocol's infer (POST /v2/models/<name>[/versions/<v>]/infer) is
answered here too, with its own wire (`oip.INFER`), on the routes
frontend/oip.py gives Tornado (`oip.INFER_PATHS`). Every other request
(other paths, other methods) goes to the inference Application untouched:
/healthz, /readyz, /openapi.json, 404s and 405s are Tornado's.
"""
from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

from tornado import httputil
from tornado.ioloop import IOLoop
from tornado.iostream import StreamClosedError
from tornado.web import Application

from frontend import oip, predictions, request_ids
from frontend.base import ApiError, declared_too_large, log_level, read_too_large
from frontend.pipeline import Call, PredictPipeline, Wire

if TYPE_CHECKING:
    from state.config import LimitsSettings

log = logging.getLogger("textswap.http")

# the Open Inference Protocol's infer: its routes in frontend/oip.py, anchored
# as Tornado's routing anchors them
_OIP_INFER = tuple(re.compile(path + "$") for path in oip.INFER_PATHS)


class PredictRouter(httputil.HTTPServerConnectionDelegate):
    """The inference server's delegate: POST /predict here, the rest to `app`."""

    def __init__(self, app: Application, pipeline: PredictPipeline, limits: LimitsSettings,
                 access: Any = None) -> None:
        self.app = app
        self.pipeline = pipeline
        self.access = access  # frontend.auth.Access of the predict key; None: open
        self.limits = limits

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
        self.bad_length: ApiError | None = None  # a Content-Length that is not a number
        self.closed = False
        self.oip: tuple[str, str | None] | None = None  # (name, version) of an OIP infer

    def headers_received(self, start_line: Any, headers: httputil.HTTPHeaders) -> Any:
        path = start_line.path.split("?", 1)[0]
        if start_line.method == "POST" and path != "/predict" and path.startswith("/v2/"):
            for route in _OIP_INFER:
                m = route.match(path)
                if m:
                    self.oip = (m.group(1), m.group(2) if route.groups > 1 else None)
                    break
        if start_line.method != "POST" or (path != "/predict" and self.oip is None):
            self.inner = self.router.app.start_request(self.server_conn, self.conn)
            return self.inner.headers_received(start_line, headers)
        self.start_line, self.headers = start_line, headers
        self.started = time.monotonic()
        try:
            self.too_large = declared_too_large(headers.get("Content-Length"),
                                                self.router.limits.max_body_bytes)
        except ApiError as exc:
            # answered now, as the RequestHandlers answer it: Tornado will not
            # read such a body (it sends a bare 400 after this answer and closes)
            self.bad_length = exc
            return self._answer()
        return None

    def data_received(self, chunk: bytes) -> Any:
        if self.inner is not None:
            return self.inner.data_received(chunk)
        self.size += len(chunk)
        if self.too_large is None:
            self.too_large = read_too_large(self.size, self.router.limits.max_body_bytes)
            if self.too_large is None:
                self.chunks.append(chunk)
            else:
                self.chunks = []
        return None

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()
            return
        IOLoop.current().spawn_callback(self._answer)

    def on_connection_close(self) -> None:
        if self.inner is not None:
            self.inner.on_connection_close()
        self.closed = True

    async def _answer(self) -> None:
        """POST /predict or an OIP infer: the pipeline, less RequestHandler's overhead."""
        if self.oip is None:
            wire: Wire = predictions.JSON
            args: tuple[str | None, ...] = ()
        else:
            wire, args = oip.INFER, self.oip
        denied = refused = None
        namespace = None  # a predict key's, for the ids its clients choose
        if self.router.access is not None:
            try:
                if self.router.access.check("POST", self.headers) is not None:
                    namespace = request_ids.key_namespace(self.headers)
            except ApiError as exc:
                denied = exc
        if self.bad_length is not None:
            refused = self.bad_length
        elif self.too_large:
            refused = ApiError(413, "body_too_large", self.too_large)
        elif self.oip is not None:
            try:  # as Tornado decodes path arguments
                args = tuple(None if x is None else unquote_to_bytes(x).decode("utf-8")
                             for x in self.oip)
            except UnicodeDecodeError:
                refused = ApiError(400, "bad_path", "the path is not valid UTF-8")
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        reply = await self.router.pipeline.answer(
            wire, Call(self.headers, body, self.start_line.path, args, refused, denied=denied,
                       namespace=namespace),
            self.started)
        if reply.status >= 400:  # a 503 while no model serves yet is expected: not ERROR
            log.log(log_level(reply.status), "%d POST %s %.1fms", reply.status,
                    self.start_line.path, 1000 * (time.monotonic() - self.started),
                    extra={"request_id": reply.headers.get("X-Request-Id")})
        self._write(reply.status, reply.body, reply.headers)

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
