"""CRC-32C of big buffers, on a few threads, and the threads for bulk copies.

Checksums of big buffers run on a few threads (``Workers``; crc32c releases the GIL): each
piece gets its own CRC-32C and ``crc32c_combine`` joins them into the CRC of the whole, so
the stored value is the same one a single pass computes. ``Workers`` also runs the
snapshot and restore copies (torch's ``copy_`` releases the GIL too).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import crc32c

T = TypeVar("T")
CHECKSUM_CHUNK_BYTES = 8 << 20
# Parallel pieces: never smaller than this (a hand-off costs more than a small piece saves),
# a few per thread (a core busy with something else does not hold the others back), and
# starting on 64-byte boundaries (so a cut never splits an element of any dtype).
MIN_PIECE_BYTES = 16 << 20
PIECES_PER_THREAD = 4
PIECE_ALIGN = 64
# CRC-32C (Castagnoli) generator polynomial, bit-reversed like the register that uses it.
CRC32C_POLY_REFLECTED = 0x82F63B78


def default_threads() -> int:
    """Threads for bulk copies and checksums: the cores, but a handful at most (memory
    bandwidth, not compute, is the limit beyond that)."""
    return min(4, os.cpu_count() or 1)


class Workers:
    """A few threads for bulk work that releases the GIL (tensor copies, CRC-32C).

    With one thread the tasks run inline in the caller: no hand-off, the serial behaviour.
    """

    def __init__(self, threads: int, name: str = "ckpt-bulk") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name) if threads > 1 else None

    def run(self, tasks: Sequence[Callable[[], T]]) -> list[T]:
        """Every task's result, in order. Waits for all of them before raising the first
        error: a caller must never return while a task still writes into its buffer."""
        if self._pool is None or len(tasks) <= 1:
            return [task() for task in tasks]
        futures = [self._pool.submit(task) for task in tasks]
        wait(futures)
        return [future.result() for future in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


_shared: tuple[int, Workers] | None = None
_shared_lock = threading.Lock()


def shared_workers() -> Workers:
    """The process-wide workers, for code that owns no pool (the sealer, restore)."""
    global _shared
    with _shared_lock:
        # A forked child inherits the pool object but none of its threads: make a new one.
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), Workers(default_threads(), "ckpt-shared"))
        return _shared[1]


def split_spans(total: int, threads: int, align: int = PIECE_ALIGN) -> list[tuple[int, int]]:
    """[start, stop) pieces of equal size covering ``range(total)`` for ``threads`` workers;
    every start is a multiple of ``align``. One piece when ``threads`` is 1."""
    if total <= 0:
        return []
    pieces = 1
    if threads > 1:
        pieces = max(1, min(threads * PIECES_PER_THREAD, total // MIN_PIECE_BYTES))
    size = -(-total // pieces)
    size = -(-size // align) * align
    return [(start, min(start + size, total)) for start in range(0, total, size)]


# -- CRC-32C of concatenations ------------------------------------------------------------
# Appending n zero bits to a message maps its (reflected) CRC register through a linear
# operator over GF(2), and CRC(A + B) = Z^len(B)(CRC(A)) xor CRC(B), where Z shifts in one
# zero byte (the init/final inversions cancel out). Operators are 32x32 bit matrices stored
# as 32 column words; Z^(2^k) comes from squaring, so a shift by n bytes takes one matrix-
# vector product per set bit of n.


def _gf2_apply(matrix: Sequence[int], vector: int) -> int:
    """The product matrix x vector over GF(2): the xor of the columns ``vector`` selects."""
    out = 0
    column = 0
    while vector:
        if vector & 1:
            out ^= matrix[column]
        vector >>= 1
        column += 1
    return out


def _gf2_square(matrix: Sequence[int]) -> tuple[int, ...]:
    return tuple(_gf2_apply(matrix, column) for column in matrix)


@functools.cache
def _zero_bytes_operator(log2_bytes: int) -> tuple[int, ...]:
    """The operator that shifts 2**log2_bytes zero bytes through the CRC register."""
    if log2_bytes > 0:
        return _gf2_square(_zero_bytes_operator(log2_bytes - 1))
    # One zero bit: shift right; a 1 falling out of bit 0 folds the polynomial back in.
    operator: tuple[int, ...] = (CRC32C_POLY_REFLECTED, *(1 << bit for bit in range(31)))
    for _ in range(3):  # 2**3 bits = one byte
        operator = _gf2_square(operator)
    return operator


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC-32C of A + B from CRC-32C(A), CRC-32C(B) and len(B) in bytes."""
    if length_b < 0:
        raise ValueError(f"length must be >= 0, got {length_b}")
    shifted = crc_a
    power = 0
    while length_b:
        if length_b & 1:
            shifted = _gf2_apply(_zero_bytes_operator(power), shifted)
        length_b >>= 1
        power += 1
    return shifted ^ crc_b


def _crc_of_span(view: memoryview, start: int, stop: int) -> int:
    with view[start:stop] as piece:  # released here, so the mapping can close afterwards
        return crc32c.crc32c(piece)


def checksum_parallel(view: memoryview, workers: Workers | None = None) -> int:
    """CRC-32C of the bytes of ``view`` (equal to one serial pass), pieces computed on
    ``workers`` (default: ``shared_workers()``) and combined."""
    workers = workers or shared_workers()
    with view.cast("B") as flat:
        spans = split_spans(len(flat), workers.threads)
        crcs = workers.run([functools.partial(_crc_of_span, flat, a, b) for a, b in spans])
    crc = 0
    for (start, stop), piece_crc in zip(spans, crcs, strict=True):
        crc = crc32c_combine(crc, piece_crc, stop - start)
    return crc
