"""Where the time of a training step went on the H200 (issue #56): the Chrome traces torch.profiler wrote of one
step (``data/*.trace.json.gz``, copied from ``../shared/gpu/h200-2026-12-04``, made by the shared oracle's
``gpu_profile_steps.py``; read by remat.target.host_trace through ``h200_data.py``:
torch 2.11, one step after two warm-up steps, CPU and CUDA activities), read into tables:

* GPU time and kernel count per kernel class (matrix products, attention forward / backward, elementwise,
  reductions, the optimizer's foreach kernels, copies, NCCL), and per phase (forward, backward, optimizer);
* per phase: the host's wall time, the GPU's busy time (the union of its kernels) and its span: which one set
  the phase;
* the host's cost per operator: top-level ATen operators (median by kind), ``cudaLaunchKernel``, and
  ``PythonDispatchMode`` (selective checkpointing's dispatch mode) per call, its own time beyond the operator it
  wraps;
* achieved rates: the matrix products' TFLOP/s from the model's shapes (``llama1b``: Llama 3.2 1B's widths, batch
  4 x 2048, bf16), an elementwise product's bandwidth; ``--calibrate``: each operator class's, from the work the
  model counts for the recorded step.

    python benchmarks/h200/gpu_traces.py [TRACE_DIR]   # default data/ beside it (GPU_DATA: another copy)
    python benchmarks/h200/gpu_traces.py --calibrate   # the device table's H200 efficiencies (records llama1b: ~30 s)
    python benchmarks/h200/gpu_traces.py --host [--write]   # the H200 host's figures (GPU_HOST) and their check;
                                                       # --write: their inputs to data/host_inputs.json

Phases: forward is the main thread up to the first event of autograd's thread, backward is autograd's thread
(its first to last event), optimizer the ``Optimizer.step`` annotation (with ``zero_grad`` and anything after it
on the main thread). A kernel belongs to the phase in which the host launched it (``correlation``).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from h200_data import DATA as DEFAULT_DIR, shared_models  # noqa: E402

from remat.target.host_trace import TraceEvents  # noqa: E402
TRACES = ("llama1b__1", "llama1b__4", "titan4_off__0")
ABOUT = {"llama1b__1": "llama1b, every block checkpointed", "llama1b__4": "llama1b, 16 selective units (@ops)",
         "titan4_off__0": "titan4, one layer offloaded (plan applied on meta: pageable copies)"}

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync",
            "cudaMemsetAsync")


def kernel_class(event: dict) -> str:
    """The class of one GPU activity, from the kernel's name."""
    name, cat = event["name"], event.get("cat")
    if cat == "gpu_memcpy":
        return "copy (memcpy " + name.split(" ")[1] + ")"
    if cat == "gpu_memset":
        return "copy (memset)"
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "sdpa" in low or "flash" in low or "fmha" in low or "cudnn::fusion" in low:
        return "attention bwd" if ("bprop" in low or "dot_do_o" in low or "dq_to" in low) else "attention fwd"
    if low.startswith("nvjet") or "gemm" in low or "cutlass" in low or "cublas" in low:
        return "matmul"
    if "multi_tensor_apply" in low or "lpnorm_cleanup" in low:
        return "optimizer foreach"
    if "copy_kernel" in low or "catarraybatchedcopy" in low or "chunk_cat" in low:
        return "copy (kernel)"
    if "reduce_kernel" in low or "softmax" in low or "nll_loss" in low or "norm" in low:
        return "reduction"
    if "elementwise" in low or "index" in low or "gather" in low or "scatter" in low:
        return "elementwise"
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def span_us(t: TraceEvents) -> float:
    """The traced span (the profiler's "Trace" event), µs."""
    return next(e["dur"] for e in t.events if e.get("cat") == "Trace")


def gpu_by_phase(t: TraceEvents) -> dict[str, list[dict]]:
    """Each GPU activity with the phase its launch was in."""
    ph = t.phases()
    launch = {e["args"]["correlation"]: e for e in t.of("cuda_runtime", "cuda_driver") if "correlation" in e.get("args", {})}
    out: dict[str, list[dict]] = defaultdict(list)
    for k in t.of(*GPU_CATS):
        l = launch.get(k["args"].get("correlation"))
        out[t.phase_of(l["ts"], l["tid"], ph) if l else "unknown"].append(k)
    return out


