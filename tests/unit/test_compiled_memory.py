"""Reading a program inductor generated (remat.costs.compiled_memory): hand-written wrappers in inductor's form."""

from __future__ import annotations

import pytest

from remat.costs.compiled_memory import ProgramMemory, UnreadableProgram, program_memory, step_program_bytes, step_rise_bytes

FORWARD = '''
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        assert_size_stride(primals_1, (8, 16), (16, 1), 'input')
        buf0 = extern_kernels.convolution(primals_1, primals_2, None, stride=(1, 1))
        assert_size_stride(buf0, (8, 16), (16, 1), 'torch.ops.aten.convolution.default')
        buf1 = empty_strided_cpu((8, 16), (16, 1), torch.float32)
        cpp_fused_relu_0(buf0, buf1)
        buf2 = buf0; del buf0  # reuse
        cpp_fused_mul_1(buf1, buf2)
        buf3 = empty_strided_cpu((8, 4), (4, 1), torch.float32)
        extern_kernels.mm(buf2, primals_2, out=buf3)
        del primals_2
        return (buf3, primals_1, buf1, reinterpret_tensor(buf2, (128, ), (1, ), 0), )
'''

BACKWARD = '''
    def call(self, args):
        primals_1, buf1_saved, big_saved, tangents_1 = args
        args.clear()
        buf0 = empty_strided_cpu((8, 16), (16, 1), torch.float32)
        cpp_fused_0(tangents_1, big_saved, buf0)
        del tangents_1
        buf1 = torch.ops.aten.convolution_backward.default(buf0, big_saved, primals_1, [16], (1, 1), [True, True, False])
        del buf0
        del big_saved
        buf2 = buf1[0]
        assert_size_stride(buf2, (8, 16), (16, 1), 'torch.ops.aten.convolution_backward.default')
        buf3 = buf1[1]
        del buf1, buf1_saved
        return (buf2, buf3, )
'''

SIZES = {"primals_1": 512, "primals_2": 256, "buf0": 512, "buf1": 512, "buf2": 512, "buf3": 128}
BW_SIZES = {"primals_1": 512, "buf1_saved": 512, "big_saved": 4096, "tangents_1": 512, "buf0": 512, "buf1": None,
            "buf2": 512, "buf3": 256}


def test_a_forward_frees_nothing_it_was_given_and_returns_its_saved_tensors():
    m = program_memory(FORWARD, SIZES)
    # primals_* (parameters, the batch) are held by the module: deleting one frees nothing; buf2 reuses buf0's memory
    assert m.inputs_bytes == 0
    assert m.peak_bytes == 512 + 512 + 128  # buf0 (then buf2), buf1, buf3
    assert m.end_bytes == 128 + 512 + 512  # returned: buf3, buf1 and buf2 (as a view); primals_1 is not its own


def test_a_multi_output_kernel_allocates_its_outputs_while_its_inputs_live():
    """The backward of a convolution allocates its gradients during the call, while its inputs are alive: on
    the tests' conv net inductor's own estimate counted them after the input was freed, 131 KiB short."""
    m = program_memory(BACKWARD, BW_SIZES)
    assert m.inputs_bytes == 512 + 4096 + 512  # buf1_saved, big_saved, tangents_1 (not primals_1)
    # at the call: buf1_saved, big_saved, buf0 and both outputs (512 + 256); tangents_1 already freed
    assert m.peak_bytes == 512 + 4096 + 512 + 512 + 256
    assert m.rise_bytes == m.peak_bytes - m.inputs_bytes
    assert m.end_bytes == 512 + 256


def test_a_step_is_the_forward_peak_or_what_it_saves_plus_the_backward_rise():
    fw, bw = ProgramMemory(0, 1000, 600), ProgramMemory(700, 1000, 100)
    assert step_rise_bytes(fw, bw) == 1000  # 600 + 300 is below the forward's peak
    assert step_rise_bytes(ProgramMemory(0, 800, 700), bw) == 1000  # 700 + 300
    both = [(FORWARD, SIZES), (BACKWARD, BW_SIZES)]
    assert step_program_bytes(both) == step_rise_bytes(program_memory(FORWARD, SIZES), program_memory(BACKWARD, BW_SIZES))
    # anything but one forward then one backward is not a step this reads
    assert step_program_bytes(both[:1]) is None
    assert step_program_bytes(both + both) is None
    assert step_program_bytes(both[::-1]) is None


