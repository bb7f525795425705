"""The world a modelled target trains in, built on fake tensors on this machine: the model copied without its
weights, the batch from shapes, torch's fake process group at the target's world size, FSDP2 and tensor
parallelism applied as the run will apply them.

Note [Fake CUDA on a CPU build]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A CPU build of torch aborts in its device guard on any operator over a fake CUDA tensor, and the lent GPU is not
where users plan. So a target's step is recorded on fake *CPU* tensors in the target's dtypes (the same operators
and storage sizes, no memory), and what the target's kernels do differently from the CPU ones is modelled
explicitly where it matters to memory (Note [Target kernels] in remat.target.source; docs/targets.md): each
block rounded to the CUDA allocator's 512 bytes, the allocator replayed for reserved bytes, ``foreach`` optimizer
steps (torch's default on CUDA), the attention kernel CUDA picks (Note [Attention on the target] in
remat.target.attention). Collectives run on torch's fake process
group (backend ``"fake"``): they return at once with their outputs allocated, so FSDP2's all-gather and
reduce-scatter buffers, sharded parameters, gradients and optimizer state are the real code's, at a world size
that does not exist.

In: a :class:`Target`, the user's model (any device, meta included; never changed) and example inputs (tensors,
meta tensors or fake tensors: only shapes and dtypes are read). Out: a fake copy of the model, parallelized as on
the target, and fake inputs, inside :func:`fake_world`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from remat._compat import FAKE_WORLD_FLOOR, FAKE_WORLD_FLOOR_WHY, batch_layout, checkpoint_policies_asked_for, \
    fake_mode, fake_store, masks_decided_for, meshes_built_for_real, require_torch, tree_map
from remat.costs.allocator import AllocatorConfig
from remat.errors import InternalError, InvalidInputError, RematError, UnsupportedError
from remat.costs.attention_kernels import SdpaSettings
from remat.target.attention import settings_here
from remat.target.devices import DeviceSpec
from remat.target.spec_file import device_spec

#: ``parallelize(model, mesh)``: applies the run's FSDP2 / tensor parallelism to ``model`` in place
Parallelize = Callable[[nn.Module, Any], Any]


@dataclasses.dataclass(frozen=True)
class Target:
    """A device and a world that are not here: what :func:`remat.optimize_checkpointing` plans for with
    ``target=``. Figures planned for it are predicted for ``device``, not measured.

    ``world`` ranks, of which ``fsdp`` shard parameters with FSDP2 (default: ``world // tp`` when ``world`` > 1)
    and ``tp`` split them with tensor parallelism (a mesh ``(fsdp, tp)`` named ``("dp", "tp")``). ``parallelize``
    applies the run's parallelism to the model (``parallelize(model, mesh)``, as torchtitan's
    ``parallelize_llama`` does); without it, FSDP2 wraps every block of the model (:func:`repeated_blocks`: those a
    Hugging Face model declares in ``_no_split_modules``, else the repeated children of a ``ModuleList``,
    ``Sequential`` or ``ModuleDict``), then the root, with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``, and
    tensor parallelism is refused (it needs the model's own plan); every plan says which wrapping it assumed.
    ``allocator``: the CUDA caching allocator's settings (an :class:`AllocatorConfig` or a dict of its fields); its
    capacity is the device's memory unless given. Fields are checked when the Target is made (dtype names such as
    ``"bf16"`` are taken)."""

    device: DeviceSpec | str = "cpu"
    world: int = 1
    fsdp: int | None = None
    tp: int = 1
    param_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    parallelize: Parallelize | None = None
    allocator: AllocatorConfig = AllocatorConfig()
    #: the loop clips gradients to this norm after backward (``clip_grad_norm_(..., foreach=True)``), None: it does not
    clip_grad_norm: float | None = None
    #: the rank whose step is recorded (ranks of a data-parallel world run the same step)
    rank: int = 0
    #: bytes/s each GPU sends to other nodes (one direction): 400 Gb/s, one NIC per GPU, as Meta's H100 training
    #: clusters ("Building Meta's GenAI infrastructure", engineering.fb.com, 2024-03-12: RoCE and InfiniBand
    #: fabrics, both 400 Gbps endpoints); collectives over ranks of several nodes run at it (issue #40)
    network_bytes_per_s: float | None = 50e9
    #: GPUs per node: a group of more ranks (counting the TP ranks between FSDP ranks) crosses the network
    devices_per_node: int = 8
    #: the torch release the run uses ("2.11"): which attention kernel CUDA picks (Note [Attention on the target] in
    #: remat.target.attention); None: this process's torch
    torch_version: str | None = None
    #: host memory one rank may fill with offloaded activations (bytes; the server's, not the GPU's: e.g. a DGX H100's
    #: 2 TB over 8 GPUs, less what the run itself uses); None: not limited (Note [Offload in the memory model])
    host_memory_bytes: int | None = None
    #: the run's SDP switches, priority order and cuDNN environment, which decide its attention kernel (Note
    #: [Attention on the target] in remat.target.attention); None: this process's, read when the Target is made
    #: (and fixed then: a switch the process changes later does not change the target)
    sdpa: SdpaSettings | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, (DeviceSpec, str)):
            raise InvalidInputError(f"Target.device takes a device name such as 'h100-80gb', a JSON file of a spec or a "
                                    f"DeviceSpec, got {type(self.device).__name__} {self.device!r}")
        object.__setattr__(self, "device", device_spec(self.device))
        for name in ("world", "tp", "rank", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "rank" else 1):
                raise InvalidInputError(f"Target.{name} must be a whole number {'>= 0' if name == 'rank' else '>= 1'}, "
                                        f"got {type(value).__name__} {value!r}")
        fsdp = self.fsdp if self.fsdp is not None else (self.world // self.tp if self.world // self.tp > 1 else None)
        if fsdp is not None and (isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1):
            raise InvalidInputError(f"Target.fsdp must be a whole number of ranks >= 1, got {fsdp!r}")
        if self.fsdp is None and self.world % self.tp:
            raise InvalidInputError(f"Target: world {self.world} is not a multiple of tp {self.tp}: the ranks of a "
                                    f"tensor-parallel group split the world evenly "
                                    f"(e.g. world={self.world // self.tp * self.tp or self.tp})")
        if (fsdp or 1) * self.tp != self.world:
            raise InvalidInputError(
                f"Target: fsdp {fsdp or 1} x tp {self.tp} = {(fsdp or 1) * self.tp} ranks, but world is {self.world}: "
                f"give world = fsdp x tp (e.g. world={(fsdp or 1) * self.tp})")
        if self.rank >= self.world:
            raise InvalidInputError(f"Target.rank must be in [0, {self.world}), got {self.rank}")
        object.__setattr__(self, "fsdp", fsdp)
        for name in ("param_dtype", "reduce_dtype"):
            object.__setattr__(self, name, _dtype(name, getattr(self, name)))
        for name in ("network_bytes_per_s", "clip_grad_norm", "host_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise InvalidInputError(f"Target.{name} takes a number > 0 or None, got {value!r}")
        if self.torch_version is not None and not (isinstance(self.torch_version, str)
                                                   and re.match(r"^\d+\.\d+", self.torch_version)):
            raise InvalidInputError(f"Target.torch_version takes a release such as '2.11' or None (this process's "
                                    f"torch), got {self.torch_version!r}")
        if self.sdpa is None:
            object.__setattr__(self, "sdpa", settings_here(self.torch_version))
        elif not isinstance(self.sdpa, SdpaSettings):
            raise InvalidInputError(f"Target.sdpa takes remat.costs.attention_kernels.SdpaSettings or None (this "
                                    f"process's switches), got {type(self.sdpa).__name__} {self.sdpa!r}")
        if self.parallelize is not None and not callable(self.parallelize):
            raise InvalidInputError(f"Target.parallelize takes a function fn(model, mesh), got {self.parallelize!r}")
        allocator = self.allocator
        if isinstance(allocator, Mapping):
            known = [f.name for f in dataclasses.fields(AllocatorConfig)]
            if set(allocator) - set(known):
                raise InvalidInputError(f"Target.allocator: unknown settings {sorted(set(allocator) - set(known))}; "
                                        f"AllocatorConfig takes {known}")
            allocator = AllocatorConfig(**allocator)
        if not isinstance(allocator, AllocatorConfig):
            raise InvalidInputError(f"Target.allocator takes an AllocatorConfig (or a dict of its fields), got "
                                    f"{allocator!r}")
        if self.is_cuda and allocator.capacity_bytes is None:  # the device's memory is the allocator's limit
            allocator = dataclasses.replace(allocator, capacity_bytes=self.spec.memory_bytes)
        object.__setattr__(self, "allocator", allocator)

    @property
    def spec(self) -> DeviceSpec:
        if not isinstance(self.device, DeviceSpec):  # __post_init__ made it one
            raise InternalError(f"Target.device is {self.device!r}, not a DeviceSpec", stage="target")
        return self.device

    @property
    def is_cuda(self) -> bool:
        """Whether the target's memory is counted as the CUDA caching allocator counts it (every GPU in the
        table: ROCm's allocator is the same code)."""
        return self.spec.name != "cpu"

    def blas_workspaces(self) -> tuple[int, ...]:
        """The bytes of each BLAS workspace a step holds in the target's allocator (Note [cuBLAS workspaces] in
        remat.target.workspace: torch's defaults for the device and the torch here, this process's environment);
        none on this machine's CPU."""
        if not self.is_cuda:
            return ()
        from remat.target.devices import generation_of
        from remat.target.workspace import blas_workspaces

        version = tuple(int(x) for x in re.findall(r"\d+", self.torch_version or torch.__version__)[:2])
        return blas_workspaces(self.spec.vendor, generation_of(self.spec), version, os.environ)

    def describe(self) -> str:
        """E.g. "NVIDIA H100 SXM 80GB (79.2 GiB) x 8 ranks (FSDP 8)"."""
        parts = [f"FSDP {self.fsdp}"] if self.fsdp else []
        parts += [f"TP {self.tp}"] if self.tp > 1 else []
        ranks = f" x {self.world} ranks ({', '.join(parts)})" if self.world > 1 or parts else ""
        return f"{self.spec}{ranks}"


