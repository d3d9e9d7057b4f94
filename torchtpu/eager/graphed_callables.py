"""``torch.tpu.make_graphed_callables``: a callable's forward and backward each as one program.

As in PyTorch, the callable runs a few warm-up iterations, then its forward is captured
(``eager/capture.py``) on the sample arguments and its backward (``torch.autograd.grad`` of the
outputs with respect to the inputs and parameters that require grad) is captured after it. The
result is an ``autograd.Function``: its forward replays the forward program with the call's
arguments bound to the sample arguments' storages (no copy), its backward replays the backward
program with the incoming gradients bound the same way.

What PyTorch's version requires holds here too: the arguments' shapes, dtypes and
``requires_grad`` must match the samples', and grad mode, autocast, the matmul precision and
the modules' train/eval mode the capture's (checked at each call: a mismatch raises), the
callable must not depend on Python state that changes between calls, and modules must have no
hooks. Outputs are the same tensors on every call, as with CUDA Graphs (each replay overwrites
them); gradients are fresh tensors.
"""

from __future__ import annotations

import jax
import torch
import torch.utils._pytree as pytree
from torch.autograd.function import once_differentiable

from torchtpu.device import tensors
from torchtpu.eager.capture import Capture, Captured, CaptureError


def _captured(fn, *args) -> tuple:
    capture = Capture()
    capture.begin()
    try:
        out = fn(*args)
    except BaseException:
        capture.abort()
        raise
    return out, capture.finish()


def _grad_inputs(outputs, inputs, grad_outputs, allow_unused: bool):
    wanted = [o for o in outputs if o.requires_grad]
    diff = [i for i in inputs if i.requires_grad]
    grads = torch.autograd.grad(wanted, diff, grad_outputs=grad_outputs, only_inputs=True,
                                allow_unused=allow_unused)
    return grads


def binding(static: list) -> list:
    """(index, storage, shape, dtype) for each static device tensor a call rebinds."""
    return [(i, t.untyped_storage(), tuple(t.shape), t.dtype) for i, t in enumerate(static)
            if isinstance(t, torch.Tensor)]


