"""remat's plans for the compiled step, side by side with torch.compile's activation_memory_budget (run by hand).

    python benchmarks/plans/compiled.py [--models gpt,llama] [--repeats 5] [--device cuda] [--out FILE]
                                                                     # ~30-40 min on 2 CPU cores

Models: the built-in GPT decoder (4 x 128, batch 8 x 128, dropout 0.1) and a Hugging Face Llama decoder built
from a config (4 layers of width 128, attention dropout 0.1, batch 8 x 128; needs transformers). AdamW, the
output kept until the step ends, the whole model compiled with inductor (its own random numbers, the default).

For each model, in one run:

  remat @ budget    ``optimize_checkpointing(..., compile=True)``'s plan for 5 budgets from remat's least compiled
                    peak to the compiled no-checkpointing peak (planned as the library plans: profile once,
                    compiled steps measured per plan, Note [Compiled steps] in remat.solve.calibrated), then
                    measured again here on a freshly compiled model
  AMB f             the plain model compiled with ``torch._functorch.config.activation_memory_budget = f`` for
                    f in 0, 0.25, 0.5, 0.75, 1 (compile's own min-cut/knapsack recomputation)
  remat @ AMB f     remat's plan for a budget equal to AMB f's measured peak: step times at equal peak
  every block by hand    each block's forward under torch's checkpoint, then compile (the hand rule), and
                    remat's plan for a budget equal to its measured peak

Every peak is measured on a compiled step: the profiler's allocator-level memory events on CPU (what compiled
kernels allocate is invisible to a dispatch-level tracker), the allocator on CUDA; parameters, gradients,
optimizer state and the batch alive before the step plus the step's allocations (forward, backward, optimizer
step; gradients start as None). Step times: median of --repeats steps after two warm-up steps, interleaved
per row (not across rows: each row compiles its own model). Writes benchmarks/results/compile-<device>.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

import remat
from remat._compat import profiler_memory_peak
from remat.api import checked_reading
from remat.check.compiled import CompiledComparison
from remat.runtime.compiled import compiled_loop
from remat.examples import make_gpt
from remat.runtime.measure import outside_autocast, split_inputs, tensor_bytes
from remat.solve.plan import fmt_bytes
from remat.solve.calibrated import plan_compiled

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
AMB = (0.0, 0.25, 0.5, 0.75, 1.0)


def by_hand(model, blocks):
    """Each block's forward under torch's checkpoint, on the instance (the hand rule "every block")."""
    mods = dict(model.named_modules())
    for name in blocks:
        block = mods[name]
        block.forward = functools.partial(_checkpointed, type(block).forward.__get__(block))
    return model


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def gpt(device):
    return make_gpt(layers=4, batch_size=8, seq_len=128, d_model=128, dropout=0.1, device=str(device))


def llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.1,
                      max_position_embeddings=128, use_cache=False)
    model = LlamaForCausalLM(cfg).to(device).train()
    ids = torch.randint(0, 512, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


#: name -> (factory, the loop keeps the output until the step ends); measure_compiled drops it after the loss,
#: as the Hugging Face Trainer does; the GPT's output is its loss
MODELS = {"gpt": (gpt, True), "llama": (llama, False)}
#: the blocks the hand rule "every block" checkpoints, by model
BLOCKS = {"gpt": lambda m: [f"h.{i}" for i in range(len(m.h))],
          "llama": lambda m: [f"model.layers.{i}" for i in range(len(m.model.layers))]}


def measure_compiled(model, inputs, loss_fn, device: torch.device, repeats: int, *,
                     memory_budget: float | None = None) -> dict:
    """Compile ``model`` (with compile's ``activation_memory_budget`` when given) and measure whole training
    steps (AdamW): compile time, the allocator-level peak, the bytes saved for backward, median step time."""
    import torch._functorch.config as fconfig

    args, kwargs = split_inputs(inputs)
    torch._dynamo.reset()
    patch = fconfig.patch(activation_memory_budget=memory_budget) if memory_budget is not None else _Null()
    with patch:
        compiled = torch.compile(model)
        opt = adamw(model.parameters())
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        def step(record: bool = False):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if record else _Null():
                loss = loss_fn(compiled(*args, **kwargs))
            with outside_autocast():
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        t0 = time.perf_counter()
        step()  # compiles (and creates the optimizer state)
        compile_s = time.perf_counter() - t0
        step(record=True)
        step()
        state = [*model.parameters(), *model.buffers(), *remat.runtime.measure.input_tensors(args, kwargs),
                 *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))]
        if device.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats(device)
            step()
            sync()
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = tensor_bytes(state, device) + profiler_memory_peak(step, device)
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
    return dict(peak=peak, saved=sum(saved.values()), step_s=statistics.median(times), compile_s=compile_s)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class RematCompiled:
    """remat's compiled planning for one model, as optimize_checkpointing(compile=True) does it, with the
    measured compiled peaks shared across budgets (the anchors are measured once)."""

    def __init__(self, factory, device: torch.device, output_alive: bool) -> None:
        self.model, self.inputs, loss_fn = factory(device)
        self.loss_fn = loss_fn or remat.default_loss
        self.device = device
        t0 = time.perf_counter()
        self.profile = remat.make_profile(self.model, self.inputs, loss_fn=self.loss_fn,
                                          optimizer=adamw(self.model.parameters()), output_alive=output_alive)
        self.profile_s = time.perf_counter() - t0
        self.planner = remat.Planner(self.profile, granularity="op", regions=False)
        self.loop = compiled_loop(self.model, self.model, True)
        self.measured: dict = {}
        self.programs: dict = {}  # what each measured plan's compiled program says (Note [Compiled programs])
        self.args, self.kwargs = split_inputs(self.inputs)
        # each measured step compared with the plain compiled step, as the library does (Note [Two programs per plan])
        self.compare = CompiledComparison(self.loop)

    def plan(self, budget: int):
        t0 = time.perf_counter()
        before = len(self.measured)
        plan = plan_compiled(self.planner, budget, lambda p: checked_reading(
            self.model, p, self.args, self.kwargs, self.loss_fn, self.device, self.profile, self.loop,
            compare=self.compare), loop=str(self.loop), measured=self.measured, programs=self.programs,
            proved=self.compare.proved)
        return plan, time.perf_counter() - t0, len(self.measured) - before


def run_model(name: str, factory, output_alive: bool, device: torch.device, repeats: int) -> list[dict]:
    rows: list[dict] = []
    rc = RematCompiled(factory, device, output_alive)
    print(f"{name}: profiled in {rc.profile_s:.1f} s", flush=True)

    def remat_row(label: str, budget: int) -> None:
        try:
            plan, plan_s, compiles = rc.plan(budget)
        except remat.InfeasibleBudgetError as e:
            rows.append(dict(model=name, name=label, budget=budget, units=None, note=f"refused: least {fmt_bytes(e.min_feasible_bytes)}"))
            print(rows[-1], flush=True)
            return
        m, inp, loss_fn = factory(device)
        remat.apply_plan(m, plan)
        comp = measure_compiled(m, inp, loss_fn or remat.default_loss, device, repeats)
        rows.append(dict(model=name, name=label, budget=budget, units=len(plan.checkpointed),
                         selective=sum("@ops" in u for u in plan.checkpointed), predicted=plan.predicted_peak_bytes,
                         checked=plan.checked_peak_bytes, plan_s=plan_s, compiles=compiles,
                         random=plan.compiled_random, **comp))
        print(rows[-1], flush=True)

    t0 = time.perf_counter()
    none = rc.plan(10**15)[0]  # the compiled step without checkpointing (one compile)
    hi = none.checked_peak_bytes
    try:
        rc.plan(0)
    except remat.InfeasibleBudgetError as e:
        lo = e.min_feasible_bytes
    rows.append(dict(model=name, name="anchors", profile_s=rc.profile_s, plan_s=time.perf_counter() - t0,
                     compiles=len(rc.measured)))
    for f in (0.0, 0.25, 0.5, 0.75, 1.0):
        remat_row(f"remat @ {f:.2f} of the range", int(lo + f * (hi - lo)))
    for frac in AMB:
        m, inp, loss_fn = factory(device)
        comp = measure_compiled(m, inp, loss_fn or remat.default_loss, device, repeats, memory_budget=frac)
        rows.append(dict(model=name, name=f"AMB {frac}", budget=None, units=None, **comp))
        print(rows[-1], flush=True)
        remat_row(f"remat @ AMB {frac}'s peak", comp["peak"])
    m, inp, loss_fn = factory(device)
    comp = measure_compiled(by_hand(m, BLOCKS[name](m)), inp, loss_fn or remat.default_loss, device, repeats)
    rows.append(dict(model=name, name=HAND, budget=None, units=None, **comp))
    print(rows[-1], flush=True)
    remat_row(f"remat @ {HAND}'s peak", comp["peak"])
    return rows


#: the hand rule's row: every block under torch's checkpoint, then compile
HAND = "every block by hand"


def _rival(name: str) -> bool:
    return name.startswith("AMB") or name == HAND


def table(rows: list[dict], device: torch.device, args) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# remat's compiled plans against activation_memory_budget on {device.type}", "",
             f"Measured {when} on {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
             f"remat {remat.__version__}; `python benchmarks/plans/compiled.py --models {args.models} --repeats {args.repeats}`. "
             "Whole model compiled with inductor, AdamW; the loss is the GPT's output, the Llama's output is dropped "
             "after its loss (as the Hugging Face Trainer does). Every peak measured on a compiled step "
             "(profiler allocator-level memory events on CPU, the allocator on CUDA). remat rows: the plan "
             "`optimize_checkpointing(compile=True)` returns for the budget (predicted = its calibrated compiled "
             "prediction, checked = measured while planning), measured again on a freshly compiled copy; "
             "AMB rows: the plain model under `torch._functorch.config.activation_memory_budget`.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        lines += [f"## {model}", "",
                  "| row | budget | units (@ops) | predicted | checked | measured peak | within budget | step | "
                  "remat/rival step at equal peak | planning (compiles) |",
                  "|---|---:|---:|---:|---:|---:|:---:|---:|---:|---:|"]
        rival_step = {r["name"]: r["step_s"] for r in mine if _rival(r["name"])}
        anchors = next(r for r in mine if r["name"] == "anchors")
        mine = [r for r in mine if r is not anchors]
        for r in mine:
            if r.get("units") is None and not _rival(r["name"]):
                lines.append(f"| {r['name']} | {fmt_bytes(r['budget'])} | - | - | - | - | - | - | - | {r['note']} |")
                continue
            ratio = "-"
            if "'s peak" in r["name"]:
                key = r["name"].split("@ ")[1].split("'")[0]
                ratio = f"{r['step_s'] / rival_step[key]:.3f}"
            is_remat = r["name"].startswith("remat")
            recomputed = ", random recomputed" if r.get("random") == "recompute" else ""
            units = f"{r['units']} ({r['selective']}){recomputed}" if is_remat else "-"
            planning = f"{r['plan_s']:.0f} s ({r['compiles']})" if is_remat else "-"
            within = ("yes" if r["peak"] <= r["budget"] else "NO") if is_remat else "-"
            lines.append(
                f"| {r['name']} | {fmt_bytes(r['budget']) if r['budget'] else '-'} | {units} | "
                f"{fmt_bytes(r['predicted']) if is_remat else '-'} | {fmt_bytes(r['checked']) if is_remat else '-'} | "
                f"{fmt_bytes(r['peak'])} | {within} | {r['step_s'] * 1e3:.1f} ms | {ratio} | {planning} |")
        least_remat = min((r["peak"] for r in mine if r["name"].startswith("remat") and r.get("units") is not None),
                          default=None)
        least_amb = min(r["peak"] for r in mine if r["name"].startswith("AMB"))
        hand = next((r["peak"] for r in mine if r["name"] == HAND), None)
        by_hand = "" if hand is None else (
            f", every block by hand {fmt_bytes(hand)} (remat's least {(least_remat - hand) / 2**20:+.2f} MiB from it)")
        lines += ["", f"Least compiled peak measured: remat {fmt_bytes(least_remat)}, activation_memory_budget "
                      f"{fmt_bytes(least_amb)}{by_hand}. Profiling took {anchors['profile_s']:.1f} s; the anchors (no "
                      f"checkpointing, the least-memory plan, every block: {anchors['compiles']} compiles) "
                      f"{anchors['plan_s']:.0f} s, measured once and shared by every budget's planning, whose column "
                      "counts only its own further compiles.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    out = Path(args.out) if args.out else RESULTS / f"compile-{device.type}.md"
    saved = out.with_suffix(".json")  # every model's rows: a run of some models keeps the others'
    rows = [r for r in (json.loads(saved.read_text()) if saved.exists() else []) if r["model"] not in args.models.split(",")]
    for name in args.models.split(","):
        factory, output_alive = MODELS[name]
        rows += run_model(name, factory, output_alive, device, args.repeats)
        saved.write_text(json.dumps(rows, indent=1))
        text = table(sorted(rows, key=lambda r: list(MODELS).index(r["model"])), device, args)
        out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
