"""The checkpoint's shape: its sections, how it is rendered, how it is stored.

Kept apart from ``core.agent.compaction`` (the operation, which needs the store and the turn lock)
so the model providers, the offline stand-in included, can know the shape without the store.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape as xml_escape
from xml.sax.saxutils import unescape as xml_unescape

from core.messages import Message, user_message
from core.records import StoredMessage

SECTIONS: tuple[str, ...] = (
    "objectives",
    "constraints",
    "decisions",
    "completed_work",
    "active_work",
    "blockers",
    "next_steps",
    "important_details",
)


@dataclass(frozen=True)
class Checkpoint:
    sections: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown checkpoint section(s): {', '.join(sorted(unknown))}")

    def items(self, section: str) -> list[str]:
        return list(self.sections.get(section, []))


CHECKPOINT_REQUEST = "Write the checkpoint now."


def checkpoint_request(focus: str | None, previous: Checkpoint | None) -> str:
    """The message that asks a model for a checkpoint, after the conversation it summarises.

    It is an instruction, never part of the conversation: a summariser (the offline stand-in
    included) recognises it with ``is_checkpoint_request`` and leaves it out of the sections.
    """
    ask = CHECKPOINT_REQUEST
    if focus:
        ask += f" Focus on: {focus}"
    if previous is not None:
        ask += "\nThe earlier checkpoint to update:\n" + render_checkpoint(previous)
    return ask


def is_checkpoint_request(text: str) -> bool:
    return text.startswith(CHECKPOINT_REQUEST)


Summariser = Callable[
    [Sequence[StoredMessage], Checkpoint | None, str | None], Awaitable[Checkpoint]
]


def render_checkpoint(checkpoint: Checkpoint) -> str:
    """The text the model reads in place of the history the checkpoint replaced.

    Items are escaped as XML text (``&``, ``<``, ``>``) and their later lines indented, so no
    item can close a section or start an item of its own: an item that quotes
    ``</objectives>`` stays one item for the next compaction (``parse_checkpoint_text``).
    """
    lines = ["<checkpoint>"]
    for section in SECTIONS:
        lines.append(f"<{section}>")
        lines.extend(f"- {_item_text(item)}" for item in checkpoint.items(section))
        lines.append(f"</{section}>")
    lines.append("</checkpoint>")
    return "\n".join(lines)


def _item_text(item: str) -> str:
    return xml_escape(item).replace("\n", "\n  ")


def parse_checkpoint_text(text: str) -> dict[str, list[str]] | None:
    """The sections of a text ``render_checkpoint`` wrote (None if it is not one)."""
    if not text.startswith("<checkpoint>"):
        return None
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        tag = line.strip()
        if current and line.startswith("- "):
            sections.setdefault(current, []).append(line.removeprefix("- "))
        elif current and line.startswith("  ") and sections.get(current):
            sections[current][-1] += "\n" + line.removeprefix("  ")
        elif tag.startswith("<") and tag.endswith(">"):
            name = tag.strip("</>")
            current = name if not tag.startswith("</") and name in SECTIONS else None
    return {name: [xml_unescape(item) for item in items] for name, items in sections.items()}


def checkpoint_message(checkpoint: Checkpoint, *, focus: str | None = None) -> Message:
    meta: dict[str, Any] = {"compaction": {"sections": checkpoint.sections, "focus": focus}}
    return user_message(render_checkpoint(checkpoint), **meta)


def parse_checkpoint(message: StoredMessage) -> Checkpoint | None:
    if not message.is_compaction_message:
        return None
    sections = message.message.get("metadata", {}).get("compaction", {}).get("sections", {})
    return Checkpoint({k: list(v) for k, v in sections.items() if k in SECTIONS})
