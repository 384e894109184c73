"""KV block transfer throughput: stock per-layer copies vs cross-layer blocks.

For each model shape, block count and direction (device->host "d2h",
host->device "h2d"), moves the same random blocks with:

  stock        one copy per layer per K/V per block (vLLM 0.11.2's
               swap_blocks pattern: 2 x num_layers copies per block)
  cross-dma    cross-layer buffer, one copy per block (consecutive ids merge)
  cross-triton cross-layer buffer, one Triton launch        (GPU only)
  layer-triton per-layer caches, one Triton launch           (GPU only)
  peak         one contiguous copy of the same number of bytes

Every method's bytes are checked against the torch reference before timing.
Prints a table; on a GPU absolute GB/s, on CPU only ratios (to stock and to
peak, measured side by side in this run).

    python benchmarks/bench_block_transfer.py            # GPU if present
    python benchmarks/bench_block_transfer.py --quick    # CI-sized CPU run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from vllm_overlay.core.ops.block_copy import BlockTable, gather, scatter

# name: (layers, kv heads, head size); bf16, 16-token blocks.
SHAPES = {
    "llama3.1-8b": (32, 8, 128),
    "llama3.1-70b-tp8": (80, 1, 128),
}
BLOCK_TOKENS = 16
DTYPE = torch.bfloat16


class Caches:
    """The same KV data in both layouts, plus a pinned host pool."""

    def __init__(self, shape: tuple[int, int, int], num_blocks: int,
                 device: str) -> None:
        layers, heads, head = shape
        self.device = device
        self.cross = torch.randn(num_blocks, layers, 2, BLOCK_TOKENS, heads,
                                 head, dtype=DTYPE, device=device)
        # Stock: per layer (2, blocks, tokens, heads, head), flash-attn NHD.
        self.per_layer = [self.cross[:, l].transpose(0, 1).contiguous()
                          for l in range(layers)]
        self.cross_table = BlockTable.from_tensors([self.cross], 0)
        self.layer_table = BlockTable.from_tensors(self.per_layer, 1)
        self.block_bytes = self.cross_table.block_bytes
        pin = device == "cuda"
        self.host = torch.empty(num_blocks, self.block_bytes,
                                dtype=torch.uint8, pin_memory=pin)
        self.flat_dev = torch.empty(num_blocks * self.block_bytes,
                                    dtype=torch.uint8, device=device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (and Triton compile)
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def methods(c: Caches, ids: torch.Tensor, to_host: bool, gpu: bool):
    n = ids.numel()
    host = c.host[:n]
    dev_ids = ids.to(c.device)
    move = gather if to_host else scatter
    out = {
        "stock": lambda: move(c.layer_table, ids, host, "dma"),
        "cross-dma": lambda: move(c.cross_table, ids, host, "dma"),
    }
    if gpu:
        out["cross-triton"] = lambda: move(c.cross_table, dev_ids, host,
                                           "triton")
        out["layer-triton"] = lambda: move(c.layer_table, dev_ids, host,
                                           "triton")
    flat = c.flat_dev[:n * c.block_bytes]
    flat_host = host.view(-1)
    out["peak"] = ((lambda: flat_host.copy_(flat, non_blocking=True))
                   if to_host else
                   (lambda: flat.copy_(flat_host, non_blocking=True)))
    return out


def check_bytes(c: Caches, ids: torch.Tensor, gpu: bool) -> None:
    """All methods produce the reference bytes (both layouts hold the same
    data, packed the same way only for cross-layer; per-layer packs by run)."""
    n = ids.numel()
    for table in (c.cross_table, c.layer_table):
        want = torch.empty(n, table.block_bytes, dtype=torch.uint8,
                           device=c.device)
        gather(table, ids, want, "reference")
        for method in ("dma",) + (("triton",) if gpu else ()):
            got = torch.empty(n, table.block_bytes, dtype=torch.uint8,
                              pin_memory=gpu)
            gather(table, ids.to(c.device) if method == "triton" else ids,
                   got, method)
            sync(c.device)
            if not torch.equal(got.to(want.device), want):
                sys.exit(f"byte mismatch: {method} on "
                         f"{table.runs_per_block}-run table")


def run(args) -> None:
    gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if gpu else "cpu"
    counts = args.blocks or ([1, 16, 256] if args.quick
                             else [1, 16, 64, 256, 1024, 4096])
    shapes = args.shapes or list(SHAPES)
    where = (torch.cuda.get_device_name() if gpu
             else "CPU (no GPU: ratios only)")
    print(f"# KV block transfers on {where}; bf16, {BLOCK_TOKENS}-token "
          f"blocks, random block ids, median of {args.repeats}")
    unit = "GB/s" if gpu else "x stock"
    header = ["shape", "blocks", "dir", "block", "stock", "cross-dma"]
    if gpu:
        header += ["cross-triton", "layer-triton"]
    header += ["peak", "cross-dma/stock", "cross-dma/peak"]
    if gpu:
        header += ["layer-triton/stock"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in shapes:
        shape = SHAPES[name]
        pool = max(counts) * 2
        c = Caches(shape, pool, device)
        gen = torch.Generator().manual_seed(0)
        check_bytes(c, torch.randperm(pool, generator=gen)[:7], gpu)
        for n in counts:
            ids = torch.randperm(pool, generator=gen)[:n].to(torch.int64)
            for to_host in (True, False):
                times = {m: timed(fn, device, args.repeats)
                         for m, fn in methods(c, ids, to_host, gpu).items()}
                nbytes = n * c.block_bytes
                if gpu:
                    cells = [f"{nbytes / t / 1e9:.1f}" for t in times.values()]
                else:
                    cells = [f"{times['stock'] / t:.2f}x"
                             for t in times.values()]
                row = [name, str(n), "d2h" if to_host else "h2d",
                       f"{c.block_bytes // 1024} KiB", *cells,
                       f"{times['stock'] / times['cross-dma']:.2f}x",
                       f"{times['peak'] / times['cross-dma']:.0%}"]
                if gpu:
                    row.append(f"{times['stock'] / times['layer-triton']:.2f}x")
                print("| " + " | ".join(row) + " |", flush=True)
        del c
    print(f"\nunits: method columns in {unit}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="few block counts (CI-sized)")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU even if a GPU is present")
    parser.add_argument("--blocks", type=int, nargs="*")
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
