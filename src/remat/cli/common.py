"""What every ``remat`` command shares: argument types, the device, the target, its profile, the consoles.

In: the parsed command line (an ``argparse.Namespace``; TARGET resolved by :mod:`remat.cli.targets`). Out: the
device, the target built on it (model, inputs, loss function, description), its profile after a warm-up, the rich
consoles (quiet on ranks other than 0), the header line, and :class:`UsageError` for a mistake on the command line
(one line, exit status 2). Used by the commands in :mod:`remat.cli`."""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import os
from pathlib import Path
from typing import Any

import torch

from remat._compat.versions import REMAT_VERSION as __version__
from remat.api import make_profile
from remat.rewrite import remove_checkpointing
from remat.api import validate
from remat.capture import composite_modules
from remat.check.steps import warm_up
from remat.rewrite import checkpoint_modules
from remat.cli.targets import resolve_target


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "none": None,
}


class UsageError(Exception):
    """A mistake on the command line: reported in one line, exit status 2."""


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"a budget must be a positive number of GiB, got {text!r}")
    return value


def _gib_list(text: str) -> list[float]:
    return [_gib(t.strip()) for t in text.split(",") if t.strip()]


def _compile_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                        help="the loop trains the model under torch.compile (default backend: inductor): plan and "
                             "check the compiled step (1-8 compiles per budget)")
    parser.add_argument("--compile-mode", metavar="MODE", help="torch.compile mode the loop uses (with --compile)")


def _compile_setting(args) -> dict | bool:
    """``optimize_checkpointing``'s ``compile`` from --compile and --compile-mode (False: eager)."""
    backend, mode = getattr(args, "compile", None), getattr(args, "compile_mode", None)
    if mode and not backend:
        raise UsageError("--compile-mode goes with --compile")
    return {k: v for k, v in (("backend", backend), ("mode", mode)) if v} if backend else False


