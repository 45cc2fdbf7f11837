"""API keys: where they come from, the generated key file, scopes, sessions.

Four key names, each a scope (docs/operations.md "Security"):

    admin     everything on the management port
    review    on the management port: GET routes, the review queue's labels
              (POST /feedback there) and POST /try
    feedback  POST /feedback on the inference port
    predict   when set: POST /predict and /v2 on the inference port

A key comes from, first to last: the environment (TEXTSWAP_ADMIN_KEY,
TEXTSWAP_REVIEW_KEY, TEXTSWAP_FEEDBACK_KEY, TEXTSWAP_PREDICT_KEY), the config
(`auth.admin_key`, ...; the older `management.token` is the admin key and
`feedback.token` the feedback key), the key file. Those of admin, review and
feedback that are not configured are generated on the first start, into the
key file (`auth.keys_file`, default `<models_dir>/../.textswap/keys.json`): 0600,
in a 0700 folder beside the model store, not in it. It is created whole or
not at all (written to a temp file, then hard-linked to its name, which
fails when the name exists), so nodes starting together on one shared store
agree on the first one's keys. Keys shorter than 32 characters are refused.

The key file is looked at again (its inode, mtime and size; at most every
0.25 s) when a key is checked: a new file (`textswap keys rotate`) takes
effect without a restart. Dashboard sessions (a one-time code exchanged for
a session token, see `KeyRing.session`) live in memory; a new admin key in
the file (rotation) ends them all, and every unused code.

Nothing here logs a key or puts one in an error message.
"""
from __future__ import annotations

import contextvars
import hmac
import json
import logging
import os
import secrets
import threading
import time
from typing import Any

from state.config import Config, ConfigError, open_to_others

log = logging.getLogger("textswap.auth")

SCOPES = ("admin", "review", "feedback", "predict")
GENERATED = ("admin", "review", "feedback")  # what a first start writes; predict stays off
MIN_KEY_CHARS = 32
ENV = {"admin": "TEXTSWAP_ADMIN_KEY", "review": "TEXTSWAP_REVIEW_KEY",
       "feedback": "TEXTSWAP_FEEDBACK_KEY", "predict": "TEXTSWAP_PREDICT_KEY"}
SESSION_NAME = "admin/session"  # what the history records for a dashboard session's calls
_RECHECK_S = 0.25  # the key file's stat is looked at no more often than this

# The name of the key that made the current request (set by the frontend when
# it checks a key; a context variable, so it follows the request's coroutine
# into the control plane). The history records it beside API-made entries.
ACTOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("textswap_actor",
                                                                  default=None)


class KeyError_(ValueError):
    """A key or key file that cannot be used (too short, unreadable, wrong mode)."""


def default_keys_file(models_dir: str) -> str:
    """Beside the model store, not in it: workers and trainers read the store."""
    parent = os.path.dirname(os.path.abspath(models_dir).rstrip(os.sep)) or os.sep
    return os.path.join(parent, ".textswap", "keys.json")


def keys_file_of(config: Config) -> str:
    path = config.auth.keys_file
    return os.path.abspath(path) if path else default_keys_file(config.models_dir)


def new_key() -> str:
    return secrets.token_urlsafe(32)  # 256 random bits, 43 characters


def check_keys(keys: dict[str, Any], where: str) -> dict[str, str]:
    """The keys of a mapping (name -> key), or KeyError_ saying what is wrong."""
    out: dict[str, str] = {}
    for name, value in keys.items():
        if name not in SCOPES:
            raise KeyError_(f"{where}: unknown key name {name!r}; the names are "
                            f"{', '.join(SCOPES)}")
        if not isinstance(value, str):
            raise KeyError_(f"{where}: the {name} key must be a string")
        if value == "":
            continue
        if len(value) < MIN_KEY_CHARS:
            raise KeyError_(f"{where}: the {name} key has {len(value)} characters; keys need "
                            f"at least {MIN_KEY_CHARS} (e.g. python -c 'import secrets; "
                            "print(secrets.token_urlsafe(32))')")
        out[name] = value
    return out


def configured_keys(config: Config) -> dict[str, str]:
    """The keys the config and the environment set (read into the config at
    start, see state/config.py), checked."""
    keys = {"admin": config.management.token, "feedback": config.feedback.token}
    for name in SCOPES:  # auth.<name>_key (or its environment variable) wins
        value = getattr(config.auth, f"{name}_key")
        if value:
            keys[name] = value
    return check_keys(keys, "auth keys (config or environment)")


def read_keys_file(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except ValueError:
        raise KeyError_(f"the key file {path} is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys"), dict):
        raise KeyError_(f"the key file {path} must be {{\"keys\": {{name: key}}}}")
    return check_keys(data["keys"], f"the key file {path}")


