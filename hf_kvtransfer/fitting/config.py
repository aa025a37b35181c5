"""`FitConfig`: every hyper-parameter of a fit in one validated dataclass.

The Python API (`fit_mapper(source, target, calibration, config=FitConfig(...), **overrides)`), the
`hf-kvtransfer fit` / `solve` command line (whose options are generated from the fields' metadata) and the
workflows (`workflow.fit_and_save`, `workflow.solve_and_save`) all read the same object, so a value has one
grammar, one default and one meaning everywhere.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# No torch at import: `hf-kvtransfer --help` builds its options from this module's fields (importing torch takes seconds).
from ..core.mapper_types import MLP, RIDGE
from .budget import budget_bytes
from .calibration import DEFAULT_NUM_SEQUENCES, DEFAULT_SEQ_LEN, DEFAULT_SPLIT, DEFAULT_TEXT_FIELD

if TYPE_CHECKING:
    import torch

# The paper's k sweep and a lambda grid around its 0.01 (lambda multiplies the *sum* Gram matrix).
PAPER_TOP_K_CANDIDATES = (1, 2, 4, 6, 8, 10, 12, 16, 20, 24, None)
RIDGE_LAMBDA_CANDIDATES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)
MAPPER_TYPES = (RIDGE, MLP)  # what a fit can produce (reduced rank comes from a ridge fit: `rank`)
MAPPER_DTYPES = ("float32", "bfloat16", "float16")


def _as_list(value) -> list:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return [w for v in value for w in _as_list(v)]
    return [value]


def parse_top_k(top_k) -> list[int | None | str]:
    """The one `top_k` grammar: `8`, `"all"`, `"1,2,all"`, `"auto"`, `[1, "all"]` (None = all) -> a list of ints,
    None (= all source layers) and "auto" (pick by held-out R^2, among the listed values if any)."""
    out: list[int | None | str] = []
    for v in _as_list(top_k):
        if v is None or v == "all":
            out.append(None)
        elif v == "auto":
            out.append("auto")
        elif isinstance(v, bool):
            raise ValueError(f"top_k must be integers, 'all' or 'auto' (comma-separated), got {v!r}")
        else:
            try:
                value = int(v)
            except (TypeError, ValueError):
                raise ValueError(f"top_k must be integers, 'all' or 'auto' (comma-separated), got {v!r}") from None
            if value < 1:
                raise ValueError(f"top_k must be >= 1 (or 'all' / 'auto'), got {value}")
            out.append(value)
    if not out:
        raise ValueError("top_k is empty: give an integer, 'all', several ('1,2,all') or 'auto'")
    return list(dict.fromkeys(out))


def parse_ridge_lambda(ridge_lambda) -> list[float | str]:
    """`0.01`, `"auto"`, `"0.01,0.1,auto"` -> a list of floats (>= 0) and "auto"."""
    out: list[float | str] = []
    for v in _as_list(ridge_lambda):
        if v == "auto":
            out.append("auto")
            continue
        try:
            value = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"ridge_lambda must be numbers or 'auto' (comma-separated), got {v!r}") from None
        if value < 0:
            raise ValueError(f"ridge_lambda must be >= 0, got {value}")
        out.append(value)
    if not out:
        raise ValueError("ridge_lambda is empty: give a number, several with 'auto', or 'auto'")
    return list(dict.fromkeys(out))


def parse_num_exact_layers(value) -> int | str:
    """`"auto"`, `4`, `"4"` -> "auto" or an int >= 0."""
    if value == "auto":
        return value
    if not isinstance(value, bool):
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = -1
        if number >= 0 and str(number) == str(value).strip():
            return number
    raise ValueError(
        f"num_exact_layers (--exact-layers) must be 'auto' or an integer >= 0 (the target's first layers), got {value!r}"
    )


def parse_exact_window(value) -> int | str | None:
    """`"auto"`, `None` / `"none"`, `64` / `"64"` -> "auto", None (the whole prompt) or an int >= 1 (tokens)."""
    if value == "auto" or value is None:
        return value
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    if not isinstance(value, bool):
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = 0
        if number >= 1 and str(number) == str(value).strip():
            return number
    raise ValueError(
        f"exact_window (--exact-window) must be 'auto', 'none' (the whole prompt) or a number of tokens >= 1, got {value!r}"
    )


def parse_rank_spec(spec: str) -> dict[str, Any]:
    """'full' | '16' | 'energy=0.99' | 'budget=0.25', optionally '@bf16' / '@fp16' / '@fp32' (the mapper's weight
    and compute dtype) -> `solve_mapper` keyword arguments (`rank`, `energy`, `size_budget`, `dtype`)."""
    spec, _, dtype = str(spec).strip().partition("@")
    if dtype:
        if dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"mapper dtype in {spec}@{dtype} must be one of ['bf16', 'fp16', 'fp32']")
        from ..core.loading import DTYPES

        return {**parse_rank_spec(spec), "dtype": DTYPES[dtype]}
    if spec == "full":
        return {}
    if spec.isdigit() and int(spec) >= 1:
        return {"rank": int(spec)}
    key, _, value = spec.partition("=")
    if key in ("energy", "budget") and value:
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if number > 0:
            return {"energy" if key == "energy" else "size_budget": number}
    raise ValueError(
        f"rank spec must be 'full', an integer rank, 'energy=F' or 'budget=F' (optionally @bf16/@fp16/@fp32); got {spec!r}"
    )


def parse_residual_lags(value, name: str = "residual_lags") -> tuple[int, ...]:
    """Token lags (residual features) from "0,1,2" or a sequence: distinct integers >= 0."""
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        lags = tuple(int(str(v).strip()) for v in items)
    except ValueError:
        lags = ()
    if not lags or any(lag < 0 for lag in lags) or len(set(lags)) != len(lags):
        raise ValueError(f"{name} must be distinct integers >= 0 such as '0,1,2', got {value!r}")
    return lags


def heldout_count(num_sequences: int, heldout_fraction: float) -> int:
    """Sequences held out for a fraction (the *last* ones of the sample): at least one when the fraction is
    positive, never all of them."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if heldout_fraction == 0:
        return 0
    count = max(1, round(num_sequences * heldout_fraction))
    if count >= num_sequences:
        raise ValueError(
            f"heldout_fraction {heldout_fraction} leaves no sequence to fit on ({num_sequences} in all); "
            "pass more sequences or a smaller heldout_fraction"
        )
    return count


