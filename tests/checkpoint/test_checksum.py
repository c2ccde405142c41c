"""Parallel CRC-32C: the combine rule, piece planning and the worker threads behind them."""

from __future__ import annotations

import threading
from unittest import mock

import crc32c
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from bulkhead.trainer.checkpoint import checksum
from bulkhead.trainer.checkpoint.checksum import (
    PIECE_ALIGN,
    PIECES_PER_THREAD,
    Workers,
    checksum_parallel,
    crc32c_combine,
    shared_workers,
    split_spans,
)


@given(st.binary(max_size=3000), st.binary(max_size=3000))
@example(b"", b"")
@example(b"a", b"")
@example(b"", b"b")
def test_combine_equals_the_crc_of_the_concatenation(first: bytes, second: bytes) -> None:
    combined = crc32c_combine(crc32c.crc32c(first), crc32c.crc32c(second), len(second))
    assert combined == crc32c.crc32c(first + second)


def test_combine_over_a_long_run_of_zeros() -> None:
    """Big lengths exercise high powers of the zero-byte operator."""
    zeros = bytes(5_000_017)
    head = b"checkpoint"
    assert crc32c_combine(crc32c.crc32c(head), crc32c.crc32c(zeros), len(zeros)) == (
        crc32c.crc32c(head + zeros)
    )
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, -1)


@given(st.integers(0, 1 << 40), st.integers(1, 16))
@example(0, 2)
@example(1, 2)
@example(checksum.MIN_PIECE_BYTES, 2)
@example(checksum.MIN_PIECE_BYTES * 8 + 1, 2)
def test_spans_cover_everything_once_in_balanced_aligned_pieces(total: int, threads: int) -> None:
    spans = split_spans(total, threads)
    covered = 0
    for start, stop in spans:  # back to back from 0 to total
        assert start == covered
        covered = stop
    assert covered == total
    assert all(start % PIECE_ALIGN == 0 and stop > start for start, stop in spans)
    assert len(spans) <= (1 if threads == 1 else threads * PIECES_PER_THREAD)
    sizes = [stop - start for start, stop in spans]
    assert all(size >= min(total, checksum.MIN_PIECE_BYTES) for size in sizes[:-1])
    if len(sizes) > 1:  # equal pieces, the last one short by less than a piece
        assert len(set(sizes[:-1])) == 1 and sizes[-1] <= sizes[0]


@given(st.binary(max_size=5000), st.integers(1, 4))
@example(b"", 3)
@example(b"x", 3)
@example(bytes(range(256)) * 4, 3)  # exactly 16 pieces of 64 bytes
@example(bytes(range(256)) * 4 + b"!", 3)  # one byte past a piece boundary
def test_parallel_checksum_equals_the_serial_one(data: bytes, threads: int) -> None:
    workers = Workers(threads)
    try:
        with mock.patch.object(checksum, "MIN_PIECE_BYTES", 64):  # many pieces on small data
            got = checksum_parallel(memoryview(data), workers)
    finally:
        workers.close()
    incremental = 0  # the serial CRC fed in 7-byte chunks, as a stream would arrive
    for start in range(0, len(data), 7):
        incremental = crc32c.crc32c(data[start : start + 7], incremental)
    assert got == crc32c.crc32c(data) == incremental


def test_parallel_checksum_of_a_multi_piece_buffer_with_shared_workers() -> None:
    data = bytearray(range(256)) * (3 * checksum.MIN_PIECE_BYTES // 256) + b"tail"
    assert checksum_parallel(memoryview(data)) == crc32c.crc32c(data)
    assert shared_workers() is shared_workers()


def test_workers_return_results_in_order_and_one_thread_runs_inline() -> None:
    workers = Workers(3)
    try:
        assert workers.run([lambda i=i: i * i for i in range(10)]) == [i * i for i in range(10)]
    finally:
        workers.close()
    inline = Workers(1)
    assert inline.run([threading.get_ident]) == [threading.get_ident()]
    with pytest.raises(ValueError):
        Workers(0)


def test_workers_finish_every_task_before_raising() -> None:
    """A failed piece must not let the caller return while another still writes."""
    failed = threading.Event()
    finished: list[str] = []

    def fail() -> None:
        failed.set()
        raise OSError("piece failed")

    def slow() -> None:
        assert failed.wait(timeout=30)
        finished.append("slow")

    workers = Workers(2)
    try:
        with pytest.raises(OSError, match="piece failed"):
            workers.run([fail, slow])
        assert finished == ["slow"]
    finally:
        workers.close()