def top_level_ops(t: TraceEvents, prefix: str = "aten::") -> list[dict]:
    """ATen operators not inside another ATen operator on the same thread (what Python or autograd called)."""
    out = []
    by_tid = defaultdict(list)
    for e in t.of("cpu_op"):
        if e["name"].startswith(prefix):
            by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        end = -1.0
        for e in evs:
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


def dispatch_mode(t: TraceEvents) -> tuple[int, float, float, float]:
    """PythonDispatchMode: (calls, total µs, median µs per call, median µs per call beyond the ATen operators
    inside it)."""
    modes = [e for e in t.of("cpu_op", "user_annotation") if "PythonDispatchMode" in e["name"]]
    if not modes:
        return 0, 0.0, 0.0, 0.0
    aten = defaultdict(list)
    for e in t.of("cpu_op"):
        if e["name"].startswith("aten::"):
            aten[e["tid"]].append(e)
    for v in aten.values():
        v.sort(key=lambda e: e["ts"])
    own = []
    import bisect
    for m in modes:
        evs = aten[m["tid"]]
        i = bisect.bisect_left([e["ts"] for e in evs], m["ts"]) if len(evs) < 50000 else 0
        inner, end = 0.0, -1.0
        for e in evs[i:]:
            if e["ts"] > m["ts"] + m["dur"]:
                break
            if e["ts"] >= end and e["ts"] + e["dur"] <= m["ts"] + m["dur"] + 1e-3:
                inner += e["dur"]
                end = e["ts"] + e["dur"]
        own.append(m["dur"] - inner)
    durs = [m["dur"] for m in modes]
    return len(modes), sum(durs), statistics.median(durs), statistics.median(own)


# -- llama1b's shapes (gpu_models.py): what a kernel's work is ----------------------------------------------------
TOKENS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 4 * 2048, 2048, 8192, 32, 8, 64, 16, 128256


def gemm_flops_llama1b() -> dict[str, float]:
    """FLOPs of the matrix products of one plain step (forward, backward's two products each) and per
    recomputed layer: per layer q (2048 x 2048), k, v (2048 x 512), o (2048 x 2048), gate, up (2048 x 8192),
    down (8192 x 2048); the tied head (2048 x 128256)."""
    per_layer = 2 * TOKENS * (HIDDEN * HIDDEN * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2 + 3 * HIDDEN * FFN)
    head = 2 * TOKENS * HIDDEN * VOCAB
    return {"layer_forward": per_layer, "head_forward": head, "down": 2 * TOKENS * FFN * HIDDEN}


