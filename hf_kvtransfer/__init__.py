"""hf-kvtransfer: reuse one model's KV cache in another model of the same family instead of re-running prefill."""

__version__ = "0.1.0"

from .cache import TransferredCache
from .capture import capture_kv, prefill
from .fit import collect_statistics, fit_mapper, solve_mapper
from .hub import MapperHubError
from .lowrank import reduce_mapper_rank
from .mapper import KVMapper, MapperConfig
from .mlp import fit_mlp_mapper
from .stats import KVLayout, KVStatistics

__all__ = [
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
