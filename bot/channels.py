"""The Slack channels a person belongs to, for the HTTP API (``web.auth.Channels``).

The API shows a person the sessions of Slack threads in channels they are a member of; only
Slack knows which those are (``users.conversations``, public and private channels). ``web``
caches the answer for a minute; a workspace the app has no token for answers nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from slack_sdk.web.async_client import AsyncWebClient

ClientFor = Callable[[str], Awaitable[AsyncWebClient | None]]
PAGE = 999  # users.conversations' largest page
PAGES_MOST = 20  # a person in 20,000 channels sees the threads of the first 20,000


class SlackChannels:
    def __init__(self, client_for: ClientFor) -> None:
        self._client_for = client_for

    async def of(self, team: str, user: str) -> frozenset[str]:
        client = await self._client_for(team)
        if client is None:
            return frozenset()
        found: set[str] = set()
        cursor: str | None = None
        for _ in range(PAGES_MOST):
            response = await client.users_conversations(
                user=user,
                types="public_channel,private_channel",
                exclude_archived=True,
                limit=PAGE,
                cursor=cursor,
                team_id=team,
            )
            for channel in response.get("channels") or []:
                if isinstance(channel, dict) and isinstance(channel.get("id"), str):
                    found.add(channel["id"])
            cursor = (response.get("response_metadata") or {}).get("next_cursor") or None
            if not cursor:
                break
        return frozenset(found)
