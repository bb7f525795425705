"""Features that need a later torch than remat's floor refuse on older releases with the version they need, and
work from it on (Issue #37). CI runs this on the floor, where the refusal is what is checked, and on later
releases, where the feature is (.ci/run; remat._compat.CHECKED_ON)."""

import re

import pytest
import torch
from torch import nn

import remat
from remat._compat import COMPILED_FLOOR, torch_release


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    return model, torch.randn(8, 16), lambda out: out.square().mean()


def test_planning_a_compiled_step_needs_the_compiled_floor():
    model, x, loss_fn = _model()
    compiled = torch.compile(model, backend="aot_eager")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if torch_release() < COMPILED_FLOOR:
        need = f"{COMPILED_FLOOR[0]}.{COMPILED_FLOOR[1]}"
        with pytest.raises(remat.UnsupportedError, match=re.escape(
                f"needs torch >= {need}; this is torch {torch.__version__}")) as e:
            remat.optimize_checkpointing(compiled, 1.0, x, loss_fn=loss_fn)
        assert "torch.compile" in str(e.value) and f"pip install 'torch>={need}'" in str(e.value)
        # refused before anything was touched; the eager step is still planned
        assert remat.checkpointed_modules(model) == []
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert remat.optimize_checkpointing(model, 1.0, x, loss_fn=loss_fn).compiled == ""
    else:
        plan = remat.optimize_checkpointing(compiled, 1.0, x, loss_fn=loss_fn)
        assert "torch.compile" in plan.compiled, plan.compiled
