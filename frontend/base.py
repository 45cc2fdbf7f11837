"""What every handler shares: JSON bodies in, JSON (errors too) out.

Handlers raise ``ApiError`` (or tornado's HTTPError) and one ``write_error``
shapes every error body as ``{"error": {"code": ..., "message": ...}}``, so
no path can answer with Tornado's HTML error page. Bodies are streamed so an
over-large one is refused with 413 from its Content-Length, before it is read.
"""
from __future__ import annotations

import json
import re
import urllib.parse
import logging
from typing import TYPE_CHECKING, Any, Protocol

from tornado import httputil
from tornado.web import HTTPError, RequestHandler, stream_request_body

from frontend import jsonwire
from state.errors import InvalidName, NotFound, ServiceError, StoreError

if TYPE_CHECKING:
    from state.config import Config, LimitsSettings, ServerSettings

log = logging.getLogger("textswap.http")


class HistoryLog(Protocol):
    """Where JsonHandler.audit writes a state change an API call made (the
    state DB's history: the handlers are given it, they never import it)."""

    def add_history(self, name: str | None, kind: str, *, source: str | None = None,
                    details: dict[str, Any] | None = None) -> Any: ...


_REASONS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
            405: "method_not_allowed", 409: "conflict", 411: "length_required",
            413: "body_too_large", 415: "unsupported_media_type", 422: "invalid",
            500: "internal", 502: "bad_gateway", 503: "unavailable", 504: "timeout"}


def log_level(status: int, path: str = "") -> int:
    """How loud an answer is logged. A 503 is an expected refusal (no model yet
    while the first one trains, overloaded, shutting down): WARNING, or INFO for
    readiness probes that ask every few seconds; other 5xx are ERROR; 4xx INFO."""
    if status == 503:
        return logging.INFO if path in ("/readyz", "/v2/health/ready") else logging.WARNING
    return logging.ERROR if status >= 500 else logging.INFO


class ApiError(HTTPError):
    def __init__(self, status: int, code: str, message: str,
                 details: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, reason=httputil.responses.get(status, "Error"))
        self.code = code
        self.message = message
        self.details = details or {}
        self.headers = headers or {}  # sent with the error (e.g. Retry-After)


# what Tornado's HTTP/1 reader takes as a Content-Length (it refuses anything else)
_LENGTH = re.compile(r"[0-9]+")


def declared_too_large(length: str | None, cap: int) -> str | None:
    """The body cap checked on a request's Content-Length, before its body is
    read: the one check of the RequestHandlers and the lean path
    (frontend/fastpath.py). None when no length is declared or it is within
    `cap`; the 413's message when it is over (the caller reads and drops the
    body, then answers 413: refusing at once makes most clients see a reset
    instead of the answer). A length that is not a plain number is ApiError
    400: Tornado refuses such a request too, but with a bare 400 and no body,
    and only after this answer has gone out."""
    if length is None:
        return None
    if _LENGTH.fullmatch(length) is None:
        raise ApiError(400, "bad_request", "invalid Content-Length")
    n = int(length)
    return f"request body of {n} bytes exceeds the limit of {cap}" if n > cap else None


def read_too_large(size: int, cap: int) -> str | None:
    """The body cap on the bytes read so far (a chunked body declares no
    length): the 413's message once `size` is over `cap`, else None."""
    return f"request body exceeds the limit of {cap} bytes" if size > cap else None


