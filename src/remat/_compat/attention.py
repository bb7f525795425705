"""The attention kernels a GPU runs, called on fake CPU tensors, and the SDP switches of this process: the private
torch APIs behind remat.target.attention (part of remat._compat: see its docstring). Note [Attention on the
target] in remat.target.attention says why.

Checked on 2.13 (here, fake CPU tensors: each CUDA operator's meta kernel and its backward run; the choice of
``torch._fused_sdp_choice`` on CPU tensors is the CPU's, never a GPU's). ``torch.backends.cuda.can_use_*_attention``
refuse CPU tensors (``check_all_tensors_on_device``), so on a machine without a GPU torch's own rules cannot be
asked: :func:`torch_choice_on_cuda` asks them where a GPU is (the GPU image's 2.11).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

#: set in the context that replaced the function (sdpa_replaced): another thread's calls are not replaced
_RECORDING: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_sdpa_replaced", default=False)

#: ``torch.nn.attention.SDPBackend`` values (``torch._C._SDPBackend``; checked on 2.13) by remat's kernel names
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}

#: the CUDA operators by kernel (``aten/src/ATen/native/native_functions.yaml``; their meta kernels in
#: ``torch/_meta_registrations.py`` run on fake tensors of any device; checked on 2.13)
_OPS = {"flash": "_scaled_dot_product_flash_attention", "efficient": "_scaled_dot_product_efficient_attention",
        "cudnn": "_scaled_dot_product_cudnn_attention", "math": "_scaled_dot_product_attention_math"}

#: the outputs each fused operator's autograd node keeps (derivatives.yaml: output, log-sum-exp, the RNG state);
#: 2.13 names flash's RNG state ``rng_state``/``unused``, older releases ``philox_seed``/``philox_offset``
_KEPT = frozenset({"output", "logsumexp", "log_sumexp", "rng_state", "unused", "philox_seed", "philox_offset"})


def sdp_switches() -> tuple[frozenset[str], tuple[str, ...] | None]:
    """The SDP backends this process has enabled (``torch.backends.cuda.*_sdp_enabled``, public) and the priority
    order a user set (``torch._C._get_sdp_priority_order``, from ``sdpa_kernel(..., set_priority=True)``; checked
    on 2.8, whose list repeats math in a fifth slot, and 2.13); None when it is torch's default (or its cuDNN-first one, which a user may also have set: taken as
    torch's) or this torch lacks it."""
    import torch.backends.cuda as bc

    enabled = {name for name, on in (("flash", bc.flash_sdp_enabled()), ("efficient", bc.mem_efficient_sdp_enabled()),
                                      ("math", bc.math_sdp_enabled()),
                                      ("cudnn", getattr(bc, "cudnn_sdp_enabled", lambda: False)()))
               if on}
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    order = None
    if get is not None:
        # each backend once, at its first place: torch 2.8's list has five slots and fills the last with 0 (math)
        names = tuple(dict.fromkeys(_BACKEND_NAMES[i] for i in get() if i in _BACKEND_NAMES))
        # torch's default, or the cuDNN-first order torch itself sets once SDPA has run on a Hopper or Blackwell
        # GPU in this process (``priority_order``): neither is the user's
        order = None if names in (("flash", "efficient", "math", "cudnn"), ("cudnn", "flash", "efficient", "math")) \
            else names
    return frozenset(enabled), order


def _bound(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
           scale: float | None = None, enable_gqa: bool = False) -> dict:
    return dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=float(dropout_p),
                is_causal=bool(is_causal), scale=scale, enable_gqa=bool(enable_gqa))


def _float_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a boolean mask as an additive one in the query's dtype (0 kept, -inf not)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=like.dtype), torch.full((), -math.inf, dtype=like.dtype))


