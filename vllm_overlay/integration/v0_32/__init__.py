"""Adapters for vLLM 0.32.x: the overlay's core behind upstream's own
interfaces (imported only on that release)."""
