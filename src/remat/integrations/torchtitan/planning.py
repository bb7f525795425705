"""The torchtitan step as remat plans it: one frozen hand-off (:class:`TitanRun`) of what torchtitan built, the step
module (:class:`TitanStep`: the model, its loss, torchtitan's ``del pred``), FSDP2 applied by torchtitan's own
``apply_fsdp_to_decoder`` on torch's fake process group, and :func:`plan_run`, which plans it for the run's GPU and
world in a process without a process group (Note [Plan in a process of its own] in
remat.integrations.torchtitan.policy).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from remat.errors import InternalError, UnsupportedError
from remat.solve.plan import Plan

#: the attention torchtitan's language models run (FlexAttention, varlen) is planned as ``scaled_dot_product_attention``:
#: Note [FlexAttention planned as SDPA]
FLEX_NOTE = ("attention: torchtitan's {kind} planned as causal scaled_dot_product_attention, which on the target runs "
             "the kernel torch picks there (flash or cuDNN on Hopper): the same saved tensors (q, k, v, output, "
             "log-sum-exp) as FlexAttention's; its time is costed as that kernel's")

# Note [FlexAttention planned as SDPA]
# torchtitan 0.3's language models accept only FlexAttention and varlen attention (get_attention_config refuses SDPA),
# and neither runs here: FlexAttention has no backward on a CPU and no fake-tensor path outside torch.compile, varlen
# needs CUDA. Both keep, for backward, what a fused attention kernel keeps: q, k, v, the output and the row log-sum-exp
# (FlexAttention also its BlockMask, a few KiB of block indices). So remat records the step with each layer's
# inner_attention swapped for torchtitan's own ScaledDotProductAttention (causal), as torchtitan's tests do
# (experiments/graph_trainer/common_utils.py), and the target's SDPA kernel (remat.target.attention) stands for the
# GPU's FlexAttention: the memory is the kernel's, the time the attention class's efficiency on that GPU (FlexAttention
# runs at most FlashAttention's rate: the time may be under-predicted, said in the plan's notes). Unit names and
# parameters do not change, so the plan applies to the model that runs FlexAttention.


@dataclasses.dataclass(frozen=True)
class TitanRun:
    """What the plan depends on that torchtitan's ``apply(model)`` does not pass: the run's batch, world and loop,
    read from its ``Trainer.Config`` (:func:`remat.integrations.torchtitan.run_of`). Bytes and GiB as named."""

    local_batch_size: int
    seq_len: int
    #: ranks in the job, of which ``fsdp`` shard parameters (torchtitan's ``dp_shard``); TP / PP / CP are refused
    world: int = 1
    fsdp: int = 1
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    reshard_after_forward: str = "default"
    #: torchtitan's ChunkedLossWrapper's ``num_chunks`` (0: the loss on the whole logits)
    loss_chunks: int = 0
    optimizer: str = "AdamW"
    optimizer_kwargs: tuple[tuple[str, Any], ...] = (("lr", 8e-4), ("betas", (0.9, 0.95)), ("eps", 1e-8),
                                                     ("weight_decay", 0.1))
    max_norm: float | None = 1.0
    #: torchtitan compiles each block after checkpointing (``compile.enable`` with "model"): planned eager, said
    compiled: bool = False


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """One planning job: the run, the budget (GiB per rank, the whole step), the device (a name, a spec file's path
    or a :class:`remat.target.DeviceSpec`), offloading allowed, and the model's torchtitan config to build it from."""

    run: TitanRun
    budget_gb: float
    device: Any
    offload: bool
    model_config: Any
    time_limit_s: float = 60.0


class TitanStep(nn.Module):
    """torchtitan's forward and loss as one module: ``pred = model(tokens)``, the sum cross-entropy over the float32
    logits divided by the tokens, ``del pred`` (the logits are not kept past the loss). With ``loss_chunks`` the
    ChunkedLossWrapper's step: the decoder's hidden states, then ``lm_head`` and the loss one chunk of the sequence at a
    time, each chunk's logits recomputed in backward (torchtitan runs each chunk's backward at once: the same one
    chunk of logits alive, the head run once more here)."""

    def __init__(self, model: nn.Module, loss_chunks: int = 0) -> None:
        super().__init__()
        self.model = model
        self.loss_chunks = loss_chunks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        labels = torch.zeros(tokens.shape, dtype=torch.long, device=tokens.device)
        if not self.loss_chunks:
            pred = self.model(tokens)
            loss = nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
            del pred
            return loss / tokens.numel()
        self.model._skip_lm_head = True
        try:
            hidden = self.model(tokens)
        finally:
            self.model._skip_lm_head = False
        head = self.model.lm_head
        loss = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden.chunk(self.loss_chunks, dim=1), labels.chunk(self.loss_chunks, dim=1)):
            loss = loss + torch.utils.checkpoint.checkpoint(
                lambda h, y: nn.functional.cross_entropy(head(h).flatten(0, 1).float(), y.flatten(0, 1),
                                                         reduction="sum"), h, y, use_reentrant=False)
        return loss / tokens.numel()


def sdpa_config(model_config: Any) -> tuple[Any, str]:
    """A copy of a torchtitan decoder config whose layers run torchtitan's ScaledDotProductAttention (Note
    [FlexAttention planned as SDPA]) and the name of the attention it replaced ("" when it ran SDPA already)."""
    import copy

    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = copy.deepcopy(model_config)
    kinds = set()
    for layer in getattr(config, "layers", ()):
        inner = layer.attention.inner_attention
        if not isinstance(inner, ScaledDotProductAttention.Config):
            kinds.add(type(inner).__qualname__.split(".")[0])
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config, ", ".join(sorted(kinds))


