"""``remat accuracy TARGET``: remat's prediction for the GPU here beside the same plans run on it (issue #55).

In: the parsed command line (TARGET, ``--device`` the spec to predict for, default this GPU's; ``--budget``,
``--steps``, ``--json``, the loop's flags as the other commands take them). Out: a table of predicted and
measured allocated and reserved peaks and step times per plan, a caption saying which figures are which, and the
rows as JSON. The work is :func:`remat.sweeps.accuracy.check_prediction`'s; this module parses and prints."""

from __future__ import annotations

import argparse
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from remat._compat.versions import REMAT_VERSION as __version__
from remat.cli.common import OPTIMIZERS, UsageError, _gib_list, parsed_device
from remat.costs.unit_costs import is_selective
from remat.solve.plan import fmt_bytes


def add_accuracy(sub, common: argparse.ArgumentParser) -> None:
    """The ``accuracy`` subcommand's parser."""
    a = sub.add_parser("accuracy", parents=[common],
                       help="on a CUDA GPU: remat's prediction for it beside the same plans run on it",
                       description="Predict the target's hand rules and remat's plans for this GPU as remat predicts "
                                   "a GPU that is not here (fake tensors; --device: the spec, default this GPU's "
                                   "from the device table), then run each plan for real here and print predicted "
                                   "and measured allocated and reserved peaks and step times side by side.")
    a.add_argument("--budget", "--budgets", type=_gib_list, default=[], dest="budgets",
                   help="GiB, comma-separated: remat's plans for these budgets too (always: the least and the "
                        "halfway budget)")
    a.add_argument("--steps", type=int, default=4,
                   help="real training steps per plan (default 4; peaks and median step time over steps 2..N)")
    a.add_argument("--json", type=Path, help="write every row with all fields to this file")
    # Note [What the check measures] in remat.sweeps.accuracy: tests run the command with the measuring half on
    # a CPU; its figures are remat's CPU meter's, labelled so, never a GPU's
    a.add_argument("--measure-on", default=None, help=argparse.SUPPRESS)


def _spec(args):
    """The spec to predict for and how it was chosen (None, "cuda" or "cuda:N": this GPU's)."""
    from remat.target.this_gpu import spec_here
    from remat.target.spec_file import device_spec

    device = args.device
    if device is None or device == "cuda" or device.startswith("cuda:"):
        return spec_here(device)
    if device == "cpu":
        raise UsageError("remat accuracy predicts for a GPU and runs the plans on it: leave out --device for this "
                         "GPU's spec from the table, or name a GPU (--device h200) or a JSON spec")
    return device_spec(device), "given with --device"


