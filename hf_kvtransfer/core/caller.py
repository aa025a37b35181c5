"""What the target was fed, for a `TransferredCache` that must never give a silently wrong answer: the caller's
token ids, mask and model read off the call stack (the one place that does), and the check that they continue the
prompt the cache was built for."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass
class CallerInputs:
    """What the model calling the cache was given, read off the call stack (a cache only sees key/value states).

    `model` is the outermost model forward on the stack (also when it was given `inputs_embeds`, not ids);
    `forward_ids` are the token ids of the running model forward; `sequence` the ids of the nearest caller of that
    forward that is not a forward (generate's decoding loop: the whole sequence so far), or the forward's own ids when
    it was called directly; `mask_length` the length of the 2D attention mask given, if any; `mask` that mask
    (generate's, covering its whole sequence, or a direct forward's; None: no mask, i.e. no padding).
    """

    model: PreTrainedModel | None = None
    forward_ids: torch.Tensor | None = None
    forward_embeds: torch.Tensor | None = None  # the running forward's inputs_embeds, when it was given no ids
    mask_length: int | None = None
    mask: torch.Tensor | None = None
    sequence: torch.Tensor | None = None
    direct: bool = True  # no enclosing generate-like call: the forward was called by the user

    @classmethod
    def from_stack(cls, max_frames: int = 64) -> "CallerInputs":
        """Read the nearest model forward and its caller off the stack, starting two frames above this call (the
        cache method that asks, and the model code that called it).

        Why the stack: a `Cache` is handed key/value states and a layer index, never the token ids, the attention
        mask or the model, and transformers has no supported hook that gives a cache those before the first layer
        runs (`generate` builds positions and masks from `get_seq_length` / `get_mask_sizes` first). Reading them
        is what lets the cache refuse input that does not continue its prompt instead of answering wrongly, and take
        the prompt ids for its exact layers from `generate`'s own sequence. Relies on the local names `self`,
        `input_ids`, `attention_mask`, `model_kwargs`, `generation_config` of `PreTrainedModel.forward` /
        `generate` (checked on transformers 5.19 and 5.24). Finding nothing (another calling convention, a
        compiled graph) returns an empty `CallerInputs`: the checks are then skipped, never guessed.
        """
        found = cls()
        seen_model = None  # the outermost model forward, found with or without ids (inputs_embeds)
        frame = sys._getframe(2)
        for _ in range(max_frames):
            if frame is None:
                break
            local = frame.f_locals
            owner, ids = local.get("self"), local.get("input_ids")
            if isinstance(owner, PreTrainedModel) and frame.f_code.co_name == "forward":
                seen_model = owner
                embeds = local.get("inputs_embeds")
                if found.forward_ids is None and found.forward_embeds is None and isinstance(embeds, torch.Tensor):
                    found.forward_embeds = embeds
                    mask = local.get("attention_mask")
                    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
                        found.mask, found.mask_length = mask, mask.shape[-1]
            if isinstance(owner, PreTrainedModel) and isinstance(ids, torch.Tensor) and ids.ndim == 2:
                if ids.is_floating_point():
                    break
                if found.forward_ids is None:
                    if frame.f_code.co_name != "forward":
                        # generate itself: before any forward nothing is fed yet; a forward of inputs_embeds
                        # below it gave no ids (only its model is known)
                        return cls(model=seen_model, forward_embeds=found.forward_embeds, mask=found.mask,
                                   mask_length=found.mask_length)
                    mask = local.get("attention_mask")
                    found.forward_ids = ids
                    found.mask_length = mask.shape[-1] if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None
                    found.mask = mask if found.mask_length is not None else None
                elif frame.f_code.co_name != "forward":
                    found.direct = False
                    found.sequence = ids
                    # generate drops an all-ones mask before the forward but remembers its length
                    model_kwargs, config = local.get("model_kwargs"), local.get("generation_config")
                    mask = model_kwargs.get("attention_mask") if isinstance(model_kwargs, dict) else None
                    found.mask = None
                    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
                        found.mask_length, found.mask = mask.shape[-1], mask
                    elif getattr(config, "_mask_length", -1) > 0:
                        found.mask_length = config._mask_length
                    break
                found.model, found.sequence = owner, ids
            frame = frame.f_back
        if found.model is None:
            found.model = seen_model
        return found


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First column where `[batch, n]` id tensors differ (rows of `a` may be `b`'s repeated, as beams are)."""
    if a.shape[0] != b.shape[0]:
        if a.shape[0] % b.shape[0]:
            return None  # another batch: reported when the layers are converted
        a = a.reshape(b.shape[0], a.shape[0] // b.shape[0], -1)[:, 0]
    differs = (a.to(b.device) != b).any(dim=0).nonzero()
    return int(differs[0]) if differs.numel() else None


def check_prompt(
    caller: CallerInputs, prompt_ids: torch.Tensor | None, held: int, fed_length: int, num_recompute_tokens: int
) -> bool:
    """The input must continue the prompt a cache holding `held` tokens was built for: generate's sequence starts with
    it (or only new tokens are passed, with a mask covering the cached ones); a direct forward feeds the tokens that
    follow. Raises `ValueError` saying what to pass otherwise; returns whether only new tokens were passed."""
    # Only new tokens: the mask covers the cached tokens (and what is fed), the sequence only the new ones. On the
    # first forward the sequence is exactly what is fed; on later steps (assisted decoding, prompt lookup) it is
    # shorter than what the cache holds, which the mask still covers.
    sequence_length, mask_length = caller.sequence.shape[-1], caller.mask_length
    only_new = (mask_length == held + fed_length and (sequence_length == fed_length or sequence_length < mask_length)) or (
        mask_length is not None
        and sequence_length < held <= mask_length
        and (prompt_ids is None or held >= prompt_ids.shape[-1])  # a later step: the whole prompt is cached
    )
    if only_new:
        total = prompt_ids.shape[-1] if prompt_ids is not None else held
        count = min(fed_length, total - held, caller.sequence.shape[-1])
        if count > 0 and first_difference(caller.sequence[:, :count], prompt_ids[:, held : held + count]) is not None:
            # Only new tokens, but the cache leaves the prompt's last tokens to the target: they were not fed.
            raise ValueError(
                f"this cache holds the first {held} of the prompt's {total} tokens and leaves the last {total - held} "
                f"to the target (num_recompute_tokens={num_recompute_tokens}), but only new tokens were fed; pass the "
                "whole conversation so far (the prompt, then the new tokens), or build the cache with "
                "num_recompute_tokens=0 to feed only new tokens"
            )
        return True
    sequence = caller.sequence if not caller.direct else None
    if sequence is not None and sequence.shape[-1] < held:
        raise ValueError(
            f"input_ids hold {sequence.shape[-1]} tokens but this cache already holds {held}; pass the whole "
            "conversation so far (the cached tokens, then the new ones), or only the new tokens together with an "
            "attention_mask covering the cached ones"
        )
    if prompt_ids is None:
        return False
    if sequence is not None:
        count = min(sequence.shape[-1], prompt_ids.shape[-1])
        where = first_difference(sequence[:, :count], prompt_ids[:, :count])
    else:  # a direct forward: its tokens sit at positions held, held + 1, ...
        count = max(min(fed_length, prompt_ids.shape[-1] - held), 0)
        where = first_difference(caller.forward_ids[:, :count], prompt_ids[:, held : held + count])
        where = None if where is None else held + where
    if where is not None and sequence is None and _feeds_prompt_tail(caller.forward_ids, prompt_ids, held):
        total = prompt_ids.shape[-1]
        raise ValueError(
            f"this cache holds the first {held} of the prompt's {total} tokens and leaves the last {total - held} "
            f"to the target (num_recompute_tokens={num_recompute_tokens}), but the forward was fed only the "
            f"last {fed_length}; feed `input_ids[:, {held}:]`, i.e. `input_ids[:, -cache.num_recompute_tokens:]` "
            "(generate does this by itself), or build the cache with num_recompute_tokens=1"
        )
    if where is not None:
        raise ValueError(
            f"the target's input_ids differ from the prompt this cache was built for (first at position {where}); "
            "build a TransferredCache from the source's cache of this prompt (one cache per prompt)"
        )
    return False


def check_mask(caller: CallerInputs, cache_mask: torch.Tensor | None, held: int) -> None:
    """The mask the target is given must be the one the cache's tokens were computed with, over those tokens (None:
    no padding): with another, the target would read them at other positions or attend other tokens than the source
    did. Raises `ValueError` saying what to pass otherwise."""
    given = caller.mask
    if given is not None and given.ndim == 2 and not bool(given.bool().any(dim=-1).all()):
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
    fed = caller.forward_ids if caller.forward_ids is not None else caller.forward_embeds
    rows = given.shape[0] if given is not None else fed.shape[0]
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
    """Whether a direct forward was fed the prompt's last tokens but fewer than the cache left to the target
    (code written for one recomputed token, given a cache that leaves more)."""
    total, count = prompt_ids.shape[-1], fed.shape[-1]
    return held + count < total and first_difference(fed, prompt_ids[:, total - count :]) is None
