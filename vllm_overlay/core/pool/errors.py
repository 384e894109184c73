"""What went wrong talking to the pool, and what the pool does about it.

Every exception from redis-py (or from building a client) falls into one
``Failure`` kind; each kind has its own reaction:

==============  ==========================================  =================
kind            examples                                    reaction
==============  ==========================================  =================
unreachable     refused, reset, timeout, LOADING,           reads and writes
                CLUSTERDOWN, no slot coverage, TRYAGAIN,    pause; a
                a cluster client that cannot be built       background PING
                                                            resumes them
slow            a lookup not answered within                as unreachable
                ``lookup_wait_s``                           (PING must be
                                                            fast too)
full            OOM (``maxmemory`` with noeviction)         writes pause
read-only       READONLY (a replica)                        writes pause
denied          NOPERM, bad credentials                     that direction
                                                            pauses (long)
bad key         WRONGTYPE on one key                        that block only:
                                                            a miss, key
                                                            deleted
bad request     any other error reply                       that direction
                                                            pauses (long)
==============  ==========================================  =================

Pauses grow from ``retry_backoff_s`` to ``max_retry_backoff_s``; "long"
pauses start at ``max_retry_backoff_s`` (a configuration problem does not
fix itself in a second).
"""

from __future__ import annotations

import enum


class Failure(enum.Enum):
    UNREACHABLE = "unreachable"
    SLOW = "slow"
    FULL = "full"
    READ_ONLY = "read-only"
    DENIED = "denied"
    BAD_KEY = "bad key"
    BAD_REQUEST = "bad request"

    @property
    def whole_pool(self) -> bool:
        """Both reads and writes pause, until a background PING answers."""
        return self in (Failure.UNREACHABLE, Failure.SLOW)

    @property
    def writes_only(self) -> bool:
        return self in (Failure.FULL, Failure.READ_ONLY)

    @property
    def long_pause(self) -> bool:
        return self in (Failure.DENIED, Failure.BAD_REQUEST)


class PoolTooSlow(Exception):
    """A lookup was not answered within ``lookup_wait_s``."""


def classify(exc: BaseException) -> Failure:
    import redis.exceptions as rex

    if isinstance(exc, PoolTooSlow):
        return Failure.SLOW
    # Denials first: redis-py makes bad credentials a ConnectionError.
    if isinstance(
        exc, (rex.AuthenticationError, rex.AuthorizationError, rex.NoPermissionError)
    ):
        return Failure.DENIED
    if isinstance(
        exc,
        (
            rex.ConnectionError,  # also LOADING (BusyLoadingError)
            rex.TimeoutError,
            rex.ClusterDownError,  # also MASTERDOWN
            rex.TryAgainError,
            rex.ClusterError,
            rex.RedisClusterException,  # no reachable startup node, no slot
            OSError,
        ),
    ):
        return Failure.UNREACHABLE
    if isinstance(exc, rex.OutOfMemoryError):
        return Failure.FULL
    if isinstance(exc, rex.ReadOnlyError):
        return Failure.READ_ONLY
    if isinstance(exc, rex.ResponseError):
        text = str(exc)
        if text.startswith("WRONGTYPE"):
            return Failure.BAD_KEY
        if text.startswith("OOM"):
            return Failure.FULL
        if text.startswith("READONLY"):
            return Failure.READ_ONLY
        if text.startswith(("NOPERM", "NOAUTH", "WRONGPASS")):
            return Failure.DENIED
        if text.startswith(("LOADING", "CLUSTERDOWN", "MASTERDOWN", "TRYAGAIN")):
            return Failure.UNREACHABLE
    return Failure.BAD_REQUEST
