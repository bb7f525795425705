"""Which Hugging Face model families plan for a target that is not here (issue #47): each family's config made
small (2 layers, width 64, 4 heads, vocabulary 256), written as a config.json and planned as a user would, with
``remat plan CONFIG --device h100-80gb --world 2 --batch 2 --seq 64 --budget 80`` (the model built from the config
on the meta device, FSDP2 over a fake world of 2). Prints one row per family: whether it planned, the predicted
reserved peak, or the error's first line.

    python benchmarks/targets/hf_targets.py
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def configs() -> dict:
    import transformers as t

    moe = dict(num_local_experts=4, num_experts_per_tok=2)
    rows = {
        "Llama": lambda: t.LlamaConfig(**SMALL),
        "Qwen2": lambda: t.Qwen2Config(**SMALL),
        "Qwen3": lambda: t.Qwen3Config(**SMALL, head_dim=16),
        "Mistral": lambda: t.MistralConfig(**SMALL),
        "Gemma": lambda: t.GemmaConfig(**SMALL, head_dim=16),
        "GPT-2": lambda: t.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128),
        "Mixtral": lambda: t.MixtralConfig(**SMALL, **moe),
        "Mixtral, bfloat16 (as its published config.json)": lambda: t.MixtralConfig(**SMALL, **moe,
                                                                                   dtype="bfloat16"),
        "Qwen3-MoE": lambda: t.Qwen3MoeConfig(**SMALL, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=64),
        "Qwen3-MoE, bfloat16": lambda: t.Qwen3MoeConfig(**SMALL, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=64, dtype="bfloat16"),
        "DeepSeek-V3": lambda: t.DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, n_routed_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=64, n_group=1,
                                                  topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                                                  kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                  v_head_dim=16),
        "T5": lambda: t.T5Config(vocab_size=256, d_model=64, d_ff=128, num_layers=2, num_heads=4),
        "ViT": lambda: t.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
    }
    return rows


def main() -> int:
    from remat.cli import main as remat_main

    print("| family | plans for h100-80gb x 2 (FSDP 2) | predicted reserved | time | why not |")
    print("|---|---|---|---|---|")
    for family, make in configs().items():
        with tempfile.TemporaryDirectory() as folder:
            try:
                make().save_pretrained(folder)
            except Exception as e:  # noqa: BLE001 - a config transformers cannot make here is a row too
                print(f"| {family} | no | - | - | transformers cannot make the config: {type(e).__name__}: {e} |")
                continue
            out, err = io.StringIO(), io.StringIO()
            started = time.perf_counter()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = remat_main(["plan", str(Path(folder) / "config.json"), "--device", "h100-80gb", "--world", "2",
                                   "--batch", "2", "--seq", "64", "--budget", "80"])
            took = time.perf_counter() - started
            reserved = next((line.split(":", 1)[1].strip().split("  ")[0] for line in out.getvalue().splitlines()
                             if line.strip().startswith("predicted reserved:")), "-")
            why = "" if code == 0 else " ".join(err.getvalue().strip().splitlines()[-1:])[:400].replace("|", "/")
            print(f"| {family} | {'yes' if code == 0 else 'no'} | {reserved} | {took:.1f} s | {why} |", flush=True)
    return 0


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    sys.exit(main())