def rows(t: TraceEvents) -> None:
    by_phase = gpu_by_phase(t)
    ph = t.phases()
    print(f"\n## {t.name}: {ABOUT.get(t.name, '')}; traced span {span_us(t) / 1e3:.1f} ms")
    # -- kernel classes -----------------------------------------------------------------------------------------
    cls_t: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    cls_ph: dict[tuple[str, str], float] = defaultdict(float)
    for p, ks in by_phase.items():
        for k in ks:
            c = kernel_class(k)
            cls_t[c][0] += 1
            cls_t[c][1] += k["dur"]
            cls_ph[c, p] += k["dur"]
    names = [p for p in ("forward", "backward", "optimizer", "unknown") if p in by_phase]
    print("\n| kernel class | kernels | GPU ms | " + " | ".join(f"{p} ms" for p in names) + " |")
    print("|---|---:|---:|" + "---:|" * len(names))
    for c, (n, us) in sorted(cls_t.items(), key=lambda x: -x[1][1]):
        print(f"| {c} | {n} | {us / 1e3:.2f} | " + " | ".join(f"{cls_ph[c, p] / 1e3:.2f}" for p in names) + " |")
    total = sum(v[1] for v in cls_t.values())
    print(f"| all | {sum(v[0] for v in cls_t.values())} | {total / 1e3:.2f} | "
          + " | ".join(f"{sum(k['dur'] for k in by_phase[p]) / 1e3:.2f}" for p in names) + " |")
    # -- phases: host vs GPU ------------------------------------------------------------------------------------
    ops = top_level_ops(t)
    launches = [e for e in t.of("cuda_runtime", "cuda_driver") if e["name"] in LAUNCHES]
    syncs = [e for e in t.of("cuda_runtime") if "Synchronize" in e["name"]]
    print("\n| phase | host wall ms | of it in synchronize ms | top-level ATen ops | launches | host µs / top-level op "
          "| GPU busy ms | GPU span ms | GPU idle in span ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    all_busy = []
    for p in names:
        if p == "unknown":
            continue
        s, e = ph[p]
        inside = (lambda ev: (s <= ev["ts"] < e) and t.phase_of(ev["ts"], ev["tid"], ph) == p)
        n_ops = sum(1 for o in ops if inside(o))
        n_l = sum(1 for o in launches if inside(o))
        sync = sum(o["dur"] for o in syncs if inside(o))
        ks = by_phase[p]
        iv = [(k["ts"], k["ts"] + k["dur"]) for k in ks]
        all_busy += iv
        busy = union_us(iv)
        span = (max(b for _, b in iv) - min(a for a, _ in iv)) if iv else 0.0
        print(f"| {p} | {(e - s) / 1e3:.2f} | {sync / 1e3:.2f} | {n_ops} | {n_l} | {(e - s - sync) / max(n_ops, 1):.1f} | "
              f"{busy / 1e3:.2f} | {span / 1e3:.2f} | {(span - busy) / 1e3:.2f} |")
    gpu_iv = [(k["ts"], k["ts"] + k["dur"]) for ks in by_phase.values() for k in ks]
    print(f"\nGPU busy (union of all activities) {union_us(gpu_iv) / 1e3:.1f} ms of the "
          f"{(max(b for _, b in gpu_iv) - min(a for a, _ in gpu_iv)) / 1e3:.1f} ms from the first to the last")
    # -- host costs ---------------------------------------------------------------------------------------------
    by_name = defaultdict(list)
    for o in ops:
        by_name[o["name"]].append(o["dur"])
    print("\n| host event | calls | median µs | total ms |")
    print("|---|---:|---:|---:|")
    print(f"| top-level ATen operator (all) | {len(ops)} | {statistics.median(o['dur'] for o in ops):.1f} | "
          f"{sum(o['dur'] for o in ops) / 1e3:.1f} |")
    for n, d in sorted(by_name.items(), key=lambda x: -sum(x[1]))[:12]:
        print(f"| {n} | {len(d)} | {statistics.median(d):.1f} | {sum(d) / 1e3:.1f} |")
    for name in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamSynchronize",
                 "cudaDeviceSynchronize"):
        d = [e["dur"] for e in t.of("cuda_runtime", "cuda_driver") if e["name"] == name]
        if d:
            print(f"| {name} | {len(d)} | {statistics.median(d):.1f} | {sum(d) / 1e3:.1f} |")
    n, tot, med, own = dispatch_mode(t)
    if n:
        print(f"| PythonDispatchMode (span, operator inside included) | {n} | {med:.1f} | {tot / 1e3:.1f} |")
        print(f"| PythonDispatchMode beyond its operators (median) | {n} | {own:.1f} | - |")


