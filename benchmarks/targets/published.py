"""remat's memory and step time predicted for GPUs it does not run on, against published measurements (issues
#39 and #40).

torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` (pytorch/torchtitan): Llama 3 8B, FSDP over 8 and
over 128 H100s (96 GB HBM2e), local batch 2 x 8192 tokens, selective op activation checkpointing, AdamW with
gradient clipping at norm 1.0, eager: 82.4 GiB and 67.0 GiB per GPU (``reserved_bytes.all.peak``). Here torchtitan's
own model, op policy, FSDP wrapping, loss and optimizer (``benchmarks/targets/torchtitan_llama3.py``, vendored at the
commit that ran the table) are built on the meta device and their step predicted by remat on this CPU, on fake
tensors at world sizes 8 and 128 (torch's fake process group): nothing is measured here. What torchtitan ran that
the table does not say, and what this script assumes, is printed under the table (``ASSUMPTIONS``).

Step time (issue #40): the same step timed by remat's device model (remat.costs.device_time: a roofline per
operator with efficiencies from torchao's and FlashAttention's published measurements, ring collectives, FSDP2's
prefetch), against torchtitan's 5,762 and 5,605 tokens/s per GPU. No factor was fitted to them. torchtitan says
its part's bf16 peak lies between the H100 SXM's 989.5 and the H100 NVL's 835 TFLOP/s (dense): the table shows the
prediction at both ends. Then remat's own plans for the step without checkpointing, under 70 and 80 GiB,
against torchtitan's op policy and full checkpointing (``--plans``).

    python benchmarks/targets/published.py                 # memory and time, 8 and 128 GPUs (about 25 s a row)
    python benchmarks/targets/published.py --world 8       # one world
    python benchmarks/targets/published.py --plans         # also the plans under 70 and 80 GiB on 8 GPUs (about 7 minutes on 2 cores)
    python benchmarks/targets/published.py --model package --no-time   # the memory from the installed torchtitan's model
                                                               # (benchmarks/targets/torchtitan_package.py; issue #61)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torchtitan_llama3 as tt  # noqa: E402

#: the torch torchtitan's table ran (nightly 1963fc8, before 2.6: benchmarks/targets/torchtitan_llama3.md): its SDPA picked
#: flash attention on the H100, where 2.11 and later pick cuDNN, which torchtitan's op policy does not name (Note
#: [Attention on the target] in remat.target.attention)
TORCH = "2.6"

import remat  # noqa: E402
from remat.costs.allocator import AllocatorConfig, replay  # noqa: E402
from remat.solve import Planner  # noqa: E402
from remat.target import Target  # noqa: E402
from remat.api.predict import modelled_request  # noqa: E402

GiB = 2**30
#: published reserved peaks, GiB (torchtitan's metrics: torch.cuda.memory_stats()["reserved_bytes.all.peak"])
PUBLISHED = {8: 82.4, 128: 67.0}
#: published tokens per second per GPU (the same rows: Tables 1 and 3)
PUBLISHED_TPS = {8: 5762, 128: 5605}
#: the allocator setting each published row is compared under (ASSUMPTIONS): "reserved" (expandable segments) or
#: "native"
HELD_TO = {8: "reserved", 128: "native"}
#: the H100 NVL's dense bf16 FLOP/s (1,671 with sparsity, halved; NVIDIA's H100 datasheet): the low end of the range
#: torchtitan gives for its part's peak
NVL_BF16 = 835.5e12

ASSUMPTIONS = [
    "device: torchtitan's H100 with 96 GB HBM2e (remat's h100-96gb: memory as marketed, 96e9 bytes; only "
    "out-of-memory depends on it)",
    "allocator setting per row (HELD_TO): 8 GPUs with expandable_segments, which torchtitan's single-node launcher "
    "(run_llama_train.sh) sets; 128 GPUs native, the default, since its multi-node launcher sets nothing (what the "
    "cluster's environment set is not published): both columns shown, the row's own marked *",
    "attention: H100 flash attention, as the torch the table ran picks it (Target(torch_version=TORCH)); its CUDA "
    "operator's meta kernel runs on the fake CPU tensors, so the recording keeps what flash keeps and torchtitan's "
    "save list, which names it, is asked about it (Note [Attention on the target])",
    "FSDP root not resharded after forward (the Dec-2024 torch ignored torchtitan's True for the root)",
    "the loss on a float32 copy of the bf16 logits, the logits dropped before backward (torchtitan's del pred)",
    "gradient clipping with foreach=True every step, AdamW foreach (fused=False), as torchtitan's defaults",
    "streams: FSDP2's all-gather and reduce-scatter allocations in pools of their own (as torch 2.13's FSDP2 "
    "allocates them; the Dec-2024 torch allocated the reduce-scatter input on the reduce-scatter stream too)",
    "not counted: the CUDA context, NCCL's own buffers; peak over two steps here, torchtitan's over steps 81-90",
    "time: eager kernels one per operator (no fusion); the 500 W power limit torchtitan states is not modelled "
    "(clocks under it are not published); links: 8 GPUs per node over NVLink 4 (450 GB/s a direction), "
    "400 Gb/s per GPU between nodes (Meta's H100 clusters); MFU by torchtitan's formula (6 x non-embedding "
    "parameters + 12 x layers x heads x head_dim x seq per token) over the bf16 peak used",
]



def predict(world: int, flavor: str = "8B", batch: int = 2, seq: int = 8192) -> dict:
    """The step of torchtitan's model (its own selective checkpointing applied) recorded once on fake tensors in a
    world of ``world`` H100s, the allocator replayed over it with and without expandable segments."""
    started = time.perf_counter()
    model, inputs, loss_fn, parallelize = tt.remat_target(flavor, batch_size=batch, seq_len=seq, selective_ac=True)
    target = Target(device="h100-96gb", world=world, parallelize=parallelize, clip_grad_norm=1.0,
                    torch_version=TORCH)
    req = modelled_request(model, inputs, target, loss_fn=loss_fn, optimizer=tt.build_optimizer(model.model),
                           output_alive=False)
    events = req.source.step_events(req, None)  # the model as it is: torchtitan's checkpointing, no remat plan
    expandable, native = (replay(events, AllocatorConfig(expandable_segments=e)) for e in (True, False))
    return dict(world=world, reserved=expandable.reserved_peak_bytes / GiB, native=native.reserved_peak_bytes / GiB,
                allocated=native.allocated_peak_bytes / GiB, seconds=time.perf_counter() - started,
                rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


def _flops_per_token(model, seq: int) -> float:
    """torchtitan's get_num_flop_per_token: 6 x non-embedding parameters + 12 x layers x heads x head_dim x seq."""
    args = model.model.model_args
    params = sum(p.numel() for p in model.parameters()) - model.model.tok_embeddings.weight.numel()
    return 6 * params + 12 * args.n_layers * args.n_heads * (args.dim // args.n_heads) * seq


def predict_time(world: int, batch: int = 2, seq: int = 8192, peak: float | None = None) -> dict:
    """torchtitan's step (its selective checkpointing applied) timed by remat's device model on ``world`` H100s
    (96 GB), at the device's bf16 peak or ``peak``: tokens/s per GPU and MFU, predicted."""
    started = time.perf_counter()
    model, inputs, loss_fn, parallelize = tt.remat_target("8B", batch_size=batch, seq_len=seq, selective_ac=True)
    device = remat.target.device_spec("h100-96gb")
    if peak is not None:
        device = dataclasses.replace(device, bf16_flops_per_s=peak)
    target = Target(device=device, world=world, parallelize=parallelize, clip_grad_norm=1.0,
                    torch_version=TORCH)
    profile = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=tt.build_optimizer(model.model),
                                 output_alive=False, target=target)
    step = profile.step_time_s
    return dict(world=world, peak=device.bf16_flops_per_s, step=step, forward=profile.forward_s,
                backward=profile.backward_s, optimizer=profile.optimizer_s, tps=profile.tokens_per_step / step,
                mfu=_flops_per_token(model, seq) * profile.tokens_per_step / step / device.bf16_flops_per_s,
                comm=next((n for n in profile.notes if n.startswith("FSDP2's collectives")), ""),
                seconds=time.perf_counter() - started)


