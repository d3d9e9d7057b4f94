"""``torch.compile(step, backend="tpu")`` of a whole training step: one XLA program per call.

A step function (forward, ``loss.backward()``, ``clip_grad_norm_``, ``opt.step()``, in any
order with ``zero_grad``) is not one Dynamo graph in torch 2.13, even with
``torch._dynamo.config.trace_autograd_ops`` turning ``backward()`` into an in-graph
``autograd.grad``: ``Optimizer.zero_grad`` is skipped by Dynamo, ``Optimizer.step`` calls
``torch._dynamo.graph_break()`` before and after itself on purpose, a returned loss whose
``grad_fn`` the in-graph backward consumed breaks the graph again, and a changed ``lr`` (a
Python float in ``param_groups``) recompiles. Probed on TinyGPT: 5 graphs, 3 deliberate breaks,
one recompile per ``lr`` change. Without the flag Dynamo hands the backend four graphs with
AOTAutograd's and the autograd engine's host work between them.

So the whole step is served by the captured-step machinery instead (``eager/capture.py``, the
one behind ``torch.tpu.graph``), reached through ``torch.compile`` itself (``install`` wraps it:
a backend sees only Dynamo's graphs, never the whole call): each call with a known signature
replays one captured program that reads and donates the parameters, gradients and optimizer
state and rebinds their storages in place; no Dynamo, AOTAutograd or autograd engine runs.
Measured on the TinyGPT step (``bench/captured.py``): one program per call, 1.3-1.4x faster than
Dynamo's graphs of the same step, as fast as a hand-written ``torch.tpu.graph`` capture.

How a call runs (``WholeStep``):
- the first call is captured and run once, not kept: its first ``backward()`` creates the
  ``.grad`` buffers, which a replay would create afresh (CUDA Graphs require warm-up steps for
  this reason); it also tells which optimizers the function steps (a step may have none: a
  hand-written update under ``no_grad``). Its optimizers make their state eagerly, outside the
  recording (``device_steps.py``), so that its program is the steady one: the second call
  captures again and reuses that program (``eager/capture.py``'s program cache) instead of
  compiling the step a second time;
- a call with a new signature (tensor shapes, dtypes and ``requires_grad``; other arguments by
  value or identity; grad mode, autocast, matmul precision, the default dtype; the train/eval
  mode of every module among the arguments and the function's globals and closure; the scalars
  it reads from them) captures the step and replays it at once: every call is one training
  step; so does a call that finds one of those modules' parameters or buffers replaced (an
  attribute assigned, ``.data`` set) or its ``requires_grad`` toggled since the capture, as
  the program reads the storages the capture found;
- a default optimizer (``capturable=False``) keeps its step count in CPU tensors, and its bias
  correction would become a constant of the program: during the capture its groups run as
  ``capturable=True`` on device twins of the step counts, which the program advances in place
  while each replay advances the CPU counts on the host (a twin is refilled if its count moved
  outside the compiled step; a count advances only where the program steps its parameter: the
  optimizer skips one without a ``.grad``). The optimizer's own state is left as eager leaves
  it;
- a capturable group's ``lr`` is an input of the program, so a scheduler's change takes effect
  without a recapture; any other hyperparameter (a tensor one written in place too), or a
  parameter, gradient or state tensor replaced since the capture, recaptures (at most
  ``MAX_CAPTURES`` times, then Dynamo's path);
- outputs the step computes (the loss) come back as new tensors each call, without ``grad_fn``.

What cannot be one program (a host read such as ``.item()`` inside the step, a shape that
depends on values, a CPU tensor argument, an argument written in place) is warned about once,
naming the op and the line, and the function then runs through Dynamo's graphs as before.
Python side effects inside the step (counters, prints, hooks, ``optimizer._step_count``) run at
capture only, as with CUDA Graphs; a Python number the step reads from an object other than the
function's own globals, closure and arguments is frozen at capture.

Opt out with ``options={"whole_step": False}``; ``mode="reduce-overhead"`` and
``dynamic=True`` keep their own paths.
"""

from __future__ import annotations

