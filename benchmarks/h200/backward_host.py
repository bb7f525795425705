"""Where the host's time went in llama1b__1's backward on the H200 (every block checkpointed; issue #60): the one
traced phase the host figures were not derived from, predicted at 65.8 ms of host wall against 126.1 ms traced
(docs/targets.md, ``gpu_traces.py --host``). Torch-free: it reads the trace (``data/llama1b__1.trace.json.gz``)
through remat.target.host_trace and splits each phase's host wall by the events' nesting:

* forward: the top-level operators (with what runs inside them: nested operators, CUDA runtime calls, a saved
  tensor's hooks) and the time between them (the model's Python, checkpoint's per-call bookkeeping);
* backward: autograd's engine beyond the node it runs (``evaluate_function``'s own time), the nodes that recompute
  a block (non-reentrant checkpoint recomputes inside the first unpack of a saved tensor: a node that runs at least
  half a block's forward operators), split into the Python between their operators (the recomputed forward's) and
  their operators, and the other nodes.

    python benchmarks/h200/backward_host.py [TRACE_NAME]   # default llama1b__1; GPU_DATA: another copy of data/

Prints a table (measured on the H200 by the shared oracle; nothing here runs on a GPU).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from h200_data import trace  # noqa: E402

from remat.target.host_trace import HOST_CATEGORIES  # noqa: E402

ENGINE = "autograd::engine::evaluate_function"


def phase_tree(t, phase: str) -> tuple[list[dict], dict[int, list[dict]]]:
    """The phase's host events in order, and each event's direct children (by ``id``), by nesting on its thread."""
    spans = t.phases()
    a, b = spans[phase]
    events = sorted((e for e in t.of(*HOST_CATEGORIES)
                     if t.phase_of(e["ts"], e["tid"], spans) == phase and a <= e["ts"] < b),
                    key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    kids: dict[int, list[dict]] = defaultdict(list)
    stack: list[dict] = []
    for e in events:
        while stack and (stack[-1]["tid"] != e["tid"] or e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]):
            stack.pop()
        if stack:
            kids[id(stack[-1])].append(e)
        stack.append(e)
    return events, kids


def inside(e: dict, kids: dict[int, list[dict]]) -> list[dict]:
    out = []
    for k in kids[id(e)]:
        out += [k, *inside(k, kids)]
    return out


def own_us(e: dict, kids: dict[int, list[dict]]) -> float:
    return e["dur"] - sum(k["dur"] for k in kids[id(e)])


def top_level(events: list[dict], kids: dict[int, list[dict]]) -> list[dict]:
    nested = {id(k) for ks in kids.values() for k in ks}
    return [e for e in events if id(e) not in nested]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama1b__1"
    t = trace(name)
    spans = t.phases()
    rows: list[tuple[str, int, float]] = []
    fwd, fkids = phase_tree(t, "forward")
    ftop = top_level(fwd, fkids)
    fops = [e for e in ftop if e["name"].startswith("aten::")]
    calls = sum(1 for e in fwd if e["name"] == "_NoopSaveInputs")  # one per checkpointed call
    fwall = (spans["forward"][1] - spans["forward"][0])
    fops_us = sum(e["dur"] for e in ftop)
    rows += [("forward: top-level events (operators with everything inside them)", len(ftop), fops_us),
             ("forward: between them (the model's Python, checkpoint's bookkeeping)", 0, fwall - fops_us)]
    bwd, bkids = phase_tree(t, "backward")
    nodes = [e for e in top_level(bwd, bkids) if e["name"].startswith(ENGINE)]
    per_block = sum(1 for e in fwd if e["name"].startswith("aten::")) / max(calls, 1)
    recomputing = [n for n in nodes if sum(x["name"].startswith("aten::") for x in inside(n, bkids)) >= per_block / 2]
    engine_us = sum(own_us(n, bkids) for n in nodes)
    # a node's own event (MmBackward0) is the one child of evaluate_function; a recomputation runs inside it
    node_events = [k for n in recomputing for k in bkids[id(n)]]
    python_us = sum(own_us(k, bkids) for k in node_events)
    rec_ops = [x for k in node_events for x in bkids[id(k)]]
    rec_us = sum(x["dur"] for x in rec_ops)
    plain = [n for n in nodes if n not in recomputing]
    plain_us = sum(n["dur"] - own_us(n, bkids) for n in plain)
    bwall = spans["backward"][1] - spans["backward"][0]
    rows += [(f"backward: autograd's engine beyond the node it runs ({ENGINE})", len(nodes), engine_us),
             ("backward: nodes that recompute a block: the Python between their operators", len(recomputing),
              python_us),
             ("backward: nodes that recompute a block: their operators (with everything inside them)", len(rec_ops),
              rec_us),
             ("backward: the other nodes (their operators, with everything inside them)", len(plain), plain_us),
             ("backward: between nodes (no event)", 0, bwall - sum(n["dur"] for n in nodes))]
    print(f"{name} (torch.profiler's trace, traced on the H200): host wall forward {fwall / 1e3:.2f} ms, backward "
          f"{bwall / 1e3:.2f} ms; {calls} checkpointed calls, {len(fops)} top-level operators in the forward\n")
    print("| part of the host's wall (measured on the H200) | events | ms | us each |")
    print("|---|---:|---:|---:|")
    for what, n, us in rows:
        print(f"| {what} | {n or ''} | {us / 1e3:.2f} | {f'{us / n:.1f}' if n else ''} |")
    fwd_per_op = sum(e["dur"] for e in fops) / len(fops)
    rec_aten = [x for x in rec_ops if x["name"].startswith("aten::")]
    print(f"\na top-level operator's host time, everything inside it included: {fwd_per_op:.1f} us in the forward "
          f"({len(fops)}), {sum(x['dur'] for x in rec_aten) / len(rec_aten):.1f} us in the recomputations "
          f"({len(rec_aten)}); a block: the forward's top-level events {fops_us / max(calls, 1) / 1e3:.2f} ms "
          f"(embedding and loss included), a recomputing node {sum(n['dur'] for n in recomputing) / len(recomputing) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
