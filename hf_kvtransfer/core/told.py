"""What the target is fed, told to the `TransferredCache` it runs on, and the checks of that input against the prompt
the cache was built for (a cache never gives a silently wrong answer).

Two hooks on the target model tell the cache in their arguments (`cache=` or `past_key_values=`): a forward pre-hook
(the forward's ids or embeddings and mask, before it builds positions and masks from the cache), and, under
`generate`, a wrapper of the model's `prepare_inputs_for_generation`, which generate calls before each forward with
its whole sequence and mask (the forward is fed only what the cache does not hold)."""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass(frozen=True)
class ForwardInputs:
    """One forward of the target on a cache: the model, its token ids or `inputs_embeds` (`[rows, n, ...]`), the 2D
    attention mask (generate's, over its whole sequence, under generate; None: none, i.e. no padding), generate's
    sequence (None: the forward was called directly) and the forward's `position_ids` (None: not given)."""

    model: PreTrainedModel
    ids: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    sequence: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def fed(self) -> torch.Tensor | None:
        return self.ids if self.ids is not None else self.embeds

    @property
    def direct(self) -> bool:
        return self.sequence is None

    @classmethod
    def of(cls, model: PreTrainedModel, args: tuple, kwargs: dict, step: tuple | None) -> "ForwardInputs":
        bound = _signature(type(model)).bind_partial(model, *args, **kwargs).arguments
        ids, embeds, mask = bound.get("input_ids"), bound.get("inputs_embeds"), bound.get("attention_mask")
        ids = ids if isinstance(ids, torch.Tensor) and ids.ndim == 2 and not ids.is_floating_point() else None
        embeds = embeds if isinstance(embeds, torch.Tensor) and ids is None else None
        sequence = None
        if step is not None:  # generate's: its mask covers the whole sequence (the forward's may be 4D)
            sequence, mask = step
            sequence = sequence if isinstance(sequence, torch.Tensor) and not sequence.is_floating_point() else None
        mask = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None
        positions = bound.get("position_ids")
        positions = positions if isinstance(positions, torch.Tensor) and positions.ndim in (1, 2) else None
        return cls(model, ids, embeds, mask, sequence, positions)

    def only_new(self, held: int) -> bool:
        """Whether generate was given only the tokens after the `held` cached ones: it then feeds its whole
        sequence, over a mask covering the cached ones too (or, with no padding, at positions from `held` on). Its
        first step under assisted decoding feeds its whole sequence too, from position 0."""
        if self.sequence is None or held == 0 or self.sequence.shape[-1] != self.ids.shape[-1]:
            return False
        if self.mask is not None:
            return self.mask.shape[-1] == held + self.ids.shape[-1]
        return self.positions is not None and int(self.positions[..., 0].min()) >= held


class Listener:
    """What a cache implements to be told the inputs of the forwards that run on it (`listen`)."""

    _generate_step: tuple | None = None  # generate's (sequence, mask) for the forward it is about to run

    def listening(self) -> bool:
        """Whether the next forward's inputs are wanted (read in traced code too: keep it a plain attribute read)."""
        raise NotImplementedError

    def hear(self, inputs: ForwardInputs, compiled: bool) -> None:
        """`compiled`: the forward is traced by torch.compile (this call is its graph break)."""
        raise NotImplementedError


def listen(model: PreTrainedModel) -> None:
    """Have `model` tell every `Listener` cache passed to it what each forward is fed, before it runs. One hook per
    model (a deep copy keeps it), however many caches it serves."""
    if _tell_listener not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_tell_listener, with_kwargs=True)
    prepare = getattr(model, "prepare_inputs_for_generation", None)  # a model's body alone has none (no generate)
    if prepare is not None and not hasattr(getattr(prepare, "__func__", prepare), "_tells"):
        # Bound to the model (a deep copy rebinds it to the copy). It calls the class's own method, or the one the
        # model was given by another library (peft sets its own on the model), which it then holds.
        own = vars(model).get("prepare_inputs_for_generation")
        model.prepare_inputs_for_generation = types.MethodType(_prepare_and_tell(type(model), own), model)


