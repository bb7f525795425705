"""The measurements of ``remat calibrate`` (issue #56): each a small function taking a device and returning plain
numbers (remat.target.calibration's records), which remat.target.calibration maps to a device spec file (Note
[Calibrated fields] there). On a CUDA GPU they take well under a minute (--quick: less); on a CPU they run only
for the tests, at tiny sizes (:data:`CPU_TEST`), and say so.

Kernel time is read with CUDA events around a batch of calls (enough for about 20 ms), the median of
``repeats`` batches; host time with the wall clock between two synchronizations.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
from torch import nn

from remat._compat import TorchDispatchMode, op_bytes, op_flops
from remat.target.calibration import ClassSample, CopyRate, Environment, GemmRate, HostSample, Measurements
from remat.target.this_gpu import driver_version

__all__ = ["Sizes", "FULL", "QUICK", "CPU_TEST", "measure", "environment", "gemm_rates", "attention_samples",
           "memory_samples", "foreach_samples", "host_costs", "copy_rates", "shortest_kernel"]


@dataclass(frozen=True)
class Sizes:
    """How large and how often a calibration measures."""

    #: square products, n x n by n x n
    gemm: tuple[int, ...]
    #: the elementwise and reduction samples' tensors: tokens x width, bfloat16
    tokens: int
    width: int
    #: attention calls: (batch, heads, sequence, head dim), bfloat16, causal
    attention: tuple[tuple[int, int, int, int], ...]
    #: the optimizer sample: AdamW (foreach) over this many float32 tensors of this many elements
    foreach: tuple[int, int]
    copy_bytes: int
    #: batches timed per figure (the median is kept)
    repeats: int
    #: seconds of bf16 products before measuring (the GPU's clocks rise)
    warmup_s: float


FULL = Sizes(gemm=(1024, 2048, 4096, 8192), tokens=8192, width=4096,
             attention=((4, 16, 2048, 128), (4, 32, 2048, 64)), foreach=(32, 2**22), copy_bytes=2**28, repeats=7,
             warmup_s=2.0)
QUICK = Sizes(gemm=(1024, 4096), tokens=8192, width=2048, attention=((4, 16, 2048, 128),), foreach=(16, 2**22),
              copy_bytes=2**26, repeats=3, warmup_s=1.0)
#: the CPU test run: the pipeline end to end in seconds (its figures are a CPU's, not a GPU's); 1024 tokens, so that
#: the host block's wall is well above the model's own work between operators (at 64 the forward read 0.38 ms
#: against 0.41 ms of that work on a loaded 2-core machine, and the decomposition had nothing left to divide)
CPU_TEST = Sizes(gemm=(32, 64), tokens=1024, width=64, attention=((1, 2, 32, 16),), foreach=(4, 1024),
                 copy_bytes=2**20, repeats=2, warmup_s=0.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def _kernel_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds of one call of ``fn`` on the device: the median of ``repeats`` batches, each enough calls for
    about 20 ms (CUDA events on a GPU, the wall clock on a CPU), after two unread calls."""
    fn(), fn()
    calls = max(1, min(200, int(0.02 / max(_wall(fn, device), 1e-7))))
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            times.append(_wall(lambda: [fn() for _ in range(calls)], device) / calls)
    return statistics.median(times)