import dis
import functools
import logging
import types
import warnings
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchtpu.compile import module_trees
from torchtpu.compile.device_steps import DeviceSteps
from torchtpu.compile.module_trees import ModuleTrees
from torchtpu.compile.step_counts import StepCounts
from torchtpu.device import tensors
from torchtpu.eager.capture import Capture, CaptureError, storage_of
from torchtpu.eager.graphed_callables import bind, binding, context, move_out
from torchtpu.eager.tpu_graph import OptimizerWatch, StateCreated

log = logging.getLogger("torchtpu.compile")

# Captures per function (new signatures, changed hyperparameters) before Dynamo's path is used.
MAX_CAPTURES = 8

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)


class _CannotCapture(Exception):
    """This call's step cannot be one captured program (the reason is the message)."""


def mentions_backward(fn, depth: int = 3) -> bool:
    """Whether fn's code (or code nested in it) calls something named ``backward``, or a
    function it reaches by name does (a closure's or a global's, ``depth`` calls deep): a step
    is often a thin wrapper, ``zero_grad()`` and then a ``train(x, y)`` defined elsewhere."""
    seen: set = set()
    todo = [(fn, depth)]
    while todo:
        f, left = todo.pop()
        code = getattr(f, "__code__", None)
        if not isinstance(code, types.CodeType) or id(code) in seen:
            continue
        seen.add(id(code))
        stack = [code]
        while stack:
            c = stack.pop()
            if "backward" in c.co_names:
                return True
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        if left:
            todo.extend((x, left - 1) for x in _environment(f) if isinstance(x, types.FunctionType))
    return False


def _leaf_key(x) -> tuple:
    if isinstance(x, torch.Tensor):
        if x.device.type != "tpu":
            raise _CannotCapture(f"a {x.device.type} tensor argument (a capture would freeze its "
                                 "value); pass tpu tensors")
        return ("tensor", tuple(x.shape), x.dtype, x.requires_grad)
    if isinstance(x, _SCALARS):
        return ("value", type(x), x)
    return ("object", id(x))


def _covers(x) -> bool:
    return not isinstance(x, torch.Tensor) or tensors.covers_storage(x)


def _environment(fn) -> list:
    """The objects fn reads by name: its closure cells and the globals its code loads."""
    out = []
    for c in fn.__closure__ or ():
        try:
            out.append(c.cell_contents)
        except ValueError:  # an empty cell
            pass
    g = fn.__globals__
    out.extend(g[n] for n in _globals_read(fn.__code__) if n in g)
    return out


@functools.cache
def _globals_read(code: types.CodeType) -> tuple:
    # Not co_names, which also holds attribute names: opt.step() must not tie the step to a
    # global loop counter named step.
    return tuple(dict.fromkeys(i.argval for i in dis.get_instructions(code)
                               if i.opname == "LOAD_GLOBAL"))


def _env_key(objects: list) -> tuple:
    key = []
    for x in objects:
        if isinstance(x, _SCALARS):
            key.append(("value", x))
        elif isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
            key.append(("object", id(x)))
    return tuple(key)


def _modules(objects, trees: ModuleTrees) -> list:
    out = []
    for x in objects:
        if isinstance(x, torch.nn.Module):
            out.extend(trees.modules(x))
    return out


def _leaves(args: tuple, kwargs: dict) -> list:
    """pytree's leaves of (args, kwargs); the arguments themselves when each is a leaf (no
    container type pytree knows, no tuple subclass: a namedtuple is a container), as a step's
    tensors, modules and numbers are, without pytree's walk."""
    if kwargs or any(type(a) in _NODES or isinstance(a, tuple) for a in args):
        return pytree.tree_leaves((args, kwargs))
    return list(args)


_NODES = pytree.SUPPORTED_NODES  # (the live registry: a type registered later counts)