def bind(binding: list, static: list, values, what: str) -> None:
    """Point each static tensor's storage at the value passed for it (no copy)."""
    for i, st, shape, dtype in binding:
        v = values[i]
        if v is static[i]:
            continue
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != dtype \
                or v.device.type != "tpu":
            got = (tuple(v.shape), v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else v
            raise CaptureError(f"torchtpu.capture: a graphed callable's {what} {i} is {got}, but "
                               "it "
                               f"was captured as ({shape}, {dtype}, tpu); make a new graphed "
                               "callable for other shapes")
        value = tensors.read(v) if v.is_contiguous() else tensors.read(v.contiguous())
        st._tpu_array = tensors.stored_form(value, dtype)  # complex32: its float16 pairs


class GraphedCallable:
    """A callable's captured forward and backward, and the static tensors they are bound to."""

    def __init__(self, fn, sample_args: tuple, warmup: int, allow_unused: bool,
                 inputs_written: bool = False) -> None:
        flat, self._spec = pytree.tree_flatten(sample_args)
        if not all(isinstance(t, torch.Tensor) and t.device.type == "tpu" for t in flat):
            raise TypeError("torchtpu.capture: make_graphed_callables: sample_args must be tpu "
                            "tensors")
        params = tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else ()
        self._static = [*flat, *params]
        self._n_args = len(flat)
        tensor_inputs = self._static
        self._requires = [t.requires_grad for t in tensor_inputs]
        self._modules = list(fn.modules()) if isinstance(fn, torch.nn.Module) else []
        self._context = context(self._modules)
        grads_on = torch.is_grad_enabled()
        for _ in range(warmup):
            out = pytree.tree_leaves(fn(*sample_args))
            if grads_on and any(o.requires_grad for o in out):
                _grad_inputs(out, tensor_inputs,
                             [torch.ones_like(o) for o in out if o.requires_grad], allow_unused)
            del out
        outputs, self._forward = _captured(fn, *sample_args)
        flat_out, self._out_spec = pytree.tree_flatten(outputs)
        self._outputs = flat_out
        written = {id(st) for st in self._forward.storages_written()}
        # Arguments the callable writes in place (an optimizer's parameters and state, the
        # gradients clipping scales): see ``_write_through``.
        self._written = [i for i, t in enumerate(flat) if id(t.untyped_storage()) in written]
        if self._written and not inputs_written:
            raise CaptureError("torchtpu.capture: make_graphed_callables: the callable writes one "
                               "of "
                               "its arguments in place; graphed callables must not")
        self._backward: Captured | None = None
        self._diff_outputs = [o for o in flat_out
                              if isinstance(o, torch.Tensor) and o.requires_grad]
        if grads_on and self._diff_outputs:
            self._grad_outputs = [torch.empty_like(o) for o in self._diff_outputs]
            grads, self._backward = _captured(
                _grad_inputs, self._diff_outputs, tensor_inputs, self._grad_outputs,
                allow_unused)
            self._grads = list(grads)
        self.binding = [b for b in binding(self._static[:self._n_args])
                         if b[0] not in self._written]
        self._function = self._autograd_function()

    def can_write(self, flat: list) -> bool:
        """Whether a call's arguments written in place can stand in for the captured ones:
        the same storage, or a tensor that covers a storage of the same shape and dtype."""
        for i in self._written:
            t, static = flat[i], self._static[i]
            if t.untyped_storage() is static.untyped_storage():
                continue
            if not (tuple(t.shape) == tuple(static.shape) and t.dtype == static.dtype
                    and tensors.covers_storage(t)):
                return False
        return True

    def _write_through(self, inputs: tuple) -> list:
        """Point the captured storage of each argument written in place at the call's array;
        returns (call storage, captured storage) pairs to hand the results back through."""
        moved = []
        for i in self._written:
            st, static = inputs[i].untyped_storage(), self._static[i].untyped_storage()
            if st is not static:
                static._tpu_array = tensors.storage_array(inputs[i])
                moved.append((st, static))
        return moved

    def _autograd_function(self):
        graphed = self

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                bind(graphed.binding, graphed._static, inputs, "argument")
                moved = graphed._write_through(inputs)
                graphed._forward.replay()
                for st, static in moved:
                    # The call's tensor gets the new value; the captured storage lets go of it
                    # (its old buffer was donated), so no two storages share a buffer.
                    st._tpu_array, static._tpu_array = static._tpu_array, None
                return tuple(o.detach() if isinstance(o, torch.Tensor) else o
                             for o in graphed._outputs)

            @staticmethod
            @once_differentiable
            def backward(ctx, *grads):
                return graphed.backward(grads)

        return Graphed

    def backward(self, grads: tuple) -> tuple:
        if self._backward is None:
            raise RuntimeError("torchtpu.capture: this graphed callable was captured without "
                               "gradients (grad mode was off, or no output requires grad)")
        incoming = [g for o, g in zip(self._outputs, grads)
                    if isinstance(o, torch.Tensor) and o.requires_grad]
        bind(binding(self._grad_outputs), self._grad_outputs,
              [g if g is not None else torch.zeros_like(o)
               for g, o in zip(incoming, self._diff_outputs)], "incoming gradient")
        self._backward.replay()
        fresh = iter(move_out(self._grads))
        return tuple(next(fresh) if req else None for req in self._requires)

    def __call__(self, *args):
        if context(self._modules) != self._context:
            raise CaptureError(
                "torchtpu.capture: grad mode, autocast, the matmul precision or a module's "
                "train/eval mode differs from the capture's (captured: grad, autocast, dtype, "
                f"precision = {self._context[:4]}); make a new graphed callable for it")
        flat = pytree.tree_leaves(args)
        if len(flat) != self._n_args:
            raise CaptureError(f"torchtpu.capture: a graphed callable takes {self._n_args} tensor "
                               f"arguments (as its samples), not {len(flat)}")
        for t, req in zip(flat, self._requires):
            if isinstance(t, torch.Tensor) and t.requires_grad != req:
                raise CaptureError("torchtpu.capture: a graphed callable's argument requires_grad "
                                   "differs from its sample's; make a new graphed callable")
        out = self._function.apply(*flat, *self._static[self._n_args:])
        return pytree.tree_unflatten(list(out), self._out_spec)


def context(modules: list = ()) -> tuple:
    """What a captured program depends on beyond its tensors: grad mode, autocast, the matmul
    precision, the default dtype (``arange(n) * 0.5``'s), and the train/eval mode of each
    module."""
    return (torch.is_grad_enabled(), torch.get_default_dtype(), torch.is_autocast_enabled("tpu"),
            torch.get_autocast_dtype("tpu"), jax.config.jax_default_matmul_precision,
            tuple(m.training for m in modules))


def move_out(ts: list) -> list:
    """New tensors owning the values of ts (None stays None); their storages, written at every
    replay, are left empty. Every value is read before any storage lets go of its array:
    outputs may share a storage (a loss and its ``detach()``, a view of it)."""
    arrays = [tensors.read(t) if t is not None else None for t in ts]
    for t in ts:
        if t is not None:
            t.untyped_storage()._tpu_array = None
    return [tensors.wrap(a, t.dtype) if t is not None else None for a, t in zip(arrays, ts)]


def make_graphed_callables(callables, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, pool=None):
    """Graphed versions of callables (modules or functions): see the module docstring.

    ``callables`` may be one callable or a tuple of them, ``sample_args`` the matching tuple of
    sample arguments (a tuple per callable). A module is returned with its ``forward`` graphed.
    """
    just_one = not isinstance(callables, tuple)
    if just_one:
        callables, sample_args = (callables,), (sample_args,)
    out = []
    for fn, args in zip(callables, sample_args, strict=True):
        args = args if isinstance(args, tuple) else (args,)
        if isinstance(fn, torch.nn.Module):
            if fn._forward_hooks or fn._forward_pre_hooks or fn._backward_hooks:
                raise CaptureError("torchtpu.capture: make_graphed_callables: modules must have no "
                                   "hooks registered")
            graphed = GraphedCallable(fn, args, num_warmup_iters, allow_unused_input)
            fn.forward = graphed
            out.append(fn)
        else:
            out.append(GraphedCallable(fn, args, num_warmup_iters, allow_unused_input))
    return out[0] if just_one else tuple(out)
