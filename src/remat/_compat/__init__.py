"""Private torch APIs remat relies on, in one place.

Every private torch API remat uses (and the one of Lightning's it reads, and transformers' mask helpers) lives in
this package and nowhere else; the rest of remat imports them from ``remat._compat``, which re-exports the entries
of its modules (``attention``'s are imported from it: remat.target.attention alone uses them):
``versions`` (the torch releases remat supports: ``CHECKED_ON``, ``TORCH_FLOOR``, ``COMPILED_FLOOR``,
:func:`require_torch`), ``dispatch`` (dispatch modes, fake tensors, operator schemas, storages, pytrees),
``optim`` (torch.optim's global hooks and defaults), ``modules`` (``Module.compile()`` and ``torch.compile``),
``inductor`` (the sizes of inductor's programs), ``distributed`` (DTensor, FSDP2), ``profiler`` (the
profiler's memory events), ``cuda`` (the BLAS workspaces in the CUDA caching allocator), ``transformers``
(Hugging Face's mask helpers, answered for fake tensors: Note [Masks decided on values]) and ``attention`` (SDPA's
switches and priority order, the CUDA kernels called on fake tensors: Note [Attention on the target]).

Each entry names the torch versions it was checked on: CI runs the suite on every release in ``CHECKED_ON``
(``.ci/run``), so each entry was run on those; 2.11 is the lent GPU's image; an entry used only for compiled steps
(from ``COMPILED_FLOOR`` on) says so. When a new torch moves one of them, it breaks here with a message that says
which, instead of deep inside a stage.

Only what the rest of remat uses is re-exported; private names and module-level state (``_PROGRAM_SIZES``,
``_IS_DTENSOR``) are not: code and tests that need them read the module that defines them, the one to patch.
"""

from __future__ import annotations

from remat._compat.versions import (  # noqa: F401
    CHECKED_ON, COMPILED_FLOOR, COMPILED_FLOOR_WHY, FAKE_WORLD_FLOOR, FAKE_WORLD_FLOOR_WHY, TORCH_FLOOR, require_torch,
    torch_release)
from remat._compat.optim import default_foreach, global_optimizer_hooks_paused  # noqa: F401
from remat._compat.distributed import (  # noqa: F401
    active_fake_mode, default_store, fake_store, fsdp_modules, in_sharding_propagation, is_dtensor_class,
    local_tensor, meshes_built_for_real, rng_states_reported, sharding_propagation_marked, storage_resizes_reported)
from remat._compat.dispatch import (  # noqa: F401
    FakeTensor, TorchDispatchMode, argument, checkpoint_policies_asked_for, fake_mode, fake_tensor_exceptions,
    leaves_with_paths, module_stack, op_bytes, op_flops, outside_dispatch_modes, storage_key, storage_ref, tree_flatten,
    tree_map, untyped_storage_key, written_arguments)
from remat._compat.modules import (  # noqa: F401
    cacheable_context_fn, compile_fn, compile_settings,
    compiled_call, compiled_submodules, lightning_compiled, module_call, module_compile_compiles_nothing,
    set_compiled_call, submodules_called, uncompiled)
from remat._compat.profiler import (  # noqa: F401
    ProfilerSession, profiler_memory_peak, profiler_memory_trace)
from remat._compat.inductor import (  # noqa: F401
    inductor_programs, random_numbers)
from remat._compat.transformers import batch_layout, masks_decided_for  # noqa: F401
from remat._compat.cuda import clear_blas_workspaces  # noqa: F401
