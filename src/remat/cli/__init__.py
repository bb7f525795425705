"""The ``remat`` command line (also ``python -m remat``).

    remat tradeoff TARGET      measured memory/step-time table: hand rules and remat's plan per budget
    remat plan TARGET --budget GIB [--out plan.json] [--compile [BACKEND]]
    remat profile TARGET       per-unit costs and the capture path
    remat verify TARGET (--budget GIB | --plan plan.json)   equivalence check; exit 1 on mismatch
    remat maxbatch TARGET --budget GIB [--dim batch|seq]     the largest and the fastest batch (or sequence)
    remat accuracy TARGET [--budget GIB,...] [--steps N]     on a CUDA GPU: the prediction for it beside real steps
    remat calibrate [--out FILE] [--base NAME] [--quick]     on a CUDA GPU: measure it into a spec for --device FILE

TARGET is a built-in example (gpt, unet), path/to/file.py:function or package.module:function.
User mistakes print one line and exit with status 2; --debug shows the traceback.

Under ``torchrun`` (WORLD_SIZE > 1) the command line joins the process group (gloo on CPU, nccl on GPUs,
one GPU per LOCAL_RANK) before building the target, whose function wraps the model (``fully_shard``, DDP)
as it will train; ``remat plan`` then makes one plan for every rank and prints each rank's measured peak; ``remat tradeoff``
plans for every rank and measures each plan on the target's model itself (it trains it; sharded models
cannot be deep-copied), with a column of per-rank peaks. ``verify`` compares deep copies: it refuses.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch

from remat._compat.versions import REMAT_VERSION as __version__
from remat.api import apply_plan, optimize_checkpointing
from remat.check.steps import measure_step
from remat.check.verify import check_equivalence
from remat.errors import RematError
from remat.solve import Planner
from remat.solve.plan import Plan
from remat.solve.plan import GiB, fmt_bytes
from remat.sweeps.report import plot_rows, plot_sizes, rows_to_json, tradeoff
# the shared pieces and the printing
from remat.cli.common import (
    OPTIMIZERS,
    UsageError,
    _compile_args,
    _compile_setting,
    _console,
    _target_args,
    _gib,
    _gib_list,
    _header,
    _plot,
    _profile,
    _quiet,
    _rank,
    _size_args,
    _target,
)
from remat.cli.render import _compiled_footer, _eager_footer, _print_profile, _tradeoff_table
from remat.cli.accuracy import add_accuracy, cmd_accuracy
from remat.cli.calibrate import add_calibrate, cmd_calibrate


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("target", help="gpt, unet, path/to/file.py:function, package.module:function, or a Hugging "
                                       "Face config.json (or a folder holding one)")
    _target_args(common)
    common.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                        help="optimizer whose state counts in the budget (default: adamw)")
    _size_args(common)
    common.add_argument("--output-dropped", action="store_true",
                        help="the training loop drops the model's output once the loss is computed (HF Trainer, "
                             "torchtitan); default: it keeps it until the step ends (nanoGPT, most hand loops)")
    common.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit in seconds (default 60)")
    common.add_argument("--offload", action="store_true",
                        help="plans may also offload activations to host memory (a GPU target: --device; "
                             "docs/offload.md)")
    common.add_argument("--debug", action="store_true", help="show tracebacks")

    p = argparse.ArgumentParser(prog="remat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"remat {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tradeoff", parents=[common], help="measured memory/step-time tradeoff table")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--budgets", type=_gib_list, help="budgets in GiB, comma-separated, e.g. 1.5,2,3")
    g.add_argument("--points", type=int, default=6,
                   help="number of budgets from the least achievable to the no-checkpointing peak (default 6)")
    t.add_argument("--repeats", type=int, default=5,
                   help="timed steps per plan (median; default 5; on CPU twice as many, interleaved round-robin)")
    t.add_argument("--granularity", choices=["block", "op", "both"], default="op",
                   help="remat rows with selective (op-level) units allowed (op, the default: rows 'remat-op'), "
                        "whole units only (block: rows 'remat'), or both")
    t.add_argument("--warmup", type=float, default=3.0,
                   help="seconds of warm-up steps before measuring (default 3; the first steps run slow)")
    _compile_args(t)
    t.add_argument("--json", type=Path, help="write every row with all fields to this file")
    t.add_argument("--plot", type=Path, help="write measured peak vs step time to this PNG (needs matplotlib)")

    pl = sub.add_parser("plan", parents=[common], help="solve one budget, print and save the plan")
    pl.add_argument("--budget", type=_gib, required=True, help="GiB of peak memory for one training step")
    pl.add_argument("--out", "--json", type=Path, dest="out",
                    help="write the plan as JSON (for remat.apply_plan; with predicted tokens/s and MFU for a target)")
    pl.add_argument("--granularity", choices=["block", "op"], default="op",
                    help="allow selective (op-level) units (op, the default) or whole units only (block)")
    _compile_args(pl)

    pr = sub.add_parser("profile", parents=[common], help="per-unit costs and the capture path")
    pr.add_argument("--warmup", type=float, default=3.0,
                    help="seconds of warm-up steps before profiling (default 3; the first steps run slow)")
    pr.add_argument("--json", type=Path, help="write the whole profile as JSON")

    mb = sub.add_parser("maxbatch", parents=[common],
                        help="the largest and the fastest batch (or sequence) under a budget, confirmed on real steps")
    mb.add_argument("--budget", type=_gib, required=True, help="GiB of peak memory for one training step")
    mb.add_argument("--dim", choices=["batch", "seq"], default="batch",
                    help="the size to grow: batch_size or seq_len of the target (default batch)")
    mb.add_argument("--max-size", type=int, default=None,
                    help="largest size to try (default 65536; for --dim seq on gpt, the model's positions: 1024)")
    mb.add_argument("--multiple-of", type=int, default=1, help="only sizes that are multiples of this (default 1)")
    mb.add_argument("--profile-sizes", type=lambda t: tuple(int(x) for x in t.split(",")),
                    help="sizes profiled for real, comma-separated (default: 2 and 4 steps of --multiple-of for "
                         "the batch, 4, 8, 12 for the sequence)")
    mb.add_argument("--compare", action="store_true",
                    help="also size the hand rules: checkpoint every block, and no checkpointing")
    mb.add_argument("--repeats", type=int, default=3, help="timed steps per size (median; default 3)")
    mb.add_argument("--plot", type=Path, help="write measured samples/s by size to this PNG (needs matplotlib)")
    v = sub.add_parser("verify", parents=[common], help="plain vs checkpointed: gradients, buffers, loss, output")
    g = v.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget", type=_gib, help="plan for this budget, then check")
    g.add_argument("--plan", type=Path, help="check a saved plan")
    v.add_argument("--rtol", type=float, default=0.0)
    v.add_argument("--atol", type=float, default=0.0)
    v.add_argument("--granularity", choices=["block", "op"], default="op",
                   help="with --budget: allow selective (op-level) units (op, the default) or whole units only")
    add_accuracy(sub, common)
    add_calibrate(sub)
    return p


def cmd_tradeoff(args, out, err) -> int:
    model, inputs, loss_fn, desc, device = _target(args)
    compile = _compile_setting(args)
    _header(out, desc, device, args)
    if args.modelled is not None:
        return _modelled_tradeoff(args, out, err, model, inputs, loss_fn)
    with err.status("profiling") as st:
        profile, _ = _profile(args, model, inputs, loss_fn, device, st.update)
        budgets = [int(b * GiB) for b in args.budgets] if args.budgets else None
        rows = tradeoff(model, inputs, profile, loss_fn=loss_fn, optimizer_factory=OPTIMIZERS[args.optimizer],
                        budgets=budgets, points=args.points, repeats=args.repeats, warmup_s=args.warmup,
                        granularities={"block": ("block",), "op": ("op",), "both": ("block", "op")}[args.granularity],
                        progress=st.update, compile=compile)
    planner_min = min((r.predicted_peak_bytes for r in rows if r.predicted_peak_bytes), default=None)
    out.print(_tradeoff_table(rows))
    if compile:  # Note [Compiled tradeoff] in remat.sweeps.report
        _compiled_footer(out, compile, device, args)
    else:
        _eager_footer(out, rows, profile, device, args, planner_min)
    meta = dict(target=desc, device=str(device), optimizer=args.optimizer, torch=torch.__version__,
                remat=__version__, machine=platform.platform(), date=datetime.now(timezone.utc).isoformat(),
                capture_path=profile.capture_path, memory_recorded_with=profile.memory_recorded_with,
                compiled=str(compile) if compile else "")
    if args.json and _rank() == 0:
        args.json.write_text(rows_to_json(rows, meta))
        out.print(f"rows written to {args.json}")
    if args.plot and _rank() == 0:
        _plot(out, args.plot, lambda path: plot_rows(rows, path, f"{desc} on {device}"))
    return 0


def _modelled_tradeoff(args, out, err, model, inputs, loss_fn) -> int:
    """``remat tradeoff --device GPU``: the table predicted for a target that is not here (nothing measured)."""
    from remat.cli.render import _predicted_table
    from remat.sweeps.predicted import predicted_tradeoff

    if _compile_setting(args):
        raise UsageError("--compile with --device GPU: a compiled step cannot be modelled for a target yet")
    factory = OPTIMIZERS[args.optimizer]
    with err.status("recording the step on fake tensors in the target's world"):
        rows = predicted_tradeoff(model, inputs, args.modelled, loss_fn=loss_fn,
                                  optimizer=factory(model.parameters()) if factory else None,
                                  output_alive=not args.output_dropped,
                                  budgets=[int(b * GiB) for b in args.budgets] if args.budgets else None,
                                  points=args.points, offload=getattr(args, "offload", False))
    out.print(_predicted_table(rows, args.modelled))
    out.print("every figure predicted on this machine for the target, not measured: peaks per rank, the reserved "
              "one by replaying the CUDA caching allocator; step time by the target's device model (roofline per "
              "operator, ring collectives, FSDP2's prefetch: docs/targets.md)")
    if args.json:
        import dataclasses
        import json

        Path(args.json).write_text(json.dumps({"target": args.modelled.describe(), "predicted": True, "measured": False,
                                               "rows": [dataclasses.asdict(r) for r in rows]}, indent=2))
        out.print(f"rows written to {args.json}")
    return 0


def _optimize(args, model, inputs, loss_fn) -> Plan:
    """optimize_checkpointing with the command line's budget, optimizer and time limit."""
    factory = OPTIMIZERS[args.optimizer]
    compile = _compile_setting(args)
    return optimize_checkpointing(model, args.budget, inputs, loss_fn=loss_fn,
                                  optimizer=factory(model.parameters()) if factory else None,
                                  time_limit_s=args.time_limit, granularity=getattr(args, "granularity", "op"),
                                  output_alive=not args.output_dropped, compile=compile,
                                  target=getattr(args, "modelled", None), offload=getattr(args, "offload", False))