class _Counted(TorchDispatchMode):
    """What the time model counts of the operators run under it: FLOPs, bytes, operators, their names."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = self.bytes = self.operators = 0
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.operators += 1
        self.flops += op_flops(func, args, kwargs, out)
        self.bytes += op_bytes(func, args, kwargs, out)
        name = str(func).rsplit(".", 1)[0]
        if name not in self.names:
            self.names.append(name)
        return out


def _counted(fn: Callable[[], object]) -> _Counted:
    with _Counted() as counted:
        fn()
    return counted


def _sample(op_class: str, label: str, fn: Callable[[], object], device: torch.device, repeats: int) -> ClassSample:
    counted = _counted(fn)
    return ClassSample(op_class, label, counted.flops, counted.bytes, _kernel_seconds(fn, device, repeats),
                       tuple(counted.names))


def environment(device: torch.device) -> Environment:
    """The GPU (or this CPU), torch, CUDA and the driver, now."""
    date = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    if device.type != "cuda":
        from remat.target.devices import cpu_spec

        return Environment("cpu", False, cpu_spec().memory_bytes, torch.__version__, date=date,
                           machine=platform.platform())
    props = torch.cuda.get_device_properties(device)
    return Environment(props.name, True, int(props.total_memory), torch.__version__, torch.version.cuda or "",
                       driver_version(), (props.major, props.minor), date, platform.platform())


def gemm_rates(device: torch.device, sizes: tuple[int, ...], repeats: int) -> tuple[GemmRate, ...]:
    """Square products at each size in bfloat16, float16, TF32 (a GPU's: float32 on its tensor cores) and plain
    float32 (TF32 off), into a preallocated output."""
    dtypes = [("bfloat16", torch.bfloat16, None), ("float16", torch.float16, None)]
    if device.type == "cuda":
        dtypes.append(("tf32", torch.float32, True))
    dtypes.append(("float32", torch.float32, False))
    out = []
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        for label, dtype, tf32 in dtypes:
            if tf32 is not None:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            for n in sizes:
                a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
                c = torch.empty(n, n, device=device, dtype=dtype)
                out.append(GemmRate(label, n, 2 * n ** 3, _kernel_seconds(lambda: torch.mm(a, b, out=c), device,
                                                                          repeats)))
                del a, b, c
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    return tuple(out)


def attention_samples(device: torch.device, shapes: tuple[tuple[int, int, int, int], ...],
                      repeats: int) -> tuple[ClassSample, ...]:
    """``scaled_dot_product_attention`` forward and backward, causal, bfloat16, the kernel torch picks here."""
    out = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)

        def step() -> None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), g)

        out.append(_sample("attention", f"{b}x{h}x{s}x{d}", step, device, repeats))
    return tuple(out)


def memory_samples(device: torch.device, tokens: int, width: int, repeats: int) -> tuple[ClassSample, ...]:
    """Elementwise, transcendental and reduction operators over ``tokens x width`` bfloat16 tensors (a training
    step's activations), and a plain copy of a float32 tensor of the same elements (the best bandwidth, for a GPU
    whose peak is not known)."""
    x, y = (torch.randn(tokens, width, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(width, device=device, dtype=torch.bfloat16)
    big = torch.randn(tokens, width, device=device)
    copy = torch.empty_like(big)
    shape = f"{tokens}x{width}"
    cases = [
        ("pointwise", f"mul {shape}", lambda: x * y),
        ("pointwise", f"add broadcast {shape}", lambda: x + w),
        ("pointwise", f"cast to float32 {shape}", lambda: x.float()),
        ("transcendental", f"silu {shape}", lambda: F.silu(x)),
        ("transcendental", f"gelu {shape}", lambda: F.gelu(x)),
        ("reduction", f"sum over rows {shape}", lambda: x.sum(-1)),
        ("reduction", f"softmax {shape}", lambda: torch.softmax(x, -1)),
        ("reduction", f"layer_norm {shape}", lambda: F.layer_norm(x, (width,), w, w)),
        ("bandwidth", f"copy float32 {shape}", lambda: copy.copy_(big)),
    ]
    return tuple(_sample(cls, label, fn, device, repeats) for cls, label, fn in cases)


def foreach_samples(device: torch.device, tensors: int, numel: int, repeats: int) -> tuple[ClassSample, ...]:
    """AdamW's foreach step over ``tensors`` float32 parameters of ``numel`` elements (its ``_foreach_*``
    kernels)."""
    params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, device=device)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    with torch.no_grad():
        return (_sample("foreach", f"AdamW foreach, {tensors} x {numel:,} float32", opt.step, device, repeats),)


class _Block(nn.Module):
    """A decoder block's operators at a tiny width: RMS norm as Hugging Face writes it, a gated MLP, a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.gate, self.up, self.down = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.weight * h.to(x.dtype)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def host_costs(device: torch.device, repeats: int, *, blocks: int = 4, width: int = 64,
               tokens: int = 8) -> HostSample:
    """The device host's seconds per operator (Note [Calibrated fields] in remat.target.calibration; Note [Host
    time decomposed] in remat.costs.host_time): ``blocks`` decoder blocks at a training step's width and tokens
    (bfloat16 on a GPU), forward and backward timed on the host (synchronized before, not inside: the host runs
    ahead of the GPU), less the blocks' own work between their operators (remat.profile.host_work, as for a planned
    model), over the operators they dispatch."""
    from remat.costs.host_time import op_s_from_phase
    from remat.profile.host_work import measure_host_work

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layers = nn.Sequential(*(_Block(width) for _ in range(blocks))).to(device=device, dtype=dtype)
    x = torch.randn(tokens, width, device=device, dtype=dtype)
    params = list(layers.parameters())

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().square().mean()

    def step() -> None:
        loss_fn(layers(x)).backward()

    def clear() -> None:
        for p in params:
            p.grad = None

    for _ in range(3):  # unread: the first calls (the engine's, the allocator's) run slow
        clear(), step()
    walls: tuple[list[float], list[float]] = ([], [])
    for _ in range(max(10, 4 * repeats)):
        clear()
        _sync(device)
        started = time.perf_counter()
        loss = loss_fn(layers(x))
        forward = time.perf_counter()
        loss.backward()
        walls[0].append(forward - started)
        walls[1].append(time.perf_counter() - forward)
        _sync(device)
    clear()
    work = measure_host_work(layers, (x,), {}, loss_fn, output_alive=False, targets=params)
    wall = (min(walls[0]), min(walls[1]))
    python = (work.forward_python_s, work.backward_python_s)
    ops = (work.forward_ops, work.backward_ops)
    return HostSample(forward_op_s=op_s_from_phase(wall[0], python[0], ops[0]),
                      backward_op_s=op_s_from_phase(wall[1], python[1], ops[1]), wall_s=wall, python_s=python,
                      ops=ops, label=f"{blocks} decoder blocks, width {width}, {tokens} tokens, "
                                     f"{str(dtype).removeprefix('torch.')}; the least of {len(walls[0])} steps")


