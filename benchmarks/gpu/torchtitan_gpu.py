"""Issue #61's GPU check, for benchmarks/gpu/gpu_acceptance.sh's ``torchtitan`` part (not run yet: no GPU in the session
that wrote it). One CUDA GPU, one NCCL rank: torchtitan's own ``parallelize_llama`` on its Llama 3 debug model with
FlexAttention as torchtitan runs it (no SDPA swap: remat plans it as SDPA, Note [FlexAttention planned as SDPA]),
bf16 parameters, torchtitan's plain cross-entropy, AdamW and clipping; remat's policy (``RematAC``) at ``--budget``,
then ``--steps`` real steps. Prints the plan's predicted reserved peak, the measured ``reserved_bytes.all.peak`` and
``allocated_bytes.all.peak`` of steps 2..N, and whether the budget held; writes them to ``--json``. Exit 1 when the
measured reserved peak is over the budget.

    python benchmarks/gpu/torchtitan_gpu.py --budget 2.0 --json torchtitan_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

GiB = 2**30


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=2.0, help="GiB per rank, the whole step (default 2.0)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("torchtitan_gpu.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

    from remat.integrations.torchtitan import remat_ac

    config = llama3_debugmodel_ce_loss()
    config.training.local_batch_size, config.training.seq_len = a.batch, a.seq
    config.activation_checkpoint = remat_ac(config, budget_gb=a.budget)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model = parallelize_llama(model, parallel_dims=ParallelDims.from_config(config.parallelism, 1),
                              training=config.training, parallelism=config.parallelism,
                              compile_config=config.compile, ac_config=config.activation_checkpoint,
                              dump_folder="torchtitan-gpu-dump")
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    plan = json.loads(Path("torchtitan-gpu-dump/remat_plan.json").read_text())
    loss_fn = config.loss.build()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    tokens = torch.randint(0, 2048, (a.batch, a.seq + 1), device="cuda")
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses = []
    for step in range(a.steps):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        pred = model(inputs)
        loss, _ = loss_fn(pred, labels, torch.tensor(float(labels.numel()), device="cuda"))
        del pred
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    stats = torch.cuda.memory_stats()
    row = dict(budget_bytes=int(a.budget * GiB), checkpointed=plan["checkpointed"],
               predicted_reserved_bytes=plan["predicted_reserved_bytes"],
               predicted_peak_bytes=plan["predicted_peak_bytes"],
               measured_reserved_bytes=stats["reserved_bytes.all.peak"],
               measured_allocated_bytes=stats["allocated_bytes.all.peak"], losses=losses,
               device=torch.cuda.get_device_name())
    print(f"{row['device']}: budget {a.budget:.2f} GiB; predicted reserved {row['predicted_reserved_bytes'] / GiB:.3f} "
          f"GiB, measured reserved {row['measured_reserved_bytes'] / GiB:.3f} GiB (allocated predicted "
          f"{row['predicted_peak_bytes'] / GiB:.3f}, measured {row['measured_allocated_bytes'] / GiB:.3f}); "
          f"checkpointed {len(row['checkpointed'])} units; losses {losses}")
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=2))
    torch.distributed.destroy_process_group()
    return 0 if row["measured_reserved_bytes"] <= row["budget_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
