"""The model store on local disk, and the applied-model record.

Layout (under models_dir)::

    <name>/<version>/model.keras    the end-to-end Keras model (raw strings in)
    <name>/<version>/meta.json      labels (index = output unit), params,
                                    metrics, data hash, library versions...
    .applied.json                   {"default", "models": {name: {version,
                                    replicas}}, "revision"}: what the service
                                    serves; written atomically
    .tmp/                           models being published; wiped at start

A version is visible only once its folder holds both files: publishing writes
into .tmp/, fsyncs, then renames the whole folder into place, so a crash never
leaves a half model that looks whole. Versions are immutable, numbered 1, 2...
Imports no TensorFlow.
"""
from __future__ import annotations

import json
import os
import zipfile
import re
import shutil
import tempfile
import time
from typing import Any

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # used with fullmatch
RECORD = ".applied.json"
TMP = ".tmp"
DATA = "data"  # where a user puts training files (a relative path is read from there): no model's name


from state.errors import InvalidArtifact, InvalidName, NotFound, StoreError  # noqa: F401 (re-exported)


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidName(
            "model name must be 1-64 characters of letters, digits, '_', '-', '.', "
            "starting with a letter or digit, without '..'")
    return name


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, data: Any) -> None:
    """Write temp file, fsync, rename: readers see the old or the new file."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, ensure_ascii=False, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class ModelStore:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def ensure(self, wipe_tmp: bool = True) -> None:
        """wipe_tmp False: a store shared by cluster nodes, where staging under
        .tmp/ may be another node's publish in progress."""
        os.makedirs(self.root, exist_ok=True)
        # the folder the README says to put training files in, there from the
        # first start (kubectl cp and cp need it; the user's files, never changed)
        os.makedirs(os.path.join(self.root, DATA), mode=0o700, exist_ok=True)
        if wipe_tmp:
            shutil.rmtree(os.path.join(self.root, TMP), ignore_errors=True)
        for entry in os.listdir(self.root):  # stray temp records from a crash
            if entry.startswith(".tmp-"):
                os.unlink(os.path.join(self.root, entry))

    # -- reading -----------------------------------------------------------
    def _is_complete(self, vdir: str) -> bool:
        return (os.path.isfile(os.path.join(vdir, "model.keras"))
                and os.path.isfile(os.path.join(vdir, "meta.json")))

    def versions(self, name: str) -> list[int]:
        check_name(name)
        mdir = os.path.join(self.root, name)
        if not os.path.isdir(mdir):
            return []
        out = []
        for entry in os.listdir(mdir):
            if entry.isdigit() and not entry.startswith("0") and self._is_complete(
                    os.path.join(mdir, entry)):
                out.append(int(entry))
        return sorted(out)

    def names(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        return sorted(e for e in os.listdir(self.root)
                      if NAME_RE.fullmatch(e) and os.path.isdir(os.path.join(self.root, e))
                      and self.versions(e))

    def resolve(self, name: str, version: int | None = None) -> tuple[int, str]:
        """(version, folder) of a complete version; latest when version is None."""
        versions = self.versions(name)
        if not versions:
            raise NotFound(f"no model named '{name}' in the store")
        if version is None:
            version = versions[-1]
        elif version not in versions:
            raise NotFound(f"model '{name}' has no version {version} "
                           f"(versions: {', '.join(map(str, versions))})")
        return version, os.path.join(self.root, name, str(version))

    def meta(self, name: str, version: int) -> dict[str, Any]:
        _, vdir = self.resolve(name, version)
        try:
            with open(os.path.join(vdir, "meta.json"), encoding="utf-8") as fh:
                meta = json.load(fh)
        except (OSError, ValueError) as exc:
            raise StoreError(f"unreadable meta.json of {name} v{version}: {exc}") from exc
        if not isinstance(meta, dict):
            raise StoreError(f"meta.json of {name} v{version} is not an object")
        return meta

    def check_artifact(self, name: str, version: int) -> dict[str, Any]:
        """Cheap checks before a worker is spent on loading: meta and file format."""
        meta = self.meta(name, version)
        labels = meta.get("labels")
        if (not isinstance(labels, list) or len(labels) < 2
                or not all(isinstance(x, str) and x for x in labels)
                or len(set(labels)) != len(labels)):
            raise InvalidArtifact(f"meta.json of {name} v{version} needs 'labels': a list of "
                                  "two or more distinct non-empty strings")
        path = os.path.join(self.root, name, str(version), "model.keras")
        try:
            with zipfile.ZipFile(path) as zf:
                names = set(zf.namelist())
        except (zipfile.BadZipFile, OSError) as exc:
            raise InvalidArtifact(f"model.keras of {name} v{version} is not a Keras archive "
                                  f"({exc})") from None
        if "config.json" not in names:
            raise InvalidArtifact(f"model.keras of {name} v{version} is not a Keras 3 archive "
                                  "(no config.json inside)")
        return meta

    def listing(self) -> list[dict[str, Any]]:
        out = []
        for name in self.names():
            versions: list[dict[str, Any]] = []
            for v in self.versions(name):
                try:
                    meta = self.meta(name, v)
                except StoreError as exc:
                    meta = {"error": str(exc)}
                versions.append({"version": v, **{k: meta.get(k) for k in (
                    "labels", "created_at", "metrics", "params", "data", "train_seconds")
                    if k in meta}})
            out.append({"name": name, "latest": versions[-1]["version"], "versions": versions})
        return out

    # -- publishing ----------------------------------------------------------
    def staging_dir(self) -> str:
        """A fresh folder to write a model into before publish()."""
        tmp_root = os.path.join(self.root, TMP)
        os.makedirs(tmp_root, exist_ok=True)
        return tempfile.mkdtemp(dir=tmp_root, prefix="stage-")

    def clean_staging(self) -> None:
        """Remove half-written models (call only while no trainer runs)."""
        tmp_root = os.path.join(self.root, TMP)
        if os.path.isdir(tmp_root):
            for entry in os.listdir(tmp_root):
                if entry.startswith("stage-"):
                    shutil.rmtree(os.path.join(tmp_root, entry), ignore_errors=True)

    def publish(self, name: str, staged: str, meta: dict[str, Any]) -> int:
        """Move a staged model into the next free version; returns the version."""
        check_name(name)
        if not os.path.isfile(os.path.join(staged, "model.keras")):
            raise StoreError("staged model has no model.keras")
        mdir = os.path.join(self.root, name)
        os.makedirs(mdir, exist_ok=True)
        for attempt in range(100):
            existing = [int(e) for e in os.listdir(mdir) if e.isdigit()]
            version = max(existing, default=0) + 1
            meta = {**meta, "name": name, "version": version}
            write_json_atomic(os.path.join(staged, "meta.json"), meta)
            # every file, subfolders too (the SavedModel export is a folder)
            for folder, _, files in os.walk(staged):
                for fname in files:
                    with open(os.path.join(folder, fname), "rb") as fh:
                        os.fsync(fh.fileno())
                _fsync_dir(folder)
            try:
                os.rename(staged, os.path.join(mdir, str(version)))
            except OSError:  # another publisher took that number: try the next
                continue
            _fsync_dir(mdir)
            return version
        raise StoreError("could not find a free version number")

    # -- the applied-model record -------------------------------------------
    @property
    def record_path(self) -> str:
        return os.path.join(self.root, RECORD)

    def read_record(self) -> dict[str, Any] | None:
        """The applied-model record, in the current format (see `normalize_record`)."""
        try:
            with open(self.record_path, encoding="utf-8") as fh:
                rec = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StoreError(f"unreadable applied-model record: {exc}") from exc
        return normalize_record(rec)

    def version_bytes(self, name: str) -> int:
        """Bytes on disk of the newest version of `name` (0 when none): the
        training guard wants twice that free before a job starts."""
        try:
            versions = self.versions(name)
        except StoreError:
            return 0
        if not versions:
            return 0
        total = 0
        for folder, _, files in os.walk(os.path.join(self.root, name, str(versions[-1]))):
            for fn in files:
                try:
                    total += os.path.getsize(os.path.join(folder, fn))
                except OSError:
                    pass
        return total

    def write_record(self, record: dict[str, Any]) -> None:
        os.makedirs(self.root, exist_ok=True)
        write_json_atomic(self.record_path, {
            **normalize_record(record),
            "applied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def _int_or_none(value: Any, what: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise StoreError(f"applied-model record: {what} must be a positive integer")
    return value


def normalize_record(rec: Any) -> dict[str, Any]:
    """Check a record and bring it to the current format::

        {"default": "news" | null,
         "models": {"news": {"version": 3, "replicas": 2, "explicit": true}, ...},
         "revision": 12}

    The single-model format of earlier releases, {"name", "version"}, is
    read as a map with that one model as the default (and written back in
    the new format at the next change). A version of null means the latest.
    """
    if not isinstance(rec, dict):
        raise StoreError("applied-model record must be a JSON object")
    if "models" not in rec and "name" in rec:  # the single-model format: migrate
        if not isinstance(rec["name"], str):
            raise StoreError("applied-model record: 'name' must be a string")
        rec = {"default": rec["name"], "revision": 0,
               "models": {rec["name"]: {"version": rec.get("version"), "replicas": None}}}
    models = rec.get("models")
    if not isinstance(models, dict):
        raise StoreError("applied-model record must have a 'models' object")
    out: dict[str, Any] = {}
    for name, entry in models.items():
        try:
            check_name(name)
        except InvalidName as exc:
            raise StoreError(f"applied-model record: {exc}") from None
        if not isinstance(entry, dict):
            raise StoreError(f"applied-model record: models.{name} must be an object")
        out[name] = {"version": _int_or_none(entry.get("version"), f"models.{name}.version"),
                     "replicas": _int_or_none(entry.get("replicas"), f"models.{name}.replicas"),
                     "explicit": bool(entry.get("explicit", True))}
    default = rec.get("default")
    if default is not None and default not in out:
        raise StoreError(f"applied-model record: default {default!r} is not in 'models'")
    revision = rec.get("revision", 0)
    if isinstance(revision, bool) or not isinstance(revision, int):
        raise StoreError("applied-model record: 'revision' must be an integer")
    return {"default": default, "models": out, "revision": revision}
