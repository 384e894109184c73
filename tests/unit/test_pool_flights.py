"""``LookupFlights`` (core/pool/flights.py), the lookups in flight that
both adapters' lookup caches share (the 0.11.2 connector's scheduler, the
0.32 pool tier's ``LookupVerdicts``), on a real ``KVPool`` and a real
server: an answer in time, a late ticket (abandoned through the pool,
which pauses reads; a miss), a dropped one (not blamed on the pool), and a
re-ask that keeps the first ask's deadline.  No vLLM."""

from __future__ import annotations

import pathlib
import sys
import time

import pytest
import redis

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from support.redis_server import redis_server  # noqa: E402
from unit.test_pool_liveness import _pool  # noqa: E402

from vllm_overlay.core.pool.flights import LookupFlights  # noqa: E402

DEADLINE_S = 10.0  # generous: a loaded 2-core machine


def _settled(flights, flight):
    deadline = time.monotonic() + DEADLINE_S
    while True:
        settled, present = flights.poll(flight, time.monotonic())
        if settled:
            return present
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_an_answer_in_time_gives_a_bool_per_key():
    with redis_server() as server:
        pool = _pool(server.url, io_threads=False, lookup_wait_s=5.0)
        try:
            redis.Redis(port=server.port).set(b"k1", b"v")
            flights = LookupFlights(pool)
            flight = flights.ask([b"k1", b"k2", b"k1"], about="mine")
            assert flight.about == "mine" and flights.pending()
            assert _settled(flights, flight) == [True, False, True]
            assert not flights.pending()
            assert pool.cumulative()["lookup_timeouts"] == 0
            assert pool.state()["read"] == "open"
        finally:
            pool.close()


def test_a_late_ticket_is_a_miss_and_the_pool_pauses_reads():
    with redis_server() as server:
        pool = _pool(server.url, io_threads=False)  # lookup_wait_s 0.1
        try:
            flights = LookupFlights(pool)
            server.pause()  # nothing answers
            flight = flights.ask([b"k1"], about=("a", 0))
            now = time.monotonic()
            assert flights.poll(flight, now) == (False, None)  # never waits
            assert flights.settle(now) == []
            assert flight.deadline == pytest.approx(flight.since + 0.1)
            late = flight.deadline + 0.001
            assert flights.settle(late) == [(flight, None)]
            assert not flights.pending()
            assert flight.ticket.abandoned
            assert pool.cumulative()["lookup_timeouts"] == 1
            assert pool.state()["read"] != "open"
            # Paused: the next question is a miss at once.
            again = flights.ask([b"k1"])
            assert flights.poll(again, time.monotonic()) == (True, None)
        finally:
            server.resume()
            pool.close()


def test_a_dropped_ticket_is_not_blamed_on_the_pool():
    with redis_server() as server:
        pool = _pool(server.url, io_threads=False)
        try:
            flights = LookupFlights(pool)
            server.pause()
            flight = flights.ask([b"k1"])
            flights.drop(flight)
            assert flight.ticket.abandoned and not flights.pending()
            assert flights.settle(flight.deadline + 1.0) == []
            assert pool.cumulative()["lookup_timeouts"] == 0  # not abandoned
        finally:
            server.resume()
            pool.close()


def test_asking_again_keeps_the_first_asks_deadline():
    """A question asked again (the 0.11.2 scheduler, for another range of
    the same request) waits no longer than the first ask allowed."""
    with redis_server() as server:
        pool = _pool(server.url, io_threads=False)
        try:
            flights = LookupFlights(pool)
            server.pause()
            now = time.monotonic()
            first = flights.ask([b"k1"], now=now - 1.0)
            flights.drop(first)
            second = flights.ask([b"k1", b"k2"], now=now, since=first.since)
            assert second.deadline == first.deadline < now
            assert flights.poll(second, now) == (True, None)  # late already
            assert pool.cumulative()["lookup_timeouts"] == 1
        finally:
            server.resume()
            pool.close()