def compare_plans(world: int = 8, budgets: tuple[float, ...] = (70.0, 80.0)) -> list[tuple]:
    """On ``world`` H100s (96 GB): torchtitan's op policy, full checkpointing, remat's least-memory plan and
    remat's plan for each budget (the fastest the device model finds whose replayed reserved peak fits), each
    with its predicted reserved peak and tokens/s per GPU."""
    from remat.api.predict import predict_peaks

    rows = []
    sac = predict(world)
    sac_time = predict_time(world)
    rows.append(("torchtitan's op policy (selective)", "every layer, op-level", sac["native"], sac_time["tps"]))
    model, inputs, loss_fn, parallelize = tt.remat_target("8B", selective_ac=False)
    target = Target(device="h100-96gb", world=world, parallelize=parallelize, clip_grad_norm=1.0,
                    torch_version=TORCH)
    opt = tt.build_optimizer(model.model)
    profile = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=opt, output_alive=False, target=target)
    planner = Planner(profile, granularity="op")
    layers = tuple(u.name for u in profile.units if re.fullmatch(r"model\.layers\.\d+", u.name))
    for name, plan in (("full checkpointing", planner.make_plan(layers, "every layer")),
                       ("remat, least memory", planner.least_memory())):
        peaks = predict_peaks(model, inputs, target, loss_fn=loss_fn, optimizer=opt, output_alive=False, plan=plan)
        rows.append((name, f"{len(plan.checkpointed)} units", peaks.reserved_peak_bytes / GiB,
                     plan.predicted_tokens_per_s))
    for b in budgets:
        plan = remat.optimize_checkpointing(model, b, inputs, loss_fn=loss_fn, optimizer=opt, output_alive=False,
                                            target=target)
        selective = sum(1 for u in plan.checkpointed if "@" in u)
        rows.append((f"remat, fastest under {b:.0f} GiB", f"{len(plan.checkpointed)} units ({selective} selective)",
                     plan.predicted_reserved_bytes / GiB, plan.predicted_tokens_per_s))
        remat.remove_checkpointing(model)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, action="append", help="world sizes (default 8 and 128)")
    p.add_argument("--plans", action="store_true", help="also remat's plans under 70 and 80 GiB on 8 GPUs")
    p.add_argument("--no-memory", action="store_true", help="skip the memory table")
    p.add_argument("--no-time", action="store_true", help="skip the time table")
    p.add_argument("--model", choices=("vendored", "package"), default="vendored",
                   help="torchtitan's model as vendored from the table's commit (default) or as the installed "
                        "torchtitan 0.3 builds it (benchmarks/targets/torchtitan_package.py)")
    a = p.parse_args()
    if a.model == "package":
        global tt
        import torchtitan_package as tt
        print("model: the installed torchtitan package's (benchmarks/targets/torchtitan_package.py), not the vendored copy")
    worlds = a.world or [8, 128]
    if not a.no_memory:
        memory_table(worlds)
    if not a.no_time:
        time_table(worlds)
    if a.plans:
        print()
        print("Plans for the step without checkpointing, 8 H100s (96 GB), FSDP, batch 2 x 8192; predicted, not measured")
        print(f"{'plan':<38} | {'checkpointed':<26} | {'reserved GiB':>12} | {'tokens/s/GPU':>12}")
        for name, what, reserved, tps in compare_plans():
            print(f"{name:<38} | {what:<26} | {reserved:>12.1f} | {tps:>12,.0f}")