class _Step:
    """One captured step: its program, the storages calls bind, and the guards of a replay."""

    def __init__(self, captured, binding, static, outputs, out_spec, fresh, guards,
                 steps, grads_in, grads_out, held) -> None:
        self.captured = captured
        self.binding = binding            # the tensor arguments' storages, rebound each call
        self.static = static              # the capture's own argument leaves
        self.outputs = outputs            # the capture's output leaves
        self.out_spec = out_spec
        self.single = out_spec.is_leaf()  # one output (a loss): itself, without pytree
        self.fresh = fresh                # output positions handed back as new tensors
        self.moved = [o for k, o in enumerate(outputs) if k in fresh]  # their capture tensors
        # (CPU step count, its device twin the program advances, step() calls per replay).
        self.counts = StepCounts(steps)
        # The .grad a call must find where the program reads it (backward accumulating into
        # it); any other .grad the step replaces, as its Python did at capture.
        read = {id(st) for st in captured.storages_read()}
        self.grads_in = {p: g for p, g in grads_in.items()
                         if g is not None and id(storage_of(g)) in read}
        self.grads_out = grads_out        # [(param, .grad the step leaves)]
        self.guards = guards              # the optimizers' (eager/tpu_graph.py)
        self.held = held                  # the modules' tensors then (module_trees.held)

    def stale(self, modules: list) -> str | None:
        """Why a replay would no longer match the capture, or None."""
        why = self.guards.mismatch()
        if why is None and any(p.grad is not g for p, g in self.grads_in.items()):
            why = "a .grad the step accumulates into was replaced"
        if why is None and not module_trees.same(module_trees.held(modules), self.held):
            why = "a module's parameter or buffer was replaced or its requires_grad changed"
        return why

    def run(self, leaves: list):
        bind(self.binding, self.static, leaves, "argument")
        self.counts.before_replay()  # (refills twins stepped or loaded outside the step)
        self.captured.replay()
        self.counts.after_replay()
        for p, g in self.grads_out:
            if p.grad is not g:  # the step's Python set it at capture: zero_grad, backward
                p.grad = g
        moved = iter(move_out(self.moved))
        out = [next(moved) if k in self.fresh else o for k, o in enumerate(self.outputs)]
        return out[0] if self.single else pytree.tree_unflatten(out, self.out_spec)


