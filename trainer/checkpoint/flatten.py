"""Flattening a training state into one byte buffer and back, without pickling tensor data.

``plan_layout`` finds every tensor in a nested state (model and optimizer state dicts, RNG
states, data position...), assigns it an aligned offset in a flat buffer and writes the
rest of the state as a small JSON skeleton in which tensors are references (data only:
nothing in a checkpoint is ever unpickled, so a checkpoint volume or a peer cannot run
code in the trainer). ``copy_into``
fills a buffer; ``assemble`` rebuilds the state from a buffer, optionally copying into
the caller's existing tensors in place (like torch.distributed.checkpoint's load).

Both copies can run on a few threads (``Workers``; torch's ``copy_`` releases the GIL): the
buffer is cut into equal byte ranges and a big tensor is copied as flat slices, one per
range it overlaps, so every thread moves the same number of bytes.

``assemble_verified`` is the restore from shared memory: it checks the buffer's CRC-32C
while copying, one small chunk at a time (the checksum reads the chunk from memory, the
copy then takes it from the cache), so the bytes cross the memory bus once instead of
twice (verify pass, then copy pass). It reports the CRC and which of the caller's tensors
it wrote: the caller must compare the CRC before using anything.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import json
import logging
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from bulkhead.trainer.checkpoint.checksum import PIECE_ALIGN, Workers, crc32c_combine, split_spans
from bulkhead.trainer.checkpoint.records import SnapshotRecord, TensorEntry

# Every tensor starts on a cache-line boundary, so any dtype can be viewed in place (and
# parallel pieces, cut at the same alignment, never split an element).
ALIGN = PIECE_ALIGN
KeyPath = tuple[str | int, ...]
# One copy: buffer offset, destination, source (same shape and dtype).
Copy = tuple[int, torch.Tensor, torch.Tensor]
# Verify-while-copying granularity: half a core's L2 cache, so the chunk the checksum just
# read is still cached when the copy reads it; large enough that the per-chunk Python
# overhead (a few microseconds) stays under 2 % of the chunk's copy time.
VERIFY_CHUNK_BYTES = 1 << 20
# Fresh tensors this big are backed by transparent huge pages where the kernel offers them
# on request (THP "madvise" mode, the common default): a restore then takes one page fault
# per 2 MiB instead of one per 4 KiB, which measured 4x faster than the 4 KiB faults.
HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h

log = logging.getLogger(__name__)


@dataclass
class Layout:
    """The tensors of a state, where each goes in the buffer, and the JSON remainder."""

    entries: list[TensorEntry]
    tensors: list[torch.Tensor]
    skeleton: str
    nbytes: int


def _walk(obj: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """(key path, leaf) for the dict/list/tuple structure; other objects are leaves."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str | int):
                yield from _walk(value, (*path, key))
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            yield from _walk(value, (*path, index))
    else:
        yield path, obj


def _check_tensor(tensor: torch.Tensor) -> None:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"cannot snapshot a {type(tensor).__name__}: convert it to a local tensor first "
            "(e.g. DTensor.to_local())"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"cannot snapshot a {tensor.layout} / quantized tensor; densify it first")


class SkeletonError(ValueError):
    """A skeleton that is not data this module wrote (corrupt or hostile): never loaded."""


_TENSOR, _DICT, _TUPLE, _FLOAT = "$t", "$d", "$tuple", "$f"


