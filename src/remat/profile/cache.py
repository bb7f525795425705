"""The timing cache: measured times of a training step kept on disk, so that the same step gets the same plan.

Note [Timing cache]
~~~~~~~~~~~~~~~~~~~
Memory is recorded exactly, but times are measured, and measured times move by a few percent from run to
run. Where two plans cost nearly alike (a transformer's `h.2.attn` + `h.3[ln_1:ln_2]` against
`h.2[ln_1:ln_2]` + `h.3.attn`; an MLP against the region that also holds its layer norm), that noise
decided which one the solver took: three profiles of the built-in GPT gave one plan at 2 of 10 budgets
(issue #24). Stable menus (Note [Policy menus]) and twins' shared times (Note [Twins share their times] in
remat.costs.recording) remove the noise *within* one profile; this removes it *between* profiles, the way
autotuners do (cuDNN's benchmark cache, Inductor's autotuning cache): the first profile of a step stores
what its timed steps measured, and a later profile of the same step on the same machine reads them
instead of timing again. So the same model, batch and loop on the same machine get the same costs, hence
the same plan, and the later profiles skip the timed steps (the largest part of profiling: issue #23).

*The same step* is decided from what the recording saw, never from the user's objects: every forward
operator with the sizes, shapes and dtypes of what it created, the units and their spans, the units
timed and those checkpointed while timing, the example inputs' shapes, the loop's timing settings, and
the machine (host, device name, threads, torch and remat versions, the rank in a process group). Weights
do not enter (times do not depend on values). A changed model, batch, dtype or device is another key;
times measured on a machine busier than now are not detected: delete the cache to measure again.

Where: ``$REMAT_CACHE_DIR`` or ``$XDG_CACHE_HOME/remat`` or ``~/.cache/remat`` (``timings/``, one JSON
file per step). ``REMAT_CACHE=0`` turns it off (read nothing, write nothing). A file that cannot be read
or written is ignored: the cache never fails a call. The plan's notes say when times came from it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from remat.costs.host_time import HostWork
from remat.costs.recording import CheckpointOverhead, Recording, UnitTimes

log = logging.getLogger(__name__)

#: bumped when what a cached entry means changes: 2, a long step's times are the lesser of two hooked steps after
#: the logging one (Note [Long steps are timed twice] in remat.profile.timing), not the logging step's
FORMAT = 2
#: what :func:`device_rates` measures: 2 added the bfloat16 and float16 product rates, 4 times the class samples
#: over 40 steps, three times
RATES_VERSION = 4
#: what :func:`overhead` measures: 2 measures it on one thread, the least of interleaved readings (issue #60: the
#: median of 30 readings in a row on two loaded cores read a selective operator at 0 and at 124 us minutes apart)
OVERHEAD_VERSION = 2


def cache_dir() -> Path | None:
    """The directory of the timing cache, or None when ``REMAT_CACHE=0`` turns it off."""
    if os.environ.get("REMAT_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    root = os.environ.get("REMAT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "remat")
    return Path(root) / "timings"


def machine(device: torch.device) -> dict[str, Any]:
    """What decides the times on this machine besides the step itself."""
    from remat._compat.versions import REMAT_VERSION as __version__

    m: dict[str, Any] = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                         "threads": torch.get_num_threads(), "torch": torch.__version__, "remat": __version__,
                         "device": str(device)}
    if device.type == "cuda":
        m["device_name"] = torch.cuda.get_device_name(device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        m["rank"], m["world"] = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return m


def _digest(fields: Any) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


def step_key(rec: Recording, timed: Sequence[str], checkpointed: Sequence[str], device: torch.device,
             inputs: Sequence[torch.Tensor], **settings: Any) -> str:
    """The key of one step's times (Note [Timing cache]): ``timed``, the units timed; ``checkpointed``, those
    checkpointed while timing; ``inputs``, the example inputs; ``settings``, the timing loop's settings."""
    ops = [(op.name, op.random, [None if s is None else (rec.storages[s].nbytes, rec.storages[s].shape,
                                                          rec.storages[s].dtype) for s in op.created])
           for op in rec.forward_ops]
    return _digest({
        "format": FORMAT, "machine": machine(device), "ops": ops, "backward_start": rec.backward_start,
        "n_ops": rec.n_ops, "spans": sorted(rec.spans.items()), "timed": list(timed),
        "checkpointed": list(checkpointed), "settings": settings,
        "inputs": [(tuple(t.shape), str(t.dtype), str(t.device)) for t in inputs],
    })


