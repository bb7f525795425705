"""A prediction for a GPU checked on the GPU here: remat's figures for this GPU's spec, made as for a GPU that is
not here (fake tensors, the CUDA caching allocator replayed, the device time model), beside the same plans run
for real on it (``remat accuracy``, :func:`check_prediction`; issue #55).

Two halves, each usable alone:

- :func:`predict_plans` (any machine): the hand rules (no checkpointing, every block, every second block) and
  remat's plans at the least and the halfway budget and at those given, each predicted for ``Target(device=spec,
  world=1)`` exactly as ``../shared/gpu/oracle/gpu_oracle_predict.py`` did -> :class:`PlanPrediction` rows;
- :func:`measure_plans_here` (the device): each plan applied to a fresh model built on the device, ``steps`` real
  training steps, the allocator's peaks over steps 2..N from parameters and batch on, the median step time
  -> :class:`PlanMeasurement` rows.

:func:`check_prediction` pairs them (:class:`AccuracyRow`) into a :class:`PredictionCheck`.

Note [What the check measures]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The measured figures are torch's own CUDA allocator statistics, not remat's meters: ``allocated_bytes.all.peak``
and ``reserved_bytes.all.peak`` of ``torch.cuda.memory_stats()``, absolute (parameters, batch, optimizer state,
library workspaces: all the allocator holds), the same quantities the prediction replays. The first step is not
read: it creates the optimizer's state and the libraries' workspaces (cuBLAS's, allocated at the first product
and kept for the process's life) and its peak differs from every later step's; the peaks are reset after it and
read over steps 2..N, and the step time is the median of steps 2..N, each step between two synchronizations.
The model is built on the device after the cache was emptied, so the reserved peak is the step's segments, as the
replay (which starts from an empty allocator) predicts it. Each row builds its own model and frees it (``gc``,
``empty_cache``) before the next; the cuBLAS workspaces made by the first row stay for the others, as they do in
a training process (the prediction counts them in every row).

On a CPU (tests only: ``measure_on="cpu"``, the command line's hidden ``--measure-on cpu``) the allocated peak
is remat's CPU meter (live tensor storages, :class:`~remat.runtime.meters.StepMeter`) and there is no reserved
figure: a test of the command's pairing and printing, not of a GPU prediction; the result says so.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from remat.errors import InfeasibleBudgetError, InvalidInputError, RematError
from remat.solve.plan import GiB, Plan
from remat.target.devices import DeviceSpec
from remat.target.spec_file import device_spec
from remat.target.this_gpu import cuda_required, describe_device, spec_here

#: ``build(device)`` -> ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``: the target built on
#: ``device`` (the meta device for the prediction, the GPU for each measured row)
Build = Callable[[torch.device], tuple]


@dataclass(frozen=True)
class PlanPrediction:
    """One plan predicted for the spec (bytes, seconds; predicted, not measured)."""

    #: "none", "every block", "every 2nd block", "remat least", "remat halfway", "remat @ 2.00 GiB"
    label: str
    plan: Plan
    #: the budget remat's plan was made for (None for a hand rule)
    budget_bytes: int | None
    #: the CUDA caching allocator's peaks replayed over two recorded steps (reserved None on a CPU target)
    predicted_allocated_peak_bytes: int
    predicted_reserved_peak_bytes: int | None
    predicted_step_time_s: float
    #: the replay ran out of the device's memory
    predicted_oom: bool


@dataclass(frozen=True)
class PlanMeasurement:
    """One plan run for real (bytes, seconds; measured): peaks over steps 2..N, absolute (Note [What the check
    measures]); None where the row failed (``error``) or the meter has no such figure (reserved on a CPU)."""

    measured_allocated_peak_bytes: int | None
    measured_reserved_peak_bytes: int | None
    measured_step_time_s: float | None
    #: bytes allocated and reserved once the model and batch were on the device, before the first step
    base_allocated_bytes: int | None
    base_reserved_bytes: int | None
    #: the units checkpointed in the model that was run, read from the model after the plan was applied
    checkpointed: tuple[str, ...]
    step_times_s: tuple[float, ...] = ()
    losses: tuple[float, ...] = ()
    #: what went wrong (an out-of-memory on the device), else None
    error: str | None = None


@dataclass(frozen=True)
class AccuracyRow:
    """A plan's predicted and measured figures side by side (bytes, seconds). The errors are
    ``predicted / measured - 1`` (positive: predicted over), None where a figure is missing."""

    label: str
    checkpointed: tuple[str, ...]
    budget_bytes: int | None
    predicted_allocated_peak_bytes: int
    predicted_reserved_peak_bytes: int | None
    predicted_step_time_s: float
    predicted_oom: bool
    measured_allocated_peak_bytes: int | None
    measured_reserved_peak_bytes: int | None
    measured_step_time_s: float | None
    base_allocated_bytes: int | None
    base_reserved_bytes: int | None
    measured_checkpointed: tuple[str, ...]
    step_times_s: tuple[float, ...]
    losses: tuple[float, ...]
    error: str | None

    @property
    def allocated_error(self) -> float | None:
        return _rel(self.predicted_allocated_peak_bytes, self.measured_allocated_peak_bytes)

    @property
    def reserved_error(self) -> float | None:
        return _rel(self.predicted_reserved_peak_bytes, self.measured_reserved_peak_bytes)

    @property
    def step_time_error(self) -> float | None:
        return _rel(self.predicted_step_time_s, self.measured_step_time_s)


@dataclass(frozen=True)
class PredictionCheck:
    """What :func:`check_prediction` found: the spec predicted for and how it was chosen, where and how the rows
    were measured, and one :class:`AccuracyRow` per plan."""

    spec: DeviceSpec
    #: how the spec was chosen ("given", or which table entry this GPU's name or compute capability matched)
    spec_source: str
    #: the device measured on, e.g. "NVIDIA H200 (cuda:0), torch 2.11.0+cu130, CUDA 13.0, driver 580.159.04"
    measured_on: str
    #: what read the measured figures
    meter: str
    steps: int
    rows: tuple[AccuracyRow, ...]
    #: plans asked for but not in the table (an infeasible budget, a plan equal to an earlier row's)
    notes: tuple[str, ...] = ()

    @property
    def on_cuda(self) -> bool:
        """Whether the measured figures are a GPU's (the CUDA allocator's statistics)."""
        return self.meter.startswith("torch.cuda")

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = dataclasses.asdict(r)
            d.update(allocated_error=r.allocated_error, reserved_error=r.reserved_error,
                     step_time_error=r.step_time_error)
            rows.append(d)
        return {"predicted_for": self.spec.to_dict(), "spec_source": self.spec_source, "measured_on": self.measured_on,
                "meter": self.meter, "steps": self.steps, "notes": list(self.notes), "rows": rows}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _rel(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else predicted / measured - 1


# -- the prediction -----------------------------------------------------------------------------------------------

def _built(build: Build, device: torch.device) -> tuple[nn.Module, Any, Any]:
    result = build(device)
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], nn.Module):
        raise InvalidInputError(f"build(device) must return (model, example_inputs) or (model, example_inputs, "
                                f"loss_fn) with an nn.Module first; it returned {type(result).__name__}")
    model, inputs, loss_fn = (*result, None)[:3]
    return model, inputs, loss_fn


def predict_plans(model: nn.Module, example_inputs: Any, spec: DeviceSpec | str, *, loss_fn: Any = None,
                  optimizer: torch.optim.Optimizer | None = None, output_alive: bool = True,
                  budgets_bytes: Sequence[int] = (), time_limit_s: float | None = 60.0
                  ) -> tuple[list[PlanPrediction], list[str]]:
    """The prediction half: the hand rules and remat's plans at the least budget (``least_memory``), halfway
    between it and no checkpointing's peak, and at ``budgets_bytes``, each predicted for ``Target(device=spec,
    world=1)`` (the profile and the plans from the step recorded on fake tensors; each plan's peaks by replaying
    the CUDA caching allocator over two recorded steps: :func:`remat.api.predict.predict_peaks`). ``model`` may
    be on the meta device. Returns the rows (a plan asked for twice once) and notes on plans not in them."""
    from remat.api.profiling import make_profile
    from remat.solve import Planner
    from remat.api.predict import predict_peaks
    from remat.target.world import Target

    target = Target(device=device_spec(spec), world=1)
    kw = dict(loss_fn=loss_fn, optimizer=optimizer, output_alive=output_alive)
    profile = make_profile(model, example_inputs, target=target, **kw)
    planner = Planner(profile, granularity="op", time_limit_s=time_limit_s)
    asked: list[tuple[str, Callable[[], Plan], int | None]] = [
        ("none", planner.no_checkpointing, None), ("every block", lambda: planner.every_nth_block(1), None),
        ("every 2nd block", lambda: planner.every_nth_block(2), None)]
    lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
    asked.append(("remat least", planner.least_memory, lo))
    for label, b in [("remat halfway", (lo + hi) // 2), *((f"remat @ {b / GiB:.3g} GiB", int(b))
                                                          for b in budgets_bytes)]:
        asked.append((label, lambda b=b: planner.plan_for_budget(b), b))
    rows: list[PlanPrediction] = []
    notes: list[str] = []
    seen: dict[Any, str] = {}
    for label, make, budget in asked:
        try:
            plan = make()
        except InfeasibleBudgetError as e:
            notes.append(f"{label}: infeasible ({_first_sentence(e)})")
            continue
        except RematError as e:  # (a model without repeated blocks has no "every block")
            notes.append(f"{label}: {_first_sentence(e)}")
            continue
        if plan.choices in seen:
            notes.append(f"{label}: the same plan as {seen[plan.choices]}")
            continue
        seen[plan.choices] = label
        peaks = predict_peaks(model, example_inputs, target, plan=plan if plan.choices else None, **kw)
        rows.append(PlanPrediction(label, plan, budget, peaks.allocated_peak_bytes,
                                   peaks.reserved_peak_bytes if target.is_cuda else None,
                                   plan.predicted_step_time_s, peaks.oom is not None))
    return rows, notes


def _first_sentence(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text.split(". ")[0].rstrip(".")


# -- the measurement ----------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_plans_here(build: Build, plans: Sequence[Plan | None], device: torch.device | str, *,
                  optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None, loss_fn: Any = None,
                  output_alive: bool = True, steps: int = 4, seed: int = 0,
                  progress: Callable[[str], None] | None = None) -> list[PlanMeasurement]:
    """The measuring half: for each plan (None: as built), a fresh model from ``build(device)`` with the plan
    applied, its optimizer from ``optimizer_factory``, ``steps`` real training steps (forward, loss, backward,
    ``step``, ``zero_grad(set_to_none=True)``; the output dropped after the loss unless ``output_alive``); peaks
    and the median step time over steps 2..N (Note [What the check measures]); everything freed before the next
    plan. ``loss_fn`` overrides the one ``build`` returns. An out-of-memory on the device is that row's
    ``error``. On CUDA the figures are the allocator's statistics; on a CPU remat's meter, allocated only.
    Every row's steps start from the random seed ``seed`` (the caller's random state is given back after), so
    every plan trains as the plain row does: its ``losses`` equal. ``progress(message)`` is called before each
    plan."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if steps < 2:
        raise InvalidInputError(f"steps must be 2 or more (the first is not read: Note [What the check measures]), "
                                f"got {steps}")
    out: list[PlanMeasurement] = []
    for k, plan in enumerate(plans):
        if progress is not None:
            progress(f"running plan {k + 1} of {len(plans)} for real on {device} ({steps} steps)")
        _free(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)  # every row draws the same random numbers (dropout): each trains as the plain
            out.append(_measure_one(build, plan, device, optimizer_factory, loss_fn, output_alive, steps))
        _free(device)
    return out


