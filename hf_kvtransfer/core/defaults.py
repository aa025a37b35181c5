"""A transfer's settings, decided in one place: how many of the target's first layers the target computes itself
(exact layers), how far back their attention reaches (the exact pass's window) and how many of the prompt's last
tokens it recomputes. `TransferredCache`, the evaluation suite,
`bench`, the demo, `plan`, the lm-eval adapter and the vLLM connector all call `resolve_transfer` (or the two
functions it combines), so a mapper gives the same transfer on every surface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .map_inputs import exact_layers_needed

# The exact layers for a mapper that records none (fit before the content probe, or solved from statistics without
# the models): layer 0's keys and values depend only on each token and its position.
DEFAULT_NUM_EXACT_LAYERS = 1

# The prompt's last tokens are prefilled by the target itself unless asked otherwise: the next tokens depend most on
# the nearest context, so exact keys and values there buy the most fidelity per token of the target's forward (the
# docs' results pages measure the trade: `hf-kvtransfer eval --tasks agreement --recompute N`).
DEFAULT_NUM_RECOMPUTE_TOKENS = 32


@dataclass(frozen=True)
class TransferSettings:
    """What one transfer of a prompt does: the target's first `num_exact_layers` layers computed by the target (their
    attention within `exact_window` tokens; None: the whole prompt), the rest mapped, and the prompt's last
    `num_recompute_tokens` tokens left to the target's forward."""

    num_exact_layers: int
    num_recompute_tokens: int
    exact_window: int | None = None


def _config_of(mapper: Any) -> Any:
    """A `MapperConfig` from a `KVMapper` or a config (duck-typed: this module sits below `mapper`)."""
    return getattr(mapper, "config", mapper)


def resolve_num_exact_layers(mapper: Any, requested: int | None) -> int:
    """What a caller's `num_exact_layers` means with `mapper` (a `KVMapper` or `MapperConfig`): as given, and None is
    the mapper's recorded number (`MapperConfig.num_exact_layers`), else `DEFAULT_NUM_EXACT_LAYERS`.

    Raises:
        ValueError: outside `[0, target layers]`, or fewer exact layers than the mapper's inputs need (its maps
            read the target's residual, say: `map_inputs.exact_layers_needed`).
    """
    config = _config_of(mapper)
    recorded = config.num_exact_layers
    resolved = (DEFAULT_NUM_EXACT_LAYERS if recorded is None else recorded) if requested is None else int(requested)
    num_target = len(config.selected_layers)
    if not 0 <= resolved <= num_target:
        raise ValueError(f"num_exact_layers must be in [0, {num_target}] (the target's layers), got {resolved}")
    needed, why = exact_layers_needed(config)
    if resolved < needed:
        raise ValueError(f"{why}: num_exact_layers must be >= {needed}, got {resolved}")
    return resolved


def resolve_num_recompute_tokens(
    requested: int | None, num_tokens: int, mapper: Any = None, num_exact_layers: int | None = None
) -> int:
    """What a caller's `num_recompute_tokens` means for a prompt of `num_tokens`: as given, and None is the default:
    the mapper's own (`MapperConfig.num_recompute_tokens`, when its config records one) or `DEFAULT_NUM_RECOMPUTE_TOKENS`,
    but at most half of a short prompt (most of it is still transferred) and at least 1 (`generate` must feed a
    token). When the exact layers (`num_exact_layers`, default the mapper's) are all of the target's, the default
    is 1: nothing is mapped, the transferred K/V are the target's own, and recomputing more of the prompt would
    only compute it twice."""
    if requested is not None:
        return requested
    config = _config_of(mapper)
    preferred = getattr(config, "num_recompute_tokens", None)
    if preferred is None and config is not None:
        exact = num_exact_layers if num_exact_layers is not None else config.num_exact_layers
        exact = DEFAULT_NUM_EXACT_LAYERS if exact is None else exact
        preferred = 1 if exact >= len(config.selected_layers) else None
    return min(DEFAULT_NUM_RECOMPUTE_TOKENS if preferred is None else preferred, max(1, num_tokens // 2))


def resolve_exact_window(mapper: Any, requested: int | None) -> int | None:
    """What a caller's `exact_window` means with `mapper`: as given (0: the whole prompt), None the mapper's recorded
    window (`MapperConfig.exact_window`, None: the whole prompt)."""
    if requested is None:
        return getattr(_config_of(mapper), "exact_window", None)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"exact_window must be a number of tokens >= 1, or 0 for the whole prompt, got {requested!r}")
    return requested or None


def resolve_transfer(
    mapper: Any, num_tokens: int, num_exact_layers: int | None = None, num_recompute_tokens: int | None = None,
    exact_window: int | None = None,
) -> TransferSettings:
    """The transfer of a `num_tokens`-token prompt with `mapper` (a `KVMapper` or `MapperConfig`), given what the
    caller asked for (None: the defaults above).

    Raises:
        ValueError: for exact layers the mapper cannot use, or more recomputed tokens than the prompt holds.
    """
    exact = resolve_num_exact_layers(mapper, num_exact_layers)
    recompute = resolve_num_recompute_tokens(num_recompute_tokens, num_tokens, mapper, exact)
    if not 0 <= recompute <= num_tokens:
        raise ValueError(f"num_recompute_tokens must be in [0, {num_tokens}] (the cached tokens), got {recompute}")
    return TransferSettings(exact, recompute, resolve_exact_window(mapper, exact_window))