@stream_request_body
class JsonHandler(RequestHandler):
    """Base handler. ``initialize`` receives the config, the route group's key
    check (auth) and site guard, the history that audit() writes to, and the
    one object of the service that the handler uses (``parts``): a part such
    as the model store or the job manager, a narrow Protocol of the control
    plane (frontend/service.py), or a small dataclass of a few parts. Each
    subclass declares its type (``parts: ModelStore``); frontend/app.py
    composes them, so no handler sees the supervisor."""

    # the management port's routes and POST /feedback: only this service's own
    # names in Host and Origin, and a body not declared JSON only with a valid
    # Authorization header (see check_site); routes= kw "guard" or the class
    guarded = False

    # the key check (frontend/auth.py): needs_key is False on the routes that
    # take no key (the dashboard's files, the session exchange, the OIP
    # probes); review_may_post is True where the review key may POST too (the
    # management port's /feedback and /try)
    needs_key = True
    review_may_post = False

    parts: Any = None

    def initialize(self, config: Config, auth: Any = None, guard: bool = False,
                   history: HistoryLog | None = None, parts: Any = None) -> None:
        self.parts = parts
        self.history = history
        self.cfg = config
        self.limits: LimitsSettings = config.limits
        self.auth = auth  # a frontend.auth.Access, or None: no key checked
        self.guard = guard or self.guarded
        self.authorized = False  # a valid Authorization header came with it
        self.key_name: str | None = None  # the name of that key
        self._chunks: list[bytes] = []
        self._size = 0
        self._too_large: str | None = None

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json; charset=utf-8")

    def prepare(self) -> None:
        if self.guard:
            check_site(self.request.headers, self.cfg.server)
        if self.auth is not None and self.needs_key:
            self.key_name = self.auth.check(self.request.method, self.request.headers,
                                            self.review_may_post)
            self.authorized = self.key_name is not None
        if self.request.method in ("POST", "PUT", "PATCH", "DELETE"):
            self._too_large = declared_too_large(self.request.headers.get("Content-Length"),
                                                 self.limits.max_body_bytes)

    def data_received(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._too_large:
            return
        self._too_large = read_too_large(self._size, self.limits.max_body_bytes)
        if self._too_large:
            self._chunks = []
            return
        self._chunks.append(chunk)

    @property
    def body(self) -> bytes:
        if self._too_large:
            raise ApiError(413, "body_too_large", self._too_large)
        if len(self._chunks) != 1:
            self._chunks = [b"".join(self._chunks)]
        return self._chunks[0]

    def json_body(self, required: bool = True) -> Any:
        if self._too_large:
            raise ApiError(413, "body_too_large", self._too_large)
        content_type = self.request.headers.get("Content-Type")
        if self.guard and not self.authorized and not declared_json(content_type):
            # a cross-site form or no-cors fetch sends exactly this, and can
            # send no Authorization header: `curl -d` with -H "Authorization:
            # Bearer ..." still works
            raise ApiError(415, "unsupported_media_type",
                           "this route takes a body not declared 'Content-Type: "
                           "application/json' only with a valid 'Authorization: Bearer "
                           "<token>' header")
        return parse_json(self.body, content_type, required)

    def json_object(self, allowed: set[str], required: bool = True) -> dict[str, Any]:
        return check_object(self.json_body(required), allowed)

    def allowed_methods(self) -> list[str]:
        """The HTTP methods this handler class implements."""
        return [m for m in self.SUPPORTED_METHODS
                if getattr(type(self), m.lower(), None) is not getattr(RequestHandler, m.lower())]

    def audit(self, name: str | None, kind: str, details: dict[str, Any] | None = None) -> None:
        """A history entry for a state change this call made (training,
        cancelling, golden sets, policies, erasures): what changed and, with
        auth on, which key did it (state/statedb.py add_history). The change
        is done and persisted already; a failed entry is logged, not answered."""
        if self.history is None:
            return
        try:
            self.history.add_history(name, kind, source="api", details=details)
        except Exception as exc:
            log.error("cannot record %s of %s in the history: %s", kind, name, exc)

    def send_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data, ensure_ascii=False, allow_nan=False))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        details: dict[str, Any] = {}
        if isinstance(exc, ApiError):
            code, message, details = exc.code, exc.message, exc.details
            for name, value in exc.headers.items():
                self.set_header(name, value)
        elif isinstance(exc, HTTPError):
            code = _REASONS.get(status_code, "error")
            message = exc.log_message or httputil.responses.get(status_code, "error")
        else:
            code = _REASONS.get(status_code, "error")
            message = httputil.responses.get(status_code, "error")
        self.set_header("Content-Type", "application/json; charset=utf-8")
        if status_code == 405:  # RFC 9110: a 405 names the methods the resource has
            self.set_header("Allow", ", ".join(self.allowed_methods()))
        self.finish(json.dumps({"error": {**details, "code": code, "message": message}},
                               ensure_ascii=False, default=str))


FORM = "application/x-www-form-urlencoded"  # what curl -d sends by default
_LOCAL = {"localhost", "127.0.0.1", "::1"}
_ANY = {"", "0.0.0.0", "::"}  # nosec B104 # no bind: names left out


def declared_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def allowed_hosts(server: ServerSettings) -> set[str]:
    """The names the service answers to on guarded routes: localhost, the
    addresses it is bound to, and server.allowed_hosts (the public names a
    proxy forwards, e.g. nginx's Host)."""
    names = set(_LOCAL) | {str(h).lower() for h in server.allowed_hosts or []}
    names |= {str(h).lower() for h in (server.host, server.manage_host)} - _ANY
    return names


