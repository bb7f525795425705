"""remat as an activation-checkpointing policy of torchtitan 0.3 (``pip install 'remat[torchtitan]'``).

In a config registry function (torchtitan's ``config_registry.py`` style)::

    from remat.integrations.torchtitan import remat_ac

    def llama3_8b_remat() -> Trainer.Config:
        config = llama3_8b()
        config.activation_checkpoint = remat_ac(config, budget_gb=60)
        return config

torchtitan's ``parallelize_llama`` (and every decoder's parallelize function) then calls the policy's ``apply(model)``
on the meta model, before per-block compile and FSDP2: remat plans the step there for the GPU the rank runs on and the
job's world (Note [Plan on the meta model] in remat.integrations.torchtitan.policy), logs the plan through torchtitan's
logger, saves it in the dump folder, and checkpoints the model in place; a budget no plan meets stops the job before
training with the least peak (InfeasibleBudgetError). ``plan_path=`` applies a saved plan instead. docs/torchtitan.md.
"""

from __future__ import annotations

from typing import Any

from remat.integrations.first_step import missing_framework

try:
    import torchtitan  # noqa: F401
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without torchtitan installed
    raise missing_framework("torchtitan", "torchtitan 0.3 (and triton, which it imports)", e) from e

from remat.integrations.torchtitan.policy import RematAC  # noqa: E402

__all__ = ["RematAC", "remat_ac"]


def remat_ac(trainer_config: Any = None, *, budget_gb: float = 0.0, plan_path: str = "", device: str = "",
             offload: bool = False, **fields: Any) -> "RematAC.Config":
    """A :class:`RematAC` config for the run ``trainer_config`` (torchtitan's ``Trainer.Config``) describes: its local
    batch and sequence length, mixed precision, FSDP resharding, loss (chunked or not), optimizer, gradient clipping,
    compile and other parallelism are read from it (``apply(model)`` is given the model only). ``budget_gb``: GiB per
    rank of the whole step; ``plan_path``: apply a saved plan; ``device``: the GPU planned for (default: the one the
    rank runs on); ``fields`` set any other field of ``RematAC.Config`` (they win over what is read)."""
    read: dict[str, Any] = {}
    if trainer_config is not None:
        training, parallelism = trainer_config.training, trainer_config.parallelism
        read.update(local_batch_size=training.local_batch_size, seq_len=training.seq_len,
                    param_dtype=training.mixed_precision_param, reduce_dtype=training.mixed_precision_reduce,
                    max_norm=float(training.max_norm or 0.0),
                    reshard_after_forward=parallelism.fsdp_reshard_after_forward,
                    compiled=bool(trainer_config.compile.enable and "model" in trainer_config.compile.components))
        others = {"tp": parallelism.tensor_parallel_degree, "pp": parallelism.pipeline_parallel_degree,
                  "cp": parallelism.context_parallel_degree, "ep": parallelism.expert_parallel_degree,
                  "dp_replicate": parallelism.data_parallel_replicate_degree}
        read["other_parallelism"] = ", ".join(f"{k}={v}" for k, v in others.items() if v > 1)
        loss = trainer_config.loss
        read["loss_chunks"] = getattr(loss, "num_chunks", 0) if type(loss).__qualname__.startswith(
            "ChunkedLossWrapper") else 0
        groups = getattr(trainer_config.optimizer, "param_groups", None) or ()
        if groups:
            read["optimizer"] = groups[0].optimizer_name
    return RematAC.Config(budget_gb=budget_gb, plan_path=plan_path, device=device, offload=offload,
                          **{**read, **fields})
