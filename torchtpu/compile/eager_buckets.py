"""Eager op calls over growing sizes, run padded to size buckets instead of compiled per size.

An eager loop whose tensors grow (an autoregressive sampler fed its whole context each step)
would compile every op at every new length. A call at sizes that never ran before is looked
at here (a call that did takes one dict lookup and runs as usual, unless its structure varies
at some site): ``call_sites`` finds its *family* (its structure at its call site) and which of
its sizes (tensor dims, integer arguments) vary there, having taken ``VARYING_VALUES`` distinct
values. A call with varying sizes becomes a one-node FX graph whose varying sizes
are symbols (equal sizes, one symbol), and ``dynamic.plan`` decides, exactly as for
``torch.compile(dynamic=True)``, whether it runs padded and what it masks. If so, one program
per bucket runs it with the real sizes as traced inputs (``masking`` through ``GraphFunction``)
and its results stay padded in their storages (``padded_values``): the next bucketed call reads
them in its own program, so a chain of bucketed calls makes no host trip and waits for nothing;
an input that arrives unpadded with a padded dim is padded on the host (``buckets.pad``); one
with nothing padded (a weight) goes in as it is. ``cat`` along the growing dim, which the plan
refuses, is ``padded_cat``'s. A call whose sizes never varied, or that the plan refuses, runs
as before, exact-shape (its padded inputs cut on the host first).

A view whose geometry varies (``logits[:, -1]`` of a growing tensor, whose offset moves) would
make a program per geometry even when the view's own shape does not change: a view of a padded
value is read at a traced start (a program per bucket), so is a box of a parameter (a program
per box size: its shape never grows), any other such view on the host.

On by default (``TORCHTPU_EAGER_BUCKETS=0``, or ``set_enabled(False)``, turns it off). Autograd's
calls keep the exact path: a backward's ops, every layer's, all come from the user's one
``backward()`` line, where their sizes would look varying. Still taken for growth: one line that
serves 4 or more fixed shapes in one step (an ``nn.Sequential`` of 4 widths) runs padded at
every step, exact in values but padded each time.

Debug (which checks each result at its real size) and DeferAndFuse cut every result at once,
a synchronous call (under DeferAndFuse the recordings between cuts made a fused program per
length). Random ops, captures and views the host cannot read by strides (a reinterpreting
dtype) keep the exact path, and so do pointwise results CPU lays out in another order than
row-major (their programs store them in memory order).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import torch
import torch.fx as fx

from torchtpu import metrics
from torchtpu.compile import buckets, call_sites, dynamic, one_node, padded_cat, padded_values
from torchtpu.compile.graph_function import GraphFunction
from torchtpu.compile.one_node import int_tuple as _int_tuple
from torchtpu.compile.one_node import is_int as _is_int
from torchtpu.compile.padded_values import WHOLE
from torchtpu.device import dtypes, ownership, tensors
from torchtpu.device.hooks import AUTOGRAD, HOOKS, STEADY
from torchtpu.eager import calls, executor, meta
from torchtpu.eager.lazy_casts import Cast
from torchtpu.eager.program import CONST, KEY, SCALAR, TENSOR, TENSORS, Spec, cast_outputs
from torchtpu.lowering.registry import Lowering
from torchtpu.runtime import platform, transfer

# Buckets: 64, 128, 256, 512, then multiples of 512 (``buckets.bucket``). Not smaller: a program
# per bucket costs more than the padding (a TPU pads below 128 lanes or 8 rows anyway).
BUCKET_SIZE = 64
NUM_BUCKETS = 4


_exact: dict = {}     # (id of a spec, views) of calls that ran as usual -> (spec, structure)
# (call structure, symbol pattern, fixed sizes) -> (GraphFunction, Plan, ...) or why not
_plans: dict = {}
_programs: dict = {}  # (that key, bucket sizes) -> jitted program
_CAT = torch.ops.aten.cat.default
_abstract: dict = {}  # spec -> its entries with integer constants left out
_grad_enabled = torch.is_grad_enabled


def set_enabled(on: bool) -> None:
    """Route eager calls through ``before`` and ``run`` (and varying views through
    ``read_view``), or not."""
    HOOKS.growing = run if on else None
    # Until a padded value exists no call can read one: every call saves asking (set at the
    # first, by ``run``).
    HOOKS.padded_inputs = before if on and padded_values.made[0] else None
    HOOKS.view_reader = read_view if on else None


def enabled() -> bool:
    return HOOKS.growing is run




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


def run(lowering: Lowering, spec: Spec, values: list, dyn: tuple, views: tuple, writes: bool):
    """The call's results, padded to buckets or with its views read on the host; None (or
    ``STEADY``, ``AUTOGRAD``) when it should run as usual (``HOOKS.growing``). ``writes``: its
    results are written into tensors (an in-place op's), so they must be plain arrays."""
    # ``calls.plan`` gives one spec object per call key (shapes included): a call whose spec
    # and views ran exact before has its program. The value keeps the spec, so its id is not
    # reused while it is a key.
    # Unless its structure grows somewhere: a site must see its own calls to find that it grows
    # too, which it would not if another site (an earlier model's, another block's) had run the
    # same spec exact first.
    # A backward's calls never pad (``_in_backward``): asked first, as every one of them would
    # otherwise hash its views and walk its entries for nothing (~1,600 calls a 12-layer step);
    # answered ``AUTOGRAD``, which a remembered call's next backward calls take without asking.
    if _in_backward():
        return AUTOGRAD
    exact = (id(spec), views)
    ran = _exact.get(exact)
    if ran is not None and not call_sites.grows(ran[1]):
        # So again until a call reaches the families below (``growing_epoch``), the only way
        # ``_exact`` and the growing structures change.
        return STEADY
    if HOOKS.capture is not None:  # a capture's replays could not repeat host padding
        return None
    if spec.order is not None or any(kind == KEY for kind, _ in spec.entries):
        # Keys: random draws; an order: a result stored in memory order (``program.finished``),
        # which a padded program's is not. Facts of the spec: its calls are answered so until
        # the epoch moves (the rotary halves' negations, products and sums, 72 calls a
        # 12-layer Llama step, asked every step when answered None).
        return STEADY
    if any(type(how) is Cast for _, _, how in views):
        # A lazy cast's source is no value of the tensor: read the tensors computed.
        dyn, views = calls.dynamic_values([None, *values] if lowering.random else values,
                                             spec.entries, fold=False)
    call = _Call(lowering, spec, values, dyn)
    structure = _structure(lowering, spec, call)
    try:
        out = _route(lowering, spec, values, call, structure, tuple(g for _, _, g in views),
                     bool(views), writes, ran is not None)
        if out is None:
            meta.bounded_put(_exact, exact, (spec, structure))
        elif padded_values.made[0] and HOOKS.padded_inputs is None:
            HOOKS.padded_inputs = before
    finally:
        # After the change (a family noted, growing or not; this call remembered): a steady
        # answer given before it is asked for again (``HOOKS.growing``).
        HOOKS.growing_epoch += 1
    return out


def before(lowering: Lowering, spec: Spec, values: list, writes: bool = False):
    """The results of a call that reads a storage holding a ``Padded`` value, run on the padded
    arrays; None to run it as usual, which cuts them (``HOOKS.padded_inputs``)."""
    if not padded_values.made[0] or not any(padded_values.held(t) is not None
                                            for t in _tensors_of(values)):
        return None
    if writes or HOOKS.capture is not None or any(kind == KEY for kind, _ in spec.entries) \
            or _in_backward() or spec.order is not None:
        return None
    dyn = []
    for (kind, _), v in zip(spec.entries, values):
        if kind == TENSORS:
            dyn.extend(None for x in v if x is not None)
        elif kind in (TENSOR, SCALAR):
            dyn.append(None if kind == TENSOR else v)
    call = _Call(lowering, spec, values, tuple(dyn))
    return _route(lowering, spec, values, call, _structure(lowering, spec, call), ("padded",),
                  True, writes)


def _tensors_of(values: list):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))



