"""The attention kernel a GPU target runs for each ``scaled_dot_product_attention`` call of the recorded step.

Note [Attention on the target]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A target's step is recorded on fake CPU tensors (Note [Fake CUDA on a CPU build] in remat.target.world), where
``scaled_dot_product_attention`` picks a CPU kernel: the CPU's flash kernel, or its math fallback for dropout and
for what the CPU's flash refuses. On CUDA torch picks among flash, memory-efficient, cuDNN and math by the call's
dtype, dropout, mask, head dimensions and grouped heads, the GPU and the torch release (Note [SDPA selection
rules] in remat.costs.attention_kernels), and each keeps different tensors for backward: flash the output and
float32 log-sum-exp rows ``[B, H, L]``, memory-efficient the same rows padded to 32 and the mask, cuDNN its
statistics ``[B, H, L, 1]``, its RNG seed and offset and the mask, math the whole attention matrix (and, with
dropout, its mask). Before this, the CPU's choice was recorded for every target: right in memory for a bf16
step without dropout (the CPU's flash keeps the same output and rows), but the math fallback's attention
matrices for any step with attention dropout (GPT-2's default 0.1), and the CPU's flash where CUDA runs math
(float32 with grouped heads before 2.15).

So while a CUDA target's step is recorded, every such call is made through the CUDA operator of the kernel the
rules choose (its meta kernel runs on the fake CPU tensors, and autograd keeps what that operator's derivative
keeps), with the arguments ``scaled_dot_product_attention`` passes it on CUDA (remat._compat.attention.run_kernel):
the recording holds that kernel's saved tensors, times it by its own operator name, and a selective policy that
names CUDA's kernels is asked about the one the run calls. The release is this process's torch (the planning
process runs the release the target will, unless ``Target(torch_version=...)`` names the run's), the cuDNN the
default wheel of that release brings, and
the run's SDP switches (``torch.backends.cuda.enable_*_sdp``, an order set with ``sdpa_kernel(...,
set_priority=True)``) and environment (``TORCH_CUDNN_SDPA_PREFERRED``, ``TORCH_CUDNN_SDPA_DEPRIORITIZED``): the
target's ``sdpa`` (a typed value: ``Target(sdpa=SdpaSettings(...))`` for a run set otherwise), this process's when
the Target is made without one, and fixed then. The kernels run through a replacement of
``F.scaled_dot_product_attention`` that acts only in the context that recorded (remat._compat.attention:
``sdpa_replaced``): another thread of the process calling attention meanwhile gets torch's own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from remat.costs.attention_kernels import CAPABILITY, Choice, SdpaCall, SdpaSettings, choose_kernel

if TYPE_CHECKING:
    from remat.target.world import Target


@dataclass(frozen=True)
class AttentionCall:
    """One ``scaled_dot_product_attention`` call of a recorded target step: the call, the kernel assumed and
    what its operator kept for backward besides its inputs (name, shape, dtype, bytes)."""

    call: SdpaCall
    choice: Choice
    kept: tuple[tuple[str, tuple[int, ...], str, int], ...]

    @property
    def kept_bytes(self) -> int:
        return sum(k[3] for k in self.kept)


def gpu_of(target: Target) -> tuple[str, tuple[int, int]]:
    """(vendor, compute capability) of the target's GPU: the spec's ``compute_capability`` where it gives one (a
    calibrated spec does), else its generation's (remat.target.devices); an unknown NVIDIA GPU is taken as Hopper."""
    from remat.target.devices import generation_of

    spec = target.spec
    if spec.compute_capability is not None:
        return spec.vendor, spec.compute_capability
    return spec.vendor, CAPABILITY.get(generation_of(spec), (9, 0))


def settings_here(torch_version: str | None = None) -> SdpaSettings:
    """The torch release (``torch_version``, else this process's), SDP switches and environment of this process
    (Note [Attention on the target])."""
    from remat._compat import torch_release
    from remat._compat.attention import sdp_switches

    enabled, order = sdp_switches()
    return SdpaSettings(torch=torch_release(torch_version), enabled=enabled, order=order,
                        cudnn_preferred_env=os.environ.get("TORCH_CUDNN_SDPA_PREFERRED"),
                        cudnn_deprioritized_env=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"))


def call_of(a: dict) -> SdpaCall:
    """The :class:`SdpaCall` of ``scaled_dot_product_attention``'s bound arguments."""
    q, k, v = a["query"], a["key"], a["value"]
    return SdpaCall(dtype=str(q.dtype).removeprefix("torch."), batch=int(q.shape[0]), q_heads=int(q.shape[1]),
                    kv_heads=int(k.shape[1]), seq_q=int(q.shape[2]), seq_kv=int(k.shape[2]),
                    head_dim_qk=int(q.shape[3]), head_dim_v=int(v.shape[3]), is_causal=a["is_causal"],
                    has_attn_mask=a["attn_mask"] is not None, dropout_p=a["dropout_p"], enable_gqa=a["enable_gqa"],
                    requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))


@contextlib.contextmanager
def attention_as_on(target: Target, calls: list[AttentionCall] | None = None) -> Iterator[None]:
    """Within the block, attention runs as on the target's GPU (Note [Attention on the target]); each call is
    appended to ``calls``. Nothing changes for the target ``cpu``."""
    if not target.is_cuda:
        yield
        return
    from remat._compat.attention import sdpa_replaced

    vendor, capability = gpu_of(target)
    settings = target.sdpa
    choices: dict[SdpaCall, Choice] = {}

    def choose(a: dict) -> str:
        call = call_of(a)
        if call not in choices:
            choices[call] = choose_kernel(call, vendor, capability, settings)
        return choices[call].kernel

    def seen(a: dict, kernel: str, kept: dict) -> None:
        if calls is not None:
            call = call_of(a)
            choice = choices[call] if kernel == choices[call].kernel else Choice(kernel, choices[call].order)
            calls.append(AttentionCall(call, choice, tuple(
                (n, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                 t.untyped_storage().nbytes()) for n, t in kept.items())))

    with sdpa_replaced(choose, seen):
        yield


def describe_calls(calls: list[AttentionCall], target: Target) -> str | None:
    """One note for a plan: the kernels assumed, per distinct call, with the rules' torch release."""
    if not calls:
        return None
    vendor, (major, minor) = gpu_of(target)
    seen: dict[tuple, int] = {}
    for c in calls:
        key = (c.choice.kernel, c.call.dtype, c.call.head_dim_qk, c.call.head_dim_v, c.call.dropout_p,
               c.call.has_attn_mask, c.call.enable_gqa)
        seen[key] = seen.get(key, 0) + 1
    from remat._compat import torch_release

    parts = [f"{k[0]} for {n} call{'s' if n > 1 else ''} ({k[1]}, head dim {k[2]}"
             + (f"/{k[3]}" if k[3] != k[2] else "") + (f", dropout {k[4]}" if k[4] else "")
             + (", mask" if k[5] else "") + (", grouped heads" if k[6] else "") + ")" for k, n in seen.items()]
    first = calls[0].choice
    release = ".".join(map(str, torch_release(target.torch_version)))
    refused = "".join(f"; {k} refused: {why}" for k, why in first.refused)  # (the first call's, where earlier ones were)
    return (f"attention assumed as torch {release} picks it on {vendor} sm {major}.{minor} (order "
            f"{' > '.join(first.order)}{refused}; Note [Attention on the target]): " + "; ".join(parts))