def time_table(worlds: list[int]) -> None:
    rows = [(predict_time(w), predict_time(w, peak=NVL_BF16)) for w in worlds]
    print()
    print("Llama 3 8B, FSDP, batch 2 x 8192, selective op AC (torchtitan's), eager: tokens/s per GPU")
    print(f"{'GPUs':>5} | {'published':>9} | {'predicted, 989.5 TFLOP/s':>25} | {'predicted, 835.5 TFLOP/s':>25} | "
          f"{'step s':>6} | {'fwd/bwd/opt s':>15} | {'MFU':>5} | {'seconds':>7}")
    for hi, lo in rows:
        pub = PUBLISHED_TPS.get(hi["world"])

        def err(x: float) -> str:
            return f"{x:,.0f} ({(x - pub) / pub:+.1%})" if pub else f"{x:,.0f}"
        print(f"{hi['world']:>5} | {pub if pub else '-':>9,} | {err(hi['tps']):>25} | {err(lo['tps']):>25} | "
              f"{hi['step']:>6.3f} | {hi['forward']:.2f}/{hi['backward']:.2f}/{hi['optimizer']:.3f}"
              f" | {hi['mfu']:>5.1%} | {hi['seconds'] + lo['seconds']:>7.0f}")
        if hi["comm"]:
            print(f"        {hi['comm']}")
    if len(rows) == 2 and all(r[0]["world"] in PUBLISHED_TPS for r in rows):
        pub = PUBLISHED_TPS[rows[1][0]["world"]] / PUBLISHED_TPS[rows[0][0]["world"]] - 1
        pred = rows[1][0]["tps"] / rows[0][0]["tps"] - 1
        print(f"{rows[0][0]['world']} -> {rows[1][0]['world']} GPUs: published {pub:+.1%}, predicted {pred:+.1%}")
    print("predicted on this machine's CPU for the H100 (96 GB), not measured; torchtitan's figures measured on "
          "H100s (their MFU: torchtitan's formula at 989.5 TFLOP/s)")


