"""RESP replies read from a socket, with every size the server decides
bounded, and the command pieces the pool sends.

``RespReader`` reads reply lines through a small buffer; a bulk string that
the caller has memory for is read straight into it with ``recv_into`` (its
bytes are never copied in Python: only what the line buffer already holds
is moved over).  Bounds: a reply line is at most ``MAX_LINE_BYTES``, an
array at most ``MAX_ARRAY`` items, a bulk string read as bytes at most
``max_bulk_bytes`` (a longer one is read and dropped in small pieces and
comes back as ``Oversized``).  With a ``deadline`` (``time.monotonic()``),
no read starts after it and none waits past it (the socket timeout is
shortened), so a server that trickles bytes cannot hold a reader longer;
with a ``guard``, every write into the caller's memory happens under
``guard.lock`` and only while ``guard.cancelled`` is false, so whoever
cancels under that lock knows no later write lands.  With an ``outgoing``
(``transport.Outgoing``: the commands still to send), the reader sends
them while it waits for bytes, so replies are read as they come.
"""

from __future__ import annotations

import threading
import time

from vllm_overlay.core.pool.errors import PoolTooSlow

MAX_LINE_BYTES = 1 << 20
MAX_ARRAY = 1 << 16
MAX_VALUE_BYTES = 512 << 20  # Redis's own proto-max-bulk-len default
_SMALL_CHUNK = 64 << 10  # command pieces shorter than this are sent joined
_DISCARD_BYTES = 64 << 10


class InPlace:
    """A value read straight into the buffers the caller gave for it;
    ``len()`` is its length."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"InPlace({self.length})"


class Oversized:
    """A bulk string longer than the reader's bound: read and dropped; only
    its length is kept."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"Oversized({self.length})"


class Cancelled(Exception):
    """The job this reader serves was cancelled (its deadline passed and the
    pool gave up on it): no more reads."""


class Guard:
    """Shared by a reader and whoever may cancel its job (see module doc)."""

    __slots__ = ("lock", "cancelled")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False

    def cancel(self, timeout_s: float) -> bool:
        """Cancel, once no write is under way (waits ``timeout_s`` at most
        for the lock); True if cancelled."""
        if not self.lock.acquire(timeout=timeout_s):
            return False
        try:
            self.cancelled = True
        finally:
            self.lock.release()
        return True


def command(name: bytes, key: bytes) -> bytes:
    return b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(name), name, len(key), key)


def coalesce(pieces) -> list:
    """Command pieces to send: runs of short ``bytes`` joined (fewer
    sends), anything else (a payload) passed on as it is (no copy)."""
    out: list = []
    small: list[bytes] = []
    for piece in pieces:
        if isinstance(piece, bytes) and len(piece) < _SMALL_CHUNK:
            small.append(piece)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(piece)
    if small:
        out.append(b"".join(small))
    return out


def _protocol_error(text: str) -> Exception:
    import redis

    return redis.InvalidResponse(text)


