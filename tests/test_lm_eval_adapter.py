"""The lm-evaluation-harness adapter against lm_eval's own stock `hf` model (`HFLM`) on the same in-memory model.

On the exact pair (a mapper from a model to itself that reproduces its cache) the adapter must score exactly as
`--model hf` does: the transfer is then invisible, so any difference is the adapter's bookkeeping (windows, start
token, chunking, batching). No network: tiny models from configs, a word-level tokenizer, in-memory requests.
"""

from __future__ import annotations

import random

import pytest

from conftest import exact_identity_mapper, tiny_model
from fit_fixtures import WORDS, make_tokenizer

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval not installed (pip install 'hf-kvtransfer[test]')")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from hf_kvtransfer.integrations.lm_eval_harness import KVTransferLM  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen3", num_hidden_layers=2, seed=3)  # max_position_embeddings 256: rolling windows of 256
    tokenizer = make_tokenizer()
    stock = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    return model, tokenizer, exact_identity_mapper(model), stock


def _passage(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_rolling_loglikelihood_equals_the_stock_hf_model(setup, batch_size):
    model, tokenizer, mapper, stock = setup
    # one window (shorter than 256 tokens), several windows (600 tokens), a single token
    texts = [_passage(120, 1), _passage(600, 2), _passage(1, 3), _passage(257, 4)]
    requests = _requests("loglikelihood_rolling", [(t,) for t in texts])
    expected = stock.loglikelihood_rolling(requests, disable_tqdm=True)
    adapter = KVTransferLM(source=model, target=model, mapper=mapper, tokenizer=tokenizer, rolling_chunk=100,
                           batch_size=batch_size)  # fmt: skip
    got = adapter.loglikelihood_rolling(requests, disable_tqdm=True)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-3)
    # The start token matters: without it the first chunk would be scored from nothing, the rest shifted by one.
    assert adapter.prefix_token_id == stock.prefix_token_id == tokenizer.bos_token_id


def test_batched_loglikelihood_equals_unbatched_and_stock(setup):
    model, tokenizer, mapper, stock = setup
    args = [(_passage(n, 10 + n), " " + _passage(m, 20 + m)) for n, m in ((5, 1), (30, 4), (12, 2), (1, 3), (50, 6))]
    requests = _requests("loglikelihood", args)
    one = KVTransferLM(source=model, target=model, mapper=mapper, tokenizer=tokenizer, batch_size=1)
    many = KVTransferLM(source=model, target=model, mapper=mapper, tokenizer=tokenizer, batch_size=4)
    a = one.loglikelihood(requests, disable_tqdm=True)
    b = many.loglikelihood(requests, disable_tqdm=True)
    assert [s for s, _ in b] == pytest.approx([s for s, _ in a], rel=1e-5, abs=1e-4)
    assert [g for _, g in b] == [g for _, g in a]
    expected = stock.loglikelihood(requests, disable_tqdm=True)
    assert [s for s, _ in a] == pytest.approx([s for s, _ in expected], rel=1e-5, abs=1e-4)
