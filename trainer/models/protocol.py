"""The model-family protocol: everything the engine knows about a model.

The engine, the planners' profiling, checkpoint keys and ``bulkhead plan`` use only what
this module declares; nothing outside ``trainer/models/`` names a family's modules or
parameters. A family is a ``ModelFamily`` (registered in ``registry.py``) that builds a
``CausalLM`` from the job's ``ModelConfig`` (or a Hugging Face ``config.json``).

Units. A model is a sequence of units: unit 0 is the embedding, units ``1..n`` are the
decoder blocks, unit ``n + 1`` the final norm and the head. A pipeline stage holds a
contiguous range of units and runs ``model(x, targets, units=(start, stop))``; ZeRO shards
each block as one FSDP2 unit. Weights shared by several units (a tied embedding and head)
are declared in ``tied``: their key group is ``TIED`` and every stage holding one of those
units holds them.

Mixture-of-Experts. A block's MoE layer is an ``MoELayer``: a router, whole experts (the
unit placement moves), the routing function and the auxiliary loss. Expert parallelism
never re-implements routing: it replaces only ``MoELayer.dispatch`` (how routed tokens
reach the experts and come back) and the set of experts a rank hosts.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from bulkhead.trainer.planning.costs import ActivationValues, ModelShape, UnitShape


@dataclass
class ModelOutput:
    """``logits``: ``[batch, seq, vocab]``, or the hidden states leaving a stage that does
    not hold the head. ``lm_loss``: mean cross-entropy over the batch's tokens (``None``
    without targets or without the head). ``aux_loss``: the MoE auxiliary loss of the
    blocks that ran (zero for a dense model). ``aux_stats``: for a family whose MoE layers
    are ``pooled``, the routing statistics of the blocks that ran, summed; a pipeline adds
    up its stages' and takes ``pooled_loss`` of the total (``None`` otherwise)."""

    logits: torch.Tensor
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor
    aux_stats: torch.Tensor | None = None

    def total(self, aux_coef: float) -> torch.Tensor:
        if self.lm_loss is None:
            raise ValueError("no targets were given, so there is no loss")
        return self.lm_loss + aux_coef * self.aux_loss


@dataclass
class Routing:
    """Where each token of a flattened ``[tokens, d_model]`` input goes.

    ``probs``: ``[tokens, experts]`` router probabilities (what the auxiliary loss reads);
    ``weights``: ``[tokens, top_k]`` mixing weights of the chosen experts; ``chosen``:
    ``[tokens, top_k]`` expert indices (int64)."""

    probs: torch.Tensor
    weights: torch.Tensor
    chosen: torch.Tensor


class Dispatch(Protocol):
    """How routed tokens reach the experts: ``(layer, tokens, routing) -> [tokens, d]``,
    the weighted sum of each token's chosen experts' outputs."""

    def __call__(self, layer: MoELayer, tokens: torch.Tensor, routing: Routing) -> torch.Tensor: ...


