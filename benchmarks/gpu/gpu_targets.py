"""Command-line targets for the GPU checks (benchmarks/gpu/gpu_acceptance.sh; issue #55).

    remat accuracy benchmarks/gpu/gpu_targets.py:llama1b --output-dropped
    remat accuracy benchmarks/gpu/gpu_targets.py:llama_tiny --device h100-80gb --measure-on cpu   # (a CPU smoke test)

``llama1b``: a Hugging Face Llama with Llama 3.2 1B's shape (16 layers, width 2048, 8 KV heads, vocabulary
128,256, tied embeddings), built in bfloat16 with ``sdpa`` attention, a batch of 4 x 2048 token ids with
``labels=input_ids`` and Hugging Face's own loss: the step of ``benchmarks/h200/gpu_models.py``'s
``llama1b``, built by it (AdamW is the command line's default optimizer; that loop keeps only the loss: ``--output-dropped``).
``llama_tiny``: the same code at 2 layers, width 64, vocabulary 1,000, for checks on a CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "h200"))
import gpu_models  # noqa: E402 - the steps the H200 ran (benchmarks/h200/gpu_models.py)


def _llama(device, batch_size: int, seq_len: int, tiny: bool):
    c = gpu_models.llama1b_step(str(device), batch_size, seq_len, tiny=tiny)
    return c["model"], c["inputs"], c["loss_fn"]


def llama1b(device="cpu", batch_size: int = 4, seq_len: int = 2048):
    """Llama 3.2 1B's shape in bfloat16, batch ``batch_size`` x ``seq_len`` (default 4 x 2048)."""
    return _llama(device, batch_size, seq_len, tiny=False)


def llama_tiny(device="cpu", batch_size: int = 2, seq_len: int = 64):
    """The same model at 2 layers, width 64 (a check of the scripts on a CPU)."""
    return _llama(device, batch_size, seq_len, tiny=True)
