"""Shared KV pool on Redis/Valkey (no vLLM imports)."""