def _structure(lowering: Lowering, spec: Spec, call: _Call) -> tuple:
    return (lowering, _abstract_entries(spec), tuple((t.dtype, t.dim()) for t in call.tensors))


def _route(lowering: Lowering, spec: Spec, values: list, call: _Call, structure: tuple,
           geometries: tuple, views: bool, writes: bool, ran: bool = False):
    """The call's results padded, its views read whole, or None to run it exact. ``ran``: its
    spec and views ran exact before (at this site or another)."""
    sizes = tuple(n for t in call.tensors for n in t.shape) + tuple(x for _, _, x in call.ints)
    family = call_sites.family(structure, sizes, geometries)  # (noted also where it runs exact)
    # A call autograd records whose exact program ran before runs it again: a training step
    # at its one length, after a sampler grew its sites between steps, keeps its programs
    # (padded, DeferAndFuse would cut each of its calls: 27 programs a TinyGPT step instead of
    # 1); its backward runs exact whatever its forward does. Calls without grad (a sampler's
    # chain of padded values) keep the buckets.
    if family is None or not call.supported or ran and _grad_enabled():
        return None
    # Debug checks each result at its real size; under DeferAndFuse the recordings between the
    # cuts of padded values made a fused program per length (8 in 6 lengths): both cut at once.
    keep = not writes and HOOKS.deferrer is None and executor.current().name != "debug"
    if any(family.varying):
        if lowering.op is _CAT:
            return padded_cat.run(lowering.op, _programs, spec, values, call.tensors,
                                  family.varying, _bucket, _prepare, keep)
        return _padded(structure, family, lowering, spec, values, call, sizes, keep)
    if family.views and views:
        return _views(lowering, spec, call, family)
    return None