def cmd_plan(args, out, err) -> int:
    model, inputs, loss_fn, desc, device = _target(args)
    _header(out, desc, device, args)
    with err.status("profiling and solving"):
        plan = _optimize(args, model, inputs, loss_fn)
    out.print(str(plan), markup=False, highlight=False)
    if plan.world_size > 1 and not plan.target:
        _per_rank_peaks(model, inputs, loss_fn, device, plan, out)
    if args.out and _rank() == 0:
        plan.save(args.out)
        out.print(f"plan written to {args.out} (apply it with remat.apply_plan(model, remat.Plan.load(path)))")
    return 0


def _per_rank_peaks(model, inputs, loss_fn, device: torch.device, plan: Plan, out) -> None:
    """Each rank's own peak of one real step with the plan (forward and backward measured, the optimizer as
    predicted), printed by rank 0."""
    import torch.distributed as dist

    from remat.api import measure_checked_peak
    from remat.runtime.measure import default_loss, split_inputs

    a, k = split_inputs(inputs)
    peak = measure_checked_peak(model, a, k, loss_fn or default_loss, device, output_alive=plan.output_alive,
                                optimizer_state_bytes=plan.breakdown.optimizer_state_bytes)
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    for r, p in enumerate(peaks):
        met = "within" if plan.budget_bytes is None or p <= plan.budget_bytes else "OVER"
        out.print(f"  rank {r}: peak {fmt_bytes(p)} measured (forward and backward; optimizer state as predicted), "
                  f"{met} the budget {fmt_bytes(plan.budget_bytes)}")


