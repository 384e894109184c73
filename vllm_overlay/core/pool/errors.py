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
                ``lookup_wait_s``, a load or store not      (PING must be
                done within ``io_timeout_s``                fast too)
full            OOM (``maxmemory`` with noeviction)         writes pause
read-only       READONLY (a replica)                        writes pause
denied          NOPERM, bad credentials                     that direction
                                                            pauses (long)
bad key         WRONGTYPE on one key                        that block only:
                                                            a miss, key
                                                            deleted
bad request     any other error reply                       that direction
                                                            pauses (long)
stuck           a pool thread busy with one job past its    reads and writes
                deadline (``io_timeout_s``, a lookup        pause until the
                ``lookup_wait_s`` + ``timeout_s``)          thread is free
                                                            and a PING
                                                            answers
internal        anything that is not the server's doing:    nothing pauses;
                a bug, a missing dependency                 that job's
                                                            requests
                                                            recompute, logged
                                                            with a traceback
==============  ==========================================  =================

Pauses grow from ``retry_backoff_s`` to ``max_retry_backoff_s``; "long"
pauses start at ``max_retry_backoff_s`` (a configuration problem does not
fix itself in a second).  ``health.Gate`` holds that arithmetic.
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
    STUCK = "stuck"
    INTERNAL = "internal"

    @property
    def whole_pool(self) -> bool:
        """Both reads and writes pause, until a background PING answers."""
        return self in (Failure.UNREACHABLE, Failure.SLOW, Failure.STUCK)

    @property
    def writes_only(self) -> bool:
        return self in (Failure.FULL, Failure.READ_ONLY)

    @property
    def long_pause(self) -> bool:
        return self in (Failure.DENIED, Failure.BAD_REQUEST)

    @property
    def server_side(self) -> bool:
        """The server's (or the network's) doing: pauses, warned about."""
        return self is not Failure.INTERNAL


class PoolTooSlow(Exception):
    """A lookup was not answered within ``lookup_wait_s``, or a load or a
    store not done within ``io_timeout_s``."""


class PoolStuck(Exception):
    """A pool thread has been busy with one job past its deadline."""


class PoolDependencyError(ImportError):
    """The pool's Python dependencies are not installed."""


INSTALL_HINT = "pip install redis xxhash"
# runtime only: begin
INSTALL_HINT = "pip install 'vllm-overlay[pool]'"  # the overlay's pool extras
# runtime only: end


def require_dependencies() -> None:
    """Raise ``PoolDependencyError`` naming what is missing and the install
    command; a connector calls this when it starts (never later, on a
    background thread).  ``xxhash`` is optional (values are then checked
    with CRC-32), ``hiredis`` too (redis-py parses in Python)."""
    missing = []
    try:
        import redis  # noqa: F401
        import redis.exceptions  # noqa: F401
    except ImportError as exc:
        missing.append(f"redis ({exc})")
    if missing:
        raise PoolDependencyError(
            "the shared KV pool needs redis-py, which is not installed: "
            f"{'; '.join(missing)}. Install the pool's dependencies: {INSTALL_HINT}"
        )


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, PoolTooSlow):
        return Failure.SLOW
    if isinstance(exc, PoolStuck):
        return Failure.STUCK
    try:
        import redis.exceptions as rex
    except ImportError:  # no redis-py: nothing can be the server's doing
        return Failure.UNREACHABLE if isinstance(exc, OSError) else Failure.INTERNAL
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
    if isinstance(exc, rex.RedisError):  # e.g. a malformed reply
        return Failure.BAD_REQUEST
    return Failure.INTERNAL  # not the server's doing: a bug
