"""The attention a GPU target runs (Note [Attention on the target] in remat.target.attention): for every Hugging Face
family docs/targets.md lists, its config's own defaults (head dimensions, grouped heads, dropout) with the sizes
made tiny, each ``scaled_dot_product_attention`` call of a step recorded for an H100 runs the kernel torch's CUDA
rules choose (remat.costs.attention_kernels, for the torch here) and keeps what that kernel keeps, per setting
(bfloat16, float16, float32; attention dropout off and on). Before, every call ran the CPU's kernel: its flash
kernel, or its math fallback (the whole attention matrix) with dropout."""

from __future__ import annotations

import math

import pytest
import torch

import remat
from remat import Target
from remat.costs.attention_kernels import MATH, SdpaCall, choose_kernel, saved_by_kernel
from remat.runtime.measure import run_step
from remat.target.attention import settings_here
from remat.target.world import built

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'remat[hf]'")

SEQ, HEADS = 16, 4


def _tiny(name: str):
    """The family's config from its own defaults, made tiny: one or two layers, 4 query heads and the default
    ratio of query to key/value heads, the default head dimensions and dropout."""
    t = transformers
    if name == "GPT-2":
        return t.GPT2Config(vocab_size=128, n_embd=HEADS * 64, n_head=HEADS, n_layer=1, n_positions=64)
    cls = {"Llama": t.LlamaConfig, "Qwen2": t.Qwen2Config, "Qwen3": t.Qwen3Config, "Mistral": t.MistralConfig,
           "Gemma": t.GemmaConfig, "Mixtral": t.MixtralConfig, "Qwen3-MoE": t.Qwen3MoeConfig,
           "DeepSeek-V3": t.DeepseekV3Config}[name]
    d = cls()
    ratio = d.num_attention_heads // (d.num_key_value_heads or d.num_attention_heads)
    head_dim = getattr(d, "head_dim", None) or d.hidden_size // d.num_attention_heads
    small = dict(vocab_size=128, hidden_size=HEADS * head_dim, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=HEADS, num_key_value_heads=max(1, HEADS // ratio), max_position_embeddings=64)
    if getattr(d, "head_dim", None) is not None:
        small["head_dim"] = head_dim
    small.update({"Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
                  "Qwen3-MoE": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                  "DeepSeek-V3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                                      kv_lora_rank=16)}.get(name, {}))
    return cls(**small)


FAMILIES = ("Llama", "Qwen2", "Qwen3", "Mistral", "Gemma", "GPT-2", "Mixtral", "Qwen3-MoE", "DeepSeek-V3")
MOE = ("Mixtral", "Qwen3-MoE", "DeepSeek-V3")
SETTINGS = [(dtype, dropout) for dtype in ("bfloat16", "float16", "float32") for dropout in ("off", "on")]


def _expected(config, dtype: str, dropout_p: float) -> SdpaCall:
    """The call the family's attention makes, from its config alone: causal, no mask (no padding), grouped
    heads given to SDPA (enable_gqa) where keys and values have fewer heads."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if hasattr(config, "qk_nope_head_dim"):
        qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        qk = v = getattr(config, "head_dim", None) or config.hidden_size // heads
    return SdpaCall(dtype=dtype, batch=1, q_heads=heads, kv_heads=kv, seq_q=SEQ, seq_kv=SEQ, head_dim_qk=qk,
                    head_dim_v=v, is_causal=True, dropout_p=dropout_p, enable_gqa=kv < heads)


def _recorded_calls(config, dtype: str, target: Target) -> list:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.train()
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    calls: list = []
    with built(target, model, ((), {"input_ids": ids, "labels": ids}), attention_calls=calls) as (
            fake, (args, kwargs), mode), mode:
        run_step(fake, args, kwargs, lambda out: out.loss, output_alive=False)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_runs_the_kernel_cuda_would_pick_and_keeps_what_it_keeps(family):
    """Per setting: every attention call of the family's step is the call its config describes, runs the kernel
    the rules of this torch pick on an H100 (sm 9.0), and keeps that kernel's output and log-sum-exp rows, to the
    byte; math (float32 with grouped heads before 2.15) keeps none of them (its decomposition keeps the matrix)."""
    target = Target(device="h100-80gb")
    settings = settings_here()
    for dtype, dropout in SETTINGS:
        if dtype != "bfloat16" and family in MOE:
            continue  # their experts call torch's _grouped_mm, whose meta kernel takes bfloat16 only (2.13)
        config = _tiny(family)
        p = 0.0
        if dropout == "on":
            p = 0.1
            setattr(config, "attn_pdrop" if family == "GPT-2" else "attention_dropout", p)
        elif family == "GPT-2":
            config.attn_pdrop = 0.0
        expected = _expected(config, dtype, p)
        kernel = choose_kernel(expected, "NVIDIA", (9, 0), settings).kernel
        calls = _recorded_calls(config, dtype, target)
        where = f"{family}, {dtype}, dropout {dropout}"
        assert len(calls) == config.num_hidden_layers if family != "GPT-2" else 1, where
        for c in calls:
            assert c.call == expected, where
            assert c.choice.kernel == kernel, where
            kept = {name: (shape, dt) for name, shape, dt, _ in c.kept}
            for spec in saved_by_kernel(kernel, expected):
                got = kept.get(spec.name, kept.get("log_sumexp") if spec.name == "logsumexp" else None)
                assert got == (spec.shape, spec.dtype), (where, spec, kept)
            if kernel == MATH:
                assert c.kept == (), where
            else:  # output and float32 rows, plus the RNG state's few bytes
                main = sum(s.nbytes for s in saved_by_kernel(kernel, expected))
                assert main <= c.kept_bytes <= main + 32, (where, c.kept)


def test_dropout_in_attention_keeps_no_attention_matrix_for_a_gpu():
    """GPT-2 as its config ships (attention dropout 0.1), bfloat16, planned for an H100: the recorded step keeps
    what the fused kernel keeps, not the CPU's math fallback's attention matrices (batch x heads x 64 x 64 per
    layer, with the dropout mask), so the predicted peak of the plain step is that of the step without attention
    dropout but for the kernel's few RNG bytes and the rest of GPT-2's dropouts (the same in both)."""
    peaks = {}
    for p in (0.1, 0.0):
        config = transformers.GPT2Config(vocab_size=128, n_embd=256, n_head=4, n_layer=2, n_positions=64,
                                         attn_pdrop=p)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.train()
        ids = torch.zeros(4, 64, dtype=torch.long, device="meta")
        profile = remat.make_profile(model, {"input_ids": ids, "labels": ids}, loss_fn=lambda out: out.loss,
                                     target=Target(device="h100-80gb"))
        assert any(n.startswith("attention assumed") for n in profile.notes), profile.notes
        peaks[p] = remat.Planner(profile, granularity="op").baseline_peak_bytes
    matrix = 4 * 4 * 64 * 64 * 2  # one layer's attention probabilities in bfloat16
    assert abs(peaks[0.1] - peaks[0.0]) < matrix, peaks
    assert not math.isnan(peaks[0.1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's own choice is asked of a CUDA device")
def test_the_rules_pick_what_torch_picks_on_this_gpu():
    """On a machine with a GPU: for every family's call and setting (and each with a mask instead of is_causal),
    the rules give the kernel ``torch._fused_sdp_choice`` gives for CUDA tensors that require grad, with this
    process's runtime cuDNN and CUDA."""
    from dataclasses import replace

    from remat._compat.attention import torch_choice_on_cuda

    vendor = "AMD" if torch.version.hip else "NVIDIA"
    capability = torch.cuda.get_device_capability()
    settings = replace(settings_here(), cudnn_version=torch.backends.cudnn.version() or 0,
                       cuda_major=int((torch.version.cuda or "0").split(".")[0]))
    for family in FAMILIES:
        for dtype, dropout in SETTINGS:
            call = _expected(_tiny(family), dtype, 0.1 if dropout == "on" else 0.0)
            for c in (call, replace(call, is_causal=False, has_attn_mask=True)):
                got = torch_choice_on_cuda(c.batch, c.q_heads, c.kv_heads, c.seq_q, c.seq_kv, c.head_dim_qk,
                                           c.head_dim_v, getattr(torch, dtype), is_causal=c.is_causal,
                                           mask=c.has_attn_mask, dropout_p=c.dropout_p, enable_gqa=c.enable_gqa)
                assert choose_kernel(c, vendor, capability, settings).kernel == got, (family, c, got)


def test_a_target_names_the_torch_its_run_uses():
    """``Target(torch_version=...)``: a bf16 call on an H100 runs flash as torch 2.8 picks it (cuDNN last), cuDNN
    as 2.11 does (the H200 measurement's torch), whatever torch plans."""
    config = _tiny("Mistral")
    for release, kernel in (("2.8", "flash"), ("2.11", "cudnn")):
        calls = _recorded_calls(config, "bfloat16", Target(device="h100-80gb", torch_version=release))
        assert calls and {c.choice.kernel for c in calls} == {kernel}, release


def test_the_targets_sdp_settings_are_decided_when_it_is_made_and_can_be_given():
    """Issue #62: the run's SDP switches are a field of the Target, read from this process when the Target is made
    and fixed then (a switch the process turns later changes no target made before), or given: a run with only
    the math kernel on is recorded with the math kernel."""
    import dataclasses

    target = Target(device="h100-80gb")
    before = target.sdpa
    assert before == settings_here() and "flash" in before.enabled
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert target.sdpa == before and "flash" not in Target(device="h100-80gb").sdpa.enabled
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    math_only = Target(device="h100-80gb", sdpa=dataclasses.replace(before, enabled=frozenset({MATH})))
    calls = _recorded_calls(_tiny("Llama"), "bfloat16", math_only)
    assert calls and all(c.choice.kernel == MATH for c in calls)
    with pytest.raises(remat.InvalidInputError, match="Target.sdpa takes"):
        Target(device="h100-80gb", sdpa="flash")


def test_attention_on_another_thread_is_torchs_own_while_a_step_is_recorded():
    """Issue #62: while a target's step is recorded, F.scaled_dot_product_attention is replaced only for the
    context that records (remat._compat.attention.sdpa_replaced): a thread of the user's process calling it
    meanwhile runs torch's own function, and the replacement is gone after."""
    import threading

    import torch.nn.functional as F

    from remat._compat.attention import sdpa_replaced

    q = torch.randn(1, 2, 8, 16)
    expected = F.scaled_dot_product_attention(q, q, q)
    chosen: list[str] = []
    other: dict[str, torch.Tensor] = {}
    original = F.scaled_dot_product_attention
    with sdpa_replaced(lambda a: chosen.append("asked") or MATH, lambda a, kernel, kept: None):
        assert F.scaled_dot_product_attention is not original
        worker = threading.Thread(target=lambda: other.update(out=F.scaled_dot_product_attention(q, q, q)))
        worker.start()
        worker.join()
        assert chosen == []  # the other thread's call was not replaced
        F.scaled_dot_product_attention(q, q, q)
        assert chosen == ["asked"]  # this context's is
    assert torch.equal(other["out"], expected) and F.scaled_dot_product_attention is original
