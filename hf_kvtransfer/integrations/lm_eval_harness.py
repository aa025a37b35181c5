"""lm-evaluation-harness model `hf-kvtransfer`: standard tasks scored by the target with the context transferred.

Every request's context is prefilled by the *source* model and mapped into the *target's* cache
(`TransferredCache`); the target only reads the last `num_recompute_tokens` context tokens and the
continuation. Compare with `--model hf --model_args pretrained=TARGET` for the target's own score.

`lm_eval` only knows the models it ships, so run it through this module, which registers the model first:

    python -m hf_kvtransfer.integrations.lm_eval_harness --model hf-kvtransfer \\
        --model_args source=Qwen/Qwen3-0.6B,target=Qwen/Qwen3-1.7B,mapper=org/qwen3-0.6b-to-1.7b \\
        --tasks hellaswag,arc_easy

or from Python: `lm_eval.simple_evaluate(model=KVTransferLM(source=..., target=..., mapper=...), tasks=[...])`.
Needs the optional dependency: `pip install 'hf-kvtransfer[lm-eval]'`.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the lm-evaluation-harness adapter needs lm_eval: pip install 'hf-kvtransfer[lm-eval]' (or pip install lm_eval)"
    ) from exc


from ..core.cache import TransferredCache
from ..core.defaults import resolve_num_recompute_tokens
from ..core.capture import cache_argument, prefill
from ..core.loading import load_model
from ..core.mapper import KVMapper
from ..core.progress import progress_bar
from ..evaluation.metrics import REFEED_WARNING
from ..evaluation.multiple_choice import score_continuations

logger = logging.getLogger(__name__)


def _as_bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("hf-kvtransfer")
class KVTransferLM(LM):
    """An `lm_eval` model: the source model prefills each context, the target scores and generates through it.

    Args:
        source, target: model ids / paths (loaded with `AutoModelForCausalLM`) or loaded models.
        mapper: source -> target `KVMapper`, or its Hub id / local path.
        tokenizer: tokenizer id / path or object (default: the target's).
        num_recompute_tokens: trailing context tokens the target recomputes (>= 1: it must predict the first
            continuation token; default: `TransferredCache`'s, 32 or half a shorter context).
        rolling_chunk: for `loglikelihood_rolling` (perplexity tasks): lm_eval's stock `hf` windows (the start
            token, then windows of `max_length`), each scored in chunks of this many tokens by the target on top of
            the transferred cache of everything before the chunk in its window, start token included. On a mapper
            that reproduces the cache exactly this equals `--model hf` on the target.
        max_length: window length for `loglikelihood_rolling` (default: the target's, as the `hf` model reads it).
        prefix_token_id: the token an empty context / a document starts with (default: as the `hf` model, BOS,
            else EOS).
        batch_size: contexts prefilled and scored together (left-padded; `auto` is read as 1).
        device, dtype: where and how to load the models.
    """

    def __init__(
        self,
        source: Any,
        target: Any,
        mapper: Any,
        tokenizer: Any = None,
        num_recompute_tokens: int | None = None,
        rolling_chunk: int = 256,
        max_gen_toks: int = 256,
        device: str = "cpu",
        dtype: str = "float32",
        add_bos_token: bool = False,
        max_length: int | None = None,
        prefix_token_id: int | None = None,
        batch_size: int | str = 1,
        **kwargs: Any,
    ):
        super().__init__()
        from transformers import AutoTokenizer

        ignored = {k: v for k, v in kwargs.items() if k not in ("max_batch_size",)}
        if ignored:
            logger.warning("hf-kvtransfer ignores model_args %s", sorted(ignored))
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval passes device="cuda" unless told otherwise; on a CPU-only machine run there.
            logger.warning("CUDA is not available: running hf-kvtransfer on the CPU (pass --device cpu to silence)")
            device = "cpu"

        def load(model):
            return load_model(model, dtype=torch_dtype, device=device) if isinstance(model, str) else model.eval()

        self.source, self.target = load(source), load(target)
        self.mapper = mapper if isinstance(mapper, KVMapper) else KVMapper.from_pretrained(mapper)
        self.mapper.check_compatible(self.source.config, self.target.config)
        if tokenizer is None:
            if not isinstance(target, str):
                raise ValueError("pass tokenizer= when target is a model object rather than an id / path")
            tokenizer = target
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.num_recompute_tokens = int(num_recompute_tokens) if num_recompute_tokens is not None else None
        if self.num_recompute_tokens is not None and self.num_recompute_tokens < 1:
            raise ValueError(f"num_recompute_tokens must be >= 1, got {num_recompute_tokens}")
        self.rolling_chunk = int(rolling_chunk)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _as_bool(add_bos_token)
        self.custom_prefix_token_id = int(prefix_token_id) if prefix_token_id is not None else None
        self._max_length = int(max_length) if max_length else None
        # lm_eval passes batch_size as given on its command line ("8", "auto", "auto:4")
        self.batch_size = int(batch_size) if str(batch_size).isdigit() and int(batch_size) > 0 else 1
        if str(batch_size).startswith("auto"):
            logger.warning("hf-kvtransfer does not size batches automatically: batch_size=%s runs with 1", batch_size)

    # -- helpers ------------------------------------------------------------------------------------
    @property
    def prefix_token_id(self) -> int:
        # What an empty context is replaced by and a rolling document starts with: the stock `hf` model's rule.
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        for token in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id):
            if token is not None:
                return token
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to start an empty context with")

    _prefix_token = prefix_token_id

    @property
    def max_length(self) -> int:
        """Rolling-window length: `max_length=`, else what lm_eval's `hf` model reads from the target."""
        if self._max_length:
            return self._max_length
        from lm_eval.models.utils import resolve_max_length

        return resolve_max_length(self.target.config, self.tokenizer, default=2048)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _recompute(self, num_tokens: int) -> int:
        """The recomputed tokens of a context of `num_tokens` tokens: as configured, else the cache's default."""
        return min(resolve_num_recompute_tokens(self.num_recompute_tokens, num_tokens, self.mapper), num_tokens)

    def _transferred(self, context_ids: list[int], recompute: int) -> TransferredCache:
        device = next(self.source.parameters()).device
        src_cache = prefill(self.source, torch.tensor([context_ids], device=device))
        return TransferredCache(src_cache, self.mapper, num_recompute_tokens=recompute, model=self.target)

    @torch.no_grad()
    def _score(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        """Sum log-prob of the continuation and whether greedy decoding would produce it."""
        if not context_ids:
            context_ids = [self._prefix_token]
        r = self._recompute(len(context_ids))
        cache = self._transferred(context_ids, r)
        scores, greedy = score_continuations(self.target, context_ids[-r:], [continuation_ids], cache)
        return float(scores[0]), bool(greedy[0])

    @torch.no_grad()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """`_score` for several (context, continuation) pairs at once: contexts left-padded into one source
        prefill and one transferred cache, the target fed each row's recomputed tokens + continuation."""
        if len(pairs) == 1:
            return [self._score(*pairs[0])]
        pairs = [(c or [self._prefix_token], cont) for c, cont in pairs]
        device = next(self.source.parameters()).device
        length = max(len(c) for c, _ in pairs)
        width = max(len(cont) for _, cont in pairs)
        r = min(self._recompute(len(c)) for c, _ in pairs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.prefix_token_id
        ids = torch.full((len(pairs), length), pad, dtype=torch.long)
        mask = torch.zeros((len(pairs), length), dtype=torch.long)
        feed = torch.full((len(pairs), r + width), pad, dtype=torch.long)
        for row, (context, cont) in enumerate(pairs):
            ids[row, length - len(context) :] = torch.tensor(context)
            mask[row, length - len(context) :] = 1
            feed[row, :r] = torch.tensor(context[-r:])
            feed[row, r : r + len(cont)] = torch.tensor(cont)  # right pads: real tokens never attend to them
        ids, mask, feed = ids.to(device), mask.to(device), feed.to(device)
        cache = TransferredCache(
            prefill(self.source, ids, mask), self.mapper, attention_mask=mask, num_recompute_tokens=r, model=self.target
        )
        # the feed's first r tokens are the context's last r (real for every row: contexts are left-padded)
        full_mask = torch.cat([mask, torch.ones_like(feed[:, r:])], dim=1)
        positions = (full_mask.cumsum(-1) - 1)[:, length - r :]
        target_device = next(self.target.parameters()).device
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=REFEED_WARNING)
            logits = self.target(
                feed.to(target_device),
                attention_mask=full_mask.to(target_device), position_ids=positions.to(target_device),
                use_cache=True, **{cache_argument(self.target): cache},
            ).logits.float()
        logp = logits[:, r - 1 : -1].log_softmax(-1)
        out = []
        for row, (_, cont) in enumerate(pairs):
            tok = torch.tensor(cont, device=logp.device)
            score = float(logp[row, torch.arange(len(cont), device=logp.device), tok].double().sum())
            out.append((score, bool((logp[row, : len(cont)].argmax(-1) == tok).all())))
        return out

    def _batched(self, pairs: list[tuple[list[int], list[int]]], desc: str, disable_tqdm: bool) -> list[tuple[float, bool]]:
        out = []
        bar = progress_bar(total=len(pairs), desc=desc, enabled=not disable_tqdm)
        for start in range(0, len(pairs), self.batch_size):
            out.extend(self._score_batch(pairs[start : start + self.batch_size]))
            bar.update(min(self.batch_size, len(pairs) - start))
        bar.close()
        return out

    # -- lm_eval API --------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args[:2]
            # Keep the whitespace that joins context and continuation on the continuation side, as lm_eval does.
            stripped = len(context) - len(context.rstrip())
            if stripped:
                context, continuation = context[:-stripped], context[-stripped:] + continuation
            cont_ids = self._encode(continuation)
            if not cont_ids:
                raise ValueError(f"empty continuation for context {context[-60:]!r}")
            pairs.append((self._encode(context), cont_ids))
        return self._batched(pairs, "hf-kvtransfer loglikelihood", disable_tqdm)

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pieces, owners = [], []
        for index, request in enumerate(requests):
            ids = self._encode(request.args[0])
            # The stock `hf` model's windows: the start token, then windows of max_length tokens.
            windows = get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                # Chunk after chunk: the target scores each on the transferred cache of all before it in the window.
                for start in range(0, len(continuation), self.rolling_chunk):
                    pieces.append((context + continuation[:start], continuation[start : start + self.rolling_chunk]))
                    owners.append(index)
        totals = [0.0] * len(requests)
        for index, (score, _) in zip(owners, self._batched(pieces, "hf-kvtransfer rolling", disable_tqdm)):
            totals[index] += score
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        device = next(self.target.parameters()).device
        for request in progress_bar(requests, desc="hf-kvtransfer generate", enabled=not disable_tqdm):
            context, gen_kwargs = request.args[:2]
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(gen_kwargs.pop("do_sample", False))
            ids = self._encode(context) or [self._prefix_token]
            cache = self._transferred(ids, self._recompute(len(ids)))
            input_ids = torch.tensor([ids], device=device)
            generated = self.target.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new, do_sample=do_sample,
                **{cache_argument(self.target): cache}, pad_token_id=self.tokenizer.eos_token_id,
                **({k: v for k, v in gen_kwargs.items() if k in ("temperature", "top_p", "top_k")} if do_sample else {}),
            )
            text = self.tokenizer.decode(generated[0, len(ids) :], skip_special_tokens=True)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out


def main(argv: list[str] | None = None) -> None:
    """`lm_eval`'s command line with the `hf-kvtransfer` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
