"""Rewind, branch and compact over HTTP: ``truncate``, ``branch``, ``compact``.

The same rules as Slack's shortcuts, because they are the same calls of the conversation API:
a rewind (owner or admin, refused while a turn runs) first as a plan (``dryRun``: how many
messages leave and which MCP calls went out and cannot be undone), a branch into a new web
session owned by whoever branches, a compaction paid by whoever asks for it.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from core.conversation import RewindPlan
from web.auth import Caller
from web.errors import ApiError, bad_request
from web.requests import json_response, read_json, session_id_of

if TYPE_CHECKING:
    from web.api import WebApi


def irreversible(plan: RewindPlan) -> list[dict[str, Any]]:
    """The MCP calls a rewind leaves done outside (``mcp__server__tool {args}`` each)."""
    shown = []
    for call in plan.outside:
        name, _, arguments = call.partition(" ")
        parts = name.split("__")
        server = parts[1] if len(parts) >= 3 and parts[0] == "mcp" else None
        shown.append({"tool": name, "server": server, "input": arguments})
    return shown


def _message_id(body: dict[str, Any]) -> str:
    value = body.get("messageId")
    if not isinstance(value, str) or not value:
        raise bad_request("messageId: a string")
    return value


class Transcript:
    def __init__(self, api: WebApi) -> None:
        self.api = api

    def add_routes(self, app: web.Application, guard: Any) -> None:
        base = "/v1/agent_sessions/{id}"
        app.router.add_post(base + "/truncate", guard(self.truncate))
        app.router.add_post(base + "/branch", guard(self.branch))
        app.router.add_post(base + "/compact", guard(self.compact))

    async def truncate(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)
        body = await read_json(request)
        message_id = _message_id(body)
        dry_run = body.get("dryRun", False)
        if not isinstance(dry_run, bool):
            raise bad_request("dryRun: true or false")

        async def work(caller: Caller) -> dict[str, Any]:
            conversation = await self.api.conversation(caller, session_id)
            plan = await conversation.rewind_plan(message_id)
            if plan is None:
                raise ApiError(422, "unprocessable", "messageId: not a message of this session")
            shown: dict[str, Any] = {"removes": plan.leaving, "irreversible": irreversible(plan)}
            if dry_run:
                return shown
            done = await conversation.rewind(message_id, caller.actor)
            tail = await conversation.last()
            shown.update(
                removes=done.deleted,
                draft=done.draft,
                lastMessageId=tail.message_id if tail else None,
            )
            return shown

        return json_response(await self.api.on_turns(request, work))

    async def branch(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)
        message_id = _message_id(await read_json(request))

        async def work(caller: Caller) -> dict[str, Any]:
            conversation = await self.api.conversation(caller, session_id)
            if await conversation.rewind_plan(message_id) is None:
                raise ApiError(422, "unprocessable", "messageId: not a message of this session")
            owner = await self.api.conversations.person(
                caller.person, admin=caller.admin, display_name=caller.name
            )
            forked = await conversation.fork(message_id, owner, f"{caller.person}/{uuid.uuid4()}")
            shown = await self.api.session_json(forked.conversation)
            shown["draft"] = forked.draft
            return shown

        return json_response(await self.api.on_turns(request, work), status=201)

    async def compact(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)
        body = await read_json(request)
        focus = body.get("focus")
        if focus is not None and not isinstance(focus, str):
            raise bad_request("focus: a string")

        async def work(caller: Caller) -> dict[str, Any]:
            conversation = await self.api.conversation(caller, session_id)
            checkpoint = await conversation.compact(
                caller.actor, focus=focus or None, payer=caller.payer
            )
            return {"checkpointMessageId": checkpoint.message_id}

        return json_response(await self.api.on_turns(request, work))
