"""Every surface with every mapper kind the fit saves: one matrix.

Each kind is made by the fit's own functions on a tiny saved pair whose target has another KV layout than its source,
saved with `save_pretrained` and loaded back from disk, as a user gets it. Each surface must give the target's answer
or one line saying why not (`error:` and at most a `hint:`), never a traceback. Where an answer can be checked
against an independent computation it is: the same prompt as ids or as embeddings, alone or in a left-padded batch,
gives the same logits.
"""

from __future__ import annotations

from dataclasses import replace

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import left_pad, random_ids
from fit_fixtures import save_pair, write_corpus
from hf_kvtransfer import KVMapper, TransferredCache, prefill
from hf_kvtransfer.commands.bench import mapping_flops
from hf_kvtransfer.commands.cli import main
from hf_kvtransfer.core.exact import own_prefix
from mapper_kinds import KINDS, SURFACE_KINDS, calibration_ids, make_kinds


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny saved pair (source: 2 layers, 2 KV heads of 16; target: 3 layers, 1 KV head of 8), a corpus, and one
    saved mapper of each kind."""
    root = tmp_path_factory.mktemp("surfaces")
    source_dir, target_dir = save_pair(root, source_layers=2, target_layers=3)
    corpus = write_corpus(root / "corpus.txt", num_paragraphs=120)
    source = AutoModelForCausalLM.from_pretrained(source_dir).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = calibration_ids(AutoTokenizer.from_pretrained(target_dir), corpus)
    made = make_kinds(source, target, ids)
    dirs = {}
    for name, mapper in made.items():
        mapper.save_pretrained(root / name)
        dirs[name] = root / name
    return {"source": source_dir, "target": target_dir, "corpus": corpus, "models": (source, target), "dirs": dirs}


def _answer_or_one_line(code: int, err: str) -> None:
    """The contract of every command: success, or `error:` on one line (plus at most a `hint:` line)."""
    assert "Traceback" not in err, err
    if code != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines[0].startswith("error: ") and (len(lines) == 1 or lines[1].startswith("hint: ")), err


def test_every_kind_loads_as_saved(family):
    for name, path in family["dirs"].items():
        mapper = KVMapper.from_pretrained(path)
        assert mapper.config.selected_layers and mapper.num_parameters() > 0, name


@pytest.mark.parametrize("kind", SURFACE_KINDS)
def test_commands(kind, family, tmp_path, capsys):
    path, source, target = str(family["dirs"][kind]), str(family["source"]), str(family["target"])
    runs = {
        "info": ["info", path],
        "bench": ["bench", "--no-reexec", "--source", source, "--target", target, "--mapper", path, "--seq-lens", "24",
                  "--repeats", "1", "--warmup", "0", "--decode-steps", "1", "--threads", "1",
                  "--output-dir", str(tmp_path / "bench")],
        "eval": ["eval", "--source", source, "--target", target, "--mapper", path, "--text", str(family["corpus"]),
                 "--tasks", "perplexity,repeat,recall", "--items", "4", "--prefix-len", "32", "--max-windows", "2",
                 "--json", str(tmp_path / "e.json")],
        "demo": ["demo", "--source", source, "--target", target, "--mapper", path, "--text", str(family["corpus"]),
                 "--prompt", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12", "--max-new-tokens", "3", "--recall-items", "0"],
    }  # fmt: skip
    for command, argv in runs.items():
        code = main(argv)
        captured = capsys.readouterr()
        _answer_or_one_line(code, captured.err)
        assert code == 0, f"{command} refused the {kind} mapper the fit saved: {captured.err}"
        if command == "info":  # what its arithmetic allows, from its config and weights alone
            assert "fewer FLOPs than the target's own prefill at 1024 tokens" in captured.out, captured.out


# The first-layer table computes its exact layer by a look-up, not as the target's own prefill does.
@pytest.mark.parametrize("kind", [k for k in SURFACE_KINDS if k != "first-layer-table"])
def test_info_says_what_the_transfer_does(kind, family, capsys):
    """`info`'s exact layers, what the maps read and the recomputed tokens, against the transfer itself at its
    defaults: the leading layers whose K/V equal the target's own prefill's, whether the mapped layers move when the
    source's cache does, and how many prompt tokens the cache leaves to the target's forward; a gate is named."""
    out = _info_against_transfer(family["dirs"][kind], family, capsys)
    assert ("gate:        a request row whose mapped K/V" in out) == (kind == "quality-gate"), out


def test_info_of_a_mapper_that_maps_no_layer(family, tmp_path, capsys):
    """A fit that keeps every layer exact (no map kept the content): nothing mapped, one recomputed token."""
    mapper = KVMapper.from_pretrained(family["dirs"]["source-only"])
    mapper.config = replace(mapper.config, num_exact_layers=len(mapper.config.selected_layers))
    mapper.save_pretrained(tmp_path / "all-exact")
    out = _info_against_transfer(tmp_path / "all-exact", family, capsys)
    assert "maps:        none" in out and "the prompt's last 1 token(s)" in out, out


def _info_against_transfer(path, family, capsys) -> str:
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    source, target = family["models"]
    mapper = KVMapper.from_pretrained(path)
    ids = random_ids(1, 80, seed=6) % 60 + 4
    with torch.no_grad():
        own, src, moved = prefill(target, ids), prefill(source, ids), prefill(source, ids)
        for layer in moved.layers:
            layer.keys, layer.values = layer.keys + 1, layer.values - 1
        fresh = TransferredCache(src, mapper, model=target)
        a = TransferredCache(src, mapper, model=target).convert_all()
        b = TransferredCache(moved, mapper, model=target).convert_all()
    n = len(own.layers)
    same = [torch.allclose(a.layers[t].keys, own.layers[t].keys[..., : a.layers[t].keys.shape[-2], :], atol=1e-5)
            for t in range(n)]  # fmt: skip
    exact = same.index(False) if False in same else n
    assert f"its first {exact} of {n} layer(s) itself" in out, out
    assert f"the prompt's last {ids.shape[1] - fresh.get_seq_length()} token(s)" in out, out
    maps = next(line for line in out.splitlines() if line.startswith("maps:"))
    # The model card `save_pretrained` wrote says the same of the transfer.
    card = (Path(path) / "README.md").read_text(encoding="utf-8")
    card_maps = [line for line in card.splitlines() if line.startswith("- **What the mapped layers read**")]
    assert f"its first {exact} of {n} layers" in card, card
    marked = [t for t in range(n) if f"| {t} (computed by the target) |" in card]
    assert marked == list(range(exact)), (marked, exact)  # the per-layer table marks the layers not mapped
    reads_source = any(not torch.equal(a.layers[t].keys, b.layers[t].keys) for t in range(exact, n))
    if exact < n:
        assert f"{n - exact} mapped layer(s)" in maps and ("no source K/V" not in maps) == reads_source, out
        assert len(card_maps) == 1 and ("no source K/V" not in card_maps[0]) == reads_source, card_maps
    else:
        assert not card_maps and "the target computes every layer itself" in card, card
    # k (source layers per target layer) is marked unused exactly when no mapped layer moves with the source's cache.
    top_k = next(line for line in out.splitlines() if line.startswith("top_k:"))
    card_k = next(line for line in card.splitlines() if line.startswith("- **Source layers per target layer (k)**"))
    assert ("(not used:" not in top_k) == reads_source and ("(not used:" not in card_k) == reads_source, (top_k, card_k)
    return out


@pytest.mark.parametrize("kind", ["source-only", "residual", "residual-alone"])
def test_kv_r2_scores_each_map_as_the_transfer_runs_it(kind, family):
    """`eval`'s K/V R^2 (its perplexity task) against sums written here: a source-only mapper's maps applied to the
    source's captured K/V (every layer, as the fit scores them); a residual mapper's exact layers are the target's own
    (R^2 1) and its mapped layers score below that."""
    from hf_kvtransfer.core.capture import capture_kv
    from hf_kvtransfer.core.map_inputs import exact_layers_needed
    from hf_kvtransfer.evaluation.evaluate import kv_r2

    source, target = family["models"]
    mapper = KVMapper.from_pretrained(family["dirs"][kind])
    ids = random_ids(3, 20, seed=5)
    r2 = kv_r2(source, target, mapper, ids, progress=False)
    if kind == "source-only":
        src, own = capture_kv(source, ids), capture_kv(target, ids)
        for t, selected in enumerate(mapper.config.selected_layers):
            # every token but the last, which a transfer leaves to the target
            feats = [torch.cat([s[i][:, :, :-1].transpose(1, 2).flatten(2) for i in selected], -1) for s in src]
            with torch.no_grad():
                mapped = mapper(t, *feats)
            for name, pred, true in zip(("key", "value"), mapped, (own[0][t][:, :, :-1], own[1][t][:, :, :-1])):
                centred = true - true.mean((0, 2), keepdim=True)  # per head and channel, over every token
                per_head = 1 - ((true - pred) ** 2).sum((0, 2, 3)) / (centred**2).sum((0, 2, 3))
                assert r2[name][t] == pytest.approx(float(per_head.mean()), abs=1e-4), (name, t)
    else:
        exact = exact_layers_needed(mapper.config)[0]
        assert exact >= 1
        assert all(r2[k][t] == pytest.approx(1.0, abs=1e-5) for k in r2 for t in range(exact)), r2
        assert all(r2[k][t] < 0.9999 for k in r2 for t in range(exact, len(r2[k]))), r2


def _cache(family, mapper, ids, mask=None):
    source, target = family["models"]
    return TransferredCache(prefill(source, ids, attention_mask=mask), mapper, attention_mask=mask, model=target)


@pytest.mark.parametrize("kind", SURFACE_KINDS)
def test_generate_paths_agree(kind, family):
    """ids and inputs_embeds, one row and a left-padded batch: the same prompt, the same logits; sampling and beams
    run on the default cache."""
    _, target = family["models"]
    mapper = KVMapper.from_pretrained(family["dirs"][kind])
    ids = random_ids(1, 40, seed=3) % 60 + 4
    emb = target.get_input_embeddings()
    gen = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        by_ids = target.generate(ids, cache=_cache(family, mapper, ids), **gen)
        by_embeds = target.generate(inputs_embeds=emb(ids), cache=_cache(family, mapper, ids), **gen)
    assert torch.equal(by_ids.sequences[:, ids.shape[1]:], by_embeds.sequences)
    torch.testing.assert_close(torch.stack(by_ids.logits), torch.stack(by_embeds.logits), rtol=1e-4, atol=1e-4)
    # A left-padded batch: the longer row is the prompt above, unpadded (position ids and RoPE follow the mask).
    short = random_ids(1, 30, seed=4) % 60 + 4
    batch, mask = left_pad(torch.cat([ids, torch.nn.functional.pad(short, (10, 0), value=5)]), [40, 30])
    with torch.no_grad():
        padded = target.generate(batch, attention_mask=mask, cache=_cache(family, mapper, batch, mask), **gen)
    torch.testing.assert_close(torch.stack(padded.logits)[:, :1], torch.stack(by_ids.logits), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        sampled = target.generate(ids, cache=_cache(family, mapper, ids), max_new_tokens=3, do_sample=True, top_k=5)
        beams = target.generate(ids, cache=_cache(family, mapper, ids), max_new_tokens=3, num_beams=2, do_sample=False)
    assert sampled.shape == beams.shape == (1, ids.shape[1] + 3)


@pytest.mark.parametrize("kind", ["source-only", "residual", "token-tables"])
def test_push_pull_round_trip(kind, family, hub_server):
    mapper = KVMapper.from_pretrained(family["dirs"][kind])
    repo = f"{hub_server.user}/surfaces-{kind}"
    mapper.push_to_hub(repo, token=hub_server.write_token)
    pulled = KVMapper.from_pretrained(repo, token=hub_server.write_token)
    assert pulled.config == mapper.config
    ours, theirs = mapper.state_dict(), pulled.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


# The first-layer table's exact layer is a look-up by token id, not the target's projections: its exact pass is not
# the target's own, so the exact pass cannot be subtracted here (its maps are the source-only kind's).
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "first-layer-table"])
def test_bench_counts_the_flops_the_transfer_runs(kind, family):
    """bench's FLOPs of the maps (`mapping_flops` at the mapper's exact layers) are what torch's FLOP counter sees a
    transfer run beyond the target's own exact pass: the maps of the layers it maps and what their inputs add (the
    residual's projection and weights), never the maps of layers the target computes itself."""
    source, target = family["models"]
    mapper = KVMapper.from_pretrained(family["dirs"][kind])
    ids = random_ids(1, 24, seed=5)
    cache = prefill(source, ids)

    def transfer():
        return TransferredCache(cache, mapper, num_recompute_tokens=0, model=target).convert_all()

    exact = transfer().num_exact_layers  # the first run also builds the stacked weights, once
    with FlopCounterMode(display=False) as whole:
        transfer()
    with FlopCounterMode(display=False) as own:
        if exact:
            own_prefix(target, ids, None, torch.arange(ids.shape[-1]).unsqueeze(0), exact)
    assert whole.get_total_flops() - own.get_total_flops() == mapping_flops(mapper, ids.shape[-1], exact)


