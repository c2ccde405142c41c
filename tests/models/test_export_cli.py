"""``bulkhead export`` from checkpoints written by the checkpoint storage code in the layouts
the engine's modes leave (ZeRO rows, experts per rank, pipeline stages), and ``bulkhead
model init``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from click.testing import CliRunner

from bulkhead.api.spec import ModelConfig
from bulkhead.cli.main import cli
from bulkhead.trainer.checkpoint.flatten import copy_into, plan_layout
from bulkhead.trainer.checkpoint.records import SnapshotRecord
from bulkhead.trainer.checkpoint.storage import FileStorage
from bulkhead.trainer.models import from_pretrained
from bulkhead.trainer.models.registry import family
from bulkhead.trainer.parallel.layout import KeySpec, shard_range

JOB = "tiny"
STEP = 12


def _manifest(path: Path, model: dict[str, Any]) -> Path:
    lines = [
        "apiVersion: bulkhead.dev/v1alpha1",
        "kind: TrainingJob",
        f"metadata: {{name: {JOB}}}",
        "spec:",
        "  workers: 2",
        "  trainer:",
        f"    model: {model}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _model(model: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    fam = family(model["family"])
    sizes = fam.sizes(ModelConfig.model_validate(model))
    torch.manual_seed(3)
    return sizes, {n: p.detach().clone() for n, p in fam.build(sizes).named_parameters()}


def _rows(t: torch.Tensor, shards: int, index: int) -> torch.Tensor:
    spec = KeySpec("k", t.numel(), t.shape[0], "", shardable=True)
    start, stop = shard_range(spec, shards, index)
    return t.reshape(-1)[start:stop]


def _write(root: Path, pieces: dict[str, tuple[tuple[int, int, int], dict]], plan: dict) -> None:
    """Persist one step: shard id -> (holding, keys), as the trainer's sidecar does."""
    storage = FileStorage(root)
    for shard, (holding, keys) in pieces.items():
        layout = plan_layout({"holding": list(holding), "keys": keys, "shard": shard})
        buffer = torch.zeros(max(layout.nbytes, 1), dtype=torch.uint8)
        copy_into(layout, buffer)
        record = SnapshotRecord(
            job=JOB, shard=shard, step=STEP, shards=sorted(pieces), plan=plan,
            nbytes=layout.nbytes, tensors=layout.entries, skeleton=layout.skeleton,
        )  # fmt: skip
        data = memoryview(buffer.numpy())[: layout.nbytes]
        record.seal(crc32c.crc32c(data))
        storage.persist(record, data)


def _zero_pieces(params: dict[str, torch.Tensor], shards: int) -> dict:
    pieces = {}
    for i in range(shards):
        keys = {f"param/{n}": _rows(p, shards, i).clone() for n, p in params.items()}
        keys |= {f"optim/{n}/exp_avg": torch.zeros_like(t) for n, t in keys.items()}
        pieces[f"zero{shards}-s{i}"] = ((STEP + 1, shards, i), keys)
    return pieces


def _expert_stage_pieces(params: dict[str, torch.Tensor]) -> dict:
    """Two pipeline stages (blocks split by name), the second holding its experts over two
    ranks, each whole; the first stage sharded in rows over two processes."""
    pieces: dict = {}
    first = {n: p for n, p in params.items() if n.startswith(("model.embed", "model.layers.0."))}
    for i in range(2):
        keys = {f"param/{n}": _rows(p, 2, i).clone() for n, p in first.items()}
        pieces[f"stage0-s{i}"] = ((STEP + 1, 2, i), keys)
    rest = {n: p for n, p in params.items() if n not in first}
    for i in range(2):
        keys = {
            f"param/{n}": p.reshape(-1).clone()
            for n, p in rest.items()
            if ".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) % 2 == i
        }
        pieces[f"stage1-r{i}"] = ((STEP + 1, 1, 0), keys)
    return pieces


def _export(tmp_path: Path, model: dict, pieces: dict, plan: dict | None = None) -> Any:
    _write(tmp_path / "ckpt", pieces, plan or {})
    args = ["export", str(tmp_path / "ckpt" / JOB), "--out", str(tmp_path / "hf")]
    if plan is None or "model" not in plan:
        args += ["--job", str(_manifest(tmp_path / "job.yaml", model))]
    return CliRunner().invoke(cli, [*args, "--shard-size", "100KB"])


