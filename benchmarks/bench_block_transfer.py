"""KV block transfer throughput: vLLM 0.11.2's copy path vs cross-layer blocks.

For each model shape, block count and direction (device->host "d2h",
host->device "h2d"), moves the same random blocks (bf16, 16-token blocks)
with each method below; all move the same bytes.

  stock         vLLM 0.11.2 swap_blocks call pattern, C++ port
                (``stock_swap.py``): per-layer caches ``(2, blocks, ...)``
                (FlashAttention NHD), per-layer pinned host tensors as
                vLLM's offloading handler allocates them; per layer
                ``swap_blocks(K)`` then ``swap_blocks(V)`` with one int64 CPU
                ``(src, dst)`` mapping, each issuing one cudaMemcpyAsync per
                block on the current stream (on CPU: "C++ loop port of
                swap_blocks (CPU)", one std::memcpy per block).
                2 x layers op calls, 2 x layers x blocks copies.
  cross-swap    cross-layer buffer, the same swap_blocks port called once
                (one copy per block; the call vLLM 0.12 makes for
                cross-layer blocks)
  cross-dma     cross-layer buffer, overlay ``dma_copy``: one Tensor.copy_
                per run from Python (consecutive ids merge)
  cross-triton  cross-layer buffer, overlay ``triton_copy``: one Triton
                launch, zero copy into/out of pinned host memory (GPU only)
  layer-triton  per-layer caches (the stock layout), one Triton launch,
                zero copy (GPU only)
  contig        one contiguous copy of the same number of bytes
  py-loop       only when the stock port cannot be built (no compiler, or
                ``--no-stock-port``): the earlier Python loop, one
                Tensor.copy_ per layer per K/V per block.  NOT vLLM's code
                path (vLLM loops in C++); ratios then use it as the unit.

Block ids are CPU int64 tensors for every method (as the scheduler hands
them over; the Triton path copies them to the device itself).  Every
method's bytes are checked against the torch reference before timing.
Methods are interleaved (ABAB...) over ``--repeats`` rounds after a
warm-up; each cell is the median, timed with CUDA events on a GPU
(perf_counter on CPU); "spread" is the widest (max-min)/median of the row.
On a GPU the table is absolute GB/s and a peak pinned memcpy (one 1 GiB
contiguous copy each way) is measured first; on CPU only ratios.

    python benchmarks/bench_block_transfer.py            # GPU if present
    python benchmarks/bench_block_transfer.py --quick    # CI-sized CPU run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stock_swap  # noqa: E402

from vllm_overlay.core.ops.block_copy import (  # noqa: E402
    BlockTable,
    _word_size,
    gather,
    scatter,
)

# name: (layers, kv heads, head size); bf16, 16-token blocks.
SHAPES = {
    "llama3.1-8b": (32, 8, 128),
    "llama3.1-70b-tp8": (80, 1, 128),
}
BLOCK_TOKENS = 16
DTYPE = torch.bfloat16


class Caches:
    """The same KV data in both layouts, plus pinned host pools."""

    def __init__(
        self,
        shape: tuple[int, int, int],
        num_blocks: int,
        host_rows: int,
        device: str,
        stock: bool,
    ) -> None:
        layers, heads, head = shape
        self.device = device
        self.cross = torch.randn(
            num_blocks, layers, 2, BLOCK_TOKENS, heads, head, dtype=DTYPE, device=device
        )
        # Stock: per layer (2, blocks, tokens, heads, head), flash-attn NHD.
        self.per_layer = [
            self.cross[:, layer].transpose(0, 1).contiguous() for layer in range(layers)
        ]
        self.cross_table = BlockTable.from_tensors([self.cross], 0)
        self.layer_table = BlockTable.from_tensors(self.per_layer, 1)
        self.block_bytes = self.cross_table.block_bytes
        pin = device == "cuda"
        self.host = torch.empty(
            host_rows, self.block_bytes, dtype=torch.uint8, pin_memory=pin
        )
        # vLLM's handler: one pinned host tensor per layer, GPU shape.
        self.layer_host = (
            list(
                torch.empty(
                    layers,
                    2,
                    host_rows,
                    BLOCK_TOKENS,
                    heads,
                    head,
                    dtype=DTYPE,
                    pin_memory=pin,
                ).unbind(0)
            )
            if stock
            else []
        )
        self.flat_dev = torch.empty(
            host_rows * self.block_bytes, dtype=torch.uint8, device=device
        )


class Timer:
    def __init__(self, device: str) -> None:
        self.gpu = device == "cuda"

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def once(self, fn, inner: int) -> float:
        """Seconds per call, averaged over ``inner`` back-to-back calls."""
        self.sync()
        if self.gpu:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - start) / inner

    def interleaved(
        self, fns: dict, repeats: int, inner: int
    ) -> dict[str, list[float]]:
        """Warm each method up, then time them round-robin (ABAB...),
        alternating the order each round."""
        for fn in fns.values():
            fn()
        self.sync()
        samples: dict[str, list[float]] = {m: [] for m in fns}
        for r in range(repeats):
            for m in list(fns) if r % 2 == 0 else list(reversed(fns)):
                samples[m].append(self.once(fns[m], inner))
        return samples


def mapping_of(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """vLLM's block mapping: int64 CPU [n, 2] of (src block, dst block)."""
    return torch.stack([src, dst], dim=1).to(torch.int64).contiguous()