def _path(kind: str, key: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root / f"{kind}-{key}.json"


def _read(kind: str, key: str) -> dict[str, Any] | None:
    path = _path(kind, key)
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
        if entry.get("format") != FORMAT:
            return None
        entry["path"] = str(path)
        return entry
    except (OSError, ValueError) as e:
        log.info("remat's timing cache: %s unreadable (%s); measuring again", path, e)
        return None


def _write(kind: str, key: str, entry: dict[str, Any]) -> None:
    path = _path(kind, key)
    if path is None:
        return
    entry = {"format": FORMAT, "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), **entry}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{kind}-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)  # atomic: ranks of one host writing at once never leave half a file
    except OSError as e:
        log.info("remat's timing cache: cannot write %s (%s); times not kept", path, e)


def load_times(key: str) -> tuple[UnitTimes, dict[int, float], str] | None:
    """The cached times of a step: (per-unit times, per-forward-operator seconds, a note saying where from)."""
    entry = _read("step", key)
    if entry is None:
        return None
    try:
        t = entry["times"]
        times = UnitTimes(forward_s=t["forward_s"], recompute_s=t["recompute_s"], backward_s=t["backward_s"],
                          mutated_buffers={k: tuple(v) for k, v in t["mutated_buffers"].items()},
                          step_forward_s=float(t["step_forward_s"]), step_backward_s=float(t["step_backward_s"]))
        seconds = {int(i): float(s) for i, s in entry["op_seconds"].items()}
    except (KeyError, TypeError, ValueError) as e:
        log.info("remat's timing cache: %s malformed (%s); measuring again", entry["path"], e)
        return None
    return times, seconds, (f"times read from remat's timing cache ({entry['path']}, measured "
                            f"{entry.get('measured_at', '?')}; Note [Timing cache]): delete it, or set REMAT_CACHE=0, "
                            "to measure them again")


def store_times(key: str, times: UnitTimes, op_seconds: Mapping[int, float]) -> None:
    _write("step", key, {"times": {
        "forward_s": dict(times.forward_s), "recompute_s": dict(times.recompute_s),
        "backward_s": dict(times.backward_s), "mutated_buffers": {k: list(v) for k, v in times.mutated_buffers.items()},
        "step_forward_s": times.step_forward_s, "step_backward_s": times.step_backward_s,
    }, "op_seconds": {str(i): s for i, s in op_seconds.items()}})


def overhead(device: torch.device, measure: Callable[[], CheckpointOverhead]) -> CheckpointOverhead:
    """Checkpoint's bookkeeping on this machine (Note [Checkpoint overhead] in remat.profile.timing): cached
    like a step's times, since it costs every unit; ``measure()`` measures it."""
    key = _digest({"format": FORMAT, "machine": machine(device), "overhead": OVERHEAD_VERSION})
    entry = _read("overhead", key)
    if entry is not None:
        try:
            return CheckpointOverhead(**entry["overhead"])
        except (KeyError, TypeError):
            pass
    found = measure()
    _write("overhead", key, {"overhead": {"per_call_s": found.per_call_s, "per_saved_tensor_s": found.per_saved_tensor_s,
                                          "per_selective_op_s": found.per_selective_op_s,
                                          "held_bytes": found.held_bytes}})
    return found


def device_rates(measure: Callable[[], dict[str, float]]) -> tuple[dict[str, float], str]:
    """This machine's CPU rates for the time model (remat.target.timing.measure_cpu: matmul FLOP/s, copy
    bandwidth, the shortest operator), cached like a step's times; ``measure()`` measures them. Returns the rates
    and where they came from."""
    key = _digest({"format": FORMAT, "machine": machine(torch.device("cpu")), "rates": RATES_VERSION})
    entry = _read("rates", key)
    if entry is not None:
        try:
            return {k: float(v) for k, v in entry["rates"].items()}, (
                f"read from remat's timing cache ({entry['path']}, measured {entry.get('measured_at', '?')})")
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    found = measure()
    _write("rates", key, {"rates": found})
    return found, "measured now"


def paired_key(device: torch.device, step: Any, plans: Sequence[Sequence[str]]) -> str:
    """The key of plans timed side by side (Note [Plans timed beside the hand rules] in remat.api.hand_rules): the
    machine, ``step`` (what the planner knew of the step: its units' timed costs, JSON-able) and the plans' units.
    A profile whose times came from this cache gives the same ``step`` again, so the same pairs are read back."""
    return _digest({"format": FORMAT, "machine": machine(device), "step": step, "plans": [list(p) for p in plans]})


def load_paired(key: str) -> tuple[list[tuple[float, ...]], list[float | None], str] | None:
    """Paired step times stored under ``key`` (one tuple per plan, in rounds: a rule decided early has fewer, one
    decided by the checked steps none), each plan's checked step's seconds (None: unknown), and a note saying where
    from."""
    entry = _read("paired", key)
    if entry is None:
        return None
    try:
        times = [tuple(float(s) for s in ts) for ts in entry["times"]]
        checked = [None if s is None else float(s) for s in entry["checked_s"]]
    except (KeyError, TypeError, ValueError):
        return None
    return times, checked, (f"read from remat's timing cache ({entry['path']}, measured "
                            f"{entry.get('measured_at', '?')}; Note [Timing cache]): the same plans of the same step "
                            "measured before on this machine")


def store_paired(key: str, times: Sequence[Sequence[float]], checked_s: Sequence[float | None] = ()) -> None:
    """Keep ``times`` (:func:`load_paired`'s) and each plan's checked step's seconds under ``key``."""
    _write("paired", key, {"times": [list(ts) for ts in times], "checked_s": list(checked_s)})


def model_error(key: str, measure: Callable[[], tuple[float, str] | None]) -> tuple[float, str] | None:
    """The time model's error measured on a step's checked plans and what it was read from (Note [The model's
    measured error] in remat.api.margins), stored under ``key`` (:func:`paired_key` of the step and the plans
    compared): a later call whose profile read its times from this cache reads the same error, so it times the same
    rules and returns the same plan; ``measure()`` gives it where not stored (None: nothing measured, nothing kept)."""
    entry = _read("error", key)
    if entry is not None:
        try:
            return float(entry["error"]), f"{entry['source']}; read from remat's timing cache ({entry['path']})"
        except (KeyError, TypeError, ValueError):
            pass
    found = measure()
    if found is not None:
        _write("error", key, {"error": found[0], "source": found[1]})
    return found


def host_work(rec: Recording, where: str, measure: Callable[[], HostWork]) -> HostWork:
    """The model's own host work in a step recorded for a modelled target (remat.profile.host_work), cached under
    the recorded step and ``where`` (the target): a modelled plan depends on no measurement of this run, so the
    same model, batch and target get the same plan again (Note [Timing cache]); ``measure()`` measures it."""
    ops = [(op.name, [None if s is None else (rec.storages[s].nbytes, rec.storages[s].shape) for s in op.created])
           for op in rec.forward_ops]
    key = _digest({"format": FORMAT, "machine": machine(torch.device("cpu")), "ops": ops, "where": where,
                   "backward_ops": [op.name for op in rec.backward_ops], "host_work": 1})
    entry = _read("host", key)
    if entry is not None:
        try:
            found = HostWork(**entry["work"])
            return dataclasses.replace(found, source=f"{found.source}; read from remat's timing cache "
                                                     f"({entry['path']}, measured {entry.get('measured_at', '?')})")
        except (KeyError, TypeError):
            pass
    found = measure()
    _write("host", key, {"work": dataclasses.asdict(found)})
    return found
