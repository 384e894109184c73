"""Block transfer ops (no vLLM imports): Triton kernels, torch reference."""