def achieved(t: TraceEvents) -> None:
    """Rates the kernels reached, from llama1b's shapes (every block: each layer's forward runs again in the
    backward, up to its MLP's up projection: the recomputation stops once the tensors backward needs exist)."""
    by_phase = gpu_by_phase(t)
    mm = [k for ks in by_phase.values() for k in ks if kernel_class(k) == "matmul"]
    f = gemm_flops_llama1b()
    flops = f["layer_forward"] * LAYERS * 3 + (f["layer_forward"] - f["down"]) * LAYERS + f["head_forward"] * 3
    us = sum(k["dur"] for k in mm)
    print(f"\nmatrix products ({t.name}): {len(mm)} kernels, {us / 1e3:.1f} ms, {flops / 1e12:.2f} TFLOP (16 layers x "
          f"(forward + 2 x backward) + their recomputations without the down projection + the head x 3) -> "
          f"{flops / us / 1e6:.0f} TFLOP/s achieved ({flops / us / 1e6 / 989.5:.0%} of 989.5 dense bf16)")
    groups = defaultdict(list)
    for ks in by_phase.values():
        for k in ks:
            if kernel_class(k) in ("elementwise", "copy (kernel)", "reduction"):
                groups[_short(k["name"])].append(k)
    print("\n| elementwise / copy / reduction kernel | kernels | median µs | total ms |")
    print("|---|---:|---:|---:|")
    for n, ks in sorted(groups.items(), key=lambda x: -sum(k["dur"] for k in x[1]))[:16]:
        print(f"| {n} | {len(ks)} | {statistics.median(k['dur'] for k in ks):.1f} | "
              f"{sum(k['dur'] for k in ks) / 1e3:.2f} |")
    # kernels whose bytes the shapes fix: the MLP's SiLU and its product with the up projection, bf16 [8192, 8192]
    # (16 layers: the forward's and the recomputation's SiLU; the product also twice in each layer's backward)
    mlp = TOKENS * FFN * 2
    for name, moved, what in (("vectorized_elementwise_kernel<8 silu_kernel", 2 * mlp, "SiLU (read 1, write 1)"),
                              ("vectorized_elementwise_kernel<8 BinaryFunctor<c10::BFloat16", 3 * mlp,
                               "product (read 2, write 1; the median of these kernels is one of the MLP's)")):
        ks = groups.get(name, [])
        if ks:
            med = statistics.median(k["dur"] for k in ks)
            print(f"\nthe MLP's {what} over bf16 [8192, 8192]: {moved / 1e6:.0f} MB in {med:.1f} µs (median of "
                  f"{len(ks)}) -> {moved / med / 1e3:.0f} GB/s")
    print("(a vectorized kernel over contiguous bf16 runs near the 4.8 TB/s peak; the class as a whole reaches 61% "
          "of it: --calibrate)")


def _short(name: str) -> str:
    m = re.search(r"(vectorized_elementwise_kernel<\d+|unrolled_elementwise_kernel|elementwise_kernel<\d+, \d+|"
                  r"reduce_kernel<\d+, \d+|CatArrayBatchedCopy|cunn_SoftMax\w+)", name)
    kind = m.group(1) if m else name[:40]
    fn = re.search(r"(BinaryFunctor<[^,]+|CUDAFunctor\w*<[^>]+|\w+_kernel_cuda|\w+_kernel_impl<\w+|silu\w*_kernel|"
                   r"FillFunctor<[^>]+|MeanOps<\w+|sum_functor<[^,]+|MulFunctor|\w+Functor<\w+)", name[len(kind):])
    return f"{kind} {fn.group(1) if fn else ''}".strip()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("where", nargs="?", default=DEFAULT_DIR, help="the traces' folder (default: data/ here)")
    parser.add_argument("--calibrate", action="store_true", help="the device table's H200 efficiencies")
    parser.add_argument("--host", action="store_true", help="the H200 host's figures (GPU_HOST) and their check")
    parser.add_argument("--write", action="store_true", help="with --host: write their inputs to data/")
    args = parser.parse_args()
    where = args.where
    if args.calibrate:
        calibrate(where)
        return
    if args.host:
        host(where)
        return
    for name in TRACES:
        path = os.path.join(where, f"{name}.trace.json.gz")
        if not os.path.exists(path):
            print(f"{path}: not found")
            continue
        t = TraceEvents.load(path)
        rows(t)
        if name == "llama1b__1":
            achieved(t)




# -- calibration: the model's work per class against the kernels' time (--calibrate) --------------------------
#: kernel classes (kernel_class) that each operator class of the model (remat.costs.device_time.op_class) runs as
MODEL_CLASSES = {"matmul": ("matmul",), "attention": ("attention fwd", "attention bwd"),
                 "elementwise": ("elementwise", "reduction", "copy (kernel)", "copy (memcpy DtoD)", "copy (memset)",
                                 "other"),
                 "foreach": ("optimizer foreach",)}


