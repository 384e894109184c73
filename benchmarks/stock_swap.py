"""The stock baseline: vLLM 0.11.2's KV offloading copy path, ported.

What vLLM 0.11.2 does (``vllm/v1/kv_offload/worker/cpu_gpu.py``,
``CpuGpuOffloadingHandler.transfer_async``): under a side stream, for every
layer's KV tensor it calls ``ops.swap_blocks(src, dst, block_mapping)``,
where ``block_mapping`` is an int64 CPU tensor of ``(src block, dst block)``
rows.  When the per-layer tensor is K/V first, ``(2, blocks, ...)``, that is
two calls per layer: ``swap_blocks(src[0], dst[0], ...)`` then
``swap_blocks(src[1], dst[1], ...)``.  ``swap_blocks`` (a C++ op behind
``torch.ops``) loops over the mapping and issues one ``cudaMemcpyAsync`` of
``element_size * stride(0)`` bytes per row on the current CUDA stream.  So a
transfer of n blocks is 2 x layers op calls and 2 x layers x n memcpys.

vLLM's CPU wheel has no ``swap_blocks``, and this benchmark must not import
vLLM, so this module builds its own port of that op at run time with
``torch.utils.cpp_extension.load_inline`` and registers it with the
dispatcher (``torch.ops.overlay_stock_port.swap_blocks``), called the way
vLLM calls its own op:

* CUDA build: one ``cudaMemcpyAsync`` per mapping row on the current stream
  (device<->host; host<->host rows use ``std::memcpy``).
* CPU build ("C++ loop port of swap_blocks (CPU)"): one ``std::memcpy`` per
  mapping row.

The build is cached under the temp dir (one build per torch version and
variant); it takes about a minute and a half on a 2-core machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time

import torch

_SOURCE = r"""
#include <cstring>
#include <torch/library.h>
#ifdef PORT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

// Copy rows block_mapping[i, 0] of src to rows block_mapping[i, 1] of dst,
// element_size * stride(0) bytes each, one copy call per row.
static void port_swap_blocks(const at::Tensor& src, at::Tensor& dst,
                             const at::Tensor& block_mapping) {
  TORCH_CHECK(block_mapping.device().is_cpu() &&
                  block_mapping.scalar_type() == at::kLong &&
                  block_mapping.dim() == 2 && block_mapping.size(1) == 2 &&
                  block_mapping.is_contiguous(),
              "block_mapping must be a contiguous int64 CPU tensor [n, 2]");
  const int64_t row_bytes = src.element_size() * src.stride(0);
  TORCH_CHECK(dst.element_size() * dst.stride(0) == row_bytes,
              "src and dst rows differ in size");
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(dst.data_ptr());
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  const int64_t rows = block_mapping.size(0);
#ifdef PORT_WITH_CUDA
  if (src.is_cuda() || dst.is_cuda()) {
    TORCH_CHECK(!(src.is_cuda() && dst.is_cuda()),
                "device-to-device is not ported (vLLM uses a kernel there)");
    const cudaMemcpyKind kind =
        src.is_cuda() ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device()
                                                   : dst.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    for (int64_t i = 0; i < rows; ++i) {
      const cudaError_t err = cudaMemcpyAsync(
          to + pairs[2 * i + 1] * row_bytes, from + pairs[2 * i] * row_bytes,
          row_bytes, kind, stream);
      TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
    }
    return;
  }
#endif
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu(),
              "unsupported devices");
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(to + pairs[2 * i + 1] * row_bytes,
                from + pairs[2 * i] * row_bytes, row_bytes);
  }
}

TORCH_LIBRARY(overlay_stock_port, m) {
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()",
        &port_swap_blocks);
}
"""

NAMES = {
    True: "C++ port of vLLM 0.11.2 swap_blocks (cudaMemcpyAsync per block)",
    False: "C++ loop port of swap_blocks (CPU)",
}


def build(cuda: bool, build_dir: str | None = None, verbose: bool = False):
    """Build (or load the cached build of) the port.

    Returns ``(op, description)``; ``op`` is None and ``description`` the
    reason when it cannot be built (no compiler, no CUDA toolkit, ...)."""
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return None, "no C++ compiler on PATH"
    if cuda and cpp_extension.CUDA_HOME is None:
        return None, "CUDA toolkit (CUDA_HOME) not found"
    variant = "cuda" if cuda else "cpu"
    key = hashlib.sha256(f"{_SOURCE}{torch.__version__}{variant}".encode()).hexdigest()[
        :12
    ]
    name = f"overlay_stock_port_{variant}_{key}"
    build_dir = build_dir or os.path.join(tempfile.gettempdir(), name)
    os.makedirs(build_dir, exist_ok=True)
    start = time.perf_counter()
    try:
        cpp_extension.load_inline(
            name,
            cpp_sources=_SOURCE,
            with_cuda=cuda,
            extra_cflags=["-O2"] + (["-DPORT_WITH_CUDA"] if cuda else []),
            build_directory=build_dir,
            is_python_module=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure: skip
        return None, f"build failed: {type(exc).__name__}: {exc}"[:300]
    took = time.perf_counter() - start
    if verbose:
        print(f"# stock port built/loaded in {took:.1f} s ({build_dir})")
    return torch.ops.overlay_stock_port.swap_blocks, NAMES[cuda]


def swap_all_layers(
    op,
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    block_mapping: torch.Tensor,
    kv_first: bool,
) -> int:
    """One transfer, called like vLLM 0.11.2's offloading handler: per
    layer, ``op(src[0], dst[0])`` then ``op(src[1], dst[1])`` when K/V come
    first, else ``op(src, dst)``.  Returns the number of op calls."""
    calls = 0
    for src, dst in zip(src_layers, dst_layers):
        if kv_first:
            op(src[0], dst[0], block_mapping)
            op(src[1], dst[1], block_mapping)
            calls += 2
        else:
            op(src, dst, block_mapping)
            calls += 1
    return calls