def _hostname(value: str) -> str:
    """host[:port] or [v6]:port -> the host, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def check_site(headers: Any, server: ServerSettings) -> None:
    """Host must be one of this service's names (a DNS-rebinding page sends
    its own), and an Origin, when sent, too (a page of another site)."""
    allowed = allowed_hosts(server)
    host = headers.get("Host") or ""
    if _hostname(host) not in allowed:
        raise ApiError(403, "forbidden_host",
                       f"Host {host[:100]!r} is not one of this service's names; add it to "
                       "server.allowed_hosts if it is")
    origin = headers.get("Origin")
    if origin is not None and not own_origin(origin, host, server):
        raise ApiError(403, "forbidden_origin",
                       f"requests from pages of {origin[:100]!r} are refused here")


def own_origin(origin: str, host: str, server: ServerSettings) -> bool:
    """Whether a page's Origin is this service's own: one of its names, the
    port the request came to (its Host's), and http (https too for the
    server.allowed_hosts names, which a TLS proxy may serve)."""
    try:
        parsed = urllib.parse.urlsplit(origin)
        port = parsed.port
        there = urllib.parse.urlsplit("//" + host).port
    except ValueError:
        return False
    name = (parsed.hostname or "").lower()
    proxied = {str(h).lower() for h in server.allowed_hosts or []}
    if parsed.scheme not in (("http", "https") if name in proxied else ("http",)):
        return False
    default = 443 if parsed.scheme == "https" else 80
    return name in allowed_hosts(server) and (port or default) == (there or default)


def parse_json(raw: bytes, content_type: str | None, required: bool = True) -> Any:
    """The JSON value of a request body, or an ApiError saying what is wrong."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media == FORM:
        # `curl -d '{...}'` sends JSON as a form: answer it when it is JSON
        try:
            return loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise ApiError(415, "unsupported_media_type",
                           f"Content-Type is '{media}' and the body is not JSON; send "
                           "JSON (Content-Type: application/json)") from None
    if media not in ("application/json", "") and not media.endswith("+json"):
        raise ApiError(415, "unsupported_media_type",
                       f"Content-Type must be application/json, got '{media}'")
    if not raw.strip():
        if required:
            raise ApiError(400, "bad_request", "request body is empty; JSON expected")
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "bad_encoding", f"body is not valid UTF-8: {exc}") from None
    try:
        return loads(raw, utf8=True)  # the value json.loads(text) gives, faster
    except ValueError as exc:
        raise ApiError(400, "bad_json", f"body is not valid JSON: {exc}") from None


MAX_DEPTH = 64  # how deep a request body's arrays and objects may nest


def loads(raw: str | bytes, *, utf8: bool = False) -> Any:
    """json.loads for request bodies (bytes: UTF-8, -16 or -32; utf8=True: the
    caller checked it is UTF-8): arrays and objects nested deeper than
    MAX_DEPTH are refused (400 too_deep), however deep (json's RecursionError
    included). Bad JSON raises ValueError, as json.loads does. A body with
    fewer brackets than the bound cannot nest past it: it goes through orjson
    (frontend/jsonwire.py, the same value and errors, faster) with no walk."""
    opened = raw.count("[") + raw.count("{") if isinstance(raw, str) \
        else raw.count(b"[") + raw.count(b"{")
    if opened <= MAX_DEPTH:
        if isinstance(raw, str):
            return json.loads(raw)
        return jsonwire.loads_utf8(raw) if utf8 else jsonwire.loads(raw)
    try:
        data = json.loads(raw.decode("utf-8") if utf8 and isinstance(raw, bytes) else raw)
    except RecursionError:
        raise _too_deep() from None
    if isinstance(data, (dict, list)):
        stack: list[tuple[Any, int]] = [(data, 1)]
        while stack:
            value, depth = stack.pop()
            for item in (value.values() if isinstance(value, dict) else value):
                if isinstance(item, (dict, list)):
                    if depth >= MAX_DEPTH:
                        raise _too_deep()
                    stack.append((item, depth + 1))
    return data


def _too_deep() -> ApiError:
    return ApiError(400, "too_deep", f"the body nests arrays or objects more than "
                                     f"{MAX_DEPTH} deep; flatten it")


def check_object(data: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ApiError(400, "bad_request", "body must be a JSON object")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ApiError(400, "unknown_field",
                       f"unknown field(s) {', '.join(map(repr, unknown))}; "
                       f"allowed: {', '.join(sorted(allowed))}")
    return data


class NotFoundHandler(JsonHandler):
    def prepare(self) -> None:
        raise ApiError(404, "not_found", f"no such endpoint: {self.request.path}")


def int_field(data: dict[str, Any], key: str, *, minimum: int = 1, maximum: int | None = None,
              default: Any = None) -> Any:
    value = data.get(key, default)
    if value is default and key not in data:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, "invalid_field", f"'{key}' must be an integer")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ApiError(400, "invalid_field", f"'{key}' must be {bound}, got {value}")
    return value


def service_error(exc: Exception) -> ApiError:
    if isinstance(exc, InvalidName):
        return ApiError(400, "invalid_name", str(exc))
    if isinstance(exc, NotFound):
        return ApiError(404, "not_found", str(exc))
    if isinstance(exc, ServiceError):
        return ApiError(exc.status, exc.code, str(exc), exc.details)
    if isinstance(exc, StoreError):
        return ApiError(500, "store_error", str(exc))
    raise exc


def name_field(data: dict[str, Any]) -> str:
    if "name" not in data:
        raise ApiError(400, "missing_field", "'name' is required")
    if not isinstance(data["name"], str):
        raise ApiError(400, "invalid_name", "'name' must be a string")
    return data["name"]
