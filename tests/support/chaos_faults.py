"""The chaos test's fault injector: what it does to a real pool server.

Timed faults (``begin`` ... ``end``): ``sigstop`` (SIGSTOP, then SIGCONT:
the kernel still accepts connections, nothing answers), ``kill`` (SIGKILL,
then a new server on the same port: every value is gone), ``client_pause``
(``CLIENT PAUSE <ms> ALL``, which ends by itself), ``maxmemory``
(``maxmemory`` just above what the server holds, ``noeviction``, filled
with filler keys until it answers OOM; then the limit is lifted and the
fillers deleted).

Value faults (instant): overwrite pool values with ``corrupt_bytes``
(a run of payload bytes set to 0xff - NaN as float -, a truncated value,
or random bytes of the right length), an
``corrupt_unsigned`` value (checksum right, no MAC: the nodes run with a
shared secret) or a ``corrupt_layout`` value (signed with the right
secret, checksum right, another layout fingerprint).  Each forged value is
checked against ``codec`` here first, so a value refused for another
reason than the one meant (a changed value format) fails loudly.
"""

from __future__ import annotations

import random
import time

from vllm_overlay.core.pool import codec

TIMED = ("sigstop", "kill", "client_pause", "maxmemory")
VALUES = ("corrupt_bytes", "corrupt_unsigned", "corrupt_layout")
KINDS = TIMED + VALUES
FILLER = "chaos-filler:"
# Header fields (codec's module docstring): namespace tag, key tag, layout.
_NS, _LAYOUT = slice(8, 24), slice(32, 40)


