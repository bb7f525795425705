"""A torchtitan job on CPU gloo ranks, as a user's config registry function makes it: torchtitan's own
``parallelize_llama`` on its Llama 3 debug model with each policy (none, ``FullAC``, remat's ``RematAC``), one
training step of torchtitan's loss (``del pred``), AdamW and clipping; the loss, every gradient (gathered) and, for
remat, the measured peak of the second step. Each layer's attention is swapped for torchtitan's SDPA, as torchtitan's
own tests do (FlexAttention has no backward on a CPU). Run on 1 and 2 ranks by tests/slow/test_torchtitan_policy.py
through torch.multiprocessing.spawn; tests/integration/test_torchtitan.py reads its config function."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import torch

BATCH, SEQ = 4, 512
#: GiB: the issue's 307 MiB, between the least peak (about 194 MiB predicted) and none (about 439 MiB) at 1 rank
BUDGET_GB = 0.3
#: below the least peak any plan reaches
REFUSED_GB = 0.1


def llama3_debugmodel_remat(budget_gb: float = BUDGET_GB):
    """A torchtitan user's config registry function selecting remat's policy (docs/torchtitan.md): torchtitan's
    debug model with its plain cross-entropy loss, 4 x 512 tokens, float32 (a CPU)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

    from remat.integrations.torchtitan import remat_ac

    config = llama3_debugmodel_ce_loss()
    config.training.local_batch_size, config.training.seq_len = BATCH, SEQ
    config.training.mixed_precision_param = "float32"
    # torchtitan 0.3's default spmd_types backend keeps parameters plain, which torch 2.13's fully_shard refuses over 2
    # ranks ("When dp_mesh_dims is provided, all parameters must be DTensors"): the DTensor backend, as before 0.3
    config.parallelism.spmd_backend = "partial_dtensor"
    config.activation_checkpoint = remat_ac(config, budget_gb=budget_gb)
    return config


def _model_config(config):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    model_config = config.model_spec.model
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_config.update_from_config(config=config)  # as torchtitan's Trainer does: its sharding for the SPMD mesh
    return model_config


def _step(model, loss_fn, tokens, labels):
    pred = model(tokens)
    loss, _ = loss_fn(pred, labels, torch.tensor(float(labels.numel() * _world())))
    del pred
    loss.backward()
    return loss


def _world() -> int:
    return torch.distributed.get_world_size()


def run_variant(name: str, out: Path) -> dict:
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.llama3 import parallelize_llama

    from remat.runtime.meters import StepMeter
    from remat.errors import RematError

    parallel_dims_module.device_type = "cpu"  # torchtitan assumes CUDA where no accelerator is found
    config = llama3_debugmodel_remat(REFUSED_GB if name == "refused" else BUDGET_GB)
    ac = {"none": None, "full": FullAC.Config()}.get(name, config.activation_checkpoint)
    parallel_dims = ParallelDims.from_config(config.parallelism, _world())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _model_config(config).build()
    result: dict = {"materialized": False}
    try:
        model = parallelize_llama(model, parallel_dims=parallel_dims, training=config.training,
                                  parallelism=config.parallelism, compile_config=config.compile, ac_config=ac,
                                  dump_folder=str(out / f"dump-{name}"))
    except RematError as e:
        return {**result, "error": type(e).__name__, "message": str(e),
                "min_feasible_bytes": getattr(e, "min_feasible_bytes", None)}
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # gloo has no PREMUL_SUM, which FSDP2 uses for apply_fsdp_to_decoder's divide factor 1
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build()
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=g)
    tokens, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)

    loss = _step(model, loss_fn, tokens, labels)
    # (FullAC's checkpoint_wrapper renames its blocks' parameters: named as in the plain model)
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in model.named_parameters()}
    result.update(materialized=True, loss=loss.item())
    torch.save({n: g.clone() for n, g in grads.items()}, out / f"grads-{name}-rank{torch.distributed.get_rank()}.pt")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = [*model.parameters(), *model.buffers(), tokens, labels,
             *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    meter = StepMeter(torch.device("cpu"))
    meter.start(state)
    _step(model, loss_fn, tokens, labels)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    result["measured_peak_bytes"] = meter.stop()
    policy_plan = Path(out / f"dump-{name}" / "remat_plan.json")
    if policy_plan.exists():
        plan = json.loads(policy_plan.read_text())
        result.update(plan_checkpointed=plan["checkpointed"], predicted_peak_bytes=plan["predicted_peak_bytes"],
                      budget_bytes=plan["budget_bytes"])
    return result


def run(rank: int, world: int, port: int, out_dir: str, variants: tuple[str, ...]) -> None:
    """Each variant in turn on this rank; its results written before the process group is destroyed, and each stage
    reached appended to ``rank{rank}.progress`` (a rank that dies says where: :func:`progress`)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out = Path(out_dir)
    reached = out / f"rank{rank}.progress"

    def stage(what: str) -> None:
        with reached.open("a") as f:
            f.write(what + "\n")

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    try:
        for v in variants:
            stage(f"started {v}")
            results[v] = run_variant(v, out)
            # the variant's model, its meshes and FSDP2's state freed now, while every rank's groups are alive (left
            # to the interpreter's exit, gloo's threads may drop a work's tensors after Python is gone: SIGABRT,
            # pytorch/pytorch#179291)
            gc.collect()
            stage(f"finished {v}")
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        torch.distributed.barrier()  # no rank tears its groups down while another still uses them
        stage("results written, every rank done")
    finally:
        torch.distributed.destroy_process_group()
    stage("process group destroyed")


def progress(out: Path, world: int) -> str:
    """The stages each rank of a job in ``out`` reached (:func:`run`), for a test whose job died."""
    def of(rank: int) -> str:
        f = out / f"rank{rank}.progress"
        return ", ".join(f.read_text().split("\n")[:-1]) if f.exists() else "nothing"
    return "; ".join(f"rank {r}: {of(r)}" for r in range(world))
