"""A small HTTP proxy in front of several ``vllm serve`` nodes.

* ``rr``: round-robin, the router that cannot keep a conversation on the
  node holding its KV: request n goes to node n mod N.
* ``sticky``: one conversation always on one node (the ideal router): the
  key is the ``X-Session-Id`` header, else the request body's ``user``
  field; a new key goes to the next node round-robin, later requests with
  that key to the same node.  Requests without a key are routed round-robin.

Responses are passed through as they arrive (streamed completions stay
streamed), with an ``X-Routed-To`` header naming the node's index.
``GET /proxy/stats`` answers the requests sent to each node.

    python benchmarks/serving/proxy.py --port 8000 --mode rr \\
        http://127.0.0.1:8001 http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import itertools
import json

from aiohttp import ClientSession, ClientTimeout, web

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "te",
    "trailer",
    "upgrade",
}
CLIENT = web.AppKey("client", ClientSession)
SESSION_HEADER = "X-Session-Id"
ROUTED_HEADER = "X-Routed-To"  # the node (index) that served the request


class Router:
    def __init__(self, backends: list[str], mode: str) -> None:
        if mode not in ("rr", "sticky"):
            raise ValueError(f"unknown routing mode {mode!r} (rr or sticky)")
        self.backends, self.mode = backends, mode
        self._next = itertools.cycle(range(len(backends)))
        self._sticky: dict[str, int] = {}
        self.sent = [0] * len(backends)

    def pick(self, key: str | None) -> int:
        if self.mode == "rr" or key is None:
            node = next(self._next)
        elif key in self._sticky:
            node = self._sticky[key]
        else:
            node = self._sticky[key] = next(self._next)
        self.sent[node] += 1
        return node


def session_key(headers, body: bytes) -> str | None:
    if SESSION_HEADER in headers:
        return headers[SESSION_HEADER]
    try:
        user = json.loads(body).get("user")
    except (ValueError, AttributeError):
        return None
    return str(user) if user is not None else None


def build_app(backends: list[str], mode: str, timeout_s: float) -> web.Application:
    router = Router(backends, mode)
    app = web.Application(client_max_size=64 * 2**20)

    async def start(app):
        app[CLIENT] = ClientSession(timeout=ClientTimeout(total=timeout_s))

    async def close(app):
        await app[CLIENT].close()

    async def stats(request):
        return web.json_response(
            {"mode": mode, "backends": backends, "sent": router.sent}
        )

    async def forward(request):
        body = await request.read()
        key = session_key(request.headers, body) if mode == "sticky" else None
        node = router.pick(key)
        url = router.backends[node] + request.rel_url.path_qs
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP
        }
        async with app[CLIENT].request(
            request.method, url, data=body, headers=headers
        ) as upstream:
            reply = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP_BY_HOP:
                    reply.headers[k] = v
            reply.headers[ROUTED_HEADER] = str(node)
            await reply.prepare(request)
            async for chunk in upstream.content.iter_any():
                await reply.write(chunk)
            await reply.write_eof()
            return reply

    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_get("/proxy/stats", stats)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="rr", choices=["rr", "sticky"])
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("backends", nargs="+", help="base URLs of the nodes")
    args = ap.parse_args()
    backends = [b.rstrip("/") for b in args.backends]
    web.run_app(
        build_app(backends, args.mode, args.timeout_s),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
