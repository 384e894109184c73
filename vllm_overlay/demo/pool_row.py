"""The pool reload row's part that is the same on both releases: whether
it runs (the note that says why not) and its throwaway pool server."""

from __future__ import annotations


def skip_note(pool: bool, missing: str | None) -> str | None:
    """Why the row is left out (``--no-pool``, or ``missing``: why the pool
    server cannot start here), or None when it runs."""
    if not pool:
        return "pool reload row skipped: --no-pool"
    if missing:
        return f"pool reload row skipped: {missing}"
    return None


def start_server(stack, notes: list[str]) -> str:
    """A throwaway pool server for the demo's run (stopped when ``stack``
    closes); its URL, and a note naming it."""
    from vllm_overlay.testing.redis import DEFAULT_KIND, redis_server, server_binary

    url = stack.enter_context(redis_server())
    notes.append(
        f"pool server: a throwaway {DEFAULT_KIND} server at {url} ({server_binary()})"
    )
    return url
