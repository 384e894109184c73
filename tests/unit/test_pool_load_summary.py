"""``LoadSummary`` and ``log_refusal`` (core/pool/refusals.py), how both
adapters (the 0.11.2 connector's worker, the 0.32 pool tier) sum up one
load's values and report them: real values checked by ``codec`` (good,
corrupt, missing, another layout, signed for a node without the secret),
reported to a real ``KVPool`` on a real server: the counts, the refused
values that are deleted (and those left), one rate-limited warning that
names the value and why.  No vLLM."""

from __future__ import annotations

import functools
import logging
import pathlib
import sys

import redis

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from support.log_records import LogRecords as _Records  # noqa: E402
from support.redis_server import redis_server  # noqa: E402
from unit.test_pool_liveness import _pool  # noqa: E402

from vllm_overlay.core.pool import codec  # noqa: E402
from vllm_overlay.core.pool.keys import pool_key  # noqa: E402
from vllm_overlay.core.pool.ratelog import RateLimitedLog  # noqa: E402
from vllm_overlay.core.pool.refusals import (  # noqa: E402
    LoadSummary,
    key_label,
    log_refusal,
)

NS = b"n" * 16
LAYOUT = codec.layout_tag("summary test")
PAYLOAD = bytes(range(64))


def _values(keys):
    """(key, value or None) as a reader finds them: good, corrupt, missing,
    another layout (left), signed by a node with a secret (left)."""
    good = codec.encode(NS, keys[0], PAYLOAD, LAYOUT)
    corrupt = bytearray(codec.encode(NS, keys[1], PAYLOAD, LAYOUT))
    corrupt[-1] ^= 0xFF
    other = codec.encode(NS, keys[3], PAYLOAD, codec.layout_tag("another"))
    signed = codec.encode(NS, keys[4], PAYLOAD, LAYOUT, b"s" * 32)
    return [good, bytes(corrupt), None, other, signed]


def _verdicts(keys, values):
    """What ``codec.LandedChecks`` gives: each value checked (one buffer)."""

    def refusal(i, value):
        if value is None:
            return codec.refusal(NS, keys[i], None, None, len(PAYLOAD), LAYOUT)
        try:
            codec.decode(NS, keys[i], value, len(PAYLOAD), LAYOUT)
        except codec.BadValue as exc:
            return exc
        return None

    checks = codec.LandedChecks(len(keys), refusal)
    for i, value in enumerate(values):
        if value is not None:
            checks.landed(i, value)
    return checks.verdicts(values)


def test_a_loads_values_are_summed_up_by_position():
    keys = [pool_key(NS, bytes([i]) * 32, 0) for i in range(5)]
    summary = LoadSummary.of(keys, _verdicts(keys, _values(keys)))
    assert summary.good == [0]
    assert summary.failed == [1, 2, 3, 4]
    assert summary.refused == [1, 3, 4]  # the missing one is not refused
    assert summary.delete == [keys[1]]  # corrupt; the others are good elsewhere
    assert [k for k, _ in summary.refusals] == [keys[1], keys[3], keys[4]]
    assert summary.bad_signatures == 1  # signed, and this node has no secret
    failed = LoadSummary.all_failed(3)
    assert (failed.good, failed.failed, failed.refused) == ([], [0, 1, 2], [])


def test_a_summary_is_counted_logged_and_its_refused_values_deleted():
    logger = logging.getLogger("vllm_overlay.test.load_summary")
    records = _Records()
    logger.addHandler(records)
    with redis_server() as server:
        pool = _pool(server.url)
        try:
            keys = [pool_key(NS, bytes([i]) * 32, 0) for i in range(5)]
            values = _values(keys)
            client = redis.Redis(port=server.port)
            for key, value in zip(keys, values):
                if value is not None:
                    client.set(key, value)
            summary = LoadSummary.of(keys, _verdicts(keys, values))
            log = RateLimitedLog(logger, 60.0)
            who = "vllm-overlay KV pool test"
            summary.report(pool, functools.partial(log_refusal, log, who))
            assert pool.drain()
            stats = pool.cumulative()
            assert stats["loaded_blocks"] == 1 and stats["load_failures"] == 4
            assert stats["bad_signatures"] == 1
            assert [client.exists(k) for k in keys] == [1, 0, 0, 1, 1]
            (record,) = records.records  # three refusals, rate-limited to one
            message = record.getMessage()
            assert message.startswith("vllm-overlay KV pool test: value r0:")
            assert key_label(keys[1]) in message and keys[1].decode() not in message
            assert "checksum mismatch" in message and "deleted" in message
            # The refusal is the second argument (chaos tests count by it).
            assert isinstance(record.args[1], codec.BadValue)
        finally:
            pool.close()
            logger.removeHandler(records)
