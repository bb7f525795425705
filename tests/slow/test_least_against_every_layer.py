"""remat's least peak against the hand rule "every layer" on two third-party decoders (issue #36, part 2, eager):
a 3-layer Hugging Face Qwen2 trained under ``torch.autocast("cpu", torch.bfloat16)`` and a 2-layer Hugging Face
Mamba (its reference PyTorch path), built from configs. The hand rule checkpoints each layer's forward with
``torch.utils.checkpoint(..., use_reentrant=False)``; its step is measured by remat's own meter
(``remat.measure_step``); a budget equal to it gets a plan whose checked peak is within it, and remat's least
is at or below it. (The issue's figures, Qwen2 every layer 20.4 MiB against remat's least 21.2, Mamba 11.3
against 11.3 refused, were not reproduced with these configurations, whose sizes the issue does not give;
measured here: Qwen2 every layer 15,407,688 bytes, a plan for that budget checked at 14,459,336; Mamba
35,699,080, remat's least 35,694,024.) Slow: transformers' model code, about 40 s."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import remat

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]')")


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def every_layer_by_hand(model, layers):
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, type(layer).forward.__get__(layer))
    return model


def qwen2():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   use_cache=False)
    model = transformers.Qwen2ForCausalLM(cfg).train()
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, lambda m: m.model.layers


def mamba():
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=1024, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2,
                                   conv_kernel=4, use_cache=False)
    model = transformers.MambaForCausalLM(cfg).train()
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, lambda m: m.backbone.layers


@pytest.mark.parametrize("make,autocast", [(qwen2, True), (mamba, False)], ids=["qwen2-bf16-autocast", "mamba"])
def test_remats_least_is_at_or_below_every_layer(make, autocast):
    model, batch, layers = make()
    loss_fn = lambda out: out.loss  # noqa: E731
    with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
        hand, _, _ = make()
        every = remat.measure_step(every_layer_by_hand(hand, layers(hand)), batch, loss_fn=loss_fn).peak_bytes
        plan = remat.optimize_checkpointing(model, every / 2**30, batch, loss_fn=loss_fn)
    assert plan.checked_peak_bytes <= every, (plan.checked_peak_bytes, every)
    assert plan.min_peak_bytes <= every, (plan.min_peak_bytes, every)
