"""How the user's training step runs, shared by every stage that runs the model.

In: the user's model, example inputs, loss and loop (optimizer, compile, distributed wrapping). Out: one training
step run and metered (:mod:`~remat.runtime.measure`: one step, one clock, one peak meter), the model's state
snapshotted and given back (:mod:`~remat.runtime.state`), and the loop described: compiled
(:mod:`~remat.runtime.compiled`: ``torch.compile`` whole or per block) or distributed
(:mod:`~remat.runtime.distributed`: FSDP2, DDP, tensor parallel; one plan for every rank).
"""
