"""The approval rounds every replica runs: shown requests kept in step, left-behind decisions
carried out. In the core, so any surface (or a replica with none that shows cards) gets both.

Every ``SESSION_POLL_SECONDS``:

- **Shown requests kept in step.** A request a surface showed somewhere (a Slack card:
  ``card_ref``) whose state moved on anywhere (decided in the terminal or the web page, carried
  out, expired, superseded, rewound) is handed to the surfaces' ``show``; the surface updates
  its card. ``card_shown`` is conditional, so one replica updates each change.
- **Decisions left behind.** A decision whose deciding process died before carrying it out
  (the terminal killed right after ``/approve``, a web request cut with its replica) is found
  by ``ApprovalDesk.left_behind``: decided longer than ``TURN_LOCK_STALENESS_SECONDS`` ago, not
  carried out, its session free. A surface whose conversation it is may take it (Slack records
  it as a click would, so its continuation streams into the thread); any other is carried out
  here, quietly, as the usual turn (claim, stale guard, fencing, ``start_running``): the call
  goes out at most once, whoever picks it up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Literal, Protocol

from core.agent.accounting import Payer
from core.conversation.conversations import Conversations
from core.conversation.places import team_of_person
from core.settings import Settings
from core.storage.approvals import ApprovalRecord

log = logging.getLogger(__name__)

Taking = Literal["taken", "later", "not_mine"]


class ShowsApprovals(Protocol):
    """A surface that shows waiting requests where people decide them (Slack: a card)."""

    async def show(self, record: ApprovalRecord) -> bool:
        """Bring what it showed of ``record`` up to the record's state (False: not its own,
        or another replica did it)."""
        ...

    async def take(self, record: ApprovalRecord) -> Taking:
        """Carry out a left-behind decision its own way (``taken``), say it is its own but
        cannot be now (``later``: the next round asks again), or leave it to the rounds
        (``not_mine``)."""
        ...


class ApprovalRounds:
    """One per process: the rounds of the module's doc, over ``conversations``' approvals."""

    def __init__(
        self,
        settings: Settings,
        conversations: Conversations,
        surfaces: Sequence[ShowsApprovals] = (),
    ) -> None:
        self.settings = settings
        self.conversations = conversations
        self.surfaces = list(surfaces)
        self._task: asyncio.Task[None] | None = None
        # Left-behind decisions a surface took and that are not carried out yet (taking them
        # again would be a no-op write each round), and those being carried out here.
        self._taken: set[str] = set()
        self._carrying: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        if self._task is None and self.conversations.approvals is not None:
            self._task = asyncio.create_task(self._rounds())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._carrying.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def carried_out(self) -> None:
        """Wait for the decisions this process is carrying out (they run beside the rounds)."""
        await asyncio.gather(*self._carrying.values(), return_exceptions=True)

    async def _rounds(self) -> None:
        while True:
            await asyncio.sleep(self.settings.session_poll_seconds)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a database blip: the next round tries again
                log.warning("approval rounds: %s", exc)

    async def round(self) -> None:
        """One round: shown requests, then decisions left behind."""
        desk = self.conversations.approvals
        if desk is None:
            return
        for record in await desk.cards_behind():
            for surface in self.surfaces:
                if await surface.show(record):
                    break
        found = await desk.left_behind(self.settings.turn_lock_staleness_seconds)
        # A decision taken leaves the list once carried out: forget it then, so the set holds
        # only what is still on its way.
        self._taken &= {record.id for record in found}
        for record in found:
            if record.id in self._taken or record.id in self._carrying:
                continue
            taking = await self._taking(record)
            if taking == "taken":
                self._taken.add(record.id)
            if taking != "not_mine":
                continue
            log.info("carrying out decision %s, left behind by its process", record.id)
            self._carrying[record.id] = asyncio.create_task(self._carry_out(record))

    async def _taking(self, record: ApprovalRecord) -> Taking:
        for surface in self.surfaces:
            taking = await surface.take(record)
            if taking != "not_mine":
                return taking
        return "not_mine"

    async def _carry_out(self, record: ApprovalRecord) -> None:
        try:
            await self.conversations.carry_out_left_behind(
                record,
                payer=(
                    Payer(record.decided_by, team_of_person(record.decided_by))
                    if record.decided_by
                    else None
                ),
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # its lock lapses; the next round (here or elsewhere) tries again
            log.exception("decision %s left behind: carrying it out failed", record.id)
        finally:
            self._carrying.pop(record.id, None)
