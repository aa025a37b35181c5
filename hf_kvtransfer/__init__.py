"""hf-kvtransfer: reuse one model's KV cache in another model of the same family instead of re-running prefill.

The public names load on first use (PEP 562), so `hf-kvtransfer --help` does not pay for importing torch and
transformers (seconds); `from hf_kvtransfer import KVMapper` works as usual. The subpackages are the layers of the
library (ARCHITECTURE.md): `core` (the math, the mapper, the cache), `evaluation`, `fitting`, `integrations` (lm-eval,
vLLM) and `commands` (the CLI).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

# The one list of public names: name -> the module that defines it.
_EXPORTS = {
    "KVLayout": "core.stats",
    "KVStatistics": "core.stats",
    "KVMapper": "core.mapper",
    "MapperConfig": "core.mapper",
    "MapperHubError": "core.hub",
    "TransferredCache": "core.cache",
    "GROUPED_SDPA": "core.grouped_attention",
    "QualityGateConfig": "core.quality_gate",
    "TransferStatus": "core.quality_gate",
    "resolve_num_recompute_tokens": "core.defaults",
    "capture_kv": "core.capture",
    "prefill": "core.capture",
    "reduce_mapper_rank": "core.lowrank",
    "FitConfig": "fitting.config",
    "collect_statistics": "fitting.accumulate",
    "choose_configuration": "fitting.exact_layers",
    "choose_num_exact_layers": "fitting.exact_layers",
    "ContentGate": "fitting.content_gate",
    "residual_input_features": "core.residual",
    "solve_residual_mapper": "fitting.residual_stats",
    "fit_mapper": "fitting.fit",
    "fit_mappers": "fitting.fit",
    "fit_mlp_mapper": "fitting.fit",
    "solve_mapper": "fitting.fit",
}

if TYPE_CHECKING:  # what type checkers and IDEs read; the same names as _EXPORTS
    from .core.cache import TransferredCache
    from .core.grouped_attention import GROUPED_SDPA
    from .core.quality_gate import QualityGateConfig, TransferStatus
    from .core.defaults import resolve_num_recompute_tokens
    from .core.capture import capture_kv, prefill
    from .core.hub import MapperHubError
    from .core.lowrank import reduce_mapper_rank
    from .core.mapper import KVMapper
    from .core.mapper_config import MapperConfig
    from .core.residual import residual_input_features
    from .core.stats import KVLayout, KVStatistics
    from .fitting.accumulate import collect_statistics
    from .fitting.config import FitConfig
    from .fitting.content_gate import ContentGate
    from .fitting.exact_layers import choose_configuration, choose_num_exact_layers
    from .fitting.fit import fit_mapper, fit_mappers, fit_mlp_mapper, solve_mapper
    from .fitting.residual_stats import solve_residual_mapper


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["__version__", *sorted(_EXPORTS)]