def calibrate(where: str) -> None:
    """Each operator class's efficiency on the H200: the llama1b step recorded for the H200 here (fake tensors,
    the plan of llama1b__1: every block, so each layer's forward operators run again in the backward), its work
    per class (FLOPs for products and attention, bytes for the rest) at the H200's peaks, over the class's
    kernel time in llama1b__1's trace. And the host's cost per recorded operator from the host events."""
    gm = shared_models()  # the steps the H200 ran

    import remat
    import remat.target.source as source
    from remat.api.profiling import make_profile
    from remat.costs.device_time import op_class
    from remat.costs.unit_costs import is_selective

    seen = {}
    real = source.step_time

    def spy(rec, rates, target):
        seen["rec"], seen["rates"] = rec, rates
        return real(rec, rates, target)

    source.step_time = spy
    c = gm.build("llama1b", "meta")
    model = c["model"]
    opt = c["opt"](model.parameters())
    target = remat.Target(device="h200", **c["target"])
    profile = make_profile(model, c["inputs"], target=target, loss_fn=c["loss_fn"], optimizer=opt,
                           output_alive=c["output_alive"])
    source.step_time = real
    rec, rates = seen["rec"], seen["rates"]
    layers = [u for u in profile.units if re.fullmatch(r"model\.layers\.\d+", u.name)]
    recomputed = [rec.forward_ops[i] for u in layers
                  for i in range(u.forward_start, (u.recompute_end or u.forward_end) + 1)]
    work = defaultdict(lambda: [0.0, 0])  # class: seconds at peak, operators
    for op in [*rec.forward_ops, *rec.backward_ops, *recomputed]:
        cls = op_class(op.name)
        key = cls if cls in ("matmul", "attention") else "elementwise"
        if cls in ("matmul", "attention"):
            work[key][0] += op.flops / rates.flops_per_s
        elif op.bytes_accessed:
            work[key][0] += op.bytes_accessed / rates.memory_bytes_per_s
        work[key][1] += 1
    # the optimizer's operators on the target (fake tensors), as the profile timed them, at the peak bandwidth
    t1 = TraceEvents.load(os.path.join(where, "llama1b__1.trace.json.gz"))
    by_class = defaultdict(float)
    for ks in gpu_by_phase(t1).values():
        for k in ks:
            by_class[kernel_class(k)] += k["dur"] * 1e-6
    peak_of = {"matmul": rates.flops_per_s, "attention": rates.flops_per_s}
    print("\n| model class | recorded operators | model s at peak | kernels s (llama1b__1) | efficiency |")
    print("|---|---:|---:|---:|---:|")
    for cls, (s, n) in work.items():
        measured = sum(by_class[k] for k in MODEL_CLASSES[cls])
        print(f"| {cls} | {n} | {s * 1e3:.2f} ms | {measured * 1e3:.2f} ms | {s / measured:.3f} "
              f"({'of peak FLOP/s' if cls in peak_of else 'of peak bandwidth'}) |")
    pointwise = rates.efficiency_of("foreach").memory
    opt_at_peak = profile.optimizer_s * pointwise  # memory-bound: seconds at the efficiency x the efficiency
    print(f"| foreach (optimizer) | - | {opt_at_peak * 1e3:.2f} ms | {by_class['optimizer foreach'] * 1e3:.2f} ms | "
          f"{opt_at_peak / by_class['optimizer foreach']:.3f} (of peak bandwidth; the profile's optimizer "
          f"{profile.optimizer_s * 1e3:.2f} ms at {pointwise:.2f}) |")
    sel = [u for u in profile.units if is_selective(u.name)]
    print(f"(the profile's selective options: {len(sel)})")


# -- the host: the device's cost per operator (--host) -----------------------------------------------------------
INPUTS = os.path.join(DEFAULT_DIR, "host_inputs.json")


