"""A TCP proxy on a loopback port that passes the client's bytes to a
server at a limited rate (a slow link); the server's replies pass freely.

Each connection gets two forwarding threads.  The client-to-server one
reads at most ``chunk`` bytes at a time and sends them on at once, paced so
that no more than ``rate_bytes_s`` per second pass since the connection
opened; the proxy's receive buffer is kept small, so few bytes wait in it.
When either side closes or resets, both sockets are closed: bytes the
proxy had not passed on yet never reach the server (as when a client
resets a connection over a real slow link).

    with ThrottledProxy(server.port, 256 << 10) as proxy:
        pool = KVPool(PoolConfig(url=proxy.url))
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

RECV_BUFFER_BYTES = 16 << 10  # the kernel doubles it


class ThrottledProxy:
    def __init__(self, port: int, rate_bytes_s: float, chunk: int = 4096) -> None:
        self.target = ("127.0.0.1", port)
        self.rate = float(rate_bytes_s)
        self.chunk = chunk
        self.forwarded = 0  # client bytes passed to the server, all connections
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Set before listen(): accepted sockets inherit it (a small window).
        self._listener.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER_BYTES
        )
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self._listener.settimeout(0.2)  # (to see close())
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(
            target=self._accept, name="throttle-proxy", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def __enter__(self) -> ThrottledProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            client.settimeout(None)
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            pair = (client, server)
            for src, dst, rate in ((client, server, self.rate), (server, client, 0)):
                threading.Thread(
                    target=self._forward,
                    args=(src, dst, rate, pair),
                    name="throttle-proxy-forward",
                    daemon=True,
                ).start()

    def _forward(self, src, dst, rate: float, pair) -> None:
        start, passed = time.monotonic(), 0
        try:
            while True:
                if rate:  # no more than rate * elapsed bytes passed on
                    ahead = passed / rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
                data = src.recv(self.chunk if rate else 1 << 16)
                if not data:
                    break
                dst.sendall(data)
                passed += len(data)
                if rate:
                    with self._lock:
                        self.forwarded += len(data)
        except OSError:
            pass
        finally:
            for sock in pair:  # either side gone: the connection is gone
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        self._thread.join(timeout=5)