def cmd_profile(args, out, err) -> int:
    model, inputs, loss_fn, desc, device = _target(args)
    _header(out, desc, device, args)
    with err.status("profiling") as st:
        profile, _ = _profile(args, model, inputs, loss_fn, device, st.update)
    planner = Planner(profile, time_limit_s=args.time_limit)
    _print_profile(out, profile, planner)
    if args.json and _rank() == 0:  # (under torchrun: rank 0's profile)
        args.json.write_text(profile.to_json())
        out.print(f"profile written to {args.json}")
    return 0


def cmd_maxbatch(args, out, err) -> int:
    from remat.sweeps.sizing import max_batch_of
    from remat.cli.targets import sized_batches

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("remat maxbatch runs one process: size the batch per rank without torchrun")
    key = "batch_size" if args.dim == "batch" else "seq_len"
    max_size = args.max_size or (1024 if args.dim == "seq" else 1 << 16)
    if args.dim == "seq" and args.target == "gpt":
        args.seq_len = max_size  # the model's positions bound the sequences it takes
    model, inputs, loss_fn, desc, device = _target(args)
    _header(out, desc, device, args)
    options = dict(layers=args.layers, batch_size=args.batch_size, d_model=args.d_model, image_size=args.image_size,
                   depth=args.depth, seq_len=None if args.dim == "seq" else args.seq_len)
    sized = sized_batches(args.target, key, device=device, options=options)
    factory = OPTIMIZERS[args.optimizer]
    reports, profiles = [], {}  # each size profiled once for all strategies
    with err.status("sizing") as st:
        for strategy in ("ilp", "every_block", "none") if args.compare else ("ilp",):
            st.update(f"sizing with {strategy}")
            reports.append(max_batch_of(
                model, args.budget, sized, optimizer=factory(model.parameters()) if factory else None, dim=args.dim,
                profile_sizes=args.profile_sizes, max_size=max_size, multiple_of=args.multiple_of, strategy=strategy,
                granularity="block", output_alive=not args.output_dropped, repeats=args.repeats,
                time_limit_s=args.time_limit, profiles=profiles))
    for rep in reports:
        out.print(str(rep), markup=False, highlight=False)
    if len(reports) > 1:
        ilp = reports[0]
        out.print("largest that fits: " + ", ".join(f"{r.strategy} {r.max_size}" for r in reports)
                  + f" (remat {ilp.max_size / max(reports[1].max_size, 1):.2f}x every block, "
                  f"{ilp.max_size / max(reports[2].max_size, 1):.2f}x no checkpointing)", markup=False)
    out.print(f"apply the plan for the size you choose: remat.apply_plan(model, plan); the largest's plan: "
              f"{', '.join(reports[0].max_plan.checkpointed) or 'nothing checkpointed'}", markup=False)
    if args.plot:
        _plot(out, args.plot, lambda path: plot_sizes(
            reports, path, f"{desc} on {device}, budget {fmt_bytes(reports[0].budget_bytes)}"))
    return 0


