"""hf-kvtransfer: reuse one model's KV cache in another model of the same family instead of re-running prefill.

The public names load on first use (PEP 562), so `import hf_kvtransfer.cli` and `hf-kvtransfer --help` do not
pay for importing torch and transformers (~5 s); `from hf_kvtransfer import KVMapper` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

# public name -> the module that defines it (also what type checkers and IDEs read, below)
_EXPORTS = {
    "collect_statistics": "accumulate",
    "TransferredCache": "cache",
    "capture_kv": "capture",
    "choose_num_exact_layers": "exact_layers",
    "prefill": "capture",
    "fit_mapper": "fit",
    "fit_mlp_mapper": "fit",
    "solve_mapper": "fit",
    "FitConfig": "fit_config",
    "MapperHubError": "hub",
    "reduce_mapper_rank": "lowrank",
    "resolve_num_recompute_tokens": "cache",
    "KVMapper": "mapper",
    "MapperConfig": "mapper",
    "KVLayout": "stats",
    "KVStatistics": "stats",
}

if TYPE_CHECKING:
    from .accumulate import collect_statistics
    from .cache import TransferredCache, resolve_num_recompute_tokens
    from .capture import capture_kv, prefill
    from .exact_layers import choose_num_exact_layers
    from .fit import fit_mapper, fit_mlp_mapper, solve_mapper
    from .fit_config import FitConfig
    from .hub import MapperHubError
    from .lowrank import reduce_mapper_rank
    from .mapper import KVMapper, MapperConfig
    from .stats import KVLayout, KVStatistics


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "FitConfig",
    "KVLayout",
    "KVMapper",
    "KVStatistics",
    "MapperConfig",
    "MapperHubError",
    "TransferredCache",
    "__version__",
    "capture_kv",
    "choose_num_exact_layers",
    "collect_statistics",
    "fit_mapper",
    "fit_mlp_mapper",
    "prefill",
    "reduce_mapper_rank",
    "resolve_num_recompute_tokens",
    "solve_mapper",
]
