"""Training steps for the GPU oracle (gpu_oracle_predict.py on any machine, gpu_oracle_run.py on the GPU).

The steps the H200 ran on 2026-12-04 (data/), copied from the project's shared GPU measurements
(``../shared/gpu/oracle/gpu_models.py``) so that a clone predicts them again without that folder; the measurement
scripts themselves (the oracle's predict, run, profile and snapshot scripts) stay there, with the GPU they need.

Each config builds the same step on any device: ``build(name, device)`` returns a dict with the model (plain, no
checkpointing unless the config is the user's own), the inputs, the loss function, the optimizer factory, the
``parallelize`` (FSDP2 as the run wraps) or None, the clip norm, and the remat Target fields it is planned with.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

#: the repository (benchmarks/targets/torchtitan_llama3.py is read from it)
PROJECT = os.environ.get("REMAT_PROJECT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def titan_module():
    if "tt_llama3" in sys.modules:
        return sys.modules["tt_llama3"]
    path = os.path.join(PROJECT, "benchmarks", "targets", "torchtitan_llama3.py")
    spec = importlib.util.spec_from_file_location("tt_llama3", path)
    m = importlib.util.module_from_spec(spec)
    sys.modules["tt_llama3"] = m
    spec.loader.exec_module(m)
    return m


def llama1b_step(device: str, batch: int = 4, seq: int = 2048, tiny: bool = False):
    """A Llama 3.2 1B-shaped Hugging Face model in bfloat16, one GPU, AdamW, HF's loss; the loop keeps only the loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2) if tiny else dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                                         num_hidden_layers=16, num_attention_heads=32,
                                                         num_key_value_heads=8)
    cfg = LlamaConfig(max_position_embeddings=max(4096, seq), rope_theta=500000.0, tie_word_embeddings=True,
                      use_cache=False, **size)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size - 1, (batch, seq), generator=g).to(device)
    return dict(model=model, inputs={"input_ids": ids, "labels": ids}, loss_fn=lambda out: out.loss,
                opt=lambda ps: torch.optim.AdamW(ps, lr=1e-5), parallelize=None, clip=None,
                target=dict(world=1), init=None, output_alive=False)


def _titan(device: str, layers: int = 4, batch: int = 2, seq: int = 8192, own_sac: bool = False, tiny: bool = False):
    """torchtitan's Llama 3 (8B widths, ``layers`` blocks) as torchtitan trains it: FSDP2 (one rank here) with bf16
    compute, its AdamW, clip 1.0, loss on fp32 logits, the logits dropped before backward; ``own_sac``: its op-level
    selective checkpointing with the save list as shipped (CUDA kernels named)."""
    tt = titan_module()
    with torch.device("meta"):
        inner = tt.Transformer(tt.model_args("debugmodel", n_layers=layers) if tiny else
                               tt.model_args("8B", n_layers=layers))
    if own_sac:
        tt.apply_selective_op_ac(inner, tt._save_list)
    model = tt.WithLoss(inner)
    vocab = inner.tok_embeddings.num_embeddings

    def make_inputs(dev):
        g = torch.Generator().manual_seed(1)
        return (torch.randint(0, vocab, (batch, seq), generator=g).to(dev),
                torch.randint(0, vocab, (batch, seq), generator=g).to(dev))

    tokens, labels = make_inputs(device)

    def init(m, dev):  # after parallelize: materialize as train.py does
        m.model.to_empty(device=dev)
        torch.manual_seed(0)
        with torch.no_grad():
            m.model.init_weights()
        m.train()

    return dict(model=model, inputs=(tokens, labels), loss_fn=lambda loss: loss,
                opt=lambda ps: torch.optim.AdamW(ps, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True),
                parallelize=tt.parallelize_fsdp, clip=1.0, target=dict(world=1, fsdp=1), init=init,
                output_alive=False, make_inputs=make_inputs)


CONFIGS = {
    "llama1b": lambda device: llama1b_step(device),
    "titan4": lambda device: _titan(device),
    "titan4_own_sac": lambda device: _titan(device, own_sac=True),
    # smoke tests of the scripts on a CPU (ORACLE_DEVICE=cpu)
    "tiny_llama": lambda device: llama1b_step(device, batch=2, seq=64, tiny=True),
    "tiny_titan": lambda device: _titan(device, layers=2, batch=1, seq=128, tiny=True),
}


def build(name: str, device: str):
    return CONFIGS[name](device)
