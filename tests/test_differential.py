"""A property-based differential suite: `TransferredCache` under stock `generate` against the target's own run.

On a pair whose mapper is exact by construction (a model to itself, identity weights: `exact_identity_mapper`), every
call a user can make must either give the target's own answer for the same call (tokens, and logits to 1e-3) or
raise, before any token, a `ValueError` / `TypeError` whose one-line message names the fix. Never a different answer.

The cases are generated (hypothesis, derandomized so CI sees the same ones every run): prompt length 1 .. 300, batch
size and left padding, the mask given or not to each of `prefill` / `TransferredCache` / `generate`,
`num_recompute_tokens`, `num_exact_layers`, the mapper's layout (per layer, grouped, low rank, layer 0 from token
tables of the prompt's ids), the generation mode
(greedy, seeded sampling, beams, assisted decoding with another model, prompt lookup; `cache=` or
`past_key_values=`), the ids passed to `generate` (the prompt, a prefix of it, another prompt, only new tokens, the
prompt plus new tokens; the prompt as `inputs_embeds` instead of ids) and a second `generate` on the same cache.

Budget: `DIFFERENTIAL_EXAMPLES` (default 800, 2-3 minutes on one CPU thread); `HYPOTHESIS_PROFILE=slow` or
`-m slow` runs 3000. `--hypothesis-show-statistics` prints how many ran and what each ended as.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from conftest import VOCAB, exact_identity_mapper, tiny_model
from hf_kvtransfer import TransferredCache, prefill

NUM_LAYERS = 3
MAX_PROMPT = 300
NEW_TOKENS = 4
# A refusal must say what to change: "pass ...", "build ...", "feed ...", "use ...", "load ...".
NAMES_A_FIX = re.compile(r"\b(pass|build|feed|use|load)\b")

_COMMON_SETTINGS = dict(
    derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)  # fmt: skip
SLOW_EXAMPLES = 3000
DEFAULT_EXAMPLES = int(os.environ.get("DIFFERENTIAL_EXAMPLES", "800"))
EXAMPLES = SLOW_EXAMPLES if os.environ.get("HYPOTHESIS_PROFILE") == "slow" else DEFAULT_EXAMPLES


@pytest.fixture(scope="module")
def models():
    # Long enough positions for the longest prompt plus new tokens and a second turn.
    target = tiny_model("qwen3", num_hidden_layers=NUM_LAYERS, seed=31, max_position_embeddings=512)
    assistant = tiny_model("qwen3", num_hidden_layers=1, seed=32, max_position_embeddings=512)
    mappers = {mode: exact_identity_mapper(target, mode) for mode in ("per_layer", "grouped", "low_rank", "token_table")}
    return target, assistant, mappers


class _CountForwards:
    """Counts the target's finished forwards: a refusal must come before the first one (before any token; an
    assistant's drafts are not the target's tokens)."""

    def __init__(self, model):
        self.steps = 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.steps += 1


@st.composite
def cases(draw):
    mode = draw(st.sampled_from(["greedy", "sample", "beams", "assisted", "prompt_lookup"]))
    batch = 1 if mode in ("assisted", "prompt_lookup") else draw(st.integers(1, 3))
    length = draw(st.integers(1, MAX_PROMPT))
    # Row lengths: the first row is full, the others may be left-padded (or all full).
    rows = [length] + [draw(st.integers(1, length)) for _ in range(batch - 1)]
    recompute = draw(st.one_of(st.none(), st.integers(0, min(length, 48)), st.just(length)))
    return dict(
        mode=mode,
        rows=rows,
        seed=draw(st.integers(0, 2**16)),
        mask_to=draw(st.fixed_dictionaries({k: st.booleans() for k in ("prefill", "cache", "generate")})),
        num_recompute_tokens=recompute,
        num_exact_layers=draw(st.one_of(st.none(), st.integers(0, NUM_LAYERS))),
        mapper=draw(st.sampled_from(["per_layer", "grouped", "low_rank", "token_table"])),
        cache_kwarg=draw(st.sampled_from(["cache", "past_key_values"])),
        ids=draw(st.sampled_from(["prompt", "prefix", "other", "new_only", "prompt_plus_new"])),
        prefix_len=draw(st.integers(1, length)),
        num_return_sequences=draw(st.sampled_from([1, 2])) if mode == "beams" else 1,
        second_turn=draw(st.booleans()) if mode in ("greedy", "sample") else False,
        # The prompt as embeddings (`inputs_embeds`: soft prompts, multimodal front-ends) instead of ids.
        embeds=draw(st.booleans()) if mode in ("greedy", "sample", "beams") else False,
    )


def _ids(case):
    g = torch.Generator().manual_seed(case["seed"])
    length, rows = case["rows"][0], case["rows"]
    ids = torch.randint(3, VOCAB, (len(rows), length), generator=g)
    if case["mode"] == "prompt_lookup":  # repeats, so prompt lookup finds candidates
        ids = torch.cat([ids[:, : (length + 1) // 2]] * 2, dim=1)[:, :length]
    mask = torch.ones_like(ids)
    for r, n in enumerate(rows):
        ids[r, : length - n], mask[r, : length - n] = 0, 0  # pad_token_id 0, left padding
    other = torch.randint(3, VOCAB, ids.shape, generator=g)
    new = torch.randint(3, VOCAB, (len(rows), 3), generator=g)
    # New tokens that began with a short prompt's own tokens would make "only the new tokens" (without a mask) the
    # prompt continued, an equally valid reading of the call: keep their first token off the prompt's.
    clash = new[:, 0] == ids[:, 0]
    new[clash, 0] = (new[clash, 0] - 2) % (VOCAB - 3) + 3
    return ids, mask, other, new


def _generate(model, ids, mask, case, assistant, embeds=False, **cache):
    kwargs = dict(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_logits=True,
        pad_token_id=0,
    )  # fmt: skip
    mode = case["mode"]
    if mode == "sample":
        kwargs.update(do_sample=True, top_k=0, temperature=1.0)
    else:
        kwargs.update(do_sample=False)
    if mode == "beams":
        kwargs.update(num_beams=2, num_return_sequences=case["num_return_sequences"])
    if mode == "assisted":
        kwargs.update(assistant_model=assistant)
    if mode == "prompt_lookup":
        kwargs.update(prompt_lookup_num_tokens=3)
    if mask is not None:
        kwargs["attention_mask"] = mask
    torch.manual_seed(case["seed"])
    counter = _CountForwards(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if embeds:  # generate returns only the new tokens then
                return model.generate(inputs_embeds=model.get_input_embeddings()(ids), **kwargs, **cache), None, counter.steps
            return model.generate(ids, **kwargs, **cache), None, counter.steps
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            return None, exc, counter.steps
        finally:
            counter.handle.remove()


def _same(out, ref, where: str) -> None:
    assert out.sequences.shape == ref.sequences.shape, (where, out.sequences.shape, ref.sequences.shape)
    assert torch.equal(out.sequences, ref.sequences), (where, out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=lambda m: f"{where}: logits of step {step}: {m}")


def _check_refusal(exc, steps, where: str) -> None:
    assert isinstance(exc, (ValueError, TypeError)), f"{where}: not a ValueError/TypeError: {exc!r}"
    assert steps == 0, f"{where}: raised after {steps} decoding step(s): {exc}"
    message = str(exc)
    assert "\n" not in message.strip(), f"{where}: not one line: {message}"
    assert NAMES_A_FIX.search(message), f"{where}: names no fix: {message}"


def _feed(case, ids, mask, other, new):
    """The ids (and mask) passed to generate, and those of the target's own equivalent call."""
    kind, ones = case["ids"], torch.ones_like(new)
    if kind == "prompt":
        return ids, mask, ids, mask
    if kind == "prefix":
        k = case["prefix_len"]
        return ids[:, :k], mask[:, :k], ids[:, :k], mask[:, :k]
    if kind == "other":
        return other, torch.ones_like(other), other, torch.ones_like(other)
    full, full_mask = torch.cat([ids, new], 1), torch.cat([mask, ones], 1)
    if kind == "new_only":  # the cached tokens are covered by the mask only
        return new, full_mask, full, full_mask
    return full, full_mask, full, full_mask  # prompt_plus_new


