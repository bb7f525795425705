"""Reading a program inductor generated (remat.compiled_memory): hand-written wrappers in inductor's form."""

from __future__ import annotations

import pytest

from remat.compiled_memory import ProgramMemory, UnreadableProgram, program_memory, step_program_bytes, step_rise_bytes

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
