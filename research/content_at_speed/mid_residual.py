"""A lever for the exact pass: maps that read the target's residual stream *after* the attention of its last exact
layer, before that layer's MLP, so the exact pass skips the MLP and the next layer's projections.

The library's residual input reads the residual stream entering layer `L` (`ResidualConfig(layer=L)`): the exact pass
runs layers `0 .. L-1` whole and layer `L` up to its keys and values. Here the same configuration, `L + 1` exact
layers and `layer = L`, reads instead the residual after layer `L`'s attention (the input of its
`post_attention_layernorm`): layers `0 .. L-1` whole, layer `L`'s attention, no MLP. Its keys and values are the
target's own (stored when its attention runs). On the deep pair the default computes layers 0 and 1 whole and layer
2's K/V; at `L = 1` this reads the stream after layer 1's attention (where the target copies) and skips layer 1's MLP
and layer 2.

This wrapper changes two functions for the whole process — the calibration pass's capture of the residual and the
cache's exact pass — and then runs an `hf-kvtransfer` command or a research script, so the fit, `eval` and the
timing all use the same reading. A mapper fit through it looks like an ordinary one; load it only through this
wrapper (`MID_RESIDUAL` in its directory marks it; `--mapper` must be marked). Under `fit` every candidate reads the
stream after the attention; otherwise only mappers loaded from a marked directory do, so `time_split --also` times
an ordinary mapper in the same rounds.

    python research/content_at_speed/mid_residual.py cli fit -v --source examples/family_deep/source \
        --target examples/family_deep/target --dataset examples/family_deep/calibration.txt --output DIR
    python research/content_at_speed/mid_residual.py cli eval --source examples/family_deep/source \
        --target examples/family_deep/target --mapper DIR --text examples/family_deep/heldout.txt \
        --tasks recall,handoff --items 600 --json FILE
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/content_at_speed/mid_residual.py time_split \
        --family examples/family_deep --source source --target target --mapper DIR --also default=DEFAULT_DIR \
        --rounds 9 --output FILE
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python research/content_at_speed/mid_residual.py \
        research/probe_calibration/deep_boundary.py --mapper DIR --items 2000 --kinds eval --json FILE

The first argument is `cli` (an `hf-kvtransfer` command), a script of this folder by name, or a script's path.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

import hf_kvtransfer.core.cache as cache_module
import hf_kvtransfer.fitting.calibration_pass as calibration_module
from hf_kvtransfer import KVMapper, TransferredCache
from hf_kvtransfer.core.capture import cache_argument
from hf_kvtransfer.core.exact import PrefixCache, StopForward, decoder_layers
from hf_kvtransfer.core.local_attention import attend_within

MARK = "MID_RESIDUAL"
_own_prefix = cache_module.own_prefix
_capture_kv_and_inputs = calibration_module.capture_kv_and_inputs
_from_pretrained = KVMapper.from_pretrained.__func__
_compute_exact_layers = TransferredCache.compute_exact_layers
# Whether the running exact pass reads the stream after the attention: always under `fit`, else per mapper.
STATE = {"fit": False, "mapper": False}


def from_pretrained(cls, path, *args, **kwargs):
    mapper = _from_pretrained(cls, path, *args, **kwargs)
    mapper.mid_residual = (Path(path) / MARK).exists()
    return mapper


def compute_exact_layers(self, *args, **kwargs):
    STATE["mapper"] = getattr(self.mapper, "mid_residual", False)
    try:
        return _compute_exact_layers(self, *args, **kwargs)
    finally:
        STATE["mapper"] = False


def _after_attention(model, layer: int):
    """The module whose input is the residual stream after `layer`'s attention (before its MLP)."""
    return decoder_layers(model)[layer].post_attention_layernorm


