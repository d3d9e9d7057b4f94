"""What the tools are pointed at, and how they say that it is unusable.

A target is ``path/to/script.py:factory``: the script is imported (its own folder first on
``sys.path``, as ``python script.py`` would have it) and ``factory()`` returns ``(model, inputs)``,
inputs a tuple of positional arguments (a single tensor is one argument). What is unusable is a
``ToolError`` (``torchtpu/commands.py``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from torchtpu.commands import ToolError, describe


def load(target: str) -> tuple[torch.nn.Module, tuple]:
    """(model, inputs) from ``script.py:factory``; ToolError for anything unusable."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise ToolError(f"target {target!r} is not path/to/script.py:factory")
    file = Path(path)
    if not file.is_file():
        raise ToolError(f"{path} does not exist (target {target!r})")
    spec = importlib.util.spec_from_file_location(f"torchtpu_target_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ToolError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Dynamo and pickling look modules up by name
    sys.path.insert(0, str(file.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[spec.name]
        raise ToolError(f"{path} does not import: {describe(e)}") from None
    finally:
        sys.path.remove(str(file.resolve().parent))
    factory = getattr(module, name, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ToolError(f"{path} has no function {name!r}; it defines: {', '.join(names) or '-'}")
    try:
        made = factory()
    except Exception as e:
        raise ToolError(f"{name}() raised {describe(e)}") from None
    return check(made, f"{name}()")


def loss_of(out) -> torch.Tensor:
    """The training loss a tool takes from a model's output: the output if it is a scalar, else
    its ``.loss``, else the float sum of its floating tensors."""
    if isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point():
        return out.reshape(())
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    parts = [t.float().sum() for t in tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not parts:
        raise ToolError("the model's output has no floating tensor to take as the loss")
    return torch.stack(parts).sum()


def check(made, what: str = "the factory") -> tuple[torch.nn.Module, tuple]:
    """(model, inputs) checked: a module, and tensors all on one usable device."""
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise ToolError(f"{what} must return (model, inputs), model an nn.Module, inputs a "
                        f"tuple of its arguments; it returned {type(made).__name__}")
    model, inputs = made
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    devices = {t.device.type for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    params = {p.device.type for p in model.parameters()}
    odd = (devices | params) - {"cpu", "tpu"}
    if odd:
        raise ToolError(f"{what}: tensors on {', '.join(sorted(odd))}; give the model and inputs "
                        "on cpu (the tools make the tpu copies) or all on tpu")
    if len(devices | params) > 1:
        raise ToolError(f"{what}: the inputs are on {', '.join(sorted(devices))} but the model's "
                        f"parameters on {', '.join(sorted(params))}: put both on one device "
                        "(cpu is best: the tools make the tpu copies)")
    return model, inputs
