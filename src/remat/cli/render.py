"""The tables and footers the ``remat`` commands print.

In: what a command measured (``remat tradeoff``'s :class:`~remat.sweeps.rows.TradeoffRow` rows, ``remat
profile``'s :class:`~remat.costs.unit_costs.Profile` and its planner), the device and the parsed command line.
Out: rich tables and lines printed on the console ``out``. Used by the commands in :mod:`remat.cli`."""

from __future__ import annotations

from remat.costs.unit_costs import is_selective
from remat.solve.plan import fmt_bytes, policy_summary


def _tradeoff_table(rows):
    """``remat tradeoff``'s table: one line per row, with a column of per-rank peaks under torch.distributed."""
    from rich.table import Table

    table = Table(title="memory / step-time tradeoff of one training step", title_justify="left")
    for col, just in [("budget", "right"), ("strategy", "left"), ("units", "right"),
                      ("peak\npredicted", "right"), ("peak\nmeasured", "right"), ("budget\nmet", "center"),
                      ("step time\npredicted", "right"), ("step time\nmeasured", "right"),
                      ("overhead\nmeasured", "right"), ("solve\ntime", "right")]:
        table.add_column(col, justify=just, no_wrap=True)
    per_rank = any(r.measured_peak_per_rank_bytes for r in rows)
    if per_rank:
        table.add_column("peak measured\nper rank (MiB)", justify="right", no_wrap=True)
    for r in rows:
        ms = (lambda s: "-" if s is None else f"{s * 1e3:.1f} ms")
        table.add_row(
            fmt_bytes(r.budget_bytes), r.strategy if r.status != "infeasible" else f"{r.strategy} (infeasible)",
            (f"{r.units}" + (f" ({sel} @ops)" if (sel := sum(is_selective(u) for u in r.checkpointed)) else ""))
            if r.status != "infeasible" else "-",
            fmt_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes is not None else r.note,
            fmt_bytes(r.measured_peak_bytes), {True: "yes", False: "[red]NO[/red]", None: "-"}[r.budget_met],
            ms(r.predicted_step_time_s), ms(r.measured_step_time_s),
            "-" if r.measured_overhead is None else f"{r.measured_overhead:+.1%}",
            "-" if r.solve_time_s is None else f"{r.solve_time_s:.2f} s",
            *([" / ".join(f"{p / 2**20:.2f}" for p in r.measured_peak_per_rank_bytes) or "-"] if per_rank else []),
        )
    return table


def _compiled_footer(out, compile: dict, device, args) -> None:
    """What a compiled table's figures are (Note [Compiled tradeoff] in remat.sweeps.report)."""
    settings = ", ".join(f"{k}={v}" for k, v in compile.items())
    out.print(f"every row compiled with torch.compile ({settings}): peak measured on a "
              f"compiled step ({'the CUDA allocator' if device.type == 'cuda' else 'the profiler allocator-level memory events'}, "
              "optimizer as profiled); predicted: remat's calibrated compiled prediction, made before the plan was "
              f"measured; step time the median of {args.repeats} compiled forward and backward passes plus the "
              "profiled optimizer step. Hand rules' peaks are the measured points the calibration starts from.")


def _eager_footer(out, rows, profile, device, args, planner_min) -> None:
    per_rank = any(r.measured_peak_per_rank_bytes for r in rows)
    out.print(f"predicted: remat's memory model over one profile (capture: {profile.capture_path}, memory "
              f"recorded on {profile.memory_recorded_with} tensors); measured: real training steps, peak as "
              f"{'the CUDA allocator' if device.type == 'cuda' else 'live tensor storages (CPU)'}, step time the "
              + (f"median of {args.repeats} steps, the slowest rank's, each plan measured in place on every rank "
                 f"(the target's model is trained by these steps). " if per_rank else
                 f"median of {2 * args.repeats if device.type == 'cpu' else args.repeats} steps"
                 f"{' (plans interleaved round-robin, each applied in turn to one copy of the model)' if device.type == 'cpu' else ''}. ")
              + f"Least achievable peak (predicted): {fmt_bytes(planner_min)}."
              + (" remat-op: remat's plan with selective units allowed; (k @ops): k units checkpointed "
                 "selectively (keeping some operators' outputs)." if any(r.strategy == "remat-op" for r in rows)
                 else ""))
    timed = {r.checkpointed: r.measured_step_times_s for r in rows if r.measured_step_times_s}
    out.print(f"timing: {sum(map(len, timed.values()))} timed steps of {len(timed)} plans, "
              f"{sum(map(sum, timed.values())):.1f} s measured (after the warm-up; each plan once however many "
              "budgets: remat's rows are compared with the hand rules on these same steps, none of their own, Note "
              "[Plans timed beside the hand rules] in remat.api.hand_rules)")
    for r in rows:
        if r.strategy.startswith("remat") and r.status != "infeasible" and r.note:
            out.print(f"{r.strategy} at {fmt_bytes(r.budget_bytes)}: {r.note}")


