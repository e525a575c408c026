"""Usage, budgets and the admin's settings over HTTP: what ``slack-agent usage``, ``budget``,
``retention`` and ``tools`` show and set, through the same operator functions.

Everyone reads their own usage and budgets; an admin reads everyone's usage (``scope=all``)
and sets retention and budgets (``/v1/admin/…``, a 403 for anyone else).
"""

from __future__ import annotations

import dataclasses
from datetime import date
from typing import TYPE_CHECKING, Any, Literal

import orjson
from aiohttp import web

from core.conversation.places import slack_person
from core.runtime import Operator
from web.auth import Caller
from web.errors import ApiError, bad_request
from web.requests import json_response, read_json
from web.shapes import when

if TYPE_CHECKING:
    from web.api import WebApi

GroupBy = Literal["user", "workspace", "model", "day"]
GROUPS: tuple[GroupBy, ...] = ("day", "user", "workspace", "model")


def _admin(caller: Caller) -> None:
    if not caller.admin:
        raise ApiError(403, "forbidden", "for admins (ADMIN_USER_IDS)")


class Admin:
    def __init__(self, api: WebApi) -> None:
        self.api = api
        self.operator = Operator(api.settings, api.runtime.storage)

    def add_routes(self, app: web.Application, guard: Any) -> None:
        app.router.add_get("/v1/usage", guard(self.usage))
        app.router.add_get("/v1/budgets", guard(self.budgets))
        app.router.add_get("/v1/admin/retention", guard(self.retention))
        app.router.add_put("/v1/admin/retention", guard(self.set_retention))
        app.router.add_get("/v1/admin/budgets", guard(self.admin_budgets))
        app.router.add_put("/v1/admin/budgets", guard(self.set_budgets))
        app.router.add_get("/v1/admin/tools", guard(self.tools))
        app.router.add_get("/v1/admin/people/{person}/export", guard(self.export_person))
        app.router.add_post("/v1/admin/people/{person}/erase", guard(self.erase_person))

    async def usage(self, request: web.Request) -> web.StreamResponse:
        by = request.query.get("by", "day")
        if by not in GROUPS:
            raise bad_request(f"by: one of {', '.join(GROUPS)}")
        scope = request.query.get("scope", "own")
        if scope not in ("own", "all"):
            raise bad_request("scope: own or all")
        since = None
        if request.query.get("since"):
            try:
                since = date.fromisoformat(request.query["since"])
            except ValueError:
                raise bad_request("since: a day, YYYY-MM-DD") from None

        async def work(caller: Caller) -> dict[str, Any]:
            if scope == "all":
                _admin(caller)
            ledger = self.api.runtime.storage.usage
            everyone = scope == "all"
            lines = await ledger.report(
                by,
                since=since,
                user_key=None if everyone else caller.person,
                # An admin is one workspace's: everyone there, never another workspace's.
                workspace=caller.team if everyone else None,
            )
            return {
                "rows": [
                    {
                        "key": line.key,
                        "inputTokens": line.input_tokens,
                        "outputTokens": line.output_tokens,
                        "costUsd": float(line.cost_usd),
                        "requests": line.requests,
                        "turns": line.requests,  # the name the first page reads (docs)
                    }
                    for line in lines
                ]
            }

        return json_response(await self.api.on_turns(request, work))

    async def budgets(self, request: web.Request) -> web.StreamResponse:
        async def work(caller: Caller) -> dict[str, Any]:
            storage = self.api.runtime.storage
            in_force = await storage.budgets.in_force()
            accounts = await storage.usage.accounts(in_force, caller.payer)
            return {
                "budgets": [
                    {
                        "scope": a.budget.scope,
                        "period": a.budget.period,
                        "limit": str(a.budget),
                        "used": float(a.used) if a.budget.unit == "usd" else int(a.used),
                        "unit": a.budget.unit,
                        "resetsAt": when(a.window.end),
                    }
                    for a in accounts
                ]
            }

        return json_response(await self.api.on_turns(request, work))

    async def retention(self, request: web.Request) -> web.StreamResponse:
        async def work(caller: Caller) -> dict[str, Any]:
            _admin(caller)
            policy = await self.operator.retention()
            return {"maxIdleDays": policy.max_idle_days, "maxPerUser": policy.max_per_user}

        return json_response(await self.api.on_turns(request, work))

    async def set_retention(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        idle, most = body.get("maxIdleDays"), body.get("maxPerUser")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, int | float)):
            raise bad_request("maxIdleDays: a number of days")
        if most is not None and (isinstance(most, bool) or not isinstance(most, int)):
            raise bad_request("maxPerUser: a whole number")
        if (idle is not None and idle < 0) or (most is not None and most < 0):
            raise bad_request("maxIdleDays and maxPerUser: 0 (no limit) or more")

        async def work(caller: Caller) -> dict[str, Any]:
            _admin(caller)
            policy = await self.operator.set_retention(max_idle_days=idle, max_per_user=most)
            return {"maxIdleDays": policy.max_idle_days, "maxPerUser": policy.max_per_user}

        return json_response(await self.api.on_turns(request, work))

    async def admin_budgets(self, request: web.Request) -> web.StreamResponse:
        async def work(caller: Caller) -> dict[str, Any]:
            _admin(caller)
            shown = await self.operator.budgets()
            return {
                "entries": ",".join(str(budget) for budget, _, _ in shown),
                "budgets": [
                    {"limit": str(budget), "source": source, "describe": budget.describe()}
                    for budget, source, _ in shown
                ],
            }

        return json_response(await self.api.on_turns(request, work))

    async def set_budgets(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        entries = body.get("entries")
        if not isinstance(entries, str) or not entries.strip():
            raise bad_request("entries: budgets as BUDGETS writes them (user:day:200000tokens,…)")

        async def work(caller: Caller) -> dict[str, Any]:
            _admin(caller)
            made = await self.operator.set_budgets(entries)
            return {"entries": ",".join(str(b) for b in made)}

        return json_response(await self.api.on_turns(request, work))

    async def export_person(self, request: web.Request) -> web.StreamResponse:
        """``slack-agent user export TEAM:USER`` for an admin's browser: JSON lines, as a file."""
        person = request.match_info["person"]

        async def work(caller: Caller) -> bytes:
            _admin(caller)
            lines = [
                orjson.dumps(record, default=str) + b"\n"
                async for record in self.operator.export_person(person)
            ]
            return b"".join(lines)

        body = await self.api.on_turns(request, work)
        name = person.replace(":", "-")
        return web.Response(
            body=body,
            content_type="application/x-ndjson",
            headers={"Content-Disposition": f'attachment; filename="{name}.jsonl"'},
        )

    async def erase_person(self, request: web.Request) -> web.StreamResponse:
        """``slack-agent user erase TEAM:USER`` from the admin page: what it removed, or 409
        ``agent_session_busy`` (nothing removed) while a turn or a message of theirs runs."""
        person = request.match_info["person"]

        async def work(caller: Caller) -> dict[str, Any]:
            _admin(caller)
            erased = await self.operator.erase_person(person)
            # Their keys stop here at once (other replicas within BEARER_SECONDS).
            gone = slack_person(*person.strip().split(":", 1))  # parsed by the erase
            self.api.bearers.drop_values(lambda b: b is not None and b.person == gone)
            return {"person": person, "erased": dataclasses.asdict(erased)}

        return json_response(await self.api.on_turns(request, work))

    async def tools(self, request: web.Request) -> web.StreamResponse:
        async def work(caller: Caller) -> dict[str, Any]:
            _admin(caller)
            tools = self.api.runtime.tools
            statuses = [] if tools is None else tools.status()
            return {
                "servers": [
                    {
                        "name": s.name,
                        "transport": s.transport,
                        "target": s.target,
                        "state": s.state,
                        "reason": s.reason,
                        "approval": s.approval,
                        "approvers": list(s.approvers),
                        "tools": [
                            {"name": t.name, "rule": t.rule, "readOnly": t.read_only}
                            for t in s.tools
                        ],
                    }
                    for s in statuses
                ]
            }

        return json_response(await self.api.on_turns(request, work))
