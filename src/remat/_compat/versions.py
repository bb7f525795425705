"""remat's own version, the torch releases it supports and runs on (part of remat._compat: see its docstring):
``CHECKED_ON``, the floors, and the check a feature that needs a later torch makes."""

from __future__ import annotations

import torch

#: remat's version (``remat.__version__``; pyproject.toml's)
REMAT_VERSION = "0.1.0"

#: the torch releases remat's suite runs on in CI (``.ci/run``: scripts/test.sh on 2.13, scripts/torch-leg.sh on
#: the others), so every entry below was run on each; an entry says where it was also checked (2.11: the lent
#: GPU's image) or where it needs more than the floor. Named in remat's report of its own failures.
CHECKED_ON = ("2.8", "2.13", "2.15")

#: the least torch remat supports (pyproject.toml's ``torch>=``; README); features that need a later one check
#: with :func:`require_torch`
TORCH_FLOOR = (2, 8)

#: the least torch on which remat plans a torch.compile'd step (remat.runtime.compiled.compiled_loop); why older ones fail
COMPILED_FLOOR = (2, 13)
COMPILED_FLOOR_WHY = ("on torch 2.8-2.12 torch's selective checkpointing under torch.compile fails on remat's plans: "
                      "'Tensor cached during selective activation checkpoint has been mutated'")

#: the least torch on which remat models a world of several ranks on torch's fake process group (remat.target); why
#: older ones fail
FAKE_WORLD_FLOOR = (2, 13)
FAKE_WORLD_FLOOR_WHY = ("on torch 2.8 c10d's collectives have no fake implementations: FSDP2's all-gather on fake "
                        "tensors fails with UnsupportedOperatorException: c10d._allgather_base_; 2.9-2.12 not tried")


def torch_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of the running torch, or of ``version`` (``"2.15.0+cu132"`` -> ``(2, 15)``)."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def require_torch(feature: str, least: tuple[int, int], why: str = "") -> None:
    """Refuse ``feature`` (UnsupportedError) on a torch older than ``least``, naming both versions and what to do;
    ``why`` says what the older torch lacks."""
    if torch_release() < least:
        from remat.errors import UnsupportedError

        need = f"{least[0]}.{least[1]}"
        raise UnsupportedError(
            f"{feature} needs torch >= {need}; this is torch {torch.__version__}" + (f" ({why})" if why else "") +
            f". Upgrade torch (pip install 'torch>={need}'), or plan without it.")
