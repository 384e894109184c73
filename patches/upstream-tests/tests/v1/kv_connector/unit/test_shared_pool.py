# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared KV pool: the value codec, the configuration, failure kinds, the
pool core against a real redis-server (started here, skipped without one),
and two engines sharing KV blocks through it."""

import os
import shutil
import socket
import struct
import subprocess
import time

import pytest
import redis
import redis.exceptions as rex

from tests.v1.kv_connector.unit.tiny_llama import (
    make_tiny_llama,
    prompt_token_ids,
    run_once,
    tiny_llm,
)
from vllm.distributed.kv_transfer.kv_connector.v1.shared_pool import codec
from vllm.distributed.kv_transfer.kv_connector.v1.shared_pool.config import (
    PoolConfig,
    parse_url,
)
from vllm.distributed.kv_transfer.kv_connector.v1.shared_pool.errors import (
    Failure,
    PoolTooSlow,
    classify,
)
from vllm.distributed.kv_transfer.kv_connector.v1.shared_pool.pool import KVPool

NS = bytes(range(16))
KEY = b"vkv:test:r0:0123"
LAYOUT = codec.layout_tag("cross-layer|block-bytes=768")
PAYLOAD = bytes(range(256)) * 3


# -- codec ------------------------------------------------------------------------


def test_codec_round_trip():
    value = codec.encode(NS, KEY, PAYLOAD, LAYOUT)
    assert codec.HEADER_BYTES == 72
    assert len(value) == codec.HEADER_BYTES + len(PAYLOAD)
    assert value[:4] == b"VOKV"
    assert bytes(codec.decode(NS, KEY, value, len(PAYLOAD), LAYOUT)) == PAYLOAD
    # the header alone, for writers that send the payload separately
    assert codec.encode_header(NS, KEY, PAYLOAD, LAYOUT) == value[:72]


def test_codec_checksums(monkeypatch):
    """XXH3-64 where xxhash is installed, CRC-32 otherwise; a reader checks
    what the flags name, and one without xxhash refuses (keeps) XXH3 values."""
    import zlib

    monkeypatch.setattr(codec, "xxhash", None)
    crc = codec.encode(NS, KEY, PAYLOAD, LAYOUT)
    assert not struct.unpack_from("<H", crc, 6)[0] & codec.XXH3
    assert struct.unpack_from("<Q", crc, 48)[0] == zlib.crc32(PAYLOAD)
    monkeypatch.undo()
    assert bytes(codec.decode(NS, KEY, crc, len(PAYLOAD), LAYOUT)) == PAYLOAD
    xxhash = pytest.importorskip("xxhash")
    fast = codec.encode(NS, KEY, PAYLOAD, LAYOUT)
    assert struct.unpack_from("<H", fast, 6)[0] & codec.XXH3
    assert struct.unpack_from("<Q", fast, 48)[0] == xxhash.xxh3_64_intdigest(PAYLOAD)
    assert bytes(codec.decode(NS, KEY, fast, len(PAYLOAD), LAYOUT)) == PAYLOAD
    monkeypatch.setattr(codec, "xxhash", None)
    with pytest.raises(codec.BadValue, match="no xxhash") as exc:
        codec.decode(NS, KEY, fast, len(PAYLOAD), LAYOUT)
    assert not exc.value.delete


def _flip(value: bytes, at: int) -> bytes:
    return value[:at] + bytes([value[at] ^ 0xFF]) + value[at + 1 :]


@pytest.mark.parametrize(
    "mangle, args, message, delete",
    [
        (lambda v: _flip(v, 100), {}, "checksum mismatch", True),
        (lambda v: _flip(v, 0), {}, "bad magic", True),
        (lambda v: v[:50], {}, "shorter than the header", True),
        (lambda v: v[:-1], {}, "payload of", True),
        (lambda v: v, {"key": b"vkv:test:r0:9999"}, "another key", True),
        (lambda v: v, {"ns": bytes(16)}, "another namespace", True),
        (lambda v: v, {"layout": codec.layout_tag("per-layer")}, "layout", False),
        (lambda v: v, {"length": 100}, "layout needs 100 B", True),
    ],
)
def test_codec_refuses_bad_values(mangle, args, message, delete):
    value = mangle(codec.encode(NS, KEY, PAYLOAD, LAYOUT))
    with pytest.raises(codec.BadValue, match=message) as exc:
        codec.decode(
            args.get("ns", NS),
            args.get("key", KEY),
            value,
            args.get("length", len(PAYLOAD)),
            args.get("layout", LAYOUT),
        )
    assert exc.value.delete is delete


def test_codec_signatures():
    secret, other = os.urandom(64), os.urandom(64)
    signed = codec.encode(NS, KEY, PAYLOAD, LAYOUT, mac_key=secret)
    unsigned = codec.encode(NS, KEY, PAYLOAD, LAYOUT)
    assert bytes(codec.decode(NS, KEY, signed, len(PAYLOAD), LAYOUT, secret)) == (
        PAYLOAD
    )
    # a forged payload with a valid checksum, the flags and the old MAC
    forged_payload = bytes(reversed(PAYLOAD))
    forged = bytearray(codec.encode(NS, KEY, forged_payload, LAYOUT))
    (flags,) = struct.unpack_from("<H", forged, 6)
    struct.pack_into("<H", forged, 6, flags | codec.SIGNED)
    forged[56:72] = signed[56:72]
    # With a secret, key names derive from it: a value under them without
    # its MAC is deleted (an honest store then replaces it).  Without one,
    # a signed value is left for the nodes that hold the secret.
    for value, key, message, delete in [
        (unsigned, secret, "unsigned value", True),
        (signed, other, "bad signature", True),
        (bytes(forged), secret, "bad signature", True),
        (signed, None, "signed value", False),
    ]:
        with pytest.raises(codec.BadValue, match=message) as exc:
            codec.decode(NS, KEY, value, len(PAYLOAD), LAYOUT, key)
        assert exc.value.signature and exc.value.delete is delete


# -- configuration -----------------------------------------------------------------


def test_parse_url():
    parsed = parse_url("valkey://alice:p%40ss@cache.local:6380/2?client_name=vllm")
    assert parsed.scheme == "redis" and not parsed.tls
    assert (parsed.host, parsed.port, parsed.db) == ("cache.local", 6380, 2)
    assert (parsed.username, parsed.password) == ("alice", "p@ss")
    assert parsed.option("client_name") == "vllm"
    assert parse_url("valkeys://h").tls
    assert parse_url("redis://h?db=3").db == 3
    config = PoolConfig(url="valkey://alice:pw@cache.local:6380/2", timeout_s=0.5)
    kwargs = config.client_kwargs()
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("cache.local", 6380, 2)
    assert (kwargs["password"], kwargs["socket_timeout"]) == ("pw", 0.5)
    assert config.redis_url.startswith("redis://")
    assert "pw" not in config.redacted_url


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://h:6379", "scheme must be one of"),
        ("redis://", "has no host"),
        ("redis://h:99999", "bad port"),
        ("redis://h/x", "must be /<db number>"),
        ("redis://h#top", "fragment"),
        ("redis://h?color=red", "unknown query option 'color'"),
        ("redis://h?decode_responses=true", "KV values are binary"),
        ("redis://h/1?db=2", "db given both"),
        ("redis://h?ssl_cert_reqs=none", "needs rediss://"),
        ("redis://h?client_name=a&client_name=b", "given twice"),
    ],
)
def test_bad_urls_are_refused(url, message):
    with pytest.raises(ValueError, match=message):
        parse_url(url)


def test_errors_do_not_show_the_password():
    with pytest.raises(ValueError) as exc:
        PoolConfig(url="redis://alice:topsecret@h:6379/x")
    assert "topsecret" not in str(exc.value)
    assert "alice:***@h" in str(exc.value)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"namespace": "a:b"}, "namespace"),
        ({"timeout_s": 0}, "timeout_s must be a positive finite number"),
        ({"lookup_wait_s": float("inf")}, "lookup_wait_s"),
        ({"retry_backoff_s": 5.0, "max_retry_backoff_s": 1.0}, "must be >="),
        ({"max_inflight_bytes": 0}, "max_inflight_bytes must be a positive"),
        ({"ttl_s": 2**62}, "ttl_s must be a positive integer"),
        ({"cluster": True, "url": "redis://h/1"}, "db 0 only"),
        ({"tls_ca_file": "/nonexistent.pem"}, "not a readable file"),
        ({"secret_env": "VLLM_TEST_POOL_SECRET"}, "at least 16 bytes"),
        ({"colour": "red"}, "unknown pool options"),
    ],
)
def test_bad_pool_options_are_refused(monkeypatch, options, message):
    monkeypatch.setenv("VLLM_TEST_POOL_SECRET", "short")
    with pytest.raises(ValueError, match=message):
        PoolConfig.from_dict({"url": "redis://h:6379", **options})


def test_shared_secret_gives_a_mac_key(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_TEST_POOL_SECRET", "0123456789abcdef0123")
    from_env = PoolConfig(url="redis://h", secret_env="VLLM_TEST_POOL_SECRET")
    secret_file = tmp_path / "secret"
    secret_file.write_text("0123456789abcdef0123\n")
    from_file = PoolConfig(url="redis://h", secret_file=str(secret_file))
    assert len(from_env.mac_key) == 64
    assert from_env.mac_key == from_file.mac_key
    assert PoolConfig(url="redis://h").mac_key is None


@pytest.mark.parametrize(
    "exc, kind",
    [
        (rex.ConnectionError("refused"), Failure.UNREACHABLE),
        (rex.TimeoutError("timeout"), Failure.UNREACHABLE),
        (PoolTooSlow("slow"), Failure.SLOW),
        (rex.AuthenticationError("bad password"), Failure.DENIED),
        (rex.ResponseError("NOPERM no"), Failure.DENIED),
        (rex.ResponseError("WRONGTYPE Operation"), Failure.BAD_KEY),
        (rex.ResponseError("OOM command not allowed"), Failure.FULL),
        (rex.ReadOnlyError("READONLY replica"), Failure.READ_ONLY),
        (rex.ResponseError("ERR syntax error"), Failure.BAD_REQUEST),
    ],
)
def test_failure_kinds(exc, kind):
    assert classify(exc) is kind


def test_failure_reactions():
    assert Failure.UNREACHABLE.whole_pool and Failure.SLOW.whole_pool
    assert Failure.FULL.writes_only and Failure.READ_ONLY.writes_only
    assert Failure.DENIED.long_pause and Failure.BAD_REQUEST.long_pause
    assert not (Failure.BAD_KEY.whole_pool or Failure.BAD_KEY.writes_only)


# -- the pool on a real redis-server -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
        + ["--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except rex.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        client.close()
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def server(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def make_pool():
    pools = []

    def make(**options):
        pool = KVPool(PoolConfig(**options))
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def _encode(key: bytes, payload) -> bytes:
    return codec.encode(NS, key, payload, LAYOUT)


def _wait_for_loads(pool, count=1, timeout_s=10.0):
    done = []
    deadline = time.monotonic() + timeout_s
    while len(done) < count and time.monotonic() < deadline:
        done += pool.poll_loads()
        time.sleep(0.005)
    assert len(done) == count, "loads did not finish"
    return done


def test_pool_stores_looks_up_and_loads(server, redis_url, make_pool):
    pool = make_pool(url=redis_url)
    keys = [b"vkv:test:r0:%d" % i for i in range(3)]
    payloads = [bytes([i]) * 768 for i in range(3)]
    assert pool.submit_store(list(zip(keys, payloads)), encode=_encode) == 3
    assert pool.drain()
    assert server.dbsize() == 3
    missing = b"vkv:test:r0:missing"
    assert pool.count_hits([*keys, missing]) == 3
    assert pool.count_hits([missing, *keys]) == 0

    pool.submit_load("job", [*keys, missing], value_bytes=768 + 72)
    [(job, values)] = _wait_for_loads(pool)
    assert job == "job" and values[3] is None
    for key, payload, value in zip(keys, payloads, values):
        assert bytes(codec.decode(NS, key, value, 768, LAYOUT)) == payload

    # SET NX: a block already in the pool is not written again
    assert pool.submit_store(list(zip(keys, payloads)), encode=_encode) == 3
    assert pool.drain()
    stats = pool.take_stats()
    assert (stats.stored_blocks, stats.skipped_existing) == (3, 3)
    assert (stats.hits, stats.misses) == (3, 5)
    assert stats.bytes_in == 3 * (768 + 72)


def test_pool_in_flight_limits(server, redis_url, make_pool):
    pool = make_pool(url=redis_url, max_inflight_bytes=2 * 100)
    items = [(b"vkv:test:r0:%d" % i, bytes(100)) for i in range(3)]
    # prefix order: the leading values that fit are admitted, the rest dropped
    assert pool.submit_store(items) == 2
    assert pool.drain()
    assert sorted(server.keys()) == [b"vkv:test:r0:0", b"vkv:test:r0:1"]
    assert pool.take_stats().dropped_stores == 1

    pool = make_pool(url=redis_url, max_inflight_load_bytes=250)
    assert pool.submit_load("j", [k for k, _ in items], value_bytes=100) == 2
    [(_, values)] = _wait_for_loads(pool)
    assert values[0] == bytes(100) and values[2] is None
    assert pool.take_stats().limited_loads == 1


def test_pool_deletes_a_key_of_the_wrong_type(server, redis_url, make_pool):
    server.rpush(b"vkv:test:r0:list", b"x")
    pool = make_pool(url=redis_url)
    pool.submit_load("j", [b"vkv:test:r0:list"])
    [(_, values)] = _wait_for_loads(pool)
    assert values == [None]
    assert pool.drain()
    deadline = time.monotonic() + 5
    while server.exists(b"vkv:test:r0:list") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.exists(b"vkv:test:r0:list")
    assert pool.take_stats().bad_keys == 1


def test_request_finished_mid_load_keeps_its_blocks(server, redis_url, make_pool):
    """A request finished while its load is under way: the scheduler side
    delays freeing its blocks, and the worker reports it finished (sending)
    only once the load thread is done with them, never as received."""
    import types

    import torch

    from vllm.distributed.kv_transfer.kv_connector.v1.shared_pool_connector.common import (  # noqa: E501
        PoolMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.shared_pool_connector.scheduler import (  # noqa: E501
        SharedPoolScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.shared_pool_connector.worker import (  # noqa: E501
        SharedPoolWorker,
    )
    from vllm.v1.kv_offload.block_copy import BlockTable

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=1))
    workers = []
    for _ in range(2):
        worker = SharedPoolWorker(config, NS, make_pool(url=redis_url))
        cache = torch.zeros(4, 256)
        worker._set_table(BlockTable.from_tensors([cache], 0), "test", LAYOUT)
        workers.append((worker, cache))
    (a, cache_a), (b, _) = workers
    cache_a.copy_(torch.randn_like(cache_a))
    chain = [b"h0", b"h1"]
    a.wait_for_save(PoolMetadata(loads={}, stores={"r": ([0, 1], chain)}))
    a.get_finished(set())
    assert a.pool.drain()
    b.get_finished(set())
    server.execute_command("CLIENT", "PAUSE", 400, "ALL")
    b.start_load_kv(PoolMetadata(loads={"L": ([2, 3], chain)}, stores={}))
    assert b.get_finished({"L"}) == (None, None)  # finished, still loading
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline
        pending = b.pool._pending_loads
        sending, recving = b.get_finished(set())
        assert not recving
        if sending:
            assert sending == {"L"} and pending == 0
            break
        time.sleep(0.005)

    config.cache_config = types.SimpleNamespace(
        block_size=16, prefix_caching_hash_algo="sha256"
    )
    side = SharedPoolScheduler(config, NS, b.pool)
    request = types.SimpleNamespace(request_id="L")
    side._loading["L"] = ([2, 3], chain)
    assert side.request_finished(request, [2, 3]) == (True, None)
    assert side.request_finished(request, [2, 3]) == (False, None)


def test_unreachable_pool_pauses_and_answers_miss(make_pool):
    pool = make_pool(
        url=f"redis://127.0.0.1:{_free_port()}",
        connect_timeout_s=0.2,
        timeout_s=0.2,
        retry_backoff_s=30.0,
        max_retry_backoff_s=60.0,
    )
    assert pool.count_hits([KEY]) == 0
    deadline = time.monotonic() + 5
    while pool.reads_open() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.state() == {"read": "unreachable", "write": "unreachable"}
    ticket = pool.submit_lookup([KEY])
    assert ticket.done and ticket.hits == 0  # answered at once, no network
    assert pool.submit_store([(KEY, PAYLOAD)]) == 0


# -- two engines ---------------------------------------------------------------------


def test_engine_loads_blocks_another_engine_stored(
    server, redis_url, tmp_path, monkeypatch
):
    """Engine A computes a prompt and stores its blocks in the pool; engine
    B, with an empty device cache, loads them and gives A's tokens."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = make_tiny_llama(tmp_path / "model")
    kv_transfer_config = KVTransferConfig(
        kv_connector="SharedKVPoolConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "url": redis_url,
            "namespace": "upstream-test",
            # generous: a loaded machine must not turn hits into misses
            "connect_timeout_s": 5.0,
            "timeout_s": 5.0,
            "lookup_wait_s": 30.0,
        },
    )
    prompt = {"prompt_token_ids": prompt_token_ids(100)}  # 6 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)

    with tiny_llm(model, kv_transfer_config=kv_transfer_config) as llm:
        computed = run_once(llm, prompt, params)
        # one more step hands the last copies to the store thread
        llm.generate(
            [{"prompt_token_ids": prompt_token_ids(3, offset=50)}],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
        pool = get_kv_transfer_group().pool
        assert pool.drain()
        stored = pool.cumulative()
    assert computed[2] == 0
    assert stored["stored_blocks"] >= 6 and stored["loaded_blocks"] == 0
    assert server.dbsize() == stored["stored_blocks"]

    with tiny_llm(model, kv_transfer_config=kv_transfer_config) as llm:
        loaded = run_once(llm, prompt, params)
        totals = get_kv_transfer_group().pool.cumulative()
    assert loaded[2] == 96  # 6 blocks from the pool, the last token computed
    assert totals["loaded_blocks"] == 6 and totals["load_failures"] == 0
    assert loaded[0] == computed[0]
    assert loaded[1] == computed[1]
