"""torchtitan's Llama 3 as the installed package (torchtitan 0.3, ``pip install 'remat[torchtitan]'``) builds it, for
``benchmarks/targets/published.py --model package``: the same interface as ``torchtitan_llama3.py`` (the copy vendored from the
commit of December 2024 that ran torchtitan's published table), so the table can be predicted from either.

What differs from the vendored copy is the package's own code: fused QKV projection (one ``wqkv``), ComplexRoPE with
``max_seq_len`` 131072 (a larger rope buffer), FlexAttention planned as SDPA (Note [FlexAttention planned as SDPA] in
remat.integrations.torchtitan.planning), its ``SelectiveAC`` (torch's compute-intensive operators and every second
matmul saved), and its FSDP2 wrapping (``apply_fsdp_to_decoder``: the embedding, then ``[norm, lm_head]`` not
resharded after forward, each block, the root). The loss is the plain cross-entropy on the whole logits, as the
published run's (not the ChunkedLossWrapper of 0.3's own ``llama3_8b`` config)."""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from remat.integrations.torchtitan.models import model_config
from remat.integrations.torchtitan.planning import TitanRun, TitanStep, fsdp_as_torchtitan, optimizer_for, sdpa_config

RUN = TitanRun(local_batch_size=2, seq_len=8192)


def remat_target(flavor: str = "8B", *, device: Union[str, torch.device] = "meta", batch_size: int = 2,
                 seq_len: int = 8192, selective_ac: bool = False) -> tuple:
    """``(step, (tokens,), loss_fn, parallelize)``: the package's Llama 3 ``flavor`` on the meta device with its loss,
    torchtitan's own SelectiveAC applied when ``selective_ac``, and torchtitan's FSDP2 wrapping."""
    config, _ = sdpa_config(model_config("llama3", flavor))
    with torch.device("meta"):
        model = config.build()
    if selective_ac:
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        SelectiveAC.Config().build(dump_folder="").apply(model)
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    run = TitanRun(local_batch_size=batch_size, seq_len=seq_len)
    return TitanStep(model), (tokens,), (lambda loss: loss), fsdp_as_torchtitan(run)


def build_optimizer(model: nn.Module) -> Any:
    """AdamW as torchtitan's ``default_adamw`` (lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1), foreach."""
    return optimizer_for(RUN, model)


def llama3_8b(device: Union[str, torch.device] = "meta", batch_size: int = 2, seq_len: int = 8192) -> tuple:
    """The package's Llama 3 8B, batch 2 x 8192 by default, FSDP as torchtitan 0.3 wraps it."""
    return remat_target("8B", device=device, batch_size=batch_size, seq_len=seq_len)
