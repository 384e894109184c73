"""Every Triton kernel compiles ahead of time for sm_80, sm_90 and sm_100
(A100, H100/H200, B200) with no GPU, and the aligned variant moves 128 bits
per global access.

``triton.compile`` with a named ``GPUTarget`` runs all the way to a cubin
(the wheel bundles ptxas).  The compiles run in a subprocess without
``TRITON_INTERPRET`` (the kernels env sets it, and the interpreter replaces
the jit functions), one subprocess for the whole matrix.  Pointers are
compiled as 16-byte aligned, as Triton's runtime specialises them for
allocations from torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ARCHS = (80, 90, 100)
POINTERS = {  # kernel arg -> pointee type
    "cache_ptr": "i32",
    "packed_ptr": "i32",
    "block_ids_ptr": "i64",
    "packed_ids_ptr": "i64",
    "seg_src_ptr": "i64",
    "seg_stride_ptr": "i64",
    "seg_dst_ptr": "i64",
    "seg_len_ptr": "i64",
}
# variant name -> constexprs (VEC=4 with int32 words: 16-byte accesses)
VARIANTS = {
    f"{name}-{'gather' if to_packed else 'scatter'}": {
        "TO_PACKED": to_packed,
        "CHUNK": 1024,
        "VEC": vec,
    }
    for name, vec in (("aligned", 4), ("fallback", 1))
    for to_packed in (True, False)
}
KERNELS = {"copy_blocks_kernel"}

WIDE_LD = re.compile(
    r"\bld\.global(?:\.[\w:]+)*\.(?:v4\.b32|v2\.b64|v8\.b32|"
    r"v4\.b64)\b"
)
WIDE_ST = re.compile(
    r"\bst\.global(?:\.[\w:]+)*\.(?:v4\.b32|v2\.b64|v8\.b32|"
    r"v4\.b64)\b"
)
SCALAR_32 = re.compile(r"\b(?:ld|st)\.global(?:\.(?!v\d)[\w:]+)*\.b32\b")


def _compile_all() -> dict:
    """Runs in the subprocess: {arch: {variant: ptx}}, plus the list of
    jit functions found in the kernels module."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_overlay.core.ops import triton_kernels

    found = sorted(
        name
        for name, obj in vars(triton_kernels).items()
        if isinstance(obj, triton.runtime.jit.JITFunction)
    )
    fn = triton_kernels.copy_blocks_kernel
    out = {"kernels": found, "ptx": {}}
    for arch in ARCHS:
        for variant, consts in VARIANTS.items():
            signature = {}
            for arg in fn.arg_names:
                if arg in POINTERS:
                    signature[arg] = "*" + POINTERS[arg]
                elif arg in consts:
                    signature[arg] = "constexpr"
                else:
                    signature[arg] = "i64"
            attrs = {
                (fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in POINTERS
            }
            src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
            assert compiled.asm["cubin"], (arch, variant)
            out["ptx"].setdefault(str(arch), {})[variant] = compiled.asm["ptx"]
    return out


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; sys.path.insert(0, sys.argv[1]); "
            "import test_kernels_aot as t; print(json.dumps(t._compile_all()))",
            os.path.dirname(os.path.abspath(__file__)),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_is_covered(compiled):
    assert set(compiled["kernels"]) == KERNELS


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_variant_uses_128_bit_global_accesses(compiled, arch):
    for direction in ("gather", "scatter"):
        ptx = compiled["ptx"][str(arch)][f"aligned-{direction}"]
        assert WIDE_LD.search(ptx), f"sm_{arch} {direction}: no 128-bit load"
        assert WIDE_ST.search(ptx), f"sm_{arch} {direction}: no 128-bit store"
        # The copied words never go one 32-bit word at a time.
        assert not SCALAR_32.search(ptx), SCALAR_32.findall(ptx)[:4]


@pytest.mark.parametrize("arch", ARCHS)
def test_fallback_variant_compiles_with_scalar_accesses(compiled, arch):
    """Any alignment: the fallback must not assume 16-byte alignment."""
    for direction in ("gather", "scatter"):
        ptx = compiled["ptx"][str(arch)][f"fallback-{direction}"]
        assert not WIDE_LD.search(ptx) and not WIDE_ST.search(ptx)
        assert SCALAR_32.search(ptx)
