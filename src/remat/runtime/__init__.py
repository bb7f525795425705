"""How the user's training step runs, shared by every stage that runs the model.

In: the user's model, example inputs, loss and loop (optimizer, compile, distributed wrapping). Out: one training
step run and metered (:mod:`~remat.runtime.measure`: one step, one clock, one peak meter), the model's state
snapshotted and given back (:mod:`~remat.runtime.state`), and the loop described: compiled
(:mod:`~remat.runtime.compiled`: ``torch.compile`` whole or per block) or distributed
(:mod:`~remat.runtime.distributed`: FSDP2, DDP, tensor parallel; one plan for every rank).

- ``measure``      one training step, its clock and loss (run_step, Clock, default_loss)
- ``tracker``      StorageTracker: the storages a step allocates and frees, at dispatch level
- ``meters``       the peak meters (StepMeter, AllocatorMeter, measure_peak)
- ``state``        snapshot and restore of what remat may touch
- ``compiled``     how the loop compiles (CompiledLoop)
- ``distributed``  FSDP2, DDP, tensor parallel: ranks met, profiles gathered, one plan
"""