def cmd_accuracy(args, out, err) -> int:
    from remat.cli.targets import resolve_target
    from remat.sweeps.accuracy import check_prediction
    from remat.target.this_gpu import cuda_required

    if args.world != 1 or args.tp != 1 or args.fsdp not in (None,):
        raise UsageError("remat accuracy runs the plans on this one GPU: --world 1, no --fsdp or --tp (a world that "
                         "is not here is planned with remat plan or remat tradeoff --device GPU --world N)")
    if args.offload:
        raise UsageError("remat accuracy checks checkpointing plans; --offload is not checked yet "
                         "(benchmarks/gpu/offload_gpu.py measures offloading on a GPU)")
    if args.steps < 2:
        raise UsageError(f"--steps must be 2 or more (the first step is not read), got {args.steps}")
    here = args.device if (args.device or "").startswith("cuda") else "cuda"  # (--device cuda:N: that GPU)
    measure_on = parsed_device(args.measure_on or here, "remat accuracy runs the plans on the CUDA GPU here: "
                                                        "--device cuda or cuda:N, or the GPU's name or spec file")
    if measure_on.type == "cuda" and not torch.cuda.is_available():
        raise cuda_required()
    if measure_on.type == "cpu":
        if args.device in (None, "cuda") or args.device.startswith("cuda:"):
            raise UsageError("--measure-on cpu (a test) needs the spec to predict for: --device GPU")
        from remat.target.spec_file import device_spec

        spec, how = device_spec(args.device), "given with --device"
    else:
        spec, how = _spec(args)
    options = dict(layers=args.layers, batch_size=args.batch_size, seq_len=args.seq_len, d_model=args.d_model,
                   image_size=args.image_size, depth=args.depth)
    described: list[str] = []

    def build(device: torch.device):
        model, inputs, loss_fn, desc = resolve_target(args.target, device=device, options=options)
        described.append(desc)
        return model, inputs, loss_fn

    out.print(f"[bold]remat[/bold] {__version__} · target {args.target} · predicted for {spec} ({how}) · measured "
              f"on {measure_on} · optimizer {args.optimizer} · torch {torch.__version__}")
    with err.status("predicting") as st:
        result = check_prediction(build, device=spec, optimizer_factory=OPTIMIZERS[args.optimizer],
                                  output_alive=not args.output_dropped, budgets_gb=args.budgets, steps=args.steps,
                                  time_limit_s=args.time_limit, measure_on=measure_on, progress=st.update)
    result = _with_source(result, how)
    out.print(accuracy_table(result))
    out.print(caption(result), markup=False, highlight=False)
    for note in result.notes:
        out.print(f"note: {note}", markup=False, highlight=False)
    for r in result.rows:
        if r.error:
            out.print(f"{r.label}: {r.error}", markup=False, highlight=False)
    if args.json:
        data = result.to_dict()
        data["meta"] = dict(target=described[0] if described else args.target, optimizer=args.optimizer,
                            output_alive=not args.output_dropped, remat=__version__, torch=torch.__version__,
                            machine=platform.platform(), date=datetime.now(timezone.utc).isoformat())
        import json

        args.json.write_text(json.dumps(data, indent=2))
        out.print(f"rows written to {args.json}")
    return 0


def _with_source(result, how: str):
    import dataclasses

    return dataclasses.replace(result, spec_source=how)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def accuracy_table(result):
    """The rows as a rich table: per plan, units, then allocated, reserved and step time, each predicted,
    measured and the error (predicted / measured - 1)."""
    from rich.table import Table

    table = Table(title=f"remat's prediction for {result.spec} beside the plans run on {result.measured_on}",
                  title_justify="left")
    for col, just in [("plan", "left"), ("units", "right"),
                      ("allocated\npredicted", "right"), ("allocated\nmeasured", "right"),
                      ("allocated\nerror", "right"),
                      ("reserved\npredicted", "right"), ("reserved\nmeasured", "right"), ("reserved\nerror", "right"),
                      ("step time\npredicted", "right"), ("step time\nmeasured", "right"),
                      ("step time\nerror", "right")]:
        table.add_column(col, justify=just, no_wrap=True)
    for r in result.rows:
        sel = sum(is_selective(u) for u in r.checkpointed)
        units = f"{len(r.checkpointed)}" + (f" ({sel} @ops)" if sel else "")
        failed = "[red]OOM[/red]" if r.error else "-"
        table.add_row(r.label, units,
                      fmt_bytes(r.predicted_allocated_peak_bytes) + (" (OOM)" if r.predicted_oom else ""),
                      fmt_bytes(r.measured_allocated_peak_bytes) if r.measured_allocated_peak_bytes is not None
                      else failed, _pct(r.allocated_error),
                      fmt_bytes(r.predicted_reserved_peak_bytes), fmt_bytes(r.measured_reserved_peak_bytes),
                      _pct(r.reserved_error),
                      _ms(r.predicted_step_time_s), _ms(r.measured_step_time_s), _pct(r.step_time_error))
    return table


def caption(result) -> str:
    """Which figures are predicted (for which spec, how) and which measured (by what, where)."""
    steps = f"steps 2-{result.steps} of {result.steps}"
    measured = (f"measured on {result.measured_on}: {result.meter}, over {steps} from parameters and batch on (the "
                f"peaks reset after step 1), step time the median of {steps}, each between two synchronizations")
    return (f"predicted on this machine for {result.spec} ({result.spec_source}), not measured: the step recorded "
            f"on fake tensors, the peaks by replaying the CUDA caching allocator over two steps, step time by the "
            f"device's time model (docs/targets.md). {measured}. Error: predicted / measured - 1 (positive: "
            f"predicted over).")
