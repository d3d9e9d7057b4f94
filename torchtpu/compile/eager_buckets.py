"""Eager op calls over growing sizes, run padded to size buckets instead of compiled per size.

An eager loop whose tensors grow (an autoregressive sampler fed its whole context each step)
would compile every op at every new length. A call at sizes that never ran before is looked
at here (a call that did takes one dict lookup and runs as usual): its structure (the op, its
static spec, its tensors' dtypes and ranks) at its call site (the innermost Python frame outside
PyTorch and torchtpu's machinery) is a *family*, which remembers a few of the values each size
(a tensor dim, an integer argument) took there; a size that took ``VARYING_VALUES`` distinct
values is *varying*. A call with varying sizes becomes a one-node FX graph whose varying sizes
are symbols (equal sizes, one symbol), and ``dynamic.plan`` decides, exactly as for
``torch.compile(dynamic=True)``, whether it runs padded and what it masks. If so, its inputs
are padded on the host up to their buckets (``buckets.pad``), one program per bucket runs it
with the real sizes as traced inputs (``masking`` through ``GraphFunction``), and its results
are cut back to their real sizes on the host (``buckets.unpad``): storages only ever hold
arrays of their tensors' real shapes. ``cat`` along the growing dim, which the plan refuses,
is ``padded_cat``'s. A call whose sizes never varied, or that the plan refuses, runs as
before, exact-shape.

A view whose geometry varies (``logits[:, -1]`` of a growing tensor, whose offset moves) would
make a program per geometry even when the view's own shape does not change: such views are
read on the host and passed whole.

Families are keyed by call site and, at a method's line, by the method's object: another model
built from the same class starts families of its own, so the sizes one model took at a shared
line do not make another's fixed sizes look varying (a plan is exact whichever sizes reach it;
this saves the compiles of the padded path).

On by default (``TORCHTPU_EAGER_BUCKETS=0``, or ``set_enabled(False)``, turns it off). Autograd's
calls keep the exact path: a backward's ops, every layer's, all come from the user's one
``backward()`` line, where their sizes would look varying. Still taken for growth: one line that
serves 4 or more fixed shapes in one step (an ``nn.Sequential`` of 4 widths) runs padded at
every step, exact in values but with host padding and a synchronous call each time.

Host padding waits for the inputs: a bucketed call is synchronous, which under DeferAndFuse
runs what is pending first. Random ops, captures and views the host cannot read by strides
(a reinterpreting dtype) keep the exact path.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import torch
import torch.fx as fx

from torchtpu import metrics
from torchtpu.compile import buckets, dynamic, padded_cat
from torchtpu.compile.graph_function import GraphFunction
from torchtpu.device import dtypes, tensors
from torchtpu.eager import dispatch, executor, meta, schema
from torchtpu.eager.program import CONST, KEY, SCALAR, TENSOR, TENSORS, Spec, cast_outputs
from torchtpu.lowering.registry import Lowering
from torchtpu.runtime import platform, transfer

# Buckets: 16, 32, ..., 512, then multiples of 512 (``buckets.bucket``).
BUCKET_SIZE = 16
NUM_BUCKETS = 6


class _Family:
    """One call structure at one call site: the values each size took there (a few), and the
    view geometries it was called with. A size is *varying* once it took ``VARYING_VALUES``
    distinct values: a growing length takes a new one at every step, where the sizes of a
    site that serves several fixed shapes (an ``nn.Sequential``'s layers, on one line) repeat."""

    __slots__ = ("seen", "varying", "geometries", "views")

    def __init__(self, sizes: tuple, geometries: tuple) -> None:
        self.seen = [{n} for n in sizes]
        self.varying = (False,) * len(sizes)
        self.geometries = {geometries}
        self.views = False  # whether its views' geometries vary

    def note(self, sizes: tuple, geometries: tuple) -> None:
        for seen, n in zip(self.seen, sizes):
            if len(seen) < VARYING_VALUES:
                seen.add(n)
        self.varying = tuple(len(seen) >= VARYING_VALUES for seen in self.seen)
        if not self.views and geometries not in self.geometries:
            self.geometries.add(geometries)
            self.views = len(self.geometries) >= VARYING_VALUES


VARYING_VALUES = 4
_families: dict = {}  # (call structure, call site) -> _Family
_exact: dict = {}     # (id of a spec, views) of calls that ran as usual -> the spec
# (call structure, symbol pattern, fixed sizes) -> (GraphFunction, Plan, ...) or why not
_plans: dict = {}
_programs: dict = {}  # (that key, bucket sizes) -> jitted program
SITE_FRAMES = 1
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MACHINERY = tuple(os.path.join(_PACKAGE, d) + os.sep
                   for d in ("eager", "device", "compile", "lowering", "runtime")) + (
    os.path.dirname(torch.__file__) + os.sep,)
_CAT = torch.ops.aten.cat.default
_abstract: dict = {}  # spec -> its entries with integer constants left out


def set_enabled(on: bool) -> None:
    """Route eager calls through ``run`` (and varying views through ``read_view``), or not."""
    dispatch.growing = run if on else None
    tensors.view_reader = read_view if on else None


def enabled() -> bool:
    return dispatch.growing is run


def _is_int(v) -> bool:
    return type(v) is int


def _abstract_entries(spec: Spec) -> tuple:
    key = _abstract.get(spec)
    if key is None:
        entries = []
        for kind, payload in spec.entries:
            if kind == CONST and _is_int(payload):
                payload = int
            elif kind == CONST and _int_tuple(payload):
                payload = (int,) * len(payload)
            entries.append((kind, payload))
        key = (tuple(entries), spec.compute, spec.final, spec.promote)
        meta.bounded_put(_abstract, spec, key)
    return key


class _Call:
    """One call's pieces: its tensors, where their arrays sit among the dynamic values, the
    places of its traced scalars and its integer constants (entry, list position, value)."""

    __slots__ = ("entries", "tensors", "at", "scalars", "ints", "dyn", "supported")

    def __init__(self, lowering: Lowering, spec: Spec, values: list, dyn: tuple) -> None:
        # A random lowering's spec starts with its key entry, which is no argument of the op.
        self.entries = spec.entries[1:] if lowering.random else spec.entries
        self.tensors, self.at, self.scalars, self.ints, self.dyn = [], [], [], [], dyn
        # CPU scalar tensors (as a scalar, or in a list) keep the exact path.
        self.supported = True
        k = 0
        for i, ((kind, payload), v) in enumerate(zip(self.entries, values)):
            if kind == TENSOR:
                self.tensors.append(v)
                self.at.append(k)
                k += 1
            elif kind == TENSORS:
                for x in v:
                    if x is not None:
                        self.supported &= not x.is_cpu
                        self.tensors.append(x)
                        self.at.append(k)
                        k += 1
            elif kind == SCALAR:
                self.supported &= not isinstance(v, torch.Tensor)
                self.scalars.append(k)
                k += 1
            elif kind == CONST and _is_int(payload):
                self.ints.append((i, None, payload))
            elif kind == CONST and _int_tuple(payload):
                self.ints.extend((i, j, x) for j, x in enumerate(payload))


def _int_tuple(payload) -> bool:
    return isinstance(payload, tuple) and bool(payload) and all(_is_int(x) for x in payload)


def run(lowering: Lowering, spec: Spec, values: list, dyn: tuple, views: tuple):
    """The call's results, padded to buckets or with its views read on the host; None when it
    should run as usual."""
    # ``dispatch.plan`` gives one spec object per call key (shapes included): a call whose spec
    # and views ran exact before has its program. The value keeps the spec, so its id is not
    # reused while it is a key.
    exact = (id(spec), views)
    if exact in _exact:
        return None
    if tensors.capture is not None or any(kind == KEY for kind, _ in spec.entries) \
            or _in_backward():
        return None  # a capture's replays could not repeat host padding; keys: random draws
    call = _Call(lowering, spec, values, dyn)
    structure = (lowering, _abstract_entries(spec),
                 tuple((t.dtype, t.dim()) for t in call.tensors))
    sizes = tuple(n for t in call.tensors for n in t.shape) + tuple(x for _, _, x in call.ints)
    key = (structure, _call_site())
    family = _families.get(key)
    geometries = tuple(g for _, _, g in views)
    if family is None:
        meta.bounded_put(_families, key, _Family(sizes, geometries))
        meta.bounded_put(_exact, exact, spec)
        return None
    family.note(sizes, geometries)
    out = None
    if call.supported:
        if any(family.varying):
            if lowering.op is _CAT:
                out = padded_cat.run(_programs, spec, values, call.tensors,
                                     [call.dyn[k] for k in call.at], family.varying, _bucket,
                                     _host_value)
            else:
                out = _padded(structure, family, lowering, spec, values, call, sizes)
        elif family.views and views:
            out = _host_views(lowering, spec, call)
    if out is None:
        meta.bounded_put(_exact, exact, spec)
    return out


def _in_backward() -> bool:
    """Whether autograd's engine runs the call: a backward's calls, every layer's, all come from
    the one user line that called ``backward()``, so their sizes would look varying there."""
    return torch._C._current_graph_task_id() != -1


def _call_site() -> tuple:
    """The innermost ``SITE_FRAMES`` frames outside PyTorch and torchtpu's machinery, as (code,
    line, the id of the method's ``self``) triples: sizes vary *at a call site* in a growing
    loop, where a fixed-shape model's differ between sites (its layers' lines). A module's line
    is shared by every model built from its class, whose sizes need not be related: each
    instance has its own families. Built only for calls at sizes not run before."""
    site, frame = [], sys._getframe(2)
    while frame is not None and len(site) < SITE_FRAMES:
        code = frame.f_code
        if not code.co_filename.startswith(_MACHINERY):
            owner = frame.f_locals.get("self") if code.co_argcount and \
                code.co_varnames[0] == "self" else None
            site.append((code, frame.f_lineno, id(owner)))
        frame = frame.f_back
    return tuple(site)


def _bucket(n: int) -> int:
    return buckets.bucket(n, BUCKET_SIZE, NUM_BUCKETS)


def _host_value(t: torch.Tensor, array) -> np.ndarray | None:
    """t's value as a host array, from what ``tensors.read_parts`` gave (None: not that way)."""
    if t.is_conj() or t.is_neg():  # read_parts gave t's value itself
        return np.asarray(array)
    return _strided(t, array)


def _strided(t: torch.Tensor, array) -> np.ndarray | None:
    """t's stored values (before a lazy conj or negation) as a host array, read from its
    storage array by strides; None for a view that reinterprets the storage's dtype."""
    host = np.asarray(array)
    if host.dtype != dtypes.to_jax(t.dtype) or t.dtype is torch.complex32:
        return None  # checked first: a reinterpreting view may have its storage's shape
    if tuple(host.shape) == tuple(t.shape) and t.is_contiguous() and t.storage_offset() == 0:
        return host
    flat = host.reshape(-1)
    view = np.lib.stride_tricks.as_strided(
        flat[t.storage_offset():], tuple(t.shape), tuple(s * flat.itemsize for s in t.stride()))
    return np.array(view, order="C")  # np.ascontiguousarray would make a 0-d view 1-d


_view_families: dict = {}  # (kind of view, call site) -> [geometries, whether they vary]
_exact_views: dict = {}    # geometries read by their own program


def read_view(t: torch.Tensor, array, g) -> jax.Array | None:
    """A view read on the host once views of its kind (ranks and dtypes of it and its storage)
    have been read at another geometry; None: read it as usual (``tensors.view_reader``)."""
    if tensors.capture is not None or _in_backward():
        return None
    if g in _exact_views:
        return None
    key = (len(g.array_shape), g.array_dtype, len(g.size), g.dtype, _call_site())
    family = _view_families.get(key)
    if family is None:
        meta.bounded_put(_view_families, key, [{g}, False])
    elif not family[1]:
        family[0].add(g)
        family[1] = len(family[0]) >= VARYING_VALUES
    host = _strided(t, array) if family is not None and family[1] else None
    if host is None:
        meta.bounded_put(_exact_views, g, None)
        return None
    metrics.count("eager_host_views")
    return transfer.put(host, platform.local_device())


def _host_views(lowering: Lowering, spec: Spec, call: _Call):
    """The call run on its tensors read whole on the host: one program for every geometry."""
    dyn = list(call.dyn)
    for t, k in zip(call.tensors, call.at):
        host = _host_value(t, dyn[k])
        if host is None:
            return None
        dyn[k] = transfer.put(host, platform.local_device())
    metrics.count("eager_host_views")
    return executor.current().run(lowering, spec, tuple(dyn))


def _symbols(varying: tuple, sizes: tuple):
    """Each slot's symbol (equal sizes share one) or None, and each symbol's size; None when
    a varying size is 0 or 1 (which PyTorch's shapes specialize)."""
    of_size: dict = {}
    pattern = []
    for v, n in zip(varying, sizes):
        if not v:
            pattern.append(None)
            continue
        if n < 2:
            return None
        pattern.append(of_size.setdefault(n, len(of_size)))
    return tuple(pattern), tuple(of_size)


def _padded(structure: tuple, family: _Family, lowering: Lowering, spec: Spec, values: list,
            call: _Call,
            sizes: tuple):
    found = _symbols(family.varying, sizes)
    if found is None:
        return None
    pattern, real = found
    # The plan holds the sizes that do not vary: they are part of what it was built for.
    plan_key = (structure, pattern, tuple(n for s, n in zip(pattern, sizes) if s is None))
    built = _plans.get(plan_key)
    if built is None:
        built = _build(lowering, spec, values, call, pattern, real, sizes)
        meta.bounded_put(_plans, plan_key, built)
    if isinstance(built, str):
        return None
    fn, plan, symbols, int_symbols = built
    values_at = dict(zip(symbols, real))
    to = {s: _bucket(n) for s, n in values_at.items()}
    arrays = []
    for t, k, node in zip(call.tensors, call.at, fn.placeholders):
        host = _host_value(t, call.dyn[k])
        if host is None:
            return None
        padded = buckets.pad(host, plan.layouts[node], values_at, to)
        arrays.append(transfer.put(padded, platform.local_device()))
    arrays += [np.asarray(values_at[s], np.int32) for s in plan.order]
    scalars = tuple(call.dyn[k] for k in call.scalars)
    program_key = (plan_key, tuple(to[s] for s in symbols))
    program = _programs.get(program_key)
    if program is None:
        program = _program(fn, plan, spec, tuple(to[s] for s in int_symbols))
        meta.bounded_put(_programs, program_key, program)
    def run_and_cut(arrays, scalars):  # the executor's checks (Debug's NaNs) see real sizes
        return _unpad(program(arrays, scalars), fn.output[0], plan, values_at, to)

    try:
        out = executor.current().run_program(lowering.op, run_and_cut, (tuple(arrays), scalars))
    except FloatingPointError:
        raise
    except Exception as e:  # a lowering that cannot run padded: the exact path serves it
        _plans[plan_key] = f"{lowering.op}: {type(e).__name__}: {e}"
        return None
    metrics.count("eager_bucketed_calls")
    return out


def _unpad(out, node: fx.Node, plan: dynamic.Plan, values_at: dict, to: dict):
    """The program's result at the real sizes, on the device."""
    def cut(o, val, layout):
        if isinstance(val, torch.SymInt):
            return buckets.real_value(val, values_at)
        if not isinstance(val, torch.Tensor):
            return o
        host = buckets.unpad(o, layout, values_at, to)
        return o if host is o else transfer.put(host, platform.local_device())

    val, layout = node.meta["val"], plan.layouts[node]
    if isinstance(out, (tuple, list)):
        return type(out)(cut(o, v, lay) for o, v, lay in zip(out, val, layout, strict=True))
    return cut(out, val, layout)


def _program(fn: GraphFunction, plan: dynamic.Plan, spec: Spec, int_symbols: tuple):
    def padded(arrays, scalars):
        (out,) = fn.run(list(arrays), (), list(scalars), (), int_symbols, plan)
        return cast_outputs(out, spec.final)

    padded.__name__ = f"{str(fn.steps[0].node.target).replace('.', '_')}_bucketed"
    return jax.jit(padded)


def _symint(env, k: int, hint: int):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    s = env.create_symbol(hint, ConstantSource(f"eager_size_{k}"), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(s, hint=hint)


def _build(lowering: Lowering, spec: Spec, values: list, call: _Call, pattern: tuple,
           real: tuple, sizes: tuple):
    """(GraphFunction, Plan, its symbols, the symbols of its integer placeholders) of the call
    as a one-node graph with symbolic sizes, or why it cannot run padded."""
    # Imported here: importing torchtpu stays free of Dynamo's import cost.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    op = lowering.op
    try:
        env = ShapeEnv()
        syms = [_symint(env, k, n) for k, n in enumerate(real)]
        slot = iter(zip(pattern, sizes))

        def size():
            s, n = next(slot)
            return n if s is None else syms[s]

        graph = fx.Graph()
        with FakeTensorMode(shape_env=env):
            fakes = [torch.empty([size() for _ in range(t.dim())], dtype=t.dtype)
                     for t in call.tensors]
            args, int_symbols = _node_values(graph, spec, values, fakes, call, size)
            oi = schema.info(op)
            pos = [a for a, name in zip(args, oi.names) if name not in oi.kwarg_only]
            kw = {name: a for a, name in zip(args, oi.names) if name in oi.kwarg_only}
            node = graph.call_function(op, tuple(pos), kw)
            node.meta["val"] = op(*fx.node.map_arg(tuple(pos), _val),
                                  **fx.node.map_arg(kw, _val))
        graph.output((node,))
        if env.replacements:
            return f"{op} specializes a size"
        gm = fx.GraphModule(torch.nn.Module(), graph)
        traced = dispatch.traced_arguments(op, lowering)
        plan = dynamic.plan(gm, lambda n: traced)
        if isinstance(plan, str):
            return plan
        symbols = tuple(s.node.expr for s in syms)
        return GraphFunction(gm), plan, symbols, int_symbols
    except Exception as e:  # a meta kernel refusing symbolic sizes: the exact path serves it
        return f"{op}: {type(e).__name__}: {e}"


def _val(n: fx.Node):
    return n.meta["val"]


def _node_values(graph: fx.Graph, spec: Spec, values: list, fakes: list, call: _Call, size):
    """The node's arguments: tensors and varying integers as placeholders, the rest as given;
    and the symbols of the integer placeholders, in order."""
    fake = iter(fakes)
    count = [0]

    def placeholder(val):
        p = graph.placeholder(f"arg{count[0]}")
        count[0] += 1
        p.meta["val"] = val
        return p

    tensor_nodes = []
    for (kind, _), v in zip(call.entries, values):
        if kind == TENSOR:
            tensor_nodes.append(placeholder(next(fake)))
        elif kind == TENSORS:
            tensor_nodes.extend(placeholder(next(fake)) for x in v if x is not None)
    tensor_node = iter(tensor_nodes)
    args, int_symbols = [], []

    def integer(n):
        s = size()
        if isinstance(s, int):
            return n
        int_symbols.append(s.node.expr)
        return placeholder(s)

    for (kind, payload), v in zip(call.entries, values):
        if kind == TENSOR:
            args.append(next(tensor_node))
        elif kind == TENSORS:
            args.append([None if x is None else next(tensor_node) for x in v])
        elif kind == CONST and _is_int(payload):
            args.append(integer(payload))
        elif kind == CONST and _int_tuple(payload):
            args.append([integer(x) for x in payload])
        else:
            args.append(v)
    return args, tuple(int_symbols)