def host(where: str) -> None:
    """The H200 host's seconds per operator (remat.costs.device_time.GPU_HOST; Note [Host time decomposed] in
    remat.costs.host_time): llama1b__1's profiled forward (every block checkpointed) less the model's own work
    (measured here on fake tensors, as planning measures it), checkpointing's bookkeeping and the profiler's
    events (each measured here), over its recorded operators, through op_s_from_phase (what ``remat calibrate``
    uses); the inputs measured here are written to data/host_inputs.json. Then the figure is held
    against the phases it was not taken from: llama1b__1's backward, llama1b__4's forward and backward (16
    selective units)."""
    import json
    import platform
    from datetime import datetime, timezone

    import torch

    os.environ["REMAT_CACHE"] = "0"  # measured now, not read back
    gm = shared_models()

    import remat
    import remat.profile.host_work as host_work
    from remat.api.profiling import make_profile
    from remat.profile import cache
    from remat.profile.timing import checkpoint_overhead
    from remat.target.host_trace import TraceEvents, host_costs_from_traces, host_phases

    seen = {}
    real = host_work.measure_host_work

    def spy(*args, **kwargs):
        seen["work"] = real(*args, **kwargs)
        return seen["work"]

    host_work.measure_host_work = spy
    c = gm.build("llama1b", "meta")
    model = c["model"]
    profile = make_profile(model, c["inputs"], target=remat.Target(device="h200", **c["target"]),
                           loss_fn=c["loss_fn"], optimizer=c["opt"](model.parameters()),
                           output_alive=c["output_alive"])
    host_work.measure_host_work = real
    work = seen["work"]
    cpu = torch.device("cpu")
    book = cache.overhead(cpu, lambda: checkpoint_overhead(cpu))
    per_event = profiler_event_s()
    layers = [u for u in profile.units if re.fullmatch(r"model\.layers\.\d+", u.name)]
    selective = [u for u in profile.units if re.fullmatch(r"model\.layers\.\d+@ops\d+", u.name)]
    bookkeeping = sum(book.per_call_s + len(u.drops) * book.per_saved_tensor_s for u in layers)
    t1 = host_phases(TraceEvents.load(os.path.join(where, "llama1b__1.trace.json.gz")))
    t4 = host_phases(TraceEvents.load(os.path.join(where, "llama1b__4.trace.json.gz")))
    # the 16-selective-unit plan of llama1b__4: one option per layer (each layer's options run the same operators)
    selective = list({u.name.split("@")[0]: u for u in reversed(selective)}.values())

    def recomputed(units) -> int:
        return sum((u.recompute_end if u.recompute_end is not None else u.forward_end) - u.forward_start + 1
                   for u in units)

    recompute_s = lambda op_s: recomputed(layers) * (work.forward_python_per_op_s + op_s)  # noqa: E731
    sel_bookkeeping = sum(book.per_call_s + len(u.drops) * book.per_saved_tensor_s for u in selective)
    inputs = dict(traces=["llama1b__1.trace.json.gz", "llama1b__4.trace.json.gz"],
                  forward_python_s=work.forward_python_s, backward_python_s=work.backward_python_s,
                  forward_ops=work.forward_ops, backward_ops=work.backward_ops, bookkeeping_s=bookkeeping,
                  selective_ops=sum(u.forward_end - u.forward_start + 1 for u in selective),
                  selective_bookkeeping_s=sel_bookkeeping, selective_recomputed_ops=recomputed(selective),
                  profiler_event_s=per_event,
                  measured=f"{datetime.now(timezone.utc).date()} on {platform.processor() or platform.machine()}, "
                           f"torch {torch.__version__}: {work.source}; checkpoint_overhead: "
                           f"{book.per_call_s * 1e6:.1f} us a call, {book.per_saved_tensor_s * 1e6:.1f} us a saved "
                           f"tensor ({book.per_selective_op_s * 1e6:.1f} us a selective operator here); "
                           f"{len(layers)} units; the profiler {per_event * 1e6:.2f} us an event")
    phases = {"llama1b__1": t1, "llama1b__4": t4}
    found = host_costs_from_traces(phases, inputs)
    op_s, selective_op_s, selective_recompute_op_s = (found.forward_op_s, found.selective_forward_op_s,
                                                      found.selective_recompute_op_s)
    if "--write" in sys.argv:  # the built-in figures' inputs, anew (then GPU_HOST takes the figures printed)
        with open(INPUTS, "w") as f:
            json.dump(inputs, f, indent=1)
            f.write("\n")
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    fwd, bwd = t1["forward"], t1["backward"]
    print(f"\nllama1b__1 forward: {ms(fwd.wall_s)} on the host = the model's own {ms(work.forward_python_s)} + "
          f"checkpointing's bookkeeping {ms(bookkeeping)} + the profiler's {fwd.events} events x "
          f"{per_event * 1e6:.2f} us + {work.forward_ops} operators x **{op_s * 1e6:.2f} us**")
    print(f"llama1b__4 forward: {ms(t4['forward'].wall_s)} = the same operators + 16 selective units' bookkeeping "
          f"{ms(sel_bookkeeping)} + the profiler's {t4['forward'].events} events + their {inputs['selective_ops']} "
          f"operators x **{selective_op_s * 1e6:.2f} us** of dispatch mode (here: "
          f"{book.per_selective_op_s * 1e6:.2f} us)")
    print(f"llama1b__4 backward: {ms(t4['backward'].wall_s)} = the plain backward + their recomputations' "
          f"{inputs['selective_recomputed_ops']} operators, each + **{selective_recompute_op_s * 1e6:.2f} us** of "
          "dispatch mode")
    print(f"(inputs measured here{' written to ' + os.path.relpath(INPUTS) if '--write' in sys.argv else ''}; "
          "the figures for remat.costs.device_time.GPU_HOST: "
          f"forward_op_s=backward_op_s={op_s * 1e6:.2f}e-6, selective_forward_op_s={selective_op_s * 1e6:.2f}e-6, "
          f"selective_recompute_op_s={selective_recompute_op_s * 1e6:.2f}e-6)")
    checks = [
        ("llama1b__1 backward (16 blocks recomputed)", bwd,
         work.backward_python_s + work.backward_ops * op_s + recompute_s(op_s)),
    ]
    print("\n| phase (not used to derive the figures) | host wall, measured (profiled) | predicted, unprofiled | "
          "+ the profiler's events | error |")
    print("|---|---:|---:|---:|---:|")
    for what, phase, predicted in checks:
        traced = predicted + phase.events * per_event
        print(f"| {what} | {ms(phase.wall_s)} | {ms(predicted)} | {ms(traced)} | "
              f"{(traced / phase.wall_s - 1) * 100:+.1f}% |")