def test_what_it_cannot_read_is_said_not_guessed():
    with pytest.raises(UnreadableProgram, match="no size for buf3"):
        program_memory(FORWARD, {k: v for k, v in SIZES.items() if k != "buf3"})
    with pytest.raises(UnreadableProgram, match="def call"):
        program_memory("extern \"C\" void kernel(float* in_ptr0) {}", {})
    # and a step of such programs has no reading
    assert step_program_bytes([(FORWARD, {}), (BACKWARD, BW_SIZES)]) is None


def test_a_higher_order_operators_nested_outputs_are_read():
    """A checkpointed region under compile runs as a higher-order operator (``run_and_save_rng_state``) whose
    outputs are nested (``buf1[1][0]``): reading only ``buf1[0]`` lost them, and the 4-block GPT's saved
    activations with them (predicted 8.9 MB, 34%, under its measured peak)."""
    source = """
    def call(self, args):
        primals_1, = args
        args.clear()
        buf1 = torch.ops.higher_order.run_and_save_rng_state(torch.ops.aten.native_dropout.default, primals_1)
        buf2 = buf1[0]
        buf3 = buf1[1][0]
        buf4 = buf1[1][1]
        del buf1
        buf5 = buf3; del buf3  # reuse
        return (buf2, buf5, buf4, )
"""
    m = program_memory(source, {"primals_1": 4096, "buf2": 16, "buf3": 4096, "buf4": 1024})
    assert m.peak_bytes == m.end_bytes == 16 + 4096 + 1024


def test_one_del_of_several_names_frees_each():
    source = """
    def call(self, args):
        saved_a, saved_b, = args
        args.clear()
        buf0 = empty_strided_cpu((16, ), (1, ), torch.float32)
        del saved_a, saved_b
        buf1 = empty_strided_cpu((1024, ), (1, ), torch.float32)
        return (buf0, buf1, )
"""
    m = program_memory(source, {"saved_a": 1000, "saved_b": 3000, "buf0": 64, "buf1": 4096})
    assert m.inputs_bytes == 4000 and m.peak_bytes == 4096 + 64 == m.end_bytes


def test_a_multi_output_kernels_outputs_the_program_never_names_are_counted_until_it_is_deleted():
    """A multi-output kernel whose program takes one of its outputs (``buf5[1]``) still makes the others, never
    named, freed with ``del buf5``. Their bytes come from the kernel's size (all its outputs:
    ``remat._compat.inductor_programs`` reads it from its FX node); without it they were not counted."""
    source = """
    def call(self, args):
        primals_1, primals_2, = args
        args.clear()
        buf5 = torch.ops.aten.native_layer_norm.default(primals_1, [32], primals_2, None, 1e-05)
        buf7 = buf5[1]
        del buf5
        buf8 = empty_strided_cpu((16, ), (1, ), torch.float32)
        return (buf7, buf8, )
"""
    sizes = {"primals_1": 8192, "primals_2": 128, "buf5": 8192 + 256 + 256, "buf7": 256, "buf8": 64}
    m = program_memory(source, sizes)
    assert m.peak_bytes == 8192 + 256 + 256  # all three outputs, at the call
    assert m.end_bytes == 256 + 64
    # a kernel of unknown size (an older reading): only what the program names
    assert program_memory(source, {**sizes, "buf5": None}).peak_bytes == 256 + 64


