"""What the user passed, checked, and whose failure a failure is: validation, the model's signature, the stage guard
(Note [Whose failure]) and the loop's gradients.

In: the model, ``budget_gb``, example inputs, a loss. Out: bytes, positional and keyword inputs, the device; an
InvalidInputError (the user's) or InternalError (remat's) for a failure inside a stage.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from remat._compat import CHECKED_ON
from remat._compat.versions import REMAT_VERSION
from remat.costs.unit_costs import Profile
from remat.errors import InternalError, InvalidInputError, RematError
from remat.rewrite import remove_checkpointing
from remat.runtime.measure import LossFn, input_tensors, model_device, run_step, split_inputs, trainable_parameters
from remat.runtime.state import fresh_grads, preserved
from remat.solve.plan import GiB


def model_signature(model: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def validate(model: Any, budget_gb: Any, example_inputs: Any) -> tuple[int, tuple, dict, torch.device]:
    """Check the arguments of optimize_checkpointing; returns (budget bytes, args, kwargs, device)."""
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or not math.isfinite(budget_gb) \
            or budget_gb <= 0:
        raise InvalidInputError(
            f"budget_gb must be a positive finite number of GiB (2**30 bytes), got {budget_gb!r}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise InvalidInputError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad=True): "
            "there is no training step to checkpoint"
        )
    args, kwargs = split_inputs(example_inputs)
    if kwargs.get("use_cache") is True:
        raise InvalidInputError(
            "example_inputs sets use_cache=True: a KV cache in a checkpointed training step is rebuilt on every "
            "recomputation; pass use_cache=False (training does not use the cache)"
        )
    device = model_device(model)
    for t in input_tensors(args, kwargs):
        if t.device != device:
            raise InvalidInputError(
                f"example input on {t.device} but the model is on {device}: move the batch with "
                f".to({str(device)!r}) first"
            )
    return int(budget_gb * GiB), args, kwargs, device


def loop_grads(profile: Profile, grad_accumulation: bool, zero_grad_after_forward: bool) -> Profile:
    """``profile`` for the loop's gradients (Note [Accumulated gradients] in remat.costs.unit_costs)."""
    if grad_accumulation:
        return profile.with_held_grads()
    return profile.with_held_grads(through_backward=False) if zero_grad_after_forward else profile


@contextlib.contextmanager
def stage(name: str, model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, *,
          judge: bool = True) -> Iterator[None]:
    """Note [Whose failure]: an exception that is not a RematError, raised while remat runs one of its
    stages, is either the user's (the training step itself fails on these inputs) or remat's. To tell
    which, the plain step runs once (forward, loss, gradients by autograd.grad: ``.grad`` untouched;
    model, buffers and RNG restored): if it fails too, the user gets InvalidInputError with their own
    exception chained; if it runs, remat failed, and says so (InternalError, naming the stage, with
    the cause chained). The model is restored by the callers either way. ``judge`` False: the exception goes on
    as it is (a step recorded on fake tensors for a target, whose plain step cannot tell: Note [Limits of fake
    tensors] in remat.target.limits sorts it)."""
    try:
        yield
    except RematError:
        raise
    except Exception as e:  # noqa: BLE001 - sorted into the user's failure or remat's below
        if not judge:
            raise
        user_error = plain_step_error(model, args, kwargs, loss_fn)
        if user_error is not None:
            if isinstance(user_error, RematError):
                raise user_error from None
            raise InvalidInputError(
                f"the training step fails without remat too on example_inputs ({type(user_error).__name__}: "
                f"{_first_line(user_error)}); check that the model accepts them (shapes, dtypes, argument names) "
                "and that loss_fn fits its output"
            ) from user_error
        raise InternalError(
            f"remat failed in its {name} stage ({type(e).__name__}: {_first_line(e)}), while your training step "
            f"runs without remat on the same inputs. This is remat's failure, not your inputs': please report it "
            f"with the traceback (the cause is chained below) and remat {_version()}, torch {torch.__version__} "
            f"(remat is tested on torch {', '.join(CHECKED_ON)}). "
            "Your model and training state are as they were.",
            stage=name,
        ) from e


def plain_step_error(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn) -> BaseException | None:
    """The exception one plain training step raises on these inputs, or None when it runs (Note [Whose
    failure]). Leaves the model, its gradients, buffers and the RNG state as they were."""
    try:
        with preserved(model), torch.random.fork_rng(devices=[]):
            remove_checkpointing(model)
            with fresh_grads(trainable_parameters(model)):
                run_step(model, args, kwargs, loss_fn)
    except Exception as e:  # noqa: BLE001 - this is the answer
        return e
    return None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def _version() -> str:
    return REMAT_VERSION
