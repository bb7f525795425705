"""What planning on fake tensors cannot do, said as such (issue #47): a failure while a target's step is recorded
is sorted into the limit of fake tensors it meets, an UnsupportedError that names it and what to do.

In: an exception raised while recording on fake tensors. Out: an UnsupportedError, the exception chained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from remat.errors import RematError, UnsupportedError
from remat.target.world import Target


@contextlib.contextmanager
def fake_tensor_limits(target: Target) -> Iterator[None]:
    """Note [Limits of fake tensors]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A target's step is recorded on fake CPU tensors (Note [Fake CUDA on a CPU build] in remat.target.world), which
    have shapes but no values and run the CPU's kernels. A step that trains where it runs can fail there, and that
    is a limit of planning for a device that is not here, not the user's fault (issue #47): an operator that needs
    values (``.item()``, ``nonzero``, a boolean mask), a tensor the model or ``loss_fn`` captured from outside the
    inputs and parameters (labels made on the meta device: remat copies only the inputs, parameters and buffers),
    a CPU kernel without the target's dtype (a mixture of experts' grouped matmul in bfloat16). The plain-step test
    of Note [Whose failure] cannot tell them apart here (its step runs on the same fake tensors), so every failure
    of the recording is an UnsupportedError that names what failed and what to do, its cause chained."""
    try:
        yield
    except RematError:
        raise
    except Exception as e:  # noqa: BLE001 - sorted below; the cause is chained
        raise _fake_limit(e, target) from e


def _fake_limit(e: Exception, target: Target) -> UnsupportedError:
    from remat._compat import fake_tensor_exceptions

    data_dependent, device_mismatch = fake_tensor_exceptions()
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    func = getattr(e, "func", None)
    op = f" at {func}" if func is not None else ""
    where = (f"recording the step for {target.describe()} on fake tensors (shapes, no values, this machine's CPU "
             f"kernels: Note [Limits of fake tensors] in remat.target.limits) failed{op} ({type(e).__name__}: {text})")
    if isinstance(e, data_dependent) or "data-dependent" in text or "data dependent" in text:
        return UnsupportedError(
            f"{where}: the operator needs the values of its inputs (.item(), nonzero, a boolean mask), which fake "
            "tensors do not have. This is a limit of planning for a device that is not here, not of your step: "
            "compute the value from shapes, mark it with torch._check where it is a size, or plan on the device "
            "where the model runs (without target=)")
    if isinstance(e, device_mismatch) or "FakeTensor" in text and ("device" in text.lower() or "convert" in text):
        return UnsupportedError(
            f"{where}: a tensor that is not among example_inputs, the model's parameters or its buffers reached an "
            "operator (one the model or loss_fn captured, such as labels made on the meta device); remat copies only "
            "those onto fake tensors. Pass such tensors as example inputs (a Hugging Face model takes labels=), or "
            "make them inside loss_fn from the output's shape and device")
    dtypes = ("BFloat16", "BF16", "Half", "Float8", "bfloat16", "float16")
    if any(d in text for d in dtypes) and ("xpected" in text or "not implemented" in text):
        return UnsupportedError(
            f"{where}: a CPU kernel lacks the dtype the target trains in. The step is recorded with the CPU's "
            "kernels (torch's CPU build cannot run fake CUDA tensors): plan with Target(param_dtype=torch.float32) "
            "and a float32 model to plan the memory of the float32 step, or plan on the device where it runs")
    return UnsupportedError(
        f"{where}. This is a limit of planning for a device that is not here, not a failure of your step; "
        "plan on the device where the model runs (without target=), and report this with the traceback")
