"""Dynamo's graphs across processes, in PyTorch's own caches, kept in the private cache dir.

AOTAutogradCache keeps, per graph Dynamo hands the backend, what AOTAutograd made of it (the
forward and backward graphs, the runtime wrappers' metadata) and the backend's compiled output,
so a new process that traces the same graph skips AOTAutograd's tracing, functionalization and
partitioning. It caches a custom backend's output only when the backend's compilers are
``SerializableAOTDispatchCompiler`` (torch 2.13: ``torch._functorch._aot_autograd.schemas``)
returning an ``OutputCode`` (``torch._inductor.output_code``) and the entry is *bundled*
(``torch._functorch.config.bundled_autograd_cache``): the output code is pickled inside the
entry. ``TpuOutputCode`` is that output: the graph (through PyTorch's ``GraphPickler``, its
fake-tensor metadata included), its kind and the options; after loading, ``post_compile``
rebuilds the ``CompiledGraph`` from it, whose XLA program is then found in torchtpu's persistent
cache (``cache/compile_cache.py``) as any other.

Dynamo's own tracing (the bytecode analysis, most of a warm first call) is still done, unless
PyTorch's precompile is on (``torch._dynamo.config.caching_precompile``, or
``TORCH_CACHING_PRECOMPILE=1``, and ``torch.compiler.save_cache_artifacts()`` after the
compiles): then Dynamo keeps each compiled function's bytecode and guards, with the bundled
entries above as its backends, and a new process installs them at the function's first call,
tracing nothing. That is PyTorch's experimental switch, with its limits: it drops guards on
object identity (``ID_MATCH`` and the like), and torch 2.13 refuses graphs holding tensors at
static addresses (an optimizer's step: "Graph contains named parameters due to static
addresses") and then fails an assertion, so compile the model's forward and loss, not a
function that steps an optimizer, when it is on.

Where those caches live, and when they are not used: ``torch_caches.py``.

On a torch without these hooks (``SerializableAOTDispatchCompiler``, ``OutputCode``,
``GraphPickler``, the settings ``bundled_autograd_cache`` and
``force_non_lazy_backward_lowering``) nothing is cached, and one warning names what is
missing. Only torch 2.13 was run here.

A graph whose compile is not a plain function of the graph is not cached: one with a
``debug_callback`` (the callback would not see a graph it did not compile), one holding
collectives (``eager_split``: programs over a process group's mesh), and, not yet checked
across processes, one with symbolic sizes (``dynamic=True``: its padding plan keys on the
symbols, which a reloaded graph gets anew). The options are kept in the
entry and a loaded entry whose options differ from the current compile's is refused (PyTorch's
key does not contain them), so that compile traces as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import free_symbols

from torchtpu import metrics
from torchtpu.compile import eager_split, torch_caches
from torchtpu.compile import options as options_mod

try:  # torch's hooks for a backend whose compiled graphs AOTAutogradCache keeps
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import OutputCode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx._graph_pickler import Options as PicklerOptions

    _MISSING = next((f"torch._functorch.config.{name}" for name in (
        "bundled_autograd_cache", "force_non_lazy_backward_lowering")
        if not hasattr(torch._functorch.config, name)), None)
except ImportError as e:  # an older or newer torch
    _MISSING = str(e)
    OutputCode = object
    BypassAOTAutogradCache = Exception

def usable() -> bool:
    """Whether this compile keeps its graphs in AOTAutogradCache."""
    if _MISSING is not None:
        torch_caches.warn_once(f"this torch {torch.__version__} lacks {_MISSING}")
        return False
    return torch_caches.place() and not torch.compiler.config.force_disable_caches


@contextlib.contextmanager
def caching():
    """AOTAutograd's settings for a cached compile: entries bundle the output code, and the
    backward is compiled with the forward (so its entry is saved inside this block)."""
    with torch._functorch.config.patch(bundled_autograd_cache=True,
                                       force_non_lazy_backward_lowering=True):
        yield


# The options of the compile under way, to check a loaded entry against (see TpuOutputCode).
_current = {"options": None}


@contextlib.contextmanager
def compiling(opts: options_mod.Options):
    before = _current["options"]
    _current["options"] = opts
    try:
        yield
    finally:
        _current["options"] = before


class TpuOutputCode(OutputCode):
    """A graph compiled for tpu, as AOTAutogradCache keeps it: built by ``build(kind, opts)``
    (the backend's graph compiler); pickled as the graph's GraphPickler bytes."""

    def __init__(self, build: Callable, gm: torch.fx.GraphModule, kind: str,
                 opts: options_mod.Options) -> None:
        self._boxed_call = True
        self.build, self.gm, self.kind, self.opts = build, gm, kind, opts
        self._serialized: bytes | None = None
        self.compiled = build(kind, opts)(gm, [])

    def __call__(self, inputs: list):
        return self.compiled(inputs)

    def prepare_for_serialization(self) -> None:
        # Called on a shallow copy of the live one: the graph is left as it is.
        if self.opts.debug_callback is not None:
            raise BypassAOTAutogradCache("torchtpu: a graph compiled with a debug_callback")
        if any(eager_split._eager(n) for n in self.gm.graph.nodes):
            raise BypassAOTAutogradCache("torchtpu: a graph holding collectives")
        if any(isinstance(n.meta.get("val"), torch.Tensor | torch.SymInt)
               and free_symbols(n.meta["val"]) for n in self.gm.graph.find_nodes(op="placeholder")):
            raise BypassAOTAutogradCache("torchtpu: a graph with symbolic sizes")
        self._serialized = GraphPickler.dumps(self.gm, PicklerOptions(ops_filter=None))
        self.gm = self.compiled = None

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self.compiled is not None:
            return
        current = _current["options"]
        if current is not None and current != self.opts:
            raise BypassAOTAutogradCache("torchtpu: the entry was compiled with other options")
        from torch._subclasses import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        gm = GraphPickler.loads(self._serialized, FakeTensorMode(shape_env=ShapeEnv()))
        self.gm, self._serialized = gm, None
        self.compiled = self.build(self.kind, self.opts)(gm, [])
        metrics.count("graphs_loaded_from_torch_cache")

    def set_triton_bundle(self, triton_bundle) -> None:
        pass


def compiler(build: Callable, kind: str, opts: options_mod.Options) -> Callable:
    """The backend's compiler for graphs of kind, as AOTAutogradCache caches it."""
    return SerializableAOTDispatchCompiler(
        TpuOutputCode, lambda gm, example_inputs: TpuOutputCode(build, gm, kind, opts))
