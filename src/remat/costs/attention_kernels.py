"""Which kernel ``torch.nn.functional.scaled_dot_product_attention`` runs on a GPU, and what it saves for backward:
torch's CUDA selection rules written out as plain data and functions (torch-free), for planning a step on a GPU
that is not here (remat.target; Note [Attention on the target]).

Note [SDPA selection rules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
On CUDA, ``scaled_dot_product_attention`` walks a priority order of backends and takes the first whose checks
pass (``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``; the shared checks in
``sdp_utils_cpp.h``). Read for this module (2026-12-04):

* torch's ``main`` at commit 001f694 (the newest stored copy: ``std::to_array``, cuDNN preferred when the runtime
  cuDNN is newer than 9.15.0, memory-efficient attention with grouped heads, cuDNN head dimension 256 from cuDNN
  9.22), taken as 2.15's rules;
* an earlier copy (``c10::array_of``; cuDNN preferred unless ``TORCH_CUDNN_SDPA_PREFERRED=0`` on sm 9.0 / 10.0
  with cuDNN >= 9.9 at build time; cuDNN without dropout on cuDNN 9.11-9.13): 2.9's rules, by
  pytorch/pytorch#162073 ("Enable cuDNN SDPA by default for SM 9.0, SM 10.0", 2025-09, "for 2.9"), so 2.8
  left cuDNN last (after math: never chosen) unless ``TORCH_CUDNN_SDPA_PREFERRED=1``;
* the runtime cuDNN gate (> 9.15.0, pytorch/pytorch#169849) is in 2.10, and the cuDNN the wheels bring crosses it
  from 2.11 (huggingface/transformers#48163's reading of torch); measured: torch 2.11.0+cu130 on the H200 ran
  ``_scaled_dot_product_cudnn_attention`` for a bf16 Llama (head dimension 64, 8 of 32 heads for keys and values,
  ``../shared/gpu/h200-2026-12-04/*.trace.json.gz``);
* torch 2.14.1's CUDA wheel (``libtorch_cuda.so``'s messages, read here): the checks of ``main`` that 2.9's copy
  lacks are there (cuDNN's dropout in steps of 1/16, its head dimension 256 and the backward's head dimensions,
  ``TORCH_CUDNN_SDPA_DEPRIORITIZED``), so they are taken from 2.14 on, and 2.11-2.13 as 2.9's copy (cuDNN's head
  dimension 256 on sm 9.0 from cuDNN 9.10) with the runtime gate: not read;
* memory-efficient attention with grouped heads (``enable_gqa``) came with pytorch/pytorch#191085 (2026-07); on
  2.13 the CPU's checks (the same ``check_batch_size_and_num_heads_dense``) still refuse implicit single-head
  keys, so it is taken from 2.15 on (2.14 not read: modelled as 2.13).

Not modelled: nested tensors, torch.compile's own choice, ``torch.use_deterministic_algorithms`` (cuDNN refused:
not read), sm 8.6 / 12.x consumer GPUs beyond flash's head-dimension limit (none in the device table), FA3
(``torch.nn.attention.activate_flash_attention_impl``), and the pointer-alignment check of memory-efficient
attention (a view at an odd offset). On ROCm (MI300X) there is no cuDNN: flash, then memory-efficient (AOTriton;
head dimension up to 512, no grouped heads), then math. Each rule below names its check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"

#: torch's default priority order (``at::Context``'s ``sdp_priority_order``: flash, efficient, math, cuDNN), read
#: at run time from the torch here where it can be (``torch._C._get_sdp_priority_order``)
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN)
CUDNN_FIRST = (CUDNN, FLASH, EFFICIENT, MATH)

#: compute capability of the GPU generations of the device table (remat.target.devices.GENERATION)
CAPABILITY = {"ampere": (8, 0), "ada": (8, 9), "hopper": (9, 0), "blackwell": (10, 0)}

#: the cuDNN the default wheels of a torch release load (runtime ``cudnnGetVersion``), and their CUDA major:
#: 2.8-2.10: cu128 wheels, nvidia-cudnn-cu12 9.10.2; 2.11-2.13: cuDNN 9.19 (reported with 2.11.0+cu130 on a
#: B200, sgl-project/sglang#33655; 2.12 and 2.13 not read), CUDA 13 as the lent H200's image (2.11.0+cu130);
#: from 2.14: nvidia-cudnn-cu13 9.24.0.43 and CUDA 13.0 (2.14.1's wheel METADATA, read here)
WHEEL_CUDNN = {(2, 8): (91002, 12), (2, 11): (91900, 13), (2, 14): (92400, 13)}


@dataclass(frozen=True)
class SdpaCall:
    """One ``scaled_dot_product_attention`` call as its arguments describe it (query ``batch x q_heads x seq_q x
    head_dim_qk``, key ``kv_heads x seq_kv x head_dim_qk``, value ``kv_heads x seq_kv x head_dim_v``)."""

    dtype: str  # "bfloat16", "float16", "float32"
    batch: int
    q_heads: int
    kv_heads: int
    seq_q: int
    seq_kv: int
    head_dim_qk: int
    head_dim_v: int
    is_causal: bool = False
    has_attn_mask: bool = False
    dropout_p: float = 0.0
    enable_gqa: bool = False
    #: an input requires grad with grad mode on (training): the log-sum-exp is kept for backward
    requires_grad: bool = True

    @property
    def half(self) -> bool:
        return self.dtype in ("float16", "bfloat16")


@dataclass(frozen=True)
class SdpaSettings:
    """What the choice depends on besides the call and the GPU: the torch release, the process's SDP switches
    (``torch.backends.cuda.enable_*_sdp``; an order set with ``torch.nn.attention.sdpa_kernel(..., set_priority=
    True)``), the runtime cuDNN and the environment variables torch reads."""

    torch: tuple[int, int]
    enabled: frozenset[str] = frozenset({FLASH, EFFICIENT, CUDNN, MATH})
    #: an order the user set; None: torch's default for the release and GPU
    order: tuple[str, ...] | None = None
    #: runtime cuDNN as ``cudnnGetVersion`` (9.15.1 = 91501); None: the default wheel's for the release
    cudnn_version: int | None = None
    #: CUDA major of the build; None: the default wheel's
    cuda_major: int | None = None
    #: ``TORCH_CUDNN_SDPA_PREFERRED`` (2.8: "1" puts cuDNN first; 2.9: "0" stops it), ``TORCH_CUDNN_SDPA_DEPRIORITIZED``
    #: (from 2.10: "1" stops it), as the planning process has them
    cudnn_preferred_env: str | None = None
    cudnn_deprioritized_env: str | None = None

    def wheel(self) -> tuple[int, int]:
        """(runtime cuDNN, CUDA major) assumed: given, else the default wheel's of the release."""
        known = max((v for v in WHEEL_CUDNN if v <= self.torch), default=(2, 8))
        cudnn, cuda = WHEEL_CUDNN[known]
        return (self.cudnn_version if self.cudnn_version is not None else cudnn,
                self.cuda_major if self.cuda_major is not None else cuda)