def test_a_dropout_replayed_on_cpu_holds_what_it_allocates_inside():
    """A checkpointed block's compiled backward replays its dropout (``run_with_rng_state``) for the mask. On
    CPU, ``native_dropout`` makes a float copy of its mask inside (the size of its input) and the replay holds a
    copy of the generator's state: neither is in the wrapper. The tests' GPTs compiled per block, every block
    checkpointed, measured 12,032 and 529,344 bytes above the programs without them, and to the byte with
    them."""
    source = """
    def call(self, args):
        primals_1, rng_state_0, = args
        args.clear()
        buf5 = torch.ops.higher_order.run_with_rng_state(rng_state_0, torch.ops.aten.native_dropout.default, reinterpret_tensor(primals_1, (64, 32), (32, 1), 0), 0.1, True)
        del rng_state_0
        buf7 = buf5[1]
        del buf5
        buf8 = empty_strided_cpu((16, ), (1, ), torch.float32)
        return (buf7, buf8, )
"""
    sizes = {"primals_1": 8192, "rng_state_0": 5056, "buf5": 8192 + 2048, "buf7": 2048, "buf8": 64}
    # the RNG state, the dropped activations and the mask, and inside: a float mask and the generator's state
    assert program_memory(source, sizes).peak_bytes == 5056 + 8192 + 2048 + 8192 + 5056
    # a CUDA wrapper: neither (its dropout is one kernel, its generator's state 16 bytes; not measured here)
    cuda = source.replace("empty_strided_cpu", "empty_strided_cuda")
    assert program_memory(cuda, sizes).peak_bytes == 5056 + 8192 + 2048


def test_a_forward_says_which_of_its_returned_values_are_only_outputs_and_which_inputs_it_saves():
    m = program_memory(FORWARD, SIZES)
    # returned: (buf3, primals_1, buf1, view of buf2); the first is the block's output
    assert m.outputs_only_bytes(1) == 128
    assert m.returned_inputs == (512,)  # primals_1: the forward saves that input for its backward
    # an output it also saves is not "only an output"
    also = FORWARD.replace("return (buf3, primals_1,", "return (buf3, primals_1, buf3,")
    assert program_memory(also, SIZES).outputs_only_bytes(1) == 0


# Note [Blocks compiled one by one] on a step written out by hand: an eager op (t0) makes x0, the input of block A
# (t1-t2), whose output a_out is the input of block B (t3-t4), whose output b_out an eager head (t5) saves; loss
# t6; backward: the head (t7), B (t8-t9), A (t10-t11), the eager op (t12). Each block saves 200 bytes and outputs
# 100; each backward makes the 100-byte gradient of its input.
STEP = [  # (alloc index, free index, bytes)
    (0, 12, 100), (1, 11, 200), (2, 10, 100), (3, 10, 200), (4, 8, 100), (5, 6, 50), (6, 7, 4),
    (7, 10, 100), (8, 12, 100), (10, 13, 100)]


def step_profile():
    from remat.costs.unit_costs import Made, Profile, UnitCost

    n = 13
    live = tuple(sum(b for a, f, b in STEP if a <= t < f) for t in range(n))
    made = {"A": (Made(200, 11, True, None), Made(100, 10, False, 3, ((("B",), 8),))),
            "B": (Made(200, 10, True, None), Made(100, 8, False, 5, (((), 7),)))}
    span = {"A": (1, 2, 10, 11), "B": (3, 4, 8, 9)}
    units = tuple(UnitCost(name=u, parent=None, forward_s=0.0, recompute_s=0.0, backward_s=None, flops=0,
                           forward_start=f0, forward_end=f1, recompute_at=g0, drops=(), recompute_peak_bytes=0,
                           saved_bytes=200, made=made[u], backward_end=g1)
                  for u, (f0, f1, g0, g1) in span.items())
    before = tuple(live[t] - sum(b for a, f, b in STEP if a == t) for t in range(n))
    return Profile(units=units, live_bytes=live, grad_bytes=(0,) * n, saved_bytes=(0,) * n, backward_start=7,
                   params_bytes=0, grads_bytes=0, buffers_bytes=0, inputs_bytes=0, optimizer_state_bytes=0,
                   optimizer_step_bytes=0, forward_s=0.0, backward_s=0.0, optimizer_s=0.0, device="synthetic",
                   capture_path="synthetic", memory_recorded_with="synthetic", optimizer="none", before_bytes=before)


