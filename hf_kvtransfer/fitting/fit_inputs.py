"""The fit's side of the map inputs: one plug-in per input the fit searches, behind one interface, registered the way
the inputs themselves are (`core/map_inputs.py`).

A map input (`core/map_inputs.MapInput`) says how a mapper applies it at transfer time; its `FitInput` says how the
fit finds maps that read it:

- `statistics`: the calibration consumer (`calibration_pass.CalibrationConsumer`) that collects, in the fit's one
  calibration pass beside the source-only sums, what its solve needs within the budget the fit hands it
  (`budget.StatisticsBudget.residual_bytes`: what the K/V sums leave); None when this fit does not search the input
  (its options switch it off, the mapper kind cannot take it, its sums would not fit in memory: it logs one line why);
- `candidates`: from those sums and the source-only mapper, the mappers reading the input that the content probe
  (`exact_layers.choose_configuration`) tries, in groups (`CandidateGroup`) by the exact layers they need
  (`map_inputs.exact_layers_needed`), each group solved only when the probe reaches its count: the search stops at
  the first count that keeps the content, so the maps of the deeper counts are never solved;
- `describe` and `twin`: a candidate's fields in the probe's report, and which candidate is the same maps at full
  rank (a reduced-rank candidate is skipped once its full-rank twin failed);
- `planned_statistics`: what `statistics` would collect for a pair within a budget, from the two configs alone
  (`hf-kvtransfer plan` reports it: the fit's own choice, before any model is loaded).

The fit, the probe and their reports loop over the registered inputs; no module outside an input's own files names
it. The library's one: `residual_stats.ResidualFit` (maps reading the target's residual stream). Add one: a subclass in
its own module with `name` (its map input's) and `tag` (its mark in the fit's log line, "3+res"), `@register_fit_input`;
a module of the library is named in `BUILT_IN_FIT_INPUTS`.

Example:
    ```python
    for fit_input in registered_fit_inputs():
        consumer = fit_input.statistics(source, target, config, budget, log)
    ```
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

from transformers import PreTrainedModel

from ..core.mapper import KVMapper
from ..core.stats import KVLayout
from .budget import StatisticsBudget

# FitConfig (fitting/config.py) and a calibration consumer (calibration_pass.CalibrationConsumer): annotations only.
FitConfig = Any
Consumer = Any


@dataclasses.dataclass(frozen=True)
class CandidateGroup:
    """The candidates of one fit input that need the same exact layers, solved when the probe reaches them.

    `extends`: the fit input's name; `num_exact_layers`: what each of them needs (`map_inputs.exact_layers_needed` of
    its config; the probe checks); `fields`: the group's row in the probe's report while it is not solved (`inputs`, a
    phrase, and the fields of `FitInput.describe` it knows beforehand); `solve`: the mappers, the fullest first."""

    extends: str
    num_exact_layers: int
    fields: dict[str, Any]
    solve: Callable[[], list[KVMapper]]


class FitInput:
    """How the fit searches maps that read one map input. Subclasses set `name` (the map input's, `MapInput.name`) and
    `tag`, and override `statistics`, `candidates` and `describe`."""

    name: ClassVar[str] = ""
    # Its mark after the exact layers in the fit's one-line probe summary ("3+res").
    tag: ClassVar[str] = ""

    def statistics(self, source: PreTrainedModel, target: PreTrainedModel, config: FitConfig, budget: StatisticsBudget,
                   log: Callable[[str], None]) -> Consumer | None:  # fmt: skip
        """The calibration consumer collecting what `candidates` needs within `budget` (the fit's, after its K/V sums),
        or None (with one logged line why) when this fit does not search the input."""
        return None

    def candidates(self, mapper: KVMapper, statistics: Consumer, config: FitConfig) -> list[CandidateGroup]:
        """The mappers reading this input that the probe tries, from the source-only `mapper` and `statistics`, one
        group per exact-layer count, each solved only when the probe reaches it."""
        return []

    def describe(self, mapper: KVMapper) -> dict[str, Any]:
        """A candidate's fields in the probe's report beyond the generic ones (inputs, exact layers, scores)."""
        return {}

    def twin(self, mapper: KVMapper) -> tuple[Hashable, bool]:
        """`(key, reduced)`: candidates with the same key are the same maps at another rank; `reduced` when this one
        is reduced-rank (skipped once a full-rank twin failed the probe)."""
        return id(mapper), False

    def planned_statistics(self, source: KVLayout, target: KVLayout, hidden_size: int, positions: int,
                           budget: StatisticsBudget) -> dict[str, Any] | None:  # fmt: skip
        """What `statistics` collects for a pair of these layouts (`hidden_size`: the target's; `positions`: what the
        input reads per token) within `budget`, by the same rule: JSON fields, with `bytes` (what it collects) and
        `line` (the fit's log line), and `shared_rank` where the widest maps it would fit share a projection of that
        rank (the plan then costs the input at it). None: this input collects no sums of its own."""
        return None


FIT_INPUTS: dict[str, type[FitInput]] = {}

# The modules of the library's own fit inputs (each registers its class when imported).
BUILT_IN_FIT_INPUTS = ("residual_stats",)


def register_fit_input(cls: type[FitInput]) -> type[FitInput]:
    """Class decorator: make a fit input known by its map input's `name`."""
    if not cls.name or not cls.tag or cls.name in FIT_INPUTS and FIT_INPUTS[cls.name] is not cls:
        raise ValueError(f"fit input {cls.__name__} needs a name not taken and a tag, got {cls.name!r} / {cls.tag!r}")
    FIT_INPUTS[cls.name] = cls
    return cls


def registered_fit_inputs() -> list[FitInput]:
    """One instance of every registered fit input, by name."""
    for module in BUILT_IN_FIT_INPUTS:
        importlib.import_module(f"{__package__}.{module}")
    return [FIT_INPUTS[name]() for name in sorted(FIT_INPUTS)]


def fit_input_of(mapper: KVMapper) -> FitInput | None:
    """The fit input whose map input `mapper` reads (a probe candidate's), None for source-only maps."""
    found = [f for f in registered_fit_inputs() if f.name in mapper.config.map_inputs]
    return found[0] if found else None


def fit_input_named(name: str | None) -> FitInput | None:
    """The registered fit input called `name` (None for None or an unknown name)."""
    registered_fit_inputs()
    return FIT_INPUTS[name]() if name in FIT_INPUTS else None


__all__ = ["BUILT_IN_FIT_INPUTS", "FIT_INPUTS", "CandidateGroup", "FitInput", "fit_input_named", "fit_input_of", "register_fit_input",
           "registered_fit_inputs"]  # fmt: skip
