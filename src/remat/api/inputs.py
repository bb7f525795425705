"""What the user passed, checked, and whose failure a failure is: validation, the model's signature, the stage guard
(Note [Whose failure]) and the loop's gradients.

In: the model, ``budget_gb``, example inputs, a loss. Out: bytes, positional and keyword inputs, the device; an
InvalidInputError (the user's), UserCodeError (the user's code, failing on a later call) or InternalError (remat's) for
a failure inside a stage.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from remat._compat import CHECKED_ON
from remat._compat.versions import REMAT_VERSION
from remat.costs.unit_costs import Profile
from remat.errors import InternalError, InvalidInputError, RematError, UserCodeError
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


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer over parameters that are not ``model``'s (InvalidInputError naming them): its state would
    be priced into the model's step (remat.profile.optimizer reads the optimizer's own parameters), and a step of
    the model does not update them. A subset of the model's parameters (fine-tuning) is the model's."""
    if optimizer is None:
        return
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        raise InvalidInputError(f"optimizer must be a torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters()}
    held = [(g, i, p) for g, group in enumerate(groups) for i, p in enumerate(group.get("params", ()))]
    foreign = [(g, i, p) for g, i, p in held if id(p) not in mine]
    if foreign:
        named = ", ".join(f"param_groups[{g}]['params'][{i}] of shape {tuple(p.shape)}" for g, i, p in foreign[:3])
        raise InvalidInputError(
            f"optimizer ({type(optimizer).__name__}) holds parameters that are not the model's: {len(foreign)} of its "
            f"{len(held)} parameters are not the model's: {named}{' ...' if len(foreign) > 3 else ''} "
            f"({sum(p.numel() for _, _, p in foreign):,} elements); remat prices the optimizer's state as part of the "
            f"model's training step. Pass the optimizer over the model's parameters (all or some of its "
            f"{len(mine)}), or optimizer=None and lower budget_gb by the other state"
        )


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
    the cause chained) -- unless the exception was raised in the user's own code, the loss function or a forward of
    the model's own classes (:func:`users_code`: its innermost frame outside torch and remat, called from there),
    which ran on earlier calls: a loss that raises on its third call (issue #62) was reported as remat's failure.
    That is UserCodeError, naming the code and, for the loss (counted by :class:`UserLoss`), the call, with the
    user's exception chained. The model is restored by the callers either way. ``judge`` False: the exception goes on
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
        where = users_code(e, model, loss_fn) if user_error is None else None
        if where is not None:
            raise UserCodeError(
                f"{where} ({type(e).__name__}: {_first_line(e)}) while remat ran your training step in its {name} "
                "stage, though it ran on earlier calls and your plain training step runs on the same inputs: the "
                "exception and its traceback are your code's (chained below), not remat's. remat runs the step several "
                "times (recording, timed and checked steps), so code that fails on some calls only (a counter, a check "
                "of the data) fails remat's run too: make it pass on every call of the same inputs. Your model and "
                "training state are as they were."
            ) from e
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


class UserLoss:
    """The user's loss function, its calls counted (Note [Whose failure]): which call raised what, so a failure on a
    later call is named as the user's. Calls it as it is; ``calls`` counts every call remat made."""

    def __init__(self, fn: LossFn) -> None:
        self.fn = fn
        self.calls = 0
        #: (call number, exception) of the calls that raised, the last few
        self.raised: list[tuple[int, BaseException]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            return self.fn(*args, **kwargs)
        except Exception as e:
            self.raised = [*self.raised[-3:], (self.calls, e)]
            raise


def users_code(e: BaseException, model: nn.Module, loss_fn: LossFn) -> str | None:
    """Note [Whose failure]: where in the user's own code ``e`` (or an exception it was raised from) was raised -- its
    innermost frame outside torch and remat, called from the loss function or from a forward of one of the model's
    own classes -- said for a message (``"your loss_fn <name> raised on its call 3"``), or None where it was not."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        frames = [f for f, _ in traceback.walk_tb(e.__traceback__)]
        if frames and not _library_code(frames[-1].f_code.co_filename):
            loss_codes = _codes(loss_fn.fn if isinstance(loss_fn, UserLoss) else loss_fn)
            forwards = {type(m).forward.__code__: type(m).__qualname__ for m in model.modules()
                        if not _library_code(getattr(type(m).forward, "__code__", None))}
            for frame in reversed(frames):
                if frame.f_code in loss_codes:
                    call = next((k for k, x in (getattr(loss_fn, "raised", ()) or ()) if x is e), None)
                    return f"your loss_fn {frame.f_code.co_name!r} raised" + (
                        f" on its call {call} (of {loss_fn.calls} remat made)" if call is not None else "")
                if frame.f_code in forwards:
                    return (f"your model's {forwards[frame.f_code]}.forward ({frame.f_code.co_filename}:"
                            f"{frame.f_lineno}) raised")
        e = e.__cause__ or e.__context__
    return None


def _codes(fn: Any) -> set:
    """The code objects of a callable the user gave (a function, a partial, a bound method, an object's __call__)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is not None:
        return {code}
    call = getattr(type(fn), "__call__", None)
    forward = getattr(type(fn), "forward", None)  # a loss module
    return {c for c in (getattr(call, "__code__", None), getattr(forward, "__code__", None)) if c is not None}


#: where torch's and remat's own code lives (the package directories)
_LIBRARIES = tuple(os.path.dirname(f) + os.sep for f in (torch.__file__, os.path.dirname(__file__)))


def _library_code(where: Any) -> bool:
    """Whether ``where`` (a file name or a code object) is torch's or remat's."""
    name = where.co_filename if hasattr(where, "co_filename") else where
    return name is None or str(name).startswith(_LIBRARIES)


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