def copy_rates(device: torch.device, nbytes: int, repeats: int) -> tuple[CopyRate, ...]:
    """Copies of ``nbytes`` between device memory and host memory, each way, pinned (on a GPU) and pageable."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    hosts = [(False, torch.empty(nbytes, dtype=torch.uint8).fill_(1))]
    if device.type == "cuda":
        hosts.insert(0, (True, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)))
    out = []
    for pinned, host in hosts:
        for direction, fn in (("device_to_host", lambda: host.copy_(src, non_blocking=pinned)),
                              ("host_to_device", lambda: src.copy_(host, non_blocking=pinned))):
            fn()
            seconds = statistics.median(_wall(fn, device) for _ in range(max(3, repeats)))
            out.append(CopyRate(direction, pinned, nbytes, seconds))
    return tuple(out)


def shortest_kernel(device: torch.device, repeats: int, kernels: int = 200) -> float | None:
    """GPU seconds of a one-element kernel: ``kernels`` additions captured in a CUDA graph, the graph's replay
    timed with CUDA events (no host launch between them) over ``kernels``; None on a CPU."""
    if device.type != "cuda":
        return None
    z = torch.zeros(1, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # torch's recipe: warm up on a side stream before capturing
        for _ in range(3):
            z.add_(1)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            z.add_(1)
    return _kernel_seconds(graph.replay, device, repeats) / kernels


def _warm_up(device: torch.device, seconds: float) -> None:
    if seconds <= 0:
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    ended = time.perf_counter() + seconds
    while time.perf_counter() < ended:
        for _ in range(20):
            a @ a
        _sync(device)


def measure(device: torch.device | str = "cuda", *, quick: bool = False,
            progress: Callable[[str], None] | None = None) -> Measurements:
    """Every measurement of a calibration on ``device`` (a CUDA GPU; "cpu" only for the tests, at
    :data:`CPU_TEST`'s sizes). Runs under ``torch.no_grad`` where nothing needs gradients; changes no setting
    it does not restore (the random state included: its inputs are drawn from a seed of its own)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = CPU_TEST if device.type != "cuda" else QUICK if quick else FULL
    if device.type != "cuda":
        # the CPU test run on one thread: on a shared machine a busy core stalls every multithreaded kernel
        # (20 s instead of 1 for the host's figures on two loaded cores)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):
                return _measure(device, sizes, quick, progress)
        finally:
            torch.set_num_threads(threads)
    with torch.random.fork_rng(devices=[device]):
        return _measure(device, sizes, quick, progress)


def _measure(device: torch.device, sizes: Sizes, quick: bool,
             progress: Callable[[str], None] | None) -> Measurements:
    say = progress or (lambda _: None)
    started = time.perf_counter()
    env = environment(device)
    say("warming up")
    _warm_up(device, sizes.warmup_s)
    with torch.no_grad():
        say("matrix products")
        gemm = gemm_rates(device, sizes.gemm, sizes.repeats)
        say("elementwise and reductions")
        samples = memory_samples(device, sizes.tokens, sizes.width, sizes.repeats)
    say("attention")
    samples += attention_samples(device, sizes.attention, sizes.repeats)
    say("the optimizer's foreach kernels")
    samples += foreach_samples(device, *sizes.foreach, sizes.repeats)
    say("the host's cost per operator")
    host = host_costs(device, sizes.repeats, width=sizes.width, tokens=sizes.tokens)
    say("the shortest kernel")
    shortest = shortest_kernel(device, sizes.repeats)
    say("copies to and from host memory")
    with torch.no_grad():
        copies = copy_rates(device, sizes.copy_bytes, sizes.repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Measurements(env, gemm, samples, host, copies, seconds=time.perf_counter() - started, quick=quick,
                        shortest_kernel_s=shortest)

