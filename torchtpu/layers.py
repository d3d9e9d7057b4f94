"""``torchtpu.scan_layers``: a stack of identical blocks as one scanned body.

``scan_layers(layers, x, *args, **kwargs)`` runs ``x = layer(x, *args, **kwargs)`` for each
layer in turn and returns the last ``x``, as PyTorch/XLA's
``torch_xla.experimental.scan_layers.scan_layers(layers, input_data)`` does (``args`` and
``kwargs``, the same for every layer, are our addition: a mask, rotary embeddings; a layer
returning a 1-tuple, as older Hugging Face blocks do, feeds its one tensor on). Under
``torch.compile`` the layers' parameters and buffers are stacked along a new leading dimension
and the first layer's code runs once per slice through ``torch._higher_order_ops.scan``, which
the backend lowers to one XLA while loop (``compile/control_flow.py``), forward and backward:
XLA compiles one block, so compile time stays flat as the model grows deeper.

Outside ``torch.compile`` (eager, and the captured steps of ``torch.tpu.graph`` and of a
compiled whole training step, which record eager code) the layers simply run one by one: the
same results, one block's program per layer.

``scan_layers.patch(model)`` switches a Hugging Face decoder model (``model.model.layers`` or
``model.layers``, a ``ModuleList`` that the model's forward loops over) to the scanned form; its
parameters, names and ``state_dict`` stay as they were, and a KV cache is turned off (a cache is
written per layer index, which one scanned body cannot do). The blocks are checked to be
identical when patched, not again at each trace: Dynamo interprets every attribute read of the
check, which made tracing grow faster than the model (a block's settings changed after the
patch are not seen).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torchtpu import errors

# Attributes a layer may hold its own value of: HF attention keeps its index for the KV cache.
_PER_LAYER = frozenset({"layer_idx"})
_PLAIN = (int, float, bool, str, type(None))


def _fail(message: str) -> ValueError:
    return ValueError(errors.message("tpu", f"scan_layers: {message}"))


def _settings(module: nn.Module) -> dict:
    """The plain attributes (sizes, flags, names) of module and its submodules."""
    return {(prefix, k): v for prefix, m in module.named_modules()
            for k, v in vars(m).items()
            if isinstance(v, _PLAIN) and k not in _PER_LAYER and not k.startswith("_")}


def _check_identical(layers: Sequence[nn.Module]) -> None:
    first = layers[0]
    shapes = [(n, t.shape, t.dtype, t.device) for n, t in _tensors(first)]
    settings = _settings(first)
    for i, layer in enumerate(layers[1:], 1):
        if type(layer) is not type(first):
            raise _fail(f"layer {i} is a {type(layer).__name__}, layer 0 a "
                        f"{type(first).__name__}; the layers must be identical blocks")
        if [(n, t.shape, t.dtype, t.device) for n, t in _tensors(layer)] != shapes:
            raise _fail(f"layer {i}'s parameters and buffers differ from layer 0's in names, "
                        "shapes, dtypes or devices; the layers must be identical blocks")
        other = _settings(layer)
        if other != settings:
            name = next(k for k in settings.keys() | other.keys()
                        if settings.get(k) != other.get(k))
            raise _fail(f"layer {i} sets {'.'.join(filter(None, name))}="
                        f"{other.get(name)!r} where layer 0 sets {settings.get(name)!r}; one "
                        "scanned body runs layer 0's code for every layer")


def _tensors(module: nn.Module) -> list:
    return [*module.named_parameters(), *module.named_buffers()]


def _paths(module: nn.Module) -> tuple:
    """Where each of module's parameters and buffers sits: its dotted name, split."""
    return tuple(tuple(name.split(".")) for name, _ in _tensors(module))


def _at(module: nn.Module, path: tuple) -> torch.Tensor:
    for name in path:
        module = getattr(module, name)
    return module


