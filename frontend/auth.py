"""Who may call what: the API keys (state/keys.py) checked per request.

An `Access` belongs to a group of routes and says which key names they take:

    management port   admin: every route; review: GET/HEAD routes, and the
                      routes whose handler says `review_may_post` (POST
                      /feedback, POST /try)
    inference port    POST /feedback: feedback; /predict and /v2 (when a
                      predict key is set): predict

Answers: 401 `unauthorized` without a key or with one that is no key here,
403 `wrong_key` with a key of another scope on the management port, each
saying what the route takes. The inference port is public: there any key
that is not one of its own (an admin or review key, a dashboard session)
gets the same 401 as an unknown one, so it tells nobody what a key is. With auth switched
off (auth.enabled: false), the management port is open and the inference
port's POST /feedback answers 403 `feedback_off`.

`POST /auth/session` (management port, no key; throttled per client
address) exchanges the one-time code of the dashboard URL the service
prints at start for a session token with the admin scope (state/keys.py
KeyRing.session); `POST /auth/code` (admin key) makes a new one-time URL.
`POST /auth/logout` ends the session whose token it is sent with; `DELETE
/auth/sessions` (admin) ends every session and unused code, as a new admin
key does.
"""
from __future__ import annotations

import logging
import math
from typing import Any

from frontend.base import ApiError, JsonHandler
from frontend.loop_handlers import RateLimit
from state.config import Config
from state.keys import ACTOR, SESSION_NAME, KeyRing, scope_of

log = logging.getLogger("textswap.auth")

READ_METHODS = ("GET", "HEAD", "OPTIONS")


class Access:
    """The key check of one group of routes."""

    def __init__(self, keys: KeyRing | None, where: str, realm: str) -> None:
        self.keys = keys  # None: auth is off
        self.where = where  # "management", "feedback" or "predict"
        self.realm = realm

    def allowed(self, method: str, review_may_post: bool = False) -> tuple[str, ...]:
        if self.where == "management":
            if method in READ_METHODS or review_may_post:
                return ("admin", "review")
            return ("admin",)
        return (self.where,)

    def required(self) -> bool:
        """Whether a key is asked for now: the predict routes are open until a
        predict key exists (configured, or added to the key file by rotation:
        taken at once, like every key change)."""
        if self.keys is None:
            return self.where == "feedback"  # refused with auth off (check says why)
        return self.where != "predict" or self.keys.has("predict")

    def check(self, method: str, headers: Any, review_may_post: bool = False) -> str | None:
        """The name of the key the request came with (also set as the request's
        ACTOR for the history), None when auth is off or the route is open;
        ApiError otherwise."""
        if self.where == "predict" and not self.required():
            return None
        if self.keys is None:
            if self.where == "feedback":
                raise ApiError(403, "feedback_off",
                               "POST /feedback on this port is off while auth is off "
                               "(auth.enabled: false): labels train models. Send them to the "
                               "management port's /feedback")
            return None
        want = self.allowed(method, review_may_post)
        www = {"WWW-Authenticate": f'Bearer realm="{self.realm}"'}
        got = headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        if not got:
            raise ApiError(401, "unauthorized",
                           f"this route needs 'Authorization: Bearer <key>' with the "
                           f"{' or '.join(want)} key", {"takes": list(want)}, headers=www)
        name = self.keys.match(value.strip()) if scheme.lower() == "bearer" else None
        if name is not None and self.where != "management" and scope_of(name) not in want:
            # the inference port is public: a key of another scope gets the
            # unknown key's answer, so it cannot confirm a stolen key
            name = None
        if name is None:
            raise ApiError(401, "unauthorized",
                           f"the key sent is not one of this service's keys; this route takes "
                           f"the {' or '.join(want)} key ('Authorization: Bearer <key>')",
                           {"takes": list(want)}, headers=www)
        if scope_of(name) not in want:
            port = "management" if self.where == "management" else "inference"
            raise ApiError(403, "wrong_key",
                           f"the {scope_of(name)} key is not accepted for "
                           f"{method} on this route of the {port} port; it takes the "
                           f"{' or '.join(want)} key", {"key": scope_of(name), "takes": list(want)})
        ACTOR.set(name)
        return name


