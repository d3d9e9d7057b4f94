"""``torch.tpu.TPUGraph`` and ``torch.tpu.graph``: CUDA Graphs' capture and replay on the device.

A ``TPUGraph`` holds one capture (``eager/capture.py``): ``with torch.tpu.graph(g): ...`` records
the block's device work without running it, and each ``g.replay()`` runs it as one XLA program.
What this module adds to the capture is what a training step needs to stay correct from replay
to replay:
- every optimizer stepped inside the capture is watched (PyTorch's global optimizer step hooks):
  a ``capturable=True`` group's learning rate becomes an input of the program, read from
  ``param_groups`` at each replay, so a scheduler's new ``lr`` is used without a recapture;
- guards, checked before each replay: the optimizer's other hyperparameters, and the identity of
  every parameter, gradient and state tensor (and of the storage under it); a change raises
  ``CaptureError`` rather than replaying a program that no longer matches;
- an optimizer that keeps its step count on the CPU (``capturable=False``), or whose state would
  be created inside the capture (no warm-up step), raises at capture: a replay would repeat the
  first step's bias correction, or recreate the state every step.

Replay cannot repeat what Python did during the capture: counters (``optimizer._step_count``,
an LR scheduler's ``step()``), prints, host-side data structures. The random generators advance
on every replay, so dropout masks differ from step to step as in eager.
"""

from __future__ import annotations

import contextlib
import itertools
import operator

import numpy as np
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtpu.eager import executor, shared_steps
from torchtpu.eager.capture import Capture, Captured, CaptureError, storage_of


class StateCreated(CaptureError):
    """An optimizer's state was created inside a capture: warm-up steps must come first."""