def without_inits(model_config: Any) -> Any:
    """A copy of a torchtitan config without its parameters' initialisers (``param_init``: closures that do not
    pickle), which a model built on the meta device to be planned never calls."""
    import copy

    def strip(value: Any) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                if f.name == "param_init":
                    setattr(value, f.name, None)
                else:
                    strip(getattr(value, f.name))
        elif isinstance(value, (list, tuple)):
            for v in value:
                strip(v)
        elif isinstance(value, dict):
            for v in value.values():
                strip(v)

    config = copy.deepcopy(model_config)
    strip(config)
    return config


def fsdp_as_torchtitan(run: TitanRun):
    """``parallelize(step, mesh)`` for :class:`remat.Target`: torchtitan's own ``apply_fsdp_to_decoder`` on the
    step's model, with the run's mixed precision and resharding, on the fake world's ``dp`` mesh."""
    def parallelize(step: nn.Module, mesh: Any) -> None:
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        apply_fsdp_to_decoder(step.model, mesh, param_dtype=TORCH_DTYPE_MAP[run.param_dtype],
                              reduce_dtype=TORCH_DTYPE_MAP[run.reduce_dtype], pp_enabled=False,
                              reshard_after_forward_policy=run.reshard_after_forward)

    parallelize.__qualname__ = "torchtitan's apply_fsdp_to_decoder"
    return parallelize


def optimizer_for(run: TitanRun, model: nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer over ``model``'s parameters, for its state's bytes (remat never steps it)."""
    cls = getattr(torch.optim, run.optimizer, None)
    if cls is None:
        raise UnsupportedError(f"torchtitan's optimizer {run.optimizer!r} is not a torch.optim class remat can "
                               "predict; plan with AdamW or Adam, or apply a saved plan (plan_path=)")
    return cls(model.parameters(), **dict(run.optimizer_kwargs), foreach=True)


def plan_run(req: PlanRequest) -> Plan:
    """Plan the run's step for ``req.budget_gb`` GiB per rank on its device and world (every figure predicted), in
    this process: it must have no process group (Note [Plan in a process of its own]). Raises
    InfeasibleBudgetError with the least peak when no plan fits."""
    from remat.api.optimize import optimize_checkpointing
    from remat.target import Target

    run = req.run
    if run.world != run.fsdp:
        raise UnsupportedError(
            f"this torchtitan run has {run.world} ranks of which {run.fsdp} shard with FSDP: remat's torchtitan policy "
            "plans FSDP2 only (no tensor, pipeline, context or expert parallelism, no replicated data parallelism); "
            "plan with remat.optimize_checkpointing(target=Target(parallelize=...)) and apply the plan (plan_path=)")
    config, replaced = sdpa_config(req.model_config)
    with torch.device("meta"):
        model = config.build()
    step = TitanStep(model, run.loss_chunks)
    tokens = torch.zeros(run.local_batch_size, run.seq_len, dtype=torch.long, device="meta")
    target = Target(device=req.device, world=run.world, fsdp=run.fsdp, parallelize=fsdp_as_torchtitan(run),
                    clip_grad_norm=run.max_norm)
    plan = optimize_checkpointing(step, req.budget_gb, (tokens,), loss_fn=lambda loss: loss,
                                 optimizer=optimizer_for(run, model), output_alive=False, target=target,
                                 offload=req.offload, time_limit_s=req.time_limit_s)
    notes = (FLEX_NOTE.format(kind=replaced),) if replaced else ()
    if run.loss_chunks:
        notes += (f"loss: torchtitan's ChunkedLossWrapper ({run.loss_chunks} chunks) planned as the head and loss "
                  "checkpointed per chunk (one chunk of logits alive at a time, the head's forward once more)",)
    if run.compiled:
        notes += ("torchtitan compiles each block after checkpointing: the peaks and times are the eager step's "
                  "(a compiled step is not modelled for a target)",)
    return dataclasses.replace(unprefixed(plan, "model."), notes=plan.notes + notes)


def unprefixed(plan: Plan, prefix: str) -> Plan:
    """``plan`` with every unit name (checkpointed, offloaded, policies, nesting, buffers, the signature) of the
    step's ``model`` submodule named as in the model itself."""
    def name(n: str) -> str:
        if not n.startswith(prefix):
            raise InternalError(f"the plan of torchtitan's step names {n!r}, outside its model: only the model's "
                                "units are candidates", stage="torchtitan")
        return n[len(prefix):]

    def keys(d: dict) -> dict:
        return {name(k): v for k, v in d.items()}

    return dataclasses.replace(
        plan, checkpointed=tuple(map(name, plan.checkpointed)), offloaded=tuple(map(name, plan.offloaded)),
        saved_ops=keys(plan.saved_ops), offloaded_ops=keys(plan.offloaded_ops),
        offload_ahead={name(k): name(v) for k, v in plan.offload_ahead.items()},
        nested_in={name(k): name(v) for k, v in plan.nested_in.items()},
        mutated_buffers={name(k): tuple(re.sub(f"^{re.escape(prefix)}", "", b) for b in v)
                         for k, v in plan.mutated_buffers.items()},
        model_signature=tuple((name(n), s) for n, s in plan.model_signature if n.startswith(prefix)))
