"""Pool configuration: every bad input is refused at startup, naming the
key; URL parsed once; passwords redacted; cluster mismatch detected by the
startup probe against real servers."""

from __future__ import annotations

import logging
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import redis_cluster, redis_server  # noqa: E402

from vllm_overlay.core.pool import config as config_module  # noqa: E402
from vllm_overlay.core.pool.config import MAX_TTL_S, PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402

NOT_PEM = pathlib.Path(__file__)  # a readable file that is no CA bundle


@pytest.mark.parametrize(
    "values,key",
    [
        ({"url": "redis://h:abc"}, "url"),  # bad port
        ({"url": "redis://h:70000"}, "url"),  # port out of range
        ({"url": "redis://h:0"}, "url"),
        ({"url": "redis://my host:6379"}, "url"),  # space in the host
        ({"url": "redis://h?foo=1"}, "unknown query option 'foo'"),
        ({"url": "redis://h?db"}, "url"),  # malformed query
        ({"url": "redis://h?db=1&db=2"}, "given twice"),
        ({"url": "redis://h?db=x"}, "'db'"),
        ({"url": "redis://h?decode_responses=true"}, "decode_responses"),
        ({"url": "redis://h/abc"}, "/<db number>"),  # not silently db 0
        ({"url": "redis://h/1/2"}, "/<db number>"),
        ({"url": "redis://h?ssl_cert_reqs=none"}, "ssl_cert_reqs"),  # no TLS
        ({"url": "rediss://h?ssl_cert_reqs=maybe"}, "ssl_cert_reqs"),
        ({"url": "redis://h/2", "cluster": True}, "cluster"),
        ({"url": "redis://h", "timeout_s": math.nan}, "timeout_s"),
        ({"url": "redis://h", "timeout_s": math.inf}, "timeout_s"),
        ({"url": "redis://h", "connect_timeout_s": math.inf}, "connect_timeout_s"),
        ({"url": "redis://h", "lookup_wait_s": math.nan}, "lookup_wait_s"),
        ({"url": "redis://h", "lookup_wait_s": 0}, "lookup_wait_s"),
        ({"url": "redis://h", "lookup_wait_s": "fast"}, "lookup_wait_s"),
        ({"url": "redis://h", "retry_backoff_s": math.nan}, "retry_backoff_s"),
        (
            {"url": "redis://h", "retry_backoff_s": 5.0, "max_retry_backoff_s": 1.0},
            "max_retry_backoff_s",
        ),
        ({"url": "redis://h", "ttl_s": MAX_TTL_S + 1}, "ttl_s"),
        ({"url": "redis://h", "ttl_s": 0}, "ttl_s"),
        ({"url": "redis://h", "ttl_s": -5}, "ttl_s"),
        ({"url": "redis://h", "max_inflight_load_bytes": 0}, "max_inflight_load"),
        ({"url": "rediss://h", "tls_ca_file": str(NOT_PEM)}, "tls_ca_file"),
        ({"url": "rediss://h", "tls_ca_file": "/nonexistent.pem"}, "tls_ca_file"),
        ({"url": "redis://h", "secret_file": "/nonexistent"}, "secret_file"),
        ({"url": "redis://h", "secret_env": "VKV_TEST_UNSET_VARIABLE"}, "secret_env"),
        (
            {"url": "redis://h", "secret_env": "A", "secret_file": "/x"},
            "secret_file and secret_env",
        ),
        ({"url": "redis://h", "secret": "inline"}, "unknown pool options"),
    ],
)
def test_each_bad_input_is_refused_naming_the_key(values, key):
    with pytest.raises(ValueError, match=key.replace("?", r"\?")):
        PoolConfig.from_dict(values)


