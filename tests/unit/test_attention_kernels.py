"""torch's CUDA selection rules for scaled_dot_product_attention as remat writes them (remat.costs.attention_kernels,
Note [SDPA selection rules]): per torch release and GPU generation, the kernel each call gets, and what it keeps."""

from __future__ import annotations

from dataclasses import replace

from remat.costs.attention_kernels import (CUDNN, EFFICIENT, FLASH, MATH, SdpaCall, SdpaSettings, choose_kernel,
                                           priority_order, saved_by_kernel)

HOPPER, AMPERE, ADA, BLACKWELL = (9, 0), (8, 0), (8, 9), (10, 0)

#: the H200 measurement's call: Llama 3.2 1B's attention in bfloat16, batch 4 x 2048, 32 query heads, 8 for keys
#: and values given to SDPA as grouped heads, head dimension 64, causal
LLAMA_1B = SdpaCall(dtype="bfloat16", batch=4, q_heads=32, kv_heads=8, seq_q=2048, seq_kv=2048, head_dim_qk=64,
                    head_dim_v=64, is_causal=True, enable_gqa=True)


def kernel(call: SdpaCall, torch: tuple[int, int], capability=HOPPER, vendor="NVIDIA", **settings) -> str:
    return choose_kernel(call, vendor, capability, SdpaSettings(torch=torch, **settings)).kernel


def test_the_h200_measurement_ran_cudnn_as_the_rules_of_2_11_say():
    """torch 2.11.0+cu130 on the H200 ran _scaled_dot_product_cudnn_attention for this call (the shared traces)."""
    assert kernel(LLAMA_1B, (2, 11)) == CUDNN
    assert priority_order("NVIDIA", HOPPER, SdpaSettings(torch=(2, 11))) == (CUDNN, FLASH, EFFICIENT, MATH)


def test_the_priority_order_per_release():
    """2.8: cuDNN last (after math) unless TORCH_CUDNN_SDPA_PREFERRED=1; 2.9: first on sm 9.0 / 10.0 unless =0;
    2.10: first only with a runtime cuDNN past 9.15.0 (its wheels' 9.10.2 is not); from 2.11 first on Hopper and
    Blackwell unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1; never on Ampere, Ada or ROCm."""
    assert kernel(LLAMA_1B, (2, 8)) == FLASH
    assert kernel(LLAMA_1B, (2, 8), cudnn_preferred_env="1") == CUDNN
    assert kernel(LLAMA_1B, (2, 9)) == CUDNN and kernel(LLAMA_1B, (2, 9), cudnn_preferred_env="0") == FLASH
    assert kernel(LLAMA_1B, (2, 10)) == FLASH and kernel(LLAMA_1B, (2, 10), cudnn_version=91501) == CUDNN
    for release in ((2, 11), (2, 13), (2, 15)):
        assert kernel(LLAMA_1B, release, capability=BLACKWELL) == CUDNN
        assert kernel(LLAMA_1B, release, cudnn_deprioritized_env="1") == FLASH
        assert kernel(LLAMA_1B, release, capability=AMPERE) == FLASH
        assert kernel(LLAMA_1B, release, capability=ADA) == FLASH
        assert kernel(LLAMA_1B, release, vendor="AMD") == FLASH
    # a process that disabled a backend, or set its own order (sdpa_kernel(..., set_priority=True))
    assert kernel(LLAMA_1B, (2, 13), enabled=frozenset({FLASH, EFFICIENT, MATH})) == FLASH
    assert kernel(LLAMA_1B, (2, 15), order=(EFFICIENT, FLASH, MATH, CUDNN)) == EFFICIENT
    assert kernel(LLAMA_1B, (2, 13), order=(EFFICIENT, FLASH, MATH, CUDNN)) == FLASH  # no grouped heads there


