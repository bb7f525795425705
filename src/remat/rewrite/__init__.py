"""Checkpoint chosen units in place, and undo it.

In: the model and a Plan (:mod:`remat.solve.plan`: the units to checkpoint, the buffers each replays, the
policy of each selective unit), or the units by name. Out: the model, checkpointed in place and reversibly
(``remove_checkpointing`` undoes it): parameters, ``state_dict`` keys and hooks untouched.

A unit is a submodule by qualified name (``h.3``, ``h.3.mlp``) or a *segment*: a contiguous run of
the children of an ``nn.Sequential`` (``blocks[0:4]``, ``[2:5]`` for a Sequential root), checkpointed
as one piece as ``torch.utils.checkpoint.checkpoint_sequential`` does, or a *region* of a module's
forward between two of its submodule calls (``up.2[conv1:conv2]``, ``up.2[conv2:]``; Note [Regions] in
remat.capture). A module unit with the suffix
``@ops<k>`` (``h.3.mlp@ops2``) is checkpointed *selectively*, with its own policy.

The package, stage by stage (each Note lives with the code it describes):

- :mod:`~remat.rewrite.policy`: the selective policy and what it keeps (Note [Selective checkpointing],
  Note [Random operators under compile], Note [Operators named alike under compile]);
- :mod:`~remat.rewrite.call`: one checkpointed call (Note [Buffers replay], Note [Under torch.compile]);
- :mod:`~remat.rewrite.forwards`: the ``forward`` callables remat installs (Note [Checkpoint the forward,
  not the module]);
- :mod:`~remat.rewrite.eager`: the blocks ``Module.compile()`` leaves eager (Note [Blocks Module.compile()
  leaves eager] in remat.runtime.compiled, which holds their compiled calls), and the eager call profiles and
  checks make of a model's compiled submodules;
- :mod:`~remat.rewrite.offload`: offloaded units, their saved activations moved to host memory and back (Note
  [Offloaded units]; the GPU's side stream in :mod:`remat.runtime.host_copies`);
- :mod:`~remat.rewrite.install`: unit names parsed and checked, ``checkpoint_modules``, ``checkpoint_plan``
  and ``remove_checkpointing`` (which undoes offloading too).

What other stages use is re-exported here; other names, private ones included, are imported from the module
that defines them. A name is looked up in the module that uses it: to replace one (a test's
``monkeypatch.setattr``), set it there (``remat.rewrite.policy.draws_random``, ``remat.rewrite.forwards.unit_policy``,
``remat.rewrite.forwards._checkpointed_call``).
"""

from __future__ import annotations

from remat.rewrite import call, eager, forwards, install, policy  # noqa: F401
from remat.rewrite.eager import compiled_nothing_note, eager_submodules  # noqa: F401
from remat.rewrite.install import (check_units, checkpoint_modules, checkpoint_plan, checkpointed_modules,  # noqa: F401
                                   parse_unit, remove_checkpointing)
from remat.rewrite.policy import PolicyNames, draws_random, keep_ops, keep_ops_contexts  # noqa: F401
