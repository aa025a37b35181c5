"""hf-kvtransfer: reuse one model's KV cache in another model of the same family instead of re-running prefill."""

from .accumulate import collect_statistics
from .cache import TransferredCache
from .capture import capture_kv, prefill
from .fit import fit_mapper, fit_mlp_mapper, solve_mapper
from .fit_config import FitConfig
from .hub import MapperHubError
from .lowrank import reduce_mapper_rank
from .mapper import KVMapper, MapperConfig
from .stats import KVLayout, KVStatistics
from .version import __version__

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
    "collect_statistics",
    "fit_mapper",
    "fit_mlp_mapper",
    "prefill",
    "reduce_mapper_rank",
    "solve_mapper",
]