class RespReader:
    """Replies (RESP2, and RESP3's null) read from a socket."""

    # Measured (bench_pool, 256 KiB values): 1 KiB reads put the pool at
    # 0.94x the raw reader, 4 KiB at 0.83x, 64 KiB at 0.73x.
    fill_bytes = 1024

    def __init__(
        self,
        sock,
        buffer_bytes: int = 64 << 10,
        deadline: float | None = None,
        guard: Guard | None = None,
        max_bulk_bytes: int = MAX_VALUE_BYTES,
        outgoing=None,
    ) -> None:
        self.sock = sock
        self.deadline = deadline
        self.guard = guard
        self.outgoing = outgoing
        self.max_bulk_bytes = max_bulk_bytes
        self._timeout = sock.gettimeout() if deadline is not None else None
        self._shortened = False
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not consumed by a reply yet."""
        return self._end - self._start

    def close(self) -> None:
        """Give the socket its own timeout back."""
        if self._shortened:
            self.sock.settimeout(self._timeout)
            self._shortened = False

    def _before_read(self) -> None:
        if self.deadline is None:
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PoolTooSlow(
                "not done within io_timeout_s (the server or the link too slow)"
            )
        if self._timeout is None or left < self._timeout:
            self.sock.settimeout(left)
            self._shortened = True

    def _send_pending(self) -> None:
        """Commands still to send go out until a reply can be read."""
        if self.outgoing is not None and self.outgoing.pending:
            self.outgoing.until_readable()

    def _recv(self, view, nbytes: int) -> int:
        self._send_pending()
        self._before_read()
        try:
            got = self.sock.recv_into(view, nbytes)
        except TimeoutError:
            if self._shortened and time.monotonic() >= self.deadline:
                raise PoolTooSlow(
                    "not done within io_timeout_s (the server or the link too slow)"
                ) from None
            raise
        if not got:
            import redis

            raise redis.ConnectionError("connection closed by the pool server")
        return got

    def _recv_guarded(self, view, nbytes: int) -> int:
        """A read into the caller's memory (see ``Guard``)."""
        guard = self.guard
        if guard is None:
            return self._recv(view, nbytes)
        self._send_pending()  # (not under the lock)
        with guard.lock:
            if guard.cancelled:
                raise Cancelled()
            return self._recv(view, nbytes)

    def _fill(self) -> None:
        """Receive more into the line buffer (compacted, or grown for a
        line longer than it, up to ``MAX_LINE_BYTES``)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            kept = bytes(self._view[self._start : self._end])
            if self._start == 0:
                if len(self._buf) >= MAX_LINE_BYTES:
                    raise _protocol_error(f"reply line longer than {MAX_LINE_BYTES} B")
                self._view.release()
                self._buf = bytearray(min(2 * len(self._buf), MAX_LINE_BYTES))
                self._view = memoryview(self._buf)
            self._buf[: len(kept)] = kept
            self._start, self._end = 0, len(kept)
        # A short read: a reply line and the first bytes after it, so little
        # of a value passes through this buffer (the rest goes straight to
        # the caller's memory).
        room = min(len(self._buf) - self._end, self.fill_bytes)
        self._end += self._recv(self._view[self._end :], room)

    def line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._view[self._start : at])
                self._start = at + 2
                return out
            self._fill()

    def read_into(self, dest, guarded: bool = False) -> None:
        """Fill ``dest`` (a writable buffer): what is buffered, then the
        rest straight from the socket (``guarded``: the caller's memory)."""
        dest = memoryview(dest).cast("B")
        want = dest.nbytes
        got = min(want, self._end - self._start)
        recv = self._recv_guarded if guarded else self._recv
        if got:
            if guarded and self.guard is not None:
                with self.guard.lock:
                    if self.guard.cancelled:
                        raise Cancelled()
                    dest[:got] = self._view[self._start : self._start + got]
            else:
                dest[:got] = self._view[self._start : self._start + got]
            self._start += got
        while got < want:
            got += recv(dest[got:], want - got)

    def _discard(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, _DISCARD_BYTES)))
        while nbytes:
            n = min(nbytes, scratch.nbytes)
            self.read_into(scratch[:n])
            nbytes -= n

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            raise _protocol_error("bulk string not followed by CRLF")
        self._start += 2

    def _int(self, rest: bytes) -> int:
        try:
            return int(rest)
        except ValueError:
            raise _protocol_error(f"bad length {rest[:32]!r}") from None

    def reply(self, into=None, depth: int = 0):
        """The next reply: bytes (simple or bulk string), int, None (nil),
        a list, an exception instance for an error reply (returned, not
        raised), ``InPlace(length)`` for a bulk string read into the
        buffers ``into(length)`` gave (None: read as bytes), or
        ``Oversized(length)`` for one longer than ``max_bulk_bytes``."""
        import redis

        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = self._int(rest)
            if length < 0:
                return None
            views = into(length) if into is not None else None
            if views is None:
                if length > self.max_bulk_bytes:
                    self._discard(length)
                    self._crlf()
                    return Oversized(length)
                out = bytearray(length)
                self.read_into(out)
                self._crlf()
                return bytes(out)
            views = [memoryview(v).cast("B") for v in views]
            if sum(v.nbytes for v in views) != length:
                raise ValueError(f"buffers for {length} B do not add up to it")
            for view in views:
                self.read_into(view, guarded=True)
            self._crlf()
            return InPlace(length)
        if kind == b"+":
            return rest
        if kind == b":":
            return self._int(rest)
        if kind == b"-":
            return redis.ResponseError(rest.decode(errors="replace"))
        if kind == b"_":
            return None
        if kind == b"*":
            count = self._int(rest)
            if count > MAX_ARRAY or depth > 4:
                raise _protocol_error(f"array of {count} items at depth {depth}")
            return (
                None
                if count < 0
                else [self.reply(depth=depth + 1) for _ in range(count)]
            )
        raise _protocol_error(f"unexpected reply {line[:32]!r}")
