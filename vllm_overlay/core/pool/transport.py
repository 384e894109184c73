"""The pool's clients and its raw, cluster-aware pipelines.

Clients are redis-py's (its connect, AUTH, TLS, health checks and cluster
slot map); ``exchange`` sends many commands as one pipeline per server over
a connection taken from redis-py's pool and reads the replies with
``resp.RespReader`` (values straight into the caller's memory).  The
commands go out while the replies come in (``Outgoing``): each reply is
read as soon as the server sends it, and no send, like no read, waits past
the exchange's deadline (``io_timeout_s``), so a slow link cannot stretch
a store of many values beyond it.  A failed exchange resets its
connections: what was not sent yet is dropped, not delivered later.
"""

from __future__ import annotations

import collections
import contextlib
import math
import select
import socket
import struct
import time

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.errors import PoolTooSlow
from vllm_overlay.core.pool.resp import (
    MAX_VALUE_BYTES,
    Cancelled,
    RespReader,
    coalesce,
)


def make_client(config: PoolConfig, single_node: bool = False):
    """A client built from the config's parsed URL (``single_node``: a plain
    client even for a cluster, as the startup probe needs).  No client-side
    retries: the pool pauses and probes by itself."""
    import redis

    kwargs = config.client_kwargs()
    if config.cluster and not single_node:
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        # One retry lets the client follow a failover (slots moved).
        return RedisCluster(retry=Retry(NoBackoff(), 1), **kwargs)
    kwargs.setdefault("db", 0)
    return redis.Redis(retry=None, **kwargs)


class Unreachable:
    """Stands in for a client that could not be created."""

    def pipeline(self, *args, **kwargs):
        import redis

        raise redis.ConnectionError("pool unreachable (no client)")


class Redirected(Exception):
    """A cluster redirect (MOVED/ASK) still there after one retry: the slot
    is moving; that block is a miss (or a dropped store), nothing pauses."""


def first_failure(replies: list) -> Exception | None:
    """The first error reply that is not a redirect."""
    return next(
        (
            r
            for r in replies
            if isinstance(r, Exception) and not isinstance(r, Redirected)
        ),
        None,
    )


class Outgoing:
    """The bytes of one server's pipeline still to send.  ``send_ready``
    sends what the socket takes without waiting; ``until_readable`` (the
    reader calls it before it waits for a reply) sends until the socket
    has bytes to read or nothing is left, waiting at most until
    ``deadline`` (``time.monotonic()``; None: the socket's own timeout per
    wait).  Payloads are sent from the caller's buffers (no copy); with a
    ``guard`` (``resp.Guard``), each send (a copy into the kernel, which
    never waits: the socket was found writable) happens under
    ``guard.lock`` and only while ``guard.cancelled`` is false, so whoever
    cancels under that lock knows no later send reads those buffers (the
    exchange then resets the connection: a command cut short never
    reaches the server whole)."""

    SEND_BYTES = 256 << 10  # at most this much per send (TLS writes it whole)

    def __init__(self, sock, pieces, deadline: float | None = None, guard=None) -> None:
        self.sock = sock
        self.deadline = deadline
        self.guard = guard
        self._timeout = sock.gettimeout()
        self._shortened = False
        views = (memoryview(p).cast("B") for p in pieces)
        self._views = collections.deque(v for v in views if v.nbytes)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLOUT)

    @property
    def pending(self) -> bool:
        return bool(self._views)

    def close(self) -> None:
        """Give the socket its own timeout back."""
        if self._shortened:
            self.sock.settimeout(self._timeout)
            self._shortened = False

    def _left(self) -> float | None:
        """The longest the next wait may take (raises past the deadline)."""
        if self.deadline is None:
            return self._timeout
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PoolTooSlow(
                "not done within io_timeout_s (the server or the link too slow)"
            )
        return left if self._timeout is None else min(left, self._timeout)

    def _wait(self, left: float | None) -> int:
        """The socket's poll events (0: none within ``left``)."""
        ms = -1 if left is None else max(1, math.ceil(left * 1000))
        events = self._poll.poll(ms)
        return events[0][1] if events else 0

    def _send(self, left: float | None) -> None:
        if self.deadline is not None:
            self.sock.settimeout(left)
            self._shortened = True
        view = self._views[0]
        if self.guard is None:
            sent = self.sock.send(view[: self.SEND_BYTES])
        else:
            with self.guard.lock:
                if self.guard.cancelled:
                    raise Cancelled()
                sent = self.sock.send(view[: self.SEND_BYTES])
        if sent >= view.nbytes:
            self._views.popleft()
        else:
            self._views[0] = view[sent:]

    def send_ready(self) -> None:
        """Send what the socket takes now (no wait)."""
        while self._views and self._wait(0) & select.POLLOUT:
            self._send(self._left())

    def until_readable(self) -> None:
        """Send until the socket has bytes to read (a reply, or its
        closing: the read reports it) or all is sent."""
        pending = getattr(self.sock, "pending", None)  # TLS: decrypted bytes
        while self._views:
            if pending is not None and pending():
                return
            left = self._left()
            events = self._wait(left)
            if not events:
                self._left()  # past the deadline: slow
                raise TimeoutError("timed out sending to the pool")
            if events & ~select.POLLOUT:
                return
            self._send(left)