def mapper_name(top_k: int | None) -> str:
    """Subdirectory name of the mapper for one k when several are written: `k4`, `kall`."""
    return "kall" if top_k is None else f"k{top_k}"


def _opt(help: str, *, cli: str | None = None, group: str = "fit", **extra) -> dict[str, Any]:
    """Field metadata: the CLI option (default `--field-name`), its help and group (`cli.py` builds argparse
    options from it); `cli=""` keeps a field out of the command line."""
    return {"help": help, "cli": cli, "group": group, **extra}


@dataclass(frozen=True)
class FitConfig:
    """How a mapper is fit: calibration data, the pass over it, layer selection and solve, mapper type.

    Defaults follow the paper (FineWeb-Edu sample-10BT, 500 x 1024 tokens, every 4th token, k = 8,
    lambda = 0.01), plus a held-out shard of the *last* 10% of the sequences for out-of-sample R^2 (the weights
    are refit on all sequences unless `refit=False`). Validated on construction: a bad value raises `ValueError`
    saying what was expected. Build variants with `dataclasses.replace(config, top_k=4)` or
    `config.replace(top_k=4)`.

    Example:
        ```python
        config = FitConfig(top_k="1,2,all", ridge_lambda=0.01, num_sequences=64, seq_len=256)
        mappers = fit_mapper(source, target, "corpus.txt", tokenizer=tok, config=config)
        ```
    """

    # -- what is fit
    top_k: Any = field(default=8, metadata=_opt(
        "source layers per target layer: N, 'all', several ('1,2,all': one mapper each from one pass) or 'auto' "
        "(pick by held-out R^2, among listed values if any); default 8", group="solve"))  # fmt: skip
    ridge_lambda: Any = field(default=0.01, metadata=_opt(
        "ridge penalty on the centered sum Gram matrix (default 0.01), or 'auto' (held-out R^2; among listed "
        "values if any, else 1e-3 ... 1e3)", group="solve"))  # fmt: skip
    refit: bool = field(default=True, metadata=_opt(
        "keep the fit-shard weights instead of refitting on all sequences", cli="--no-refit", group="solve",
        invert=True))  # fmt: skip
    rank: str | None = field(default=None, metadata=_opt(
        "reduced-rank ridge mapper from the same statistics: an integer rank per map, energy=F (per map, the "
        "smallest rank keeping this fraction of the fitted variance, e.g. 0.99) or budget=F (parameters, a count "
        "or a fraction of full rank); default full rank", group="solve", metavar="SPEC"))  # fmt: skip
    mapper_dtype: str = field(default="float32", metadata=_opt(
        "weight dtype of the written mapper; bfloat16 halves the file and runs the transfer's GEMMs in bf16 "
        "(float32 accumulation); default float32", group="solve", choices=MAPPER_DTYPES))  # fmt: skip
    mapper_type: str = field(default=RIDGE, metadata=_opt(
        "ridge (closed form, default) or mlp: an MLP per target layer and K|V, by default a residual on top of "
        "ridge with early stopping on the held-out sequences", cli="--mapper", choices=MAPPER_TYPES))  # fmt: skip
    num_exact_layers: Any = field(default="auto", metadata=_opt(
        "the target's first layers TransferredCache computes itself with this mapper: 'auto' (default) = the fewest "
        "that keep --exact-layers-retention of the target's copying from its context on held-out calibration "
        "text (exact_layers.py), or a number (no probe)", cli="--exact-layers", group="exact", metavar="N|auto"))  # fmt: skip
    exact_window: Any = field(default="auto", metadata=_opt(
        "how far back the exact layers' attention reaches over the transferred prompt, in tokens: 'auto' (default) = "
        "with --exact-layers auto, the smallest window the content gate accepts (exact_window.py), else none; "
        "'none' = the whole prompt; or a number", group="exact", metavar="N|auto|none"))  # fmt: skip
    exact_layers_retention: float = field(default=0.95, metadata=_opt(
        "repeated-span retention 'auto' must reach (default 0.95)", group="exact", metavar="FRACTION"))
    residual_inputs: str = field(default="auto", metadata=_opt(
        "with --exact-layers auto, also try maps that read the target's own residual stream after its exact layers "
        "(residual.py): 'auto' (default: the probe keeps them where they are faster and keep the repeated spans and "
        "the cued recall the source-only answer keeps) or 'off' (source K/V maps only)", group="exact",
        choices=("auto", "off")))  # fmt: skip
    residual_lags: str = field(default="0,1,2", metadata=_opt(
        "token offsets of the residual features (default 0,1,2: positions t, t-1, t-2)", group="exact", metavar="LAGS"))
    residual_rank: int | None = field(default=None, metadata=_opt(
        "rank of one projection of the residual features shared by all layers, for every candidate (default: full "
        "rank, plus one reduced-rank candidate of maps reading the residual alone, at the rank keeping 0.99 of what "
        "the full-rank maps predict)", group="exact", metavar="R"))  # fmt: skip
    residual_stride: int | None = field(default=None, metadata=_opt(
        "token stride of the residual-input statistics (default: --stride); 1 uses every token, for small "
        "calibration samples", group="exact", metavar="N"))  # fmt: skip
    residual_lambda: float = field(default=0.01, metadata=_opt(
        "ridge penalty of the residual-input maps on standardised inputs (default 0.01)", group="exact"))
    exact_layers_timing_tokens: int = field(default=512, metadata=_opt(
        "prompt tokens the probe times each candidate's first token on (one thread; default 512)", group="exact",
        metavar="N"))  # fmt: skip
    exact_layers_items: int = field(default=64, metadata=_opt(
        "items per probe: repeated spans, cued-recall records for maps reading the residual, and twice as many "
        "passage-recall and hand-off items per task for the content gate, which extends an undecided candidate to "
        "what its measured spread needs, at most 4 times that (default 64)", group="exact", metavar="N"))  # fmt: skip
    exact_layers_tolerance: float = field(default=0.05, metadata=_opt(
        "the content gate's tolerance: a configuration is kept only if the paired 95-percent interval of its passage-recall "
        "and hand-off accuracy minus the target's own (held-out probe items) ends above -tolerance on each "
        "(default 0.05: 5 points; content_gate.py)", group="exact", metavar="FRACTION"))  # fmt: skip
    quality_gate_quantile: float | None = field(default=None, metadata=_opt(
        "record a per-request quality gate: its threshold is this quantile of the gate's score (worst-layer cosine of "
        "the mapped K/V against the target's own on the recomputed tokens) over up to 200 held-out 256-token prompts; "
        "rows below it fall back to the target's own prefill (e.g. 0.01; default: no gate)", metavar="FRACTION"))  # fmt: skip
    # -- calibration data
    dataset: str | None = field(default=None, metadata=_opt(
        "Hub dataset id (streamed) or local .txt/.jsonl/.parquet file or directory (default "
        "HuggingFaceFW/fineweb-edu, config sample-10BT)", group="data"))  # fmt: skip
    dataset_config: str | None = field(default=None, metadata=_opt(
        "Hub dataset config (default sample-10BT for the default dataset)", group="data"))
    split: str = field(default=DEFAULT_SPLIT, metadata=_opt("dataset split (default train)", group="data"))
    text_field: str = field(default=DEFAULT_TEXT_FIELD, metadata=_opt(
        "text column of .jsonl/.parquet/Hub rows (default text)", group="data"))
    num_sequences: int = field(default=DEFAULT_NUM_SEQUENCES, metadata=_opt(
        "calibration sequences (default 500)", group="data"))
    seq_len: int = field(default=DEFAULT_SEQ_LEN, metadata=_opt("tokens per packed sequence (default 1024)", group="data"))
    # -- the calibration pass
    stride: int = field(default=4, metadata=_opt("use every n-th token (default 4)"))
    batch_size: int = field(default=8, metadata=_opt("sequences per forward (default 8)"))
    heldout_fraction: float = field(default=0.1, metadata=_opt(
        "share of the sequences held out (the last ones) for out-of-sample R^2, 'auto' and the MLP's early "
        "stopping (default 0.1; 0 disables)"))  # fmt: skip
    checkpoint_every: int = field(default=64, metadata=_opt("checkpoint every N sequences per rank (default 64)"))
    stats_dir: str | None = field(default=None, metadata=_opt(
        "keep the statistics (train/, heldout/) and checkpoints here for later refits (`solve`)"))
    checkpoint_dir: str | None = field(default=None, metadata=_opt(
        "where partial statistics are checkpointed (default: STATS_DIR/checkpoints, or none in Python)", cli=""))
    statistics_device: str | None = field(default=None, metadata=_opt(
        "where the sums live (default: the target's GPU if they fit, else cpu)"))
    two_stage: bool | None = field(default=None, metadata=_opt(
        "bounded memory: probe layer selection on --probe-tokens tokens, then keep only the blocks of the top-k "
        "layers (default: automatic when the full statistics exceed the memory budget)", boolean_optional=True))
    probe_tokens: int = field(default=8192, metadata=_opt("tokens for the two-stage probe (default 8192)"))
    max_statistics_memory: float | None = field(default=None, metadata=_opt(
        "budget for all the statistics in GiB: the K/V sums switch to two-stage past it, and the residual input's sums "
        "get what they leave where both live on the CPU (default: half the free memory for the K/V sums, 4 GiB for the "
        "residual sums)",
        metavar="GIB"))  # fmt: skip
    progress: bool = field(default=True, metadata=_opt("progress bars", cli=""))
    # -- MLP mapper (mapper_type="mlp"; paper: 2 x 1024 ReLU units, Adam, MSE)
    mlp_hidden_size: int = field(default=1024, metadata=_opt("hidden units per layer (default 1024)", group="mlp"))
    mlp_num_hidden_layers: int = field(default=2, metadata=_opt("hidden layers (default 2)", cli="--mlp-layers", group="mlp"))
    mlp_epochs: int = field(default=20, metadata=_opt("maximum epochs (default 20)", group="mlp"))
    mlp_lr: float = field(default=1e-3, metadata=_opt("Adam learning rate (default 1e-3)", group="mlp"))
    mlp_batch_size: int = field(default=256, metadata=_opt("tokens per Adam step (default 256)", group="mlp"))
    mlp_patience: int | None = field(default=5, metadata=_opt(
        "stop after this many epochs without held-out improvement (default 5)", group="mlp"))
    mlp_residual: bool = field(default=True, metadata=_opt(
        "the paper's plain MLP instead of a residual on ridge", cli="--mlp-plain", group="mlp", invert=True))
    mlp_per_head: bool = field(default=False, metadata=_opt("one MLP per target KV head (the paper's layout)", group="mlp"))
    mlp_feature_stride: int | None = field(default=None, metadata=_opt(
        "token stride of the features the MLP trains on (default: --stride); raise it to save memory", group="mlp"))
    mlp_feature_dtype: str = field(default="float32", metadata=_opt(
        "dtype the MLP's features are kept in on the host (default float32)", group="mlp", choices=MAPPER_DTYPES))
    mlp_device: str | None = field(default=None, metadata=_opt(
        "where the MLPs train (default: the source model's device)", group="mlp"))
    seed: int = field(default=0, metadata=_opt("seed of the MLP's initialisation and shuffling (default 0)", group="mlp"))

    def __post_init__(self):
        # Normalised in place once (the dataclass is frozen), then checked; the first failing check raises.
        self._normalise_candidates()
        self._check_gates()
        self._check_residual_inputs()
        self._check_counts()
        self._check_mlp_training()
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1) (the share of sequences held out), got {self.heldout_fraction}")
        self._check_solver()
        for name in ("dataset", "stats_dir", "checkpoint_dir"):
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        self._check_combinations()

    def _normalise_candidates(self) -> None:
        """`top_k`, `ridge_lambda` and `num_exact_layers` parsed from the option grammar."""
        set_ = object.__setattr__
        set_(self, "top_k", tuple("all" if k is None else k for k in parse_top_k(self.top_k)))
        set_(self, "ridge_lambda", tuple(parse_ridge_lambda(self.ridge_lambda)))
        set_(self, "num_exact_layers", parse_num_exact_layers(self.num_exact_layers))
        set_(self, "exact_window", parse_exact_window(self.exact_window))

    def _check_gates(self) -> None:
        """The quality gate's quantile and the exact-layer search's fractions."""
        if self.quality_gate_quantile is not None and not 0 <= self.quality_gate_quantile < 1:
            raise ValueError(f"quality_gate_quantile must be in [0, 1), got {self.quality_gate_quantile}")
        if not 0 < self.exact_layers_retention <= 1:
            raise ValueError(f"exact_layers_retention must be in (0, 1], got {self.exact_layers_retention}")
        if not 0 < self.exact_layers_tolerance < 1:
            raise ValueError(f"exact_layers_tolerance must be a fraction of accuracy in (0, 1) (0.05 = 5 points), got "
                             f"{self.exact_layers_tolerance}")  # fmt: skip

    def _check_residual_inputs(self) -> None:
        """The residual-input options (`residual_lags` parsed)."""
        if self.residual_inputs not in ("auto", "off"):
            raise ValueError(f"residual_inputs must be 'auto' or 'off', got {self.residual_inputs!r}")
        object.__setattr__(self, "residual_lags", parse_residual_lags(self.residual_lags))
        if self.residual_rank is not None and (isinstance(self.residual_rank, bool) or not isinstance(self.residual_rank, int) or self.residual_rank < 1):
            raise ValueError(f"residual_rank must be an integer >= 1 or None, got {self.residual_rank!r}")
        if self.residual_stride is not None and (isinstance(self.residual_stride, bool) or not isinstance(self.residual_stride, int) or self.residual_stride < 1):
            raise ValueError(f"residual_stride must be an integer >= 1 or None, got {self.residual_stride!r}")
        if not self.residual_lambda > 0:
            raise ValueError(f"residual_lambda must be > 0, got {self.residual_lambda}")

    def _check_counts(self) -> None:
        """The integer sizes: strides, batch sizes, counts (>= 1) and `seq_len` (>= 2)."""
        for name in ("stride", "batch_size", "num_sequences", "checkpoint_every", "probe_tokens", "mlp_hidden_size",
                     "mlp_num_hidden_layers", "mlp_batch_size", "exact_layers_items", "exact_layers_timing_tokens"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"seq_len must be an integer >= 2, got {self.seq_len!r}")

    def _check_mlp_training(self) -> None:
        """The MLP's training schedule: epochs, patience, feature stride, learning rate."""
        if not isinstance(self.mlp_epochs, int) or self.mlp_epochs < 0:
            raise ValueError(f"mlp_epochs must be an integer >= 0, got {self.mlp_epochs!r}")
        if self.mlp_patience is not None and self.mlp_patience < 1:
            raise ValueError(f"mlp_patience must be >= 1 or None (never stop early), got {self.mlp_patience}")
        if self.mlp_feature_stride is not None and self.mlp_feature_stride < 1:
            raise ValueError(f"mlp_feature_stride must be >= 1, got {self.mlp_feature_stride}")
        if not self.mlp_lr > 0:
            raise ValueError(f"mlp_lr must be > 0, got {self.mlp_lr}")

    def _check_solver(self) -> None:
        """The mapper type, the dtypes (a `torch.dtype` becomes its name), the statistics' memory cap and `rank`."""
        if self.mapper_type not in MAPPER_TYPES:
            raise ValueError(f"mapper_type must be one of {MAPPER_TYPES}, got {self.mapper_type!r}")
        for name in ("mapper_dtype", "mlp_feature_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) and type(value).__name__ == "dtype":  # a torch.dtype (no torch import here)
                value = str(value).removeprefix("torch.")
                object.__setattr__(self, name, value)
            if value not in MAPPER_DTYPES:
                raise ValueError(f"{name} must be one of {MAPPER_DTYPES}, got {value!r}")
        if self.max_statistics_memory is not None:
            budget_bytes(self.max_statistics_memory)
        if self.rank is not None:
            object.__setattr__(self, "rank", str(self.rank))
            kwargs = parse_rank_spec(self.rank)
            if "dtype" in kwargs or not kwargs:
                raise ValueError(
                    f"rank {self.rank!r}: give an integer rank, energy=F or budget=F (the weight dtype is mapper_dtype)"
                )
            if self.mapper_type != RIDGE:
                raise ValueError("a reduced rank applies to ridge mappers; drop rank or use mapper_type='ridge'")

    def _check_combinations(self) -> None:
        """Options that exclude each other: the MLP's single (k, lambda) and held-out need, two_stage without 'all'."""
        if self.mapper_type == MLP:
            ks, lams = self.top_k_values, self.ridge_lambda
            if len(ks) != 1 or ks[0] == "auto" or len(lams) != 1 or lams[0] == "auto":
                raise ValueError(
                    f"the MLP mapper is fit for one top_k (an int or 'all') and one ridge_lambda, got top_k="
                    f"{','.join(map(str, self.top_k))}, ridge_lambda={','.join(map(str, lams))}; pick them with a "
                    "ridge fit first (top_k='auto', ridge_lambda='auto')"
                )
            if self.heldout_fraction == 0:
                raise ValueError("the MLP mapper stops early on held-out sequences: set heldout_fraction above 0")
        if self.two_stage and None in self.top_k_values:
            raise ValueError("top_k 'all' needs the full statistics; drop 'all' or run without two_stage")

    # -- derived values ------------------------------------------------------------------------------
    @property
    def top_k_values(self) -> list[int | None | str]:
        """`top_k` as ints, None (= all source layers) and "auto"."""
        return [None if k == "all" else k for k in self.top_k]

    @property
    def several(self) -> bool:
        """Whether several mappers are asked for (one per listed k, no 'auto')."""
        return len(self.top_k) > 1 and "auto" not in self.top_k

    @property
    def max_top_k(self) -> int | None:
        """The largest integer k asked for (what a two-stage fit keeps blocks for); 8 for a bare 'auto'."""
        ints = [k for k in self.top_k if isinstance(k, int)]
        return max(ints) if ints else 8

    @property
    def probe_lambdas(self) -> list[float]:
        """Every lambda layers may be ranked with: the listed ones, plus the grid when 'auto' has none listed."""
        lams = [v for v in self.ridge_lambda if v != "auto"]
        if "auto" in self.ridge_lambda and not lams:
            lams = list(RIDGE_LAMBDA_CANDIDATES)
        return lams

    @property
    def rank_kwargs(self) -> dict[str, Any]:
        """`solve_mapper` keywords of `rank` ({} for full rank)."""
        return parse_rank_spec(self.rank) if self.rank is not None else {}

    @property
    def torch_mapper_dtype(self) -> torch.dtype:
        from ..core.loading import DTYPES

        return DTYPES[self.mapper_dtype]

    @property
    def num_heldout(self) -> int:
        return heldout_count(self.num_sequences, self.heldout_fraction)

    def replace(self, **changes: Any) -> "FitConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keyword names the Python API accepted before `FitConfig` (and the MLP fitter's short names) -> fields.
KEYWORD_ALIASES = {
    "statistics_dir": "stats_dir",
    "low_rank": "rank",
    "hidden_size": "mlp_hidden_size",
    "num_hidden_layers": "mlp_num_hidden_layers",
    "epochs": "mlp_epochs",
    "lr": "mlp_lr",
    "patience": "mlp_patience",
    "residual": "mlp_residual",
    "per_head": "mlp_per_head",
    "feature_stride": "mlp_feature_stride",
    "feature_dtype": "mlp_feature_dtype",
    "device": "mlp_device",
}
FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(FitConfig))


