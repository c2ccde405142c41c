"""The profiler measures real torch modules; the planners import and run without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from bulkhead.trainer.planning.templates import generate_templates


def test_profiler_measures_real_modules() -> None:
    import torch  # the planners never import it; the profiler measures torch modules

    torch.set_num_threads(1)
    torch.manual_seed(0)
    modules = [
        torch.nn.Linear(32, 64),
        torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(64, 16)),
    ]
    from bulkhead.trainer.planning.profile import profile_layers

    costs = profile_layers(modules, torch.randn(8, 32), names=["up", "down"], repeats=2)
    assert [c.name for c in costs] == ["up", "down"]
    assert costs[0].param_bytes == (32 * 64 + 64) * 4
    assert costs[1].param_bytes == (64 * 16 + 16) * 4
    assert costs[0].optimizer_bytes == 2 * costs[0].param_bytes
    for c in costs:
        assert c.forward_s > 0 and c.backward_s > 0
    # Linear saves its input for the weight gradient: 8 x 32 floats, weights excluded.
    assert costs[0].activation_bytes == 8 * 32 * 4
    # GELU saves its input and the second Linear saves the GELU output: 2 x 8 x 64 floats.
    assert costs[1].activation_bytes == 2 * 8 * 64 * 4
    from bulkhead.trainer.planning.costs import GpuSpec

    plans = generate_templates(costs, GpuSpec(gpus_per_node=1), 2)
    assert plans.get(2).num_stages == 2


def test_planning_imports_and_plans_without_torch() -> None:
    script = textwrap.dedent(
        """
        import importlib, sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
                return None

        sys.meta_path.insert(0, NoTorch())
        for mod in ["costs", "templates", "template_search", "instantiate", "reconfigure",
                    "experts", "expert_migration", "recovery", "dispatch_quotas", "profile"]:
            importlib.import_module("bulkhead.trainer.planning." + mod)
        importlib.import_module("bulkhead.cli.plan")  # `bulkhead plan`
        from bulkhead.trainer.planning.costs import GpuSpec, LayerCost
        from bulkhead.trainer.planning.templates import generate_templates
        layer = LayerCost("x", 0.01, 0.02, 1, 1, 1, 1)
        assert generate_templates([layer] * 4, GpuSpec(gpus_per_node=1), 4).max_nodes == 4
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
