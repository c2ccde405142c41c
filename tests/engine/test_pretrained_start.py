"""A fresh start from pretrained weights: each rank reads only the parameter ranges its
plan gives it, and training starts from those values (real gloo processes).

The Hugging Face reader belongs to the model families; here a fake reader, injected per
engine, returns values that are a pure function of (name, element index) and records
what each rank asked for.
"""

from __future__ import annotations

import pickle
import zlib
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engine_harness import free_port, full_state
from processes import preloaded_context

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.pretrained import initial_state_from_pretrained
from bulkhead.trainer.engine.world import open_world
from bulkhead.trainer.parallel.layout import KeySpec
from bulkhead.trainer.parallel.plan import make_plan

pytestmark = pytest.mark.slow

DIRECTORY = "/pretrained/tiny"  # never opened: the fake reader stands in for the files
WORKERS = ["w0", "w1"]


def config(**parallelism: object) -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": 2,
            "trainer": {
                "model": {"preset": "tiny"},
                "batch": {"globalBatchSize": 4, "microBatchSize": 2},
                "steps": 10,
                "parallelism": parallelism,
            },
            "faultTolerance": {"maxFailures": 0},
        }
    )
    return replace(train_config(spec), pretrained=DIRECTORY)


def pretrained_value(name: str, numel: int) -> torch.Tensor:
    """The checkpoint's flat values of parameter ``name``."""
    return torch.arange(numel, dtype=torch.float32) * 1e-6 + (zlib.crc32(name.encode()) % 97)


class FakeReader:
    def __init__(self, numel: dict[str, int]) -> None:
        self.numel = numel
        self.requests: dict[str, tuple[int, int] | None] = {}

    def __call__(
        self, directory: str, model: object, wanted: dict, into: dict
    ) -> dict[str, torch.Tensor]:
        assert directory == DIRECTORY
        self.requests.update(wanted)
        out = {}
        for name, span in wanted.items():
            whole = pretrained_value(name, self.numel[name])
            out[name] = whole if span is None else whole[span[0] : span[1]]
            if name in into:  # as the Hugging Face reader does: straight into the state
                out[name] = into[name].copy_(out[name])
        return out


def _rank_main(rank: int, port: int, out_dir: str, parallelism: dict) -> None:
    torch.set_num_threads(1)
    cfg = config(**parallelism)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    world = open_world(1, rank, WORKERS, WORKERS, store, pick_device(False), 60)
    engine = build_engine(make_plan(1, WORKERS, WORKERS, cfg), world, cfg)
    reader = FakeReader({s.name.removeprefix("param/"): s.numel for s in engine.specs})
    engine.read_pretrained = reader
    adoption = engine.adopt(None)
    state = full_state(engine)
    out = {"source": adoption.source, "requests": reader.requests, "state": state}
    world.close()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


def run(tmp: Path, parallelism: dict) -> list[dict]:
    ctx = preloaded_context()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, str(tmp), parallelism)) for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def test_zero3_ranks_read_only_their_shards_and_start_from_them(tmp_path: Path) -> None:
    ranks = run(tmp_path, {"zero": {"stage": 3}})
    assert [r["source"] for r in ranks] == ["fresh", "fresh"]
    state = ranks[0]["state"]
    params = {k.removeprefix("param/"): t for k, t in state.items() if k.startswith("param/")}
    assert "tok_emb.weight" in params and "head.weight" not in params  # tied: one key
    for name, values in params.items():
        torch.testing.assert_close(values, pretrained_value(name, values.numel()), msg=name)
    # Optimizer state starts empty, as after a seeded start.
    assert all(not t.any() for k, t in state.items() if k.startswith("optim/"))
    # Each rank asked for its half of every matrix's rows, not the whole tensor.
    embedding = params["tok_emb.weight"].numel()
    spans = [r["requests"]["tok_emb.weight"] for r in ranks]
    assert spans == [(0, embedding // 2), (embedding // 2, embedding)]
    read = 0
    for r in ranks:
        for name, span in r["requests"].items():
            start, stop = span if span is not None else (0, params[name].numel())
            read += stop - start
    assert read == sum(t.numel() for t in params.values())  # every element read once


def test_pipeline_stages_read_only_their_units(tmp_path: Path) -> None:
    ranks = run(tmp_path, {"pipeline": {"minStages": 2, "maxStages": 2}})
    first, last = (set(r["requests"]) for r in ranks)
    assert "pos_emb.weight" in first and "pos_emb.weight" not in last
    assert "ln_f.weight" in last and "ln_f.weight" not in first
    assert "tok_emb.weight" in first & last  # the tied embedding: both ends hold it
    assert all(span is None for r in ranks for span in r["requests"].values())  # whole
    state = ranks[0]["state"]
    for key, values in state.items():
        if key.startswith("param/"):
            name = key.removeprefix("param/")
            torch.testing.assert_close(values, pretrained_value(name, values.numel()), msg=name)


def test_a_missing_or_mis_sized_tensor_is_an_error_naming_it() -> None:
    specs = {"param/w": KeySpec("param/w", 6, 3, "float32", True)}
    with pytest.raises(ValueError, match=r"pretrained\.path.*gave no values for w"):
        initial_state_from_pretrained(DIRECTORY, None, {"param/w": (0, 6)}, specs,
                                      lambda d, m, w, i: {})  # fmt: skip
    with pytest.raises(ValueError, match=r"w: 3 elements read for the range \[2, 6\) of 4"):
        initial_state_from_pretrained(DIRECTORY, None, {"param/w": (2, 6)}, specs,
                                      lambda d, m, w, i: {"w": torch.zeros(3)})  # fmt: skip
