"""The device time model (remat.costs.device_time, remat.target.timing; issue #40) on hand-made operators whose
times the model's formulas fix."""

import pytest
import torch

from remat.costs.device_time import COLLECTIVE_EFFICIENCY, EFFICIENCY, DeviceRates, collective_seconds, op_class, \
    op_seconds
from remat.costs.recording import ForwardOp, Recording

H100 = DeviceRates(name="h100 bf16", flops_per_s=989e12, memory_bytes_per_s=3.35e12, launch_s=2e-6,
                   link_bytes_per_s=450e9, network_bytes_per_s=50e9, devices_per_node=8, generation="hopper")


@pytest.mark.parametrize("name, cls", [
    ("aten.mm.default", "matmul"), ("aten.addmm.default", "matmul"), ("aten.bmm.default", "matmul"),
    ("aten.convolution.default", "conv"), ("aten.convolution_backward.default", "conv"),
    ("aten._scaled_dot_product_flash_attention_for_cpu.default", "attention"),
    ("aten._flash_attention_backward.default", "attention"),
    ("aten.native_layer_norm.default", "reduction"), ("aten._log_softmax_backward_data.default", "pointwise"),
    ("aten.gelu_backward.default", "transcendental"), ("aten.silu.default", "transcendental"),
    ("aten.sum.dim_IntList", "reduction"), ("aten.mul.Tensor", "pointwise"), ("aten.relu.default", "pointwise"),
    ("c10d._allgather_base_.default", "collective"), ("_c10d_functional.all_reduce.default", "collective"),
    ("_c10d_functional.wait_tensor.default", "none"),
    ("aten._foreach_mul_.Scalar", "foreach"), ("aten._foreach_norm.Scalar", "foreach"),
])
def test_operators_fall_in_their_class(name, cls):
    assert op_class(name) == cls


def _h100(dtype=torch.bfloat16):
    from remat.target import Target
    from remat.target.timing import rates_of

    return rates_of(Target(device="h100-80gb"), dtype)


def test_the_roofline_on_an_h100_gives_the_times_worked_out_by_hand_from_the_sources():
    """Figures worked out by hand, not by the model's formula: the H100 SXM's dense bf16 peak is 989.5 TFLOP/s
    and its HBM3 3.35 TB/s (NVIDIA's datasheet, devices.json); on Hopper products reach 80% of the peak, attention
    33% (causal, FLOPs halved), elementwise kernels 59% of the bandwidth (measured on the H200, issue #56). A wrong efficiency, peak or
    bandwidth in the table fails here."""
    h100 = _h100()
    # 8192 x 4096 @ 4096 x 4096 in bf16: 274.9 GFLOP at 791.6 TFLOP/s = 347.2 us (FLOP-bound)
    assert op_seconds("aten.mm.default", 2 * 8192 * 4096 * 4096, 2 * (8192 * 4096 * 2 + 4096 * 4096),
                      h100) == pytest.approx(347.24e-6, rel=1e-4)
    # a pointwise product over 64 MiB (read 2, write 1): 201.3 MB at 1.9765 TB/s = 101.86 us (bytes-bound)
    assert op_seconds("aten.mul.Tensor", 2**24, 3 * 2**26, h100) == pytest.approx(101.86e-6, rel=1e-4)
    # 10 TFLOP of attention: cuDNN's on Hopper at 33% of 989.5 = 326.5 TFLOP/s
    assert op_seconds("aten._flash_attention_forward.default", 10**13, 1, h100) == pytest.approx(30.625e-3,
                                                                                                   rel=1e-4)
    # a tiny one: torchao's launch floor, 2 us
    assert op_seconds("aten.add.Tensor", 4, 48, h100) == 2e-6
    # a view moves nothing and launches nothing
    assert op_seconds("aten.view.default", 0, 0, h100) == 0.0
    # waiting on a collective is not a kernel
    assert op_seconds("_c10d_functional.wait_tensor.default", 0, 1024, h100) == 0.0