def _print_profile(out, profile, planner) -> None:
    """``remat profile``'s printout: the capture path and the plain step, fixed memory, the predicted peaks,
    the table of units and the profile's notes."""
    from rich.table import Table

    out.print(f"capture: {profile.capture_path}; memory recorded on {profile.memory_recorded_with} tensors; "
              f"measured plain step {profile.step_time_s * 1e3:.1f} ms (forward {profile.forward_s * 1e3:.1f}, "
              f"backward {profile.backward_s * 1e3:.1f}, optimizer {profile.optimizer_s * 1e3:.1f})")
    out.print(f"fixed memory: parameters {fmt_bytes(profile.params_bytes)}, gradients {fmt_bytes(profile.grads_bytes)}, "
              f"optimizer state [{profile.optimizer}] {fmt_bytes(profile.optimizer_state_bytes)}, buffers "
              f"{fmt_bytes(profile.buffers_bytes)}, inputs {fmt_bytes(profile.inputs_bytes)}")
    out.print(f"peak (predicted): {fmt_bytes(planner.baseline_peak_bytes)} without checkpointing, "
              f"{fmt_bytes(planner.min_peak_bytes)} at least")
    table = Table(title=f"units: times measured (a segment's recompute derived from its parts; a selective "
                        f"@ops unit's from its operators' measured times), "
                        f"bytes recorded on {profile.memory_recorded_with} tensors", title_justify="left")
    for col in ["unit", "forward", "recompute", "backward", "GFLOP", "saved for bwd", "freed if ckpt", "note"]:
        table.add_column(col, justify="left" if col in ("unit", "note") else "right")
    ms = (lambda s: "-" if s is None else f"{s * 1e3:.2f} ms")
    for u in profile.units:
        note = u.excluded or ("" if u.drops else "frees nothing") or (policy_summary(u.saved_ops) if u.saved_ops else "")
        table.add_row(u.name, ms(u.forward_s), ms(u.recompute_s), ms(u.backward_s), f"{u.flops / 1e9:.3f}",
                      fmt_bytes(u.saved_bytes), fmt_bytes(u.droppable_bytes), note)
    out.print(table)
    for n in profile.notes:
        out.print(f"note: {n}")


def _predicted_table(rows, target):
    """``remat tradeoff --device GPU``'s table: every figure predicted for the target, none measured."""
    from rich.table import Table

    table = Table(title=f"memory / step-time tradeoff predicted for {target.describe()} (not measured)",
                  title_justify="left")
    for col, just in [("budget", "right"), ("strategy", "left"), ("units", "right"),
                      ("peak allocated\npredicted", "right"), ("peak reserved\npredicted", "right"),
                      ("fits the\ndevice", "center"), ("step time\npredicted", "right"),
                      ("overhead\npredicted", "right"), ("tokens/s per\ndevice, predicted", "right"),
                      ("MFU\npredicted", "right")]:
        table.add_column(col, justify=just, no_wrap=True)
    offloads = any(r.offloaded for r in rows)
    if offloads:
        for col in ("offloaded\nunits", "offloaded each\nway, predicted", "copies exposed\npredicted"):
            table.add_column(col, justify="right", no_wrap=True)
    base = rows[0].predicted_step_time_s if rows else 0.0
    for r in rows:
        table.add_row(fmt_bytes(r.budget_bytes), r.strategy, str(len(r.checkpointed)),
                      fmt_bytes(r.predicted_peak_bytes), fmt_bytes(r.predicted_reserved_bytes),
                      "yes" if r.fits_device else "[red]NO[/red]", f"{r.predicted_step_time_s * 1e3:.3f} ms",
                      f"{r.predicted_step_time_s / base - 1:+.1%}" if base > 0 else "-",
                      f"{r.predicted_tokens_per_s:,.0f}" if r.predicted_tokens_per_s is not None else "-",
                      f"{r.predicted_mfu:.1%}" if r.predicted_mfu is not None else "-",
                      *((str(len(r.offloaded)), fmt_bytes(r.predicted_offload_bytes),
                         f"{r.predicted_exposed_copy_s * 1e3:.1f} ms") if offloads else ()))
    return table
