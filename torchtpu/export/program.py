"""A ``torch.export`` program as one pure JAX function, from the compiled path's lowering table.

``JaxProgram(exported_program)`` decomposes the program as ``torch.compile(backend="tpu")``
decomposes its graphs (an op with a lowering stays whole), then hands the graph to the compiled
path's ``GraphFunction``: the same lowerings, promotion and result casts, no second interpreter.
The function takes the graph's placeholders in order (parameters, buffers and constants, then the
user inputs) and gives its outputs in order (updated buffers, then the user outputs): the calling
convention ``torchtpu_artifact`` reads from the manifest.

What the table cannot give is refused before tracing, naming the op and the module it came from
(``nn_module_stack``): an op without a lowering, an op whose output shape depends on data. An op
that fails while traced (a lowering that needs a concrete size where the export made it symbolic)
is named the same way.
"""

from __future__ import annotations

import dataclasses
import operator
import traceback

import jax
import numpy as np
import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import torchtpu_artifact as artifact
from torchtpu.compile import control_flow
from torchtpu.compile.backend import decompositions
from torchtpu.compile.graph_function import GraphFunction
from torchtpu.device import dtypes, kernels
from torchtpu.lowering import graph_forms
from torchtpu.lowering.registry import GRAPH_FORMS, lookup

OpOverload = torch._ops.OpOverload


@dataclasses.dataclass(frozen=True)
class Slot:
    """One input or output of the program: its manifest name and kind, and its graph node's
    value (a fake tensor, sizes possibly symbolic)."""

    name: str
    kind: str
    val: torch.Tensor | None


def module_path(node: fx.Node) -> str:
    """Where node's op was called: the innermost module of its ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "the top-level module"
    path, kind = list(stack.values())[-1]
    kind = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
    return f"module '{path or '<root>'}' ({kind.rsplit('.', 1)[-1]})"


def _error(text: str) -> str:
    return f"torchtpu.export: {text}"


def _refuse_unservable(gm: fx.GraphModule) -> None:
    """Raise for the first op the lowering table cannot serve, or whose shape is data's."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = node.target
        if isinstance(op, OpOverload) and lookup(op) is None and op not in GRAPH_FORMS \
                and op is not graph_forms.INPUT_WRITE:
            raise NotImplementedError(_error(
                f"aten op '{op}' (called in {module_path(node)}) has no tpu lowering, so it "
                "cannot be exported to JAX; rewrite that code with other ops or add a lowering "
                "(docs, Adding an op)"))
        if not isinstance(op, OpOverload) and op not in GRAPH_FORMS \
                and op is not operator.getitem and not control_flow.is_higher_order(node):
            raise NotImplementedError(_error(
                f"'{getattr(op, '__name__', op)}' (called in {module_path(node)}) has no JAX "
                "form (float arithmetic on a dynamic size, such as interpolate's scale_factor): "
                "make that dimension static (no torch.export.Dim for it)"))
        unbacked = free_unbacked_symbols(node.meta.get("val"))
        if unbacked:
            raise NotImplementedError(_error(
                f"'{op}' (called in {module_path(node)}) gives a data-dependent "
                f"{'shape' if isinstance(node.meta.get('val'), torch.Tensor) else 'value'} "
                f"({', '.join(sorted(map(str, unbacked)))}), which a JAX program cannot express: "
                "give it a static size (torch.nonzero_static, a torch.where mask instead of "
                "boolean indexing, no .item() or .tolist() on tensors) or keep that step out of "
                "the exported module"))


def _failing_node(error: BaseException) -> fx.Node | None:
    """The graph node GraphFunction.run was running when error was raised."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        step = frame.f_locals.get("step")
        if isinstance(frame.f_locals.get("self"), GraphFunction) and step is not None:
            return step.node
    return None


def _user_output_names(ep: ExportedProgram, count: int) -> list[str]:
    """Names of the user outputs from the module's output structure (``logits``, ``[0]``)."""
    from torch.utils import _pytree as pytree

    try:
        tree = ep.call_spec.out_spec.unflatten(list(range(count)))
        paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]
    except Exception:  # an output container pytree cannot rebuild: positions will do
        paths = []
    if len(paths) != count:
        return [f"output{k}" for k in range(count)]
    return ["output" + p.replace("['", ".").replace("']", "") if p else "output"
            for p in paths]


