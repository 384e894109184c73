"""The pool's I/O path: the RESP reader that reads values straight into
staging memory, and the worker's staging rings (no allocation per step)."""

from __future__ import annotations

import pathlib
import sys
import time
import types

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from support.redis_server import redis_server  # noqa: E402

from vllm_overlay.core.pool import codec  # noqa: E402
from vllm_overlay.core.pool.config import PoolConfig  # noqa: E402
from vllm_overlay.core.pool.pool import KVPool  # noqa: E402
from vllm_overlay.core.pool.resp import InPlace, RespReader  # noqa: E402

NS = b"n" * 16
LAYOUT = codec.layout_tag("test")


class ChunkedSocket:
    """Delivers ``data`` at most ``chunk`` bytes per ``recv_into``."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data = data
        self.chunk = chunk
        self.pos = 0
        self.calls = 0

    def recv_into(self, view, nbytes=0):
        self.calls += 1
        n = min(nbytes or len(view), len(view), self.chunk, len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def into_rows(head: bytearray, body: bytearray):
    """``into`` for one value: its first len(head) bytes to ``head``, the
    rest to ``body``, when the length is exactly theirs."""

    def into(length):
        if length != len(head) + len(body):
            return None
        return [memoryview(head), memoryview(body)]

    return into


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("buffer_bytes", [8, 64, 1 << 16])
def test_bulk_strings_land_exactly_in_the_callers_buffers(chunk, buffer_bytes):
    values = [bytes((i * 7 + j) % 251 for j in range(300)) for i in range(3)]
    sock = ChunkedSocket(b"".join(bulk(v) for v in values), chunk)
    reader = RespReader(sock, buffer_bytes=buffer_bytes)
    for value in values:
        head, body = bytearray(72), bytearray(228)
        assert isinstance(reader.reply(into_rows(head, body)), InPlace)
        assert bytes(head) + bytes(body) == value
    assert reader.buffered == 0 and sock.pos == len(sock.data)


def test_a_large_value_is_read_with_few_calls_straight_into_place():
    """Beyond what the line buffer already holds, each socket read goes
    to the destination: one call per chunk the socket has."""
    value = bytes(range(256)) * 4096  # 1 MiB
    sock = ChunkedSocket(bulk(value), 256 << 10)
    reader = RespReader(sock, buffer_bytes=4096)
    head, body = bytearray(72), bytearray(len(value) - 72)
    assert reader.reply(into_rows(head, body)).length == len(value)
    assert bytes(head + body) == value
    assert sock.calls <= 6  # line buffer, 4 chunks of the rest, the CRLF


def test_nil_missing_keys_errors_and_other_replies_mid_pipeline():
    stream = (
        bulk(b"first")
        + b"$-1\r\n"  # a missing key (RESP2)
        + b"-WRONGTYPE Operation against a key holding the wrong kind\r\n"
        + b"_\r\n"  # RESP3 null
        + b":1\r\n+OK\r\n*2\r\n:0\r\n$1\r\nx\r\n"
        + bulk(b"last")
    )
    for chunk in (1, 5, 1000):
        reader = RespReader(ChunkedSocket(stream, chunk), buffer_bytes=16)
        assert reader.reply() == b"first"
        assert reader.reply() is None
        error = reader.reply()
        assert isinstance(error, Exception) and str(error).startswith("WRONGTYPE")
        assert reader.reply() is None
        assert [reader.reply(), reader.reply(), reader.reply()] == [1, b"OK", [0, b"x"]]
        assert reader.reply() == b"last"


def test_a_value_of_another_length_comes_back_as_bytes():
    head, body = bytearray(4), bytearray(4)
    reader = RespReader(ChunkedSocket(bulk(b"123456789") + bulk(b"abcdefgh"), 3))
    assert reader.reply(into_rows(head, body)) == b"123456789"
    assert isinstance(reader.reply(into_rows(head, body)), InPlace)
    assert bytes(head + body) == b"abcdefgh"


def test_a_long_error_line_grows_the_buffer():
    text = b"-ERR " + b"x" * 5000 + b"\r\n"
    reader = RespReader(ChunkedSocket(text + bulk(b"ok"), 100), buffer_bytes=64)
    assert str(reader.reply()) == "ERR " + "x" * 5000
    assert reader.reply() == b"ok"


def test_a_connection_closed_mid_value_and_a_broken_stream_raise():
    import redis

    head, body = bytearray(8), bytearray(92)
    reader = RespReader(ChunkedSocket(b"$100\r\n" + b"z" * 50, 7))
    with pytest.raises(redis.ConnectionError):
        reader.reply(into_rows(head, body))
    reader = RespReader(ChunkedSocket(b"$2\r\nabXY", 7))
    with pytest.raises(redis.InvalidResponse):
        reader.reply()
    reader = RespReader(ChunkedSocket(b"?what\r\n", 7))
    with pytest.raises(redis.InvalidResponse):
        reader.reply()


def test_the_pool_reads_values_into_place_and_reports_the_rest(server_kind):
    """A real server: in-place values, a value of another length (bytes),
    a missing key and a WRONGTYPE key in one pipeline."""
    payload = bytes(range(256)) * 8
    keys = [b"a", b"short", b"missing", b"list", b"b"]
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url))
        try:
            values = [
                (k, codec.encode(NS, k, payload, LAYOUT)) for k in (b"a", b"b")
            ] + [(b"short", b"tiny")]
            assert pool.submit_store(values) == 3 and pool.drain()
            server.cli("rpush", "list", "x")
            value_bytes = codec.HEADER_BYTES + len(payload)
            heads = [bytearray(codec.HEADER_BYTES) for _ in keys]
            rows = [bytearray(len(payload)) for _ in keys]

            def into(i, length):
                if length != value_bytes:
                    return None
                return [memoryview(heads[i]), memoryview(rows[i])]

            pool.submit_load("j", keys, value_bytes, into=into)
            assert pool.drain()
            ((_, got),) = pool.poll_loads()
            assert [type(v).__name__ for v in got] == [
                "InPlace",
                "bytes",
                "NoneType",
                "NoneType",
                "InPlace",
            ]
            assert got[1] == b"tiny"
            for i in (0, 4):
                codec.check(NS, keys[i], heads[i], rows[i], len(payload), LAYOUT)
                assert bytes(rows[i]) == payload
            stats = pool.cumulative()
            assert stats["bad_keys"] == 1
            assert stats["bytes_in"] == 2 * value_bytes + 4
            assert pool.drain()
            assert server.cli("exists", "list") == "0"  # deleted
        finally:
            pool.close()


def test_stores_send_header_and_payload_as_separate_buffers(server_kind):
    """The value stored is exactly header + payload, from two buffers;
    with a TTL too."""
    payload = memoryview(bytearray(b"p" * 10000))
    head = codec.encode_header(NS, b"k", payload, LAYOUT)
    with redis_server(kind=server_kind) as server:
        pool = KVPool(PoolConfig(url=server.url, ttl_s=100))
        done = []
        try:
            assert pool.submit_store(
                [(b"k", payload)],
                encode=lambda k, p: (head, p),
                on_done=done.append,
            )
            assert pool.drain() and [d.complete for d in done] == [True]
            client = __import__("redis").Redis(port=server.port)
            assert client.get(b"k") == head + bytes(payload)
            assert 0 < client.ttl(b"k") <= 100
            assert pool.cumulative()["bytes_out"] == len(head) + len(payload)
        finally:
            pool.close()
    # Nothing admitted: on_done runs at once, nothing stored.
    pool = KVPool(PoolConfig(url="redis://127.0.0.1:1", max_inflight_bytes=10))
    try:
        done.clear()
        stored = pool.submit_store([(b"k", b"x" * 100)], on_done=done.append)
        assert stored == 0 and [(d.total, d.complete) for d in done] == [(1, False)]
    finally:
        pool.close()


# -- the staging ring ---------------------------------------------------------
def test_ring_hands_out_contiguous_spans_and_reuses_them():
    from vllm_overlay.connectors.shared_pool.staging import StagingRing

    ring = StagingRing(10, 16)
    ptr = ring.rows.data_ptr()
    assert ring.alloc(4) == (0, 4)
    assert ring.alloc(4) == (4, 4)
    assert ring.alloc(4) == (8, 2)  # the longest span that fits
    assert ring.alloc(1) == (0, 0)  # full
    ring.release(4)  # out of order: kept until 0 is released
    assert ring.alloc(1) == (0, 0)
    ring.release(0)
    assert ring.alloc(6) == (0, 6)  # wrapped around to the freed rows
    ring.release(8)
    ring.release(0)
    assert ring.in_use == 0
    assert ring.alloc(10) == (0, 10)
    assert ring.rows.data_ptr() == ptr and ring.allocations == 1


def _worker(pool, blocks: int = 12, block_words: int = 512, layers: int = 1):
    """A worker on a CPU cache ``[blocks, block_words]`` (float32).  One
    layer: each block is one run, loads are read straight into the cache;
    two layers (the cache's halves as two tensors): two runs per block,
    loads go through the load ring and a scatter."""
    from vllm_overlay.connectors.shared_pool.worker import SharedPoolWorker
    from vllm_overlay.core.ops.block_copy import BlockTable

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=1))
    worker = SharedPoolWorker(config, NS, pool)
    cache = torch.zeros(blocks, block_words, dtype=torch.float32)
    if layers == 1:
        tensors = [cache]
    else:
        storage = torch.zeros(layers, blocks, block_words // layers)
        tensors = list(storage.unbind(0))
        cache = _LayerView(storage)
    worker._set_table(BlockTable.from_tensors(tensors, 0), "test", LAYOUT)
    assert (worker._cache_rows is not None) == (layers == 1)
    return worker, cache


class _LayerView:
    """Blocks of a per-layer cache ``[layers, blocks, words]`` as rows
    ``[blocks, layers * words]`` (copies out, writes through)."""

    def __init__(self, storage: torch.Tensor) -> None:
        self.storage = storage

    def __getitem__(self, ids):
        return self.storage[:, ids].permute(1, 0, 2).reshape(len(ids), -1)

    def copy_(self, rows: torch.Tensor) -> None:
        n = self.storage.shape[1]
        self.storage.copy_(rows.reshape(n, self.storage.shape[0], -1).transpose(0, 1))

    def randomize(self) -> None:
        self.storage.copy_(torch.randn_like(self.storage))


def _meta(loads=None, stores=None):
    from vllm_overlay.connectors.shared_pool.common import PoolMetadata

    return PoolMetadata(loads=loads or {}, stores=stores or {})


def _until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.005)
    raise AssertionError("timed out")


@pytest.mark.parametrize("layers", [1, 2], ids=["direct", "staged"])
def test_blocks_round_trip_through_the_rings_without_allocating_staging(
    server_kind, monkeypatch, layers
):
    """Worker A stores blocks step after step, worker B loads them into
    another cache: the bytes arrive, and after registration no staging
    memory is allocated (torch.empty/zeros and pinned allocations are
    counted; the rings' buffers stay the same).  Direct loads (one run per
    block) never scatter; staged ones scatter once per load."""
    from vllm_overlay.connectors.shared_pool import worker as worker_module

    scatters = []
    real_scatter = worker_module.SharedPoolWorker._scatter
    monkeypatch.setattr(
        worker_module.SharedPoolWorker,
        "_scatter",
        lambda self, *a: scatters.append(a) or real_scatter(self, *a),
    )
    with redis_server(kind=server_kind) as server:
        pool_a, pool_b = (KVPool(PoolConfig(url=server.url)) for _ in range(2))
        try:
            a, cache_a = _worker(pool_a, layers=layers)
            b, cache_b = _worker(pool_b, layers=layers)
            if layers == 1:
                cache_a.copy_(torch.randn_like(cache_a))
            else:
                cache_a.randomize()
            rings = [w._store_ring.rows.data_ptr() for w in (a, b)]
            rings += [w._load_ring.rows.data_ptr() for w in (a, b)]
            big = []
            for name in ("empty", "zeros", "ones"):
                real = getattr(torch, name)

                def counting(*args, _real=real, **kwargs):
                    out = _real(*args, **kwargs)
                    if out.nbytes >= 1024:
                        big.append(out.nbytes)
                    return out

                monkeypatch.setattr(torch, name, counting)
            chains = {}
            for step in range(4):  # three blocks a step, 12 in all
                ids = [3 * step, 3 * step + 1, 3 * step + 2]
                chain = [b"h%d" % i for i in ids]
                chains[step] = (ids, chain)
                a.wait_for_save(_meta(stores={f"r{step}": (ids, chain)}))
                a.get_finished(set())
            assert pool_a.drain()
            assert pool_a.cumulative()["stored_blocks"] == 12
            for step in range(4):  # loaded into other blocks of B's cache
                ids, chain = chains[step]
                target = [11 - i for i in ids]
                b.start_load_kv(_meta(loads={f"l{step}": (target, chain)}))
                _until(lambda: b.get_finished(set())[1])
                assert not b.get_block_ids_with_load_errors()
                assert torch.equal(cache_b[target], cache_a[ids])
            assert big == []
            assert len(scatters) == (0 if layers == 1 else 4)
            assert [w._store_ring.rows.data_ptr() for w in (a, b)] + [
                w._load_ring.rows.data_ptr() for w in (a, b)
            ] == rings
            assert a._store_ring.in_use == 0 and b._load_ring.in_use == 0
            assert pool_b.cumulative()["loaded_blocks"] == 12
        finally:
            pool_a.close()
            pool_b.close()


def test_a_corrupt_value_read_in_place_is_refused_and_deleted(server_kind):
    with redis_server(kind=server_kind) as server:
        pool_a, pool_b = (KVPool(PoolConfig(url=server.url)) for _ in range(2))
        try:
            a, cache_a = _worker(pool_a, blocks=4)
            b, cache_b = _worker(pool_b, blocks=4)
            cache_a.copy_(torch.randn_like(cache_a))
            chain = [b"c0", b"c1", b"c2"]
            a.wait_for_save(_meta(stores={"r": ([0, 1, 2], chain)}))
            a.get_finished(set())
            assert pool_a.drain()
            key = a._key(b"c1")
            server.cli("setrange", key.decode(), "500", "garbage!")
            b.start_load_kv(_meta(loads={"l": ([1, 2, 3], chain)}))
            _until(lambda: b.get_finished(set())[1])
            assert b.get_block_ids_with_load_errors() == {2}
            assert torch.equal(cache_b[[1, 3]], cache_a[[0, 2]])
            assert pool_b.drain()
            assert server.cli("exists", key.decode()) == "0"
            assert pool_b.cumulative()["load_failures"] == 1
        finally:
            pool_a.close()
            pool_b.close()


@pytest.mark.parametrize("layers", [1, 2], ids=["direct", "staged"])
def test_a_request_finished_mid_load_is_released_only_after_the_load(
    server_kind, layers
):
    """The server holds the load back (CLIENT PAUSE); the request finishes
    meanwhile.  It is never reported as received, it is reported finished
    (sending: the scheduler then frees its blocks) only once the load
    thread is done with them, and a staged load is not scattered."""
    with redis_server(kind=server_kind) as server:
        pool_a, pool_b = (KVPool(PoolConfig(url=server.url)) for _ in range(2))
        try:
            a, cache_a = _worker(pool_a, blocks=4, layers=layers)
            b, cache_b = _worker(pool_b, blocks=4, layers=layers)
            chain = [b"d0", b"d1"]
            a.wait_for_save(_meta(stores={"r": ([0, 1], chain)}))
            a.get_finished(set())
            assert pool_a.drain()
            b.get_finished(set())  # connects the load thread's client
            server.cli("client", "pause", "400", "all")
            b.start_load_kv(_meta(loads={"L": ([2, 3], chain)}))
            done, _ = b.get_finished({"L"})  # L finished: its load is not
            assert not done
            assert pool_b._pending_loads == 1
            reported = []
            deadline = time.monotonic() + 10
            while not reported:
                assert time.monotonic() < deadline
                pending = pool_b._pending_loads
                sending, recving = b.get_finished(set())
                assert not recving
                if sending:
                    assert sending == {"L"} and pending == 0
                    reported.append(sending)
                time.sleep(0.005)
            assert b.get_finished(set()) == (None, None)
            assert b._load_ring.in_use == 0 and not b._aborted_loads
            if layers == 2:  # staged: never scattered into the blocks
                assert not cache_b[[2, 3]].any()
        finally:
            pool_a.close()
            pool_b.close()