def test_each_efficiency_is_its_sources_figure_and_says_where_it_was_measured():
    """The table against its sources: torchao's 0.78 / 0.92 (H100), FlashAttention-2's 72% of an A100's peak in
    training (225 of 312 TFLOP/s) rounded to 0.70; on Hopper the H200's kernels (benchmarks/h200/gpu_traces.py
    --calibrate: products 73.05 ms at peak in 91.12, attention 5.00 in 15.26, elementwise 45.58 in 76.89, AdamW's
    foreach 7.21 in 15.56)."""
    assert (EFFICIENCY["matmul"].compute, EFFICIENCY["matmul"].memory, EFFICIENCY["matmul"].measured_on) == (
        0.78, 0.92, "H100")
    assert EFFICIENCY["attention"].measured_on == "A100"
    assert 0.70 <= EFFICIENCY["attention"].compute <= 225 / 312
    assert all(e.memory == 0.92 for k, e in EFFICIENCY.items() if "@" not in k)
    hopper = {k.split("@")[0]: e for k, e in EFFICIENCY.items() if k.endswith("@hopper")}
    assert all(e.measured_on == "H200" and "llama1b__1" in e.source for e in hopper.values())
    assert hopper["matmul"].compute == pytest.approx(73.05 / 91.12, abs=0.005)
    assert hopper["attention"].compute == pytest.approx(5.00 / 15.26, abs=0.005)
    for cls in ("pointwise", "transcendental", "reduction"):
        assert hopper[cls].memory == pytest.approx(45.58 / 76.89, abs=0.005)
    assert hopper["foreach"].memory == pytest.approx(7.21 / 15.56, abs=0.005)


def test_a_plan_for_another_gpu_says_which_efficiencies_were_measured_on_another():
    from remat.target import Target
    from remat.target.timing import efficiencies_elsewhere, rates_of

    assert efficiencies_elsewhere(rates_of(Target(device="h200"), torch.bfloat16), "h200") == (
        "; efficiencies measured on the H100, applied to h200 unmeasured: conv 0.78")
    assert efficiencies_elsewhere(_h100(), "h100-80gb") == (
        "; efficiencies measured on the H200, applied to h100-80gb unmeasured: matmul 0.80, attention 0.33, "
        "pointwise 0.59")
    note = efficiencies_elsewhere(rates_of(Target(device="a100"), torch.bfloat16), "a100-80gb")
    assert "measured on the H100, applied to a100-80gb unmeasured: matmul 0.78, conv 0.78" in note
    assert "A100" not in note.split("H100")[0]  # A100's own attention figure is not listed as elsewhere


def test_float32_convolutions_run_at_tf32_and_products_at_fp32_unless_the_process_allows_tf32():
    """An A100's float32: convolutions at the TF32 tensor-core rate (cuDNN's allow_tf32, True by default), matrix
    products at the plain FP32 rate (float32 matmul precision "highest" by default): 156 and 19.5 TFLOP/s dense
    (the A100 datasheet), each at torchao's 78%."""
    from remat.target import Target
    from remat.target.timing import rates_of

    conv_flops, mm_flops = 2 * 64 * 128 * 56 * 56 * 9 * 128, 2 * 4096**3
    a100 = rates_of(Target(device="a100"), torch.float32)
    assert op_seconds("aten.convolution.default", conv_flops, 1, a100) == pytest.approx(486.44e-6, rel=1e-4)
    assert op_seconds("aten.mm.default", mm_flops, 1, a100) == pytest.approx(9.0361e-3, rel=1e-4)
    assert "conv at TF32" in a100.name
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert op_seconds("aten.mm.default", mm_flops, 1, rates_of(Target(device="a100"), torch.float32)) == \
            pytest.approx(1.12951e-3, rel=1e-4)
        torch.backends.cudnn.allow_tf32 = False
        assert op_seconds("aten.convolution.default", conv_flops, 1,
                          rates_of(Target(device="a100"), torch.float32)) == pytest.approx(3.8915e-3, rel=1e-4)
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = True
    # bfloat16 is unaffected
    assert _h100().class_flops_per_s == {}


@pytest.mark.parametrize("device, torch_version, env, expected", [
    # torch's defaults (CublasHandlePool.cpp): Hopper :4096:8, earlier :4096:2:16:8; two threads, one handle each
    ("h100-80gb", (2, 13), {}, (33_554_432,) * 2),
    ("b200", (2, 13), {}, (33_554_432,) * 2),
    ("a100-80gb", (2, 13), {}, (8_519_680,) * 2),
    ("l4", (2, 13), {}, (8_519_680,) * 2),
    ("h100-80gb", (2, 13), {"CUBLAS_WORKSPACE_CONFIG": ":4096:1:16:4"}, (4_259_840,) * 2),
    # torch 2.15: cuBLAS's own workspace outside the allocator, cuBLASLt's 1 MiB in it, unless cached
    ("h100-80gb", (2, 15), {}, (1_048_576,) * 2),
    ("h100-80gb", (2, 15), {"TORCH_CUBLAS_WORKSPACE_CACHE": "1"}, (33_554_432,) * 2),
    ("h100-80gb", (2, 15), {"CUBLASLT_WORKSPACE_SIZE": "4096"}, (4_194_304,) * 2),
    # ROCm on MI300X (gfx942): hipBLAS 128 MiB and hipBLASLt 76 MiB per handle
    ("mi300x", (2, 13), {}, (134_217_728, 79_691_776) * 2),
])
def test_blas_workspaces_are_torchs_defaults_per_generation_and_thread(device, torch_version, env, expected):
    from remat.target.devices import KNOWN, generation_of
    from remat.target.workspace import blas_workspaces

    spec = KNOWN[device]
    assert blas_workspaces(spec.vendor, generation_of(spec), torch_version, env) == expected