def _abort(conn) -> None:
    """Drop a connection at once: a reset, so the bytes not sent yet are
    discarded instead of reaching the server after the exchange gave up."""
    sock = conn._sock
    if sock is not None:
        with contextlib.suppress(OSError):
            linger = struct.pack("ii", 1, 0)  # on, 0 s: reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    conn.disconnect()


def _groups(client, cluster: bool, keys: list[bytes]) -> list[tuple[object, list[int]]]:
    """(connection pool, indexes of ``keys``) per server."""
    if isinstance(client, Unreachable):
        import redis

        raise redis.ConnectionError("pool unreachable (no client)")
    if not cluster:
        return [(client.connection_pool, list(range(len(keys))))]
    nodes: dict[str, tuple[object, list[int]]] = {}
    for i, key in enumerate(keys):
        node = client.get_node_from_key(key)
        nodes.setdefault(node.name, (node, []))[1].append(i)
    return [
        (client.get_redis_connection(node).connection_pool, idxs)
        for node, idxs in nodes.values()
    ]


def exchange(
    client,
    cluster: bool,
    requests: list,
    retry: bool = True,
    deadline: float | None = None,
    guard=None,
    max_bulk_bytes: int = MAX_VALUE_BYTES,
    send_guard=None,
) -> list:
    """Send ``requests`` (key, command pieces, ``into`` or None[, a
    callback for the reply]) as one pipeline per server and read every
    reply (``RespReader.reply``; the callback, if any, gets each reply that
    is not an error as soon as it is read, so a caller knows what the
    server answered even when the exchange fails later): error replies
    come back as exception instances, in place.  A cluster's MOVED updates
    the client's slot map and is tried once more; a redirect left after
    that is a ``Redirected``.  A socket failure, a protocol error, the
    ``deadline`` (sends and reads alike) or a cancelled ``guard`` (the
    replies' writes into the caller's memory) or ``send_guard`` (the
    commands' reads of it: ``Outgoing``) raises (the connections are
    reset)."""
    import redis

    replies: list = [None] * len(requests)
    taken = []  # (redis-py's pool, its connection)
    pipes = []  # (indexes of requests, their Outgoing, their reader)
    try:
        for pool, idxs in _groups(client, cluster, [r[0] for r in requests]):
            conn = pool.get_connection()
            taken.append((pool, conn))
            conn.check_health()  # (only with a health_check_interval)
            out = Outgoing(
                conn._sock,
                coalesce(piece for i in idxs for piece in requests[i][1]),
                deadline,
                send_guard,
            )
            reader = RespReader(
                conn._sock,
                deadline=deadline,
                guard=guard,
                max_bulk_bytes=max_bulk_bytes,
                outgoing=out,
            )
            pipes.append((idxs, out, reader))
            out.send_ready()  # every server starts on its commands
        for idxs, out, reader in pipes:
            try:
                for i in idxs:
                    replies[i] = reply = reader.reply(requests[i][2])
                    if len(requests[i]) > 3 and not isinstance(reply, Exception):
                        requests[i][3](reply)  # e.g. count or check it
                if reader.buffered or out.pending:
                    raise redis.InvalidResponse("more replies than commands")
            finally:
                reader.close()
                out.close()
    except BaseException as exc:
        for _, conn in taken:
            _abort(conn)
        if isinstance(exc, socket.timeout):
            raise redis.TimeoutError("Timeout talking to the pool") from exc
        if isinstance(exc, OSError):
            raise redis.ConnectionError(f"talking to the pool: {exc}") from exc
        raise
    finally:
        for pool, conn in taken:
            pool.release(conn)
    moved = [
        i
        for i, r in enumerate(replies)
        if isinstance(r, redis.ResponseError) and str(r).startswith(("MOVED ", "ASK "))
    ]
    if moved:
        for i in moved:
            text = str(replies[i])
            if retry and text.startswith("MOVED "):
                client.nodes_manager.move_slot(redis.exceptions.MovedError(text[6:]))
            replies[i] = Redirected(text)
        if retry:
            again = exchange(
                client,
                cluster,
                [requests[i] for i in moved],
                False,
                deadline,
                guard,
                max_bulk_bytes,
                send_guard,
            )
            for i, reply in zip(moved, again):
                replies[i] = reply
    return replies
