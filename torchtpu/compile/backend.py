"""The Dynamo backend "tpu": AOTAutograd graphs, each run as one cached XLA program.

Dynamo captures a graph; AOTAutograd functionalizes it, applies the decompositions eager would
apply (an op with a lowering stays whole, as in eager), and splits forward from backward. Each
graph becomes a ``CompiledGraph``: tpu tensors are read as arrays, the ``interpret`` function of
the graph runs under ``jax.jit``, and results are wrapped as new tpu tensors.

Inputs the graph mutates are kept in the graph (``keep_inference_input_mutations``): their new
values are extra outputs that the caller stores into the input storages. A mutated input whose
old array nothing else can see again (the whole array of its storage, passed once, held by no one
but that storage) is donated to the program, so XLA updates it in place and an optimizer step
does not hold two copies of the model state.

An op that donates arguments (``jax_op(..., donate_argnums=...)``) given a graph input directly
gets that input's buffer as eager would give it, and the input is consumed (``donation.py``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable

import jax
import numpy as np
import torch
import torch.fx as fx
from torch._decomp import core_aten_decompositions, decomposition_table
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from torchtpu import metrics
from torchtpu.compile import (
    buckets,
    checkpoint,
    donation,
    dynamic,
    eager_split,
    graph_cache,
    graph_constants,
    host_cones,
    reduce_overhead,
)
from torchtpu.compile import options as options_mod
from torchtpu.compile.graph_function import GraphFunction
from torchtpu.device import asserts, dtypes, kernels, launch, ownership, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.device.random import key_data_for
from torchtpu.eager import at_call, executor, meta, schema
from torchtpu.eager import capture as capture_mod
from torchtpu.eager.spmd import Spmd
from torchtpu.lowering.registry import GRAPH_FORMS, lookup
from torchtpu.runtime import transfer

log = logging.getLogger("torchtpu.compile")

# A compile slower than this is reported at INFO.
SLOW_COMPILE_SECONDS = 1.0

# Numbers the process's graphs, to tell them apart in profiles (``compiled_<kind>_<n>``); the XLA
# module is ``compiled_<kind>`` alone, so the persistent cache does not depend on the numbering.
_graph_numbers = itertools.count()


def _lowered(op) -> bool:
    functional = schema.functional_of(op) if isinstance(op, torch._ops.OpOverload) else None
    return lookup(op) is not None or (functional is not None and lookup(functional) is not None)


def _prims_as_aten() -> dict:
    """Each prim as its ATen implementation, the kernel eager runs when a ref calls a prim."""
    import torch._prims  # noqa: F401 (defines the prims)

    key = torch._C.DispatchKey.CompositeExplicitAutograd
    table = {}
    for name in torch._prims.__all__:
        packet = getattr(torch.ops.prims, name, None)
        op = getattr(packet, "default", None)
        if isinstance(op, torch._ops.OpOverload) and \
                torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
            table[op] = functools.partial(op._op_dk, key)
    return table


@functools.cache  # building it walks PyTorch's whole table (~0.1-0.5 s); every graph uses it
def decompositions() -> dict:
    """What AOTAutograd decomposes: ops without a lowering, as eager decomposes them.

    ``torch._refs`` decompositions call prims; those are decomposed in turn into the ATen ops
    eager runs for them, so a graph holds ATen ops only. Graph forms of device kernels (views)
    are kept whole.
    """
    table = {**decomposition_table, **dict(core_aten_decompositions().items())}
    table = {op: fn for op, fn in table.items() if not _lowered(op) and op not in GRAPH_FORMS}
    return {**table, **_prims_as_aten()}


def _meta(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _opaque(value) -> bool:
    """Whether a graph value is an object rather than a tensor or a number (a DeviceMesh)."""
    return value is not None and not isinstance(
        value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _describe(arrays) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in arrays)


def _computed(array):
    """array, or the array of a value DeferAndFuse holds pending (flushing the recording): a
    program takes arrays only, and JAX no longer converts other objects at its inputs."""
    if isinstance(array, ownership.Deferred):
        return array.__jax_array__()
    return array


def _unshared(array, owned: set):
    """array, or a copy of it if a storage already holds it; then counted as held."""
    if id(array) in owned:
        array = tensors.fresh_copy(array)
    owned.add(id(array))
    return array


def _split(arrays: list, donate: tuple) -> tuple[tuple, tuple]:
    """(the donated arrays, the others), each in input order."""
    if not donate:
        return (), tuple(arrays)
    chosen = set(donate)
    return (tuple(arrays[k] for k in donate),
            tuple(a for k, a in enumerate(arrays) if k not in chosen))


def _merging(run: Callable, donate: tuple, forwarded: frozenset) -> Callable:
    """run, taking its arrays as (donated, kept): the donated ones form one argument that
    ``jax.jit`` donates as a whole; without the outputs the caller forwards from its inputs."""

    def program(donated, kept, constants, scalars, keys):
        arrays = list(kept)
        for k, a in zip(donate, donated, strict=True):  # ascending positions
            arrays.insert(k, a)
        outs = run(arrays, constants, scalars, keys)
        return [o for k, o in enumerate(outs) if k not in forwarded]

    return program


def _write_back(mutated: list, new_values: list) -> None:
    """Each mutated input takes its new value (an optimizer's parameters and state)."""
    for t, value in zip(mutated, new_values, strict=True):
        if isinstance(value, torch.Tensor):  # computed on the host (see compile/host_cones.py)
            t.copy_(value)
        elif t.is_cpu:  # a CPU scalar input the program computed: reading it waits for it
            t.copy_(kernels.numpy_to_torch(np.array(value), t.dtype))
        else:
            tensors.write(t, value)


class CompiledGraph:
    """One AOTAutograd graph: reads inputs, runs the cached XLA program, wraps outputs."""

    def __init__(self, gm: fx.GraphModule, kind: str, opts: options_mod.Options,
                 spmd: Spmd | None = None) -> None:
        # AOTAutograd hands a list we may clear, freeing inputs early. An instance attribute,
        # since wrappers (functools.wraps) copy __dict__ only.
        self._boxed_call = True
        self.gm = gm
        self.kind = kind
        self.opts = opts
        # Its collectives inside: one SPMD program over their group's mesh (compile/spmd.py).
        self.spmd = spmd
        self.name = f"compiled_{kind}_{next(_graph_numbers)}"
        self.fn = GraphFunction(gm)
        self.out_dtypes = [
            n.meta["val"].dtype if isinstance(n, fx.Node) and isinstance(
                n.meta.get("val"), torch.Tensor) else None
            for n in self.fn.output
        ]
        self.size_outputs = [isinstance(_meta(n), torch.SymInt) for n in self.fn.output]
        self.programs: dict = {}
        self.runners: dict = {}  # an SPMD program -> its call on this rank's arrays
        self.constants = graph_constants.Constants(gm, self.fn.constants)
        self._recordable: dict = {}  # symbol values -> the jitted graph a capture records
        traced = {step.node: getattr(step, "traced", frozenset()) for step in self.fn.steps}
        self.plan = dynamic.plan(gm, lambda n: traced.get(n, frozenset()))
        problem = self.plan if isinstance(self.plan, str) else None
        self.padded = problem is None
        # Each symbol's size at the first call, and the symbols seen at another size since.
        self.first_sizes: dict = {}
        self.varying: set = set()
        self.exact_dynamic = problem not in (None, dynamic.NO_SYMBOLS)
        if self.exact_dynamic:
            log.info("torchtpu.compile: %s graph with symbolic sizes compiles per exact shape: %s",
                     kind, problem)
        self.tensor_nodes = [n for n, t in zip(self.fn.placeholders, self.fn.tensor_inputs,
                                               strict=True) if t]
        # Outputs that are unmutated tpu inputs (a forward graph's parameters and token ids
        # saved for backward): the caller hands back the input tensor itself, as Inductor
        # does, where the program would copy it. So are inputs that are no values at all (a
        # DTensor's DeviceMesh, an opaque object saved for backward), which no program returns.
        mutated_inputs = {i for i, _ in self.fn.mutations}
        self.forwarded = {} if self.padded else {
            k: self.fn.placeholders.index(n) for k, n in enumerate(self.fn.output)
            if isinstance(n, fx.Node) and n.op == "placeholder"
            and (_opaque(_meta(n)) or isinstance(_meta(n), torch.Tensor)
                 and _meta(n).device.type == "tpu"
                 and self.fn.placeholders.index(n) not in mutated_inputs)}
        self.host_cones = host_cones.of(self.fn)
        self.cpu_placeholders = [(k, n) for k, n in enumerate(self.fn.placeholders)
                                 if self.host_cones and host_cones.on_cpu(n)]
        self.moved_in = host_cones.moved_in(self.fn)
        # (position among the tensor inputs, position among all inputs) of each mutated input.
        self.mutated_at = [(sum(self.fn.tensor_inputs[:i]), i) for i, _ in self.fn.mutations
                           if self.fn.tensor_inputs[i]]
        self.donating = donation.donating_inputs(
            self.fn, mutated_inputs | set(self.forwarded.values()))
        self.output_kinds = donation.output_kinds(self.fn, self.forwarded)

    def _read(self, args: list, capturing: bool = False) -> tuple[list, list]:
        arrays, symbols = [], []
        # (A capture would keep a CPU tensor's value of the capture: refused there.)
        moved = {id(args[k]) for k in self.moved_in} if self.moved_in and not capturing else ()
        for a, is_tensor in zip(args, self.fn.tensor_inputs, strict=True):
            if not is_tensor:
                symbols.append(int(a) if isinstance(a, torch.SymInt) else a)
            elif a.is_cpu:
                if id(a) in moved:  # the graph's own .to("tpu") of it
                    arrays.append(kernels.sent(a))
                    continue
                if a.dim() != 0:
                    raise meta.device_error(a)
                # A NumPy scalar: jit transfers it in its fast path (jnp.asarray is ~15x slower).
                arrays.append(np.asarray(a.item(), dtypes.to_jax(a.dtype)))
            else:
                # read_parts first: its short path serves an input that is its storage's whole
                # computed array (most inputs: parameters, activations), without read's steps.
                # Only a storage of another device lacks the array attribute it reads (asking
                # the device first costs a third of a read).
                try:
                    array, geometry = tensors.read_parts(a)
                except AttributeError:
                    if a.device.type != "tpu":
                        raise meta.device_error(a) from None
                    raise
                if geometry is not None:
                    array = tensors.read(a)
                # Inside a capture an input may be a value the capture has not computed: kept
                # as it is; else a value DeferAndFuse holds pending is computed now.
                if not capturing and isinstance(array, ownership.Deferred):
                    array = array.__jax_array__()
                arrays.append(array)
        return arrays, symbols

    def _recorded(self, call: tuple, symbols: list) -> list:
        """The program's outputs as values of the graph capture in progress (``torch.tpu.graph``,
        a whole-step ``torch.compile``): the graph's function is recorded into the capture like
        an eager op, so the captured step's one program holds it (a TorchTitan model compiled
        per block, whose blocks run inside a captured FSDP2 step). Its jitted form, one per
        symbol values, is the recorded function: the same object at every capture, so that
        recording it again infers no shapes again."""
        if self.spmd is not None or self.padded:
            raise capture_mod.CaptureError(
                f"torchtpu.capture: a compiled {self.kind} graph "
                f"{'holding collectives' if self.spmd is not None else 'with dynamic sizes'} "
                f"inside a graph capture, {executor.user_location()}: a capture records a "
                "compiled graph only when it has static sizes and no collectives (a compiled "
                "FSDP2 block's are outside it); compile without dynamic=True, or run it outside "
                "the capture")
        fn = self._recordable.get(tuple(symbols))
        if fn is None:
            run = functools.partial(self.fn.run, symbols=tuple(symbols), plan=None)
            fn = self._recordable[tuple(symbols)] = jax.jit(
                _merging(run, (), frozenset(self.forwarded)))
        return list(HOOKS.capture.recording.record(fn, call))

    def _program(self, arrays, call: tuple, symbols, donate: tuple):
        # Donating other inputs is another program: XLA aliases them to outputs.
        # An array's aval holds its shape and dtype without the properties' Python steps.
        sig = (tuple([(v.shape, v.dtype) for v in [getattr(a, "aval", a) for a in arrays]]),
               tuple(symbols), donate)
        program = self.programs.get(sig)
        if program is None:
            program = self._compile(arrays, call, tuple(symbols), donate)
            self.programs[sig] = program
        return program

    def _compile(self, arrays, call: tuple, symbols, donate: tuple):
        start = time.perf_counter()
        run = functools.partial(self.fn.run, symbols=symbols,
                                plan=self.plan if self.padded else None)
        merged = _merging(run, donate, frozenset(self.forwarded))
        if self.spmd is not None:
            merged, self.scalar_outputs = self.spmd.body(merged, call)
            call = self.spmd.to_global(call)
        merged.__name__ = f"compiled_{self.kind}"
        jitted = jax.jit(merged, donate_argnums=0)
        lowered = jitted.lower(*call)
        if self.opts.debug_callback is not None:
            self.opts.debug_callback(self.gm, lowered.as_text())
        program = lowered.compile() if self.spmd is None else self.spmd.compile(lowered)
        seconds = time.perf_counter() - start
        metrics.count("compiled_graphs")
        if self.exact_dynamic:
            metrics.count("dynamic_exact_shape_compiles")
        if seconds > SLOW_COMPILE_SECONDS:
            log.info("torchtpu.compile: %s graph of %d nodes (inputs %s) compiled in %.1f s",
                     self.kind, len(self.gm.graph.nodes), _describe(arrays), seconds)
        return program

    def _buckets(self, values: dict) -> dict:
        """Each symbol's padded size: its bucket once it has varied between calls, else its
        size. Under ``dynamic=True`` every dim is a symbol, the batch too; padding a dim that
        never changes (a batch of 8 to 128 rows) would only multiply the work."""
        return {s: buckets.bucket(v, self.opts.bucket_size, self.opts.num_dynamic_buckets)
                if s in self.varying else v for s, v in values.items()}

    def _note_sizes(self, values: dict) -> None:
        for s, v in values.items():
            if self.first_sizes.setdefault(s, v) != v:
                self.varying.add(s)

    def _pad(self, args: list, arrays: list, symbols: list) -> tuple[list, list, dict]:
        """Inputs laid out at their size buckets, then the real size of each symbol (int32
        scalars the program reads); symbols at bucket values; the real sizes."""
        values = buckets.sizes_of(self.fn.placeholders, args)
        self._note_sizes(values)
        to = self._buckets(values)
        padded = []
        for a, n in zip(arrays, self.tensor_nodes, strict=True):
            host = buckets.pad(a, self.plan.layouts[n], values, to)
            padded.append(a if host is a else transfer.put(host, next(iter(a.devices()))))
        padded += [np.asarray(values[s], np.int32) for s in self.plan.order]
        syms = [n.meta["val"] for n, t in
                zip(self.fn.placeholders, self.fn.tensor_inputs, strict=True) if not t]
        symbols = [buckets.evaluate(s, to) if isinstance(s, torch.SymInt) else v
                   for s, v in zip(syms, symbols, strict=True)]
        return padded, symbols, values

    def _unpad(self, outs: list, values: dict) -> list:
        real, to = [], self._buckets(values)
        for o, n in zip(outs, self.fn.output, strict=True):
            val = n.meta.get("val") if isinstance(n, fx.Node) else None
            if isinstance(val, torch.Tensor):
                host = buckets.unpad(o, self.plan.layouts[n], values, to)
                if host is not o:
                    o = transfer.put(host, next(iter(o.devices())))
            elif isinstance(val, torch.SymInt):
                o = buckets.real_value(val, values)
            real.append(o)
        return real

    def _hand_over_checks(self, outs: list) -> list:
        """The program's outputs without its trailing check flags, which go to the asserts
        raised at the next host read (none inside a capture, whose replays could not)."""
        n = len(self.fn.check_errors)
        outs, flags = outs[:-n], outs[-n:]
        if HOOKS.capture is None:
            where = executor.user_location()
            for flag, (op, error) in zip(flags, self.fn.check_errors, strict=True):
                asserts.add(flag, functools.partial(at_call.check_error, op, error), where)
        return outs

    def _launched(self, arrays: list, call: tuple, symbols: list, donate: tuple) -> list:
        program = self._program(arrays, call, symbols, donate)
        if donate:
            metrics.count("compiled_donated_inputs", len(donate))
        if self.spmd is not None:
            run = self.runners.get(id(program))  # programs are kept in self.programs
            if run is None:
                run = self.runners[id(program)] = self.spmd.runner(program)
            return launch.run(self.name, run, (call, self.scalar_outputs))
        return launch.run(self.name, program, call)

    def __call__(self, args: list) -> list:
        # Every call of every graph comes here: steps a graph does not need are skipped whole.
        fn = self.fn
        mutated = [args[i] for i, _ in fn.mutations] if fn.mutations else None
        forwarded = {k: args[i] for k, i in self.forwarded.items()} if self.forwarded else None
        on_host = {}
        if self.host_cones:
            env = {n: args[k] for k, n in self.cpu_placeholders}
            on_host = {k: host_cones.value(node, env) for k, node in self.host_cones.items()}
        capturing = HOOKS.capture is not None
        arrays, symbols = self._read(args, capturing)
        values = None
        donate = ()
        if capturing:
            pass  # nothing is donated: the capture's program donates what its storages hold
        elif self.padded:
            # Padded inputs may be copies at bucket sizes: nothing is donated.
            arrays, symbols, values = self._pad(args, arrays, symbols)
        elif self.mutated_at and self.spmd is None:
            donate = donation.mutated(arrays, self.mutated_at, args)
        consumed = ()
        if self.donating and self.spmd is None and not capturing:  # SPMD programs: not yet
            taken, consumed = donation.taken(arrays, self.donating, args, self.output_kinds)
            donate = tuple(sorted(set(donate) | set(taken)))
        args.clear()
        constants = self.constants.read(capturing) if fn.constants else ()
        keys = tuple([key_data_for(None) for _ in fn.key_nodes]) if fn.key_nodes else ()
        call = (*_split(arrays, donate), constants, tuple(fn.scalars), keys)
        if capturing:
            outs = self._recorded(call, symbols)
        else:
            outs = self._launched(arrays, call, symbols, donate)
        for t, by in consumed:
            ownership.consume(t, by)
        if fn.check_errors:
            outs = self._hand_over_checks(outs)
        # Every array a storage holds or is about to hold: a program may hand an input back, or
        # one array twice, and storages never share one. (A constant, never donated, comes
        # back as a new buffer: ``graph_constants`` may keep what it read.)
        owned = set(map(id, arrays))
        if mutated:
            split = len(outs) - len(mutated)
            outs, new_values = outs[:split], outs[split:]
            _write_back(mutated, [on_host[k] if k in on_host else _unshared(v, owned)
                                  for k, v in enumerate(new_values)])
        if values is not None:
            outs = self._unpad(outs, values)
        if forwarded:
            outs = list(outs)
            for k in sorted(forwarded):
                outs.insert(k, forwarded[k])
        wrapped = []
        for k, (o, dtype, size) in enumerate(zip(outs, self.out_dtypes, self.size_outputs,
                                                 strict=True)):
            if forwarded and k in forwarded:  # the input tensor itself
                wrapped.append(o)
            elif dtype is not None:
                wrapped.append(tensors.wrap(_unshared(o, owned), dtype))
            elif size and not isinstance(o, int):
                # jax.jit returns a size output (a SymInt saved for backward) as an array;
                # AOTAutograd wants a number.
                wrapped.append(int(o))
            else:
                wrapped.append(o)
        return wrapped


def _check_dtypes(gm: fx.GraphModule) -> None:
    """A graph value of a dtype the platform cannot hold is refused here, naming its node: inputs
    of such dtypes cannot exist on the device, but a graph can make one (``x * 1j`` of float64)."""
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype is torch.complex128:
            dtypes.check_platform(val.dtype, f" (graph node {n.name}: {n.format_node()})")


def _graph_compiler(kind: str, opts: options_mod.Options) -> Callable:
    def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Callable:
        _check_dtypes(gm)
        if kind == "backward":  # activation checkpointing's regions, recomputed in time
            gm = checkpoint.schedule_recomputation(gm)
        pieces = eager_split.split(
            gm, lambda piece, spmd=None: CompiledGraph(piece, kind, opts, spmd))
        return pieces if pieces is not None else CompiledGraph(gm, kind, opts)

    return compile_graph


def tpu_backend(gm: fx.GraphModule, example_inputs: list, mode: str | None = None,
                options: dict | None = None) -> Callable:
    """``torch.compile(model, backend="tpu", options={...})``."""
    opts = options_mod.parse(mode, options)
    if mode == "reduce-overhead":
        graphed = reduce_overhead.graphed(gm, example_inputs)
        if graphed is not None:
            return graphed
    cached = graph_cache.usable()  # kept across processes by AOTAutogradCache (graph_cache.py)
    compilers = {kind: graph_cache.compiler(_graph_compiler, kind, opts) if cached
                 else _graph_compiler(kind, opts) for kind in ("forward", "backward", "inference")}
    # recompute_views: a view the backward reads is taken again there from its base, which
    # the forward hands back without a copy, instead of the program returning the view as
    # a copy (Inductor's outputs alias; ours are new buffers: a saved ``w.t()`` would copy w).
    # ban_recompute_materialized_backward off: the min cut may recompute a value whose backward
    # reader is a product (Inductor must write a product's operand to memory; XLA fuses a cast
    # into the product that reads it). Under autocast the forward no longer writes each
    # weight's bf16 cast for backward (the parameter is saved for free and cast again inside
    # the backward's products): a 2-block Llama at 8 x 1024 tokens, v5e cost model, forward +
    # backward 45.6 -> 40.8 ms (bench/RESULTS.md, model4).
    with graph_cache.compiling(opts), \
            torch._functorch.config.patch(recompute_views=True,
                                          ban_recompute_materialized_backward=False), \
            graph_cache.caching() if cached else contextlib.nullcontext():
        return aot_autograd(
            fw_compiler=compilers["forward"],
            bw_compiler=compilers["backward"],
            inference_compiler=compilers["inference"],
            decompositions=decompositions(),
            # Mutated inputs (an optimizer's parameters and state) are written by the compiled
            # graph's caller in one pass, instead of one copy_ dispatch each.
            keep_inference_input_mutations=True,
            # What the forward saves for backward: AOTAutograd's default saves every value
            # backward reads (a Llama's f32 norm outputs beside their bf16 casts, the f32
            # log-softmax twice: 1.6x the bytes eager PyTorch saves); the min cut recomputes
            # cheap elementwise work in backward and saves less than eager does.
            partition_fn=min_cut_rematerialization_partition,
        )(gm, example_inputs)