def test_the_replayed_step_holds_two_workspaces_and_a_cpu_target_none():
    from remat.target import Target

    assert Target(device="cpu").blas_workspaces() == ()
    assert len(Target(device="h100-80gb").blas_workspaces()) == 2


def test_a_cpu_pays_its_dispatch_on_every_operator():
    cpu = DeviceRates(name="cpu", flops_per_s=1e11, memory_bytes_per_s=1e10, launch_s=0.0, dispatch_s=5e-6,
                      efficiency={})  # rates measured with the operators themselves: no fraction
    assert op_seconds("aten.mm.default", 10**9, 10**6, cpu) == pytest.approx(1e-2 + 5e-6)
    assert op_seconds("aten.mul.Tensor", 1, 12, cpu) == pytest.approx(5e-6 + 12 / 1e10)


def test_ring_collectives_move_n_minus_1_over_n_of_their_bytes_once_or_twice():
    s = 2**30
    within = s * 7 / 8 / (450e9 * COLLECTIVE_EFFICIENCY) + 2e-6
    assert collective_seconds("c10d._allgather_base_.default", s, 8, H100) == pytest.approx(within)
    assert collective_seconds("c10d._reduce_scatter_base_.default", s, 8, H100) == pytest.approx(within)
    assert collective_seconds("_c10d_functional.all_reduce.default", s, 8, H100) == pytest.approx(
        2 * s * 7 / 8 / (450e9 * COLLECTIVE_EFFICIENCY) + 2e-6)
    # 16 ranks span two nodes: the network's 50 GB/s
    assert collective_seconds("c10d._allgather_base_.default", s, 16, H100) == pytest.approx(
        s * 15 / 16 / (50e9 * COLLECTIVE_EFFICIENCY) + 2e-6)
    # 2 ranks that are 8 apart (FSDP over TP 8) span nodes too
    assert collective_seconds("c10d._allgather_base_.default", s, 2, H100, across_nodes=True) == pytest.approx(
        s / 2 / (50e9 * COLLECTIVE_EFFICIENCY) + 2e-6)
    assert collective_seconds("c10d._allgather_base_.default", s, 1, H100) == 0.0


def _recording(forward: list[ForwardOp], backward: list[ForwardOp]) -> Recording:
    n = len(forward) + len(backward)
    return Recording(n_ops=n, backward_start=len(forward), after_backward_bytes=0, storages=(), saved=(),
                     forward_ops=tuple(forward), writes=(), spans={}, calls={}, inputs={}, last_use={}, flops={},
                     backward_ops=tuple(backward))


