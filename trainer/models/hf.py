"""Hugging Face weights in: read exactly the rows each rank holds from ``*.safetensors``.

``read_params(directory, family_or_model, wanted)`` takes bulkhead parameter names (the
model's ``named_parameters()`` names) with a flat element range of whole rows (dim-0
aligned, as the engine's layouts shard) or ``None`` for the whole tensor, and returns flat
tensors of exactly those elements. Whole rows of a tensor are one contiguous byte range of
its file, so each is read with one positioned read (``preadv``) straight into the tensor
returned: no rank reads, maps or materialises bytes it does not hold. (safetensors' lazy
``get_slice`` does the same through a memory map; its page faults cost 10-20x the CPU of
one read per range, measured in bench/models.py's setting, so the reader takes the byte
ranges from the file's header, whose format safetensors documents: an 8-byte little-endian
length, then JSON ``{name: {dtype, shape, data_offsets}}``, then the data.)

Checkpoints may be one file or sharded with ``model.safetensors.index.json``. Mixtral's
experts come in the two layouts seen in the wild, told apart by the tensor names: one
tensor per expert (``block_sparse_moe.experts.E.w1.weight``: identical to bulkhead's
names) or fused per layer as transformers 5 holds them in memory
(``experts.gate_up_proj [E, 2F, D]`` with the gate rows first, ``experts.down_proj
[E, D, F]``, router ``mlp.gate.weight``).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from bulkhead.trainer.models.hf_config import mapping_for, read_config
from bulkhead.trainer.models.protocol import CausalLM, ModelFamily

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
Range = tuple[int, int]

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")


class WeightsError(ValueError):
    """A Hugging Face directory that does not hold what the model needs (names the tensor
    and the file)."""


@dataclass
class ReadStats:
    """What a ``read_params`` call read: tensor bytes taken from the files (as stored)."""

    bytes: int = 0
    files: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Source:
    """Where a bulkhead parameter's rows live: ``tensor[index..., offset + row]``."""

    name: str  # the Hugging Face tensor
    file: str
    index: tuple[int, ...] = ()  # leading indices (the expert of a fused tensor)
    offset: int = 0  # row offset inside the indexed tensor (w3's rows follow w1's)


# safetensors dtype codes -> torch dtypes (the data is little-endian, like every host here).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header


class SafetensorsFile:
    """One ``*.safetensors`` file: its header, and positioned reads of element ranges."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise WeightsError(f"{path}: cannot open it: {exc.strerror}") from None
        try:
            size = os.fstat(self.fd).st_size
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0).ljust(8, b"\0"))
            if not 2 <= n <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {n}")
            header = json.loads(os.pread(self.fd, n, 8))
            self.data_start = 8 + n
            self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = _DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ValueError(f"{name}: unsupported dtype {info['dtype']}")
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(v) for v in info["data_offsets"])
                if end - begin != math.prod(shape) * dtype.itemsize or self.data_start + end > size:
                    raise ValueError(f"{name}: data_offsets {begin}..{end} do not fit")
                self.tensors[name] = (dtype, shape, begin)
        except (ValueError, KeyError, TypeError) as exc:
            self.close()
            raise WeightsError(f"{path}: not a safetensors file ({exc})") from None

    def read(
        self, name: str, first: int, count: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[first, first + count)`` of tensor ``name`` (flattened), read now into
        ``out`` (a contiguous tensor of that many elements and the stored dtype) or a new
        tensor."""
        dtype, _, begin = self.tensors[name]
        if out is None:
            out = torch.empty(count, dtype=dtype)
        view = memoryview(out.view(torch.uint8).numpy()) if count else memoryview(b"")
        at, done = self.data_start + begin + first * dtype.itemsize, 0
        while done < len(view):  # a read may return fewer bytes (e.g. past 2 GiB)
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got <= 0:
                raise WeightsError(f"{self.path}: ended early reading {name!r}")
            done += got
        return out

    def close(self) -> None:
        os.close(self.fd)


