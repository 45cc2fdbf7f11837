"""The web dashboard on the management port: GET / and its assets under /ui/.

The page is static (frontend/static/: HTML, CSS, plain JS modules and a
vendored uPlot with its licence) and served WITHOUT a key: it holds no
data. Everything it shows comes from the management API, which the page
calls with ``Authorization: Bearer <key>``: the admin or review key a person
types in, or the session token it got for the one-time code in the
#fragment of the URL the service prints at start (POST /auth/session,
frontend/auth.py). So the page is useless to someone who has neither.

Why a handler of our own instead of tornado's StaticFileHandler: only the
files that ship in frontend/static/ can ever be answered (a fixed table built
at start, no path from the request reaches the file system), errors keep the
JSON shape of every other route, and each file is read and gzipped once so a
page load costs no disk reads and few bytes. Strict headers (a Content
Security Policy that allows only this origin's scripts, no framing, no
sniffing) make an injected string inert even if some code path ever put user
data into markup; the page itself only ever uses textContent for it.
"""
from __future__ import annotations

import gzip
import hashlib
import mimetypes
import os
from typing import Any

from frontend.base import ApiError, JsonHandler

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
PREFIX = "/ui/"

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml",
          ".txt": "text/plain; charset=utf-8", ".json": "application/json; charset=utf-8"}
_COMPRESSIBLE = (".html", ".js", ".css", ".svg", ".txt", ".json")

# 'self' only: no inline script, no eval, no other origin. Styles: uPlot sets
# element styles from script (allowed by CSP) and ships one stylesheet.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")


class Asset:
    """One static file, held in memory with its gzipped form and ETag."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as fh:
            self.body = fh.read()
        ext = os.path.splitext(path)[1].lower()
        self.type = _TYPES.get(ext) or mimetypes.guess_type(path)[0] or "application/octet-stream"
        self.gz = gzip.compress(self.body, 9, mtime=0) if ext in _COMPRESSIBLE else None
        if self.gz is not None and len(self.gz) >= len(self.body):
            self.gz = None
        self.etag = '"' + hashlib.sha256(self.body).hexdigest()[:20] + '"'


def load_assets(root: str = STATIC_DIR) -> dict[str, Asset]:
    """Every file under root, keyed by its path relative to root ('/'-separated)."""
    assets: dict[str, Asset] = {}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            if name.startswith("."):
                continue
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            assets[rel] = Asset(full)
    return assets


class AssetHandler(JsonHandler):
    """GET/HEAD of one dashboard file; ``/`` is index.html."""

    needs_key = False  # the page and its assets carry no data

    parts: dict[str, Asset]  # load_assets()

    def _asset(self, rel: str | None) -> Asset:
        asset = self.parts.get(rel or "index.html")
        if asset is None:
            raise ApiError(404, "not_found", f"no such endpoint: {self.request.path}")
        return asset

    def get(self, rel: str | None = None) -> None:
        self._send(self._asset(rel), with_body=True)

    def head(self, rel: str | None = None) -> None:
        self._send(self._asset(rel), with_body=False)

    def _send(self, asset: Asset, with_body: bool) -> None:
        self.set_header("Content-Type", asset.type)
        self.set_header("Content-Security-Policy", CSP)
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("X-Frame-Options", "DENY")
        self.set_header("Referrer-Policy", "no-referrer")
        # revalidate every time (a new release must show at once); a match is a 304
        self.set_header("Cache-Control", "no-cache")
        self.set_header("ETag", asset.etag)
        self.set_header("Vary", "Accept-Encoding")
        if asset.etag in self.request.headers.get("If-None-Match", ""):
            self.set_status(304)
            self.finish()
            return
        body = asset.body
        if asset.gz is not None and "gzip" in self.request.headers.get("Accept-Encoding", ""):
            body = asset.gz
            self.set_header("Content-Encoding", "gzip")
        self.set_header("Content-Length", str(len(body)))
        self.finish(body if with_body else None)


def routes(kw: dict[str, Any]) -> list[Any]:
    # served without a key (but only under this service's own names: guard)
    akw = {**kw, "auth": None, "parts": load_assets()}
    return [(r"/", AssetHandler, akw),
            (PREFIX.rstrip("/") + r"/([A-Za-z0-9_.\-/]{1,200})", AssetHandler, akw)]