def _aten(name: str) -> Any:
    return getattr(torch.ops.aten, name).default


#: Note [Policies for the target's kernels]
#: ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
#: A run's selective-checkpointing policy names the operators its device runs: torchtitan's save list names CUDA's
#: flash and memory-efficient attention. The step is recorded on fake CPU tensors (Note [Fake CUDA on a CPU build]),
#: where ``scaled_dot_product_attention`` runs the CPU flash kernel, which such a policy does not name: as shipped
#: it would recompute attention where the run saves it (Llama 3 8B, FSDP 4 x TP 2, batch 1 x 8192, torchtitan's
#: list: 39.17 GiB predicted reserved as shipped, 44.13 with the CPU kernel added by hand; issue #47). So while a
#: CUDA target's step is recorded, a policy asked about a CPU stand-in that it would not save is asked again about
#: the CUDA operators it stands in for (``remat._compat.checkpoint_policies_asked_for``), and saves where the run
#: would. Since Note [Attention on the target] (remat.target.attention) a call found as
#: ``F.scaled_dot_product_attention`` runs CUDA's operator itself, and the policy is asked about that; the stand-in
#: is left for a call the replacement does not reach. The stand-ins (docs/targets.md lists them):
CUDA_STAND_INS: dict[Any, tuple[Any, ...]] = {
    _aten("_scaled_dot_product_flash_attention_for_cpu"): tuple(
        _aten(n) for n in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                           "_scaled_dot_product_cudnn_attention")),
}