@dataclass(frozen=True)
class Choice:
    """The kernel CUDA would run for a call, the order it was picked from, and why each earlier one was not."""

    kernel: str
    order: tuple[str, ...]
    refused: tuple[tuple[str, str], ...] = ()


def _truthy(value: str | None) -> bool | None:
    """c10::utils::check_env: "1"/"ON"/"YES"/"TRUE"/"Y" true, "0"/"OFF"/"NO"/"FALSE"/"N" false, else unset."""
    if value is None:
        return None
    v = value.upper()
    return True if v in ("1", "ON", "YES", "TRUE", "Y") else False if v in ("0", "OFF", "NO", "FALSE", "N") else None


def priority_order(vendor: str, capability: tuple[int, int], s: SdpaSettings) -> tuple[str, ...]:
    """The order torch tries backends in on this GPU (``priority_order`` / ``check_prefer_cudnn_attention``)."""
    if s.order is not None:
        return s.order
    if vendor.upper() != "NVIDIA":
        return DEFAULT_ORDER
    major, minor = capability
    cudnn, cuda = s.wheel()
    if s.torch < (2, 9):  # opt-in only
        prefer = _truthy(s.cudnn_preferred_env) is True and major >= 9 and minor == 0
    elif s.torch < (2, 10):  # on unless TORCH_CUDNN_SDPA_PREFERRED=0; built against cuDNN >= 9.9
        prefer = _truthy(s.cudnn_preferred_env) is not False and major in (9, 10) and minor == 0
    else:  # on unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1, runtime cuDNN > 9.15.0
        arch = major in (9, 10) and (cuda >= 13 or minor in (0, 3))
        prefer = _truthy(s.cudnn_deprioritized_env) is not True and cudnn > 91500 and arch
    return CUDNN_FIRST if prefer else DEFAULT_ORDER