def local_dispatch(layer: MoELayer, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Every expert on this process, each on the tokens that chose it."""
    out = torch.zeros_like(tokens)
    for key, expert in layer.experts.items():
        e = int(key)
        # Every expert runs, on no tokens if none chose it: its gradient is then zero
        # rather than missing, so sharded and replicated gradient reductions line up.
        token_idx, slot = (routing.chosen == e).nonzero(as_tuple=True)
        contribution = expert(tokens[token_idx]) * routing.weights[token_idx, slot].unsqueeze(-1)
        out = out.index_add(0, token_idx, contribution.to(out.dtype))
    return out


def routed_values(
    fp32: float,
    compute: float,
    moe: MoELayer,
    d_model: int,
    expert_values: float,
    expert_casts: float,
) -> ActivationValues:
    """Per-token values of a block whose feed-forward is ``moe`` under ``local_dispatch``
    (``CausalLM.activation_values``): the block's other values (``fp32``, ``compute``),
    plus the router's probabilities, mixing weights and their sum (fp32) and choices, plus
    for each of the token's ``top_k`` routed copies its gathered input (fp32: the norm's
    output), the expert's ``expert_values`` (its output included; ``expert_casts``: bf16
    copies of the input its projections make), its mixing weight, the weighted output
    (``index_add`` keeps it) and its index."""
    k, d = moe.top_k, d_model
    return ActivationValues(
        fp32=fp32 + moe.num_experts + k + 1 + k * d,
        compute=compute + k * (expert_values + 1 + d),
        bf16_casts=k * expert_casts,
        int64=2 * k,
    )


class MoELayer(nn.Module, ABC):
    """A routed feed-forward: ``forward(x) -> (y, aux_loss)``.

    ``experts`` is a ``ModuleDict`` keyed by the expert's index as a string, so that a rank
    hosting only some experts keeps their true indices (and their parameter names).
    ``dispatch`` is replaced by expert parallelism; everything else is the family's.

    The auxiliary loss is either per layer (``aux_loss``, summed over the layers) or, when
    ``pooled``, a function (``pooled_loss``) of routing statistics (``balance_stats``)
    summed over every MoE layer of the model, as Hugging Face's Mixtral pools the router
    logits of all layers before the product. ``forward`` then returns the statistics.
    """

    pooled: ClassVar[bool] = False
    num_experts: int
    top_k: int
    router: nn.Module
    experts: nn.ModuleDict

    def __init__(self) -> None:
        super().__init__()
        self.dispatch: Dispatch = local_dispatch

    @abstractmethod
    def route(self, tokens: torch.Tensor) -> Routing:
        """The router's decision for ``tokens`` (``[tokens, d_model]``)."""

    @abstractmethod
    def aux_loss(self, routing: Routing) -> torch.Tensor:
        """The load-balancing loss of one routing (a scalar)."""

    def balance_stats(self, routing: Routing) -> torch.Tensor:
        """A ``pooled`` layer's routing statistics: a 1-D float32 tensor of
        ``stats_size`` values, additive over layers and over a pipeline's stages."""
        raise NotImplementedError

    def pooled_loss(self, stats: torch.Tensor) -> torch.Tensor:
        """A ``pooled`` layer's loss of statistics summed over the model's MoE layers."""
        raise NotImplementedError

    @property
    def stats_size(self) -> int:
        """Length of ``balance_stats`` (a pipeline stage allocates it before receiving)."""
        raise NotImplementedError

    @abstractmethod
    def new_expert(self) -> nn.Module:
        """A fresh expert of this layer's shape (its values are transferred in)."""

    def shared_output(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Output of experts every token uses (DeepSeek/Qwen-style shared experts)."""
        return None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.route(tokens)
        out = self.dispatch(self, tokens, routing)
        shared = self.shared_output(tokens)
        if shared is not None:
            out = out + shared
        balance = self.balance_stats(routing) if self.pooled else self.aux_loss(routing)
        return out.reshape(shape), balance


class CausalLM(nn.Module, ABC):
    """A decoder-only language model of some family (see the module docstring).

    ``forward(tokens, targets=None, units=None)``: ``tokens`` are token ids ``[batch,
    seq]`` (int64), or the hidden states entering unit ``units[0] > 0``. Calling the model
    with only ``tokens`` returns logits through ``ModelOutput.logits``; ``__call__`` of an
    exported model (``from_pretrained``) returns the logits tensor itself.
    """

    family: ClassVar[str]
    # Groups of parameter names that are one tensor (e.g. the tied embedding and head),
    # the first name of each group being the one state keys use.
    tied: ClassVar[tuple[tuple[str, ...], ...]] = ()

    @property
    @abstractmethod
    def blocks(self) -> nn.ModuleList:
        """The decoder blocks, in order (unit ``i + 1`` is ``blocks[i]``)."""

    @abstractmethod
    def unit_modules(self, unit: int) -> list[nn.Module]:
        """The modules unit ``unit`` runs (0: embedding, ``n + 1``: final norm and head;
        tied weights appear in every unit that uses them)."""

    @abstractmethod
    def unit_of(self, param: str) -> int:
        """The unit a parameter name belongs to (a tied name: its first user's unit)."""

    @abstractmethod
    def moe_layers(self) -> dict[int, MoELayer]:
        """Block index (0-based) -> that block's MoE layer, for the MoE blocks."""

    def aux_pool(self) -> MoELayer | None:
        """The MoE layer whose ``pooled_loss`` turns the statistics summed over every MoE
        layer into the auxiliary loss (``None``: the loss is a sum of per-layer losses)."""
        return next((m for m in self.moe_layers().values() if m.pooled), None)

    @abstractmethod
    def moe_path(self, block: int) -> str:
        """Qualified module name of block ``block``'s MoE layer; its experts' parameters
        are named ``f"{moe_path(block)}.experts.{expert}.<rest>"``."""

    @abstractmethod
    def decays(self, param: str, tensor: torch.Tensor) -> bool:
        """Whether weight decay applies (not to norms, biases or embeddings)."""

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        units: tuple[int, int] | None = None,
    ) -> ModelOutput: ...

    def activation_values(self, unit: int) -> ActivationValues | None:
        """What one token of unit ``unit`` keeps for backward, counted from what the
        family's modules save (``bulkhead plan``'s activation memory; ``bench/precision.py``
        measures it). ``None``: the planner's generic decoder-block estimate."""
        return None

    def retie(self) -> None:
        """Share the tied tensors again (``to_empty`` and meta materialization untie)."""

    def init_weights(self) -> None:
        """Initialize every parameter from the global RNG (the caller seeds it)."""
        raise NotImplementedError


class MoESizesLike(Protocol):
    """What the engine reads of a family's MoE sizes."""

    num_experts: int
    top_k: int
    load_balance_coef: float


class SizesLike(Protocol):
    """What the engine and the planners read of a family's size object (``sizes(...)``):
    the planners' cost estimate and the pipeline's activation shape come from these."""

    vocab_size: int
    d_model: int  # the hidden width between units (a pipeline's activations)
    n_layers: int
    n_heads: int
    seq_len: int
    moe: MoESizesLike | None


@dataclass(frozen=True)
class ModelFamily:
    """One registered family.

    ``sizes(model_config)`` resolves the job's ``spec.trainer.model`` into the family's
    frozen size object (it raises ``ValueError`` naming the spec field); ``build(sizes)``
    constructs the modules on the current default device, uninitialized when that is
    ``meta``. ``hf`` maps to and from Hugging Face checkpoints (``None``: the family has
    no Hugging Face counterpart).
    """

    name: str
    sizes: Callable[[Any], Any]
    build: Callable[[Any], CausalLM]
    hf: Any = None  # hf.HFMapping
    description: str = ""


def count_params(model: nn.Module, names: Sequence[str] | None = None) -> int:
    """Parameters of ``model`` (each shared tensor once)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if (names is None or name in names) and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def build_seeded(family: ModelFamily, sizes: Any, seed: int) -> CausalLM:
    """``family``'s model with weights a pure function of ``seed`` (every rank builds the
    same one); the global RNG is left as it was."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = family.build(sizes)
        model.init_weights()
        return model
    finally:
        torch.random.set_rng_state(generator_state)