def write_keys_file(path: str, keys: dict[str, str], *, replace: bool) -> bool:
    """Write the key file whole: a 0600 temp file (O_EXCL) beside it, synced,
    then renamed over it (replace) or hard-linked to its name (not replace:
    fails when the name exists, so one of several starting nodes wins).
    True when this call's keys are the file's."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"keys": keys, "created": time.time()}, fh, indent=1)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        try:
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass


def check_key_folder(path: str) -> None:
    """The key file's folder: made 0700 when missing; refused (KeyError_) when
    others may open it, when it is not this user's, or when it would sit
    directly in a folder anyone may write to (the temporary folder: anyone
    could make it first)."""
    folder = os.path.dirname(path)
    parent = os.path.dirname(folder.rstrip(os.sep)) or os.sep
    try:
        shared = bool(os.stat(parent).st_mode & 0o002)
    except OSError:
        shared = False  # made below, by this user
    if shared:
        raise KeyError_(f"the key folder {folder} would sit directly in {parent}, which anyone "
                        "may write to (the temporary folder): set auth.keys_file to a path in "
                        "a folder of your own, or keep the model store in one")
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
    st = os.stat(folder)
    if st.st_uid != os.getuid():
        raise KeyError_(f"the key folder {folder} belongs to another user (uid {st.st_uid}); "
                        "set auth.keys_file to a folder of your own")
    if st.st_mode & 0o077:
        raise KeyError_(f"the key folder {folder} is open to others (mode "
                        f"{st.st_mode & 0o777:o}); chmod 700 {folder}")


def _check_mode(path: str) -> None:
    """Readable by this user alone, or a read-only Secret file of this
    process's group (state/config.py open_to_others)."""
    mode = open_to_others(path)
    if mode is not None:
        raise KeyError_(f"the key file {path} is readable by others (mode {mode:o}); "
                        f"chmod 600 {path}")


