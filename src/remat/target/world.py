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
steps (torch's default on CUDA), the attention kernel's saved tensors. Collectives run on torch's fake process
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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from remat._compat import FAKE_WORLD_FLOOR, FAKE_WORLD_FLOOR_WHY, fake_mode, fake_store, meshes_built_for_real, \
    require_torch, tree_map
from remat.costs.allocator import AllocatorConfig
from remat.errors import InvalidInputError, UnsupportedError
from remat.target.devices import DeviceSpec, device_spec

#: ``parallelize(model, mesh)``: applies the run's FSDP2 / tensor parallelism to ``model`` in place
Parallelize = Callable[[nn.Module, Any], Any]


@dataclasses.dataclass(frozen=True)
class Target:
    """A device and a world that are not here: what :func:`remat.optimize_checkpointing` plans for with
    ``target=``. Figures planned for it are predicted for ``device``, not measured.

    ``world`` ranks, of which ``fsdp`` shard parameters with FSDP2 (default: ``world // tp`` when ``world`` > 1)
    and ``tp`` split them with tensor parallelism (a mesh ``(fsdp, tp)`` named ``("dp", "tp")``). ``parallelize``
    applies the run's parallelism to the model (``parallelize(model, mesh)``, as torchtitan's
    ``parallelize_llama`` does); without it, FSDP2 wraps every block of the model's repeated layers, then the
    root, with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``, and tensor parallelism is refused (it needs
    the model's own plan). ``allocator``: the CUDA caching allocator's settings (``expandable_segments``)."""

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", device_spec(self.device))
        for name in ("world", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"Target.{name} must be a whole number of ranks >= 1, got {value!r}")
        fsdp = self.fsdp if self.fsdp is not None else (self.world // self.tp if self.world // self.tp > 1 else None)
        if fsdp is not None and (isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1):
            raise InvalidInputError(f"Target.fsdp must be a whole number of ranks >= 1, got {fsdp!r}")
        if (fsdp or 1) * self.tp != self.world:
            raise InvalidInputError(
                f"Target: fsdp {fsdp or 1} x tp {self.tp} = {(fsdp or 1) * self.tp} ranks, but world is {self.world}: "
                f"give world = fsdp x tp (e.g. world={(fsdp or 1) * self.tp})")
        if not 0 <= self.rank < self.world:
            raise InvalidInputError(f"Target.rank must be in [0, {self.world}), got {self.rank}")
        object.__setattr__(self, "fsdp", fsdp)

    @property
    def spec(self) -> DeviceSpec:
        assert isinstance(self.device, DeviceSpec)
        return self.device

    @property
    def is_cuda(self) -> bool:
        """Whether the target's memory is counted as the CUDA caching allocator counts it (every GPU in the
        table: ROCm's allocator is the same code)."""
        return self.spec.name != "cpu"

    def describe(self) -> str:
        """E.g. "NVIDIA H100 SXM 80GB (79.2 GiB) x 8 ranks (FSDP 8)"."""
        parts = [f"FSDP {self.fsdp}"] if self.fsdp else []
        parts += [f"TP {self.tp}"] if self.tp > 1 else []
        ranks = f" x {self.world} ranks ({', '.join(parts)})" if self.world > 1 or parts else ""
        return f"{self.spec}{ranks}"


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


def repeated_blocks(model: nn.Module) -> list[str]:
    """The qualified names of the blocks of the model's repeated layers: the children of every ``ModuleList``
    (or ``Sequential``) of two or more modules of one class (a transformer's layers), in order."""
    blocks = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            blocks += [f"{name}.{k}" if name else k for k in m._modules]
    return blocks


def default_parallelize(target: Target) -> Parallelize:
    """FSDP2 as most runs apply it: every repeated block ``fully_shard``-ed, then the root, parameters gathered
    in ``target.param_dtype`` and gradients reduced in ``target.reduce_dtype``; blocks reshard after their
    forward. Tensor parallelism needs the model's own plan: refused."""
    def parallelize(model: nn.Module, mesh: Any) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if target.tp > 1:
            raise UnsupportedError(
                f"tensor parallelism (tp={target.tp}) needs the model's own plan of which layers split how: pass "
                "Target(parallelize=fn), where fn(model, mesh) applies parallelize_module on mesh['tp'] and "
                "fully_shard on mesh['dp'] as your run does (torchtitan's parallelize_llama is such a function)")
        mp = MixedPrecisionPolicy(param_dtype=target.param_dtype, reduce_dtype=target.reduce_dtype)
        mods = dict(model.named_modules())
        for name in repeated_blocks(model):
            fully_shard(mods[name], mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)

    return parallelize


@contextlib.contextmanager
def built(target: Target, model: nn.Module, example_inputs: Any,
          before: Callable[[nn.Module, Any], None] | None = None) -> Iterator[tuple[nn.Module, Any, Any]]:
    """The target's world, with ``model`` copied onto fake tensors, parallelized as on the target, and the
    inputs made fake: yields (fake model, fake inputs, the FakeTensorMode to run them under). ``before(fake,
    inputs)`` runs on the copy before it is parallelized (the capture: Note [Capture before parallelizing] in
    remat.target.source)."""
    mode = fake_mode()
    with fake_world(target) as mesh:
        fake = fake_copy(model, mode)
        inputs = fake_inputs(example_inputs, mode)
        if before is not None:
            before(fake, inputs)
        if mesh is not None:
            with mode, meshes_built_for_real():
                (target.parallelize or default_parallelize(target))(fake, mesh)
        yield fake, inputs, mode

