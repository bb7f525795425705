"""remat's memory predicted for GPUs it does not run on, against published measurements (issue #39).

torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` (pytorch/torchtitan): Llama 3 8B, FSDP over 8 and
over 128 H100s (96 GB HBM2e), local batch 2 x 8192 tokens, selective op activation checkpointing, AdamW with
gradient clipping at norm 1.0, eager: 82.4 GiB and 67.0 GiB per GPU (``reserved_bytes.all.peak``). Here torchtitan's
own model, op policy, FSDP wrapping, loss and optimizer (``benchmarks/torchtitan_llama3.py``, vendored at the
commit that ran the table) are built on the meta device and their step predicted by remat on this CPU, on fake
tensors at world sizes 8 and 128 (torch's fake process group): nothing is measured here. What torchtitan ran that
the table does not say, and what this script assumes, is printed under the table (``ASSUMPTIONS``).

    python benchmarks/published.py            # both rows (about a minute each on 2 cores)
    python benchmarks/published.py --world 8  # one row
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torchtitan_llama3 as tt  # noqa: E402

from remat.costs.allocator import AllocatorConfig, replay  # noqa: E402
from remat.target import Target  # noqa: E402
from remat.target.source import modelled_request  # noqa: E402

GiB = 2**30
#: published reserved peaks, GiB (torchtitan's metrics: torch.cuda.memory_stats()["reserved_bytes.all.peak"])
PUBLISHED = {8: 82.4, 128: 67.0}

ASSUMPTIONS = [
    "device: torchtitan's H100 with 96 GB HBM2e (remat's h100-96gb: memory as marketed, 96e9 bytes; only "
    "out-of-memory depends on it)",
    "expandable_segments: torchtitan's run_llama_train.sh sets it for single-node runs, its multi-node launcher "
    "does not: both columns shown",
    "attention: H100 flash attention; on fake CPU tensors the CPU flash kernel stands in, added to torchtitan's "
    "save list (it saves the same output and float32 log-sum-exp rows; Note [Target kernels])",
    "FSDP root not resharded after forward (the Dec-2024 torch ignored torchtitan's True for the root)",
    "the loss on a float32 copy of the bf16 logits, the logits dropped before backward (torchtitan's del pred)",
    "gradient clipping with foreach=True every step, AdamW foreach (fused=False), as torchtitan's defaults",
    "streams: FSDP2's all-gather and reduce-scatter allocations in pools of their own (as torch 2.13's FSDP2 "
    "allocates them; the Dec-2024 torch allocated the reduce-scatter input on the reduce-scatter stream too)",
    "not counted: the CUDA context, NCCL's own buffers; peak over two steps here, torchtitan's over steps 81-90",
]


def predict(world: int, flavor: str = "8B", batch: int = 2, seq: int = 8192) -> dict:
    """The step of torchtitan's model (its own selective checkpointing applied) recorded once on fake tensors in a
    world of ``world`` H100s, the allocator replayed over it with and without expandable segments."""
    started = time.perf_counter()
    model, inputs, loss_fn, parallelize = tt.remat_target(flavor, batch_size=batch, seq_len=seq, selective_ac=True)
    target = Target(device="h100-96gb", world=world, parallelize=parallelize, clip_grad_norm=1.0)
    req = modelled_request(model, inputs, target, loss_fn=loss_fn, optimizer=tt.build_optimizer(model.model),
                           output_alive=False)
    events = req.source.step_events(req, None)  # the model as it is: torchtitan's checkpointing, no remat plan
    expandable, native = (replay(events, AllocatorConfig(expandable_segments=e)) for e in (True, False))
    return dict(world=world, reserved=expandable.reserved_peak_bytes / GiB, native=native.reserved_peak_bytes / GiB,
                allocated=native.allocated_peak_bytes / GiB, seconds=time.perf_counter() - started,
                rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, action="append", help="world sizes (default 8 and 128)")
    worlds = p.parse_args().world or [8, 128]
    rows = [predict(w) for w in worlds]
    print("Llama 3 8B, FSDP, batch 2 x 8192, selective op AC (torchtitan's), AdamW, clip 1.0, eager; per GPU, GiB")
    print(f"{'GPUs':>5} | {'published reserved':>18} | {'predicted, expandable':>24} | {'predicted, native':>20} | "
          f"{'predicted allocated':>19} | {'seconds':>7} | {'RSS GiB':>7}")
    for r in rows:
        pub = PUBLISHED.get(r["world"])

        def err(x: float) -> str:
            return f"{x:.1f} ({(x - pub) / pub:+.1%})" if pub else f"{x:.1f}"
        print(f"{r['world']:>5} | {pub if pub else '-':>18} | {err(r['reserved']):>24} | {err(r['native']):>20} | "
              f"{r['allocated']:>19.1f} | {r['seconds']:>7.0f} | {r['rss']:>7.2f}")
    if len(rows) == 2 and all(r["world"] in PUBLISHED for r in rows):
        pub = PUBLISHED[rows[0]["world"]] - PUBLISHED[rows[1]["world"]]
        for key, label in (("reserved", "expandable"), ("native", "native")):
            pred = rows[0][key] - rows[1][key]
            print(f"difference {rows[0]['world']} - {rows[1]['world']} GPUs: published {pub:.1f}, predicted {pred:.1f} "
                  f"({label}, {(pred - pub) / pub:+.1%})")
    print("predicted on this machine's CPU for the H100 (96 GB), not measured; torchtitan's figures measured on "
          "H100s. Assumptions:")
    for a in ASSUMPTIONS:
        print(f"  - {a}")


if __name__ == "__main__":
    main()
