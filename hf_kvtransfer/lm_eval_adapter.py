"""lm-evaluation-harness model `hf-kvtransfer`: standard tasks scored by the target with the context transferred.

Every request's context is prefilled by the *source* model and mapped into the *target's* cache
(`TransferredCache`); the target only reads the last `num_recompute_tokens` context tokens and the
continuation. Compare with `--model hf --model_args pretrained=TARGET` for the target's own score.

`lm_eval` only knows the models it ships, so run it through this module, which registers the model first:

    python -m hf_kvtransfer.lm_eval_adapter --model hf-kvtransfer \\
        --model_args source=Qwen/Qwen3-0.6B,target=Qwen/Qwen3-1.7B,mapper=org/qwen3-0.6b-to-1.7b \\
        --tasks hellaswag,arc_easy

or from Python: `lm_eval.simple_evaluate(model=KVTransferLM(source=..., target=..., mapper=...), tasks=[...])`.
Needs the optional dependency: `pip install 'hf-kvtransfer[lm-eval]'`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the lm-evaluation-harness adapter needs lm_eval: pip install 'hf-kvtransfer[lm-eval]' (or pip install lm_eval)"
    ) from exc

from huggingface_hub.utils import tqdm

from .cache import TransferredCache
from .capture import prefill
from .mapper import KVMapper
from .models import load_model
from .multiple_choice import score_continuations

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
            continuation token).
        rolling_chunk: for `loglikelihood_rolling` (perplexity tasks), each chunk of this many tokens is
            scored by the target on top of the transferred cache of everything before it.
        device, dtype: where and how to load the models.
    """

    def __init__(
        self,
        source: Any,
        target: Any,
        mapper: Any,
        tokenizer: Any = None,
        num_recompute_tokens: int = 1,
        rolling_chunk: int = 256,
        max_gen_toks: int = 256,
        device: str = "cpu",
        dtype: str = "float32",
        add_bos_token: bool = False,
        **kwargs: Any,
    ):
        super().__init__()
        from transformers import AutoTokenizer

        ignored = {k: v for k, v in kwargs.items() if k not in ("batch_size", "max_batch_size")}
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
        self.num_recompute_tokens = int(num_recompute_tokens)
        if self.num_recompute_tokens < 1:
            raise ValueError(f"num_recompute_tokens must be >= 1, got {num_recompute_tokens}")
        self.rolling_chunk = int(rolling_chunk)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _as_bool(add_bos_token)

    # -- helpers ------------------------------------------------------------------------------------
    @property
    def _prefix_token(self) -> int:
        # What an empty context is replaced by (lm_eval's convention: the end-of-text token).
        for token in (self.tokenizer.bos_token_id if self.add_bos_token else None, self.tokenizer.eos_token_id,
                      self.tokenizer.bos_token_id):
            if token is not None:
                return token
        raise ValueError("the tokenizer has neither an EOS nor a BOS token to start an empty context with")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _transferred(self, context_ids: list[int], recompute: int) -> TransferredCache:
        device = next(self.source.parameters()).device
        src_cache = prefill(self.source, torch.tensor([context_ids], device=device))
        return TransferredCache(src_cache, self.mapper, num_recompute_tokens=recompute)

    @torch.no_grad()
    def _score(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        """Sum log-prob of the continuation and whether greedy decoding would produce it."""
        if not context_ids:
            context_ids = [self._prefix_token]
        r = min(self.num_recompute_tokens, len(context_ids))
        cache = self._transferred(context_ids, r)
        scores, greedy = score_continuations(self.target, context_ids[-r:], [continuation_ids], cache)
        return float(scores[0]), bool(greedy[0])

    # -- lm_eval API --------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in tqdm(requests, desc="hf-kvtransfer loglikelihood", disable=disable_tqdm):
            context, continuation = request.args[:2]
            # Keep the whitespace that joins context and continuation on the continuation side, as lm_eval does.
            stripped = len(context) - len(context.rstrip())
            if stripped:
                context, continuation = context[:-stripped], context[-stripped:] + continuation
            cont_ids = self._encode(continuation)
            if not cont_ids:
                raise ValueError(f"empty continuation for context {context[-60:]!r}")
            out.append(self._score(self._encode(context), cont_ids))
        return out

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in tqdm(requests, desc="hf-kvtransfer rolling", disable=disable_tqdm):
            ids = self._encode(request.args[0])
            total, start = 0.0, 0
            while start < len(ids):
                end = min(start + self.rolling_chunk, len(ids))
                # Chunk after chunk: the target scores ids[start:end] on top of the transferred cache of all before.
                total += self._score(ids[:start], ids[start:end])[0]
                start = end
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        device = next(self.target.parameters()).device
        for request in tqdm(requests, desc="hf-kvtransfer generate", disable=disable_tqdm):
            context, gen_kwargs = request.args[:2]
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(gen_kwargs.pop("do_sample", False))
            ids = self._encode(context) or [self._prefix_token]
            cache = self._transferred(ids, min(self.num_recompute_tokens, len(ids)))
            input_ids = torch.tensor([ids], device=device)
            generated = self.target.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), cache=cache, max_new_tokens=max_new,
                do_sample=do_sample, pad_token_id=self.tokenizer.eos_token_id,
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
