"""The ``offline`` model: a deterministic stand-in, so the demo and tests run with no key.

It is not a language model and says so: every reply starts with ``OFFLINE_LABEL``. What it does
is just enough to drive the whole agent through a turn:

- a user message starting with ``$ `` becomes a call of the ``shell`` tool with that command,
  and once the result comes back, a reply saying what ran and how it ended (``_result_summary``);
- a call forced to ``write_checkpoint`` (compaction) gets list-valued sections built from the
  conversation by fixed rules (``checkpoint_arguments``), carrying an earlier checkpoint forward;
- a user message starting with the name of an offered MCP tool (``mcp__<server>__<tool>``)
  followed by a JSON object becomes a call of that tool with those arguments (``mcp__notes__add_note
  {"title": "plan", "text": "ship it"}``), and once the result (or a refusal) comes back, a reply
  saying how it ended, as for a command;
- anything else is echoed back.

The same conversation always gets the same reply, tool-call ids included, and the reply is
streamed word by word so callers exercise their streaming path. Its usage is an estimate
(``core.providers.estimate``), marked so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from core.checkpoint import SECTIONS, is_checkpoint_request, parse_checkpoint_text
from core.errors import ModelProviderRejected
from core.messages import shorten
from core.providers.base import (
    AssistantMessage,
    ChatMessage,
    EventStream,
    Finish,
    SystemMessage,
    TextDelta,
    ToolCall,
    ToolResult,
    ToolSpec,
    UserMessage,
    check_tool_choice,
)
from core.providers.estimate import estimate_usage
from core.providers.uimessages import person_words

OFFLINE_LABEL = "[offline stand-in]"
OFFLINE_MODEL = "offline-stand-in"
SHELL_TOOL = "shell"
CHECKPOINT_TOOL = "write_checkpoint"
COMMAND_PREFIX = "$ "
MCP_CALL = re.compile(r"\s*(mcp__[A-Za-z0-9_-]+)(?:\s+(.*))?\Z", re.DOTALL)
CHECKPOINT_SECTIONS = SECTIONS  # the checkpoint's sections, in rendering order

_CONSTRAINT_WORDS = re.compile(r"\b(must|never|always|do not|don't|only)\b", re.IGNORECASE)


def _command(text: str) -> str | None:
    stripped = text.lstrip()
    if stripped.startswith(COMMAND_PREFIX):
        return stripped.removeprefix(COMMAND_PREFIX).strip() or None
    return None


def _calls_by_id(messages: Sequence[ChatMessage]) -> dict[str, ToolCall]:
    return {
        call.id: call
        for message in messages
        if isinstance(message, AssistantMessage)
        for call in message.tool_calls
    }


def _mcp_call(text: str, tools: Sequence[ToolSpec]) -> tuple[str, dict[str, object]] | str | None:
    """``(tool, arguments)`` for a message naming an offered MCP tool, a reason it cannot be
    called (unknown tool, arguments that are not a JSON object), or None (not such a message)."""
    match = MCP_CALL.match(text)
    if match is None:
        return None
    name, raw = match.group(1), (match.group(2) or "").strip()
    if not any(tool.name == name for tool in tools):
        return f"I was not offered a tool named `{name}`."
    try:
        arguments = json.loads(raw) if raw else {}
    except ValueError:
        return f"The arguments for `{name}` are not JSON."
    if not isinstance(arguments, dict):
        return f"The arguments for `{name}` must be a JSON object."
    return name, arguments


def _shown_command(call: ToolCall | None) -> str:
    if call is not None and call.name != SHELL_TOOL:
        return f"{call.name} {json.dumps(call.arguments, ensure_ascii=False, sort_keys=True)}"
    command = call.arguments.get("command") if call else None
    return str(command) if command else "the command"


def _output_text(content: str) -> str:
    """What a person would read of a shell result, whether the tool sent text or JSON."""
    try:
        value = json.loads(content)
    except ValueError:
        return content
    if not isinstance(value, dict) or not {"stdout", "stderr"} & value.keys():
        return content
    text = "".join(str(value.get(key) or "") for key in ("stdout", "stderr"))
    code = value.get("exit_code", value.get("exitCode"))
    if isinstance(code, int) and code != 0:
        text += f"\n(exit code {code})"
    return text


def _first_line(content: str) -> str:
    lines = [line for line in _output_text(content).splitlines() if line.strip()]
    return shorten(lines[0], 120) if lines else "no output"


def _lines(count: int) -> str:
    return "no output" if count == 0 else f"{count} line{'s' if count != 1 else ''} of output"


def _how_it_ended(result: ToolResult) -> str:
    """A short reference to a result: its exit status and how many lines it printed."""
    try:
        value = json.loads(result.content)
    except ValueError:
        value = None
    if isinstance(value, dict) and {"stdout", "stderr"} & value.keys():
        body = "".join(str(value.get(key) or "") for key in ("stdout", "stderr"))
        said = [_lines(len(body.rstrip("\n").splitlines()))]
        code = value.get("exit_code", value.get("exitCode"))
        if isinstance(code, int):
            said.insert(0, f"exit status {code}")
        if value.get("truncated"):
            said.append("cut short")
        return ", ".join(said)
    if isinstance(value, dict) and isinstance(value.get("text"), str):  # an MCP tool's output
        return _lines(len(str(value["text"]).rstrip("\n").splitlines()))
    return _lines(len(result.content.rstrip("\n").splitlines()))


def _result_summary(result: ToolResult, call: ToolCall | None) -> str:
    """What the stand-in says once a tool's result is back: what it ran and how it ended, never
    the output itself.

    Every surface already shows a call's output where the call is: the terminal prints the
    command and its output, Slack's task card ends with it, the web page shows the tool part. A
    reply quoting it again made each scene print the same output twice (issue 35); a real model,
    too, says what it did and what came of it rather than pasting back what the person just saw.
    So a result is referred to by its exit status and line count (``exit status 0, 2 lines of
    output``). A result that is an error is not output the person saw but why the call did not
    run or failed (a refusal, an interruption): its first line is the reason, and it is said.
    """
    command = _shown_command(call)
    if result.is_error:
        return f"`{command}` failed: {_first_line(result.content).rstrip('.')}."
    verb = "answered" if call is not None and call.name != SHELL_TOOL else "ran in the sandbox"
    return f"`{command}` {verb}: {_how_it_ended(result)}."


def _parse_checkpoint(text: str) -> dict[str, list[str]] | None:
    """Sections of a checkpoint as ``core.checkpoint.render_checkpoint`` writes them."""
    return parse_checkpoint_text(text)


def checkpoint_arguments(messages: Sequence[ChatMessage]) -> dict[str, list[str]]:
    """A checkpoint by fixed rules: an earlier checkpoint's items first, then what came after.

    objectives: the first request; constraints: requests saying must/never/always/only/do not;
    completed_work and blockers: each shell result; active_work: an unanswered last request;
    next_steps: continue from the last request; important_details: the other requests verbatim.
    The message asking for the checkpoint (``core.checkpoint.checkpoint_request``) is an
    instruction, not part of the conversation: it is left out, so it is never the work.
    """
    sections: dict[str, list[str]] = {name: [] for name in CHECKPOINT_SECTIONS}
    messages = [
        m for m in messages if not (isinstance(m, UserMessage) and is_checkpoint_request(m.text))
    ]
    calls = _calls_by_id(messages)
    requests: list[str] = []
    for message in messages:
        if isinstance(message, UserMessage):
            previous = _parse_checkpoint(message.text)
            if previous is not None:
                for name, items in previous.items():
                    sections[name].extend(items)
            elif _command(message.text) is None:
                requests.append(shorten(message.text, 300))
        elif isinstance(message, ToolResult):
            call = calls.get(message.tool_call_id)
            command = _shown_command(call)
            if message.is_error:
                sections["blockers"].append(f"`{command}` failed: {_first_line(message.content)}")
            else:
                sections["completed_work"].append(
                    f"ran `{command}`: {_first_line(message.content)}"
                )
    if requests:
        sections["objectives"].append(requests[0])
        sections["important_details"].extend(requests[1:])
        sections["constraints"].extend(r for r in requests if _CONSTRAINT_WORDS.search(r))
        sections["next_steps"].append(f"Continue from the last request: {requests[-1]}")
    last = next((m for m in reversed(messages) if not isinstance(m, SystemMessage)), None)
    if isinstance(last, UserMessage) and _parse_checkpoint(last.text) is None:
        sections["active_work"].append(shorten(last.text, 300))
    return {name: list(dict.fromkeys(items)) for name, items in sections.items()}


def respond(
    messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], tool_choice: str | None = None
) -> AssistantMessage:
    """The stand-in's whole answer to a conversation: a pure function of its inputs."""
    call_id = f"offline_call_{len(_calls_by_id(messages)) + 1}"
    if tool_choice == CHECKPOINT_TOOL:
        return AssistantMessage(
            tool_calls=(ToolCall(call_id, CHECKPOINT_TOOL, checkpoint_arguments(messages)),)
        )
    if tool_choice is not None:
        raise ModelProviderRejected(
            f"offline: the stand-in cannot be made to call {tool_choice!r}", provider="offline"
        )
    conversation = [m for m in messages if not isinstance(m, SystemMessage)]
    results: list[ToolResult] = []
    for message in reversed(conversation):
        if not isinstance(message, ToolResult):
            break
        results.insert(0, message)
    if results:
        calls = _calls_by_id(messages)
        summaries = [_result_summary(r, calls.get(r.tool_call_id)) for r in results]
        return AssistantMessage(f"{OFFLINE_LABEL} " + "\n\n".join(summaries))
    last = conversation[-1] if conversation else None
    if not isinstance(last, UserMessage):
        return AssistantMessage(f"{OFFLINE_LABEL} There is no message for me to answer.")
    words = person_words(last.text)
    mcp = _mcp_call(words, tools)
    if isinstance(mcp, tuple):
        return AssistantMessage(tool_calls=(ToolCall(call_id, mcp[0], mcp[1]),))
    if isinstance(mcp, str):
        return AssistantMessage(f"{OFFLINE_LABEL} {mcp}")
    command = _command(words)
    if command is not None and any(tool.name == SHELL_TOOL for tool in tools):
        return AssistantMessage(tool_calls=(ToolCall(call_id, SHELL_TOOL, {"command": command}),))
    if command is not None:
        return AssistantMessage(
            f"{OFFLINE_LABEL} I would run `{command}`, but I was given no shell tool."
        )
    return AssistantMessage(
        f'{OFFLINE_LABEL} You said: "{shorten(words, 300)}". I am a deterministic local '
        f'stand-in, not a language model; start a message with "{COMMAND_PREFIX}" to run a '
        "shell command in the sandbox."
    )


class OfflineProvider:
    def __init__(self, *, name: str = "offline", default_model: str = OFFLINE_MODEL) -> None:
        self.name = name
        self.default_model = default_model

    async def aclose(self) -> None:
        return None

    async def stream(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (),
        *,
        tool_choice: str | None = None,
        model: str | None = None,
    ) -> EventStream:
        check_tool_choice(tools, tool_choice)
        reply = respond(messages, tools, tool_choice)
        for word in re.findall(r"\s*\S+\s*", reply.text):
            yield TextDelta(word)
        for call in reply.tool_calls:
            yield call
        yield estimate_usage(messages, tools, reply)  # no tokenizer here: marked estimated
        yield Finish("tool_calls" if reply.tool_calls else "stop")