def test_fsdp2s_gathers_hide_behind_compute_except_the_first_and_the_last_reduce_scatter():
    from types import SimpleNamespace

    from remat.target.timing import step_time

    target = SimpleNamespace(fsdp=8, tp=1, devices_per_node=8)
    gather = ForwardOp("c10d._allgather_base_.default", (), bytes_accessed=9 * 2**27)  # gathers 8 x 2^27 bytes
    scatter = ForwardOp("c10d._reduce_scatter_base_.default", (), bytes_accessed=9 * 2**28)
    one_gather = collective_seconds(gather.name, 2**30, 8, H100)
    one_scatter = collective_seconds(scatter.name, 2**31, 8, H100)
    mm = 2 * 8192 * 4096 * 4096 * 32
    matmul = ForwardOp("aten.mm.default", (), flops=mm, bytes_accessed=1)
    compute = op_seconds(matmul.name, mm, 1, H100)
    assert compute > one_gather + one_scatter  # each block's compute hides the next block's communication

    st = step_time(_recording([gather, matmul, gather, matmul], [gather, matmul, scatter, gather, matmul, scatter]),
                   H100, target)
    assert st.fsdp_comm_s == pytest.approx(4 * one_gather + 2 * one_scatter)
    assert st.forward_s == pytest.approx(2 * compute + one_gather)
    assert st.backward_s == pytest.approx(2 * compute + one_scatter)
    assert st.exposed_comm_s == pytest.approx(one_gather + one_scatter)
    assert st.flops == 4 * mm

    # with compute too short to hide them, the rest of the communication shows
    small = ForwardOp("aten.mm.default", (), flops=mm // 1000, bytes_accessed=1)
    st = step_time(_recording([gather, small, gather, small], []), H100, target)
    assert st.forward_s == pytest.approx(2 * op_seconds(small.name, mm // 1000, 1, H100) + one_gather
                                         + (one_gather - 2 * op_seconds(small.name, mm // 1000, 1, H100)))


def test_attention_flops_are_counted_on_cpus_flash_kernel_and_halved_when_causal():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat._compat import op_bytes, op_flops

    with FakeTensorMode():
        q = torch.empty(2, 4, 128, 64)
        for causal in (False, True):
            op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
            out = op(q, q, q, 0.0, causal)
            full = 4 * 2 * 4 * 128 * 128 * 64
            assert op_flops(op, (q, q, q, 0.0, causal), {}, out) == (full // 2 if causal else full)
        # a view moves nothing; a copy reads and writes its bytes
        assert op_bytes(torch.ops.aten.view.default, (q, [8, 128, 64]), {}, q.view(8, 128, 64)) == 0
        # _unsafe_view is a view its schema does not call one (matmul's backward returns them)
        unsafe = torch.ops.aten._unsafe_view.default
        assert op_bytes(unsafe, (q, [8, 128, 64]), {}, unsafe(q, [8, 128, 64])) == 0
        # an embedding reads the rows it looks up, not its whole table
        table, ids = torch.empty(50000, 64), torch.zeros(4, 8, dtype=torch.long)
        emb = torch.ops.aten.embedding.default
        assert op_bytes(emb, (table, ids), {}, emb(table, ids)) == 2 * 4 * 8 * 64 * 4 + ids.numel() * 8
        assert op_bytes(torch.ops.aten.clone.default, (q,), {}, q.clone()) == 2 * q.numel() * 4


def test_this_cpu_is_modelled_with_its_measured_rates_and_class_efficiencies(monkeypatch):
    """Target(device="cpu") reads this machine's measured figures (remat.target.timing.measure_cpu, cached): the
    product rate, the elementwise bandwidth, the dispatch per operator, dropout's generator, and each class's
    efficiency (given here, so the test does not depend on the machine)."""
    from remat.profile import cache
    from remat.target import Target
    from remat.target.devices import DeviceSpec, cpu_spec
    from remat.target.timing import CPU_SAMPLES, rates_of

    measured = {"flops_per_s": 4e11, "memory_bytes_per_s": 6e10, "random_bytes_per_s": 2e9, "dispatch_s": 4e-6,
                "threads": 2.0, **{f"{cls}_efficiency": 0.1 * (i + 2) for i, cls in enumerate(CPU_SAMPLES)}}
    monkeypatch.setattr(cache, "device_rates", lambda measure: (measured, "given"))
    rates = rates_of(Target(device="cpu"), torch.float32)
    assert (rates.flops_per_s, rates.memory_bytes_per_s, rates.dispatch_s, rates.random_bytes_per_s) == (
        4e11, 6e10, 4e-6, 2e9)
    for i, cls in enumerate(CPU_SAMPLES):
        assert rates.efficiency_of(cls).compute == pytest.approx(0.1 * (i + 2)), cls
    # a convolution of 1 GFLOP: its FLOPs at the measured rate and the class's efficiency, plus the dispatch
    conv = 0.1 * (list(CPU_SAMPLES).index("conv") + 2)
    assert op_seconds("aten.convolution.default", 10**9, 1, rates) == pytest.approx(1e9 / (4e11 * conv) + 4e-6)
    # dropout's mask at the generator's rate
    assert op_seconds("aten.bernoulli_.float", 0, 2 * 10**8, rates, random=True) == pytest.approx(0.1 + 4e-6)
    # products in bfloat16 and float16 at the rates measured in those dtypes (AMX: bfloat16 3.8x here)
    measured.update(bf16_flops_per_s=1.6e12, fp16_flops_per_s=4.2e11)
    assert rates_of(Target(device="cpu"), torch.bfloat16).flops_per_s == 1.6e12
    assert rates_of(Target(device="cpu"), torch.float16).flops_per_s == 4.2e11
    assert rates_of(Target(device="cpu"), torch.float32).flops_per_s == 4e11
    # a spec that gives its own rates is taken as it is: float32's where it gives no other
    spec = DeviceSpec(**{**cpu_spec().to_dict(), "fp32_flops_per_s": 1e11, "hbm_bytes_per_s": 1e10, "sources": ()})
    assert rates_of(Target(device=spec), torch.bfloat16).flops_per_s == 1e11