# Slow (compiling the tiny target takes seconds per variant of the cache's state; .ci/run runs it).
@pytest.mark.slow
def test_a_compiled_target_answers_as_the_eager_one(family):
    """`torch.compile` on the target's forward: every kind the fit saves gives the eager target's tokens and logits
    through generate (one row and a left-padded batch), and input that does not continue the prompt is refused as
    eagerly. The compiled forward converts the cache before its graph (one break) and traces the layers as with a
    plain cache."""
    _, target = family["models"]
    ids = random_ids(1, 40, seed=7) % 60 + 4
    short = random_ids(1, 30, seed=8) % 60 + 4
    batch, mask = left_pad(torch.cat([ids, torch.nn.functional.pad(short, (10, 0), value=5)]), [40, 30])
    gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)

    def answers(kind):
        mapper = KVMapper.from_pretrained(family["dirs"][kind])
        with torch.no_grad():
            one = target.generate(ids, cache=_cache(family, mapper, ids), **gen)
            padded = target.generate(batch, attention_mask=mask, cache=_cache(family, mapper, batch, mask), **gen)
        return [(out.sequences, torch.stack(out.logits)) for out in (one, padded)]

    eager = {kind: answers(kind) for kind in SURFACE_KINDS}
    original = target.forward
    try:
        # The whole module compiled, called directly (a serving loop's own forward): the first generated token's logits.
        compiled = torch.compile(target, dynamic=True)
        for kind in SURFACE_KINDS:
            mapper = KVMapper.from_pretrained(family["dirs"][kind])
            with torch.no_grad():
                cache = _cache(family, mapper, ids)
                got = compiled(ids[:, -cache.num_recompute_tokens:], cache=cache).logits[:, -1]
            torch.testing.assert_close(got, eager[kind][0][1][0], rtol=1e-4, atol=1e-4)
        torch._dynamo.reset()
        # The forward compiled, under generate.
        target.forward = torch.compile(original, dynamic=True)
        for kind in SURFACE_KINDS:
            for (sequences, logits), (want_sequences, want_logits) in zip(answers(kind), eager[kind]):
                assert torch.equal(sequences, want_sequences), kind
                torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        mapper = KVMapper.from_pretrained(family["dirs"]["residual"])
        with pytest.raises(ValueError, match="differ from the prompt this cache was built for"), torch.no_grad():
            target.generate(ids.flip(-1), cache=_cache(family, mapper, ids), max_new_tokens=2)
    finally:
        target.forward = original
        torch._dynamo.reset()
