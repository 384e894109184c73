"""Which blocks the pool holds, asked without waiting: the tier's answer
to ``lookup`` is HIT, MISS or "ask again next step" (RETRY).

A key first asked in a step joins that step's batch; at the end of the
step (``flush``) each request's new keys go to the pool's lookup thread
as one ticket (tickets queued together share one round trip).  A later
``lookup`` reads the ticket: answered, it settles every key of it; not
answered within ``KVPool.lookup_wait_s()`` of its submission, the ticket
is abandoned (the pool counts the pool slow and pauses reads) and its
keys are misses.  So no request waits on the network longer than that
deadline, and a paused pool answers "miss" at once.

A verdict is kept while a request that asked for it lives (vLLM asks
again every step until no key is pending).  A miss older than a request
is asked again for it: another node may have stored the block since.  A
key whose load failed is a miss from then on for the requests holding
it (so vLLM does not promote it again and again, vllm#49176).

The tickets, their deadlines and the late-ticket rule are the pool's
``LookupFlights`` (``core/pool/flights.py``, shared with the 0.11.2
connector); what is remembered (a verdict per key, held by requests) is
this release's own (``core/pool/flights.py`` says why)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from vllm_overlay.core.pool.flights import LookupFlights


@dataclasses.dataclass(slots=True)
class _Verdict:
    present: bool | None = None  # None: not answered yet
    at: float = 0.0  # when it was answered
    flight: object = None  # its LookupFlights flight while in flight
    requests: set = dataclasses.field(default_factory=set)


class LookupVerdicts:
    """The tier's verdict per block key (held, not held, asked), kept for
    the requests that asked; the questions go to the ``KVPool``'s lookup
    part (``core/pool/lookups.py``: tickets, one thread) through
    ``LookupFlights``.  ``pool``: a ``KVPool``; ``name(key)`` its pool
    key for a block key."""

    def __init__(self, pool, name: Callable[[bytes], bytes]) -> None:
        self._name = name
        self._verdicts: dict[bytes, _Verdict] = {}
        self._request_keys: dict[str, set[bytes]] = {}
        self._request_start: dict[str, float] = {}
        self._batch: dict[str, list[bytes]] = {}  # this step's new keys
        self._flights = LookupFlights(pool)

    def lookup(self, key: bytes, req_id: str) -> bool | None:
        """True (held), False (not held, or the pool cannot say in time)
        or None (asked; ask again next step).  Never waits."""
        now = time.monotonic()
        start = self._request_start.setdefault(req_id, now)
        verdict = self._verdicts.get(key)
        if verdict is not None and verdict.flight is not None:
            self._settle(now)  # in flight: answered meanwhile?
        if verdict is None:
            verdict = self._verdicts[key] = _Verdict()
            self._queue(key, req_id)
        elif verdict.present is False and verdict.at < start:
            verdict.present = None  # a miss from before this request: ask again
            self._queue(key, req_id)
        verdict.requests.add(req_id)
        self._request_keys.setdefault(req_id, set()).add(key)
        return verdict.present

    def _queue(self, key: bytes, req_id: str) -> None:
        self._batch.setdefault(req_id, []).append(key)

    def flush(self) -> None:
        """End of a step: send this step's new keys, one ticket a request."""
        now = time.monotonic()
        self._settle(now)
        batch, self._batch = self._batch, {}
        for keys in batch.values():
            flight = self._flights.ask([self._name(k) for k in keys], keys, now)
            for key in keys:
                self._verdicts[key].flight = flight
        self._settle(now)

    def _settle(self, now: float) -> None:
        """Apply the answered tickets; the ones past their deadline are
        abandoned (``LookupFlights``) and their keys are misses."""
        for flight, present in self._flights.settle(now):
            for i, key in enumerate(flight.about):
                verdict = self._verdicts.get(key)
                if verdict is None or verdict.flight is not flight:
                    continue  # forgotten, or asked again since
                if not verdict.requests:
                    del self._verdicts[key]
                    continue
                verdict.present = bool(present[i]) if present else False
                verdict.at, verdict.flight = now, None

    def mark_missing(self, keys) -> None:
        """Keys whose load failed: misses for the requests holding them."""
        now = time.monotonic()
        for key in keys:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                verdict.present, verdict.at, verdict.flight = False, now, None

    def forget(self, req_id: str) -> None:
        """A request finished: its verdicts go once no request holds them
        (one in flight goes when its answer comes; one queued and still
        wanted is sent for another request)."""
        self._request_start.pop(req_id, None)
        for key in self._request_keys.pop(req_id, ()):
            verdict = self._verdicts.get(key)
            if verdict is None:
                continue
            verdict.requests.discard(req_id)
            if not verdict.requests and verdict.present is not None:
                del self._verdicts[key]
        for key in self._batch.pop(req_id, ()):
            verdict = self._verdicts.get(key)
            if verdict is not None and verdict.requests:
                self._queue(key, next(iter(verdict.requests)))
            elif verdict is not None:
                del self._verdicts[key]

    def clear(self) -> None:
        """The namespace changed: every verdict is void (answers still in
        flight are dropped when they come)."""
        self._verdicts.clear()
        self._batch.clear()
        self._request_keys = {req: set() for req in self._request_keys}

    def pending(self) -> bool:
        """Keys queued or in flight (the engine must keep stepping)."""
        return bool(self._batch) or self._flights.pending()
