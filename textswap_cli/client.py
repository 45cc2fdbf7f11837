"""HTTP to the two APIs, and the errors the commands turn into exit codes.

Stdlib urllib only: the CLI must not need more than click and rich. Every
failure becomes a `CliError` carrying the exit code scripts rely on (see
EXIT_* below and README "Command line").
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, BinaryIO

EXIT_OK = 0
EXIT_REFUSED = 1      # the server answered with an error, or the job failed
EXIT_USAGE = 2        # bad arguments or unreadable local input (click uses 2 too)
EXIT_CONNECT = 3      # no answer: connection refused, DNS, timeout
EXIT_AUTH = 4         # 401: no key or a wrong one; 403 wrong_key: a key of another scope
EXIT_INTERRUPTED = 130  # Ctrl-C

DEFAULT_URL = "http://127.0.0.1:8081"
DEFAULT_PREDICT_URL = "http://127.0.0.1:8080"


class CliError(Exception):
    """A failure to report: a message, an exit code, and the server's error body."""

    def __init__(self, message: str, exit_code: int = EXIT_REFUSED,
                 body: Any = None, status: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.body = body
        self.status = status

    @property
    def code(self) -> str | None:
        err = (self.body or {}).get("error") if isinstance(self.body, dict) else None
        return err.get("code") if isinstance(err, dict) else None

    @property
    def missing_endpoint(self) -> bool:
        """A 404 for the route itself (an older server), not for a model or job."""
        err = (self.body or {}).get("error") if isinstance(self.body, dict) else None
        message = err.get("message", "") if isinstance(err, dict) else ""
        return self.status == 404 and message.startswith("no such endpoint")


@dataclass
class Api:
    """One base URL; `token` goes into every request when set."""

    base: str
    token: str | None = None
    timeout: float = 60.0

    def url(self, path: str) -> str:
        if not self.base.lower().startswith(("http://", "https://")):
            # urlopen would open file: and other schemes too
            raise CliError(f"the service URL must start with http:// or https://, "
                           f"got {self.base[:100]!r}")
        return self.base.rstrip("/") + path

    def _request(self, method: str, path: str, body: Any = None,
                 timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body, ensure_ascii=False).encode()
        req = urllib.request.Request(self.url(path), data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            # url() lets only http:// and https:// through
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)  # nosec B310
        except urllib.error.HTTPError as exc:
            raise _http_error(method, path, exc) from None
        except (urllib.error.URLError, OSError, socket.timeout) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"cannot reach {self.base} ({method} {path}): {reason}",
                           EXIT_CONNECT) from None

    def call(self, method: str, path: str, body: Any = None,
             timeout: float | None = None) -> Any:
        """The JSON answer of a request (an error answer raises CliError)."""
        with self._request(method, path, body, timeout) as resp:
            raw = resp.read()
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise CliError(f"{method} {path}: the answer is not JSON") from None

    def get(self, path: str, **kw: Any) -> Any:
        return self.call("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self.call("POST", path, body, **kw)

    def put(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self.call("PUT", path, body, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.call("DELETE", path, **kw)

    def download(self, path: str, out: BinaryIO, timeout: float | None = None) -> int:
        """Stream a binary answer into `out`; returns the bytes written."""
        with self._request("GET", path, timeout=timeout) as resp:
            shutil.copyfileobj(resp, out, 1 << 20)
        return out.tell()


def _http_error(method: str, path: str, exc: urllib.error.HTTPError) -> CliError:
    raw = exc.read()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):  # the service's {"error": {"code", "message"}}
        detail = f"{err.get('message')} ({err.get('code')})"
    elif isinstance(err, str):  # the Open Inference Protocol's {"error": "..."}
        detail = err
    else:
        detail = raw[:300].decode("utf-8", "replace") or exc.reason
    wrong_key = exc.code == 403 and isinstance(err, dict) and err.get("code") == "wrong_key"
    code = EXIT_AUTH if exc.code == 401 or wrong_key else EXIT_REFUSED
    hint = (" (give the key: --key, TEXTSWAP_KEY, or the key file of a local service: "
            "--keys-file, TEXTSWAP_KEYS_FILE, else .textswap/keys.json of the checkout)"
            if code == EXIT_AUTH else "")
    return CliError(f"{method} {path} -> {exc.code}: {detail}{hint}", code, body, exc.code)


def quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


# -- finding a key ----------------------------------------------------------------------
# The key file `make serve` (and `textswap serve`) makes on a first start:
# beside the checkout's ./models store, as the service's auth.keys_file
# default (<models_dir>/../.textswap/keys.json) puts it.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_KEYS_FILE = os.path.join(CHECKOUT, ".textswap", "keys.json")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# the environment variables of each key name, first to last (the older names last)
KEY_ENV = {"admin": ("TEXTSWAP_KEY", "TEXTSWAP_ADMIN_KEY", "TEXTSWAP_MANAGEMENT_TOKEN"),
           "feedback": ("TEXTSWAP_FEEDBACK_KEY", "TEXTSWAP_FEEDBACK_TOKEN"),
           "predict": ("TEXTSWAP_PREDICT_KEY",)}


def keys_file_path(flag: str | None = None) -> str:
    """--keys-file, else TEXTSWAP_KEYS_FILE, else the checkout's default."""
    return os.path.abspath(flag or os.environ.get("TEXTSWAP_KEYS_FILE") or DEFAULT_KEYS_FILE)


def read_keys_file(path: str) -> dict[str, str]:
    """name -> key of a key file ({} when there is none or it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as fh:
            keys = json.load(fh).get("keys")
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in keys.items() if isinstance(v, str)} if isinstance(keys, dict) else {}


def is_local(url: str) -> bool:
    return (urllib.parse.urlsplit(url).hostname or "") in _LOOPBACK


def find_key(name: str, url: str, flag: str | None = None,
             keys_file: str | None = None) -> str | None:
    """The key to send: the --key flag, else the key name's environment
    variables, else, for a service on this machine (a loopback URL), its
    key file (keys_file_path)."""
    if flag:
        return flag
    for var in KEY_ENV.get(name, ()):
        if os.environ.get(var):
            return os.environ[var]
    if is_local(url) or keys_file or os.environ.get("TEXTSWAP_KEYS_FILE"):
        return read_keys_file(keys_file_path(keys_file)).get(name)
    return None