def _heads(c: SdpaCall, supports_gqa: bool, mqa: bool) -> str | None:
    """``check_batch_size_and_num_heads_dense``: equal heads, or grouped (enable_gqa) where the kernel takes them."""
    if c.q_heads == c.kv_heads:
        return None
    if mqa and c.kv_heads == 1:
        return None
    if c.enable_gqa and supports_gqa and c.kv_heads and c.q_heads % c.kv_heads == 0:
        return None
    return f"{c.q_heads} query heads against {c.kv_heads} key/value heads" + (
        "" if c.enable_gqa else " without enable_gqa") + ("" if supports_gqa else ", no grouped heads")


def flash_refused(c: SdpaCall, vendor: str, capability: tuple[int, int], s: SdpaSettings) -> str | None:
    """Why ``can_use_flash_attention`` would refuse the call (None: it takes it)."""
    amd = vendor.upper() != "NVIDIA"
    if c.has_attn_mask:
        return "an attn_mask (check_for_attn_mask)"
    limit = 512 if amd else 256
    if not (c.head_dim_qk == c.head_dim_v and c.head_dim_qk <= limit):
        return f"head dims q/k {c.head_dim_qk}, v {c.head_dim_v}: must be equal and <= {limit} (check_head_dim_size_flash)"
    if not amd and not ((8, 0) <= capability <= (12, 1)):
        return f"sm {capability[0]}.{capability[1]} outside [8.0, 12.1]"
    if not amd and ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)) and c.requires_grad:
        d = c.head_dim_qk
        if not (d <= 192 or (c.dropout_p == 0 and d > 224)):
            return f"training with head dim {d} on sm 8.6-8.9 / 12.x"
    if c.is_causal and c.seq_q != c.seq_kv:
        return "is_causal with seq_q != seq_kv (check_flash_causal_non_square_seqlens)"
    if not c.half:
        return f"{c.dtype}: float16 / bfloat16 only (check_dtypes_low_precision)"
    return _heads(c, supports_gqa=True, mqa=s.torch >= (2, 15))


