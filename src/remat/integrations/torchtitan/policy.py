"""``RematAC``: remat's plan as one of torchtitan 0.3's activation-checkpointing policies (a ``Configurable`` whose
``build(dump_folder=...).apply(model)`` torchtitan's parallelize functions call on the meta model)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.errors import InfeasibleBudgetError, InvalidInputError, PlanMismatchError, RematError, UnsupportedError
from remat.integrations.torchtitan.planning import PlanRequest, TitanRun, without_inits
from remat.solve.plan import Plan, fmt_bytes

from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing  # noqa: E402 (after the check)
from torchtitan.tools.logging import logger

GiB = 2**30

# Note [Plan on the meta model]
# torchtitan calls a policy's apply(model) once, inside its parallelize function, on the model still on the meta
# device: after tensor parallelism, before per-block torch.compile and FSDP2. RematAC plans there, not at the first
# training step:
# - the order is torchtitan's and the one checkpointing needs: checkpoint, then compile each block, then fully_shard
#   (Note [Under torch.compile] in remat.rewrite). A plan made at the first step would checkpoint blocks that are
#   already compiled and sharded: every block recompiled, FSDP2's hooks outside a forward that changed under them;
# - nothing is allocated yet: a budget no plan meets stops the job before the weights exist on any GPU, with the
#   least peak, instead of after an out-of-memory step (planning at the first step needs a plain step to measure,
#   which is the step that does not fit);
# - every rank builds the same meta model, so one plan made from it is every rank's (broadcast from rank 0).
# The price: nothing of the run is measured. The plan is remat's prediction for the target (docs/targets.md): the
# step recorded on fake tensors in the run's world, FSDP2 applied by torchtitan's own apply_fsdp_to_decoder, the
# GPU's allocator replayed and its kernels timed by the device model; every figure it logs says predicted.

# Note [Plan in a process of its own]
# A target's world is modelled on torch's fake process group, which needs a process without a process group, and
# torchtitan has initialized the job's (NCCL, gloo) before it builds the model. So rank 0 plans in a child process
# (python -m remat.integrations.torchtitan.worker: the model's torchtitan config and the run, pickled; the plan or
# the error back as JSON), the other ranks wait in a broadcast of the result over the job's own group, and all raise
# the same error or apply the same plan. The child is given no torchrun variables, so it never joins the job.


class RematAC(ActivationCheckpointing):
    """remat's plan for the run as an activation-checkpointing policy of torchtitan 0.3: what to checkpoint (whole
    blocks, their attention or MLP, op-level selective options) so that one training step holds ``budget_gb`` GiB per
    rank (the whole step: parameters, gradients, optimizer state, activations, the allocator's reserved memory on a
    GPU), planned on the meta model when torchtitan applies the policy (Note [Plan on the meta model]). Make its
    config with :func:`remat.integrations.torchtitan.remat_ac`, which reads the run from a ``Trainer.Config``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        budget_gb: float = 0.0
        """GiB (2**30 bytes) of peak memory per rank during one whole training step; 0 with ``plan_path``."""

        plan_path: str = ""
        """Apply this saved plan instead of planning (its model's parameter names and shapes are checked)."""

        device: str = ""
        """The GPU planned for: a name (``h100-80gb``, ``remat.target.KNOWN``) or a spec file (``remat calibrate``);
        empty: the GPU this rank runs on (``cpu`` on a machine without CUDA)."""

        offload: bool = False
        """Let the plan move activations to host memory where that is cheaper than recomputing them."""

        time_limit_s: float = 60.0
        """The solver's time limit."""

        # the run, as remat_ac reads it from the Trainer.Config (apply(model) is given the model only)
        local_batch_size: int = 0
        seq_len: int = 0
        param_dtype: str = "bfloat16"
        reduce_dtype: str = "float32"
        reshard_after_forward: str = "default"
        loss_chunks: int = 0
        optimizer: str = "AdamW"
        max_norm: float = 1.0
        compiled: bool = False
        other_parallelism: str = ""
        """TP / PP / CP / EP / replicated DP degrees above 1, as "tp=2" (refused: FSDP2 only)."""

    def __init__(self, config: "RematAC.Config", dump_folder: str = "") -> None:
        super().__init__(config, dump_folder=dump_folder)
        self.plan: Plan | None = None

    def apply(self, model: nn.Module) -> None:
        """Plan (or load) and checkpoint ``model`` in place on every rank; raises a RematError before training when
        the budget cannot be met (InfeasibleBudgetError, with the least peak) or the saved plan is another model's."""
        config = self.config
        if config.other_parallelism:
            raise UnsupportedError(
                f"RematAC plans FSDP2 runs only; this run also uses {config.other_parallelism}: plan it with "
                "remat.optimize_checkpointing(target=Target(parallelize=...)), save the plan and give plan_path=")
        if config.plan_path:
            plan = Plan.load(config.plan_path)
            how = f"the saved plan {config.plan_path}"
        else:
            plan = _one_plan_for_every_rank(self._request(model))
            how = "planned for this run"
        check_fingerprint(model, plan, _world())
        from remat.rewrite import checkpoint_plan, remove_checkpointing

        remove_checkpointing(model)
        checkpoint_plan(model, plan)
        self.plan = plan
        _log(plan, how)
        if not config.plan_path and self.dump_folder and _rank() == 0:
            os.makedirs(self.dump_folder, exist_ok=True)
            plan.save(Path(self.dump_folder) / "remat_plan.json")
            logger.info(f"remat: plan saved to {Path(self.dump_folder) / 'remat_plan.json'} (plan_path= applies it)")

    def _request(self, model: nn.Module) -> PlanRequest:
        c = self.config
        if not c.budget_gb > 0:
            raise InvalidInputError(f"RematAC needs budget_gb (GiB per rank, > 0) or plan_path, got budget_gb="
                                    f"{c.budget_gb!r}")
        if c.local_batch_size < 1 or c.seq_len < 1:
            raise InvalidInputError("RematAC.Config needs the run's local_batch_size and seq_len: make it with "
                                    "remat.integrations.torchtitan.remat_ac(trainer_config, budget_gb=...)")
        model_config = getattr(model, "config", None)
        if model_config is None or not hasattr(model_config, "build"):
            raise UnsupportedError(f"RematAC plans torchtitan models built from their config (model.config); "
                                   f"{type(model).__name__} has none")
        world = _world()
        run = TitanRun(local_batch_size=c.local_batch_size, seq_len=c.seq_len, world=world, fsdp=world,
                       param_dtype=c.param_dtype, reduce_dtype=c.reduce_dtype,
                       reshard_after_forward=c.reshard_after_forward, loss_chunks=c.loss_chunks,
                       optimizer=c.optimizer, max_norm=c.max_norm or None, compiled=c.compiled)
        return PlanRequest(run=run, budget_gb=c.budget_gb, device=c.device or _this_device(), offload=c.offload,
                           model_config=without_inits(model_config), time_limit_s=c.time_limit_s)