def _cache_in(args: tuple, kwargs: dict):
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    if cache is None:
        cache = next((arg for arg in args if isinstance(arg, Listener)), None)
    return cache if isinstance(cache, Listener) else None


def _prepare_and_tell(model_type: type, own=None):
    """`model_type.prepare_inputs_for_generation` (or the model's `own`, already bound), telling the cache generate's
    sequence and mask first (with the same signature: generate reads it)."""
    prepare = own if own is not None else model_type.prepare_inputs_for_generation

    @functools.wraps(prepare)
    def prepare_and_tell(self, input_ids, *args, **kwargs):
        cache = _cache_in((), kwargs)
        if cache is not None and cache.listening():
            cache._generate_step = (input_ids, kwargs.get("attention_mask"))
        if own is not None:
            return own(input_ids, *args, **kwargs)
        return prepare(self, input_ids, *args, **kwargs)

    prepare_and_tell._tells = True
    return prepare_and_tell


def _tell_listener(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    cache = _cache_in(args, kwargs)
    if cache is not None and cache.listening():
        _tell(cache, module, args, kwargs, torch.compiler.is_compiling())


@torch.compiler.disable
def _tell(cache: Listener, module: torch.nn.Module, args: tuple, kwargs: dict, compiled: bool) -> None:
    # Under torch.compile this is the one graph break: only while the cache still has layers to convert.
    step, cache._generate_step = cache._generate_step, None
    cache.hear(ForwardInputs.of(module, args, kwargs, step), compiled)


_signatures: dict[type, inspect.Signature] = {}


def _signature(model_type: type) -> inspect.Signature:
    if model_type not in _signatures:
        _signatures[model_type] = inspect.signature(model_type.forward)
    return _signatures[model_type]


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First column where `[batch, n]` id tensors differ (rows of `a` may be `b`'s repeated, as beams are)."""
    if a.shape[0] != b.shape[0]:
        if a.shape[0] % b.shape[0]:
            return None  # another batch: reported when the layers are converted
        a = a.reshape(b.shape[0], a.shape[0] // b.shape[0], -1)[:, 0]
    differs = (a.to(b.device) != b).any(dim=0).nonzero()
    return int(differs[0]) if differs.numel() else None


def refeeds_prompt(inputs: ForwardInputs, prompt_ids: torch.Tensor | None, held: int) -> bool:
    """Whether a forward feeds the `held` cached prompt tokens again from its start (assisted decoding's and prompt
    lookup's first step, or generate with every prompt token cached). Under generate only a forward fed generate's
    whole sequence can, and a forward at positions after the cached ones cannot: a prompt whose tail repeats its head
    is then not taken for a re-feed."""
    fed = inputs.ids
    if held == 0 or prompt_ids is None or fed.shape[-1] < held:
        return False
    if inputs.sequence is not None and fed.shape[-1] < inputs.sequence.shape[-1]:
        return False  # generate feeds what the cache does not hold: the end of its sequence
    if inputs.positions is not None and int(inputs.positions[..., 0].min()) >= held:
        return False
    return first_difference(fed[:, :held], prompt_ids[:, :held]) is None


def check_prompt(inputs: ForwardInputs, prompt_ids: torch.Tensor | None, held: int, num_recompute_tokens: int) -> bool:
    """The input must continue the prompt a cache holding `held` tokens was built for: generate's sequence starts with
    it (or only new tokens are passed, with a mask covering the cached ones: generate then feeds its whole sequence);
    a direct forward feeds the tokens that follow. Raises `ValueError` saying what to pass otherwise; returns whether
    only new tokens were passed."""
    fed, sequence = inputs.ids, inputs.sequence
    total = prompt_ids.shape[-1] if prompt_ids is not None else held
    if inputs.only_new(held):
        count = min(fed.shape[-1], total - held)
        if count > 0 and first_difference(fed[:, :count], prompt_ids[:, held : held + count]) is not None:
            raise ValueError(
                f"this cache holds the first {held} of the prompt's {total} tokens and leaves the last {total - held} "
                f"to the target (num_recompute_tokens={num_recompute_tokens}), but only new tokens were fed; pass the "
                "whole conversation so far (the prompt, then the new tokens), or build the cache with "
                "num_recompute_tokens=0 to feed only new tokens"
            )
        return True
    if sequence is not None and sequence.shape[-1] < held:
        raise ValueError(
            f"input_ids hold {sequence.shape[-1]} tokens but this cache already holds {held}; pass the whole "
            "conversation so far (the cached tokens, then the new ones), or only the new tokens together with an "
            "attention_mask covering the cached ones"
        )
    if prompt_ids is None:
        return False
    if sequence is not None:
        count = min(sequence.shape[-1], total)
        where = first_difference(sequence[:, :count], prompt_ids[:, :count])
    else:  # a direct forward: its tokens sit at positions held, held + 1, ...
        count = max(min(fed.shape[-1], total - held), 0)
        where = first_difference(fed[:, :count], prompt_ids[:, held : held + count])
        where = None if where is None else held + where
    if where is not None and sequence is None and _feeds_prompt_tail(fed, prompt_ids, held):
        raise ValueError(
            f"this cache holds the first {held} of the prompt's {total} tokens and leaves the last {total - held} "
            f"to the target (num_recompute_tokens={num_recompute_tokens}), but the forward was fed only the "
            f"last {fed.shape[-1]}; feed `input_ids[:, {held}:]`, i.e. `input_ids[:, -cache.num_recompute_tokens:]` "
            "(generate does this by itself), or build the cache with num_recompute_tokens=1"
        )
    if where is not None:
        raise ValueError(
            f"the target's input_ids differ from the prompt this cache was built for (first at position {where}); "
            "build a TransferredCache from the source's cache of this prompt (one cache per prompt)"
        )
    return False


def check_mask(inputs: ForwardInputs, cache_mask: torch.Tensor | None, held: int) -> None:
    """The mask the target is given must be the one the cache's tokens were computed with, over those tokens (None:
    no padding): with another, the target would read them at other positions or attend other tokens than the source
    did. Raises `ValueError` saying what to pass otherwise."""
    given = inputs.mask
    if given is not None and not bool(given.bool().any(dim=-1).all()):
        row = int((~given.bool().any(dim=-1)).nonzero()[0])
        # Such a row's next token comes from attending to nothing: no answer to reproduce (nor a meaningful one).
        raise ValueError(
            f"row {row} of the target's input is all padding (its attention_mask has no 1); pass at least one real "
            "token per row, or drop the row"
        )
    if held == 0 or (given is None and cache_mask is None):
        return
    if given is not None and given.shape[-1] < held:
        return  # a mask of the new tokens only: not ours to read (transformers refuses or pads it)
    rows = given.shape[0] if given is not None else inputs.fed.shape[0]
    seen = given[:, :held] if given is not None else torch.ones(rows, held, dtype=torch.long)
    ours = cache_mask[:, :held] if cache_mask is not None else torch.ones(1, held, dtype=torch.long)
    if cache_mask is None or ours.shape[0] != seen.shape[0] and seen.shape[0] % ours.shape[0] == 0:
        ours = ours.repeat_interleave(seen.shape[0] // ours.shape[0], dim=0)
    if ours.shape != seen.shape or torch.equal(ours.to(seen.device, torch.long), seen.long()):
        return  # another batch is reported when the layers are converted
    if cache_mask is None:
        raise ValueError(
            "the target's attention_mask (given, or inferred by generate from pad tokens) has padding, but this cache's "
            "tokens were computed without a mask; pass the same attention_mask to `prefill` as to the target"
        )
    raise ValueError(
        "the target is given another attention_mask than the one this cache's tokens were computed with "
        f"({'none' if given is None else 'it differs over the cached tokens'}); pass the same attention_mask to the "
        "target (generate / forward) as to `prefill`"
    )


def _feeds_prompt_tail(fed: torch.Tensor, prompt_ids: torch.Tensor, held: int) -> bool:
    """Whether a forward was fed the prompt's last tokens but fewer than the cache left to the target (code written
    for one recomputed token, given a cache that leaves more)."""
    total, count = prompt_ids.shape[-1], fed.shape[-1]
    return held + count < total and first_difference(fed, prompt_ids[:, total - count :]) is None
