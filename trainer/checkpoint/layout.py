"""Flattening a training state into one byte buffer and back, without pickling tensor data.

``plan_layout`` finds every tensor in a nested state (model and optimizer state dicts, RNG
states, data position...), assigns it an aligned offset in a flat buffer and pickles the
rest of the state as a small skeleton in which tensors are references. ``copy_into``
fills a buffer; ``assemble`` rebuilds the state from a buffer, optionally copying into
the caller's existing tensors in place (like torch.distributed.checkpoint's load).

Both copies can run on a few threads (``Workers``; torch's ``copy_`` releases the GIL): the
buffer is cut into equal byte ranges and a big tensor is copied as flat slices, one per
range it overlaps, so every thread moves the same number of bytes.
"""

from __future__ import annotations

import base64
import bisect
import functools
import io
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bulkhead.trainer.checkpoint.checksum import PIECE_ALIGN, Workers, split_spans
from bulkhead.trainer.checkpoint.records import SnapshotRecord, TensorEntry

# Every tensor starts on a cache-line boundary, so any dtype can be viewed in place (and
# parallel pieces, cut at the same alignment, never split an element).
ALIGN = PIECE_ALIGN
Path = tuple[str | int, ...]
# One copy: buffer offset, destination, source (same shape and dtype).
Copy = tuple[int, torch.Tensor, torch.Tensor]


@dataclass
class Layout:
    """The tensors of a state, where each goes in the buffer, and the pickled remainder."""

    entries: list[TensorEntry]
    tensors: list[torch.Tensor]
    skeleton: str
    nbytes: int


def _walk(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
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


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        key = id(obj)
        if key not in self._index:
            _check_tensor(obj)
            self._index[key] = len(self.tensors)
            self.tensors.append(obj)
        return self._index[key]


def plan_layout(state: dict[str, Any]) -> Layout:
    """Where every tensor of ``state`` goes; raises TypeError for unsupported objects."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    paths = {id(leaf): list(path) for path, leaf in _walk(state) if isinstance(leaf, torch.Tensor)}
    buffer = io.BytesIO()
    pickler = _SkeletonPickler(buffer)
    try:
        pickler.dump(state)
    except (pickle.PicklingError, AttributeError) as exc:
        raise TypeError(f"state is not picklable apart from its tensors: {exc}") from exc
    entries = []
    offset = 0
    for tensor in pickler.tensors:
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
    return Layout(entries, pickler.tensors, base64.b64encode(buffer.getvalue()).decode(), offset)


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


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[pid]


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
    targets: dict[Path, torch.Tensor] = {}
    if into is not None:
        targets = {p: leaf for p, leaf in _walk(into) if isinstance(leaf, torch.Tensor)}
    tensors = []
    copies: list[Copy] = []
    for entry in record.tensors:
        source = _view(buffer, entry)
        target = targets.get(tuple(entry.path)) if entry.path is not None else None
        if target is None or target.dtype != source.dtype or target.shape != source.shape:
            target = torch.empty(source.shape, dtype=source.dtype) if copy else None
        if target is None:
            tensors.append(source)
        else:
            copies.append((entry.offset, target, source))
            tensors.append(target)
    _run_copies(copies, record.nbytes, workers)
    return _SkeletonUnpickler(base64.b64decode(record.skeleton), tensors).load()
