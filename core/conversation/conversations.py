"""The conversation API: what every surface calls, the same way.

A surface (Slack, the terminal, a future web page) translates what a person did into one of
these calls and renders what comes back; the rules in between live here once:

- ``Conversations`` is one surface's door to the sessions: it opens or finds the conversation
  for the surface's key (a Slack thread, a terminal's session), locates the conversation and
  message a surface reference names (a Slack message), and answers the questions that are not
  about one conversation (who a person is, stop requests, votes, what someone looks at).
- ``Conversation`` is one session as that surface sees it: its ``View`` (the last message the
  surface showed, the stale guard's ``last_message_id``), a turn with the stale and resume
  rules applied, what the surface has not shown, and rewind, fork and compaction at a message.

Refusals that a surface renders as part of its normal flow come back as values
(``Busy``, ``Stale``, ``AlreadyAnswered``); failures (a lost lock, an interruption, the
database) are the core's exceptions, with stable codes.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from core.agent.accounting import Attribution, Payer
from core.agent.loop import Agent, AgentEvent, TurnStarted
from core.agent.turn import STOPPED
from core.conversation import door
from core.conversation.approvals import ApprovalDesk, calls_outside
from core.conversation.door import (
    Arrival,
    Choice,
    DecisionRecorded,
    DecisionRefused,
    Renderer,
    TurnEnd,
)
from core.conversation.outcomes import (
    AlreadyAnswered,
    Answered,
    Busy,
    ConversationEvent,
    OnConversationEvent,
    OverBudget,
    PickingUp,
    Refreshed,
    RewindPlan,
    Rewound,
    Stale,
    TurnOutcome,
    TurnRequest,
)
from core.conversation.views import MemoryView, ThreadView, Unseen, View, unseen
from core.conversation.visibility import Viewer, may_see
from core.errors import (
    AgentSessionBudgetExceeded,
    AgentSessionBusy,
    AgentSessionNotFound,
    AgentSessionStale,
    DuplicateMessage,
    MessageNotFound,
)
from core.messages import message_text, said_anything, user_message
from core.records import Actor, SessionInfo, StoredMessage
from core.storage import Approvals, Feedback, SessionStore, SurfaceState
from core.storage.approvals import ENDED, MOVED_ON, ApprovalRecord
from core.storage.approvals import OVER_BUDGET as OVER
from core.tools.names import PREFIX as MCP_PREFIX


@dataclass(frozen=True)
class Summary:
    """A session as a list shows it: its owner (external id and name), its last message and
    the tool call it waits on a person for."""

    session: SessionInfo
    owner: str | None
    owner_name: str | None
    last_message_id: str | None
    waiting: ApprovalRecord | None


@dataclass(frozen=True)
class Forked:
    conversation: Conversation
    copied: int
    draft: str | None


async def _let_others_run() -> None:
    """Yield to the event loop. SQLite statements run in place (``core.storage.engine``), so a
    chain of them never suspends; without these, a surface's acknowledgements would wait
    behind whole chains."""
    await asyncio.sleep(0)


class Conversations:
    """One surface's conversations.

    ``state``: the surface's own tables (threads, message references). A surface that has
    them binds each conversation to its key and keeps its view there, for every replica; one
    without them (the terminal) keeps its view in memory.
    """

    def __init__(
        self,
        store: SessionStore,
        agent: Agent,
        feedback: Feedback,
        *,
        project: str,
        state: SurfaceState | None = None,
        approvals: Approvals | None = None,
    ) -> None:
        self.store = store
        self.agent = agent
        self.project = project
        self._feedback = feedback
        self._state = state
        # Tool calls waiting for a person: deciding them (``ApprovalDesk.decide``).
        self.approvals = ApprovalDesk(store, approvals) if approvals is not None else None

    # -- people ---------------------------------------------------------------------------------

    async def person(
        self, external_id: str, *, admin: bool = False, display_name: str | None = None
    ) -> Actor:
        """Who acts (``slack:T…:U…``, ``cli:<login>``); ``admin`` as the surface decides it."""
        user_id = await self.store.get_or_create_user(external_id, display_name)
        return Actor(user_id=user_id, admin=admin)

    async def known_person(self, external_id: str, *, admin: bool = False) -> Actor:
        """Who acts, as ``person`` says, but without making them a user: a person who may turn
        out not to be allowed (a click on someone else's card) leaves nothing behind."""
        return Actor(user_id=await self.store.find_user(external_id), admin=admin)

    async def who(self, user_id: int) -> str | None:
        """The external id of a user (to name a session's owner)."""
        return await self.store.user_external_id(user_id)

    # -- finding and opening --------------------------------------------------------------------

    async def open(
        self,
        key: str,
        *,
        owner: Actor,
        title: str | None = None,
        temporary: bool = False,
        view: View | None = None,
    ) -> Conversation:
        """The conversation for the surface's ``key``, made (owned by ``owner``) if there is
        none; idempotent under concurrency (replicas and retries meeting one thread agree).
        ``view``: where the surface keeps what it showed, when it keeps that itself."""
        await _let_others_run()
        session, _ = await self.store.get_or_create_session(
            self.project, key, user_id=owner.user_id, title=title, temporary=temporary
        )
        await _let_others_run()
        if self._state is not None:
            await self._state.bind_thread(key, session.id)
        return self._conversation(session, key, view)

    async def find(self, key: str) -> Conversation | None:
        """The conversation bound to ``key``, if there is one."""
        if self._state is None:
            found = await self.store.find_session(self.project, key)
            return None if found is None else self._conversation(found, key)
        thread = await self._state.get_thread(key)
        if thread is None:
            return None
        return self._conversation(await self.store.get_session(thread.session_id), key)

    async def get(self, session_id: int, *, view: View | None = None) -> Conversation:
        """A conversation by its session id (``AgentSessionNotFound`` when there is none).
        A session of this surface's project is keyed by its ``project_session_id``."""
        session = await self.store.get_session(session_id)
        key = session.project_session_id if session.project_name == self.project else None
        return self._conversation(session, key, view)

    async def at(self, ref: str) -> tuple[Conversation, str] | None:
        """The conversation a surface reference belongs to, and the id of the transcript
        message it stands for (which a rewind may have taken out since)."""
        if self._state is None:
            return None
        found = await self._state.find_ref(ref)
        if found is None:
            return None
        return await self.get(found.session_id), found.message_id

    async def key_of(self, session_id: int) -> str | None:
        """The surface key a session is bound to (a fork's head, a thread), if any."""
        if self._state is None:
            return None
        thread = await self._state.thread_of_session(session_id)
        return None if thread is None else thread.thread_key

    async def find_by_key_suffix(self, suffix: str, *, ref_suffix: str | None = None) -> int | None:
        """The session bound to a key ending with ``suffix``, or else the one whose message a
        reference ending with ``ref_suffix`` (default: ``suffix``) names: for a link that names
        only part of a surface's key (a Slack permalink names no workspace)."""
        if self._state is None:
            return None
        thread = await self._state.find_thread_ending(suffix)
        if thread is not None:
            return thread.session_id
        ref = await self._state.find_ref_ending(ref_suffix or suffix)
        return None if ref is None else ref.session_id

    async def recent(self, owner: Actor, key_prefix: str) -> list[SessionInfo]:
        """The owner's sessions whose keys start with ``key_prefix``, most recent first."""
        sessions = await self.store.list_sessions(user_id=owner.user_id, project_name=self.project)
        return [s for s in sessions if s.project_session_id.startswith(key_prefix)]

    # -- what a person sees of every surface's sessions ------------------------------------------

    async def visible(
        self,
        viewer: Viewer,
        *,
        everything: bool = False,
        before: tuple[datetime, int] | None = None,
        words: str | None = None,
        limit: int = 50,
    ) -> list[SessionInfo]:
        """A page of the sessions ``viewer`` sees (``places.may_see``), most recently updated
        first; ``everything`` (an admin's): every session of their workspace, and the terminal's."""
        return await self.store.visible(
            user_id=viewer.actor.user_id,
            shared=viewer.shared,
            everything=everything and viewer.admin,
            workspace=viewer.workspace,
            before=before,
            words=words,
            limit=limit,
        )

    async def seen_by(
        self, session_id: int, viewer: Viewer, *, view: View | None = None
    ) -> Conversation:
        """The conversation ``session_id`` as ``viewer`` may see it; ``AgentSessionNotFound``
        when there is none or it is not theirs to see (the same answer: ids are not probed)."""
        session = await self.store.get_session(session_id)
        if not may_see(session, viewer):
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        key = session.project_session_id if session.project_name == self.project else None
        return self._conversation(session, key, view)

    async def summaries(self, sessions: Sequence[SessionInfo]) -> list[Summary]:
        """Each session's ``Summary``, in three queries whatever their number."""
        ids = [s.id for s in sessions]
        people = await self.store.people([s.user_id for s in sessions if s.user_id is not None])
        tails = await self.store.tails(ids)
        waiting = {} if self.approvals is None else await self.approvals.waiting_among(tails)
        shown = []
        for session in sessions:
            owner, name = people.get(session.user_id or -1, (None, None))
            shown.append(
                Summary(session, owner, name, tails.get(session.id), waiting.get(session.id))
            )
        return shown

    async def stop_session(self, session_id: int) -> bool:
        """``stop`` by the session's id: False when no turn runs on it."""
        return await self.store.request_stop(session_id)

    def _conversation(
        self, session: SessionInfo, key: str | None, view: View | None = None
    ) -> Conversation:
        if view is not None:
            return Conversation(self, session, key, view)
        if self._state is not None and key is not None:
            view = ThreadView(self._state, key, session.id)
        else:
            view = MemoryView()
        return Conversation(self, session, key, view)

    # -- the door: what a surface calls for a turn -----------------------------------------------

    async def answer(self, arrival: Arrival, renderer: Renderer) -> TurnEnd:
        """Answer what arrived, shown through ``renderer``: the person, the conversation (made
        when the surface's key has none), the turn with its stale guard and resume rules, the
        "shown" bookkeeping, and every way it can end folded into one ``TurnEnd``. A database
        failure or a cancellation propagates (after ``renderer.abandoned``): the caller's
        delivery record retries it or another replica takes it over."""
        return await door.answer(self, arrival, renderer)

    async def decide(
        self,
        choice: Choice,
        renderer: Renderer | None = None,
        *,
        payer: Payer | None = None,
        view: View | None = None,
    ) -> TurnEnd | DecisionRefused | DecisionRecorded:
        """A person's decision on a waiting tool call. With a ``renderer`` the decision is
        carried out here and now, as a turn shown through it (the terminal, the HTTP API);
        without one it is only recorded (``DecisionRecorded``) and the surface carries it out
        its own way (Slack: from a durable delivery record, ``Arrival.approval``)."""
        return await door.decide(self, choice, renderer, payer=payer, view=view)

    # -- beside the conversations ---------------------------------------------------------------

    async def carry_out_left_behind(
        self,
        record: ApprovalRecord,
        on_event: OnConversationEvent | None = None,
        *,
        payer: Payer | None = None,
    ) -> TurnOutcome:
        """Carry out a decision its deciding process left behind (``ApprovalDesk.left_behind``),
        as that process would have (``payer``: the decider, as the surface names them)."""
        conversation = await self.get(record.session_id)
        return await conversation.carry_out(record.id, on_event, payer=payer)

    async def busy(self, session_ids: set[int]) -> set[int]:
        """Which of these sessions have a turn running (``is_turn_active``), in one query."""
        return await self.store.active_among(session_ids)

    async def stop(self, key: str) -> bool:
        """A stop button: the running turn stops, on whichever replica runs it."""
        found = await self.find(key)
        return found is not None and await self.store.request_stop(found.session.id)

    async def stop_all(self, key_prefix: str) -> int:
        """Every turn running under keys with this prefix stops (an app removed)."""
        return await self.store.request_stops(self.project, key_prefix)

    async def rename(self, key: str, title: str) -> None:
        """The surface renamed the conversation: that is its title here too."""
        found = await self.find(key)
        if found is not None and title.strip():
            await self.store.set_title(found.session.id, title, Actor(None, admin=True))

    async def vote(self, message_id: str, voter: str, verdict: str) -> bool:
        """A feedback vote on an answer; False when it is gone or no vote."""
        return await self._feedback.record(message_id, voter, verdict)

    async def votes(self, session_id: int) -> dict[str, dict[str, int]]:
        return await self._feedback.of_session(session_id)

    async def set_viewing(self, person: str, seen: dict[str, Any]) -> None:
        """What a person is looking at, remembered for their next message (any replica)."""
        if self._state is not None:
            await self._state.set_viewing(person, seen)

    async def viewing(self, person: str) -> dict[str, Any] | None:
        return None if self._state is None else await self._state.viewing(person)

    async def stash(self, value: dict[str, Any]) -> str:
        """Keep a surface's pending choice (a confirmation, a picker) for any replica."""
        assert self._state is not None, "stashing needs the surface's tables"
        return await self._state.stash(value)

    async def unstash(self, key: str) -> dict[str, Any] | None:
        return None if self._state is None else await self._state.unstash(key)


class Conversation:
    """One session as one surface sees it."""

    def __init__(
        self, owner: Conversations, session: SessionInfo, key: str | None, view: View
    ) -> None:
        self._all = owner
        self.store = owner.store
        self.session = session
        self.key = key
        self.view = view
        self._sent: StoredMessage | None = None  # the user message of this handle's last turn

    @property
    def id(self) -> int:
        return self.session.id

    # -- reading --------------------------------------------------------------------------------

    async def is_empty(self) -> bool:
        return await self.store.tail(self.id) is None

    async def is_busy(self) -> bool:
        return await self.store.is_turn_active(self.id)

    async def projected(self) -> list[StoredMessage]:
        """What the model sees (the latest checkpoint and what follows); now shown."""
        history = await self.store.history(self.id)
        # The projection ends at the tail it was read with: what was printed is what was seen.
        await self.view.show(history[-1].message_id if history else None)
        return history

    async def unseen(self) -> Unseen:
        """What was added or changed since the surface last showed the session; now shown."""
        shown = await self.view.shown()
        found = await unseen(self.store, self.id, shown)
        if found.messages:
            await self.view.show(found.messages[-1].message_id)
        elif found.rewound:
            tail = await self.store.tail(self.id)
            await self.view.show(tail.message_id if tail else None)
        return found

    async def listing(self) -> tuple[list[StoredMessage], set[str]]:
        """The whole transcript, and which of its messages carry a sandbox snapshot."""
        messages = await self.store.messages(self.id)
        return messages, await self.store.snapshots.messages_with_snapshots(self.id)

    async def page(
        self, *, after_position: int = -1, limit: int = 100
    ) -> list[tuple[StoredMessage, datetime]]:
        """Up to ``limit`` messages after ``after_position``, oldest first, each with when it
        was stored (a client's page of the whole transcript; nothing is marked shown)."""
        return await self.store.page(self.id, after_position=after_position, limit=limit)

    async def last(self) -> StoredMessage | None:
        """The transcript's last message (what a client's stale guard names)."""
        return await self.store.tail(self.id)

    async def rename(self, title: str, actor: Actor) -> None:
        """A new title (owner or admin: ``AgentSessionForbidden`` otherwise)."""
        await self.store.set_title(self.id, title, actor)

    async def delete(self, actor: Actor) -> None:
        """The session and its transcript go (owner or admin; ``AgentSessionBusy`` while a
        turn runs)."""
        await self.store.delete_session(self.id, actor)

    async def at_position(self, position: int) -> StoredMessage:
        found = await self.store.messages(self.id, after_position=position - 1)
        if not found or found[0].position != position:
            raise MessageNotFound(f"no message at position {position}")
        return found[0]

    async def owner(self) -> str | None:
        """The external id of the session's owner (None when it has none)."""
        if self.session.user_id is None:
            return None
        return await self._all.who(self.session.user_id) or f"user #{self.session.user_id}"

    # -- a turn ---------------------------------------------------------------------------------

    async def take_turn(
        self, request: TurnRequest, on_event: OnConversationEvent | None = None
    ) -> TurnOutcome:
        """One turn for ``request``, with the stale guard against the surface's view.

        A refusal costs no model tokens: ``Busy`` and ``Stale`` come from the claim. A stale
        refusal caused only by this surface's own earlier turn (every message after the view
        came through this surface: a reply that finished a moment ago on another replica)
        moves the view on and sends, as does one the person chose to send anyway (after the
        surface showed them ``Refreshed``). A resumed request answers from what the
        transcript holds: a message stored but unanswered is answered from there (never
        stored again, ``PickingUp`` first); an answered one is ``AlreadyAnswered``.
        """
        emit = on_event or _ignore
        if request.ref is not None and request.message_id is not None:
            await self._note_ref(request.ref, request.message_id, "user")
            await _let_others_run()
        if not request.resume:
            try:
                return await self._turn(request, emit, retry=True)
            except DuplicateMessage:
                pass  # already in the transcript: what follows it says what is left to do
        return await self._resume(request, emit)

    async def _resume(self, request: TurnRequest, emit: OnConversationEvent) -> TurnOutcome:
        tail = await self.store.tail(self.id)
        if tail is not None and tail.message_id == request.message_id:
            await emit(PickingUp())
            return await self._turn(request, emit, resume=True)
        found = await self.store.find_message(request.message_id) if request.message_id else None
        if found is None:
            return await self._turn(request, emit, retry=True)
        after = await self.store.messages(self.id, after_position=found[1].position)
        answers = list(itertools.takewhile(lambda m: m.role == "assistant", after))
        counted = [m for m in answers if not answers_nothing(m)]
        if answers and not counted and len(answers) == len(after):
            # Its turn stopped before the model said anything (a shutdown, a lost lock), and
            # nothing came after: the message is answered from here, after the empty answer
            # (which the model is not shown).
            await emit(PickingUp())
            return await self._turn(request, emit, resume=True, tail=answers[-1].message_id)
        return AlreadyAnswered(counted[0] if counted else None)

    async def _turn(
        self,
        request: TurnRequest,
        emit: OnConversationEvent,
        *,
        resume: bool = False,
        retry: bool = False,
        tail: str | None = None,
    ) -> TurnOutcome:
        """``resume``: answer the stored message, the transcript's tail (or, given, ``tail``)."""
        shown = await self.view.shown()
        self._sent = None

        async def noted(event: AgentEvent) -> None:
            if isinstance(event, TurnStarted):
                self._sent = event.user
            await emit(event)

        message = None
        if not resume:
            extra: dict[str, Any] = dict(request.metadata)
            if request.context:
                extra["context"] = request.context
            message = user_message(request.text, message_id=request.message_id, **extra)
        try:
            result = await self._all.agent.run_turn(
                self.id,
                user_message=message,
                last_message_id=(tail or request.message_id) if resume else shown,
                on_event=noted,
                files=request.files,
                attribution=Attribution(self._all.project, request.payer),
                author=request.author,
            )
        except AgentSessionBusy:
            return Busy()
        except AgentSessionBudgetExceeded as exc:
            return OverBudget(exc)
        except AgentSessionStale as exc:
            if resume:  # something was added after the message meanwhile: it was answered
                return AlreadyAnswered(None)
            if retry and await self._only_this_surface_moved(shown):
                # This surface's own previous turn finished a moment ago; nothing came from
                # elsewhere, so this is not stale for the person typing here.
                await self.view.show(exc.actual_last_message_id)
            elif retry and request.sent_anyway:
                await emit(Refreshed(await self._refresh(shown, exc)))
            else:
                return Stale(await self._refresh(shown, exc))
            return await self._turn(request, emit)
        return Answered(result)

    async def _refresh(self, shown: str | None, exc: AgentSessionStale) -> Unseen:
        """What the surface had not shown; it shows the current tail from now on."""
        found = await unseen(self.store, self.id, shown)
        await self.view.show(exc.actual_last_message_id)
        return found

    async def _only_this_surface_moved(self, shown: str | None) -> bool:
        """Everything after ``shown`` is this surface's own: user messages it received (they
        have its references) and the answers to them; no checkpoint, no rewind, no other
        surface. A surface without references of its own never qualifies."""
        state = self._all._state
        if state is None:
            return False
        found = await unseen(self.store, self.id, shown)
        messages = found.messages
        if found.rewound or not messages or any(m.is_compaction_message for m in messages):
            return False
        users = [m.message_id for m in messages if m.role == "user"]
        if not users or messages[0].role != "user":
            return False
        known = {r.message_id for r in await state.refs_for(users)}
        return set(users) <= known

    async def was_shown(self, message_id: str) -> bool:
        """Whether a surface recorded showing ``message_id`` whole (``showed`` or ``noted`` it
        as a reply): a resume that finds it answered has nothing left to show."""
        state = self._all._state
        if state is None:
            return False
        return any(r.kind == "reply" for r in await state.refs_for([message_id]))

    async def showed(self, message_id: str, refs: Sequence[str] = (), kind: str = "reply") -> None:
        """The surface showed ``message_id`` (an answer, a checkpoint), under ``refs``."""
        await self.view.show(message_id)
        for ref in refs:
            await self._note_ref(ref, message_id, kind)

    async def noted(self, ref: str, message_id: str, kind: str) -> None:
        """A surface message stands for ``message_id`` (a long reply's later parts)."""
        await self._note_ref(ref, message_id, kind)

    async def _note_ref(self, ref: str, message_id: str, kind: str) -> None:
        state = self._all._state
        if state is not None:
            await state.add_ref(ref, self.id, message_id, kind)

    async def after_interruption(self) -> None:
        """A turn of this handle stopped after its message was added (Ctrl-C, a lost lock):
        what it showed was its message and the partial answer kept right after it. Anything
        later came from elsewhere once the lock was free, and ``unseen`` shows it."""
        if self._sent is None:
            return
        after = await self.store.messages(self.id, after_position=self._sent.position)
        ours = after[0] if after and after[0].role == "assistant" else None
        await self.view.show(ours.message_id if ours is not None else self._sent.message_id)

    # -- tool calls waiting for a person ---------------------------------------------------------

    async def pending_approval(self) -> ApprovalRecord | None:
        """The tool call this conversation waits on a person for, if any (every surface shows
        it; a decision anywhere makes this None for all of them)."""
        desk = self._all.approvals
        return None if desk is None else await desk.waiting_in(self.id)

    async def carry_out(
        self,
        approval_id: str,
        on_event: OnConversationEvent | None = None,
        *,
        payer: Payer | None = None,
    ) -> TurnOutcome:
        """The turn that carries out a recorded decision (``ApprovalDesk.decide``): the
        approved call runs once, or the model hears it was declined, and the model continues.
        ``Busy``: a turn runs elsewhere (try again later). ``AlreadyAnswered``: carried out
        already, or the conversation moved on so the call never runs. ``OverBudget``: the
        decider (``payer``) is over a budget; the decision stays recorded, not carried out."""
        emit = on_event or _ignore
        desk = self._all.approvals
        assert desk is not None, "carrying out a decision needs the approvals store"
        record = await desk.get(approval_id)
        if record is None or record.state in ENDED:
            # Carried out, or ended without running (refused, superseded, expired…): nothing
            # to carry out, and no model request; the next message tells the model why.
            return AlreadyAnswered(None)
        try:
            result = await self._all.agent.carry_out(
                self.id,
                approval_id,
                on_event=emit,
                attribution=Attribution(self._all.project, payer),
                record=record,
            )
        except AgentSessionBusy:
            return Busy()
        except AgentSessionBudgetExceeded as exc:
            # The decision cannot be carried out now, and must not be later by itself (when
            # the budget resets nobody consents again): it ends here, and the card says why.
            approvals = desk.approvals
            await approvals.end(approval_id, before=("approved",), state="refused", reason=OVER)
            await approvals.end(approval_id, before=("denied",), state="declined", reason=OVER)
            return OverBudget(exc)
        except AgentSessionStale:
            # The message that asked is no longer the last: carried out by a turn that died
            # after storing its answer (finished now), or the conversation moved on first (a
            # new message, a compaction): an approved call that never went out never will.
            await desk.approvals.carried_out(approval_id)
            await desk.approvals.close(approval_id, "superseded", MOVED_ON)
            return AlreadyAnswered(None)
        if result.answer is not None:
            await self.view.show(result.answer.message_id)
        return Answered(result)

    # -- transcript operations ------------------------------------------------------------------

    async def rewind_plan(self, message_id: str) -> RewindPlan | None:
        """How many messages a rewind to ``message_id`` would take out (None: it is gone)."""
        located = await self.store.find_message(message_id)
        if located is None or located[0] != self.id:
            return None
        target = located[1]
        later = await self.store.count_after(self.id, target.position)
        leaving = later + (1 if target.returns_as_draft else 0)
        # Only messages that name an MCP tool can hold a call that went out (read by the
        # database's filter: the confirmation never reads the rest of the transcript).
        called = await self.store.messages(
            self.id, after_position=target.position, containing=MCP_PREFIX
        )
        outside = tuple(call for m in [target, *called] for call in calls_outside(m.message))
        return RewindPlan(leaving, target.returns_as_draft, outside)

    async def rewind(self, message_id: str, actor: Actor) -> Rewound:
        """§7 truncate to ``message_id`` (owner or admin; refused while busy); the surface's
        view moves to the new tail, and the replies it showed for what left are named."""
        located = await self.store.find_message(message_id)
        start = located[1].position - 1 if located is not None else -1
        # What the rewind can delete: the target and what follows it (never the whole transcript).
        before = {m.message_id: m for m in await self.store.messages(self.id, after_position=start)}
        result = await self.store.truncate(self.id, message_id, actor)
        await self.view.show(result.tail_message_id)
        withdrawn: list[tuple[str, str]] = []
        state = self._all._state
        if state is not None:
            for gone in await state.refs_for(list(result.deleted_message_ids)):
                if gone.kind == "reply":
                    original = before.get(gone.message_id)
                    withdrawn.append(
                        (gone.ref_key, message_text(original.message) if original else "")
                    )
        target = before.get(message_id)
        metadata = target.message.get("metadata") if target else None
        return Rewound(
            deleted=result.deleted,
            draft=result.draft,
            draft_metadata=metadata if isinstance(metadata, dict) else {},
            withdrawn_replies=withdrawn,
        )

    async def fork(self, message_id: str, actor: Actor, key: str) -> Forked:
        """§7 branch at ``message_id`` into a new conversation under the surface's ``key``,
        owned by ``actor``; its view starts at its tail."""
        result = await self.store.branch(
            self.id,
            message_id,
            user_id=actor.user_id,
            project_name=self._all.project,
            project_session_id=key,
        )
        tail = await self.store.tail(result.session.id)
        state = self._all._state
        if state is not None:
            await state.bind_thread(key, result.session.id, tail.message_id if tail else None)
        fork = self._all._conversation(result.session, key)
        if state is None:
            await fork.view.show(tail.message_id if tail else None)
        return Forked(fork, result.copied, result.draft)

    async def compact(
        self, actor: Actor, *, focus: str | None = None, payer: Payer | None = None
    ) -> StoredMessage:
        """§7 compaction on request (owner or admin). The view stays: the surface shows the
        checkpoint (``showed``, or with what else it had not shown, ``unseen``). Its model
        request counts against ``payer``'s budgets (``AgentSessionBudgetExceeded`` when they
        are used up)."""
        return await self._all.agent.compact(
            self.id, actor, focus=focus, attribution=Attribution(self._all.project, payer)
        )


async def _ignore(_event: ConversationEvent) -> None:
    return None


def answers_nothing(answer: StoredMessage) -> bool:
    """An answer interrupted before its model said or did anything, by anything but the
    person's own stop or a model error (both shown as the answer): the message before it is
    still to be answered. (Turns that fail on their own, or lose the database, store no such
    answer; a shutdown past its grace, a lost lock and earlier versions did.)"""
    metadata = answer.message.get("metadata") or {}
    return (
        bool(metadata.get("interrupted"))
        and not metadata.get("error")
        and metadata.get("interrupted_by") != STOPPED
        and not said_anything(answer.message)
    )


__all__ = ["Conversation", "Conversations", "Forked", "Summary", "answers_nothing"]
