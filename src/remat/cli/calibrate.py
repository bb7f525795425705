"""``remat calibrate``: measure the CUDA GPU here into a device spec file (issue #56) that ``--device FILE`` and
``Target(device=FILE)`` take.

In: ``--out FILE``, ``--base NAME`` (a built-in device the file derives from; default: the table's entry torch's
name for the GPU matches, none if it matches none; ``none``: every peak measured), ``--name``, ``--quick``. Out:
the figures measured, the file written. The measurements are remat.target.measure_device's, the mapping to the
spec's fields remat.target.calibration's (Note [Calibrated fields]); this module parses and prints."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from remat._compat.versions import REMAT_VERSION as __version__
from remat.cli.common import UsageError, parsed_device
from remat.target.calibration import flops_text
from remat.target.this_gpu import cuda_required, named_in_table


def add_calibrate(sub) -> None:
    """The ``calibrate`` subcommand's parser."""
    c = sub.add_parser("calibrate", help="on a CUDA GPU: measure it into a device spec file for --device FILE",
                       description="Measure the CUDA GPU here in a minute or less (products by dtype and size, "
                                   "elementwise and reduction bandwidth, attention, the optimizer's foreach "
                                   "kernels, the host's cost per operator below the model's own work, "
                                   "pinned and pageable copies each way, the memory torch sees) and write a device "
                                   "spec file: plan for this GPU, or a cluster of it, with --device FILE.")
    c.add_argument("--out", type=Path, default=None,
                   help="the spec file to write (default: NAME.json here)")
    c.add_argument("--base", default=None,
                   help="a built-in device the GPU is (its datasheet peaks, links and notes carried; default: the "
                        "table's entry torch's name for the GPU matches); 'none': every peak measured")
    c.add_argument("--name", default=None,
                   help="the device's name in the file (default: BASE-calibrated, or GPU-calibrated from torch's name "
                        "of the GPU where there is no base)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about a third of the time)")
    c.add_argument("--device", default="cuda", help="the GPU to measure (default: cuda, the current one)")
    c.add_argument("--debug", action="store_true", help="show tracebacks")
    # the tests run the whole pipeline on the CPU (tiny sizes, labelled: NOT a GPU calibration)
    c.add_argument("--measure-on", default=None, help=argparse.SUPPRESS)


def _base(args, gpu_name: str | None):
    """The built-in spec the file derives from and how it was chosen, or (None, why)."""
    from remat.target.devices import ALIASES, KNOWN, spec_key

    if args.base is not None:
        if args.base.lower() == "none":
            return None, "--base none: every peak measured"
        if spec_key(args.base) not in ALIASES:
            raise UsageError(f"--base {args.base}: not a built-in device; the built-in ones: {', '.join(KNOWN)} "
                             f"(or --base none)")
        return KNOWN[ALIASES[spec_key(args.base)]], "given with --base"
    if gpu_name is None:
        return None, "no base (the CPU test run)"
    found = named_in_table(gpu_name)
    if found is not None:
        return found
    return None, f"{gpu_name!r} is not in the table: every peak measured"


