"""Message shortcuts (rewind, fork, compact) and ``/compact``.

A shortcut names a Slack message; its ref (``{team}/{channel}/{ts}``) leads to a transcript
message and session of the same workspace only, so a payload from another workspace finds
nothing here. Permissions are the core's (``Actor``): owner or ADMIN_USER_IDS for rewind and
compact, anyone for fork; every refusal is an ephemeral and changes nothing. Each action is one
call of the conversation API between reading the payload and writing to Slack.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

from slack_bolt.context.respond.async_respond import AsyncRespond as Respond
from slack_sdk.web.async_client import AsyncWebClient

from bot import payload
from bot import texts as text
from bot.post import Post, external_user, thread_key
from bot.reply import SLACK_FAILURES
from core.conversation import (
    SECTIONS,
    Actor,
    Conversation,
    Conversations,
    message_text,
    parse_checkpoint,
)
from core.conversation.places import SlackThread
from core.errors import (
    AgentSessionAlreadyCompact,
    AgentSessionBusy,
    AgentSessionForbidden,
    AgentSessionNotFound,
    MessageNotFound,
    SlackAgentError,
)
from core.runtime import Settings

log = logging.getLogger(__name__)

_LINK = re.compile(r"/archives/(?P<channel>[A-Z0-9]+)/p(?P<secs>\d{10})(?P<micros>\d{6})")
_THREAD_TS = re.compile(r"[?&]thread_ts=(?P<ts>\d+\.\d+)")


class Shortcuts:
    def __init__(self, settings: Settings, conversations: Conversations) -> None:
        self.settings = settings
        self.conversations = conversations

    # -- shared ---------------------------------------------------------------------------------

    async def _person(self, team: str, user: str) -> Actor:
        return await self.conversations.person(
            external_user(team, user), admin=self.settings.is_admin(team, user)
        )

    async def _target(
        self, body: dict[str, Any], client: AsyncWebClient
    ) -> tuple[Post, Conversation, str] | None:
        """The shortcut's message as a conversation and transcript message id, or an
        ephemeral saying why not."""
        team = payload.nested_string(body, "team", "id") or ""
        channel = payload.nested_string(body, "channel", "id") or ""
        user = payload.nested_string(body, "user", "id") or ""
        ts = payload.nested_string(body, "message", "ts") or ""
        root = payload.nested_string(body, "message", "thread_ts") or ts
        post = Post(team, channel, root, ts, user, "channel")
        found = await self.conversations.at(thread_key(team, channel, ts))
        if found is None:
            in_session = await self.conversations.find(thread_key(team, channel, root))
            await self._say(
                client, post, text.not_in_transcript() if in_session else text.no_session()
            )
            return None
        conversation, message_id = found
        key = await self.conversations.key_of(conversation.id)
        if key is not None:
            root = key.rsplit("/", 1)[1]
            post = Post(team, channel, root, ts, user, "channel")
        return post, conversation, message_id

    async def _say(self, client: AsyncWebClient, post: Post, body: str) -> None:
        await client.chat_postEphemeral(
            channel=post.channel, user=post.user, thread_ts=post.thread_ts, text=body
        )

    # -- rewind ---------------------------------------------------------------------------------

    async def rewind(self, body: dict[str, Any], client: AsyncWebClient) -> None:
        """*Rewind to here*: first a confirmation saying how many messages would leave."""
        found = await self._target(body, client)
        if found is None:
            return
        post, conversation, message_id = found
        actor = await self._person(post.team, post.user)
        if not actor.may_manage(conversation.session.user_id):
            await self._say(client, post, text.forbidden("rewind"))
            return
        plan = await conversation.rewind_plan(message_id)
        if plan is None:
            await self._say(client, post, text.not_in_transcript())
            return
        trigger = payload.nested_string(body, "trigger_id")
        key = await self.conversations.stash(
            {
                "session_id": conversation.id,
                "message_id": message_id,
                "post": post.context(),
                "domain": payload.nested_string(body, "team", "domain"),
            }
        )
        modal = text.rewind_modal(
            plan.leaving, key, to_a_question=plan.to_a_question, outside=plan.outside
        )
        await client.views_open(trigger_id=trigger or "", view=modal)

    async def rewind_confirmed(
        self, key: str, user: str, team: str, client: AsyncWebClient
    ) -> None:
        """The confirmation's *Rewind* button (a modal submission, on any replica)."""
        stashed = await self.conversations.unstash(key)
        if stashed is None:
            return
        post = Post.from_context(stashed["post"])
        if post.user != user or post.team != team:
            return  # only the person who asked confirms their own rewind
        session_id, message_id = int(stashed["session_id"]), str(stashed["message_id"])
        actor = await self._person(post.team, post.user)
        try:
            conversation = await self.conversations.get(session_id)
            result = await conversation.rewind(message_id, actor)
        except AgentSessionForbidden:
            await self._say(client, post, text.forbidden("rewind"))
            return
        except AgentSessionBusy:
            await self._say(client, post, text.busy_action("rewind"))
            return
        except (AgentSessionNotFound, MessageNotFound):
            await self._say(client, post, text.not_in_transcript())
            return
        await client.chat_postMessage(
            channel=post.channel,
            thread_ts=post.thread_ts,
            text=text.rewound(
                result.deleted,
                post.user,
                text.permalink(_domain(stashed), post.channel, post.ts),
            ),
        )
        for ref, shown in result.withdrawn_replies:
            reply = SlackThread.parse(ref)
            if reply is None:
                continue
            try:
                await client.chat_update(
                    channel=reply.channel, ts=reply.ts, text=text.rewound_reply(shown)
                )
            except SLACK_FAILURES as exc:
                # Deleted in Slack, or Slack busy past the retries: the rewind is done, and
                # the other replies and the returned draft must not wait on this one.
                log.warning("could not mark the withdrawn reply %s: %s", ref, exc)
        if result.draft:
            author = result.draft_metadata.get("slack_user")
            await client.chat_postEphemeral(
                channel=post.channel,
                user=str(author or post.user),
                thread_ts=post.thread_ts,
                text=text.returned_draft(result.draft),
            )

    # -- fork -----------------------------------------------------------------------------------

    async def fork(self, body: dict[str, Any], client: AsyncWebClient) -> None:
        found = await self._target(body, client)
        if found is None:
            return
        post, conversation, message_id = found
        actor = await self._person(post.team, post.user)
        domain = payload.nested_string(body, "team", "domain")
        source_link = text.permalink(domain, post.channel, post.ts)
        head = await client.chat_postMessage(
            channel=post.channel, text=text.forked_from(source_link, post.user)
        )
        new_ts = str(head["ts"])
        try:
            forked = await conversation.fork(
                message_id, actor, thread_key(post.team, post.channel, new_ts)
            )
        except (AgentSessionNotFound, MessageNotFound):
            await client.chat_delete(channel=post.channel, ts=new_ts)
            await self._say(client, post, text.not_in_transcript())
            return
        await client.chat_postMessage(
            channel=post.channel, thread_ts=new_ts, text=text.fork_copied(forked.copied)
        )
        await self._say(client, post, text.fork_done(text.permalink(domain, post.channel, new_ts)))
        if forked.draft:
            await client.chat_postEphemeral(
                channel=post.channel,
                user=post.user,
                thread_ts=new_ts,
                text=text.returned_draft(forked.draft),
            )

    # -- compact --------------------------------------------------------------------------------

    async def compact_shortcut(self, body: dict[str, Any], client: AsyncWebClient) -> None:
        found = await self._target(body, client)
        if found is None:
            return
        post, conversation, _ = found
        await self._compact(post, conversation, None, client)

    async def compact_command(self, body: dict[str, Any], client: AsyncWebClient) -> None:
        team = payload.nested_string(body, "team_id") or ""
        channel = payload.nested_string(body, "channel_id") or ""
        user = payload.nested_string(body, "user_id") or ""
        args = (payload.nested_string(body, "text") or "").strip()
        here = Post(team, channel, "", "", user, "channel")
        first, _, rest = args.partition(" ")
        link = first.strip("<>").split("|", 1)[0]
        match = _LINK.search(link)
        if match is None:
            if "/archives/" in link:
                await self._say_here(client, here, text.compact_bad_link())
                return
            await self._picker(here, args or None, client)
            return
        link_channel = match["channel"]
        ts = f"{match['secs']}.{match['micros']}"
        threaded = _THREAD_TS.search(link)
        root = threaded["ts"] if threaded else ts
        conversation = await self.conversations.find(thread_key(team, link_channel, root))
        if conversation is None:
            located = await self.conversations.at(thread_key(team, link_channel, ts))
            conversation = located[0] if located else None
        actor = await self._person(team, user)
        if conversation is None or not actor.may_manage(conversation.session.user_id):
            # One answer for "no session there" and "not yours": a link (to a channel the
            # person may not even be in) must not tell which threads are conversations.
            await self._say_here(client, here, text.compact_nothing_of_yours())
            return
        post = Post(team, link_channel, root, ts, user, "channel")
        await self._compact(post, conversation, rest.strip() or None, client)

    async def _say_here(self, client: AsyncWebClient, here: Post, body: str) -> None:
        await client.chat_postEphemeral(channel=here.channel, user=here.user, text=body)

    async def _picker(self, here: Post, focus: str | None, client: AsyncWebClient) -> None:
        actor = await self._person(here.team, here.user)
        sessions = await self.conversations.recent(actor, thread_key(here.team, here.channel, ""))
        if not sessions:
            await self._say_here(client, here, text.compact_picker_empty())
            return
        choices = [(s.id, s.title or "") for s in sessions[: text.PICKER_CHOICES]]
        key = await self.conversations.stash(
            {"sessions": [sid for sid, _ in choices], "focus": focus, "user": here.user}
        )
        await client.chat_postEphemeral(
            channel=here.channel,
            user=here.user,
            text=text.compact_picker(),
            blocks=text.picker_blocks(choices, key),
        )

    async def compact_picked(
        self, body: dict[str, Any], value: str, client: AsyncWebClient, respond: Respond
    ) -> None:
        """A picker button: its value names the stashed picker (choices and focus, of any
        length) and one of its sessions; anything else changes nothing."""
        key, _, chosen = value.partition(":")
        stashed = await self.conversations.unstash(key)
        user = payload.nested_string(body, "user", "id") or ""
        if stashed is None or stashed.get("user") != user or not chosen.isdigit():
            return
        if int(chosen) not in stashed.get("sessions", []):
            return  # not one of the choices offered to this person
        team = payload.nested_string(body, "team", "id") or ""
        try:
            conversation = await self.conversations.get(int(chosen))
        except AgentSessionNotFound:
            return
        session = conversation.session
        if not session.project_session_id.startswith(f"{team}/"):
            return  # another workspace's session: nothing to see here
        await respond(replace_original=True, text=text.compact_picked(session.title or ""))
        _, channel, root = session.project_session_id.split("/", 2)
        post = Post(team, channel, root, root, user, "channel")
        focus = stashed.get("focus")
        await self._compact(post, conversation, focus if isinstance(focus, str) else None, client)

    async def _compact(
        self, post: Post, conversation: Conversation, focus: str | None, client: AsyncWebClient
    ) -> None:
        actor = await self._person(post.team, post.user)
        if not actor.may_manage(conversation.session.user_id):
            # Checked before the thread hears of it (the core checks again, under its lock).
            await self._say(client, post, text.forbidden("compact"))
            return
        started = await client.chat_postMessage(
            channel=post.channel, thread_ts=post.thread_ts, text=text.compact_started(post.user)
        )
        try:
            stored = await conversation.compact(actor, focus=focus)
        except (AgentSessionForbidden, AgentSessionBusy, AgentSessionAlreadyCompact) as exc:
            await client.chat_delete(channel=post.channel, ts=str(started["ts"]))
            await self._say(client, post, _compact_refusal(exc))
            return
        except Exception as exc:
            # The model failed (or the database): the notice must not say "compacting…"
            # forever, and the person who asked is told; nothing was compacted.
            code = exc.code if isinstance(exc, SlackAgentError) else "internal_error"
            log.warning("compaction of session %s failed: %s", conversation.id, exc)
            with contextlib.suppress(*SLACK_FAILURES):
                await client.chat_delete(channel=post.channel, ts=str(started["ts"]))
            await self._say(client, post, text.compact_failed(code))
            return
        checkpoint = parse_checkpoint(stored)
        shown = (
            text.compacted([(name, checkpoint.items(name)) for name in SECTIONS])
            if checkpoint
            else text.compacted_text(message_text(stored.message))
        )
        await conversation.showed(stored.message_id)
        reply = await client.chat_postMessage(
            channel=post.channel, thread_ts=post.thread_ts, text=shown
        )
        await conversation.noted(
            thread_key(post.team, post.channel, str(reply["ts"])), stored.message_id, "checkpoint"
        )


def _compact_refusal(exc: Exception) -> str:
    if isinstance(exc, AgentSessionForbidden):
        return text.forbidden("compact")
    if isinstance(exc, AgentSessionBusy):
        return text.busy_action("compact")
    return text.already_compact()


def _domain(stashed: dict[str, Any]) -> str | None:
    """The workspace's domain kept with a rewind's confirmation (none in one stashed by a
    release before it was kept: the link then goes through slack.com, which redirects)."""
    domain = stashed.get("domain")
    return domain if isinstance(domain, str) else None
