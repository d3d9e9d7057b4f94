"""A whole step's optimizers during a capture: capturable, on device step counts, with their
state made outside the recording.

A default optimizer (``capturable=False``) keeps its step count in CPU tensors, and its bias
correction would become a constant of the program: for the length of a capture its groups run as
``capturable=True`` on device twins of the counts, which the program advances in place while each
replay advances the CPU counts on the host (``step_counts.py``); ``restore`` puts the groups and
counts back.

The first call of a whole step meets its optimizers only when they step, inside the capture, and
their state does not exist yet (PyTorch makes it in ``_init_group`` at the first ``step()``).
Made inside the recording, that state would be the program's own (zeros built in), so the first
program would differ from every later one and the step would compile twice: on the Llama row of
the v5e chip that is a second ~50 s compile of a 12-block step. So ``adopt`` takes an optimizer
at its first step inside the capture: its groups become capturable there, and ``_init_group``
runs outside the recording (``Capture.paused``), making the state eagerly as it would have been
made, read by the program as storages made before the capture (``Capture.made_outside``). The
first program is then the steady one (the capture's program cache, ``eager/capture.py``, serves
the next capture of the same step without compiling). An optimizer whose step makes state
outside ``_init_group`` (SGD's momentum buffer, from the first gradient) still records it; the
whole step then captures a first step of its own, as before. Where an optimizer has a parameter
past the host's constants (``constants.HOST_CONSTANT_BYTES``), its ``_init_group`` runs recorded
and flushed at its end: its state of every shape made by one program (``_state_in_one_program``).
"""

from __future__ import annotations

import contextlib

import torch

from torchtpu.device import constants
from torchtpu.eager import defer_executor, executor
from torchtpu.eager.capture import Capture, storage_of


def _cpu_count(state: dict) -> torch.Tensor | None:
    cpu = state.get("step")
    return cpu if isinstance(cpu, torch.Tensor) and cpu.device.type == "cpu" else None


@contextlib.contextmanager
def _state_in_one_program(opt):
    """The block's ops recorded and run as one program at its end (DeferAndFuse's flush, when
    it leaves), where opt has a parameter past ``HOST_CONSTANT_BYTES``: its state of every
    parameter shape made by one program, not a ``zero`` program a shape (four at the Llama
    row's sizes). Smaller state is sent from the host (``constants.host_constant``), no program."""
    outer = executor.current()
    big = any(p.numel() * p.element_size() > constants.HOST_CONSTANT_BYTES
              for group in opt.param_groups for p in group["params"])
    if outer.name != "strict" or not big:  # (Debug checks each op; DeferAndFuse records)
        yield
        return
    executor.set_current(defer_executor.DeferAndFuse())
    try:
        yield
    finally:
        executor.set_current(outer)


class DeviceSteps:
    """Optimizers run as capturable on device twins of their CPU step counts for the length of
    a capture; ``twins`` lists (optimizer, CPU count, device twin)."""

    def __init__(self, optimizers: list) -> None:
        self.twins: list = []
        self._undo: list = []      # (group made capturable | None, state, CPU count)
        self._wrapped: list = []   # optimizers whose _init_group runs outside the capture
        for opt in optimizers:
            self._flip(opt, None)

    def _flip(self, opt, capture: Capture | None) -> list:
        """opt's non-capturable groups made capturable, their CPU counts given twins; the groups
        flipped."""
        flipped = []
        for group in opt.param_groups:
            if group.get("capturable", True):
                continue
            self._undo.append((group, None, None))
            group["capturable"] = True
            flipped.append(group)
            for p in group["params"]:
                state = opt.state.get(p, {})
                cpu = _cpu_count(state)
                if cpu is None:
                    continue
                # Kept from replay to replay (donated, advanced in place), and refilled
                # from the CPU count when that moved outside the compiled step.
                dev = torch.tensor(cpu.item(), dtype=torch.float32, device=p.device)
                if capture is not None:
                    capture.made_outside(storage_of(dev))
                self._twin(opt, state, cpu, dev)
        return flipped

    def _twin(self, opt, state: dict, cpu: torch.Tensor, dev: torch.Tensor) -> None:
        state["step"] = dev
        self._undo.append((None, state, cpu))
        self.twins.append((opt, cpu, dev))

    def adopt(self, opt, capture: Capture) -> None:
        """At opt's first step inside the capture (its pre-hook): capturable from here on, its
        state made outside the recording."""
        with capture.paused():
            flipped = self._flip(opt, capture)
        original = getattr(opt, "_init_group", None)
        if original is None:
            return

        def init_group(*args, **kwargs):
            with capture.paused(), _state_in_one_program(opt):
                out = original(*args, **kwargs)
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    for t in state.values():
                        if isinstance(t, torch.Tensor) and t.device.type != "cpu" \
                                and capture.created(storage_of(t)):
                            capture.made_outside(storage_of(t))
                    dev = state.get("step")
                    if any(group is g for g in flipped) and isinstance(dev, torch.Tensor) \
                            and dev.device.type != "cpu" and dev.dim() == 0 \
                            and not any(d is dev for _, _, d in self.twins):
                        # Made on the device as a capturable group does; the CPU count a
                        # default optimizer would have made holds the same value.
                        with capture.paused():
                            cpu = torch.zeros((), dtype=dev.dtype)
                        self._twin(opt, state, cpu, dev)
            return out

        opt._init_group = init_group  # (an instance attribute: the class's stays as it is)
        self._wrapped.append(opt)

    def restore(self) -> None:
        for opt in self._wrapped:
            del opt._init_group
        self._wrapped = []
        for group, state, cpu in self._undo:
            if group is not None:
                group["capturable"] = False
            else:
                state["step"] = cpu
        self._undo = []