def _measure_one(build: Build, plan: Plan | None, device: torch.device, optimizer_factory: Any, loss_fn: Any,
                 output_alive: bool, steps: int) -> PlanMeasurement:
    """One row of :func:`measure_plans_here`: built, planned, ``steps`` steps, read."""
    from remat.api import apply_plan
    from remat.rewrite import checkpointed_modules
    from remat.runtime.measure import default_loss, input_tensors, run_step, split_inputs
    from remat.runtime.meters import StepMeter

    model, inputs, built_loss = _built(build, device)
    model = model.to(device).train()
    if plan is not None and plan.choices:
        apply_plan(model, plan)
    checkpointed = tuple(checkpointed_modules(model))
    opt = optimizer_factory(model.parameters()) if optimizer_factory is not None else None
    args, kwargs = split_inputs(inputs)
    fn = loss_fn or built_loss or default_loss
    cuda = device.type == "cuda"
    _sync(device)
    _free(device)
    base = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)) if cuda else (None, None)
    times: list[float] = []
    losses: list[float] = []
    meter, started = StepMeter(device), False
    try:
        for i in range(steps):
            if i == 1 and cuda:  # steps 2..N are read
                torch.cuda.reset_peak_memory_stats(device)
            elif i == 1:
                opt_state = (t for s in (opt.state.values() if opt is not None else ()) for t in s.values()
                             if isinstance(t, torch.Tensor))
                meter.start([*model.parameters(), *model.buffers(), *input_tensors(args, kwargs), *opt_state])
                started = True
            _sync(device)
            t0 = time.perf_counter()
            result = run_step(model, args, kwargs, fn, output_alive=output_alive, optimizer=opt)
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(float(result.loss))
            del result
        if cuda:
            st = torch.cuda.memory_stats(device)
            alloc, reserved = st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]
        else:
            alloc, reserved, started = meter.stop(), None, False
        return PlanMeasurement(alloc, reserved, statistics.median(times[1:]), *base, checkpointed, tuple(times),
                               tuple(losses))
    except torch.OutOfMemoryError as e:
        return PlanMeasurement(None, None, None, *base, checkpointed, tuple(times), tuple(losses),
                               error=f"out of memory on the device: {' '.join(str(e).split())[:300]}")
    finally:
        if started:  # (stopped early by an error)
            meter.stop()