def _target_args(common: argparse.ArgumentParser) -> None:
    """--device, and the world of a target that is not here (--world, --fsdp, --tp)."""
    common.add_argument("--device", default=None,
                        help="where to run: cuda or cpu (default: cuda when available, else cpu); or a GPU to plan "
                             "for without running there, e.g. h100-80gb (remat plan only; docs/targets.md lists them, "
                             "or give a JSON file of your own)")
    world = common.add_argument_group("a world that is not here (with --device GPU)")
    world.add_argument("--world", type=int, default=1, help="ranks of the run (default 1)")
    world.add_argument("--fsdp", type=int, default=None, help="ranks sharding parameters with FSDP2 (default world/tp)")
    world.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (needs the target's parallelize)")


def _size_args(common: argparse.ArgumentParser) -> None:
    """The size of a built-in example (--layers, --batch-size, --seq-len, --d-model, --image-size, --depth)."""
    size = common.add_argument_group("size of a built-in example")
    size.add_argument("--layers", type=int, help="gpt: decoder blocks (default 4)")
    size.add_argument("--batch-size", "--batch", type=int, help="examples per batch")
    size.add_argument("--seq-len", "--seq", type=int, help="gpt: tokens per example (default 64)")
    size.add_argument("--d-model", type=int, help="gpt: width (default 128)")
    size.add_argument("--image-size", type=int, help="unet: image side in pixels (default 64)")
    size.add_argument("--depth", type=int, help="unet: down/up levels (default 3)")


def _modelled(args) -> Any:
    """The :class:`remat.target.Target` the command line plans for (``--device`` a GPU of the table or a JSON spec,
    ``--world``/``--fsdp``/``--tp``), or None to run here; the target's ``parallelize`` is added by :func:`_target`,
    which keeps the result as ``args.modelled`` for the command."""
    from remat.errors import RematError
    from remat.target import Target

    device = getattr(args, "device", None)
    if device in (None, "cuda", "cpu") or (device or "").startswith("cuda:"):
        if getattr(args, "world", 1) != 1 or getattr(args, "fsdp", None) or getattr(args, "tp", 1) != 1:
            raise UsageError("--world, --fsdp and --tp plan for a world that is not here: give the GPU with --device "
                             "(e.g. --device h100-80gb); under torchrun remat reads the real world")
        return None
    if args.command not in ("plan", "tradeoff"):
        raise UsageError(f"--device {device}: remat {args.command} runs the model here; for a GPU that is not here "
                         "use remat plan or remat tradeoff (--device cuda or cpu to run here)")
    try:
        return Target(device=device, world=args.world, fsdp=args.fsdp, tp=args.tp)
    except RematError as e:
        raise UsageError(str(e)) from None


def parsed_device(text: str, hint: str) -> torch.device:
    """``torch.device(text)``, or the command line's error saying what to give (``hint``)."""
    try:
        return torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device {text}: not a device torch knows here; {hint}") from None


def _device(arg: str | None) -> torch.device:
    if arg == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine; use --device cpu")
    device = parsed_device(arg or ("cuda" if torch.cuda.is_available() else "cpu"),
                           "cpu, cuda or cuda:N, or a GPU of the device table to plan for (docs/targets.md)")
    if device.type == "cuda" and device.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # one GPU per rank under torchrun
    return device


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _quiet(console):
    from rich.console import Console

    return Console(file=io.StringIO(), stderr=console.stderr)


def _console():
    from rich.console import Console

    out = Console()
    if not out.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        out = Console(width=160)
    return out, Console(stderr=True)


def _target(args) -> tuple[Any, Any, Any, str, torch.device]:
    """The target built (model, inputs, loss function, description, device); ``args.modelled``: the Target to plan
    for when it is not here (its model built on the meta device: no weights, docs/targets.md), else None."""
    modelled = _modelled(args)
    device = torch.device("meta") if modelled is not None else _device(args.device)
    options = dict(layers=args.layers, batch_size=args.batch_size, seq_len=args.seq_len, d_model=args.d_model,
                   image_size=args.image_size, depth=args.depth)
    model, inputs, loss_fn, desc, parallelize = resolve_target(args.target, device=device, options=options,
                                                                   with_parallelize=True)
    args.modelled = None if modelled is None else dataclasses.replace(modelled, parallelize=parallelize)
    return model, inputs, loss_fn, desc, device


def _profile(args, model, inputs, loss_fn, device, status):
    factory = OPTIMIZERS[args.optimizer]
    optimizer = factory(model.parameters()) if factory else None
    validate(model, 1.0, inputs)  # the user's mistakes before the warm-up runs the model
    warmup_s = getattr(args, "warmup", 0.0)
    if warmup_s > 0 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # (a deep copy: not for sharded models)
        # Note [Warm-up] in remat.sweeps.report: a fresh process runs its first steps slow, and profiling
        # measures times too. Warm up with the top-level composite modules checkpointed (little memory).
        status("warming up")
        comp = composite_modules(model)
        top = [c for c in comp if not any(c.startswith(o + ".") for o in comp)]
        checkpoint_modules(model, top)
        try:
            warm_up(model, inputs, loss_fn=loss_fn, optimizer_factory=factory, seconds=warmup_s)
        finally:
            remove_checkpointing(model)
    status(f"profiling {type(model).__name__} on {device}")
    return make_profile(model, inputs, loss_fn=loss_fn, optimizer=optimizer,
                        output_alive=not args.output_dropped), optimizer


def _header(out, desc: str, device: torch.device, args) -> None:
    target = getattr(args, "modelled", None)
    where = f"for {target.describe()} (modelled here, not run)" if target is not None else device
    out.print(f"[bold]remat[/bold] {__version__} · target {desc} · {where} · optimizer {args.optimizer} · "
              f"torch {torch.__version__}")


def _plot(out, path: Path, draw) -> None:
    """``draw(path)``, or the one-line usage error when matplotlib is missing."""
    try:
        draw(path)
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'remat[plot]'") from None
    out.print(f"plot written to {path}")