def build_meta(family: ModelFamily, sizes: Any) -> CausalLM:
    """``family``'s model without storage (names, shapes and units only)."""
    with torch.device("meta"):
        return family.build(sizes)


def materialize(model: CausalLM, modules: Sequence[nn.Module], device: torch.device | str) -> None:
    """Give uninitialized storage on ``device`` to those of ``modules`` still on the meta
    device, sharing tied tensors (a tied tensor materialized once serves every user)."""
    for module in modules:
        model.retie()
        if any(p.is_meta for p in module.parameters()):
            module.to_empty(device=device)
    model.retie()


def build_empty(family: ModelFamily, sizes: Any, device: torch.device | str) -> CausalLM:
    """``family``'s whole model with uninitialized storage on ``device`` (for a caller that
    overwrites every parameter: random initialization of a large model is wasted time)."""
    model = build_meta(family, sizes)
    materialize(model, [model], device)
    return model


def num_units(model: CausalLM) -> int:
    """Units of ``model``: the embedding, every block, the head."""
    return len(model.blocks) + 2


def experts_prefix(model: CausalLM, block: int) -> str:
    """The name prefix of block ``block``'s experts' parameters."""
    return f"{model.moe_path(block)}.experts."


def model_shape(family: ModelFamily, sizes: SizesLike) -> ModelShape:
    """The planners' view of ``family``'s model of ``sizes`` (measured on the meta
    device through the protocol; cached, since every plan of a job asks for it)."""
    try:
        return _model_shape(family.name, family, sizes)
    except TypeError:  # unhashable sizes: measure every time
        return _model_shape.__wrapped__(family.name, family, sizes)


@functools.lru_cache(maxsize=32)
def _model_shape(_name: str, family: ModelFamily, sizes: SizesLike) -> ModelShape:
    model = build_meta(family, sizes)
    n = len(model.blocks)
    moe = model.moe_layers()
    units = []
    for unit in range(n + 2):
        modules = model.unit_modules(unit)
        params = count_params(nn.ModuleList(modules))
        active = params
        kind = "embedding" if unit == 0 else "head" if unit == n + 1 else "block"
        name = {"embedding": "embedding", "head": "head"}.get(kind, f"block{unit - 1}")
        layer = moe.get(unit - 1) if kind == "block" else None
        if layer is not None:
            per_expert = count_params(next(iter(layer.experts.values())))
            active -= (layer.num_experts - layer.top_k) * per_expert
            name += ".moe"
        units.append(UnitShape(name, params, active, kind, model.activation_values(unit)))
    first = next(iter(moe.values()), None)
    return ModelShape(
        units=tuple(units),
        d_model=sizes.d_model,
        seq_len=sizes.seq_len,
        n_heads=sizes.n_heads,
        vocab_size=sizes.vocab_size,
        moe_blocks=tuple(sorted(moe)),
        num_experts=first.num_experts if first is not None else 0,
    )