def block_forward(saves_input: bool, extra: int = 0) -> tuple[str, dict]:
    """A block's compiled forward: 200 bytes saved (and ``extra`` more), a 100-byte output, its input saved or
    not."""
    ret = "buf1, primals_1, buf0" if saves_input else "buf1, buf0"
    source = f"""
    def call(self, args):
        primals_1, primals_2, = args
        args.clear()
        buf0 = empty_strided_cpu((50, ), (1, ), torch.float32)
        buf1 = empty_strided_cpu((25, ), (1, ), torch.float32)
        buf2 = empty_strided_cpu((1, ), (1, ), torch.float32)
        return ({ret}{', buf2' if extra else ''}, )
"""
    return source, {"primals_1": 100, "primals_2": 16, "buf0": 200, "buf1": 100, "buf2": extra}


BLOCK_BACKWARD = ("""
    def call(self, args):
        primals_1, buf0, tangents_1, = args
        args.clear()
        buf3 = empty_strided_cpu((25, ), (1, ), torch.float32)
        del buf0, tangents_1
        return (buf3, )
""", {"primals_1": 100, "buf0": 200, "tangents_1": 100, "buf3": 100})


def test_programs_that_do_what_the_eager_blocks_did_compose_to_the_eager_peak():
    from remat.costs.compiled_memory import composed_step_bytes, eager_blocks

    profile = step_profile()
    blocks = eager_blocks(profile, ["B", "A"], [])
    assert [b.name for b in blocks] == ["A", "B"]  # by their forwards' order
    calls = [block_forward(True), block_forward(True), BLOCK_BACKWARD, BLOCK_BACKWARD]
    assert max(profile.live_bytes) == 800  # the head's backward: x0, A's and B's 300, g_h
    assert composed_step_bytes(profile, blocks, calls) == 800


def test_a_blocks_output_lives_as_long_as_the_next_compiled_block_saves_it():
    """A convolution block compiled saves a channels-last copy of its input, not the input: the block before's
    output is then freed once that forward has run, where the eager step kept it for the backward (the tests'
    conv net compiled per block: 131,072 bytes over on every plan before this was read)."""
    from remat.costs.compiled_memory import composed_step_bytes, eager_blocks

    profile = step_profile()
    blocks = eager_blocks(profile, ["A", "B"], [])
    # B saves no input: a_out is freed after B's forward, 100 bytes less at the head's backward
    assert composed_step_bytes(profile, blocks, [block_forward(True), block_forward(False), BLOCK_BACKWARD,
                                                 BLOCK_BACKWARD]) == 700
    # B saves a 100-byte copy of it instead: the same 800
    assert composed_step_bytes(profile, blocks, [block_forward(True), block_forward(False, extra=100),
                                                 BLOCK_BACKWARD, BLOCK_BACKWARD]) == 800
    # A saves 50 bytes more than its eager forward did: held from its forward to its backward
    assert composed_step_bytes(profile, blocks, [block_forward(True, extra=50), block_forward(True), BLOCK_BACKWARD,
                                                 BLOCK_BACKWARD]) == 850


def test_what_the_composition_cannot_say_is_none():
    from remat.costs.compiled_memory import composed_step_bytes, eager_blocks

    profile = step_profile()
    blocks = eager_blocks(profile, ["A", "B"], [])
    fw = block_forward(True)
    assert composed_step_bytes(profile, blocks, [fw, fw, BLOCK_BACKWARD]) is None  # a program missing
    assert composed_step_bytes(profile, blocks, [fw, BLOCK_BACKWARD, fw, BLOCK_BACKWARD]) is None  # out of order
    assert composed_step_bytes(profile, blocks, [fw, fw, BLOCK_BACKWARD, None]) is None  # one of unknown sizes
    assert eager_blocks(profile, ["A", "C"], []) is None  # not a unit of the profile
    assert eager_blocks(profile, ["A"], ["B"]) is None  # a unit checkpointed outside every compiled block
