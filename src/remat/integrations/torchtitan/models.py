"""torchtitan's models from its registry (``torchtitan.models.<name>.model_registry(flavor)``), as the installed package
builds them: for the command line's ``torchtitan:NAME:FLAVOR`` targets, tests and benchmarks."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from remat.errors import InvalidInputError
from remat.integrations.torchtitan.planning import TitanRun, TitanStep, fsdp_as_torchtitan, sdpa_config


def model_config(name: str, flavor: str) -> Any:
    """The decoder config of torchtitan's model ``name`` (``llama3``, ``qwen3``, ``deepseek_v3``, ...) in ``flavor``
    (``debugmodel``, ``8B``, ...), from the installed package's registry."""
    try:
        module = importlib.import_module(f"torchtitan.models.{name}")
    except ImportError as e:
        raise InvalidInputError(f"torchtitan has no model {name!r} ({e}); its models: {', '.join(known_models())}") \
            from e
    registry = getattr(module, "model_registry", None)
    flavors = _flavors(module)
    if registry is None or (flavors and flavor not in flavors):
        raise InvalidInputError(f"torchtitan's {name} has no flavour {flavor!r}; its flavours: "
                                f"{', '.join(flavors) or '(none listed)'}")
    return registry(flavor).model


def known_models() -> list[str]:
    import pkgutil

    import torchtitan.models

    return sorted(m.name for m in pkgutil.iter_modules(torchtitan.models.__path__) if m.ispkg and m.name != "common")


def _flavors(module: Any) -> list[str]:
    for attr in dir(module):
        if attr.endswith("_configs") and isinstance(getattr(module, attr), dict):
            return list(getattr(module, attr))
    return []


def titan_target(name: str, flavor: str, *, device: torch.device, batch_size: int = 1, seq_len: int = 2048,
                 param_dtype: str = "bfloat16") -> tuple:
    """``(step, (tokens,), loss_fn, description, parallelize)``: torchtitan's model ``name``/``flavor`` with its loss
    (:class:`TitanStep`: ``del pred`` as torchtitan's trainer), attention as Note [FlexAttention planned as SDPA] in
    remat.integrations.torchtitan.planning says, and torchtitan's own FSDP2 wrapping for a world of ranks. On the meta
    device for a target that is not here; else its weights initialised by torchtitan's ``init_weights``."""
    config, replaced = sdpa_config(model_config(name, flavor))
    with torch.device("meta"):
        model = config.build()
    if device.type != "meta":
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    run = TitanRun(local_batch_size=batch_size, seq_len=seq_len, param_dtype=param_dtype)
    desc = (f"torchtitan {name} {flavor} batch_size={batch_size} seq_len={seq_len}"
            + (f" ({replaced} planned as SDPA)" if replaced else ""))
    return TitanStep(model).train(), (tokens,), (lambda loss: loss), desc, fsdp_as_torchtitan(run)