# -- both ---------------------------------------------------------------------------------------------------------

def check_prediction(build: Build, *, device: DeviceSpec | str | None = None,
                     optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
                     loss_fn: Any = None, output_alive: bool = True, budgets_gb: Sequence[float] = (),
                     steps: int = 4, time_limit_s: float | None = 60.0,
                     measure_on: torch.device | str | None = None,
                     progress: Callable[[str], None] | None = None) -> PredictionCheck:
    """remat's prediction for the GPU here, checked on it: the target built on the meta device by
    ``build(device)`` (returning ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``), its hand
    rules and remat's plans (least, halfway, ``budgets_gb`` in GiB) predicted for ``device`` as for a GPU that is
    not here (:func:`predict_plans`), then each plan run for real on this GPU (:func:`measure_plans_here`, ``steps``
    steps, peaks and the median step time over steps 2..N): predicted and measured allocated and reserved peaks
    and step times side by side, so the error of remat's model on your own step shows on one GPU before you plan
    many. A 1B model takes a few minutes.

    ``device``: the spec to predict for (a table name, a JSON file's path or a :class:`DeviceSpec`); None: this
    GPU's (:func:`~remat.target.this_gpu.spec_here`: torch's name matched against the table, memory as torch
    reports it). ``optimizer_factory(params)`` builds the loop's optimizer (None: no optimizer). ``measure_on``:
    the CUDA device to run on (default the current one); ``"cpu"`` is for tests only (remat's CPU meter, no
    reserved figure, labelled so). ``progress(message)`` is told what runs. Raises
    :class:`~remat.errors.UnsupportedError` without CUDA (unless measuring on a CPU)."""
    where = torch.device(measure_on) if measure_on is not None else torch.device("cuda")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise cuda_required("check_prediction")
    if where.type not in ("cuda", "cpu"):
        raise InvalidInputError(f"measure_on must be a CUDA device (or 'cpu' in tests), got {where}")
    if device is None:
        if where.type != "cuda":
            raise InvalidInputError("measuring on a CPU (a test): give the spec to predict for, device=...")
        spec, how = spec_here(where)
    else:
        spec, how = device_spec(device), "given"
    if any(b <= 0 for b in budgets_gb):
        raise InvalidInputError(f"budgets must be positive numbers of GiB, got {list(budgets_gb)}")
    if progress is not None:
        progress(f"predicting for {spec} on fake tensors")
    meta_model, meta_inputs, built_loss = _built(build, torch.device("meta"))
    fn = loss_fn or built_loss
    predictions, notes = predict_plans(
        meta_model, meta_inputs, spec, loss_fn=fn,
        optimizer=optimizer_factory(meta_model.parameters()) if optimizer_factory is not None else None,
        output_alive=output_alive, budgets_bytes=[int(b * GiB) for b in budgets_gb], time_limit_s=time_limit_s)
    del meta_model, meta_inputs
    # (each row's own loss function, from its own build: one built for the meta device may hold meta tensors)
    measured = measure_plans_here(build, [p.plan for p in predictions], where, optimizer_factory=optimizer_factory,
                             loss_fn=loss_fn, output_alive=output_alive, steps=steps, progress=progress)
    rows = tuple(AccuracyRow(p.label, p.plan.checkpointed, p.budget_bytes, p.predicted_allocated_peak_bytes,
                             p.predicted_reserved_peak_bytes, p.predicted_step_time_s, p.predicted_oom,
                             m.measured_allocated_peak_bytes, m.measured_reserved_peak_bytes, m.measured_step_time_s,
                             m.base_allocated_bytes, m.base_reserved_bytes, m.checkpointed, m.step_times_s, m.losses,
                             m.error) for p, m in zip(predictions, measured, strict=True))
    meter = ("torch.cuda.memory_stats(): allocated_bytes.all.peak and reserved_bytes.all.peak" if where.type == "cuda"
             else "remat's CPU meter (live tensor storages; no reserved figure): a test of the command, not of a GPU "
                  "prediction")
    return PredictionCheck(spec, how, describe_device(where), meter, steps, rows, tuple(notes))