def _in_backward() -> bool:
    """Whether autograd's engine runs the call: a backward's calls, every layer's, all come from
    the one user line that called ``backward()``, so their sizes would look varying there."""
    return torch._C._current_graph_task_id() != -1


def _bucket(n: int) -> int:
    return buckets.bucket(n, BUCKET_SIZE, NUM_BUCKETS)


def _host_value(t: torch.Tensor, array) -> np.ndarray | None:
    """t's value as a host array, from what ``tensors.read_parts`` gave (None: not that way)."""
    if t.is_conj() or t.is_neg():  # read_parts gave t's value itself
        return transfer.fetch(array)
    return _strided(t, array)


def _strided(t: torch.Tensor, array) -> np.ndarray | None:
    """t's stored values (before a lazy conj or negation) as a host array, read from its
    storage array by strides; None for a view that reinterprets the storage's dtype."""
    host = transfer.fetch(array)  # (the whole storage crosses: its bytes counted)
    if host.dtype != dtypes.to_jax(t.dtype) or t.dtype is torch.complex32:
        return None  # checked first: a reinterpreting view may have its storage's shape
    if tuple(host.shape) == tuple(t.shape) and t.is_contiguous() and t.storage_offset() == 0:
        return host
    flat = host.reshape(-1)
    # as_strided goes through the array interface, whose type strings cannot name ml_dtypes'
    # types (float8's '<f1' is refused): stride unsigned ints of the same width instead.
    bits = flat.view(f"u{flat.itemsize}") if flat.dtype.isbuiltin != 1 else flat
    view = np.lib.stride_tricks.as_strided(
        bits[t.storage_offset():], tuple(t.shape), tuple(s * flat.itemsize for s in t.stride()))
    return np.array(view, order="C").view(flat.dtype)  # ascontiguousarray makes 0-d 1-d


_view_families: dict = {}  # (kind of view, call site) -> [geometries, whether they vary]
_exact_views: dict = {}    # geometries read by their own program


def read_view(t: torch.Tensor, array, g) -> jax.Array | None:
    """A view read on the host once views of its kind (ranks and dtypes of it and its storage)
    have been read at another geometry; None: read it as usual (``HOOKS.view_reader``)."""
    if HOOKS.capture is not None or _in_backward():
        return None
    if g in _exact_views:
        return None
    key = (len(g.array_shape), g.array_dtype, len(g.size), g.dtype, call_sites.site())
    family = _view_families.get(key)
    if family is None:
        meta.bounded_put(_view_families, key, [{g}, False])
    elif not family[1]:
        family[0].add(g)
        family[1] = len(family[0]) >= call_sites.VARYING_VALUES
    host = _strided(t, array) if family is not None and family[1] else None
    if host is None:
        meta.bounded_put(_exact_views, g, None)
        return None
    metrics.count("eager_host_views")
    return transfer.put(host, platform.local_device())


