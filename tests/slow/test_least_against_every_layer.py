"""remat's least peak against the hand rule "every layer" on two third-party decoders (issues #36 and #48, eager), in
the configurations issue #48 gives: a 3-layer Hugging Face Qwen2 (attention dropout 0.1) trained under
``torch.autocast("cpu", torch.bfloat16)`` and a 2-layer Hugging Face Mamba (its reference PyTorch path), Adam, the
Hugging Face loss, 4 sequences of 128 (Mamba: 64) token ids in [3, 1000). Two hand rules: each layer's forward under
``torch.utils.checkpoint(..., use_reentrant=False)``, and Hugging Face's own ``gradient_checkpointing_enable()``.
Their steps are measured by remat's own meter (``remat.measure_step``, its budget's definition); a budget equal to
the lower gets a plan whose checked peak is within it, and remat's least is at or below it.

Measured here (torch 2.13, and the same on 2.8 and 2.15): Qwen2 every layer 22,269,668 bytes by either rule, remat's
least 22,269,668 (21.24 MiB: the issue's "remat's least 21.2"); Mamba 11,876,128 both (the issue's "11.3 MiB").
The issue's "every layer by hand 20.4 MiB" was not reproduced: not with the output dropped after the loss (Qwen2
21,245,668 both ways, Mamba 10,852,128), not with Hugging Face's default checkpointing, not on another torch.
Slow: transformers' model code, about 40 s."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import remat

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]')")

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def every_layer_by_hand(model, layers):
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, type(layer).forward.__get__(layer))
    return model


def every_layer_by_hugging_face(model, layers):
    model.gradient_checkpointing_enable()
    return model


def batch(tokens: int) -> dict:
    ids = torch.randint(3, 1000, (4, tokens), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def qwen2():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attention_dropout=0.1, **IDS)
    return transformers.Qwen2ForCausalLM(cfg).train(), batch(128), lambda m: m.model.layers


def mamba():
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=1000, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                                   conv_kernel=4, **IDS)
    return transformers.MambaForCausalLM(cfg).train(), batch(64), lambda m: m.backbone.layers


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' gradient_checkpointing_enable is deprecated
@pytest.mark.parametrize("make,autocast", [(qwen2, True), (mamba, False)], ids=["qwen2-bf16-autocast", "mamba"])
def test_remats_least_is_at_or_below_every_layer(make, autocast):
    loss_fn = lambda out: out.loss  # noqa: E731
    with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
        peaks = {}
        for rule in (every_layer_by_hand, every_layer_by_hugging_face):
            hand, inputs, layers = make()
            peaks[rule.__name__] = remat.measure_step(rule(hand, layers(hand)), inputs, loss_fn=loss_fn,
                                                      optimizer_factory=adam, repeats=0).peak_bytes
        every = min(peaks.values())
        model, inputs, _ = make()
        plan = remat.optimize_checkpointing(model, every / 2**30, inputs, loss_fn=loss_fn,
                                            optimizer=adam(model.parameters()))
    assert plan.checked_peak_bytes <= every, (plan.checked_peak_bytes, peaks)
    assert plan.min_peak_bytes <= every, (plan.min_peak_bytes, peaks)