def _carry(out):
    """The block's output to feed the next block: a tensor, or the first of a 1-tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and len(out) == 1 and isinstance(out[0], torch.Tensor):
        return out[0]
    raise _fail("a scanned layer must return one tensor (or a 1-tuple of one), the input of the "
                f"next layer; got {type(out).__name__}")


def scan_layers(layers: Sequence[nn.Module], x: torch.Tensor, *args, **kwargs):
    """``x`` through each of ``layers`` in turn, as one scanned body under ``torch.compile``."""
    return _scan(list(layers), x, args, kwargs, paths=None)


def _scan(layers: list, x: torch.Tensor, args: tuple, kwargs: dict, paths: tuple | None):
    """paths: layer 0's tensor paths, taken when the blocks were checked (``patch``); None to
    check the blocks and take them now."""
    if not layers:
        return x
    if not torch.compiler.is_compiling():
        for layer in layers:
            x = _carry(layer(x, *args, **kwargs))
        return x
    from torch._higher_order_ops.scan import scan
    from torch.func import functional_call

    if paths is None:  # Dynamo traces the check's every attribute read: seconds per layer
        _check_identical(layers)
        paths = _paths(layers[0])
    first = layers[0]
    names = [".".join(p) for p in paths]
    # Each layer's tensors read by attribute, in layer 0's order (_check_identical made sure
    # every layer has them): Dynamo inlines a named_parameters() walk, generators and all, at a
    # cost per layer that made the trace of 32 scanned layers 2.3x that of 2.
    per_layer = [[_at(layer, p) for p in paths] for layer in layers]
    stacked = [torch.stack(ts) for ts in zip(*per_layer, strict=True)]

    def body(h, sliced):
        out = _carry(functional_call(first, dict(zip(names, sliced, strict=True)),
                                     (h, *args), kwargs))
        # scan wants per-iteration outputs; the blocks have none to give.
        return out, h.new_empty(0)

    h, _ = scan(body, x, stacked)
    return h


class ScannedLayers(nn.ModuleList):
    """A decoder's ``ModuleList`` of blocks that a model's ``for layer in self.layers[:n]`` loop
    runs as one scanned call: iterating it gives one callable over all the blocks. Indexing,
    ``len``, parameters and ``state_dict`` are a ``ModuleList``'s."""

    def __init__(self, modules: list, paths: tuple) -> None:
        super().__init__(modules)
        self._paths = paths  # layer 0's tensor paths, from the check at the patch

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            # A decoder slices its blocks at every call (``self.layers[:n]``); a new container
            # would cost the trace an add_module per block.
            if idx.indices(len(self)) == (0, len(self), 1):
                return self
            return ScannedLayers(list(self._modules.values())[idx], self._paths)
        return super().__getitem__(idx)

    def __iter__(self):
        return iter([self._scanned])

    def _scanned(self, hidden_states: torch.Tensor, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            raise _fail("a KV cache cannot be written by one scanned body (it is indexed per "
                        "layer); call the model with use_cache=False, or undo the patch with "
                        "scan_layers.unpatch(model) for generation")
        # patch() checked the blocks (a check traced by Dynamo costs seconds per layer).
        return _scan(list(self._modules.values()), hidden_states, args, kwargs, self._paths)


def _owner(model: nn.Module) -> nn.Module:
    for owner in (getattr(model, "model", None), model):
        if isinstance(getattr(owner, "layers", None), nn.ModuleList):
            return owner
    raise _fail(f"{type(model).__name__} has no ModuleList at .model.layers or .layers; pass "
                "the decoder's blocks to scan_layers(layers, x) yourself")


def patch(model: nn.Module) -> nn.Module:
    """model (a Hugging Face decoder, ``...ForCausalLM`` or its base model), its decoder blocks
    run as one scanned body under ``torch.compile``; the KV cache is turned off."""
    owner = _owner(model)
    layers = owner.layers
    if not isinstance(layers, ScannedLayers):
        _check_identical(list(layers))
        owner.layers = ScannedLayers(list(layers), _paths(layers[0]) if len(layers) else ())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """model with its blocks back in a plain ``ModuleList`` (for generation with a KV cache)."""
    owner = _owner(model)
    if isinstance(owner.layers, ScannedLayers):
        owner.layers = nn.ModuleList(list(owner.layers._modules.values()))
    return model


scan_layers.patch = patch
scan_layers.unpatch = unpatch