def accesses(keys: KeyRing | None, config: Config) -> dict[str, Access | None]:
    """The Access of each group of routes: management, feedback, predict (None:
    open; with auth on, predict is open while no predict key exists)."""
    predict = None
    if keys is not None:
        predict = Access(keys, "predict", "textswap-predict")
    return {"management": Access(keys, "management", "textswap-management"),
            "feedback": Access(keys, "feedback", "textswap-feedback"),
            "predict": predict}


class SessionHandler(JsonHandler):
    """POST /auth/session {"code"}: the dashboard URL's one-time code for a
    session token (admin scope). No key needed: the code is the credential."""

    needs_key = False
    parts: KeyRing | None  # None: auth is off

    async def post(self) -> None:
        data = self.json_object({"code"})
        code = data.get("code")
        keys = self.parts
        if keys is None:
            raise ApiError(409, "auth_off", "auth is off (auth.enabled: false): no key needed")
        wait = _SESSION_TRIES.take(self.request.remote_ip or "")
        if wait:
            raise ApiError(429, "rate_limited",
                           f"too many code exchanges from this address; try again in "
                           f"{math.ceil(wait)} s", {"retry_after_s": round(wait, 3)},
                           headers={"Retry-After": str(math.ceil(wait))})
        if not isinstance(code, str) or not code:
            raise ApiError(400, "invalid_field", "'code' must be the code of the dashboard URL")
        token = keys.session(code)
        if token is None:
            raise ApiError(401, "unauthorized",
                           "this code is unknown, used or expired (a code works once); use "
                           "the admin or review key, or the URL of a newer start")
        log.info("a dashboard session started with the start URL's code")
        self.send_json({"token": token, "scope": "admin",
                        "expires_in_s": int(keys.session_s)})


class CodeHandler(JsonHandler):
    """POST /auth/code (admin key): a new one-time dashboard URL, for when the
    start URL's code is used (`textswap dashboard` prints it)."""

    parts: KeyRing | None

    async def post(self) -> None:
        self.json_object(set(), required=False)
        keys = self.parts
        if keys is None:
            raise ApiError(409, "auth_off", "auth is off (auth.enabled: false): no key needed")
        code = keys.new_code()
        self.send_json({"code": code, "url": f"http://{self.request.host}/#code={code}",
                        "expires_in_s": int(keys.code_s)})


class LogoutHandler(JsonHandler):
    """POST /auth/logout: ends the dashboard session whose token the request
    carries (a key is no session: 400 not_a_session)."""

    parts: KeyRing | None

    async def post(self) -> None:
        self.json_object(set(), required=False)
        keys = self.parts
        if keys is None:
            raise ApiError(409, "auth_off", "auth is off (auth.enabled: false): no sessions")
        token = self.request.headers.get("Authorization", "").partition(" ")[2].strip()
        if self.key_name != SESSION_NAME or not keys.end_session(token):
            raise ApiError(400, "not_a_session",
                           "POST /auth/logout ends the dashboard session whose token it is "
                           "sent with; this is a key (rotate keys with `textswap keys rotate`)")
        log.info("a dashboard session ended (logout)")
        self.send_json({"ended": True})


class SessionsHandler(JsonHandler):
    """DELETE /auth/sessions (admin): ends every dashboard session and unused
    one-time code."""

    parts: KeyRing | None

    async def delete(self) -> None:
        keys = self.parts
        if keys is None:
            raise ApiError(409, "auth_off", "auth is off (auth.enabled: false): no sessions")
        sessions, codes = keys.end_sessions()
        log.warning("%d dashboard session(s) and %d one-time code(s) ended (DELETE "
                    "/auth/sessions)", sessions, codes)
        self.send_json({"ended": {"sessions": sessions, "codes": codes}})


# POST /auth/session tries per client address: a person trades a code a few
# times a day; guessing a 192-bit code is hopeless anyway, this keeps it slow
_SESSION_TRIES = RateLimit(rate=0.5, burst=10)


def routes(kw: dict[str, Any], keys: KeyRing | None) -> list[Any]:
    kw = {**kw, "parts": keys}
    return [(r"/auth/session", SessionHandler, kw), (r"/auth/code", CodeHandler, kw),
            (r"/auth/logout", LogoutHandler, kw), (r"/auth/sessions", SessionsHandler, kw)]
