"""What became of one load's values, summed up once for both adapters (the
0.11.2 connector's worker, ``connectors/shared_pool/loads.py``, and the
0.32 pool tier, ``integration/v0_32/pool_tier/tier.py``): which values are
good, which blocks are recomputed, which values were refused by their check
(integrity: checksum, MAC, layout, namespace, length) and of those which
are deleted, and how the refusals are counted and logged.

``codec.LandedChecks`` gives each value's verdict (its refusal, whether a
value came); ``LoadSummary.of`` sums them up (on the load thread: it is
pure work), and ``LoadSummary.report`` tells the pool on the adapter's
thread: the load's counts (``record_load``), one rate-limited warning per
refused value (``log_refusal``) and the deletes (a refused value is never
loaded again; the next honest store writes the block again).  Each adapter
maps the positions to what its vLLM release names: block ids (0.11.2) or
chunk keys (0.32)."""

from __future__ import annotations

import dataclasses
import logging

from vllm_overlay.core.pool.codec import BadValue
from vllm_overlay.core.pool.ratelog import RateLimitedLog


@dataclasses.dataclass(slots=True)
class LoadSummary:
    """One load's values by position (the order of its keys)."""

    good: list[int] = dataclasses.field(default_factory=list)
    failed: list[int] = dataclasses.field(default_factory=list)  # recomputed
    # Of ``failed``: a value came and failed its check (not a transient
    # failure: missing, cut off, over a limit).
    refused: list[int] = dataclasses.field(default_factory=list)
    delete: list[bytes] = dataclasses.field(default_factory=list)  # keys
    refusals: list[tuple[bytes, BadValue]] = dataclasses.field(default_factory=list)
    bad_signatures: int = 0

    @classmethod
    def of(cls, keys: list[bytes], verdicts) -> LoadSummary:
        """``verdicts``: per key, (its refusal or None, whether a value
        came), as ``codec.LandedChecks.verdicts`` gives them."""
        out = cls()
        for i, (key, (exc, came)) in enumerate(zip(keys, verdicts)):
            if exc is None:
                out.good.append(i)
                continue
            out.failed.append(i)
            if came:  # refused by its check: integrity
                out.refused.append(i)
                out.refusals.append((key, exc))
                out.bad_signatures += exc.signature
                if exc.delete:
                    out.delete.append(key)
        return out

    @classmethod
    def all_failed(cls, n: int) -> LoadSummary:
        """A load whose checks could not be made (preparing it failed,
        logged by the pool): every block is recomputed, none refused."""
        return cls(failed=list(range(n)))

    def report(self, pool, log_refusal) -> None:
        """Tell the pool (``KVPool``): the load's counts, each refusal
        (``log_refusal(key, exc)``, e.g. ``log_refusal`` below), and the
        refused values to delete.  Never waits (deletes are queued)."""
        pool.record_load(len(self.good), len(self.failed), self.bad_signatures)
        for key, exc in self.refusals:
            log_refusal(key, exc)
        if self.delete:
            pool.submit_delete(self.delete)


def key_label(key: bytes) -> str:
    """A pool key in a log line: its rank and the start of its block part
    (``r0:0123456789ab``), never the whole key."""
    parts = key.rsplit(b":", 2)
    return b":".join(parts[-2:])[:15].decode(errors="replace")


def log_refusal(log: RateLimitedLog, who: str, key: bytes, exc: BadValue) -> bool:
    """One warning for a refused value (topic ``"refused"``, at most one a
    ``log`` interval; the ones held back are counted in the next): ``who``
    (e.g. ``"vllm-overlay KV pool"``) then which value, why (``exc``, the
    second argument), whether it was deleted."""
    return log.log(
        logging.WARNING,
        "refused",
        f"{who}: value %s refused (%s); %s; its block is recomputed",
        key_label(key),
        exc,
        "deleted" if exc.delete else "left in the pool",
    )