def memory_table(worlds: list[int]) -> None:
    rows = [predict(w) for w in worlds]
    print("Llama 3 8B, FSDP, batch 2 x 8192, selective op AC (torchtitan's), AdamW, clip 1.0, eager; per GPU, GiB")
    print(f"{'GPUs':>5} | {'published reserved':>18} | {'predicted, expandable':>24} | {'predicted, native':>20} | "
          f"{'predicted allocated':>19} | {'seconds':>7} | {'RSS GiB':>7}")
    for r in rows:
        pub = PUBLISHED.get(r["world"])

        def err(key: str) -> str:
            x = r[key]
            mark = "*" if HELD_TO.get(r["world"]) == key else ""
            return f"{mark}{x:.1f} ({(x - pub) / pub:+.1%})" if pub else f"{x:.1f}"
        print(f"{r['world']:>5} | {pub if pub else '-':>18} | {err('reserved'):>24} | {err('native'):>20} | "
              f"{r['allocated']:>19.1f} | {r['seconds']:>7.0f} | {r['rss']:>7.2f}")
    if len(rows) == 2 and all(r["world"] in PUBLISHED for r in rows):
        a, b = rows
        pub = PUBLISHED[a["world"]] - PUBLISHED[b["world"]]
        held = (HELD_TO.get(a["world"], "native"), HELD_TO.get(b["world"], "native"))
        for ka, kb in dict.fromkeys([held, ("reserved", "reserved"), ("native", "native")]):
            pred = a[ka] - b[kb]
            label = {"reserved": "expandable", "native": "native"}
            mark = "* each row's own setting, " if (ka, kb) == held else ""
            print(f"difference {a['world']} - {b['world']} GPUs: published {pub:.1f}, predicted {pred:.1f} "
                  f"({mark}{a['world']} {label[ka]}, {b['world']} {label[kb]}: {(pred - pub) / pub:+.1%})")
    print("* the setting each row is held to (HELD_TO). Predicted on this machine's CPU for the H100 (96 GB), not "
          "measured; torchtitan's figures measured on H100s. Assumptions:")
    for a in ASSUMPTIONS:
        print(f"  - {a}")


if __name__ == "__main__":
    main()
