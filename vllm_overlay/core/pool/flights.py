"""Lookups in flight for a caller that never waits (a vLLM scheduler), one
home for both adapters' lookup caches: the 0.11.2 connector's
(``connectors/shared_pool/scheduler.py``: leading hits per request range)
and the 0.32 pool tier's (``integration/v0_32/pool_tier/lookups.py``:
per-key verdicts for upstream's ``lookup()``).

What they share is here: a question is a ``KVPool`` lookup ticket
(``core/pool/lookups.py``), asked without waiting (``ask``), read without
waiting (``poll``, ``settle``), with a deadline fixed when it is asked:
``KVPool.lookup_wait_s()`` from ``since`` (the ask, or an earlier ask for
the same thing that this one replaces, so re-asking never extends the
wait).  A ticket answered in time gives a bool per key; one not answered
by its deadline is abandoned through the pool (``KVPool.abandon``: the
pool counts itself slow and pauses reads) and is a miss (``None``); one
the caller no longer wants is dropped (``drop``: the lookup thread skips
it, and the pool is not blamed).

What they remember differs, because each release asks a different
question, and stays in each adapter:

- 0.11.2 asks ``get_num_new_matched_tokens`` for a request: the answer is
  a count of leading blocks, held for every rank, over a range of the
  request's chain; it is kept per request for ``ANSWER_TTL_S`` (the
  scheduler asks again every step while the request waits) and forgotten
  when the request finishes or a load of it fails.  A refused value's block
  is not asked for again for ``REFUSED_TTL_S``.
- 0.32 asks ``lookup(key, req_context)`` for each chunk key: a verdict per
  key, shared by every request that asked for it, kept while one of them
  lives; a miss older than a request is asked again for it, and a key
  whose load failed is a miss for the requests holding it.

Neither a time-to-live nor a per-key verdict would fit the other without
changing what vLLM is told, so the memories are the adapters' own."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(eq=False, slots=True)
class Flight:
    """One question in flight: the pool's ticket, what the caller asked
    (``about``: its own record, e.g. the keys or a range), since when the
    caller has waited, and when it stops waiting."""

    ticket: object
    about: object
    since: float
    deadline: float


class LookupFlights:
    """The lookups a caller has in flight (``pool``: a ``KVPool``).  Not
    thread-safe: one caller thread (the scheduler's)."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self._flights: dict[Flight, None] = {}  # (ordered, by identity)

    def ask(
        self, keys: list[bytes], about=None, now: float | None = None, since=None
    ) -> Flight:
        """Submit a lookup of ``keys``; returns at once.  ``since``: when
        the caller started waiting for this answer (an earlier ask it
        replaces); default now."""
        if now is None:
            now = time.monotonic()
        ticket = self._pool.submit_lookup(keys)
        since = now if since is None else since
        flight = Flight(ticket, about, since, since + self._pool.lookup_wait_s())
        self._flights[flight] = None
        return flight

    def _outcome(self, flight: Flight, now: float) -> tuple[bool, list | None]:
        ticket = flight.ticket
        if ticket.done:
            return True, ticket.present
        if now >= flight.deadline:
            self._pool.abandon(ticket)  # too slow: the pool pauses reads
            return True, None
        return False, None

    def poll(self, flight: Flight, now: float) -> tuple[bool, list | None]:
        """(settled, present): settled once answered, or late (then
        ``present`` is None: a miss); a settled flight is no longer held."""
        settled, present = self._outcome(flight, now)
        if settled:
            self._flights.pop(flight, None)
        return settled, present

    def settle(self, now: float) -> list[tuple[Flight, list | None]]:
        """Every flight answered or late, with its ``present`` (None: the
        pool could not say in time); the others stay in flight."""
        out = []
        for flight in list(self._flights):
            settled, present = self._outcome(flight, now)
            if settled:
                del self._flights[flight]
                out.append((flight, present))
        return out

    def drop(self, flight: Flight) -> None:
        """The caller no longer wants this answer (its request finished, or
        it asks about something else now): the lookup thread skips it if it
        has not started, and the pool is not counted slow."""
        flight.ticket.abandoned = True
        self._flights.pop(flight, None)

    def pending(self) -> bool:
        """Any lookup in flight."""
        return bool(self._flights)

    def __len__(self) -> int:
        return len(self._flights)