def as_target(target: Any) -> Target:
    """``target`` as a :class:`Target`: a Target as it is, a device name (``"h100-80gb"``) or a
    :class:`~remat.target.devices.DeviceSpec` as ``Target(device=...)``; anything else refused."""
    if isinstance(target, Target):
        return target
    if isinstance(target, (str, DeviceSpec)):
        return Target(device=target)
    raise InvalidInputError(f"target= takes a remat.Target (e.g. Target(device='h100-80gb', world=8)) or a device "
                            f"name, got {type(target).__name__} {target!r}")


#: dtype names a Target takes for param_dtype and reduce_dtype
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def _dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[value.lower().removeprefix("torch.")]
    raise InvalidInputError(f"Target.{name} takes a floating-point torch.dtype (torch.bfloat16, ...), None or one of "
                            f"the names {sorted(DTYPE_NAMES)}, got {value!r}")


@contextlib.contextmanager
def fake_world(target: Target) -> Iterator[Any]:
    """Torch's fake process group at the target's world size and its device mesh (None for one rank without
    FSDP), torn down after. Refuses when a process group is already initialized (a real run: plan there without
    ``target``, or in a process of its own)."""
    import torch.distributed as dist

    if target.world == 1 and not target.fsdp:
        yield None
        return
    require_torch(f"planning for a world of {target.world} ranks{' (FSDP)' if target.fsdp else ''} on torch's fake "
                  "process group", FAKE_WORLD_FLOOR, FAKE_WORLD_FLOOR_WHY)
    if not dist.is_available():
        raise UnsupportedError("planning for a world of several ranks needs torch.distributed, which this torch "
                               "build lacks; plan for world=1 or install a torch build with distributed support")
    if dist.is_initialized():
        raise UnsupportedError(
            f"a process group is already initialized (backend {dist.get_backend()}, world size "
            f"{dist.get_world_size()}): a target's world ({target.world} ranks) is modelled on torch's fake process "
            "group, which needs a process without one. Plan for the target in a process of its own (the CLI's "
            "`remat plan`), or plan this run with optimize_checkpointing without target= on every rank.")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=fake_store(), rank=target.rank, world_size=target.world)
    try:
        if target.tp > 1:
            mesh = init_device_mesh("cpu", (target.fsdp or 1, target.tp), mesh_dim_names=("dp", "tp"))
            # sliced here, outside the fake mode parallelize runs in: slicing computes coordinates with real tensor
            # operators (nonzero) that fake tensors cannot run; DeviceMesh keeps the slices made
            _ = mesh["dp"], mesh["tp"]
        else:
            mesh = init_device_mesh("cpu", (target.world,), mesh_dim_names=("dp",))
        yield mesh
    finally:
        dist.destroy_process_group()


