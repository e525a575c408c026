"""Checkpoints written by the model: a forced ``write_checkpoint`` tool call.

Forcing a tool call gives structured output on every provider we speak, including the offline
stand-in: the arguments are the sections, each a list of strings. An earlier checkpoint is
handed to the model as the start of the history and named in the instructions, so the new one
updates it rather than ignoring what it already summarised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.checkpoint import SECTIONS, Checkpoint, Summariser, checkpoint_request
from core.errors import ModelProviderBadResponse
from core.providers.base import ModelProvider, ToolCall, ToolSpec, UserMessage
from core.providers.uimessages import ui_to_chat
from core.records import StoredMessage

CHECKPOINT_TOOL = "write_checkpoint"

_INSTRUCTIONS = """You are compacting a long agent conversation into a checkpoint that replaces it.
Call write_checkpoint once. Each section is a list of short, self-contained items. Preserve exact
identifiers, file paths, commands, numbers, names and decisions verbatim; drop pleasantries.
If the conversation starts with an earlier <checkpoint>, update it: keep what still holds, move
finished items to completed_work, and add what happened since."""

WRITE_CHECKPOINT_TOOL = ToolSpec(
    name=CHECKPOINT_TOOL,
    description="Record the structured checkpoint of the conversation so far.",
    parameters={
        "type": "object",
        "properties": {
            section: {"type": "array", "items": {"type": "string"}} for section in SECTIONS
        },
        "required": list(SECTIONS),
        "additionalProperties": False,
    },
)


def _sections(call: ToolCall) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    for section in SECTIONS:
        value: Any = call.arguments.get(section, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ModelProviderBadResponse(
                f"write_checkpoint: section {section} is not a list", provider="checkpoint"
            )
        sections[section] = [str(item) for item in value if str(item).strip()]
    return sections


def model_summariser(provider: ModelProvider, *, model: str | None = None) -> Summariser:
    async def summarise(
        history: Sequence[StoredMessage], previous: Checkpoint | None, focus: str | None
    ) -> Checkpoint:
        conversation = ui_to_chat([m.message for m in history], system=_INSTRUCTIONS)
        conversation.append(UserMessage(checkpoint_request(focus, previous)))
        call: ToolCall | None = None
        async for event in provider.stream(
            conversation, [WRITE_CHECKPOINT_TOOL], tool_choice=CHECKPOINT_TOOL, model=model
        ):
            if isinstance(event, ToolCall) and event.name == CHECKPOINT_TOOL:
                call = event
        if call is None:
            raise ModelProviderBadResponse(
                "the model did not write a checkpoint", provider=provider.name
            )
        return Checkpoint(_sections(call))

    return summarise