def methods(c: Caches, ids: torch.Tensor, to_host: bool, gpu: bool, op):
    n = ids.numel()
    host = c.host[:n]
    rows = torch.arange(n, dtype=torch.int64)
    move = gather if to_host else scatter
    out = {}
    if op is not None:
        mapping = mapping_of(ids, rows) if to_host else mapping_of(rows, ids)
        src, dst = (
            (c.per_layer, c.layer_host) if to_host else (c.layer_host, c.per_layer)
        )
        out["stock"] = lambda src=src, dst=dst: stock_swap.swap_all_layers(
            op, src, dst, mapping, kv_first=True
        )
        cross_host = c.host.view(DTYPE).view(c.host.shape[0], -1)
        cross_dev = c.cross.view(c.cross.shape[0], -1)
        src, dst = (cross_dev, cross_host) if to_host else (cross_host, cross_dev)
        out["cross-swap"] = lambda src=src, dst=dst: op(src, dst, mapping)
    else:
        out["py-loop"] = lambda: move(c.layer_table, ids, host, "dma")
    out["cross-dma"] = lambda: move(c.cross_table, ids, host, "dma")
    if gpu:
        out["cross-triton"] = lambda: move(c.cross_table, ids, host, "triton")
        out["layer-triton"] = lambda: move(c.layer_table, ids, host, "triton")
    flat = c.flat_dev[: n * c.block_bytes]
    flat_host = host.view(-1)
    out["contig"] = (
        (lambda: flat_host.copy_(flat, non_blocking=True))
        if to_host
        else (lambda: flat.copy_(flat_host, non_blocking=True))
    )
    return out


def check_bytes(c: Caches, ids: torch.Tensor, gpu: bool, op) -> None:
    """Every method moves the reference bytes (per-layer tables pack a
    block's runs in segment order; the stock port fills vLLM's per-layer
    host tensors)."""
    n = ids.numel()
    sync = Timer(c.device).sync
    for table in (c.cross_table, c.layer_table):
        want = torch.empty(n, table.block_bytes, dtype=torch.uint8, device=c.device)
        gather(table, ids, want, "reference")
        for method in ("dma",) + (("triton",) if gpu else ()):
            got = torch.empty(n, table.block_bytes, dtype=torch.uint8, pin_memory=gpu)
            gather(table, ids, got, method)
            sync()
            if not torch.equal(got.to(want.device), want):
                sys.exit(f"byte mismatch: {method} on {table.runs_per_block}-run table")
    if op is None:
        return
    rows = torch.arange(n, dtype=torch.int64)
    # d2h: host row i of every layer holds device block ids[i].
    stock_swap.swap_all_layers(
        op, c.per_layer, c.layer_host, mapping_of(ids, rows), kv_first=True
    )
    sync()
    for dev, host in zip(c.per_layer, c.layer_host):
        if not torch.equal(host[:, :n].to(c.device), dev[:, ids]):
            sys.exit("byte mismatch: stock port d2h")
    # h2d into reversed ids, check, then put the original bytes back.
    before = [t[:, ids].clone() for t in c.per_layer]
    flipped = ids.flip(0)
    stock_swap.swap_all_layers(
        op, c.layer_host, c.per_layer, mapping_of(rows, flipped), kv_first=True
    )
    sync()
    for dev, host in zip(c.per_layer, c.layer_host):
        if not torch.equal(dev[:, flipped], host[:, :n].to(c.device)):
            sys.exit("byte mismatch: stock port h2d")
    for t, b in zip(c.per_layer, before):
        t[:, ids] = b
    cross_host = c.host.view(DTYPE).view(c.host.shape[0], -1)
    op(c.cross.view(c.cross.shape[0], -1), cross_host, mapping_of(ids, rows))
    sync()
    want = torch.empty(n, c.block_bytes, dtype=torch.uint8, device=c.device)
    gather(c.cross_table, ids, want, "reference")
    if not torch.equal(c.host[:n].to(c.device), want):
        sys.exit("byte mismatch: stock port on the cross-layer buffer")


def peak_pinned(timer: Timer, repeats: int) -> dict[str, float]:
    """GB/s of one 1 GiB contiguous pinned host <-> device copy."""
    nbytes = 1 << 30
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    samples = timer.interleaved(
        {
            "d2h": lambda: host.copy_(dev, non_blocking=True),
            "h2d": lambda: dev.copy_(host, non_blocking=True),
        },
        repeats,
        2,
    )
    out = {}
    for d, s in samples.items():
        med = statistics.median(s)
        out[d] = nbytes / med / 1e9
        print(
            f"# peak pinned memcpy {d}: {out[d]:.1f} GB/s (1 GiB, median "
            f"of {repeats}, spread {(max(s) - min(s)) / med:.1%})"
        )
    return out