class HFWeights:
    """The tensors of a Hugging Face directory: which file holds each, and their layout."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                self.files: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise WeightsError(f"{index}: not a safetensors index ({exc})") from None
        else:
            found = sorted(self.directory.glob("*.safetensors"))
            if not found:
                raise WeightsError(f"{self.directory}: no *.safetensors files")
            self.files = {}
            for path in found:
                file = SafetensorsFile(path)
                file.close()
                self.files.update(dict.fromkeys(file.tensors, path.name))
        self.fused = any(n.endswith(".experts.gate_up_proj") for n in self.files)

    def source(self, param: str, shape: torch.Size) -> _Source:
        """Where ``param`` (a bulkhead name, of ``shape``) is stored."""
        expert = _EXPERT.match(param)
        if expert is not None and self.fused:
            layer, e, which = expert.group(1), int(expert.group(2)), expert.group(3)
            fused = "down_proj" if which == "w2" else "gate_up_proj"
            name = self._first(
                [f"{layer}.{p}.experts.{fused}" for p in ("mlp", "block_sparse_moe")]
            )
            offset = shape[0] if which == "w3" else 0
            return _Source(name, self.files[name], (e,), offset)
        router = _ROUTER.match(param)
        if router is not None:
            name = self._first([param, f"{router.group(1)}.mlp.gate.weight"])
            return _Source(name, self.files[name])
        self._first([param])
        return _Source(param, self.files[param])

    def _first(self, names: list[str]) -> str:
        for name in names:
            if name in self.files:
                return name
        raise WeightsError(
            f"tensor {names[0]!r} is missing from {self.directory}"
            + (f" (nor is {', '.join(map(repr, names[1:]))})" if len(names) > 1 else "")
        )


def _shapes(
    family_or_model: CausalLM | ModelFamily | str, directory: Path
) -> dict[str, torch.Size]:
    if isinstance(family_or_model, nn.Module):
        return {n: p.shape for n, p in family_or_model.named_parameters()}
    from bulkhead.trainer.models.registry import family

    fam = family(family_or_model) if isinstance(family_or_model, str) else family_or_model
    config = read_config(directory)
    sizes = _hf_of(fam).sizes(config, str(directory / "config.json"))
    with torch.device("meta"):
        model = fam.build(sizes)
    return {n: p.shape for n, p in model.named_parameters()}


def _hf_of(fam: ModelFamily):
    if fam.hf is None:
        raise WeightsError(f"the {fam.name} family has no Hugging Face counterpart")
    return fam.hf


def read_params(
    directory: str | Path,
    family_or_model: CausalLM | ModelFamily | str,
    wanted: Mapping[str, Range | None],
    dtype: torch.dtype | None = None,
    stats: ReadStats | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Flat tensors of the ``wanted`` element ranges of bulkhead parameters, read from the
    Hugging Face ``directory`` (see the module docstring). ``family_or_model`` gives the
    parameter shapes: a model (possibly on ``meta``), a family or its name (then sized by
    the directory's config.json). ``dtype``: convert to it (default: as stored).

    ``into``: where the values go, by parameter name (a contiguous CPU tensor of the range's
    size, e.g. the engine's own state): the file's bytes are read straight into it, with
    neither a new allocation (whose first touch costs as much as the read here) nor a copy;
    the result then holds it. A parameter whose destination has another dtype than the
    file's is read into a new tensor and converted into it."""
    directory = Path(directory)
    shapes = _shapes(family_or_model, directory)
    weights = HFWeights(directory)
    plans: dict[str, list[tuple[str, _Source, tuple[int, int]]]] = {}
    for param, span in wanted.items():
        if param not in shapes:
            raise WeightsError(f"{param!r} is not a parameter of the model")
        shape = shapes[param]
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        start, stop = span if span is not None else (0, math.prod(shape))
        if start % row or stop % row or not 0 <= start <= stop <= math.prod(shape):
            raise WeightsError(
                f"{param}: range [{start}, {stop}) is not whole rows of {tuple(shape)}"
            )
        source = weights.source(param, shape)
        plans.setdefault(source.file, []).append((param, source, (start // row, stop // row)))
    out: dict[str, torch.Tensor] = {}
    for file, items in plans.items():
        path = directory / file
        reader = SafetensorsFile(path)
        try:
            for param, source, (r0, r1) in items:
                if source.name not in reader.tensors:
                    raise WeightsError(f"{path}: has no tensor {source.name!r} (the index says so)")
                stored = reader.tensors[source.name][1]
                _check_shape(source, stored, shapes[param], path)
                row = math.prod(stored[-1:]) if source.index else math.prod(stored[1:])
                first_row = source.offset + r0
                if source.index:  # fused: expert e's rows start after e experts' rows
                    first_row += source.index[0] * stored[1]
                count = (r1 - r0) * row
                stored_dtype = reader.tensors[source.name][0]
                target = _destination(into, param, count)
                direct = target is not None and target.dtype == stored_dtype
                flat = reader.read(source.name, first_row * row, count, target if direct else None)
                if target is not None and not direct:
                    flat = target.copy_(flat)
                elif dtype is not None and flat.dtype != dtype:
                    flat = flat.to(dtype)
                out[param] = flat
                if stats is not None:
                    stats.bytes += (r1 - r0) * row * reader.tensors[source.name][0].itemsize
                    stats.files.add(file)
        finally:
            reader.close()
    return out


def _destination(
    into: Mapping[str, torch.Tensor] | None, param: str, count: int
) -> torch.Tensor | None:
    if into is None or param not in into:
        return None
    target = into[param]
    if target.numel() != count or not target.is_contiguous() or target.device.type != "cpu":
        raise WeightsError(
            f"{param}: the destination given holds {target.numel()} elements"
            f"{'' if target.is_contiguous() else ', not contiguous'} on {target.device}; "
            f"the range read has {count} (a contiguous CPU tensor is needed)"
        )
    return target.view(-1)


def _check_shape(source: _Source, stored: tuple[int, ...], shape: torch.Size, path: Path) -> None:
    ours = tuple(shape)
    if source.index:  # fused experts: [E, rows of w1 and w3 | rows of w2, columns]
        rows = ours[0] * (2 if source.name.endswith("gate_up_proj") else 1)
        ok = len(stored) == 3 and stored[0] > source.index[0] and stored[1:] == (rows, ours[1])
    else:
        ok = stored == ours
    if not ok:
        raise WeightsError(
            f"{path}: tensor {source.name!r} has shape {list(stored)}, the model needs "
            f"{list(ours)}" + (" per expert" if source.index else "")
        )


def load_pretrained(model: CausalLM, directory: str | Path) -> CausalLM:
    """Fill every parameter of ``model`` from the Hugging Face ``directory`` (whose
    config.json must describe the model's family)."""
    directory = Path(directory)
    mapping = mapping_for(read_config(directory), str(directory / "config.json"))
    if mapping.family != model.family:
        raise WeightsError(
            f"{directory / 'config.json'}: a {mapping.architecture}, not a {model.family} model"
        )
    params = dict(model.named_parameters())
    into = {n: p.detach().view(-1) for n, p in params.items() if p.is_cpu and p.is_contiguous()}
    tensors = read_params(directory, model, dict.fromkeys(params), into=into)
    with torch.no_grad():
        for name, p in params.items():
            if name not in into:  # read elsewhere (another device, a strided parameter)
                p.view(-1).copy_(tensors[name])
    return model