def profiler_event_s(repeats: int = 30, *, blocks: int = 4, width: int = 64, tokens: int = 8) -> float:
    """What ``torch.profiler`` (CPU activity, no shapes or stacks: as the shared traces were recorded) adds to the
    host per event it records, on this machine: steps of tiny blocks (RMS norm, Linear, SiLU) on the CPU, each
    block checkpointed (as the traced step was: checkpointing's hooks run under the profiler too), profiled and
    not, interleaved, on one thread; the least of ``repeats`` each, the difference over the events one profiled
    step records."""
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint

    from remat._compat.profiler import stderr_silenced
    from remat.runtime.measure import one_thread

    with one_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = nn.Sequential(*(nn.Sequential(nn.RMSNorm(width), nn.Linear(width, width), nn.SiLU())
                                 for _ in range(blocks)))
        x = torch.randn(tokens, width, requires_grad=True)

        def step() -> None:
            h = x
            for block in layers:
                h = checkpoint(block, h, use_reentrant=False)
            h.square().mean().backward()

        for _ in range(3):
            step()
        plain, profiled, events = [], [], 0
        with stderr_silenced():
            for _ in range(repeats):
                plain.append(_wall(step))
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    profiled.append(_wall(step))
                events = len(prof.events())
    return max(min(profiled) - min(plain), 0.0) / max(events, 1)


def _wall(fn) -> float:
    import time

    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def dispatch_clusters(t: TraceEvents, gap_us: float = 300.0) -> list[tuple[int, float, int]]:
    """PythonDispatchMode calls grouped into runs (a selective unit's forward or recomputation: no gap over
    ``gap_us``): (thread, µs from the first call's start to the last's end, calls)."""
    modes = sorted((e for e in t.of("cpu_op", "user_annotation") if "PythonDispatchMode" in e["name"]),
                   key=lambda e: e["ts"])
    out = []
    for tid in sorted({e["tid"] for e in modes}):
        run: list[dict] = []
        for e in (m for m in modes if m["tid"] == tid):
            if run and e["ts"] - (run[-1]["ts"] + run[-1]["dur"]) > gap_us:
                out.append((tid, run[-1]["ts"] + run[-1]["dur"] - run[0]["ts"], len(run)))
                run = []
            run.append(e)
        if run:
            out.append((tid, run[-1]["ts"] + run[-1]["dur"] - run[0]["ts"], len(run)))
    return out


if __name__ == "__main__":
    main()