def run_kernel(kernel: str, a: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run ``kernel``'s CUDA operator on the call's tensors as ``scaled_dot_product_attention`` does on CUDA
    (``aten/src/ATen/native/transformers/attention.cpp``): a boolean mask made additive; flash's head dimension
    padded to a multiple of 8 (``pad_last_dim<8>``) and its output sliced back; memory-efficient attention's mask
    padded to a multiple of 16 (``preprocess_mask``) and expanded. Returns the attention's output and the tensors the
    operator keeps for backward, by the schema's names."""
    q, k, v = a["query"], a["key"], a["value"]
    mask, p, causal, scale = _float_mask(a["attn_mask"], q), a["dropout_p"], a["is_causal"], a["scale"]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    op = getattr(torch.ops.aten, _OPS[kernel]).default
    if kernel == "math":
        out = op(q, k, v, mask, p, causal, None, scale=scale, enable_gqa=a["enable_gqa"])
        return out[0], {}
    if kernel == "flash":
        d = q.shape[-1]
        if d % 8:
            pad = 8 - d % 8
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        result = op(q, k, v, p, causal, False, scale=scale if scale is not None else 1.0 / math.sqrt(d))
        out = result[0][..., :d] if d % 8 else result[0]
    elif kernel == "efficient":
        if mask is not None:
            s = mask.shape[-1]
            if s % 16:
                mask = F.pad(mask, (0, 16 - s % 16))[..., :s]
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        result = op(q, k, v, mask, grad, p, causal, scale=scale)
        out = result[0]
    else:
        result = op(q, k, v, mask, grad, p, causal, False, scale=scale)
        out = result[0]
    names = [r.name for r in op._schema.returns]
    kept = {n: t for n, t in zip(names, result) if n in _KEPT and isinstance(t, torch.Tensor) and t.numel()}
    return out, kept


@contextlib.contextmanager
def sdpa_replaced(choose: Callable[[dict], str], seen: Callable[[dict, str, dict], None]) -> Iterator[None]:
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` (the module attribute that callers
    read as ``F.scaled_dot_product_attention``) runs, for dense 4-D tensors, the kernel ``choose(arguments)`` names
    through its CUDA operator (:func:`run_kernel`), and ``seen(arguments, kernel, kept)`` is told; other calls run
    as they are. Where the operator cannot run on fake tensors in this torch (a meta kernel missing), the CPU's
    kernel runs, as before, and ``seen`` is told ``"cpu (why)"``. Restored after, also on error. The replacement
    acts only in the context that entered the block (a context variable: another thread calling attention
    meanwhile, whose context does not have it, gets torch's own function).

    Why the attribute and not a ``TorchFunctionMode``: a mode's handler runs the function with the mode off, so
    ``loss.backward()`` called under it recomputes checkpointed attention without it (the CPU's operator, which
    selective checkpointing then finds missing from what its forward cached). A caller that bound the function
    before (``from torch.nn.functional import scaled_dot_product_attention``) is not reached: its calls run the
    CPU's kernel, as before."""
    original = F.scaled_dot_product_attention
    token = _RECORDING.set(True)

    def replacement(*args: Any, **kwargs: Any) -> Any:
        if not _RECORDING.get():  # another thread, or a context the recording did not start: torch's own
            return original(*args, **kwargs)
        a = _bound(*args, **kwargs)
        if not all(isinstance(a[n], torch.Tensor) and a[n].dim() == 4 and not a[n].is_nested
                   for n in ("query", "key", "value")):
            return original(*args, **kwargs)
        kernel = choose(a)
        try:
            out, kept = run_kernel(kernel, a)
        except (NotImplementedError, RuntimeError) as e:  # a torch whose meta kernel for it is missing or refuses
            seen(a, f"cpu ({kernel}'s operator did not run on fake tensors here: {type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})", {})
            return original(*args, **kwargs)
        seen(a, kernel, kept)
        return out

    F.scaled_dot_product_attention = replacement
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        _RECORDING.reset(token)


def torch_choice_on_cuda(batch: int, q_heads: int, kv_heads: int, seq_q: int, seq_kv: int, head_dim_qk: int,
                         head_dim_v: int, dtype: torch.dtype, *, is_causal: bool = False, mask: bool = False,
                         dropout_p: float = 0.0, enable_gqa: bool = False) -> str:
    """The kernel this process's torch picks on its GPU (``torch._fused_sdp_choice`` on CUDA tensors that require
    grad): for checking the rules against torch where a GPU is. Needs CUDA."""
    dev = torch.device("cuda")
    q = torch.empty(batch, q_heads, seq_q, head_dim_qk, dtype=dtype, device=dev, requires_grad=True)
    k = torch.empty(batch, kv_heads, seq_kv, head_dim_qk, dtype=dtype, device=dev, requires_grad=True)
    v = torch.empty(batch, kv_heads, seq_kv, head_dim_v, dtype=dtype, device=dev, requires_grad=True)
    m = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=dev) if mask else None
    return _BACKEND_NAMES[int(torch._fused_sdp_choice(q, k, v, m, dropout_p, is_causal, enable_gqa=enable_gqa))]
