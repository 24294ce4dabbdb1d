"""Bounded output: capture a stream in constant memory and shorten text for display."""

from __future__ import annotations

from collections import deque


class CappedBuffer:
    """Keeps the first and last bytes of a stream within `limit` bytes in total.

    Memory stays O(limit) however much is written, so a command printing gigabytes cannot
    exhaust the host. `total` counts every byte seen; `truncated` says whether some were dropped.
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"output limit must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.total = 0
        self._head = bytearray()
        self._head_limit = limit // 2
        self._tail_limit = limit - self._head_limit
        self._tail: deque[bytes] = deque()
        self._tail_size = 0

    def write(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if not chunk or self._tail_limit == 0:
            return
        if len(chunk) >= self._tail_limit:
            self._tail.clear()
            self._tail.append(bytes(chunk[-self._tail_limit :]))
            self._tail_size = self._tail_limit
            return
        self._tail.append(bytes(chunk))
        self._tail_size += len(chunk)
        while self._tail_size - len(self._tail[0]) >= self._tail_limit:
            self._tail_size -= len(self._tail.popleft())

    def omit(self, count: int) -> None:
        """Count `count` bytes that were dropped at the source, between the head and the tail."""
        self.total += count

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def getvalue(self) -> bytes:
        """Head and tail, joined by a marker saying how many bytes were left out."""
        tail = b"".join(self._tail)
        if not self.truncated:
            return bytes(self._head) + tail
        tail = tail[-self._tail_limit :]
        omitted = self.total - len(self._head) - len(tail)
        return bytes(self._head) + f"\n[... {omitted} bytes omitted ...]\n".encode() + tail

    def text(self) -> str:
        """The captured bytes decoded as UTF-8; undecodable bytes become U+FFFD."""
        return self.getvalue().decode("utf-8", errors="replace")


def head_tail(text: str, max_chars: int) -> str:
    """`text` unchanged if it fits in `max_chars`, else its head and tail around a marker."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[len(text) - tail :]}"