class FaultInjector:
    def __init__(self, server, mac_key: bytes | None, seed: int) -> None:
        self.server = server
        self.mac_key = mac_key
        self.rng = random.Random(seed)
        self.counts: dict[str, int] = {k: 0 for k in KINDS}
        self.overwritten: dict[str, int] = {k: 0 for k in VALUES}
        self._fillers = 0
        self._pause_ends = 0.0
        self.layout: bytes | None = None  # the nodes' layout fingerprint

    def client(self, timeout_s: float = 5.0):
        import redis

        return redis.Redis(
            port=self.server.port,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )

    # -- timed faults --------------------------------------------------------
    def begin(self, kind: str, duration_s: float) -> None:
        self.counts[kind] += 1
        if kind == "sigstop":
            self.server.pause()
        elif kind == "kill":
            self.server.stop()
        elif kind == "client_pause":
            # Redis 7.0 pauses CLIENT UNPAUSE too: the pause ends by itself.
            with self.client() as c:
                c.execute_command("CLIENT", "PAUSE", int(duration_s * 1e3), "ALL")
            self._pause_ends = time.monotonic() + duration_s
        elif kind == "maxmemory":
            self._fill()
        else:
            raise ValueError(kind)

    def end(self, kind: str) -> None:
        if kind == "sigstop":
            self.server.resume()
        elif kind == "kill":
            self.server._spawn()  # same port and folder, empty
        elif kind == "client_pause":
            time.sleep(max(0.0, self._pause_ends - time.monotonic()) + 0.05)
        elif kind == "maxmemory":
            with self.client() as c:
                c.config_set("maxmemory", 0)
                keys = [f"{FILLER}{i}" for i in range(self._fillers)]
                for i in range(0, len(keys), 64):
                    c.delete(*keys[i : i + 64])
            self._fillers = 0

    def _fill(self) -> None:
        """``maxmemory`` a little above what the server holds, then filler
        values until a write is refused (OOM)."""
        import redis

        with self.client() as c:
            used = int(c.info("memory")["used_memory"])
            c.config_set("maxmemory-policy", "noeviction")
            c.config_set("maxmemory", used + (4 << 20))
            filler = bytes(256 << 10)
            for _ in range(200):
                try:
                    c.set(f"{FILLER}{self._fillers}", filler)
                except redis.exceptions.OutOfMemoryError:
                    return
                self._fillers += 1
        raise RuntimeError("the server never answered OOM while being filled")

    # -- value faults --------------------------------------------------------
    def pool_keys(self) -> set[bytes]:
        with self.client() as c:
            return {
                k for k in c.scan_iter(count=1000) if not k.startswith(FILLER.encode())
            }

    def overwrite(self, kind: str, keys, honest) -> int:
        """Overwrite ``keys``' values with a bad value of ``kind``; returns
        how many were overwritten (keys gone meanwhile, and values that are
        not good ones, are skipped).  ``honest``: keys just stored by a
        node, whose values name the nodes' layout."""
        self.counts[kind] += 1
        done = 0
        with self.client() as c:
            if self.layout is None:
                for key in honest:
                    value = c.get(key)
                    if value is not None and len(value) >= codec.HEADER_BYTES:
                        self.layout = value[_LAYOUT]
                        break
            for i, key in enumerate(sorted(keys)):
                value = c.get(key)
                bad = None if value is None else self.forge(kind, key, value, i)
                if bad is not None:
                    c.set(key, bad)
                    done += 1
        self.overwritten[kind] += done
        return done

    def forge(self, kind: str, key: bytes, value: bytes, i: int) -> bytes | None:
        """A bad value of ``kind`` made from ``value``; None when ``value``
        is not a good one (overwritten before and kept: not deleted)."""
        head, payload = value[: codec.HEADER_BYTES], value[codec.HEADER_BYTES :]
        ns, layout = head[_NS], self.layout
        if layout is None or len(head) < codec.HEADER_BYTES:
            return None
        try:
            codec.check(ns, key, head, payload, len(payload), layout, self.mac_key)
        except codec.BadValue:
            return None
        if kind == "corrupt_bytes":
            variant = i % 3
            if variant == 0:  # a run of payload bytes set to 0xff (NaN)
                bad = bytearray(value)
                at = codec.HEADER_BYTES + self.rng.randrange(len(payload) - 64)
                bad[at : at + 64] = b"\xff" * 64
                return bytes(bad)
            if variant == 1:  # truncated
                return value[: len(value) - 1000]
            return self.rng.randbytes(len(value))  # noise
        if kind == "corrupt_unsigned":
            forged = codec.encode(ns, key, payload, layout, mac_key=None)
            self._refused_for(forged, key, ns, layout, "signature")
            return forged
        if kind == "corrupt_layout":
            other = codec.layout_tag(f"chaos: not this node's layout {i}")
            forged = codec.encode(ns, key, payload, other, self.mac_key)
            self._refused_for(forged, key, ns, layout, "layout")
            # With the forged layout it would be accepted: only the
            # layout is wrong.
            fh, fp = forged[: codec.HEADER_BYTES], forged[codec.HEADER_BYTES :]
            codec.check(ns, key, fh, fp, len(fp), other, self.mac_key)
            return forged
        raise ValueError(kind)

    def _refused_for(self, forged, key, ns, layout, why: str) -> None:
        head, payload = forged[: codec.HEADER_BYTES], forged[codec.HEADER_BYTES :]
        try:
            codec.check(ns, key, head, payload, len(payload), layout, self.mac_key)
        except codec.BadValue as exc:
            if why == "signature" and exc.signature:
                return
            if why == "layout" and "layout" in str(exc):
                return
            raise AssertionError(
                f"chaos injector: a value forged for a {why} refusal was "
                f"refused for something else ({exc}): has the value format "
                "changed?"
            ) from exc
        raise AssertionError(
            f"chaos injector: a value forged for a {why} refusal passes the check"
        )

    def sample(self, keys, share: float) -> set[bytes]:
        keys = sorted(keys)
        return set(self.rng.sample(keys, int(len(keys) * share)))


def schedule(
    seed: int,
    faults: int,
    first: int = 0,
    gap_s=(3.0, 7.0),
    duration_s=(2.0, 4.0),
    kinds=KINDS,
):
    """A seeded list of (gap before, kind, duration): ``kinds`` in turn
    from ``kinds[first]`` (every kind once when ``faults`` allows), in a
    seeded order, with seeded gaps and durations."""
    rng = random.Random(seed)
    kinds = [kinds[(first + i) % len(kinds)] for i in range(faults)]
    rng.shuffle(kinds)
    return [(rng.uniform(*gap_s), kind, rng.uniform(*duration_s)) for kind in kinds]
