"""Command-line targets for the GPU checks (benchmarks/gpu/gpu_acceptance.sh; issue #55).

    remat accuracy benchmarks/gpu/gpu_targets.py:llama1b --output-dropped
    remat accuracy benchmarks/gpu/gpu_targets.py:llama_tiny --device h100-80gb --measure-on cpu   # (a CPU smoke test)

``llama1b``: a Hugging Face Llama with Llama 3.2 1B's shape (16 layers, width 2048, 8 KV heads, vocabulary
128,256, tied embeddings), built in bfloat16 with ``sdpa`` attention, a batch of 4 x 2048 token ids with
``labels=input_ids`` and Hugging Face's own loss: the step of ``../shared/gpu/oracle/gpu_models.py``'s
``llama1b`` (AdamW is the command line's default optimizer; that loop keeps only the loss: ``--output-dropped``).
``llama_tiny``: the same code at 2 layers, width 64, vocabulary 1,000, for checks on a CPU.
"""

from __future__ import annotations

import torch

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8)
LLAMA_TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def _llama(size: dict, device, batch_size: int, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=max(4096, seq_len), rope_theta=500000.0, tie_word_embeddings=True,
                      use_cache=False, **size)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # built where it trains (meta for a prediction): no copy through the host
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size - 1, (batch_size, seq_len), generator=g).to(device)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def llama1b(device="cpu", batch_size: int = 4, seq_len: int = 2048):
    """Llama 3.2 1B's shape in bfloat16, batch ``batch_size`` x ``seq_len`` (default 4 x 2048)."""
    return _llama(LLAMA_1B, device, batch_size, seq_len)


def llama_tiny(device="cpu", batch_size: int = 2, seq_len: int = 64):
    """The same model at 2 layers, width 64 (a check of the scripts on a CPU)."""
    return _llama(LLAMA_TINY, device, batch_size, seq_len)
