"""Does the host's cost transfer to a model it was not derived from (issue #60)? A Qwen2-1.5B-shaped Hugging Face
model (28 layers, width 1536, 2 KV heads, vocabulary 151,936, tied embeddings) in bf16, batch 4 x 1024, planned
for the H200 on this CPU: the plain step's and every block's predicted step time with the host decomposed (Note
[Host time decomposed] in remat.costs.host_time) and with the host figures before it (29.0 us a forward operator
and a recomputed one, 18.7 us a backward one: llama1b's profiled, checkpointed step read per operator). Every
figure predicted, none measured here; issue #60 reports the H200's measured steps of this model 21-44% below the
figures before.

    python benchmarks/targets/host_transfer.py      # ~1 min
"""

from __future__ import annotations

import os


def main() -> None:
    import re

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import remat
    import remat.profile.host_work as host_work
    from remat.api.profiling import make_profile
    from remat.costs.step_time import plan_step_time_s

    measured = []  # the model's own host work, as the profile measures it (its operator counts below)
    real = host_work.measure_host_work
    host_work.measure_host_work = lambda *a, **kw: measured.append(real(*a, **kw)) or measured[-1]
    os.environ["REMAT_CACHE"] = "0"  # measured now, not read back

    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, use_cache=False)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    ids = torch.zeros(4, 1024, dtype=torch.long, device="meta")
    profile = make_profile(model, {"input_ids": ids, "labels": ids}, target=remat.Target(device="h200"),
                           loss_fn=lambda out: out.loss, optimizer=torch.optim.AdamW(model.parameters()),
                           output_alive=False)
    layers = [u for u in profile.units if re.fullmatch(r"model\.layers\.\d+", u.name)]
    note = next(n for n in profile.notes if n.startswith("host:"))
    print(f"{note}\n")
    host_work.measure_host_work = real
    n_fwd, n_bwd = measured[-1].forward_ops, measured[-1].backward_ops
    print("| plan | GPU forward / backward ms | host forward / backward ms, decomposed | step ms, decomposed | "
          "host forward / backward ms, before | step ms, before | decomposed / before |")
    print("|---|---|---|---:|---|---:|---:|")
    for name, units in (("none", []), ("every block", layers)):
        now = plan_step_time_s(profile, units)
        recomputed = sum((u.recompute_end if u.recompute_end is not None else u.forward_end) - u.forward_start + 1
                         for u in units)
        gpu_f = profile.forward_s
        gpu_b = profile.backward_s + sum(u.recompute_s + u.overhead_s for u in units)
        host_f = profile.forward_host_s + sum(u.forward_host_s for u in units)
        host_b = profile.backward_host_s + sum(u.recompute_host_s for u in units)
        old_f, old_b = n_fwd * 29.0e-6, n_bwd * 18.7e-6 + recomputed * 29.0e-6
        before = max(gpu_f, old_f) + max(gpu_b, old_b) + profile.optimizer_s
        ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
        print(f"| {name} | {ms(gpu_f)} / {ms(gpu_b)} | {ms(host_f)} / {ms(host_b)} | {ms(now)} | {ms(old_f)} / "
              f"{ms(old_b)} | {ms(before)} | {now / before - 1:+.1%} |")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    main()