@torch.no_grad()
def capture_kv_and_inputs(model, input_ids, attention_mask=None, *, hidden_layers=(), key_projections=False):
    """`core.capture.capture_kv_and_inputs` with each of `hidden_layers` read after that layer's attention (the
    library's capture runs the forward; these hooks take the stream on the way)."""
    hidden, hooks = {}, []
    for j in hidden_layers:

        def keep(module, args, j=j):
            hidden[j] = args[0].float()

        hooks.append(_after_attention(model, j).register_forward_pre_hook(keep))
    try:
        keys, values, _, proj = _capture_kv_and_inputs(
            model, input_ids, attention_mask, key_projections=key_projections
        )
    finally:
        for hook in hooks:
            hook.remove()
    return keys, values, hidden, proj


@torch.no_grad()
def own_prefix(model, input_ids, attention_mask, position_ids, num_layers, hidden_of=None, window=None):
    """`core.exact.own_prefix` that, with `hidden_of`, runs layer `hidden_of`'s attention (storing its K/V) and stops
    at the residual after it: layers `0 .. hidden_of` are the exact ones."""
    if hidden_of is None or not (STATE["fit"] or STATE["mapper"]):
        return _own_prefix(model, input_ids, attention_mask, position_ids, num_layers, hidden_of, window)
    if hidden_of != num_layers - 1:
        raise ValueError(
            f"mid_residual reads the residual after the last exact layer's attention, got layer {hidden_of} of {num_layers}"
        )
    body = model.base_model if hasattr(model, "base_model") else model
    device = model.get_input_embeddings().weight.device
    cache, captured = PrefixCache(num_layers + 1), {}

    def keep_and_stop(module, args):
        captured["hidden"] = args[0]
        raise StopForward

    hook = _after_attention(model, hidden_of).register_forward_pre_hook(keep_and_stop)
    try:
        with attend_within(model, window):
            body(input_ids=input_ids.to(device),
                 attention_mask=attention_mask.to(device) if attention_mask is not None else None,
                 position_ids=position_ids.to(device), use_cache=True, **{cache_argument(body): cache})  # fmt: skip
    except StopForward:
        pass
    finally:
        hook.remove()
    return [(layer.keys, layer.values) for layer in cache.layers[:num_layers]], captured["hidden"]


def _check_marks(argv: list[str]) -> None:
    """Refuse a `--mapper` directory that was not fit through this wrapper (it would be read at the wrong point)."""
    for flag, value in zip(argv, argv[1:]):
        if flag == "--mapper" and not (Path(value) / MARK).exists():
            raise SystemExit(f"{value} was not fit through mid_residual.py (no {MARK} file): refit it here")


@contextlib.contextmanager
def patched(fit: bool) -> Iterator[None]:
    """While inside, the calibration pass and the exact pass read the residual after the attention: every exact pass
    with `fit`, else only those of mappers loaded from a marked directory (or with `mid_residual = True`)."""
    saved = (calibration_module.capture_kv_and_inputs, cache_module.own_prefix, KVMapper.__dict__["from_pretrained"],
             TransferredCache.compute_exact_layers)  # fmt: skip
    calibration_module.capture_kv_and_inputs = capture_kv_and_inputs
    cache_module.own_prefix = own_prefix
    KVMapper.from_pretrained = classmethod(from_pretrained)
    TransferredCache.compute_exact_layers = compute_exact_layers
    STATE["fit"] = fit
    try:
        yield
    finally:
        (calibration_module.capture_kv_and_inputs, cache_module.own_prefix, KVMapper.from_pretrained,
         TransferredCache.compute_exact_layers) = saved  # fmt: skip
        STATE["fit"] = False


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 else 2)
    what, argv = sys.argv[1], sys.argv[2:]
    _check_marks(argv)
    fit = what == "cli" and argv[:1] == ["fit"]
    with patched(fit):
        if what == "cli":
            from hf_kvtransfer.commands.cli import main as cli

            code = cli(argv)
            if fit and code == 0:
                (Path(argv[argv.index("--output") + 1]) / MARK).write_text(
                    "residual read after the layer's attention\n"
                )
            raise SystemExit(code)
        script = Path(what) if what.endswith(".py") else Path(__file__).resolve().parent / f"{what}.py"
        sys.argv = [str(script), *argv]
        sys.path.insert(0, str(script.resolve().parent))
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