def _assert_exported(tmp_path: Path, params: dict[str, torch.Tensor]) -> None:
    loaded = dict(from_pretrained(tmp_path / "hf").model.named_parameters())
    assert loaded.keys() == params.keys()
    for name, p in params.items():
        assert torch.equal(loaded[name], p), name


def test_export_of_zero_shards_with_the_job_manifest(tmp_path):
    model = {"family": "llama", "preset": "tiny", "tieEmbeddings": True}
    _, params = _model(model)
    result = _export(tmp_path, model, _zero_pieces(params, 3))
    assert result.exit_code == 0, result.output
    assert f"LlamaForCausalLM of step {STEP} of job {JOB}" in result.output
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    _assert_exported(tmp_path, params)


def test_export_of_pipeline_stages_and_experts_with_the_model_in_the_plan(tmp_path):
    model = {"family": "mixtral", "preset": "tiny"}
    _, params = _model(model)
    result = _export(tmp_path, model, _expert_stage_pieces(params), plan={"model": model})
    assert result.exit_code == 0, result.output
    _assert_exported(tmp_path, params)


def test_export_errors_name_what_is_wrong(tmp_path):
    model = {"family": "llama", "preset": "tiny"}
    _, params = _model(model)
    _write(tmp_path / "ckpt", _zero_pieces(params, 2), {})
    # (the gpt family, like this user family, has no Hugging Face counterpart)
    gpt = _manifest(tmp_path / "gpt.yaml", {"family": "hf_models:NO_HF", "preset": "tiny"})
    out = CliRunner().invoke(cli, ["export", str(tmp_path / "ckpt" / JOB), "--out",
                                   str(tmp_path / "x"), "--job", str(gpt)])  # fmt: skip
    assert out.exit_code != 0 and "the no-hf family has no Hugging Face counterpart" in out.output
    out = CliRunner().invoke(
        cli, ["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]
    )
    assert out.exit_code != 0 and "no such checkpoint directory" in out.output
    out = CliRunner().invoke(
        cli, ["export", str(tmp_path / "ckpt" / JOB), "--out", str(tmp_path / "x")]
    )
    assert out.exit_code != 0 and "does not record its model: pass --job" in out.output


def test_a_step_missing_a_shard_is_not_exported(tmp_path):
    model = {"family": "llama", "preset": "tiny"}
    _, params = _model(model)
    _write(tmp_path / "ckpt", _zero_pieces(params, 2), {})
    next((tmp_path / "ckpt").rglob("zero2-s1.manifest.json")).unlink()
    result = _export_existing(tmp_path, model)
    assert result.exit_code != 0
    assert f"no complete step (step {STEP} lacks shard(s) zero2-s1)" in result.output


def test_corrupt_bytes_are_never_exported(tmp_path):
    model = {"family": "llama", "preset": "tiny"}
    _, params = _model(model)
    _write(tmp_path / "ckpt", _zero_pieces(params, 2), {})
    data = next((tmp_path / "ckpt").rglob("zero2-s0-*.bin"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    result = _export_existing(tmp_path, model)
    assert result.exit_code != 0 and "shard zero2-s0" in result.output
    assert "CRC-32C" in result.output and not (tmp_path / "hf").exists()


def _export_existing(tmp_path: Path, model: dict) -> Any:
    args = ["export", str(tmp_path / "ckpt" / JOB), "--out", str(tmp_path / "hf")]
    return CliRunner().invoke(cli, [*args, "--job", str(_manifest(tmp_path / "j.yaml", model))])


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_model_init_writes_a_random_directory_of_the_preset(name, tmp_path):
    result = CliRunner().invoke(cli, ["model", "init", "--family", name, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    loaded = from_pretrained(tmp_path)
    expected = family(name).sizes(ModelConfig.model_validate({"family": name, "preset": "tiny"}))
    assert loaded.sizes == expected
    logits = loaded(torch.zeros(1, 5, dtype=torch.int64))
    assert logits.shape == (1, 5, expected.vocab_size)
    assert math.isfinite(float(logits.detach().abs().sum()))


def test_export_converts_to_the_dtype_asked_for(tmp_path):
    model = {"family": "mixtral", "preset": "tiny"}
    _, params = _model(model)
    _write(tmp_path / "ckpt", _zero_pieces(params, 2), {"model": model})
    args = ["export", str(tmp_path / "ckpt" / JOB), "--out", str(tmp_path / "hf")]
    result = CliRunner().invoke(cli, [*args, "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    loaded = from_pretrained(tmp_path / "hf")
    for name, p in loaded.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, params[name].bfloat16()), name