def fake_copy(model: nn.Module, mode: Any) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake CPU tensors of the same shapes, dtypes and
    ``requires_grad`` (tied ones stay tied), made under ``mode`` without reading or allocating any weight; the
    model itself is not changed (it may live on the meta device). remat's own checkpointing is not copied."""
    from remat.rewrite import remove_checkpointing

    memo: dict[int, Any] = {}
    with mode:
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) not in memo:
                empty = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) \
                    if isinstance(t, nn.Parameter) else empty
    copied = copy.deepcopy(model, memo)
    remove_checkpointing(copied)
    return copied


def fake_inputs(example_inputs: Any, mode: Any) -> Any:
    """``example_inputs`` with every tensor replaced by a fake CPU tensor of its shape and dtype (``requires_grad``
    kept): real, meta and fake tensors alike, read for their shapes only."""
    def conv(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        with mode:
            out = torch.zeros(t.shape, dtype=t.dtype, device="cpu")
        return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out

    return tree_map(conv, example_inputs)


def repeated_blocks(model: nn.Module) -> tuple[list[str], str]:
    """The qualified names of the blocks a run shards one by one, in order, and how they were found: the modules
    of the classes a Hugging Face model declares it must not split (``_no_split_modules``: its decoder layers,
    as accelerate's FSDP2 wrapping uses them), else the children of every ``ModuleList``, ``Sequential`` or
    ``ModuleDict`` (torchtitan's layers) of two or more modules of one class. Blocks inside another block (a
    mixture of experts' ``ModuleList``) are left to it."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    found = [n for n, m in model.named_modules() if n and type(m).__name__ in declared]
    how = f"the classes the model declares in _no_split_modules ({', '.join(sorted(declared))})"
    if not found:
        how = "the repeated children of its ModuleList, Sequential and ModuleDict containers"
        for name, m in model.named_modules():
            if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and len(m) >= 2 \
                    and len({type(c) for c in m.children()}) == 1:
                found += [f"{name}.{k}" if name else k for k in m._modules]
    blocks: list[str] = []
    for name in found:
        if not any(name.startswith(b + ".") for b in blocks):
            blocks.append(name)
    return blocks, how


def wrapping_assumed(target: Target, model: nn.Module) -> str:
    """What the plan assumes of the run's FSDP2 / TP wrapping, for its notes (issue #47: a wrapping other than
    the run's predicts another step)."""
    if target.parallelize is not None:
        fn = getattr(target.parallelize, "__qualname__", None) or type(target.parallelize).__name__
        return f"parallelism as the run applies it: the given parallelize ({fn}) on a {target.describe()} mesh"
    if not target.fsdp:
        return "one rank, no FSDP2"
    mp = f"MixedPrecisionPolicy(param_dtype={target.param_dtype}, reduce_dtype={target.reduce_dtype})"
    blocks, how = repeated_blocks(model)
    if not blocks:
        return (f"FSDP2 by default over {target.fsdp} ranks: no repeated blocks found, so the whole model is one "
                f"FSDP2 unit (every parameter gathered at once), {mp}; if the run shards blocks, pass "
                "Target(parallelize=fn) (or a 4th value from a command-line target) applying its fully_shard calls")
    shown = ", ".join(blocks) if len(blocks) <= 4 else f"{blocks[0]}, {blocks[1]}, ..., {blocks[-1]}"
    return (f"FSDP2 by default over {target.fsdp} ranks: fully_shard on {len(blocks)} blocks ({shown}: {how}), "
            f"then the root, {mp}, blocks resharded after forward; if the run wraps otherwise, pass "
            "Target(parallelize=fn)")


def default_parallelize(target: Target) -> Parallelize:
    """FSDP2 as most runs apply it: every repeated block (:func:`repeated_blocks`) ``fully_shard``-ed, then the
    root, parameters gathered in ``target.param_dtype`` and gradients reduced in ``target.reduce_dtype``; blocks
    reshard after their forward. Tensor parallelism needs the model's own plan: refused."""
    def parallelize(model: nn.Module, mesh: Any) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if target.tp > 1:
            raise UnsupportedError(
                f"tensor parallelism (tp={target.tp}) needs the model's own plan of which layers split how: pass "
                "Target(parallelize=fn), where fn(model, mesh) applies parallelize_module on mesh['tp'] and "
                "fully_shard on mesh['dp'] as your run does (torchtitan's parallelize_llama is such a function)")
        mp = MixedPrecisionPolicy(param_dtype=target.param_dtype, reduce_dtype=target.reduce_dtype)
        mods = dict(model.named_modules())
        for name in repeated_blocks(model)[0]:
            fully_shard(mods[name], mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)

    return parallelize


@contextlib.contextmanager
def built(target: Target, model: nn.Module, example_inputs: Any,
          before: Callable[[nn.Module, Any], None] | None = None,
          attention_calls: list | None = None) -> Iterator[tuple[nn.Module, Any, Any]]:
    """The target's world, with ``model`` copied onto fake tensors, parallelized as on the target, and the
    inputs made fake: yields (fake model, fake inputs, the FakeTensorMode to run them under). ``before(fake,
    inputs)`` runs on the copy before it is parallelized (the capture: Note [Capture before parallelizing] in
    remat.target.source). While the block runs, attention runs the kernel the target's GPU would (Note [Attention
    on the target] in remat.target.attention), each call appended to ``attention_calls``."""
    from remat.target.attention import attention_as_on

    mode = fake_mode()
    # Note [Masks decided on values] in remat._compat.transformers: a Hugging Face model's mask as for the batch
    with fake_world(target) as mesh, masks_decided_for(*batch_layout(example_inputs)), \
            checkpoint_policies_asked_for(CUDA_STAND_INS) if target.is_cuda else contextlib.nullcontext():
        fake = fake_copy(model, mode)
        inputs = fake_inputs(example_inputs, mode)
        if before is not None:
            before(fake, inputs)
        if mesh is not None:
            with mode, meshes_built_for_real():
                if target.parallelize is None:
                    default_parallelize(target)(fake, mesh)
                else:
                    try:
                        target.parallelize(fake, mesh)
                    except RematError:
                        raise
                    except Exception as e:  # noqa: BLE001 - the user's function: theirs, traceback chained
                        fn = getattr(target.parallelize, "__qualname__", None) or repr(target.parallelize)
                        raise InvalidInputError(
                            f"Target.parallelize ({fn}) raised {type(e).__name__}: {str(e).strip()[:300]} -- while "
                            f"applied to a copy of the model on fake tensors over a mesh of {mesh.mesh_dim_names} = "
                            f"{tuple(mesh.shape)} (torch's fake process group); its traceback is chained below") \
                            from e
        with attention_as_on(target, attention_calls):
            yield fake, inputs, mode

