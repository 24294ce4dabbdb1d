"""Bounded output: what a capped stream keeps is its first and its last bytes, in order."""

from __future__ import annotations

import tracemalloc

import pytest

from patchgym.core.output import CappedBuffer, head_tail


def numbered(lines: int) -> bytes:
    return b"".join(b"line %06d\n" % i for i in range(lines))


@pytest.mark.parametrize("chunk", [1, 7, 64, 500, 10_000, 1 << 20])
def test_a_capped_stream_keeps_its_head_and_its_last_bytes(chunk: int) -> None:
    stream = numbered(50_000)  # 600 kB, every byte position distinguishable
    buffer = CappedBuffer(1000)
    for start in range(0, len(stream), chunk):
        buffer.write(stream[start : start + chunk])
    assert buffer.total == len(stream) and buffer.truncated
    head, marker, tail = buffer.getvalue().partition(b"\n[... ")
    assert marker, "a truncated stream says that bytes were left out"
    count, tail = tail.split(b" bytes omitted ...]\n", 1)
    assert head == stream[:500] and tail == stream[-500:]
    assert int(count) == len(stream) - 1000  # the marker counts exactly the bytes it stands for
    assert buffer.text().endswith("line 049999\n")


def test_a_stream_within_the_limit_is_kept_whole() -> None:
    stream = numbered(90)  # 1080 bytes
    buffer = CappedBuffer(len(stream))
    for start in range(0, len(stream), 13):
        buffer.write(stream[start : start + 13])
    assert not buffer.truncated and buffer.getvalue() == stream


def test_head_tail_keeps_both_ends_of_text() -> None:
    text = "".join(f"{i:04d}" for i in range(1000))
    short = head_tail(text, 40)
    assert short.startswith(text[:20]) and short.endswith(text[-20:])
    assert "3960 characters omitted" in short
    assert head_tail(text, len(text)) == text


def test_memory_stays_bounded_however_much_is_written() -> None:
    buffer = CappedBuffer(4096)
    chunk = bytearray(b"x" * 1000)  # as a reader hands out: what is kept is a copy
    tracemalloc.start()
    try:
        for _ in range(20_000):  # 20 MB in small writes
            buffer.write(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert buffer.total == 20_000_000 and len(buffer.getvalue()) < 4200
    assert peak < 1_000_000, f"{peak} bytes held for a 4 kB cap"


def test_a_zero_limit_keeps_nothing_but_the_count() -> None:
    buffer = CappedBuffer(0)
    buffer.write(b"abc")
    assert buffer.truncated and buffer.total == 3
    assert buffer.getvalue() == b"\n[... 3 bytes omitted ...]\n"
    with pytest.raises(ValueError, match=">= 0 bytes"):
        CappedBuffer(-1)


def test_bytes_dropped_at_the_source_are_counted_between_head_and_tail() -> None:
    buffer = CappedBuffer(1000)
    buffer.write(b"h" * 600)
    assert not buffer.truncated
    buffer.omit(5000)  # e.g. a sandbox that cut its stream before sending it
    assert buffer.total == 5600 and buffer.truncated
    assert buffer.getvalue() == b"h" * 500 + b"\n[... 5000 bytes omitted ...]\n" + b"h" * 100