def _views(lowering: Lowering, spec: Spec, call: _Call, family: call_sites.Family):
    """The call run on its tensors read whole, so that one program serves every geometry: a
    view of a padded value through its traced-start windows (a program per bucket), a box of a
    parameter likewise (a program per box size: TRL's vocabulary chunks of a 545 MB head weight
    were each read whole on the host), a view whose geometry never varied at the site by its
    own program (TRL's ``hidden[token_start:token_end]``, beside a weight's moving chunk), any
    other view on the host."""
    dyn = list(call.dyn)
    host = False
    for t, k in zip(call.tensors, call.at):
        p = padded_values.held(t)
        if p is not None:
            got = padded_values.source(t, p)
            if got is None or got[2] != tuple(t.shape):
                return None
            src, starts, _ = got
            dyn[k] = p.array if src is WHOLE else padded_values.read_now(p.array, starts, src)
            continue
        read, g = tensors.read_parts(t)
        array = read if dyn[k] is None else dyn[k]  # (None: called before they were read)
        if g is None:  # the storage's array whole: it goes in as it is
            dyn[k] = array
            continue
        if all(g in seen for seen in family.geometries):
            # Another tensor's views vary here, not this one's: read as the exact path reads
            # it (the program of its one geometry), not on the host at every call.
            dyn[k] = tensors.read(t)
            metrics.count("eager_fixed_views")
            continue
        # A parameter's chunks: read at a traced start on the device, one program for every
        # offset. Not any other storage's: a growing one (a sampler's context) would make a
        # program per length, where the host read makes none.
        got = padded_values.window(g) if isinstance(t._base, torch.nn.Parameter) \
            and tuple(array.shape) == tuple(g.array_shape) else None
        if got is not None:
            dyn[k] = padded_values.read_now(array, got[1], got[0])
            metrics.count("eager_window_views")
            continue
        value = _host_value(t, array)
        if value is None:
            return None
        dyn[k] = transfer.put(value, platform.local_device())
        host = True
    metrics.count("eager_host_views" if host else "eager_padded_reads")
    return executor.current().run(lowering, spec, tuple(dyn))


def _prepare(t: torch.Tensor, want: tuple, pad_host):
    """(array, Source, window starts) that give tensor t at the padded shape ``want`` inside a
    program: a padded value read in place, a real one as it is (its view read in the program)
    when nothing of it is padded, else padded on the host by ``pad_host``; None: not so."""
    p = padded_values.held(t)
    if p is not None:
        got = padded_values.source(t, p)
        if got is None or got[2] != want:
            return None
        return p.array, got[0], got[1]
    array, g = tensors.read_parts(t)
    if tuple(t.shape) == want:
        return array, (WHOLE if g is None else padded_values.Source((), (), g)), ()
    host = _host_value(t, array)
    if host is None:
        return None
    return transfer.put(pad_host(host), platform.local_device()), WHOLE, ()


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


