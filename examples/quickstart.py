"""The README's Python example, runnable: plan the built-in GPT for a 25 MiB training step, print the plan,
prove it, train.

    python examples/quickstart.py
"""

import torch

import remat
from remat.examples import make_gpt

model, batch, _ = make_gpt()                       # 4 blocks of width 128, batch 8 x 64 tokens, dropout 0.1
optimizer = torch.optim.AdamW(model.parameters())

plan = remat.optimize_checkpointing(model, 25 / 1024, batch, optimizer=optimizer)   # 25 MiB per step
print(plan)
remat.assert_equivalent(model, batch)              # plain vs checkpointed: loss, outputs, every grad, buffers

for _ in range(3):                                 # train as usual: same parameters, same optimizer
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"trained 3 steps, loss {loss.item():.3f}")