def weight_array(t: torch.Tensor) -> np.ndarray:
    """A parameter, buffer or constant as a NumPy array (bfloat16 and fp8 through ml_dtypes)."""
    return kernels.torch_to_numpy(t.detach().cpu())


class JaxProgram:
    """An ExportedProgram as ``fn(*placeholders) -> outputs``, a pure function of JAX arrays."""

    def __init__(self, ep: ExportedProgram) -> None:
        if not isinstance(ep, ExportedProgram):
            raise TypeError(_error(f"expected the result of torch.export.export, got "
                                   f"{type(ep).__name__}"))
        self.ep = ep = ep.run_decompositions(decompositions())
        gm = ep.graph_module
        _refuse_unservable(gm)
        self.fn = GraphFunction(gm)
        if self.fn.key_nodes:
            node = self.fn.key_nodes[0]
            raise NotImplementedError(_error(
                f"'{node.target}' (called in {module_path(node)}) draws random numbers, which "
                "an exported program cannot take a seed for yet: export the module in eval mode "
                "(model.eval(), no dropout)"))
        self.constants = tuple(jax.numpy.asarray(weight_array(getattr(gm, n.target)))
                               for n in self.fn.constants)
        sig = ep.graph_signature
        self.inputs = [Slot(spec.arg.name if spec.kind is InputKind.USER_INPUT else spec.target,
                            spec.kind.name.lower(), node.meta.get("val"))
                       for spec, node in zip(sig.input_specs, self.fn.placeholders, strict=True)]
        user = [k for k, s in enumerate(sig.output_specs) if s.kind is OutputKind.USER_OUTPUT]
        names = dict(zip(user, _user_output_names(ep, len(user))))
        # Outputs that are no value (TinyGPT's loss without targets) are left out.
        self.kept = [k for k, o in enumerate(self.fn.output) if o is not None]
        self.outputs = [Slot(names.get(k, spec.target), spec.kind.name.lower(),
                             _val(self.fn.output[k]))
                        for k, spec in enumerate(sig.output_specs) if k in self.kept]
        for slot in self.outputs:
            if slot.kind not in (artifact.USER_OUTPUT, artifact.BUFFER_MUTATION):
                raise NotImplementedError(_error(
                    f"output {slot.name!r} is a {slot.kind}, which an exported JAX program does "
                    "not return (only buffer updates and user outputs)"))
        for slot in self.outputs:
            if not isinstance(slot.val, torch.Tensor):
                raise NotImplementedError(_error(
                    f"output {slot.name!r} is a {type(slot.val).__name__}, not a tensor; an "
                    "exported JAX program returns tensors only"))
        for slot in self.inputs:
            if not isinstance(slot.val, torch.Tensor):
                raise NotImplementedError(_error(
                    f"input {slot.name!r} is a {type(slot.val).__name__}, not a tensor; export "
                    "programs whose inputs are all tensors (numbers become constants)"))

    def weights(self) -> dict[str, np.ndarray]:
        """The parameters, buffers and constants the program takes, by manifest name."""
        ep = self.ep
        found = {}
        for slot in self.inputs:
            if slot.kind == artifact.USER_INPUT:
                continue
            t = ep.state_dict[slot.name] if slot.name in ep.state_dict else ep.constants[slot.name]
            found[slot.name] = weight_array(t)
        return found

    def input_dtypes(self) -> list:
        return [dtypes.to_jax(s.val.dtype) for s in self.inputs]

    def __call__(self, *arrays) -> list:
        """The program's outputs from its inputs, in manifest order (inside a JAX trace)."""
        try:
            outs = self.fn.run(tuple(arrays), self.constants, tuple(self.fn.scalars), (), ())
        except Exception as e:
            node = _failing_node(e)
            if node is None:
                raise
            raise NotImplementedError(_error(
                f"'{node.target}' (called in {module_path(node)}, node {node.name}) failed while "
                f"traced with its input shapes {_shapes_of(node)}: {type(e).__name__}: {e}. "
                "A lowering that needs a concrete size cannot take a dynamic one: make that "
                "dimension static (no torch.export.Dim for it) or file an issue with the op"
            )) from e
        return [outs[k] for k in self.kept]  # without the check flags (see docs/features.md)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _shapes_of(node: fx.Node) -> str:
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    return ", ".join(str(list(v.shape)) for v in vals if isinstance(v, torch.Tensor)) or "()"