def efficient_refused(c: SdpaCall, vendor: str, capability: tuple[int, int], s: SdpaSettings) -> str | None:
    """Why ``can_use_mem_efficient_attention`` would refuse the call."""
    amd = vendor.upper() != "NVIDIA"
    if amd:
        align, limit = (8 if c.half else 4), 512
        if not (c.head_dim_qk == c.head_dim_v and c.head_dim_qk <= limit):
            return f"head dims q/k {c.head_dim_qk}, v {c.head_dim_v} on ROCm: equal and <= {limit}"
    else:
        if not ((5, 0) <= capability <= (12, 1)):
            return f"sm {capability[0]}.{capability[1]} outside [5.0, 12.1]"
        # minimum_gemm_alignment: tensor cores from sm 8.0 on, 128 bits per load
        align = max(4, 128 // (16 if c.half else 32)) if capability >= (8, 0) else 1
        limit = None
    if c.head_dim_qk % align or c.head_dim_v % align:
        return f"head dims {c.head_dim_qk}/{c.head_dim_v} not multiples of {align} (check_head_dim_size_mem_efficient)"
    if c.dtype not in ("float16", "bfloat16", "float32") or (not amd and capability < (8, 0) and c.dtype == "bfloat16"):
        return f"{c.dtype}"
    return _heads(c, supports_gqa=not amd and s.torch >= (2, 15), mqa=not amd and s.torch >= (2, 15))


def cudnn_refused(c: SdpaCall, vendor: str, capability: tuple[int, int], s: SdpaSettings) -> str | None:
    """Why ``can_use_cudnn_attention`` would refuse the call."""
    if vendor.upper() != "NVIDIA":
        return "no cuDNN on ROCm"
    cudnn, _ = s.wheel()
    if s.torch >= (2, 9) and c.dropout_p > 0 and 91100 < cudnn < 91400:
        return f"dropout with cuDNN {cudnn} (9.11-9.13 refused)"
    if not c.half:
        return f"{c.dtype}: float16 / bfloat16 only (check_dtypes_low_precision)"
    if not ((8, 0) <= capability <= (12, 1)):
        return f"sm {capability[0]}.{capability[1]} outside [8.0, 12.1]"
    if s.torch >= (2, 14) and c.dropout_p * 16 != math.floor(c.dropout_p * 16):
        return f"dropout {c.dropout_p} not a multiple of 1/16 (check_cudnn_dropout)"
    if c.batch > 65535 or c.q_heads > 65535:
        return "batch or heads over 65535"
    sm90_10x = capability[0] == 10 or capability == (9, 0)
    limit = 128
    if s.torch >= (2, 14):
        if sm90_10x and cudnn > 92200:
            limit = 256
        elif sm90_10x and cudnn >= 91100 and (c.head_dim_qk, c.head_dim_v) == (192, 128):
            limit = 192
    elif cudnn >= 91000 and capability == (9, 0):
        limit = 256
    if c.head_dim_qk > limit or c.head_dim_v > limit:
        return f"head dim {max(c.head_dim_qk, c.head_dim_v)} over {limit} (check_cudnn_tensor_shapes)"
    if c.head_dim_qk % 8 or c.head_dim_v % 8:
        return "head dims not multiples of 8"
    if c.seq_kv == 1 or (c.dropout_p > 0 and c.seq_q == 1):
        return "key sequence of 1 (or query of 1 with dropout)"
    if s.torch >= (2, 14) and limit == 256 and c.requires_grad and (c.head_dim_qk, c.head_dim_v) not in (
            (192, 128), (256, 256)) and (c.head_dim_qk > 128 or c.head_dim_v > 128):
        return "backward with these head dims (check_cudnn_d256_bprop_head_dim)"
    return _heads(c, supports_gqa=True, mqa=True)


_REFUSED = {FLASH: flash_refused, EFFICIENT: efficient_refused, CUDNN: cudnn_refused}


def choose_kernel(c: SdpaCall, vendor: str, capability: tuple[int, int], s: SdpaSettings) -> Choice:
    """The kernel ``select_sdp_backend`` picks for the call on this GPU with this torch: the first of the priority
    order that is enabled and whose checks pass; math when enabled and reached (it takes any call)."""
    order = priority_order(vendor, capability, s)
    refused: list[tuple[str, str]] = []
    for kernel in order:
        if kernel not in s.enabled:
            refused.append((kernel, "disabled in this process"))
            continue
        if kernel == MATH:
            return Choice(MATH, order, tuple(refused))
        why = _REFUSED[kernel](c, vendor, capability, s)
        if why is None:
            return Choice(kernel, order, tuple(refused))
        refused.append((kernel, why))
    return Choice(MATH, order, tuple(refused))


@dataclass(frozen=True)
class SavedSpec:
    """One tensor a fused kernel keeps for its backward besides query, key, value (and the mask as passed)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        size = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "uint64": 8}[self.dtype]
        return math.prod(self.shape) * size


def saved_by_kernel(kernel: str, c: SdpaCall) -> tuple[SavedSpec, ...]:
    """What a fused kernel's autograd node keeps besides its inputs (``derivatives.yaml``; the shapes its CUDA
    forward allocates): the output, and for training the float32 log-sum-exp rows: flash ``[B, H, L]``,
    memory-efficient ``[B, H, ceil(L / 32) x 32]`` (padded to its 32-row blocks), cuDNN's statistics
    ``[B, H, L, 1]``. Their RNG seed and offset (16 bytes) are left out here. Math keeps what its decomposition
    keeps (the attention matrix): none of these."""
    if kernel == MATH:
        return ()
    out = SavedSpec("output", (c.batch, c.q_heads, c.seq_q, c.head_dim_v), c.dtype)
    if not c.requires_grad:
        return (out,)
    rows = {FLASH: (c.batch, c.q_heads, c.seq_q),
            EFFICIENT: (c.batch, c.q_heads, math.ceil(c.seq_q / 32) * 32),
            CUDNN: (c.batch, c.q_heads, c.seq_q, 1)}[kernel]
    return out, SavedSpec("logsumexp", rows, "float32")