def test_url_is_parsed_once_into_client_arguments():
    config = PoolConfig(
        url="valkeys://alice:p%40ss@cache.example:6380/3?ssl_check_hostname=false",
        timeout_s=0.5,
    )
    p = config.parsed
    assert (p.scheme, p.host, p.port, p.db) == ("rediss", "cache.example", 6380, 3)
    assert (p.username, p.password) == ("alice", "p@ss")
    kwargs = config.client_kwargs()
    assert kwargs["ssl"] is True and kwargs["ssl_check_hostname"] is False
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["db"] == 3
    assert kwargs["socket_timeout"] == 0.5
    assert PoolConfig(url="redis://h?db=4").parsed.db == 4
    assert PoolConfig(url="redis://h/").parsed.db == 0
    assert PoolConfig(url="redis://[::1]:7000").client_kwargs()["host"] == "::1"


def test_query_password_is_redacted_like_userinfo():
    config = PoolConfig(url="redis://h:1234/0?password=s3cret&client_name=n")
    assert "s3cret" not in config.redacted_url
    assert "password=***" in config.redacted_url
    assert config.parsed.password == "s3cret"
    assert config.redact("auth failed for s3cret") == "auth failed for ***"
    with pytest.raises(ValueError) as info:
        PoolConfig(url="redis://h:99999/0?password=s3cret")
    assert "s3cret" not in str(info.value)


def test_ssl_cert_reqs_none_warns_loudly_once(caplog):
    url = "rediss://h:6390?ssl_cert_reqs=none"
    config_module._warned_insecure.discard(url)
    with caplog.at_level(logging.WARNING, logger="vllm.overlay"):
        PoolConfig(url=url)
        PoolConfig(url=url)
    warnings = [r for r in caplog.records if "NOT verified" in r.getMessage()]
    assert len(warnings) == 1


def test_the_largest_ttl_is_accepted_by_redis(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url, ttl_s=MAX_TTL_S))
        try:
            assert pool.submit_store([(b"t", b"v")]) == 1 and pool.drain()
            assert pool.cumulative()["errors"] == 0
            assert int(server.cli("ttl", "t")) > 10**12
        finally:
            pool.close()


def _probe(config: PoolConfig, caplog):
    pool = KVPool(config, io_threads=False)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.overlay"):
            pool.probe().join(timeout=20)
        return pool
    finally:
        pool.close()


def test_cluster_true_against_a_plain_server_is_reported_and_disables(
    server_kind, caplog
):
    with redis_server(kind=server_kind) as server:
        pool = _probe(PoolConfig(url=server.url, cluster=True), caplog)
        assert pool.server_is_cluster is False
        assert pool.misconfigured and "is not a cluster node" in pool.misconfigured
        errors = [r for r in caplog.records if "configuration error" in r.getMessage()]
        assert len(errors) == 1 and "set cluster to false" in errors[0].message
        assert pool.is_down() and pool.count_hits([b"k"]) == 0  # no network


def test_cluster_detection_at_startup_and_cluster_io(server_kind, caplog):
    with redis_server(kind=server_kind) as server:
        plain = _probe(PoolConfig(url=server.url), caplog)
    assert plain.server_is_cluster is False and plain.misconfigured is None
    with redis_cluster(3, kind=server_kind) as servers:
        ok = _probe(PoolConfig(url=servers[0].url, cluster=True), caplog)
        assert ok.server_is_cluster is True and ok.misconfigured is None
        wrong = _probe(PoolConfig(url=servers[0].url), caplog)
        # The cluster client is built from the parsed URL too.
        pool = KVPool(PoolConfig(url=servers[0].url, cluster=True))
        try:
            items = [(b"c%d" % i, b"v%d" % i) for i in range(6)]
            assert pool.submit_store(items) == 6 and pool.drain()
            assert pool.count_hits([k for k, _ in items]) == 6
            pool.submit_load("j", [k for k, _ in items])
            assert pool.drain()
            assert pool.poll_loads() == [("j", [v for _, v in items])]
        finally:
            pool.close()
    assert wrong.misconfigured and "set cluster to true" in wrong.misconfigured