def _careful(case) -> bool:
    """A call a careful user makes (the prompt the cache was built for, or it and new tokens; the mask of a padded
    batch given to `prefill`): it must be answered, not only never answered wrongly."""
    padded = min(case["rows"]) < case["rows"][0]
    give = case["mask_to"]
    if case["embeds"] and padded and not give["generate"]:
        return False  # generate cannot infer padding from embeddings: the mask is the caller's to give
    return case["ids"] in ("prompt", "prompt_plus_new") and (not padded or give["prefill"])


def check_case(case, models):
    target, assistant, mappers = models
    note(repr(case))
    ids, mask, other, new = _ids(case)
    fed, fed_mask, own_ids, own_mask = _feed(case, ids, mask, other, new)
    give = case["mask_to"]
    gen_mask = fed_mask if give["generate"] else None
    own_gen_mask = own_mask if give["generate"] else None
    if case["ids"] == "new_only" and gen_mask is None:
        own_gen_mask = None  # the target's own call: the full sequence, mask inferred as generate does
    # The prompt as embeddings: the target's own call gets them too (generate infers no padding from embeddings).
    embeds = case["embeds"] and case["ids"] in ("prompt", "prompt_plus_new")
    # A second turn continues the cache of the first: the target's own reference continues its own cache too (a
    # fresh prefill of the whole conversation is not always what transformers' cache gives: a row whose prompt is
    # all padding is computed differently).
    own_cache = {"past_key_values": DynamicCache(config=target.config)} if case["second_turn"] else {}
    ref, ref_exc, _ = _generate(target, own_ids, own_gen_mask, case, assistant, embeds, **own_cache)

    try:
        source_cache = prefill(target, ids, attention_mask=mask if give["prefill"] else None)
        cache = TransferredCache(
            source_cache, mappers[case["mapper"]], attention_mask=mask if give["cache"] else None,
            num_recompute_tokens=case["num_recompute_tokens"], num_exact_layers=case["num_exact_layers"],
            model=target,
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        _check_refusal(exc, 0, "TransferredCache(...)")
        assert not _careful(case), f"a careful call was refused: {exc}"
        event(f"refused at construction: {type(exc).__name__}")
        return
    out, exc, steps = _generate(target, fed, gen_mask, case, assistant, embeds, **{case["cache_kwarg"]: cache})
    if exc is not None:
        if ref_exc is not None:
            event("the target's own call fails too")
            return
        _check_refusal(exc, steps, f"generate ({case['mode']})")
        assert not _careful(case), f"a careful call was refused: {exc}"
        event(f"refused: {re.sub(r'[0-9]+', 'N', str(exc))[:70]}")
        return
    assert ref_exc is None, f"the target's own call raised {ref_exc!r}, the transferred one answered"
    if embeds:  # (both return the new tokens only)
        _same(out, ref, f"generate ({case['mode']}, inputs_embeds)")
        event(f"answered as the target: {case['mode']}, inputs_embeds")
        return
    if case["ids"] == "new_only":  # compare what was generated, after the (different) inputs
        assert torch.equal(out.sequences[:, -NEW_TOKENS:], ref.sequences[:, -NEW_TOKENS:]), (out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    else:
        _same(out, ref, f"generate ({case['mode']})")
    event(f"answered as the target: {case['mode']}")

    if not case["second_turn"]:
        return
    # A second turn on the same cache: the whole conversation so far plus new tokens.
    turn = torch.cat([out.sequences, new], 1)
    turn_own = torch.cat([ref.sequences, new], 1) if case["ids"] != "new_only" else None
    if turn_own is None:
        return
    turn_mask = torch.cat([own_mask, torch.ones(turn.shape[0], turn.shape[1] - own_mask.shape[1], dtype=own_mask.dtype)], 1)
    second_mask = turn_mask if give["generate"] else None
    ref2, ref2_exc, _ = _generate(target, turn_own, second_mask, case, assistant, **own_cache)
    out2, exc2, steps2 = _generate(target, turn, second_mask, case, assistant, **{case["cache_kwarg"]: cache})
    if exc2 is not None:
        if ref2_exc is None:
            _check_refusal(exc2, steps2, "second generate")
        event("second turn refused")
        return
    assert ref2_exc is None, f"the target's own second turn raised {ref2_exc!r}"
    _same(out2, ref2, "second generate")
    event("second turn answered as the target")


_BODY_SETTINGS = settings(max_examples=EXAMPLES, **_COMMON_SETTINGS)


@_BODY_SETTINGS
@given(case=cases())
def test_transferred_cache_answers_as_the_target_or_says_what_to_change(case, models):
    check_case(case, models)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **_COMMON_SETTINGS)
@given(case=cases())
def test_differential_slow(case, models):
    check_case(case, models)
