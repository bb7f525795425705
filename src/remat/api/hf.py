"""Hugging Face specifics a training step is profiled and run with (Note [Hugging Face]): no KV cache, the model's
own gradient checkpointing taken over; each change said in the plan's notes and undone on failure."""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["prepare_hf_for_training"]


def prepare_hf_for_training(model: nn.Module) -> tuple[tuple[str, ...], Callable[[], None]]:
    """Hugging Face specifics, before profiling (Note [Hugging Face]). Returns notes for the plan and a
    function that puts everything back (called when optimize_checkpointing fails).

    Note [Hugging Face]
    ~~~~~~~~~~~~~~~~~~~
    * ``config.use_cache``: a KV cache built in a checkpointed forward is built again on recompute,
      and training does not need it; remat sets it to False and says so.
    * ``gradient_checkpointing_enable()`` makes each decoder layer checkpoint itself; combined with
      remat's plan, layers would be checkpointed twice. remat takes over: it turns the model's own
      flags off (``gradient_checkpointing_disable()`` does the same) and says so.
    """
    notes: list[str] = []
    undo_steps: list[Callable[[], None]] = []
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if flagged:
        for m in flagged:
            m.gradient_checkpointing = False
        undo_steps.append(lambda: [setattr(m, "gradient_checkpointing", True) for m in flagged])
        notes.append(
            f"took over from the model's own gradient checkpointing (gradient_checkpointing_enable() on "
            f"{len(flagged)} modules): turned off, remat's plan replaces it"
        )
    # every distinct config: encoder-decoder models (T5) give their decoder stack its own copy, whose
    # cache made the cross-attention's recomputation save fewer tensors than its forward
    configs = list({id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)
                    is True}.values())
    if configs:
        for c in configs:
            c.use_cache = False
        undo_steps.append(lambda: [setattr(c, "use_cache", True) for c in configs])
        notes.append("set model.config.use_cache = False" + (f" (and on {len(configs) - 1} sub-configs)"
                     if len(configs) > 1 else "") + ": a KV cache would be rebuilt by every recomputation "
                     "and training does not use it")

    def undo() -> None:
        for step in reversed(undo_steps):
            step()

    return tuple(notes), undo
