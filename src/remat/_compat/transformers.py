"""Hugging Face transformers' private mask helpers remat answers for fake tensors (part of remat._compat: see its
docstring; the one library besides torch and Lightning whose private functions it touches).

Note [Masks decided on values]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers (from 4.53, ``transformers.masking_utils``) decides from the *values* of the batch whether a model's
causal mask can be left to ``scaled_dot_product_attention``'s ``is_causal``: no padding in the attention mask
(``_ignore_causal_mask_sdpa``; ``_ignore_bidirectional_mask_sdpa`` for encoders) and no packed sequences in the
position ids (``find_packed_sequence_indices``). Given a fake tensor (``is_tracing`` counts ``FakeTensor``) it
cannot read them and takes the path that holds for any values: the mask is materialized (batch x 1 x queries x
keys, built from three boolean ones), and with a mask ``sdpa_attention_forward`` repeats the key and value heads
(``repeat_kv``: a copy per group) instead of passing ``enable_gqa``. A real batch without padding or packing takes
the other path: no mask, keys and values as they are. A target's step is recorded on fake tensors (Note [Fake
CUDA on a CPU build] in remat.target.world), so every Hugging Face step planned for a target was recorded on the
path its GPU does not run. Measured on an H200 (2026-12-04, ``../shared/gpu/``; a Llama 3.2 1B-shaped model in
bf16, batch 4 x 2048): per layer the mask (33,554,432 bytes, saved by attention) and the repeated keys and values
(2 x 33,554,432 saved) where the GPU saved the keys and values themselves (2 x 8,388,608): 1,342,177,280 bytes
more at the peak of 16 layers, +3.9% allocated; and, with the whole model checkpointed, the cache laid out so
that one more 4,202,692,608-byte segment was needed (+16.5% reserved).

So while a step is recorded on fake tensors (not while one is compiled or exported: there transformers' own
tracing rules hold), these three helpers are asked about a fake tensor as about the batch the step trains on:
padded or packed as the example inputs show where they hold values (a real ``attention_mask`` with a zero, real
``position_ids`` that restart), else as a batch without padding or packing -- a fixed-length batch, as
pre-training and the planned examples use; a run that pads or packs passes such inputs with values, or its
prediction is low by the mask and the repeated heads. Checked on transformers 5.17 (the H200's) and 5.25; older
releases without ``masking_utils`` do not count fake tensors as tracing and are left as they are.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

#: the helpers answered for fake tensors, by name (Note [Masks decided on values])
_ANSWERED = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


def _masking_utils() -> Any:
    try:
        from transformers import masking_utils
    except Exception:  # noqa: BLE001 - no transformers, or one without masking_utils (< 4.53): nothing to answer
        return None
    return masking_utils


def _has_values(t: Any) -> bool:
    from remat._compat.dispatch import FakeTensor

    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type != "meta"


def batch_layout(example_inputs: Any) -> tuple[bool | None, bool | None]:
    """(padded, packed) of the batch in ``example_inputs`` (``(args, kwargs)`` or a kwargs dict) where its
    ``attention_mask`` / ``position_ids`` hold values: padded when the mask has a zero, packed when transformers
    finds more than one sequence in a row of the position ids; None where they are absent or hold no values (meta,
    fake). Note [Masks decided on values]."""
    kwargs = example_inputs[1] if isinstance(example_inputs, tuple) and len(example_inputs) == 2 \
        and isinstance(example_inputs[1], dict) else example_inputs if isinstance(example_inputs, dict) else {}
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    padded = bool((mask == 0).any()) if _has_values(mask) else None
    packed = None
    mu = _masking_utils()
    if _has_values(positions) and positions.dim() == 2 and mu is not None \
            and hasattr(mu, "find_packed_sequence_indices"):
        packed = getattr(mu.find_packed_sequence_indices, "__wrapped__", mu.find_packed_sequence_indices)(
            positions) is not None
    return padded, packed


@contextlib.contextmanager
def masks_decided_for(padded: bool | None, packed: bool | None) -> Iterator[None]:
    """Within the block, transformers' mask helpers given a fake tensor answer as for a batch ``padded`` /
    ``packed`` (None: not), instead of taking the path of unknown values (Note [Masks decided on values]); on
    real tensors, and while torch compiles or exports, they run as they are. The module's functions are patched
    (transformers calls them by their module-level names) and put back after."""
    mu = _masking_utils()
    names = [n for n in _ANSWERED if mu is not None and callable(getattr(mu, n, None))]
    if not names:
        yield
        return
    from remat._compat.dispatch import FakeTensor

    def answered(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def helper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(tensor, FakeTensor) or torch.compiler.is_compiling():
                return original(tensor, *args, **kwargs)
            if name == "find_packed_sequence_indices":
                return original(tensor, *args, **kwargs) if packed else None
            # a padding mask: with padding the mask stays (the path of unknown values is then the batch's own)
            return original(tensor, *args, **kwargs) if padded else original(None, *args, **kwargs)
        return helper

    saved = {n: getattr(mu, n) for n in names}
    for n in names:
        setattr(mu, n, answered(n, saved[n]))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(mu, n, f)
