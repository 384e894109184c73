"""Build a Llama-shaped random-weight model big enough for prefill to cost
something (``benchmarks/bench_prefix_reuse.py``), into a cache folder.

No hub: the tokenizer is the tiny model's byte-level BPE (trained here on
the same generated corpus, ``build_tiny_llama.build_tokenizer``), the weights
are random from a fixed seed.  The default shape is a small Llama:

    16 layers, hidden 1024, 16 query heads, 8 KV heads, head size 64,
    MLP 2816, vocabulary 512: 190 M parameters, 760 MB in float32.

KV per token = 2 (K, V) x 16 layers x 8 KV heads x 64 x 4 B = 64 KiB in
float32, so a 2100-token prompt holds 131.25 MiB of KV, of which its 16 full
128-token blocks (2048 tokens, what a prefix cache can serve on vLLM's CPU
backend) are exactly 128 MiB: 8 MiB per block.

The folder is ``$VLLM_OVERLAY_CACHE/models/<name>`` (default
``~/.cache/vllm-overlay``), named after the shape; it is built once
(``build.json`` records the shape, a changed shape gets its own folder) and
not in the repository (760 MB).

    python -m vllm_overlay.models.build_bench_llama [--layers 16] [OUT_DIR]

(``--help`` lists every dimension; the default shape is ``DEFAULT``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib

SEED = 20251123


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 16
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    intermediate: int = 2816

    @property
    def name(self) -> str:
        return (
            f"bench_llama_l{self.layers}_h{self.hidden}_q{self.heads}"
            f"_kv{self.kv_heads}_d{self.head_dim}_i{self.intermediate}"
        )

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def parameters(self, vocab: int = 512) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden
        return (
            self.layers * (attn + mlp + norms) + 2 * vocab * self.hidden + self.hidden
        )


DEFAULT = Shape()


def cache_root() -> pathlib.Path:
    root = os.environ.get("VLLM_OVERLAY_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-overlay"
    )
    return pathlib.Path(root) / "models"


def default_dir(shape: Shape = DEFAULT) -> pathlib.Path:
    return cache_root() / shape.name


def build(out_dir: pathlib.Path, shape: Shape = DEFAULT) -> pathlib.Path:
    from vllm_overlay.models.build_tiny_llama import write_random_llama

    out_dir = write_random_llama(
        out_dir,
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_positions=8192,
        init_range=0.02,
        seed=SEED,
    )
    (out_dir / "build.json").write_text(json.dumps(_record(shape), indent=1))
    return out_dir


def _record(shape: Shape) -> dict:
    """What a built folder must record to be used as is."""
    from vllm_overlay.models.build_tiny_llama import TOKENIZER_CLASS

    return {
        "shape": dataclasses.asdict(shape),
        "seed": SEED,
        "tokenizer_class": TOKENIZER_CLASS,
    }


def ensure(shape: Shape = DEFAULT, out_dir: pathlib.Path | None = None) -> str:
    """The model folder, built first if it is not there (or incomplete)."""
    out_dir = pathlib.Path(out_dir or default_dir(shape))
    marker = out_dir / "build.json"
    if not marker.exists() or json.loads(marker.read_text()) != _record(shape):
        # Build next to it and rename: a half-written folder is never used.
        tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
        build(tmp, shape)
        if out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    return str(out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = DEFAULT
    for field in dataclasses.fields(Shape):
        ap.add_argument(
            "--" + field.name.replace("_", "-"),
            type=int,
            default=getattr(defaults, field.name),
        )
    ap.add_argument("out_dir", nargs="?", help="default: the cache folder")
    args = ap.parse_args()
    shape = Shape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Shape)})
    print(ensure(shape, pathlib.Path(args.out_dir) if args.out_dir else None))
    print(
        f"{shape.parameters() / 1e6:.0f} M parameters; KV "
        f"{shape.kv_bytes_per_token() // 1024} KiB per token in float32"
    )


if __name__ == "__main__":
    main()