def _state_tensors(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple:
    state = opt.state.get(p, {})
    return tuple((k, v) for k, v in state.items() if isinstance(v, torch.Tensor))


def _hyperparameters(group: dict, fed_lr: bool) -> tuple:
    # A tensor's value (a CPU tensor lr a scheduler fills in place) is a constant of the program
    # as a number's is: its version counter says whether it was written since.
    return tuple((k, (v, v._version) if isinstance(v, torch.Tensor) else v)
                 for k, v in group.items() if k != "params" and not (fed_lr and k == "lr"))


class OptimizerWatch:
    """The optimizers stepped during one capture: their learning rates fed, their guards."""

    def __init__(self, capture: Capture, once: bool = False, share_steps: bool = False) -> None:
        self._capture = capture
        self._once = once           # a capture replayed once: its first step may create state
        # A capturable optimizer's step counts made views of one buffer (``shared_steps``):
        # for ``torch.tpu.graph``; a whole step keeps device twins of its own counts.
        self._share_steps = share_steps
        self._seen: dict = {}       # id -> optimizer
        self._swapped: list = []    # (group, lr) while a step runs
        self._fed: set = set()      # id(group) whose lr is an input of the program
        self._handles: list = []

    def install(self) -> None:
        self._handles = [register_optimizer_step_pre_hook(self._before),
                         register_optimizer_step_post_hook(self._after)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._restore()

    def _before(self, opt, args, kwargs) -> None:
        self._seen[id(opt)] = opt
        if self._share_steps and any(group.get("capturable") for group in opt.param_groups):
            shared_steps.share(opt, self._capture)
        for group in opt.param_groups:
            for p in group["params"]:
                for _, t in _state_tensors(opt, p):
                    if not self._once and t.device.type == "cpu" and t.dim() == 0:
                        raise CaptureError(
                            f"torchtpu.capture: {type(opt).__name__} keeps its step count on the "
                            "CPU "
                            f"(capturable=False), {executor.user_location()}: a replay would "
                            "repeat the first step's bias correction. Construct it with "
                            "capturable=True to capture its step.")
            lr = group.get("lr")
            if group.get("capturable") and isinstance(lr, (int, float)):
                self._swapped.append((group, lr))
                group["lr"] = self._lr_tensor(group, lr)

    def _lr_tensor(self, group: dict, lr: float) -> torch.Tensor:
        # Made outside the recording, so that it is a storage the program reads; at each replay
        # that input is the group's lr of the moment.
        double = any(p.dtype == torch.float64 for p in group["params"])
        dtype = torch.float64 if double else torch.float32
        with self._capture.paused():
            t = torch.tensor(float(lr), dtype=dtype, device=group["params"][0].device)
        np_dtype = np.float64 if double else np.float32
        self._capture.feed(storage_of(t), lambda: np.asarray(group["lr"], np_dtype))
        self._fed.add(id(group))
        return t

    def _after(self, opt, args, kwargs) -> None:
        self._restore()
        for group in opt.param_groups:
            for p in group["params"]:
                for name, t in _state_tensors(opt, p):
                    if not self._once and self._capture.created(storage_of(t)):
                        raise StateCreated(
                            f"torchtpu.capture: {type(opt).__name__}'s state {name!r} was created "
                            f"inside the capture, {executor.user_location()}: a replay would "
                            "create it afresh every step. Run a few warm-up steps before "
                            "capturing.")

    def _restore(self) -> None:
        for group, lr in self._swapped:
            group["lr"] = lr
        self._swapped = []

    def guards(self, grads: bool = True) -> Guards:
        out = []
        for opt in self._seen.values():
            groups = []
            for group in opt.param_groups:
                tensors = tuple((p, storage_of(p), p.grad, _state_tensors(opt, p))
                                for p in group["params"])
                fed = id(group) in self._fed
                groups.append((group, fed, _hyperparameters(group, fed), tensors))
            out.append((opt, groups))
        return Guards(out, grads)


class Guards:
    """What a replay needs unchanged in the optimizers it steps, checked before each replay.

    The check (``mismatch``) compares what it guards with what the capture saw, per parameter:
    ~1.5 µs each, 117 µs for an 80-parameter AdamW step (more than the rest of a replay's host
    work). So a snapshot is kept of every object the check's answer depends on (the
    ``param_groups`` list and its groups, each group's keys and hyperparameters, ``opt.state``,
    its per-parameter dicts with their keys and values, and each parameter, its storage and
    its ``.grad``), taken when the check last passed. A replay finding every one of those the
    very object of the snapshot (``is``, in one C-level pass over a flat list) is one the
    check would pass; anything else (a new ``lr`` float of a scheduler, a replaced gradient)
    runs the full check, and its pass takes a new snapshot.
    """

    def __init__(self, entries: list, grads: bool) -> None:
        self.entries = entries  # [(optimizer, [(group, lr fed?, hyperparameters, tensors)])]
        self._grads = grads
        # Per optimizer, per group: the hyperparameter keys the check compares. A wrapper
        # subclass parameter (a DTensor) is checked through its inner tensor's storage, which
        # the snapshot does not read: such optimizers always take the full check.
        # So is a tensor hyperparameter, written in place without a new object.
        self._plan = None
        if not any(is_traceable_wrapper_subclass(t[0]) for _, groups in entries
                   for *_, tensors in groups for t in tensors) \
                and not any(isinstance(v, tuple) and isinstance(v[0], torch.Tensor)
                            for _, groups in entries for _, _, hyper, _ in groups
                            for _, v in hyper):
            self._plan = [(opt, [tuple(k for k, _ in hyper) for _, _, hyper, _ in groups])
                          for opt, groups in entries]
        self._snapshot = None

    def mismatch(self) -> str | None:
        """Why the optimizers no longer match the capture, or None."""
        if self._snapshot is not None:
            try:
                now = self._objects()
            except Exception:  # noqa: BLE001 (changed beyond recognition: the full check says)
                now = None
            if now is not None and len(now) == len(self._snapshot) \
                    and all(map(operator.is_, now, self._snapshot)):
                return None
        why = _mismatch(self.entries, self._grads)
        if why is None and self._plan is not None:
            try:
                self._snapshot = self._objects()
            except Exception:  # noqa: BLE001 (a state that is no dict: the full check only)
                self._plan = self._snapshot = None
        return why

    def _objects(self) -> list:
        """Every object the full check's answer depends on, in one flat list; each section
        closed by ``_END``, so that a section of another length misaligns the rest."""
        out: list = []
        for opt, hyper_keys in self._plan:
            groups = opt.param_groups
            state = opt.state
            dicts = list(state.values())
            out += (groups, *groups, _END, state, *state, _END, *dicts, _END,
                    *itertools.chain.from_iterable(dicts), _END,
                    *itertools.chain.from_iterable(map(dict.values, dicts)), _END)
            for group, keys in zip(groups, hyper_keys, strict=True):
                params = group["params"]
                out += (*group, _END, *map(group.__getitem__, keys), _END,
                        params, *params, _END, *map(_STORAGE, params))
                if self._grads:
                    out.extend(map(_GRAD, params))
                out.append(_END)
        return out


_END = object()
_STORAGE = torch.Tensor.untyped_storage
_GRAD = operator.attrgetter("grad")


def _mismatch(guards: list, grads: bool) -> str | None:
    """Why the optimizers no longer match their guards (``Guards.entries``), or None. With
    ``grads=False`` a parameter's ``.grad`` is not checked."""
    for opt, groups in guards:
        name = type(opt).__name__
        if len(opt.param_groups) != len(groups):
            return f"{name}'s param_groups changed since the capture"
        for group, (captured, fed, hyper, tensors) in zip(opt.param_groups, groups):
            if group is not captured or len(group["params"]) != len(tensors):
                return f"{name}'s param_groups changed since the capture"
            now = _hyperparameters(group, fed)
            if now != hyper:
                now = dict(now)
                changed = [k for k, v in hyper if now.get(k) != v]
                return (f"{name} hyperparameter(s) {changed} changed since the capture (they "
                        "are constants of the captured program; only the lr of a "
                        "capturable=True optimizer is an input)")
            for p, (q, st, grad, state) in zip(group["params"], tensors):
                if p is not q or storage_of(p) is not st or (grads and p.grad is not grad) \
                        or not _same_state(_state_tensors(opt, p), state):
                    return (f"a parameter, its .grad or its {name} state is not the tensor the "
                            "capture used (replaced, or set to None by zero_grad?); the captured "
                            "program updates the tensors it captured: do not zero or replace "
                            "them between replays (replay refills .grad)")
    return None


def _same_state(now: tuple, captured: tuple) -> bool:
    # By identity: == on tensors would compare values (and read them).
    return len(now) == len(captured) and all(
        k == c and v is t for (k, v), (c, t) in zip(now, captured))


def _check(guards: Guards | None) -> None:
    why = None if guards is None else guards.mismatch()
    if why is not None:
        raise CaptureError(f"torchtpu.capture: {why}; capture again")


class TPUGraph:
    """A captured region of device work, replayed as one XLA program (CUDA Graphs' CUDAGraph)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._capture: Capture | None = None
        self._watch: OptimizerWatch | None = None
        self._captured: Captured | None = None
        self._guards: Guards | None = None

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        """Start recording (use ``torch.tpu.graph(g)`` rather than calling this)."""
        if self._captured is not None:
            raise RuntimeError("torchtpu.capture: this TPUGraph already holds a capture; reset() "
                               "it or "
                               "use a new one")
        self._capture = Capture()
        self._watch = OptimizerWatch(self._capture, share_steps=True)
        self._watch.install()
        try:
            self._capture.begin()
        except BaseException:
            self._watch.remove()
            raise

    def capture_end(self) -> None:
        """Stop recording and build the program."""
        self._watch.remove()
        self._captured = self._capture.finish()
        self._guards = self._watch.guards()
        self._capture = self._watch = None

    def _abort(self) -> None:
        self._watch.remove()
        self._capture.abort()
        self._capture = self._watch = None

    def replay(self) -> None:
        """Run the captured work once (one program call)."""
        if self._captured is None:
            raise RuntimeError("torchtpu.capture: replay() of a TPUGraph that holds no capture")
        _check(self._guards)
        self._captured.replay()

    def reset(self) -> None:
        """Drop the capture (and the storages it holds on to)."""
        self._captured = None
        self._guards = None

    def pool(self) -> tuple:
        """A memory-pool handle, for API compatibility: XLA buffers need no private pool."""
        return ()

    def enable_debug_mode(self) -> None:
        """Kept for API compatibility; ``debug_dump`` needs no switch."""

    def debug_dump(self, debug_path: str) -> None:
        """Write the captured program as StableHLO text to debug_path."""
        if self._captured is None:
            raise RuntimeError("torchtpu.capture: debug_dump() of a TPUGraph that holds no capture")
        with open(debug_path, "w") as f:
            f.write(self._captured.hlo())

    @property
    def captured(self) -> Captured | None:
        return self._captured


@contextlib.contextmanager
def graph(tpu_graph: TPUGraph, pool=None, stream=None, capture_error_mode: str = "global"):
    """Capture the block's device work into tpu_graph (``torch.cuda.graph``'s counterpart)."""
    tpu_graph.capture_begin(pool, capture_error_mode)
    try:
        yield tpu_graph
    except BaseException:
        tpu_graph._abort()
        raise
    tpu_graph.capture_end()