def test_float32_runs_memory_efficient_attention_or_math_with_grouped_heads():
    """Flash and cuDNN take float16 and bfloat16 only; memory-efficient takes float32, but grouped heads only from
    2.15 (pytorch/pytorch#191085): before, float32 with enable_gqa falls to math."""
    fp32 = replace(LLAMA_1B, dtype="float32")
    assert kernel(replace(fp32, kv_heads=32, enable_gqa=False), (2, 13)) == EFFICIENT
    assert kernel(fp32, (2, 13)) == MATH and kernel(fp32, (2, 11)) == MATH and kernel(fp32, (2, 8)) == MATH
    assert kernel(fp32, (2, 15)) == EFFICIENT
    assert kernel(fp32, (2, 13), vendor="AMD") == MATH  # no grouped heads in AOTriton's kernel


def test_masks_dropout_and_head_dimensions():
    """A mask rules flash out (cuDNN takes it on Hopper, memory-efficient elsewhere: math with grouped heads
    before 2.15); dropout 0.1 rules cuDNN out
    from 2.14 (steps of 1/16) and on cuDNN 9.11-9.13; head dimensions: flash needs q = k = v <= 256, cuDNN 128,
    or 256 on Hopper (cuDNN >= 9.10 before 2.14, > 9.22 from 2.14), 192/128 on cuDNN >= 9.11."""
    masked = replace(LLAMA_1B, is_causal=False, has_attn_mask=True)
    assert kernel(masked, (2, 13)) == CUDNN and kernel(masked, (2, 13), capability=AMPERE) == MATH
    assert kernel(replace(masked, kv_heads=32, enable_gqa=False), (2, 13), capability=AMPERE) == EFFICIENT
    dropped = replace(LLAMA_1B, dropout_p=0.1)
    assert kernel(dropped, (2, 13)) == CUDNN and kernel(dropped, (2, 15)) == FLASH
    assert kernel(replace(LLAMA_1B, dropout_p=0.125), (2, 15)) == CUDNN
    assert kernel(dropped, (2, 13), cudnn_version=91200) == FLASH
    gemma = replace(LLAMA_1B, head_dim_qk=256, head_dim_v=256, kv_heads=32, enable_gqa=False)
    assert kernel(gemma, (2, 13)) == CUDNN and kernel(gemma, (2, 15)) == CUDNN
    assert kernel(gemma, (2, 13), capability=AMPERE) == FLASH
    assert kernel(replace(gemma, head_dim_qk=288, head_dim_v=288), (2, 13)) == EFFICIENT  # over every fused limit of 256
    deepseek = replace(LLAMA_1B, head_dim_qk=192, head_dim_v=128, kv_heads=32, enable_gqa=False)
    assert kernel(deepseek, (2, 15)) == CUDNN  # flash needs equal head dims
    assert kernel(deepseek, (2, 15), capability=AMPERE) == EFFICIENT
    # Ada: flash refuses training at head dimension 193-224, and 225-256 with dropout
    assert kernel(replace(gemma, head_dim_qk=208, head_dim_v=208), (2, 13), capability=ADA) == EFFICIENT
    assert kernel(gemma, (2, 13), capability=ADA) == FLASH
    assert kernel(replace(gemma, dropout_p=0.1), (2, 13), capability=ADA) == EFFICIENT
    # flash's causal mask is top-left only for square attention
    assert kernel(replace(LLAMA_1B, seq_kv=4096), (2, 8)) == MATH  # and 2.8's memory-efficient has no grouped heads
    assert kernel(replace(LLAMA_1B, seq_kv=4096, kv_heads=32, enable_gqa=False), (2, 8)) == EFFICIENT


def test_what_each_kernel_keeps():
    """The output, and float32 log-sum-exp rows: flash [B, H, L], memory-efficient padded to 32 rows, cuDNN
    [B, H, L, 1]; nothing but the output without grad; math none (its decomposition keeps the matrix)."""
    c = replace(LLAMA_1B, seq_q=100, seq_kv=100)
    out = 4 * 32 * 100 * 64 * 2
    assert [(s.name, s.nbytes) for s in saved_by_kernel(FLASH, c)] == [("output", out), ("logsumexp", 4 * 32 * 100 * 4)]
    assert saved_by_kernel(EFFICIENT, c)[1].shape == (4, 32, 128)
    assert saved_by_kernel(CUDNN, c)[1].shape == (4, 32, 100, 1)
    assert [s.name for s in saved_by_kernel(CUDNN, replace(c, requires_grad=False))] == ["output"]
    assert saved_by_kernel(MATH, c) == ()
