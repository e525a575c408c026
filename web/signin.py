"""Sign in with Slack (OpenID Connect) for browsers: ``/auth/slack``, its callback, sign-out.

``GET /auth/slack?next=/path`` sends the browser to Slack's authorize page with a fresh state,
kept in a short-lived ``HttpOnly`` cookie; Slack sends it back to ``/auth/slack/callback`` with
a code, which is exchanged (``openid.connect.token``) for the person's identity
(``openid.connect.userInfo``: their workspace and user). The person then gets a sign-in
(``WebAccess.sign_in``, only its hash kept) as the ``slack_agent_session`` cookie, and the
browser goes to ``next``: a path on this origin, never another site (an open redirect would
lend this origin's name to a phishing link).
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from aiohttp import web
from slack_sdk.errors import SlackApiError
from slack_sdk.oauth import OpenIDConnectAuthorizeUrlGenerator
from slack_sdk.web.async_client import AsyncWebClient

from core.conversation.places import slack_person
from web.auth import COOKIE
from web.errors import ApiError, bad_request, guarded

if TYPE_CHECKING:
    from web.api import WebApi

log = logging.getLogger(__name__)

STATE_COOKIE = "slack_agent_signin"
STATE_SECONDS = 600
SCOPES = ("openid", "profile")
CALLBACK = "/auth/slack/callback"


def same_origin_path(value: str | None) -> str:
    """``next`` when it is a path on this origin; ``/`` for anything else."""
    if not value or not value.startswith("/") or value.startswith(("//", "/\\")):
        return "/"
    if any(c in value for c in "\r\n\\") or "://" in value.split("?", 1)[0]:
        return "/"
    return value


def over_https(request: web.Request) -> bool:
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return request.secure or forwarded == "https"


def callback_url(request: web.Request) -> str:
    scheme = "https" if over_https(request) else "http"
    return f"{scheme}://{request.host}{CALLBACK}"


class SignIn:
    def __init__(self, api: WebApi) -> None:
        self.api = api

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/auth/slack", guarded(self.start))
        app.router.add_get(CALLBACK, guarded(self.callback))
        app.router.add_post("/auth/signout", guarded(self.sign_out))

    def _credentials(self) -> tuple[str, str]:
        found = self.api.settings.signin_credentials
        if found is None:
            raise ApiError(
                404,
                "not_found",
                "Sign in with Slack is not set up (SLACK_CLIENT_ID and SLACK_CLIENT_SECRET, "
                "or SLACK_SIGNIN_CLIENT_ID and SLACK_SIGNIN_CLIENT_SECRET)",
            )
        return found

    async def start(self, request: web.Request) -> web.StreamResponse:
        client_id, _ = self._credentials()
        state = secrets.token_urlsafe(24)
        target = same_origin_path(request.query.get("next"))
        url = OpenIDConnectAuthorizeUrlGenerator(
            client_id=client_id,
            redirect_uri=callback_url(request),
            scopes=list(SCOPES),
            authorization_url=self.api.settings.slack_openid_authorize_url,
        ).generate(state=state, nonce=secrets.token_urlsafe(16))
        response = _redirect(url)
        response.set_cookie(
            STATE_COOKIE,
            f"{state}.{quote(target, safe='')}",
            max_age=STATE_SECONDS,
            path="/auth/slack",
            httponly=True,
            samesite="Lax",
            secure=over_https(request),
        )
        return response

    async def callback(self, request: web.Request) -> web.StreamResponse:
        client_id, client_secret = self._credentials()
        kept = request.cookies.get(STATE_COOKIE, "")
        state, _, target = kept.partition(".")
        given = request.query.get("state", "")
        if not state or not secrets.compare_digest(state, given):
            raise bad_request("the sign-in could not be checked (its state); start again")
        if "error" in request.query:
            raise ApiError(403, "forbidden", "Slack did not sign you in; start again")
        code = request.query.get("code")
        if not code:
            raise bad_request("code: missing")
        person, name = await self._identity(request, client_id, client_secret, code)

        async def sign_in() -> str:
            storage = self.api.runtime.storage
            user_id = await storage.sessions.get_or_create_user(person, name)
            hours = self.api.settings.web_session_hours
            return await self.api.access.sign_in(user_id, lifetime_seconds=hours * 3600)

        secret = await self.api.turns.run(sign_in)
        response = _redirect(same_origin_path(unquote(target)))
        response.set_cookie(
            COOKIE,
            secret,
            max_age=int(self.api.settings.web_session_hours * 3600),
            path="/",
            httponly=True,
            samesite="Lax",
            secure=over_https(request),
        )
        response.del_cookie(STATE_COOKIE, path="/auth/slack")
        return response

    async def _identity(
        self, request: web.Request, client_id: str, client_secret: str, code: str
    ) -> tuple[str, str | None]:
        """``slack:T…:U…`` and the name of the person Slack signed in."""
        api_url = self.api.settings.slack_api_url
        try:
            # The credentials in the form (Slack takes them there too): slack_sdk's
            # ``openid_connect_token`` sends them with aiohttp's deprecated ``BasicAuth``.
            exchanged = await AsyncWebClient(base_url=api_url).api_call(
                "openid.connect.token",
                data={
                    "client_id": client_id,
                    "client_secret": client_secret,
                    "code": code,
                    "redirect_uri": callback_url(request),
                },
            )
            token = exchanged.get("access_token")
            if not isinstance(token, str):
                raise bad_request("Slack gave no token for this code; start again")
            info = await AsyncWebClient(token=token, base_url=api_url).openid_connect_userInfo()
        except SlackApiError as exc:
            error = exc.response.get("error") if exc.response is not None else None
            log.info("Sign in with Slack refused: %s", error)
            raise ApiError(403, "forbidden", f"Slack refused the sign-in ({error})") from None
        team = info.get("https://slack.com/team_id")
        user = info.get("https://slack.com/user_id")
        if not isinstance(team, str) or not isinstance(user, str):
            raise ApiError(502, "bad_gateway", "Slack's answer named no workspace or user")
        name = info.get("name")
        return slack_person(team, user), name if isinstance(name, str) else None

    async def sign_out(self, request: web.Request) -> web.StreamResponse:
        secret = request.cookies.get(COOKIE)
        if secret:

            async def forget() -> None:
                self.api.bearers.drop(("cookie", secret))
                await self.api.access.sign_out(secret)

            await self.api.turns.run(forget)
        response = web.Response(status=204)
        response.del_cookie(COOKIE, path="/")
        return response


def _redirect(url: str) -> web.Response:
    return web.Response(status=302, headers={"Location": url})
