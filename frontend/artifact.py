"""GET /models/<name>/<version>/artifact: the version folder as a .tar.gz.

The archive holds everything a user needs to serve or inspect the model
elsewhere: `model.keras`, `meta.json` and `saved_model/` (a TensorFlow
SavedModel that loads with plain `tf.saved_model.load`, no project code).
Members are named `<name>/<version>/...`. Published versions never change,
so the archive is built from the folder as it is, in a thread (gzip of a few
megabytes must not stall the IOLoop), then streamed in chunks.
"""
from __future__ import annotations

import os
import tarfile
import tempfile
from typing import TYPE_CHECKING, Any

from tornado.ioloop import IOLoop

from state.errors import InvalidName
from frontend.base import ApiError, JsonHandler, service_error

if TYPE_CHECKING:
    from state.store import ModelStore

_CHUNK = 256 * 1024
# Archives up to this size stay in memory; larger ones spill to a temp file.
_SPOOL_BYTES = 16 * 1024 * 1024


def _build(folder: str, arcname: str) -> Any:
    out = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=6) as tar:
        # no symlinks or special files: only what publish wrote
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for fname in sorted(files):
                path = os.path.join(root, fname)
                if os.path.isfile(path) and not os.path.islink(path):
                    tar.add(path, arcname=os.path.join(arcname, os.path.relpath(path, folder)),
                            recursive=False)
    out.seek(0)
    return out


class ArtifactHandler(JsonHandler):
    parts: ModelStore

    async def get(self, name: str, version: str) -> None:
        try:
            v, folder = self.parts.resolve(name, int(version))
        except InvalidName:
            raise ApiError(404, "not_found", f"no model named {name!r} in the store") from None
        except Exception as exc:
            raise service_error(exc) from None
        archive = await IOLoop.current().run_in_executor(None, _build, folder, f"{name}/{v}")
        try:
            archive.seek(0, os.SEEK_END)
            size = archive.tell()
            archive.seek(0)
            self.set_header("Content-Type", "application/gzip")
            self.set_header("Content-Length", str(size))
            self.set_header("Content-Disposition", f'attachment; filename="{name}-v{v}.tar.gz"')
            while True:
                chunk = archive.read(_CHUNK)
                if not chunk:
                    break
                self.write(chunk)
                await self.flush()
        finally:
            archive.close()


def routes(kw: dict[str, Any], store: ModelStore) -> list[Any]:
    return [(r"/models/([^/]+)/([0-9]{1,9})/artifact", ArtifactHandler, {**kw, "parts": store})]