def _world() -> int:
    return torch.distributed.get_world_size() if _initialized() else 1


def _rank() -> int:
    return torch.distributed.get_rank() if _initialized() else 0


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _this_device() -> Any:
    """The spec of the GPU this rank runs on (its memory as torch reports it), or ``"cpu"`` without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    from remat.target.this_gpu import spec_here

    return spec_here()[0]


def _one_plan_for_every_rank(req: PlanRequest) -> Plan:
    """Rank 0 plans in a child process (Note [Plan in a process of its own]); every rank gets its plan or its error."""
    result = [plan_in_child(req) if _rank() == 0 else None]
    if _initialized() and _world() > 1:
        torch.distributed.broadcast_object_list(result, src=0)
    return from_result(result[0])


def plan_in_child(req: PlanRequest) -> dict:
    """The plan for ``req`` made by ``python -m remat.integrations.torchtitan.worker`` (a dict: the plan's, or the
    error's type, message and numbers)."""
    with tempfile.TemporaryDirectory(prefix="remat-torchtitan-") as tmp:
        given, back = Path(tmp) / "request.pkl", Path(tmp) / "result.json"
        given.write_bytes(pickle.dumps(req))
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
        done = subprocess.run([sys.executable, "-m", "remat.integrations.torchtitan.worker", str(given), str(back)],
                              env=env, capture_output=True, text=True)
        if not back.exists():
            return {"error": "InternalError", "message": f"remat's planning process exited with status "
                    f"{done.returncode} and no result; its output ended:\n{(done.stdout + done.stderr)[-3000:]}"}
        return json.loads(back.read_text())


def from_result(result: dict) -> Plan:
    """The plan of a planning process's result, or its error raised again here (the same type and numbers)."""
    if "plan" in result:
        return Plan.from_dict(result["plan"])
    message = f"remat's torchtitan policy (planned before training; no step ran): {result['message']}"
    if result["error"] == "InfeasibleBudgetError":
        raise InfeasibleBudgetError(message, budget_bytes=result["budget_bytes"],
                                    min_feasible_bytes=result["min_feasible_bytes"])
    import remat.errors as errors

    cls = getattr(errors, result["error"], None)
    if cls is None or not issubclass(cls, RematError):
        cls = errors.RematError
    raise (cls(message, stage="torchtitan") if cls is errors.InternalError else cls(message))


def check_fingerprint(model: nn.Module, plan: Plan, world: int) -> None:
    """Refuse (PlanMismatchError) a plan made for another model (parameter names and shapes), with units this model
    lacks, or for another number of ranks."""
    from remat.api.inputs import model_signature
    from remat.costs.offload import offloaded_module
    from remat.rewrite import check_units

    mine, theirs = dict(model_signature(model)), {n: tuple(s) for n, s in plan.model_signature}
    differ = sorted(n for n in mine.keys() | theirs.keys() if tuple(mine.get(n, ())) != theirs.get(n))
    if differ:
        n = differ[0]
        raise PlanMismatchError(
            f"this plan was made for another model: {len(differ)} parameter(s) differ, e.g. {n}: plan "
            f"{theirs.get(n, 'absent')}, model {tuple(mine[n]) if n in mine else 'absent'}; plan this model (leave "
            "plan_path empty and give budget_gb)")
    ranks = _planned_ranks(plan)
    if ranks is not None and ranks != world:
        raise PlanMismatchError(f"this plan was made for {ranks} rank(s) ({plan.target}), this run has {world}: "
                                "per-rank memory depends on it; plan this run (leave plan_path empty)")
    absent = check_units(model, plan.checkpointed + tuple(offloaded_module(u) for u in plan.offloaded))
    if absent:
        raise PlanMismatchError(f"the plan checkpoints units this model does not have: {absent}")


def _planned_ranks(plan: Plan) -> int | None:
    import re

    found = re.search(r" x (\d+) ranks", plan.target or "")
    return int(found.group(1)) if found else (1 if plan.target else None)


def _log(plan: Plan, how: str) -> None:
    """What was planned, predicted and assumed, through torchtitan's logger."""
    logger.info(f"remat: {how}: checkpointed {len(plan.checkpointed)} unit(s), offloaded {len(plan.offloaded)}: "
                f"{', '.join(plan.checkpointed + plan.offloaded) or 'nothing'}")
    reserved = f", reserved {fmt_bytes(plan.predicted_reserved_bytes)}" if plan.predicted_reserved_bytes else ""
    logger.info(f"remat: predicted peak per rank {fmt_bytes(plan.predicted_peak_bytes)}{reserved} (budget "
                f"{fmt_bytes(plan.budget_bytes)}; no checkpointing {fmt_bytes(plan.baseline_peak_bytes)}, least "
                f"{fmt_bytes(plan.min_peak_bytes)}), step {plan.predicted_step_time_s * 1e3:.1f} ms predicted "
                f"(+{plan.predicted_overhead * 100:.1f}%) on {plan.target or 'this device'}")
    for note in plan.notes:
        logger.info(f"remat: note: {note}")
