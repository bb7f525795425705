"""The cost model (stage 3, torch-free): what checkpointing each unit costs and what a plan's step peaks at.

In: a :class:`~remat.costs.recording.Recording` of one training step (storages, saved tensors, unit spans; made by
:mod:`remat.profile`) and per-unit times. Out: a :class:`~remat.costs.unit_costs.Profile` (every
:class:`~remat.costs.unit_costs.UnitCost` and the step's fixed memory and times) for the solver, and the predicted
peak of any plan over it (:mod:`remat.costs.simulate`, the one definition).

- ``recording``        the hand-off from the recorder: what one step allocated, freed and saved
- ``effects``          Recording + times -> UnitCost: what checkpointing each unit frees, holds, recomputes
- ``unit_costs``       UnitCost and Profile, and their (de)serialization
- ``unit_names``       the names of units and plan variables (segments, regions, selective, nested), made and parsed
- ``simulate``         Profile + plan -> predicted peak, and the rows the ILP needs
- ``memory_rows``      the rows of the memory model (simulate's MemoryModel builds them with it)
- ``peak_breakdown``   what holds a plan's predicted peak (simulate's MemoryModel explains with it)
- ``compiled_memory``  the peak of a compiled step, from the programs inductor wrote
- ``wrapper_statements`` the statements of an inductor wrapper, read one at a time (for compiled_memory)
- ``extrapolate``      profiles at a few sizes -> a profile at any size
- ``allocator_reading`` a step's peak from the CUDA allocator's statistics or history (what the budget means on CUDA)

Nothing here imports torch: its tests run on hand-written recordings and profiles.
"""

from remat.costs.unit_costs import Profile, UnitCost

__all__ = ["Profile", "UnitCost"]
