"""Tool calls waiting for a person, the Slack way: the card, the buttons, the card's outcome.

- **The card.** A turn that stops at a call needing approval (``TurnResult.approval``) gets a
  card in its thread: the tool, its server, every argument (escaped, long values folded),
  Approve / Deny (and *Show all* when something is folded).
  The buttons carry only the request's id; where the card is (``card_ref``) is stored with it.
- **A click.** Who clicked and on which request is one call of the conversation API
  (``ApprovalDesk.decide``). A decision is then recorded as a delivery record (event key
  ``approval:<id>``) *before* Bolt acknowledges the click, so it is carried out (the turn that
  runs the call and continues) exactly once, on whichever replica holds the record, across
  restarts; a refusal is a one-line ephemeral and writes nothing (who clicked is checked before
  anything is stored). Slack never sends a click again, so a click whose recording failed is
  answered with an ephemeral asking to click again; a second click finds the request decided and
  records it (the same key: nothing runs twice), and the left-behind pass picks it up anyway.
- **Show all.** The card shows every argument (``core.conversation.argument_lines``: nothing
  hidden by invisible or reordering characters), each folded to a few hundred characters; when
  anything is folded, *Show all* opens a modal with every character of the call, in pages within
  Slack's block limits.
- **The outcome.** A card shows its request's state in place of its buttons. The core's
  approval rounds (``core.conversation.rounds``) hand every request whose card is behind its
  state (decided in the terminal or the web page, carried out, expired, superseded, rewound) to
  ``show``, which updates the card.
- **Decisions left behind.** The rounds find decisions whose deciding process died before
  carrying them out; one of a Slack thread is offered to ``take``, which records it as a click
  would have (the same key, so a click's record already there is not doubled) so that its
  continuation streams into the thread. The rounds carry out the others themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from slack_sdk.web.async_client import AsyncWebClient

from bot import payload
from bot import texts as text
from bot.post import Post, external_user, thread_key
from bot.reply import SLACK_FAILURES
from core.conversation import (
    ApprovalRecord,
    ApprovalRequest,
    Choice,
    Conversations,
    DecisionRecorded,
    DecisionRefused,
)
from core.conversation.intake import Incoming
from core.conversation.places import SlackThread, slack_user_in
from core.conversation.rounds import Taking
from core.conversation.worker import DeliveryWorker
from core.runtime import Settings

log = logging.getLogger(__name__)

EVENT_PREFIX = "approval:"  # delivery records of decisions: ``approval:<id>``

ClientFor = Callable[[str], Awaitable[AsyncWebClient | None]]


class ApprovalCards:
    """One per process: posts cards, handles clicks, keeps cards up to date."""

    def __init__(
        self,
        settings: Settings,
        conversations: Conversations,
        client_for: ClientFor,
    ) -> None:
        self.settings = settings
        self.conversations = conversations
        self._client_for = client_for
        self._worker: DeliveryWorker[AsyncWebClient] | None = None

    # -- the card -------------------------------------------------------------------------------

    async def post(self, client: AsyncWebClient, post: Post, request: ApprovalRequest) -> None:
        """The card for a request a turn stopped at, in the turn's thread."""
        desk = self.conversations.approvals
        body = text.approval_text(request.tool_name, request.server)
        try:
            response = await client.chat_postMessage(
                channel=post.channel,
                thread_ts=post.thread_ts,
                text=body,
                blocks=text.approval_blocks(
                    request.id, request.tool_name, request.server, request.arguments
                ),
            )
        except SLACK_FAILURES as exc:
            log.warning("approval card for %s not posted: %s", request.id, exc)
            return
        ts = response.get("ts")
        if desk is not None and isinstance(ts, str):
            await desk.set_card(request.id, thread_key(post.team, post.channel, ts))

    async def post_missing(
        self, client: AsyncWebClient, post: Post, waiting: ApprovalRecord
    ) -> None:
        """The card of the request the conversation waits on (``waiting``), if none was ever
        posted: the replica whose turn stored the request died before posting it, and the turn
        taken over finds the answer already stored."""
        if waiting.card_ref is None:
            request = ApprovalRequest(
                waiting.id, waiting.tool_name, waiting.server, waiting.arguments
            )
            await self.post(client, post, request)

    async def show(self, record: ApprovalRecord, client: AsyncWebClient | None = None) -> bool:
        """Bring one card up to its request's state (one replica per change does)."""
        desk = self.conversations.approvals
        if desk is None or record.card_ref is None or record.card_state is None:
            return False
        if record.card_state == record.state:
            return False
        card = SlackThread.parse(record.card_ref)
        if card is None:
            return False
        if not await desk.card_shown(record.id, record.card_state, record.state):
            return False
        client = client or await self._client_for(card.team)
        if client is None:
            return False
        try:
            await client.chat_update(
                channel=card.channel,
                ts=card.ts,
                text=text.approval_outcome(
                    record.state, record.decided_by, record.reason, record.decision_reason
                ),
                blocks=text.approval_outcome_blocks(
                    record.id,
                    record.state,
                    record.decided_by,
                    record.tool_name,
                    record.server,
                    record.arguments,
                    record.reason,
                    record.decision_reason,
                ),
            )
        except SLACK_FAILURES as exc:
            log.info("approval card %s not updated: %s", record.id, exc)
        return True

    async def refresh(self, approval_id: str, client: AsyncWebClient | None = None) -> None:
        desk = self.conversations.approvals
        if desk is None:
            return
        record = await desk.get(approval_id)
        if record is not None:
            await self.show(record, client)

    def start(self, worker: DeliveryWorker[AsyncWebClient]) -> None:
        """Left-behind decisions of Slack threads are recorded for ``worker`` from now on."""
        self._worker = worker

    # -- decisions whose deciding process died -------------------------------------------------

    async def take(self, record: ApprovalRecord) -> Taking:
        """A left-behind decision of a Slack thread gets the delivery record a click would have
        made (the same key, so a click's record already there is not doubled): its
        continuation streams into the thread. Any other is the approval rounds' to carry out."""
        key = await self.conversations.key_of(record.session_id)
        post = None if key is None else Post.of_thread(key, "")
        if key is None or post is None:
            return "not_mine"
        client = await self._client_for(post.team)
        user = None if client is None else await self._decider_in(record, post.team)
        if client is None or user is None or self._worker is None:
            return "later"  # a thread's, never carried out unseen: the next round asks again
        log.info("decision %s was left behind by its process; recording it", record.id)
        await self._record(record, key, user, client, self._worker)
        return "taken"

    async def _decider_in(self, record: ApprovalRecord, team: str) -> str | None:
        """The Slack user the thread's notices about a decision go to: the decider when they
        decided in this workspace, else the conversation's owner."""
        decider = slack_user_in(record.decided_by, team) if record.decided_by else None
        if decider is not None:
            return decider
        session = (await self.conversations.get(record.session_id)).session
        owner = None if session.user_id is None else await self.conversations.who(session.user_id)
        return None if owner is None else slack_user_in(owner, team)

    # -- a click --------------------------------------------------------------------------------

    async def clicked(
        self,
        body: dict[str, Any],
        action: dict[str, Any],
        client: AsyncWebClient,
        worker: DeliveryWorker[AsyncWebClient],
    ) -> str | None:
        """Decide the request a button names, before the acknowledgement. Returns the line
        to tell the clicker when nothing changed (None: the decision was recorded)."""
        approve = payload.nested_string(action, "action_id") == text.APPROVE
        approval_id = payload.nested_string(action, "value") or ""
        team = payload.nested_string(body, "team", "id") or ""
        user = payload.nested_string(body, "user", "id") or ""
        if not team or not user:
            return text.approval_refused("unknown")
        channel = payload.nested_string(body, "container", "channel_id")
        card_ts = payload.nested_string(body, "container", "message_ts")
        decision = await self.conversations.decide(
            Choice(
                approval_id,
                external_user(team, user),
                approve,
                admin=self.settings.is_admin(team, user),
                approver_id=f"{team}:{user}",
                within=SlackThread.in_workspace(team),  # a tampered id, another workspace's
                shown_at=thread_key(team, channel, card_ts) if channel and card_ts else None,
            )
        )
        if isinstance(decision, DecisionRefused):
            found, key = decision.record, decision.key
            if decision.reason == "decided" and found and key and not found.carried_out:
                # A second click after one whose recording failed, or a click of someone else
                # at once: the record is idempotent, so the decision is carried out once.
                await self._record(found, key, user, client, worker)
            return text.approval_refused(
                decision.reason, found.decided_by if found is not None else None
            )
        assert isinstance(decision, DecisionRecorded)
        assert decision.key is not None  # asked ``within`` a workspace: its key was read
        await self._record(decision.record, decision.key, user, client, worker)
        return None

    # -- *Show all* -----------------------------------------------------------------------------

    async def show_call(
        self, body: dict[str, Any], action: dict[str, Any], client: AsyncWebClient
    ) -> None:
        """*Show all* on a card (or Previous / Next in its modal): the whole call, every
        character, in a modal (a page of it). Anyone who sees the card may read it; a request
        of another workspace, or none, opens nothing."""
        desk = self.conversations.approvals
        value = payload.nested_string(action, "value") or ""
        approval_id, _, page = value.partition(":")
        team = payload.nested_string(body, "team", "id") or ""
        if desk is None or not team:
            return
        record = await desk.get(approval_id)
        key = None if record is None else await self.conversations.key_of(record.session_id)
        if record is None or key is None or not key.startswith(f"{team}/"):
            return
        modal = text.call_modal(
            record.id,
            record.tool_name,
            record.server,
            record.arguments,
            int(page) if page.isdigit() else 0,
        )
        view_id = payload.nested_string(body, "view", "id")
        try:
            if view_id:
                await client.views_update(view_id=view_id, view=modal)
            else:
                trigger = payload.nested_string(body, "trigger_id") or ""
                await client.views_open(trigger_id=trigger, view=modal)
        except SLACK_FAILURES as exc:
            log.info("the call of %s not shown: %s", record.id, exc)

    async def _record(
        self,
        record: ApprovalRecord,
        key: str,
        user: str,
        client: AsyncWebClient,
        worker: DeliveryWorker[AsyncWebClient],
    ) -> None:
        post = Post.of_thread(key, user)
        if post is None:
            return
        decision = Incoming(
            event_key=f"{EVENT_PREFIX}{record.id}",
            thread_key=key,
            author=user,
            message_id=record.message_id,
            text=f"({record.tool_name}: {record.state})",
            context={**post.context(), "approval": record.id, "decided_by": record.decided_by},
        )
        await worker.receive(decision, client)
