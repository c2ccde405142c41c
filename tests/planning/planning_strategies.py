"""Hypothesis strategies for the planner tests: small random layer costs and GPU specs."""

from __future__ import annotations

from hypothesis import strategies as st

from bulkhead.trainer.planning.costs import GpuSpec, LayerCost

GIB = 2**30


@st.composite
def layer_costs(draw: st.DrawFn, min_layers: int = 1, max_layers: int = 6) -> list[LayerCost]:
    n = draw(st.integers(min_layers, max_layers))
    out = []
    for i in range(n):
        fwd = draw(st.integers(1, 20)) / 1000
        out.append(
            LayerCost(
                name=f"l{i}",
                forward_s=fwd,
                backward_s=2 * fwd,
                param_bytes=draw(st.integers(0, 4)) * GIB // 8,
                grad_bytes=draw(st.integers(0, 4)) * GIB // 8,
                optimizer_bytes=draw(st.integers(0, 8)) * GIB // 8,
                activation_bytes=draw(st.integers(0, 4)) * GIB // 8,
            )
        )
    return out


@st.composite
def gpu_specs(draw: st.DrawFn) -> GpuSpec:
    return GpuSpec(
        gpus_per_node=draw(st.sampled_from([1, 2, 4])),
        memory_bytes=draw(st.integers(1, 6)) * GIB,
        memory_headroom=1.0,
        intra_node_bandwidth=draw(st.sampled_from([1e9, 1e10, 1e12])),
    )
