"""The pool's clients and its raw, cluster-aware pipelines.

Clients are redis-py's (its connect, AUTH, TLS, health checks and cluster
slot map); ``exchange`` sends many commands as one pipeline per server over
a connection taken from redis-py's pool and reads the replies with
``resp.RespReader`` (values straight into the caller's memory).
"""

from __future__ import annotations

import socket

from vllm_overlay.core.pool.config import PoolConfig
from vllm_overlay.core.pool.resp import MAX_VALUE_BYTES, RespReader, coalesce


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
) -> list:
    """Send ``requests`` (key, command pieces, ``into`` or None[, a
    callback for the reply]) as one pipeline per server and read every
    reply (``RespReader.reply``; the callback, if any, gets each reply that
    is not an error as soon as it is read): error replies come back as
    exception instances, in place.  A cluster's MOVED updates the client's
    slot map and is tried once more; a redirect left after that is a
    ``Redirected``.  A socket failure, a protocol error, the ``deadline``
    or a cancelled ``guard`` raises (the connections are dropped)."""
    import redis

    replies: list = [None] * len(requests)
    taken = []
    try:
        for pool, idxs in _groups(client, cluster, [r[0] for r in requests]):
            conn = pool.get_connection()
            taken.append((pool, conn, idxs))
            conn.send_packed_command(
                coalesce(piece for i in idxs for piece in requests[i][1])
            )
        for _, conn, idxs in taken:
            reader = RespReader(
                conn._sock,
                deadline=deadline,
                guard=guard,
                max_bulk_bytes=max_bulk_bytes,
            )
            try:
                for i in idxs:
                    replies[i] = reply = reader.reply(requests[i][2])
                    if len(requests[i]) > 3 and not isinstance(reply, Exception):
                        requests[i][3](reply)  # e.g. check it while more arrive
                if reader.buffered:
                    raise redis.InvalidResponse("more bytes than replies")
            finally:
                reader.close()
    except BaseException as exc:
        for _, conn, _ in taken:
            conn.disconnect()
        if isinstance(exc, socket.timeout):
            raise redis.TimeoutError("Timeout reading from the pool") from exc
        if isinstance(exc, OSError):
            raise redis.ConnectionError(f"reading from the pool: {exc}") from exc
        raise
    finally:
        for pool, conn, _ in taken:
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
            )
            for i, reply in zip(moved, again):
                replies[i] = reply
    return replies
