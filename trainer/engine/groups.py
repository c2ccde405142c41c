"""The key group of every parameter, from the model-family protocol alone.

A parameter belongs to the unit ``model.unit_of(name)`` says (group ``unit/<u>``), to the
tied group when it is one of ``model.tied``'s names, or, under expert parallelism, to its
expert's group ``expert/<block>/<expert>`` when its name is under
``moe_path(block).experts.<expert>.``. An optimizer key ``optim/<name>/<slot>`` follows its
parameter. Nothing here knows a family's module names.
"""

from __future__ import annotations

from bulkhead.trainer.models.protocol import CausalLM, ModelFamily, build_meta, experts_prefix
from bulkhead.trainer.parallel.experts_plan import expert_group
from bulkhead.trainer.parallel.pipeline_plan import TIED, unit_group


class ParamGroups:
    """Names -> groups for one model (any instance of the family: built on meta is fine)."""

    def __init__(self, model: CausalLM, experts: bool = False) -> None:
        self._unit_of = model.unit_of
        self._tied = {name for names in model.tied for name in names}
        self._experts = experts
        self._prefixes = {b: experts_prefix(model, b) for b in model.moe_layers()}

    def expert_of(self, name: str) -> tuple[int, int] | None:
        """(block, expert) of an expert's parameter name (or a key naming it), else None."""
        name = _param_name(name)
        for block, prefix in self._prefixes.items():
            if name.startswith(prefix):
                return block, int(name[len(prefix) :].split(".", 1)[0])
        return None

    def renumber(self, key: str, block: int, expert: int) -> str:
        """``key`` of some expert rewritten to expert ``expert`` of block ``block``."""
        kind, name = key.split("/", 1)
        where = self.expert_of(name)
        assert where is not None, f"{key} is no expert's"
        rest = name[len(self._prefixes[where[0]]) :].split(".", 1)[1]
        return f"{kind}/{self._prefixes[block]}{expert}.{rest}"

    def group(self, name: str) -> str:
        """The key group of a parameter name (or a ``param/``/``optim/`` key)."""
        name = _param_name(name)
        if self._experts:
            where = self.expert_of(name)
            if where is not None:
                return expert_group(*where)
        if name in self._tied:
            return TIED
        return unit_group(self._unit_of(name))


def _param_name(name: str) -> str:
    """The parameter name of a key (``param/<n>``, ``optim/<n>/<slot>``) or of a name."""
    if name.startswith(("param/", "optim/", "buffer/")):
        name = name.split("/", 1)[1]
    return name.split("/", 1)[0]


def group_sizes(family: ModelFamily, sizes: object, experts: bool) -> dict[str, int]:
    """Parameters per key group of the model (``experts``: one group per expert)."""
    model = build_meta(family, sizes)
    groups = ParamGroups(model, experts)
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        group = groups.group(name)
        out[group] = out.get(group, 0) + p.numel()
    return out