def _padded(structure: tuple, family: call_sites.Family, lowering: Lowering, spec: Spec,
            values: list, call: _Call, sizes: tuple, keep: bool):
    found = _symbols(family.varying, sizes)
    if found is None:
        return None
    pattern, real = found
    # The plan holds the sizes that do not vary: they are part of what it was built for.
    plan_key = (structure, pattern, tuple(n for s, n in zip(pattern, sizes) if s is None))
    built = _plans.get(plan_key)
    if built is None:
        built = one_node.build(lowering, spec, values, call, pattern, real, sizes)
        meta.bounded_put(_plans, plan_key, built)
    if isinstance(built, str):
        return None
    fn, plan, symbols, int_symbols = built
    values_at = dict(zip(symbols, real))
    to = {s: _bucket(n) for s, n in values_at.items()}
    arrays, sources, starts = [], [], []
    for t, node in zip(call.tensors, fn.placeholders):
        layout = plan.layouts[node]
        want = tuple(math.prod(to.get(f, f) for f in dim) for dim in layout)
        got = _prepare(t, want, lambda host, lay=layout: buckets.pad(host, lay, values_at, to))
        if got is None:
            return None
        arrays.append(got[0])
        sources.append(got[1])
        starts.append(got[2])
    sizes_in = tuple(np.asarray(values_at[s], np.int32) for s in plan.order)
    scalars = tuple(call.dyn[k] for k in call.scalars)
    program_key = (plan_key, tuple(to[s] for s in symbols), tuple(sources))
    program = _programs.get(program_key)
    if program is None:
        program = _program(fn, plan, spec, tuple(to[s] for s in int_symbols), tuple(sources))
        meta.bounded_put(_programs, program_key, program)
    args = (tuple(arrays), tuple(starts), sizes_in, scalars)
    node = fn.output[0]
    try:
        if keep:
            out = padded_values.run(program, args, lowering.op, executor.current())
            out = _kept(out, node, plan, values_at, to, arrays)
        else:
            def run_and_cut(*args):  # the executor's checks (Debug's NaNs) see real sizes
                return _unpad(program(*args), node, plan, values_at, to)

            args = (tuple(_computed(a) for a in arrays),) + args[1:]
            out = executor.current().run_program(lowering.op, run_and_cut, args)
    except FloatingPointError:
        raise
    except Exception as e:  # a lowering that cannot run padded: the exact path serves it
        _plans[plan_key] = f"{lowering.op}: {type(e).__name__}: {e}"
        return None
    metrics.count("eager_bucketed_calls")
    return out


def _computed(array):
    """array, or the computed array of a value DeferAndFuse holds pending (run now)."""
    return array.materialize() if isinstance(array, ownership.Deferred) else array


def _sizes(layout: tuple, values: dict) -> tuple:
    return tuple(tuple(int(values.get(f, f)) for f in dim) for dim in layout)


def _kept(out, node: fx.Node, plan: dynamic.Plan, values_at: dict, to: dict, inputs: list):
    """The program's results as storages hold them: padded values, real where nothing is."""
    def keep(o, val, layout):
        if isinstance(val, torch.SymInt):
            return buckets.real_value(val, values_at)
        if not isinstance(val, torch.Tensor):
            return o
        if any(o is a for a in inputs):  # a program may hand an input back
            o = tensors.fresh_copy(o)
        return padded_values.wrap_output(o, _sizes(layout, values_at), _sizes(layout, to))

    val, layout = node.meta["val"], plan.layouts[node]
    if isinstance(out, (tuple, list)):
        return type(out)(keep(o, v, lay) for o, v, lay in zip(out, val, layout, strict=True))
    return keep(out, val, layout)


def _unpad(out, node: fx.Node, plan: dynamic.Plan, values_at: dict, to: dict):
    """The program's result at the real sizes, on the device."""
    def cut(o, val, layout):
        if isinstance(val, torch.SymInt):
            return buckets.real_value(val, values_at)
        if not isinstance(val, torch.Tensor):
            return o
        host = buckets.unpad(o, layout, values_at, to)
        if host is o:
            return o
        metrics.count("eager_host_cuts")
        return transfer.put(host, platform.local_device())

    val, layout = node.meta["val"], plan.layouts[node]
    if isinstance(out, (tuple, list)):
        return type(out)(cut(o, v, lay) for o, v, lay in zip(out, val, layout, strict=True))
    return cut(out, val, layout)


def _program(fn: GraphFunction, plan: dynamic.Plan, spec: Spec, int_symbols: tuple,
             sources: tuple):
    def padded(arrays, starts, sizes, scalars):
        xs = [padded_values.read(a, s, src) for a, s, src in zip(arrays, starts, sources)]
        (out,) = fn.run(xs + list(sizes), (), list(scalars), (), int_symbols, plan)
        return cast_outputs(out, spec.final)

    padded.__name__ = f"{str(fn.steps[0].node.target).replace('.', '_')}_bucketed"
    return jax.jit(padded)