class KeyRing:
    """The service's keys: configured ones, the key file's (re-read when it
    changes), and dashboard sessions. Thread-safe; `match` is the hot call."""

    def __init__(self, configured: dict[str, str], path: str | None,
                 session_s: float = 12 * 3600.0, code_s: float = 600.0) -> None:
        self.configured = dict(configured)
        self.path = path  # the key file, or None when no file is used
        self.session_s = session_s
        self.code_s = code_s  # a one-time code's life
        self._file: dict[str, str] = {}
        self._stat: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self._codes: dict[str, float] = {}  # one-time dashboard codes -> expiry
        self._sessions: dict[str, float] = {}  # session token -> expiry

    @classmethod
    def open(cls, config: Config) -> "KeyRing":
        """At start: the configured keys; with none, the key file, generated
        when it does not exist yet. KeyError_ (a config error) when a key or
        the file cannot be used."""
        configured = configured_keys(config)
        path = keys_file_of(config)
        session_s = config.auth.session_hours * 3600.0
        code_s = config.auth.code_minutes * 60.0
        missing = [name for name in GENERATED if name not in configured]
        if missing or os.path.exists(path):
            try:
                check_key_folder(path)
            except OSError as exc:
                raise KeyError_(f"cannot create the key folder of {path}: "
                                f"{exc.strerror or exc}; set auth.keys_file to a writable "
                                "place") from None
        if missing and not os.path.exists(path):
            keys = {name: new_key() for name in missing}
            try:
                made = write_keys_file(path, keys, replace=False)
            except OSError as exc:
                raise KeyError_(f"cannot create the key file {path}: {exc.strerror or exc}; "
                                "set auth.keys_file to a writable place, or give keys "
                                "in the config or environment") from None
            log.info("%s API keys (%s) in %s (mode 0600): the management port takes the "
                     "admin or review key, POST /feedback the feedback key",
                     "generated" if made else "another node generated the",
                     ", ".join(missing), path)
        elif os.path.exists(path):
            log.info("API keys from %s%s", path,
                     f" and the config ({', '.join(sorted(configured))})" if configured else "")
        else:
            log.info("API keys from the config or environment (%s); no key file at %s",
                     ", ".join(sorted(configured)), path)
        ring = cls(configured, path if os.path.exists(path) else None, session_s, code_s)
        if ring.path is not None:
            ring._load(strict=True)
        return ring

    # -- the key file ------------------------------------------------------------------
    def _load(self, strict: bool = False) -> None:
        """Read the key file. At start (strict) a bad file is an error; later,
        a bad or vanished file is logged and the keys read before stay."""
        assert self.path is not None
        try:
            st = os.stat(self.path)
            _check_mode(self.path)
            keys = read_keys_file(self.path)
        except (OSError, KeyError_) as exc:
            if strict:
                raise KeyError_(str(exc) if isinstance(exc, KeyError_) else
                                f"cannot read the key file {self.path}: "
                                f"{exc.strerror or exc}") from None
            log.error("keeping the keys read before: %s",
                      exc if isinstance(exc, KeyError_) else
                      f"cannot read the key file {self.path}: {exc.strerror or exc}")
            return
        with self._lock:
            changed = self._stat is not None
            # sessions and codes stand for the admin key: a new one ends them
            ended = changed and keys.get("admin") != self._file.get("admin") \
                and "admin" not in self.configured
            self._file, self._stat = keys, (st.st_ino, st.st_mtime_ns, st.st_size)
        if changed:
            log.info("the key file %s changed: its keys (%s) are used from now on",
                     self.path, ", ".join(sorted(keys)))
        if ended:
            sessions, codes = self.end_sessions()
            log.warning("the admin key changed: %d dashboard session(s) and %d one-time "
                        "code(s) ended", sessions, codes)

    def _refresh(self) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if now - self._checked < _RECHECK_S:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
        except OSError:
            return  # gone: the keys read before stay (logged when it comes back bad)
        if (st.st_ino, st.st_mtime_ns, st.st_size) != self._stat:
            self._load()

    def keys(self) -> dict[str, str]:
        """name -> key: the file's, with the configured ones over them."""
        self._refresh()
        return {**self._file, **self.configured}

    def has(self, name: str) -> bool:
        """Whether a key of that name exists now (asked on every request to
        the predict routes: no merged dict built)."""
        self._refresh()
        return name in self.configured or name in self._file

    def match(self, value: str) -> str | None:
        """The name of the key `value` is (compared in constant time against
        every key), SESSION_NAME for a live dashboard session, else None."""
        if not value:
            return None
        got = value.encode()
        found = None
        for name, key in self.keys().items():
            if hmac.compare_digest(got, key.encode()):
                found = name
        if found is None and self._sessions:
            now = time.time()
            with self._lock:
                for token, until in list(self._sessions.items()):
                    if until < now:
                        del self._sessions[token]
                    elif hmac.compare_digest(got, token.encode()):
                        found = SESSION_NAME
        return found

    # -- dashboard sessions ------------------------------------------------------------
    def new_code(self, ttl_s: float | None = None) -> str:
        """A one-time code for the dashboard URL's #fragment, good for
        code_s (auth.code_minutes) unless ttl_s says otherwise."""
        code = secrets.token_urlsafe(24)
        with self._lock:
            self._codes = {c: t for c, t in self._codes.items() if t > time.time()}
            self._codes[code] = time.time() + (self.code_s if ttl_s is None else ttl_s)
        return code

    def end_session(self, token: str) -> bool:
        """End one dashboard session (POST /auth/logout); False: no such session."""
        with self._lock:
            for t in list(self._sessions):
                if hmac.compare_digest(token.encode(), t.encode()):
                    del self._sessions[t]
                    return True
        return False

    def end_sessions(self) -> tuple[int, int]:
        """End every dashboard session and unused one-time code (DELETE
        /auth/sessions, and a new admin key): how many of each."""
        with self._lock:
            counts = len(self._sessions), len(self._codes)
            self._sessions.clear()
            self._codes.clear()
        return counts

    def session(self, code: str) -> str | None:
        """Exchange a one-time code for a session token (admin scope); None when
        the code is unknown, used or expired. A code works once."""
        now = time.time()
        with self._lock:
            hit = None
            for c, until in self._codes.items():
                if hmac.compare_digest(code.encode(), c.encode()):
                    hit = c if until > now else None
            if hit is None:
                return None
            del self._codes[hit]
            token = secrets.token_urlsafe(32)
            self._sessions[token] = now + self.session_s
            return token


def scope_of(name: str) -> str:
    """The scope a matched key name carries."""
    return "admin" if name == SESSION_NAME else name


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def open_keys(config: Config, insecure_no_auth: bool) -> KeyRing | None:
    """The API keys (state/keys.py), generated on a first start; None with auth
    off, which a management bind beyond loopback refuses unless the
    --insecure-no-auth flag says otherwise (then it warns, every start)."""
    manage_host = config.server.manage_host
    if config.auth.enabled:
        return KeyRing.open(config)
    configured_keys(config)  # a key too short is an error even while auth is off
    if manage_host not in LOOPBACK:
        if not insecure_no_auth:
            raise ConfigError(f"auth is off (auth.enabled: false) and the management API would "
                              f"be bound to {manage_host}, beyond loopback: anyone who reaches "
                              "it could train, apply and read logged texts. Turn auth on, bind "
                              "it to 127.0.0.1, or start with --insecure-no-auth")
        log.warning("INSECURE: auth is off and the management API is bound to %s "
                    "(--insecure-no-auth): anyone who reaches it can train, apply, unload and "
                    "read logged texts", manage_host)
    else:
        log.warning("auth is off (auth.enabled: false): the management API on %s takes no "
                    "key, and POST /feedback on the inference port is off", manage_host)
    return None