class _SkeletonWriter:
    """The state as JSON data with tensors replaced by references: only dicts (str or int
    keys), lists, tuples, str, int, float, bool, None and tensors; anything else is refused.
    Reading it back can build nothing else (no pickle: a checkpoint is data, not code)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def encode(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            key = id(obj)
            if key not in self._index:
                _check_tensor(obj)
                self._index[key] = len(self.tensors)
                self.tensors.append(obj)
            return {_TENSOR: self._index[key]}
        if obj is None or isinstance(obj, bool | int | str):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}
        if isinstance(obj, dict):
            items = []
            for key, value in obj.items():
                if not isinstance(key, str | int) or isinstance(key, bool):
                    raise TypeError(f"state dict keys must be str or int, got {key!r}")
                items.append([key, self.encode(value)])
            return {_DICT: items}
        if isinstance(obj, tuple):
            return {_TUPLE: [self.encode(v) for v in obj]}
        if isinstance(obj, list):
            return [self.encode(v) for v in obj]
        raise TypeError(
            f"cannot snapshot a {type(obj).__name__}: a state holds only dicts, lists, "
            "tuples, numbers, strings, None and tensors"
        )


def _decode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict) and len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == _TENSOR and isinstance(value, int) and 0 <= value < len(tensors):
            return tensors[value]
        if tag == _DICT and isinstance(value, list):
            out = {}
            for item in value:
                pair = isinstance(item, list) and len(item) == 2
                if not pair or not isinstance(item[0], str | int):
                    raise SkeletonError(f"bad dict item {item!r:.80}")
                out[item[0]] = _decode(item[1], tensors)
            return out
        if tag == _TUPLE and isinstance(value, list):
            return tuple(_decode(v, tensors) for v in value)
        if tag == _FLOAT and value in ("nan", "inf", "-inf"):
            return float(value)
    raise SkeletonError(f"not a skeleton node: {obj!r:.80}")


def plan_layout(state: dict[str, Any]) -> Layout:
    """Where every tensor of ``state`` goes; raises TypeError for unsupported objects."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    paths = {id(leaf): list(path) for path, leaf in _walk(state) if isinstance(leaf, torch.Tensor)}
    writer = _SkeletonWriter()
    skeleton = json.dumps(writer.encode(state), separators=(",", ":"), allow_nan=False)
    entries = []
    offset = 0
    for tensor in writer.tensors:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(
            TensorEntry(
                path=paths.get(id(tensor)),
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=list(tensor.shape),
                offset=offset,
                nbytes=nbytes,
            )
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return Layout(entries, writer.tensors, skeleton, offset)


def _view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    dtype = getattr(torch, entry.dtype)
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return raw.view(dtype).view(entry.shape)


def _pieces(copies: list[Copy], spans: list[tuple[int, int]]) -> list[list[Copy]]:
    """The copies cut along the buffer ranges ``spans``: one list of copies per range.

    A tensor that is not contiguous on both sides cannot be sliced flat and goes whole to
    the range where it starts.
    """
    starts = [start for start, _ in spans]
    pieces: list[list[Copy]] = [[] for _ in spans]
    for offset, target, source in copies:
        first = bisect.bisect_right(starts, offset) - 1
        if not (target.is_contiguous() and source.is_contiguous()):
            pieces[first].append((offset, target, source))
            continue
        flat_target, flat_source = target.reshape(-1), source.reshape(-1)  # views
        size = target.element_size()
        end = offset + target.numel() * size
        for index in range(first, len(spans)):
            start, stop = spans[index]
            if start >= end:
                break
            # Element bounds rounded up the same way on both sides of a cut: no gap, no overlap.
            low = -(-(max(start, offset) - offset) // size)
            high = -(-(min(stop, end) - offset) // size)
            if high > low:
                pieces[index].append((offset, flat_target[low:high], flat_source[low:high]))
    return [piece for piece in pieces if piece]


def _copy_all(copies: list[Copy]) -> None:
    for _, target, source in copies:
        target.copy_(source)


def _run_copies(copies: list[Copy], nbytes: int, workers: Workers | None) -> None:
    """Every ``target.copy_(source)``, on ``workers`` in byte-balanced pieces if given;
    ``nbytes`` is the extent of the buffer the offsets point into."""
    copies = [copy for copy in copies if copy[1].numel()]  # nothing to move, nowhere to go
    if workers is None or workers.threads == 1:
        _copy_all(copies)
        return
    pieces = _pieces(copies, split_spans(nbytes, workers.threads))
    workers.run([functools.partial(_copy_all, piece) for piece in pieces])


def copy_into(layout: Layout, buffer: torch.Tensor, workers: Workers | None = None) -> None:
    """Copy every tensor of ``layout`` into the uint8 ``buffer`` (device -> host if needed),
    on ``workers`` if given; returns when every byte is copied."""
    if buffer.numel() < layout.nbytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes cannot hold {layout.nbytes}")
    copies = [
        (entry.offset, _view(buffer, entry), tensor.detach())
        for entry, tensor in zip(layout.entries, layout.tensors, strict=True)
    ]
    _run_copies(copies, layout.nbytes, workers)


def tensor_paths(obj: Any) -> dict[KeyPath, torch.Tensor]:
    """Every tensor of the dict/list/tuple structure ``obj``, by key path."""
    return {path: leaf for path, leaf in _walk(obj) if isinstance(leaf, torch.Tensor)}


@functools.cache
def _madvise() -> Any:
    """libc's madvise, or None where there is none to call (not Linux, no libc found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def fresh_tensor(shape: list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; a big one asks for huge pages (only a hint: where the
    kernel says no, the tensor is the same, its first touch just slower)."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    madvise = _madvise() if nbytes >= 2 * HUGE_PAGE_BYTES else None
    if madvise is not None:
        start = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        stop = (tensor.data_ptr() + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if madvise(start, stop - start, MADV_HUGEPAGE) != 0:
            log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    return tensor


def _targets(
    record: SnapshotRecord, buffer: torch.Tensor, into: dict[str, Any] | None, copy: bool
) -> tuple[list[torch.Tensor], list[Copy], list[KeyPath]]:
    """Per tensor of ``record``: the tensor the state will hold, the copies that fill them,
    and the key paths of ``into``'s tensors among the destinations."""
    targets = tensor_paths(into) if into is not None else {}
    tensors: list[torch.Tensor] = []
    copies: list[Copy] = []
    in_place: list[KeyPath] = []
    for entry in record.tensors:
        source = _view(buffer, entry)
        path = tuple(entry.path) if entry.path is not None else None
        target = targets.get(path) if path is not None else None
        if target is None or target.dtype != source.dtype or target.shape != source.shape:
            target = fresh_tensor(source.shape, source.dtype) if copy else None
        elif path is not None:
            in_place.append(path)
        if target is None:
            tensors.append(source)
        else:
            copies.append((entry.offset, target, source))
            tensors.append(target)
    return tensors, copies, in_place


def parse_skeleton(record: SnapshotRecord) -> Any:
    """The record's skeleton, checked to be one this module wrote (before any byte of the
    snapshot reaches a caller's tensor); SkeletonError otherwise."""
    try:
        tree = json.loads(record.skeleton)
        state = _decode(tree, [torch.empty(0)] * len(record.tensors))
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, SkeletonError):
            raise
        raise SkeletonError(f"skeleton is not valid: {exc}") from None
    if not isinstance(state, dict):
        raise SkeletonError("skeleton is not a state dict")
    return tree


def _rebuild(tree: Any, tensors: list[torch.Tensor]) -> dict[str, Any]:
    return _decode(tree, tensors)


def assemble(
    record: SnapshotRecord,
    buffer: torch.Tensor,
    into: dict[str, Any] | None = None,
    copy: bool = True,
    workers: Workers | None = None,
) -> dict[str, Any]:
    """Rebuild the state described by ``record`` from the uint8 ``buffer``.

    A tensor whose key path exists in ``into`` with the same dtype and shape is filled in
    place and reused. Other tensors are fresh copies when ``copy`` is true (the buffer is
    shared memory that will be overwritten), otherwise views of ``buffer``. The copies run
    on ``workers`` if given.
    """
    tree = parse_skeleton(record)
    tensors, copies, _ = _targets(record, buffer, into, copy)
    _run_copies(copies, record.nbytes, workers)
    return _rebuild(tree, tensors)


@dataclass
class VerifiedCopy:
    """What ``assemble_verified`` did. ``crc32c`` is the checksum of the buffer's bytes it
    copied; ``in_place`` the key paths of the caller's tensors it wrote. Call ``state``
    only once the CRC matches the record's."""

    crc32c: int
    in_place: list[KeyPath]
    skeleton: Any  # parsed and checked before the copy began
    tensors: list[torch.Tensor]

    def state(self) -> dict[str, Any]:
        return _rebuild(self.skeleton, self.tensors)


@dataclass
class _Out:
    """One destination of a verified copy: buffer bytes [offset, end) go to ``target``."""

    offset: int
    end: int
    flat: np.ndarray | None  # the target's bytes, when a plain byte copy can fill it
    target: torch.Tensor
    source: torch.Tensor


def _byte_array(tensor: torch.Tensor) -> np.ndarray | None:
    """The bytes of a contiguous CPU tensor as a flat uint8 array sharing its memory; None
    for the rest (another device, strided, a lazy conjugate), which torch copies whole.

    numpy, not torch, moves the chunks: a slice assignment costs ~1 us against ~5 us for a
    torch slice + ``copy_``, and it releases the GIL all the same."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    if tensor.is_conj() or tensor.is_neg():
        return None
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _verify_copy_span(
    source: np.ndarray, outs: list[_Out], ends: list[int], span: tuple[int, int], chunk: int
) -> int:
    """CRC-32C of ``source[start:stop]``; on the way, copies the bytes of that range into
    the destinations, each chunk right after checksumming it (so it is read from cache).
    A destination that cannot take a byte copy is copied whole by the range where it
    starts."""
    start, stop = span
    crc = 0
    index = bisect.bisect_right(ends, start)  # the first destination ending after start
    for low in range(start, stop, chunk):
        high = min(low + chunk, stop)
        crc = crc32c.crc32c(source[low:high], crc)
        while index < len(outs) and outs[index].offset < high:
            out = outs[index]
            first, last = max(low, out.offset), min(high, out.end)
            if out.flat is not None:
                out.flat[first - out.offset : last - out.offset] = source[first:last]
            elif first == out.offset:
                out.target.copy_(out.source)
            if out.end > high:
                break  # continues in the next chunk
            index += 1
    return crc


def assemble_verified(
    record: SnapshotRecord,
    buffer: torch.Tensor,
    into: dict[str, Any] | None = None,
    workers: Workers | None = None,
    chunk_bytes: int = VERIFY_CHUNK_BYTES,
) -> VerifiedCopy:
    """Copy the state of ``record`` out of the uint8 ``buffer`` (shared memory) while
    computing the CRC-32C of all its ``record.nbytes`` bytes, padding included.

    Tensors found in ``into`` (same key path, dtype and shape) are written in place; the
    rest are fresh. The caller compares ``crc32c`` with the record before using the state;
    on a mismatch the fresh tensors are garbage to drop and the tensors of ``into`` listed
    in ``in_place`` hold bytes of a corrupt snapshot. Ranges run on ``workers`` if given.
    """
    if buffer.numel() < record.nbytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes cannot hold {record.nbytes}")
    skeleton = parse_skeleton(record)
    tensors, copies, in_place = _targets(record, buffer, into, copy=True)
    outs = sorted(
        (
            _Out(offset, offset + target.numel() * target.element_size(), None, target, source)
            for offset, target, source in copies
            if target.numel()
        ),
        key=lambda out: out.offset,
    )
    for out in outs:
        out.flat = _byte_array(out.target)
    ends = [out.end for out in outs]
    source = buffer[: record.nbytes].numpy()
    spans = split_spans(record.nbytes, workers.threads if workers is not None else 1)
    tasks = [
        functools.partial(_verify_copy_span, source, outs, ends, span, chunk_bytes)
        for span in spans
    ]
    crcs = workers.run(tasks) if workers is not None else [task() for task in tasks]
    crc = 0
    for (start, stop), piece_crc in zip(spans, crcs, strict=True):
        crc = crc32c_combine(crc, piece_crc, stop - start)
    return VerifiedCopy(crc, in_place, skeleton, tensors)
