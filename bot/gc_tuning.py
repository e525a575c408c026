"""Keeping full garbage collections out of the way of acknowledgements (``serve`` calls it)."""

from __future__ import annotations

import gc

# Collections of the middle generation between two full collections (CPython's default: 10).
FULL_COLLECTION_AFTER = 100


def tune_garbage_collection() -> None:
    """A full collection walks every tracked object with the event loop stopped, and with
    hundreds of turns running it took long enough to be the acknowledgements' worst case
    (docs/benchmarks.md: what held PostgreSQL's 500-turn p99). Two changes, both kept:

    - what start-up made (modules, the app, engines, clients: all alive as long as the
      process) is frozen out of every later collection, which makes each full collection
      about half as long. ``serve`` calls this before its worker and listener start: the
      collection stops every thread of the process, and once messages were being
      acknowledged and leased that pause crossed short staleness windows on loaded machines.
      (What the intake's thread makes after it, an engine and an app, stays unfrozen: little.)
    - a full collection comes after ``FULL_COLLECTION_AFTER`` collections of the middle
      generation instead of 10, so a replica taking on hundreds of turns is not walked again
      at every quarter of growth. Garbage in cycles waits longer for its collection: the
      turns' own, a few dozen objects a turn, is collected when a full collection comes.
    """
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_AFTER)
