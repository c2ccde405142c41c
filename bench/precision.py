"""Per-rank memory in bf16 and fp32: measured tensor bytes next to the planner's prediction.

For each family, precision (``spec.trainer.precision``) and activation checkpointing
setting, a worker process builds the engine exactly as a trainer does (``build_engine``
on a world of one rank: what each data-parallel rank holds, since data parallelism
replicates the whole state), trains two steps, and measures

- parameters, gradients and optimizer state: the bytes of the tensors the engine holds
  (``Engine.state_bytes``), against ``plan.state_bytes_per_rank`` (what ``bulkhead plan``
  and the ZeRO accounting predict: 4 + 4 + 8 bytes per parameter in either precision);
- activations: the bytes of the distinct tensors autograd saves for backward during one
  micro-batch's forward (``saved_tensors_hooks``; parameters excluded, autocast's bf16
  copies of the weights included: they live as long), and how many of them are bf16,
  against the planner's ``estimate_layer_costs(..., precision, checkpointing)`` summed
  over the units (a checkpointed block's kept input included: the hooks see it);
- the process's peak RSS.

Then every layout on two gloo ranks (``_rank_memory``: data parallel, ZeRO-1/2/3, a
1F1B pipeline of two stages, expert parallelism; fp32 and bf16): each rank's measured
state between steps and peak saved activations in a step, against what ``bulkhead plan``
prints for that rank (``parallel.rank_memory``).

Prints tables and writes JSON (``--out``: ``cases`` and ``layouts``); ``--quick`` uses the
tiny presets.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path
from typing import Any

from bulkhead.operator.local.children import end_children_on_exit

CASES = [
    ("gpt", "fp32", "none"),
    ("gpt", "bf16", "none"),
    ("gpt", "bf16", "full"),
    ("llama", "fp32", "none"),
    ("llama", "bf16", "none"),
    ("llama", "bf16", "full"),
    ("mixtral", "fp32", "none"),
    ("mixtral", "bf16", "none"),
]


def config(quick: bool, family: str, precision: str, checkpointing: str) -> Any:
    from bulkhead.api.spec import TrainingJobSpec
    from bulkhead.trainer.config import train_config

    model = {"family": family, "preset": "tiny" if quick else "small"}
    spec = TrainingJobSpec.model_validate(
        {
            "workers": 1,
            "trainer": {
                "model": model,
                "batch": {"globalBatchSize": 4, "microBatchSize": 4},
                "precision": precision,
                "activationCheckpointing": checkpointing,
            },
        }
    )
    return train_config(spec)


def _activation_bytes(engine: Any, dataset: Any) -> tuple[int, int]:
    """(bytes saved for backward, of which bf16) of one micro-batch's forward."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:  # parameters are state, not activations
            seen[ptr] = (t.untyped_storage().nbytes(), t.dtype == torch.bfloat16)
        return t

    cfg = engine.cfg
    batch = dataset.batch(list(range(cfg.micro_batch_size)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), engine.autocast():
        out = engine.model(batch.inputs, batch.targets)
    out.lm_loss.backward()
    engine.optimizer.zero_grad(set_to_none=True)
    return sum(n for n, _ in seen.values()), sum(n for n, bf16 in seen.values() if bf16)


def _case(quick: bool, family: str, precision: str, checkpointing: str, queue: Any) -> None:
    import torch

    from bulkhead.trainer.engine.device import pick_device
    from bulkhead.trainer.planning.costs import GpuSpec, estimate_layer_costs

    sys.path.insert(0, str(Path(__file__).parent))
    from _engine_runs import dataset_for, solo_world

    torch.set_num_threads(1)
    cfg = config(quick, family, precision, checkpointing)
    world, engine = solo_world(cfg, pick_device())
    try:
        dataset = dataset_for(cfg)
        for _ in range(2):
            engine.step(dataset)
        held, predicted = engine.state_bytes()
        acts, bf16 = _activation_bytes(engine, dataset)
        layers = estimate_layer_costs(
            cfg.shape, GpuSpec(), cfg.micro_batch_size, precision, checkpointing
        )
        measured = {"params": held.params, "grads": held.grads, "optimizer": held.optimizer,
                    "activations": acts, "activations_bf16": bf16}  # fmt: skip
        estimate = sum(c.activation_bytes for c in layers)
        queue.put(
            {
                "family": family,
                "precision": precision,
                "activationCheckpointing": checkpointing,
                "measured": measured,
                "predicted": {
                    "params": predicted.params,
                    "grads": predicted.grads,
                    "optimizer": predicted.optimizer,
                    "activations": estimate,
                },
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    finally:
        world.close()


def _result(proc: Any, queue: Any) -> dict[str, Any]:
    """The case's figures; a worker that died says so at once (its traceback is above)."""
    import queue as queues

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1)
        except queues.Empty:
            if not proc.is_alive():
                raise SystemExit(f"a case's worker exited with code {proc.exitcode}") from None
    raise SystemExit("a case's worker took more than 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="Write the figures as JSON here.")
    parser.add_argument("--quick", action="store_true", help="The tiny preset.")
    args = parser.parse_args()
    end_children_on_exit()  # a timeout or Ctrl-C leaves no case's process behind
    started = time.monotonic()
    # A fresh process per case (its own peak RSS), forked from a server that imported
    # torch and the engine once rather than importing them again per case.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "bulkhead.trainer.engine.parallelize"])
    results = []
    for case in CASES:
        queue = ctx.Queue()
        proc = ctx.Process(target=_case, args=(args.quick, *case, queue))
        proc.start()
        try:
            results.append(_result(proc, queue))
        finally:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    header = ("family", "precision", "AC", "kind", "measured", "predicted", "ratio")
    print("{:>6} {:>9} {:>5} {:>12} {:>12} {:>12} {:>6}".format(*header))
    for r in results:
        for kind in ("params", "grads", "optimizer", "activations"):
            m, p = r["measured"][kind], r["predicted"][kind]
            r.setdefault("ratio", {})[kind] = m / p if p else None
            ratio = f"{m / p:6.2f}" if p else "     -"
            print(f"{r['family']:>6} {r['precision']:>9} {r['activationCheckpointing']:>5} "
                  f"{kind:>12} {m:>12,} {p:>12,} {ratio}")  # fmt: skip
        print(f"{'':>6} {'':>9} {'':>5} {'rss peak':>12} {r['peak_rss_bytes']:>12,}")
    sys.path.insert(0, str(Path(__file__).parent))
    from _rank_memory import KINDS, layout_rows

    layouts = layout_rows(args.quick)
    print(f"\n{'layout':>14} {'precision':>9} {'rank':>4} " +
          " ".join(f"{k + ' m/p':>16}" for k in KINDS))  # fmt: skip
    for r in layouts:
        cells = " ".join(
            f"{r['measured'][k]:>10,} "
            + (f"{r['ratio'][k]:5.2f}" if r["ratio"][k] is not None else "    -")
            for k in KINDS
        )
        print(f"{r['layout']:>14} {r['precision']:>9} {r['rank']:>4} {cells}")
    out = {"quick": args.quick, "cases": results, "layouts": layouts,
           "seconds": time.monotonic() - started}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