class WholeStep:
    """A step function compiled whole: see the module docstring."""

    def __init__(self, fn: Callable, dynamo: Callable[[], Callable]) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._dynamo_factory = dynamo
        self._dynamo: Callable | None = None
        self._optimizers: dict = {}    # id -> optimizer stepped by fn
        self._steps: dict = {}         # signature -> _Step
        self._captures = 0
        self._warmed = False           # a first step ran (captured once, not kept)
        self._reason: str | None = None  # why fn runs through Dynamo's graphs instead
        self._trees = ModuleTrees()    # the modules of the arguments and environment

    def __call__(self, *args, **kwargs):
        if self._reason is not None:
            return self._through_dynamo(args, kwargs)
        leaves = _leaves(args, kwargs)
        env = _environment(self._fn)
        modules = _modules([*leaves, *env], self._trees)
        try:
            key = (tuple(_leaf_key(x) for x in leaves), _env_key(env), context(modules))
        except _CannotCapture as e:
            return self._give_up(str(e), args, kwargs)
        step = self._steps.get(key)
        if step is not None:
            why = step.stale(modules)
            if why is None:
                return step.run(leaves)
            log.info("torchtpu.compile: whole step %s: %s since the capture; capturing again",
                     self.__name__, why)
        if self._captures >= MAX_CAPTURES:
            return self._give_up(f"captured {MAX_CAPTURES} times (signatures, hyperparameters "
                                 "or tensors keep changing)", args, kwargs)
        if not all(_covers(x) for x in leaves):
            # A view argument (batch[:, :-1]) is captured as a tensor of its own; each call's
            # view is read into it.
            leaves = [x.contiguous().clone() if not _covers(x) else x for x in leaves]
            args, kwargs = pytree.tree_unflatten(leaves, pytree.tree_structure((args, kwargs)))
        try:
            try:
                return self._capture(key, leaves, modules, args, kwargs, once=not self._warmed)
            except _NewState:
                return self._capture(key, leaves, modules, args, kwargs, once=True)
        except _CannotCapture as e:
            return self._give_up(str(e), args, kwargs)

    def _capture(self, key, leaves: list, modules: list, args, kwargs, once: bool):
        """Capture this call's step and run it. A first step (``once``) creates optimizer state,
        which a replay would create afresh: it runs once and is not kept."""
        known = list(self._optimizers.values())
        params = [p for opt in known for g in opt.param_groups for p in g["params"]]
        grads_in = {p: p.grad for p in params}
        capture = Capture()
        device_steps = DeviceSteps([] if once else known)
        watch = OptimizerWatch(capture, once=once)
        stepped: dict = {}
        stateless: list = []  # (optimizer, parameter) without state at its first step here

        def seen(opt, a, k) -> None:
            stepped[id(opt)] = stepped.get(id(opt), 0) + 1
            if stepped[id(opt)] == 1:
                stateless.extend((opt, p) for g in opt.param_groups for p in g["params"]
                                 if not opt.state.get(p))
                # A first step makes state outside the recording: a new optimizer's, or a
                # known one's whose state was cleared, loaded or extended (add_param_group).
                if once:
                    device_steps.adopt(opt, capture)
            self._optimizers.setdefault(id(opt), opt)

        def forget_state() -> None:
            # State made by a capture that did not finish is no value (a recorded value never
            # run, or a device count a default optimizer would keep on the host): the
            # optimizer makes it again at its next step, as it would have.
            for opt, p in stateless:
                opt.state.pop(p, None)

        handle = register_optimizer_step_pre_hook(seen)
        watch.install()
        try:
            capture.begin()
            try:
                out = self._fn(*args, **kwargs)
            except BaseException:
                capture.abort()
                for p, g in grads_in.items():
                    p.grad = g
                forget_state()
                raise
            captured = capture.finish()
        except CaptureError as e:
            forget_state()
            if not once and (isinstance(e, StateCreated) or set(stepped) - {id(o) for o in known}):
                raise _NewState from e
            raise _CannotCapture(str(e)) from e
        finally:
            watch.remove()
            handle.remove()
            device_steps.restore()
        written = {id(st) for st in captured.storages_written()}
        if any(isinstance(t, torch.Tensor) and id(storage_of(t)) in written
               for t in leaves):
            raise _CannotCapture("the step writes one of its tensor arguments in place")
        flat_out, out_spec = pytree.tree_flatten(out)
        grads_out = [(p, p.grad) for p in params]
        grad_ids = {id(g) for _, g in grads_out if g is not None}
        fresh = {k for k, o in enumerate(flat_out)
                 if isinstance(o, torch.Tensor) and id(o) not in grad_ids
                 and capture.created(storage_of(o))}
        # A count advances only where the program advances its twin: the optimizer skips a
        # parameter without a .grad (requires_grad off, unused by this step's loss).
        steps = [(cpu, dev, stepped.get(id(opt), 0) if id(storage_of(dev)) in written else 0)
                 for opt, cpu, dev in device_steps.twins]
        step = _Step(captured, binding(leaves), leaves, flat_out, out_spec, fresh,
                     watch.guards(grads=False),
                     steps, grads_in, grads_out, module_trees.held(modules))
        self._captures += 1
        self._warmed = True
        if not once:
            self._steps[key] = step
        return step.run(leaves)

    def _give_up(self, reason: str, args, kwargs):
        self._reason = reason
        warnings.warn(f"torchtpu.compile: the whole step {self.__name__} cannot run as one "
                      f"captured program: {reason}. It runs through Dynamo's graphs (several "
                      "programs per call).", stacklevel=3)
        return self._through_dynamo(args, kwargs)

    def _through_dynamo(self, args, kwargs):
        if self._dynamo is None:
            self._dynamo = self._dynamo_factory()
        return self._dynamo(*args, **kwargs)


class _NewState(Exception):
    """An optimizer's state was created inside a steady-state capture: capture a first step."""


def compile_step(original: Callable, model, kwargs: dict):
    """``torch.compile(model, backend="tpu", **kwargs)``: a ``WholeStep`` for a step function,
    else ``original`` (PyTorch's torch.compile) of it."""
    if _wants_whole_step(model, kwargs):
        return WholeStep(model, functools.partial(original, model, **kwargs))
    return original(model, **kwargs)


def _wants_whole_step(model, kwargs: dict) -> bool:
    options = kwargs.get("options") or {}
    if not isinstance(options.get("whole_step", True), bool):
        raise ValueError("torchtpu.compile: whole_step must be True or False, not "
                         f"{options['whole_step']!r}")
    return (kwargs.get("backend") == "tpu" and isinstance(model, types.FunctionType)
            and kwargs.get("mode") in (None, "default") and not kwargs.get("dynamic")
            and not kwargs.get("disable") and options.get("whole_step", True)
            and mentions_backward(model))