def cmd_calibrate(args, out, err) -> int:
    from remat.target.calibration import calibrated_file
    from remat.target.measure_device import measure
    from remat.target.spec_file import spec_from_mapping

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("remat calibrate measures one GPU: run it without torchrun")
    device = parsed_device(args.measure_on or args.device, "remat calibrate measures the CUDA GPU here: --device "
                                                            "cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise cuda_required("remat calibrate", "measures")
    if device.type not in ("cuda", "cpu") or (device.type == "cpu" and args.measure_on is None):
        raise UsageError(f"--device {args.device}: remat calibrate measures a CUDA GPU (cuda or cuda:N)")
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    base, how = _base(args, gpu_name)
    out.print(f"[bold]remat[/bold] {__version__} · calibrating {gpu_name or 'the CPU (a test run, not a GPU)'} · "
              f"base {base.name if base else 'none'} ({how}) · torch {torch.__version__}")
    with err.status("measuring") as st:
        measured = measure(device, quick=args.quick, progress=lambda s: st.update(f"measuring {s}"))
    data = calibrated_file(measured, base, name=args.name)
    path = args.out or Path(f"{data['name']}.json")
    spec = spec_from_mapping(json.loads(json.dumps(data)), where=str(path))  # as the file will read back
    path.write_text(json.dumps(data, indent=1) + "\n")
    out.print(measurements_table(measured))
    out.print(fields_table(spec, base))
    label = "" if measured.environment.is_gpu else " (a CPU test run: NOT a GPU calibration)"
    out.print(f"spec {spec.name} written to {path}{label} in {measured.seconds:.0f} s: plan for it with "
              f"remat plan TARGET --budget GIB --device {path} (--world N for a cluster of it) or "
              f"Target(device={str(path)!r})", markup=False, highlight=False)
    return 0


def measurements_table(m):
    """The raw figures as a rich table: what was measured, the rate reached."""
    from rich.table import Table

    table = Table(title="measured" + ("" if m.environment.is_gpu else " (on the CPU: a test run)"),
                  title_justify="left")
    for col, just in (("what", "left"), ("measured", "right"), ("rate", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    for g in m.gemm:
        table.add_row(f"product {g.dtype} {g.size}^3", f"{g.seconds * 1e3:.3f} ms", flops_text(g.flops_per_s))
    for s in m.samples:
        rate = (flops_text(s.flops / s.seconds) if s.op_class == "attention"
                else f"{s.bytes_accessed / s.seconds / 1e9:.1f} GB/s")
        table.add_row(f"{s.op_class}: {s.label}", f"{s.seconds * 1e3:.3f} ms", rate)
    h = m.host
    for i, phase in enumerate(("forward", "backward")):
        for what, v in ((f"host: the blocks' {phase}", h.wall_s[i]),
                        ("host: of it the blocks' own work", h.python_s[i]),
                        (f"host: a {phase} operator ({h.ops[i]})", (h.forward_op_s, h.backward_op_s)[i])):
            table.add_row(what, f"{v * 1e6:.2f} us", "")
    if m.shortest_kernel_s is not None:
        table.add_row("the shortest kernel (CUDA graph replay)", f"{m.shortest_kernel_s * 1e6:.2f} us", "")
    for c in m.copies:
        table.add_row(f"copy {c.direction.replace('_', ' ')}, {'pinned' if c.pinned else 'pageable'}",
                      f"{c.seconds * 1e3:.3f} ms", f"{c.bytes_per_s / 1e9:.1f} GB/s")
    return table


def fields_table(spec, base):
    """The spec's fields the time model reads, each measured here or carried from the base."""
    from rich.table import Table

    table = Table(title=f"the spec {spec.name}", title_justify="left")
    for col, just in (("field", "left"), ("value", "right"), ("from", "left")):
        table.add_column(col, justify=just, no_wrap=True)

    def source(field: str) -> str:
        notes = spec.sources_of(field)
        if not notes:
            return "the time model's own figure"
        return "carried from the base" if notes[0][1].startswith("carried from the base") else "measured here"

    for field in ("memory_bytes", "bf16_flops_per_s", "fp16_flops_per_s", "tf32_flops_per_s", "fp32_flops_per_s",
                  "hbm_bytes_per_s", "device_to_host_bytes_per_s", "host_to_device_bytes_per_s",
                  "host_forward_op_s", "host_backward_op_s", "shortest_kernel_s"):
        value = getattr(spec, field)
        if value is None:
            continue
        text = (f"{value:,}" if field == "memory_bytes" else flops_text(value) if field.endswith("_flops_per_s")
                else f"{value / 1e9:.1f} GB/s" if field.endswith("_bytes_per_s") else f"{value * 1e6:.2f} us")
        table.add_row(field, text, source(field))
    for cls, compute, memory in spec.efficiency:
        table.add_row(f"efficiency.{cls}", ", ".join(f"{k} {v:.3f}" for k, v in (("compute", compute),
                                                                                  ("memory", memory)) if v is not None),
                      source(f"efficiency.{cls}"))
    return table