def cmd_verify(args, out, err) -> int:
    model, inputs, loss_fn, desc, device = _target(args)
    _header(out, desc, device, args)
    factory = OPTIMIZERS[args.optimizer]
    with err.status("planning" if args.budget else "applying the plan"):
        if args.plan:
            plan = Plan.load(args.plan)
            apply_plan(model, plan)
        else:
            plan = _optimize(args, model, inputs, loss_fn)
    with err.status("running plain and checkpointed steps"):
        report = check_equivalence(model, inputs, loss_fn=loss_fn, rtol=args.rtol, atol=args.atol)
        measured = measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=factory,
                                output_alive=not args.output_dropped)
    out.print(str(report), markup=False, highlight=False)
    met = "" if plan.budget_bytes is None else (" (within budget)" if measured.peak_bytes <= plan.budget_bytes
                                                else " (OVER BUDGET)")
    out.print(f"measured peak {fmt_bytes(measured.peak_bytes)}{met}; predicted {fmt_bytes(plan.predicted_peak_bytes)}; "
              f"budget {fmt_bytes(plan.budget_bytes)}", markup=False)
    return 0 if report.equal else 1


COMMANDS = {"tradeoff": cmd_tradeoff, "plan": cmd_plan, "profile": cmd_profile, "verify": cmd_verify,
            "maxbatch": cmd_maxbatch, "accuracy": cmd_accuracy, "calibrate": cmd_calibrate}


def _join_ranks(device: str | None = None) -> int:
    """Under torchrun, join the default process group (if the caller has not); returns this rank (0 alone).
    ``device``: --device; ``cpu`` joins with gloo even where CUDA is available (NCCL moves no CPU tensor)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and device != "cpu"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out, err = _console()
    try:
        if _join_ranks(getattr(args, "device", None)) != 0:  # one rank speaks for all
            out, err = _quiet(out), _quiet(err)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.command == "verify":
            raise UsageError("remat verify compares deep copies of the model, which a model sharded or replicated "
                             "across ranks does not support: under torchrun use remat plan or remat tradeoff (each "
                             "rank's measured peak), and tests/integration/test_distributed.py for gradients")
        return COMMANDS[args.command](args, out, err)
    except (UsageError, RematError) as e:
        if args.debug:
            raise
        msg = " ".join(str(e).split())
        print(f"remat: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
