"""Does the checked step's time leave the CPU meter's own time out? Each model's step timed unmetered, checked (the
meter's own time left out: Note [The meter's own time] in remat.runtime.meters) and checked with it kept, in rounds.

    python benchmarks/accuracy/meter_own_time.py [--rounds 6] [--out FILE]

The checked step's forward and backward seconds are what the model's error is read from (Note [The model's measured
error] in remat.api.margins). The models: a 6-layer Hugging Face Llama (width 256, 4 x 256 tokens: many small
operators, where a dispatch mode's cost per operator weighs most) and the built-in GPT (remat.examples.make_gpt, as
``remat tradeoff gpt`` builds it). Each round times the three in that order, after a first round not kept. About a
minute on the 2-core CPU. Run it alone. Writes benchmarks/results/meter-own-time-cpu.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch

from remat.api.checking import measure_checked_peak
from remat.examples import make_gpt
from remat.runtime import meters
from remat.runtime.measure import Clock, default_loss, run_step

ROOT = Path(__file__).resolve().parents[2]


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, use_cache=False)
    ids = torch.randint(0, 2000, (4, 256))
    return LlamaForCausalLM(cfg), (), {"input_ids": ids, "labels": ids}


def gpt():
    model, (idx, targets), _ = make_gpt()
    return model, (idx, targets), {}


def timings(model, args, kwargs, rounds: int) -> dict[str, list[float]]:
    device, clock = torch.device("cpu"), Clock(torch.device("cpu"))

    def unmetered() -> float:
        for p in model.parameters():
            p.grad = None
        marks = {"start": clock.mark()}
        run_step(model, args, kwargs, default_loss, on=lambda event: marks.__setitem__(event, clock.mark()))
        return clock.seconds(marks["start"], marks["backward"])

    def checked(kept: bool) -> float:
        step_s: list[float] = []
        own, ran = meters.StepMeter.own_seconds, meters.StepMeter.ran_seconds
        if kept:  # the meter's own time kept in the step's, as before Note [The meter's own time]
            meters.StepMeter.own_seconds = meters.StepMeter.ran_seconds = lambda self: 0.0
        try:
            measure_checked_peak(model, args, kwargs, default_loss, device, step_s=step_s)
        finally:
            meters.StepMeter.own_seconds, meters.StepMeter.ran_seconds = own, ran
        return step_s[0]

    out: dict[str, list[float]] = {"unmetered": [], "checked": [], "checked, own time kept": []}
    for r in range(rounds + 1):
        row = (unmetered(), checked(False), checked(True))
        if r:
            for k, v in zip(out, row):
                out[k].append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/meter-own-time-cpu.md"))
    args = ap.parse_args()
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {platform.machine()}, "
             f"{torch.get_num_threads()} threads; `python benchmarks/accuracy/meter_own_time.py --rounds {args.rounds}`; "
             f"every figure measured. An empty dispatch mode's cost per operator here: "
             f"{meters.dispatch_mode_entry_s() * 1e6:.1f} us (remat.runtime.meters.dispatch_mode_entry_s).", "",
             "| model | unmetered ms (median) | checked ms (median) | checked / unmetered, per round: median [min, max] "
             "| checked with the meter's own time kept ms (median) | kept / unmetered: median [min, max] |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, build in (("6-layer Llama, width 256, 4 x 256 tokens", llama), ("built-in GPT (make_gpt)", gpt)):
        model, a, k = build()
        t = timings(model, a, k, args.rounds)
        ratios = {key: [x / u for x, u in zip(t[key], t["unmetered"])] for key in ("checked", "checked, own time kept")}
        med = {key: 1e3 * statistics.median(v) for key, v in t.items()}
        lines.append(f"| {name} | {med['unmetered']:.1f} | {med['checked']:.1f} | "
                     f"{statistics.median(ratios['checked']):.2f} [{min(ratios['checked']):.2f}, "
                     f"{max(ratios['checked']):.2f}] | {med['checked, own time kept']:.1f} | "
                     f"{statistics.median(ratios['checked, own time kept']):.2f} "
                     f"[{min(ratios['checked, own time kept']):.2f}, {max(ratios['checked, own time kept']):.2f}] |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