def split_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(FitConfig fields, the rest)` of keyword arguments, with the aliases above mapped to field names."""
    fit, rest = {}, {}
    for name, value in overrides.items():
        name_ = KEYWORD_ALIASES.get(name, name)
        if name_ in FIELD_NAMES:
            if name_ in fit:
                raise TypeError(f"{name!r} and another keyword both set FitConfig.{name_}; give it once")
            fit[name_] = value
        else:
            rest[name] = value
    return fit, rest


def resolve_config(config: FitConfig | None, overrides: dict[str, Any]) -> tuple[FitConfig, dict[str, Any]]:
    """A `FitConfig` from an optional base and keyword overrides; returns it and the keywords it does not know."""
    fit, rest = split_overrides(overrides)
    base = config if config is not None else FitConfig()
    if not isinstance(base, FitConfig):
        raise TypeError(f"config must be a FitConfig, got {type(base).__name__}")
    return (dataclasses.replace(base, **fit) if fit else base), rest


def fields_for_cli(names: Sequence[str] | None = None) -> list[dataclasses.Field]:
    """The `FitConfig` fields a command exposes (all with a CLI option when `names` is None)."""
    out = [f for f in dataclasses.fields(FitConfig) if f.metadata.get("cli") != ""]
    return [f for f in out if names is None or f.name in names]


__all__ = [
    "FitConfig",
    "PAPER_TOP_K_CANDIDATES",
    "RIDGE_LAMBDA_CANDIDATES",
    "heldout_count",
    "mapper_name",
    "parse_exact_window",
    "parse_num_exact_layers",
    "parse_rank_spec",
    "parse_ridge_lambda",
    "parse_top_k",
    "resolve_config",
]