def run(args) -> None:
    gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if gpu else "cpu"
    counts = args.blocks or ([1, 16, 256] if args.quick else [1, 16, 64, 256, 1024])
    shapes = args.shapes or list(SHAPES)
    where = torch.cuda.get_device_name() if gpu else "CPU (no GPU: ratios only)"
    timer = Timer(device)
    if not gpu:
        # Every method single-threaded (the ported loop is): on a small,
        # shared CPU, torch's intra-op threads only add noise.
        torch.set_num_threads(1)
    print(
        f"# KV block transfers on {where}; bf16, {BLOCK_TOKENS}-token "
        f"blocks, random block ids, {args.repeats} interleaved rounds, "
        f"median; torch {torch.__version__}"
        f"{'' if gpu else '; 1 CPU thread'}"
    )
    if args.no_stock_port:
        op, why = None, "--no-stock-port"
    else:
        op, why = stock_swap.build(gpu, verbose=True)
    if op is None:
        print(
            f"# stock column skipped ({why}); unit: py-loop, the earlier "
            "Python loop (one Tensor.copy_ per layer per K/V per block), "
            "which is NOT vLLM's code path"
        )
    else:
        print(
            f"# stock = vLLM 0.11.2 swap_blocks call pattern, {why}: per "
            "layer swap_blocks(K) then swap_blocks(V), int64 CPU mapping"
        )
    peak = peak_pinned(timer, args.repeats) if gpu else None
    raw = {
        "device": where,
        "torch": torch.__version__,
        "stock": why,
        "peak_pinned_gbps": peak,
        "rows": [],
    }
    unit = "stock" if op is not None else "py-loop"
    names = (
        ([unit, "cross-swap"] if op is not None else [unit])
        + ["cross-dma"]
        + (["cross-triton", "layer-triton"] if gpu else [])
        + ["contig"]
    )
    ratios = [m for m in names[1:] if m != "contig"]
    header = [
        "shape",
        "blocks",
        "dir",
        "block",
        *names,
        *[f"{m}/{unit}" for m in ratios],
    ]
    header += ["best-cross/peak" if gpu else "cross-dma/contig", "spread"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in shapes:
        shape = SHAPES[name]
        pool = max(counts) * 2
        c = Caches(shape, pool, max(counts), device, op is not None)
        gen = torch.Generator().manual_seed(0)
        check_bytes(
            c, torch.randperm(pool, generator=gen)[: min(7, max(counts))], gpu, op
        )
        if gpu:
            for label, table in (
                ("cross", c.cross_table),
                ("per-layer", c.layer_table),
            ):
                word, vec = _word_size(table, c.host, table.segments[0].storage)
                print(
                    f"# triton variant, {name} {label}: {8 * word * vec}"
                    f"-bit accesses ({'aligned' if vec > 1 else 'fallback'})"
                )
        for n in counts:
            ids = torch.randperm(pool, generator=gen)[:n].to(torch.int64)
            nbytes = n * c.block_bytes
            inner = max(1, min(32, (64 << 20) // nbytes))
            for to_host in (True, False):
                fns = methods(c, ids, to_host, gpu, op)
                samples = timer.interleaved(fns, args.repeats, inner)
                raw["rows"].append(
                    {
                        "shape": name,
                        "blocks": n,
                        "bytes": nbytes,
                        "dir": "d2h" if to_host else "h2d",
                        "inner": inner,
                        "seconds": samples,
                    }
                )
                t = {m: statistics.median(s) for m, s in samples.items()}
                spread = max(
                    (max(s) - min(s)) / statistics.median(s) for s in samples.values()
                )
                if gpu:
                    cells = [f"{nbytes / t[m] / 1e9:.2f}" for m in names]
                    best = min(t[m] for m in names if m.startswith("cross"))
                    d = "d2h" if to_host else "h2d"
                    last = f"{nbytes / best / 1e9 / peak[d]:.0%}"
                else:
                    cells = [f"{t[unit] / t[m]:.2f}x" for m in names]
                    last = f"{t['contig'] / t['cross-dma']:.0%}"
                row = [
                    name,
                    str(n),
                    "d2h" if to_host else "h2d",
                    f"{c.block_bytes // 1024} KiB",
                    *cells,
                    *[f"{t[unit] / t[m]:.2f}x" for m in ratios],
                    last,
                    f"{spread:.0%}",
                ]
                print("| " + " | ".join(row) + " |", flush=True)
        del c
    print(
        f"\nunits: method columns in {'GB/s' if gpu else 'x ' + unit}"
        + (
            "; best-cross/peak = fastest cross-layer method / peak pinned memcpy"
            if gpu
            else ""
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="few block counts (CI-sized)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="CPU even if a GPU is present"
    )
    parser.add_argument("--blocks", type=int, nargs="*")
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write every timing sample here")
    parser.add_argument(
        "--no-stock-port",
        action="store_true",
        help="do not build the C++ swap_blocks port (the unit becomes the Python loop)",
    )
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
