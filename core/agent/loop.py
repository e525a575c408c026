"""The agent: one turn from a user's message to a persisted answer.

history projection -> model -> tool calls (the session's bashkit shell) -> model ... until the
model answers without calling a tool, or the round cap is reached (the last round offers no
tools, so the model must answer in words). Text streams to the caller as it arrives.

Everything that can refuse a turn (busy, stale, unknown session) happens in ``start_turn``
before any provider is called, so a refused turn costs no tokens. A provider failure ends the
turn with its partial output persisted as interrupted, the sandbox state kept, the lock released
and the error returned for the surface to word; nothing raises past a started turn but a lost
lock or a cancellation.

Auto-compaction: before calling the model, a projection estimated above ``auto_compact_tokens``
is compacted first, inside the same lock, with the checkpoint placed before the turn's own user
message. The estimate is the projection's JSON length divided by four (about four characters
per token for English text and code): cheap, provider-independent, and conservative for the
tool output that dominates long sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.agent import mcp_calls
from core.agent.accounting import Accounting, Attribution, TurnAccount
from core.agent.compaction import Summariser, checkpoint_message, compact, parse_checkpoint
from core.agent.model_choice import ProviderCache, ResolvedModel, resolve_model
from core.agent.summariser import model_summariser
from core.agent.turn import Turn, run_turn
from core.errors import (
    AgentSessionBudgetExceeded,
    DatabaseError,
    MessageNotFound,
    ModelProviderError,
    SlackAgentError,
)
from core.leases import before_side_effect
from core.messages import Message, message_text, new_message_id
from core.providers.base import TextDelta, ToolCall, ToolSpec
from core.providers.uimessages import (
    step_start_part,
    text_part,
    tool_call_part,
    tool_error_part,
    tool_output_part,
    ui_to_chat,
)
from core.records import Actor, AnyTail, StoredMessage
from core.sandbox.shell import Sandbox, SandboxLimits, ShellResult
from core.storage.approvals import COMPACTED, ApprovalRecord, Approvals
from core.storage.sessions import SessionStore
from core.storage.snapshots import SnapshotRef
from core.storage.usage import UsageLedger
from core.tools import McpTools
from core.tools.names import server_of

SHELL = ToolSpec(
    name="shell",
    description=(
        "Run a bash command in this conversation's own sandboxed shell. Files you create stay "
        "for later turns of this conversation (and follow it when it is rewound or forked). "
        "There is no network and no access to the host."
    ),
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string", "description": "the bash command"}},
        "required": ["command"],
        "additionalProperties": False,
    },
)

SYSTEM_PROMPT = (
    "You are an AI agent that a team talks to in a Slack thread. Be concise and concrete. "
    "You have a sandboxed bash shell with its own files; use it when running "
    "something beats guessing. Tools named mcp__<server>__<tool>, when offered, reach the "
    "team's own systems; a call that may change something there waits for a person's "
    "approval. Say plainly when you do not know."
)


COMPACTED_NOTICE = "The conversation was long, so it was compacted into a checkpoint first."
# A shared file the sandbox could not hold (``Sandbox.add_files``): the person sees it, and the
# model reads it beside the message whose context said where the file would be.
FILE_NOT_COPIED = (
    "{path} was not copied into the sandbox: it does not fit (the sandbox's limit per file or "
    "in total). Remove files to make room, or share a smaller one."
)


def _told(history: list[Message], notes: Sequence[str]) -> list[Message]:
    """``history`` with ``notes`` added to the context of its last user message (this turn's),
    for the model only: the stored message keeps what the surface wrote."""
    if not notes:
        return history
    for i in range(len(history) - 1, -1, -1):
        message = history[i]
        if message.get("role") != "user":
            continue
        metadata = dict(message.get("metadata") or {})
        context = metadata.get("context")
        metadata["context"] = "\n\n".join(
            [*([context] if isinstance(context, str) and context else []), *notes]
        )
        return [*history[:i], {**message, "metadata": metadata}, *history[i + 1 :]]
    return history


@dataclass(frozen=True)
class AgentConfig:
    max_tool_rounds: int = 8
    auto_compact_tokens: int = 100_000
    heartbeat_seconds: float = 15.0
    system_prompt: str = SYSTEM_PROMPT
    sandbox_limits: SandboxLimits | None = None


@dataclass(frozen=True)
class TextChunk:
    text: str


@dataclass(frozen=True)
class ToolStarted:
    command: str
    call_id: str = ""  # the model's id for the call (the UIMessage part's ``toolCallId``)


@dataclass(frozen=True)
class ToolFinished:
    command: str
    result: ShellResult
    call_id: str = ""


@dataclass(frozen=True)
class Notice:
    """Something the user should be told once (a provider fallback, an automatic compaction)."""

    text: str


@dataclass(frozen=True)
class TurnStarted:
    """The claim held and the user message is persisted (or, resuming, was already).
    ``answer_id``: the id the answer will be stored under (a client streaming it names it so
    its next turn's stale guard matches the transcript)."""

    user: StoredMessage | None
    answer_id: str = ""


@dataclass(frozen=True)
class ModelCalled:
    """A model request goes out (for the answer, or for an automatic compaction): the turn's
    own work before it (claim, history, sandbox) is done, and from here it mostly waits. A
    surface running many turns uses this and ``ModelDone`` to keep the turns' own work, which
    is CPU on its event loop, from crowding out everything else."""


@dataclass(frozen=True)
class ModelDone:
    """The model has written its answer (or failed); what follows is storing it."""


McpCallStarted = mcp_calls.McpCallStarted
McpCallFinished = mcp_calls.McpCallFinished

AgentEvent = (
    TurnStarted
    | ModelCalled
    | ModelDone
    | TextChunk
    | ToolStarted
    | ToolFinished
    | McpCallStarted
    | McpCallFinished
    | Notice
)
OnEvent = Callable[[AgentEvent], Awaitable[None]]


ApprovalRequest = mcp_calls.ApprovalRequest


@dataclass(frozen=True)
class TurnResult:
    user: StoredMessage | None
    answer: StoredMessage | None
    text: str
    error: SlackAgentError | None = None
    notices: tuple[str, ...] = ()
    compacted: bool = False
    trace_url: str | None = None  # TRACE_URL_TEMPLATE's link to this turn's trace
    approval: ApprovalRequest | None = None  # the turn ended waiting for this decision

    @property
    def interrupted(self) -> bool:
        return self.error is not None


def _tool_result(part: dict[str, Any]) -> tuple[str, bool]:
    """A tool part's result as a trace records it: its output (JSON) or its error text."""
    if part.get("state") == "output-error":
        return str(part.get("errorText", "")), True
    return json.dumps(part.get("output"), ensure_ascii=False), False


def estimate_tokens(history: Sequence[StoredMessage]) -> int:
    return sum(len(json.dumps(m.message, ensure_ascii=False)) for m in history) // 4


async def _ignore(_event: AgentEvent) -> None:
    return None


@dataclass
class _Answer:
    """The assistant message being built: one UIMessage for the whole turn, all its steps."""

    model: ResolvedModel
    parts: list[dict[str, Any]] = field(default_factory=list)
    id: str = field(default_factory=new_message_id)

    @property
    def text(self) -> str:
        return "".join(p["text"] for p in self.parts if p.get("type") == "text")

    def message(self, **metadata: Any) -> Message:
        meta = {"model": self.model.choice.name, "provider": self.model.choice.provider}
        return {
            "id": self.id,
            "role": "assistant",
            "parts": list(self.parts),
            "metadata": {**meta, **metadata},
        }


class Agent:
    """What a surface holds to run turns: the store, the providers and the configuration."""

    def __init__(
        self,
        store: SessionStore,
        providers: ProviderCache,
        config: AgentConfig | None = None,
        *,
        accounting: Accounting | None = None,
        tools: McpTools | None = None,
        approvals: Approvals | None = None,
    ) -> None:
        self.store = store
        self.providers = providers
        self.config = config or AgentConfig()
        # Usage is always recorded; budgets and traces when the runtime configures them.
        self.accounting = accounting or Accounting(
            UsageLedger(store.db, staleness_seconds=store.staleness_seconds)
        )
        self.tools = tools  # the MCP servers' tools, offered beside the shell
        # Where calls that need a person's decision are recorded; without it such a call is
        # refused as a tool result (it never runs unapproved either way).
        self.approvals = approvals

    async def run_turn(
        self,
        session_id: int,
        *,
        user_message: Message | None,
        last_message_id: str | AnyTail | None,
        on_event: OnEvent | None = None,
        files: Mapping[str, bytes] | None = None,
        attribution: Attribution | None = None,
        author: str | None = None,
    ) -> TurnResult:
        """One turn.

        ``user_message=None`` answers the user message that is already the tail, named by
        ``last_message_id``: a turn resumed after the process running it died; the stale guard
        makes sure nothing was added after it meanwhile. (The tail may also be an answer
        interrupted before its model said anything, right after that message: the model does
        not see an empty answer, so it answers the message.) ``files`` (path -> bytes) are put into
        the sandbox before the model runs, so they are part of this turn's snapshot (a rewind
        to before it removes them). ``attribution``: who pays (budgets, the usage ledger) and
        the surface (traces); a payer over a budget is refused at the claim
        (``AgentSessionBudgetExceeded``, nothing written, no model called). ``author``: the
        person who wrote the message answered (not the payer, not the owner: in a shared thread
        anyone may write); a call the model asks a person to approve records them as who asked.
        """
        account = self.accounting.turn(session_id, attribution)
        return await self._accounted(
            account,
            self._turn(
                account,
                session_id,
                user_message,
                last_message_id,
                on_event or _ignore,
                files,
                author,
            ),
        )

    @staticmethod
    async def _accounted(account: TurnAccount, turn: Awaitable[TurnResult]) -> TurnResult:
        """``turn`` inside its trace: the root span ends with the turn's outcome (or the
        error that ended it), and the result carries the trace's link."""
        text = ""
        outcome = "refused"
        failure: BaseException | None = None
        try:
            result = await turn
            text = result.text
            outcome = "answered" if result.error is None else result.error.code
            return dataclasses.replace(result, trace_url=account.trace_url)
        except BaseException as exc:
            failure, outcome = exc, str(getattr(exc, "code", type(exc).__name__))
            raise
        finally:
            account.ended(text, outcome=outcome, error=failure)

    async def _turn(
        self,
        account: TurnAccount,
        session_id: int,
        user_message: Message | None,
        last_message_id: str | AnyTail | None,
        emit: OnEvent,
        files: Mapping[str, bytes] | None,
        author: str | None,
    ) -> TurnResult:
        session = await self.store.get_session(session_id)
        model = await resolve_model(self.store.custom_providers, self.providers, session)
        notices: list[str] = []
        async with run_turn(
            self.store,
            session_id,
            user_message=user_message,
            last_message_id=last_message_id,
            model=model.choice,
            heartbeat_seconds=self.config.heartbeat_seconds,
            reservation=await account.reservation(user_message),
        ) as turn:
            tail = turn.lease.tail
            account.started(message_text(tail.message) if tail is not None else None)
            model = dataclasses.replace(
                model, provider=account.provider(model.provider, model.prices)
            )
            answer = _Answer(model)
            await emit(TurnStarted(turn.lease.tail, answer.id))
            if model.notice:
                notices.append(model.notice)
                await emit(Notice(model.notice))
            account.message_id = answer.id
            turn.partial = answer.message()
            sandbox = await Sandbox.open(
                await self.store.snapshots.load(session_id), self.config.sandbox_limits
            )
            refused = sandbox.add_files(files) if files else []
            for path in refused:
                notices.append(FILE_NOT_COPIED.format(path=path))
                await emit(Notice(notices[-1]))
            compacted = False

            async def work() -> ApprovalRequest | None:
                nonlocal compacted
                # Read once: the model is given what auto-compaction looked at, unless it
                # inserted a checkpoint.
                history = await turn.history()
                compacted = await self._auto_compact(turn, model, emit, account, history)
                if compacted:
                    notices.append(COMPACTED_NOTICE)
                    await emit(Notice(COMPACTED_NOTICE))
                    history = await turn.history()
                return await self._loop(
                    turn,
                    model,
                    sandbox,
                    answer,
                    emit,
                    account,
                    notes=notices[-len(refused) :] if refused else [],
                    stored=history,
                    requested_by=author,
                )

            stored, error, waiting = await self._answered(
                turn, sandbox, answer, account, emit, work(), {}
            )
        return TurnResult(
            user=turn.lease.tail,
            answer=stored,
            text=answer.text,
            error=error,
            notices=tuple(notices),
            compacted=compacted,
            approval=waiting,
        )

    async def carry_out(
        self,
        session_id: int,
        approval_id: str,
        *,
        on_event: OnEvent | None = None,
        attribution: Attribution | None = None,
        record: ApprovalRecord | None = None,
    ) -> TurnResult:
        """The turn after a person's decision: the approved call runs (once; a call a dead
        turn already sent is reported as such, never sent again), or the model is told it was
        declined; then the model continues. The usual claim with the stale guard at the
        message that asked (``AgentSessionStale`` if the conversation moved on), fencing and
        release; the decided part is rewritten in place, the continuation appended. It is a
        turn like any other for usage, budgets and traces (``attribution``: who decided).
        ``record``: the request as the caller just read it (not read again; what it says is
        checked again after the claim by ``start_running``'s condition and the stale guard)."""
        assert self.approvals is not None, "carrying out a decision needs the approvals store"
        account = self.accounting.turn(session_id, attribution)
        return await self._accounted(
            account,
            self._carry_out(account, session_id, approval_id, on_event or _ignore, record),
        )

    async def _carry_out(
        self,
        account: TurnAccount,
        session_id: int,
        approval_id: str,
        emit: OnEvent,
        record: ApprovalRecord | None,
    ) -> TurnResult:
        assert self.approvals is not None
        if record is None or record.id != approval_id:
            record = await self.approvals.get(approval_id)
        if record is None:
            raise MessageNotFound(f"no approval request {approval_id}")
        session = await self.store.get_session(session_id)
        model = await resolve_model(self.store.custom_providers, self.providers, session)
        async with run_turn(
            self.store,
            session_id,
            user_message=None,
            last_message_id=record.message_id,
            model=model.choice,
            heartbeat_seconds=self.config.heartbeat_seconds,
            reservation=await account.reservation(),
        ) as turn:
            account.started(None)
            model = dataclasses.replace(
                model, provider=account.provider(model.provider, model.prices)
            )
            answer = _Answer(model)
            await emit(TurnStarted(None, answer.id))
            asking = turn.lease.tail
            assert asking is not None, "a claim at a message has that message as its tail"
            call = ToolCall(record.tool_call_id, record.tool_name, record.arguments)
            with account.tool(call, server=record.server) as span:
                span.record_approval(
                    "approved" if record.approved else record.state, record.decided_by
                )
                decided, done = await mcp_calls.decided_message(
                    asking.message, record, self.approvals, self.tools, emit
                )
                content, is_error = _tool_result(done)
                span.record_result(content, is_error=is_error)
            await self.store.rewrite(turn.lease, decided)
            account.message_id = answer.id
            turn.partial = answer.message()
            sandbox = await Sandbox.open(
                await self.store.snapshots.load(session_id), self.config.sandbox_limits
            )
            stored, error, waiting = await self._answered(
                turn,
                sandbox,
                answer,
                account,
                emit,
                # The continuation still answers the message that asked: a further call it
                # asks for is that message's author's request, not the decider's.
                self._loop(
                    turn,
                    model,
                    sandbox,
                    answer,
                    emit,
                    account,
                    requested_by=record.requested_by,
                ),
                {"after_approval": approval_id},
            )
        await self.approvals.carried_out(approval_id)
        return TurnResult(user=None, answer=stored, text=answer.text, error=error, approval=waiting)

    async def _answered(
        self,
        turn: Turn,
        sandbox: Sandbox,
        answer: _Answer,
        account: TurnAccount,
        emit: OnEvent,
        work: Awaitable[ApprovalRequest | None],
        metadata: dict[str, Any],
    ) -> tuple[
        StoredMessage,
        ModelProviderError | AgentSessionBudgetExceeded | None,
        ApprovalRequest | None,
    ]:
        """``work`` (the model and its tools), then the answer stored, fenced, with its usage.
        A model error, or a budget that ran out during the turn (the request in flight
        finished, no other is made), ends the answer with what was written kept and the error
        said; a stop (a shutdown past its grace, a stop button, a lost lock) keeps the partial
        answer and what the commands already did to the sandbox."""
        error: ModelProviderError | AgentSessionBudgetExceeded | None = None
        waiting: ApprovalRequest | None = None
        try:
            waiting = await work
        except ModelProviderError as exc:
            error = exc
            turn.outcome = "model_error"
        except AgentSessionBudgetExceeded as exc:
            error = exc
            turn.outcome = "budget_exceeded"
        except asyncio.CancelledError:
            turn.partial = answer.message(**account.usage(), **account.trace())
            with contextlib.suppress(DatabaseError):  # maybe what stopped the turn
                turn.partial_snapshot = await self._snapshot(sandbox)
            raise
        await emit(ModelDone())
        if error is not None:
            metadata = {
                **metadata,
                "interrupted": True,
                "error": {"code": error.code, "message": str(error)},
            }
        if waiting is not None:
            turn.outcome = "awaiting_approval"
        snapshot = await self._snapshot(sandbox)
        (stored,) = await turn.finish(
            [answer.message(**metadata, **account.usage(), **account.trace())],
            snapshot=snapshot,
        )
        return stored, error, waiting

    async def _loop(
        self,
        turn: Turn,
        model: ResolvedModel,
        sandbox: Sandbox,
        answer: _Answer,
        emit: OnEvent,
        account: TurnAccount,
        *,
        notes: Sequence[str] = (),
        stored: Sequence[StoredMessage] | None = None,
        requested_by: str | None = None,
    ) -> ApprovalRequest | None:
        """The model's rounds; ``stored``: the transcript as this turn already read it (read
        here when not given); ``requested_by``: who a call waiting for approval was asked for."""
        if stored is None:
            stored = await turn.history()
        history = _told([m.message for m in stored], notes)
        if self.approvals is not None:
            # Requests still waiting when the conversation moves on are settled first.
            history = await mcp_calls.settle_waiting(turn, history, self.approvals)
        waiting: ApprovalRequest | None = None
        for round_ in range(self.config.max_tool_rounds + 1):
            tools = (
                [SHELL, *mcp_calls.offered(self.tools)]
                if round_ < self.config.max_tool_rounds
                else []
            )
            conversation = ui_to_chat(
                [*history, answer.message()] if answer.parts else history,
                system=self.config.system_prompt,
            )
            await account.before_request()
            answer.parts.append(step_start_part())
            await emit(ModelCalled())
            calls: list[ToolCall] = []
            text_index: int | None = None
            # Closed here, not when the event loop finalizes it: a turn stopped while its
            # surface shows a chunk (``emit``) ends its model request at once.
            before_side_effect()  # the lease is still safely this turn's (core.leases)
            stream = model.provider.stream(conversation, tools, model=model.choice.name)
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    if isinstance(event, TextDelta) and event.text:
                        if text_index is None:
                            answer.parts.append(text_part(""))
                            text_index = len(answer.parts) - 1
                        answer.parts[text_index]["text"] += event.text
                        turn.partial = answer.message()
                        await emit(TextChunk(event.text))
                    elif isinstance(event, ToolCall):
                        calls.append(event)
            if not calls:
                return None
            for call in calls:
                mcp = mcp_calls.is_mcp_call(call)
                with account.tool(call, server=server_of(call.name) if mcp else None) as span:
                    if mcp:
                        needed = mcp_calls.needs_approval(self.tools, call)
                        if needed is not None and self.approvals is not None:
                            part, request = await mcp_calls.ask(
                                self.approvals,
                                turn.session_id,
                                answer.id,
                                needed,
                                waiting,
                                requested_by,
                            )
                            waiting = waiting or request
                            span.record_approval("requested")
                        else:
                            part, _ = await mcp_calls.run(self.tools, call, emit)
                            span.record_approval("not_required")
                        answer.parts.append(part)
                    else:
                        await self._run_tool(call, sandbox, answer, emit)
                    content, is_error = _tool_result(answer.parts[-1])
                    span.record_result(content, is_error=is_error)
                turn.partial = answer.message()
            if waiting is not None:
                return waiting  # the turn ends here; a person's decision continues it
        return None

    @staticmethod
    async def _run_tool(call: ToolCall, sandbox: Sandbox, answer: _Answer, emit: OnEvent) -> None:
        command = call.arguments.get("command")
        if call.name != SHELL.name or not isinstance(command, str) or not command.strip():
            answer.parts.append(
                tool_error_part(call, f"unknown tool or missing command: {call.name}")
            )
            return
        answer.parts.append(tool_call_part(call))
        await emit(ToolStarted(command, call.id))
        before_side_effect()
        result = await sandbox.run(command)
        answer.parts[-1] = tool_output_part(
            call,
            {
                "stdout": result.stdout,
                "stderr": result.stderr,
                "exit_code": result.exit_code,
                "truncated": result.truncated,
            },
        )
        await emit(ToolFinished(command, result, call.id))

    async def _snapshot(self, sandbox: Sandbox) -> SnapshotRef | None:
        if not sandbox.dirty:
            return None
        captured = await sandbox.capture()
        return None if captured is None else await self.store.snapshots.store(captured)

    async def _auto_compact(
        self,
        turn: Turn,
        model: ResolvedModel,
        emit: OnEvent,
        account: TurnAccount,
        history: Sequence[StoredMessage],
    ) -> bool:
        limit = self.config.auto_compact_tokens
        if limit <= 0:
            return False
        earlier = history[:-1]  # everything but this turn's own user message
        if len(earlier) < 2 or earlier[-1].is_compaction_message:
            return False
        if estimate_tokens(history) <= limit:
            return False
        summarise = model_summariser(model.provider, model=model.choice.name)
        await emit(ModelCalled())
        with account.compaction() as span:
            checkpoint = await summarise(earlier, parse_checkpoint(earlier[0]), None)
            message = checkpoint_message(checkpoint)
            span.record_output(message_text(message))
        message["metadata"].update(account.compaction_usage())
        await self.store.insert_checkpoint_before_tail(turn.lease, message)
        await self._compacted(turn.session_id)
        return True

    async def _compacted(self, session_id: int) -> None:
        """A checkpoint moved the conversation on: a request still open behind it ends (the
        model no longer sees the message that asked, so no later turn would settle it)."""
        if self.approvals is not None:
            await self.approvals.end_open(session_id, COMPACTED)

    def summariser(self, model: ResolvedModel) -> Summariser:
        return model_summariser(model.provider, model=model.choice.name)

    async def compact(
        self,
        session_id: int,
        actor: Actor,
        *,
        focus: str | None = None,
        attribution: Attribution | None = None,
    ) -> StoredMessage:
        """Compaction on request (a shortcut, ``/compact``): the model writes the checkpoint.
        Its model request counts against the payer's budgets like a turn's, and is refused
        the same way when they are used up."""
        session = await self.store.get_session(session_id)
        model = await resolve_model(self.store.custom_providers, self.providers, session)
        account = self.accounting.turn(session_id, attribution)
        reservation = await account.reservation()
        account.started_compaction()
        model = dataclasses.replace(model, provider=account.provider(model.provider, model.prices))
        failure: BaseException | None = None
        try:
            stored = await compact(
                self.store,
                session_id,
                actor,
                self.summariser(model),
                focus=focus,
                heartbeat_seconds=self.config.heartbeat_seconds,
                reservation=reservation,
            )
            await self._compacted(session_id)
            return stored
        except BaseException as exc:
            failure = exc
            raise
        finally:
            account.ended("", outcome="compacted" if failure is None else "failed", error=failure)
