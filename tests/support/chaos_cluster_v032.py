"""The 0.32 chaos test's processes: chaos_cluster.py's server, secret, two
pool nodes and stock node, with what the 0.32 node faults need:

* node ``a`` reaches the pool through a proxy in this process
  (``SwitchableProxy``) that passes its bytes freely until the ``slow_reset``
  fault makes its link slow (and healthy: every value still well inside the
  pool's deadlines), then free again; its ``io_timeout_s`` is 5 s
  (``SLOW_NODE_POOL``; 10 s by default, node ``b``'s), so its tier's drain
  gives up after 8 s (``io_timeout_s + timeout_s + 2 s``) instead of 13 s:
  the fault queues less and blocks the engine less;
* with ``layouts``, a third pool node ``c`` whose KV cache has another
  layout (``VLLM_KV_CACHE_LAYOUT=BLHNC``, cross-layer blocks: patch CL32-01;
  ``a`` and ``b`` run 0.32 CPU's default per-layer ``LBHNC``) on the same
  pool (``cluster.nodes[2]``: no background traffic, only the ``layouts``
  fault's requests);
* ``weights``: each node's weights version, the seeds of the in-place
  updates it had, in order (``weights_update``; the stock node is set to a
  request's version before it computes that request)."""

from __future__ import annotations

import contextlib
import os
import socket
import time

from support.chaos_cluster import HERE, POOL_OPTIONS, Cluster, NodeProc
from support.throttle_proxy import ThrottledProxy
from vllm_overlay.testing.redis import DEFAULT_KIND

NODE_SCRIPT_V032 = HERE / "chaos_node_v032.py"
LAYOUT_NODE_ENV = {"VLLM_KV_CACHE_LAYOUT": "BLHNC"}  # a, b: the default LBHNC
SLOW_NODE_POOL = {"io_timeout_s": 5.0}  # node a's (the slow_reset fault's)


class SwitchableProxy(ThrottledProxy):
    """``ThrottledProxy`` whose client-to-server rate is switched while its
    connections stay open: free (``free()``), or ``throttle(rate)`` bytes a
    second per connection, counted from the switch."""

    def __init__(self, port: int) -> None:
        self._limit: float | None = None
        self._since = 0.0
        self._epoch = 0
        self.throttled_bytes = 0  # client bytes passed while throttled
        super().__init__(port, rate_bytes_s=1.0)  # marks the paced direction

    def throttle(self, rate_bytes_s: float) -> None:
        with self._lock:
            self._limit, self._since = float(rate_bytes_s), time.monotonic()
            self._epoch += 1

    def free(self) -> None:
        with self._lock:
            self._limit = None
            self._epoch += 1

    def _forward(self, src, dst, rate: float, pair) -> None:
        if not rate:  # the server's replies: free
            return super()._forward(src, dst, 0, pair)
        epoch, passed = -1, 0
        try:
            while True:
                limit, since = self._limit, self._since
                if self._epoch != epoch:
                    epoch, passed = self._epoch, 0
                if limit:  # no more than limit * (now - since) bytes
                    ahead = passed / limit - (time.monotonic() - since)
                    if ahead > 0:
                        time.sleep(min(ahead, 0.05))  # (sees a switch)
                        continue
                data = src.recv(self.chunk if limit else 1 << 16)
                if not data:
                    break
                dst.sendall(data)
                if limit:
                    passed += len(data)
                    with self._lock:
                        self.throttled_bytes += len(data)
        except OSError:
            pass
        finally:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()


class Cluster032(Cluster):
    """``Cluster`` for vLLM 0.32 nodes (chaos_node_v032.py), node ``a``
    behind a ``SwitchableProxy``; ``layouts``: also node ``c``."""

    def __init__(
        self,
        workdir,
        stock: bool = True,
        num_blocks: int = 48,
        kind: str = DEFAULT_KIND,
        layouts: bool = True,
    ) -> None:
        # Cluster's own start, with node a's url through the proxy: the
        # server first, the proxy on its port, then the nodes.
        from support.redis_server import RedisServer

        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.secret_file = workdir / "pool-secret"
        self.secret_file.write_text(os.urandom(32).hex())
        self.server = RedisServer(kind=kind)
        self.proxy = SwitchableProxy(self.server.port)
        pool = {**POOL_OPTIONS, "secret_file": str(self.secret_file)}
        env = _node_env()
        urls = {"a": self.proxy.url, "b": self.server.url}
        names = ("a", "b", "c") if layouts else ("a", "b")
        self.nodes = [
            NodeProc(
                name,
                {
                    "url": urls.get(name, self.server.url),
                    "pool": {**pool, **(SLOW_NODE_POOL if name == "a" else {})},
                    "num_blocks": num_blocks,
                },
                workdir,
                {**env, **(LAYOUT_NODE_ENV if name == "c" else {})},
                NODE_SCRIPT_V032,
            )
            for name in names
        ]
        self.stock = (
            NodeProc(
                "stock",
                {"url": None, "num_blocks": 256, "logprobs": True},
                workdir,
                {**env, "VLLM_OVERLAY_DISABLE": "1"},
                NODE_SCRIPT_V032,
            )
            if stock
            else None
        )
        self.weights: dict[int, tuple] = {i: () for i in range(len(self.nodes))}
        self.weight_marks: list[dict] = []  # one per node update (chaos_identity)

    @property
    def layout_node(self) -> int | None:
        return 2 if len(self.nodes) > 2 else None

    def close(self) -> None:
        self.proxy.free()
        super().close()
        self.proxy.close()


def _node_env() -> dict:
    """chaos_cluster's node environment (one compute thread per engine)."""
    return {
        "TORCHDYNAMO_DISABLE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
