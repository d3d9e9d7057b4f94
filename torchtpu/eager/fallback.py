"""The CPU fallback: an op with no lowering and no decomposition runs on CPU, visibly.

Each op it serves is counted in ``torchtpu.metrics`` and warned about once. With
``TORCHTPU_CPU_FALLBACK=error`` it raises ``NotImplementedError`` naming the op instead, which is
how coverage is measured rather than guessed. ``allowed(enabled)`` sets it for a block of code
and ``allow(enabled)`` for the process (the reference's ``execution_mode.cpu_fallback_mode`` and
``enable_cpu_fallback``), over the variable; a tool picks any policy for a block with
``settings.CPU_FALLBACK.overridden(policy)``, under those.

It also says what CPU says about a call that failed on tpu (``cpu_error``): the error then comes
from the user's call in PyTorch's own words, not from a meta kernel's or JAX's.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

from torchtpu import metrics, settings
from torchtpu.eager import schema

_warned: set = set()
_forced: list = []  # allowed()'s settings, innermost last
_process: list = [None]  # allow()'s setting


def policy() -> str:
    if _forced or _process[0]:
        return (_forced or _process)[-1]
    return settings.CPU_FALLBACK.get()


def allow(enabled: bool) -> None:
    """``allowed(enabled)`` for the rest of the process."""
    _process[0] = "warn" if enabled else "error"


@contextlib.contextmanager
def allowed(enabled: bool):
    """Inside the block the fallback runs ops on CPU (with its warning), or, ``enabled=False``,
    refuses them as ``TORCHTPU_CPU_FALLBACK=error`` does."""
    _forced.append("warn" if enabled else "error")
    try:
        yield
    finally:
        _forced.pop()


def _to_cpu(x):
    if isinstance(x, torch.Tensor) and x.device.type == "tpu":
        return x.detach().to("cpu")
    if isinstance(x, torch.Generator) and x.device.type == "tpu":
        # The device stream is advanced so repeated draws differ; CPU draws use a derived seed.
        from torchtpu.device.random import key_data_for

        data = key_data_for(x)
        return torch.Generator().manual_seed(int(data[0]) ^ (int(data[2]) << 20))
    return x


# Inputs larger than this are not copied to the host just to word an error better.
CPU_ERROR_MAX_BYTES = 1 << 28


def copy_keeping_aliases(x: torch.Tensor, device: str, bases: dict) -> torch.Tensor:
    """A detached copy of x on device with x's strides, whose storage it shares with the copies
    of the other tensors of x's storage made with the same ``bases``: overlaps stay overlaps."""
    st = x.untyped_storage()
    key = (st.data_ptr(), x.dtype)
    if key not in bases:
        whole = x.detach().as_strided((st.nbytes() // x.element_size(),), (1,), 0)
        bases[key] = whole.to(device, copy=True)
    return bases[key].as_strided(x.shape, x.stride(), x.storage_offset())


def _to_cpu_for_error(x, bases: dict):
    if isinstance(x, torch.Tensor) and x.device.type == "tpu":
        return copy_keeping_aliases(x, "cpu", bases)  # CPU refuses some overlaps
    if isinstance(x, torch.Generator) and x.device.type == "tpu":
        return None  # the CPU default generator, restored afterwards: no stream advances
    if isinstance(x, torch.device) and x.type == "tpu":
        return torch.device("cpu")
    if isinstance(x, str) and x.startswith("tpu"):
        return "cpu"
    return _to_cpu(x)


def cpu_error(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Exception | None:
    """The exception CPU raises for the same call on copies of its inputs, or None if CPU
    accepts it (or the inputs are too large to copy for this).

    Only PyTorch's own verdict on the arguments counts: an op CPU cannot run at all (no CPU
    kernel, such as the fused RNN cells) or one whose CPU path is torchtpu's own refusal (a
    ``jax_op`` given CPU tensors) says nothing about them, so the tpu error stands.
    """
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), "CPU"):
        return None
    leaves = [x for x in tree_flatten((args, kwargs))[0]
              if isinstance(x, torch.Tensor) and x.device.type == "tpu"]
    if sum(x.untyped_storage().nbytes() for x in leaves) > CPU_ERROR_MAX_BYTES:
        return None
    try:
        bases: dict = {}
        cpu_args, cpu_kwargs = tree_map(lambda x: _to_cpu_for_error(x, bases), (args, kwargs))
    except Exception:  # the inputs themselves cannot be read: nothing to compare with
        return None
    exc = ask_cpu(op, cpu_args, cpu_kwargs)
    if exc is None or str(exc).startswith("torchtpu.") or _stub_refused(op, exc):
        return None
    return exc


def _stub_refused(op: torch._ops.OpOverload, exc: Exception) -> bool:
    """Whether exc is a device-only op's stub refusing any call on CPU (no CPU kernel of its
    own; the composite raises NotImplementedError: SDPA's overrideable op, "not implemented ...
    for privateuse1 backends"): no verdict on the call's arguments, and shown instead of the tpu
    error it hid why the call failed. A kernel's own NotImplementedError (a dtype it does not
    take: ``bincount`` of floats) is one."""
    return isinstance(exc, NotImplementedError) and \
        not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU")


def ask_cpu(op: torch._ops.OpOverload, args: tuple | list, kwargs: dict) -> Exception | None:
    """What CPU raises for op's call on CPU tensors (None if it takes it), as a question: its
    random draws and warnings are not the user's (CPU's kernel warns again where the user's
    call warns: a byte mask's deprecation would come twice)."""
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        # A C++ warning is held until the call from Python into C++ returns: for an op (which
        # enters no C++ of its own) the user's call on tpu, past this block. Called through a
        # C++ entry point that calls back into Python, they are let out here, and dropped.
        return torch._C._disabled_torch_function_impl(_raised, (), (op, args, kwargs), {})


def _raised(op: torch._ops.OpOverload, args, kwargs: dict) -> Exception | None:
    try:
        op(*args, **kwargs)
    except Exception as exc:
        return _without_frames(exc)
    return None


def _without_frames(exc: Exception) -> Exception:
    """exc, and the exceptions it chains to, without their tracebacks: CPU's answer is its type
    and words. A traceback holds the frames it passed, and those hold their callers' up to the
    user's (the call's tensors among their locals); a caller keeping the answer in a local
    (``refusals._dtypes_refused``) closed a cycle through them, so a call's values lived on
    until the collector's next pass, and which of a DeferAndFuse recording's outputs were alive
    at its flush (part of its program's key) depended on when that came."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            e.__traceback__ = None
            todo += (e.__cause__, e.__context__)
    return exc


def run_on_cpu(op: torch._ops.OpOverload, args: tuple, kwargs: dict):
    name = str(op)
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), "CPU"):
        # Said in the op's terms: running it would end in a dispatcher error about CPU.
        raise NotImplementedError(
            f"torchtpu.fallback: aten op '{name}' has no tpu lowering, and the CPU fallback "
            "cannot run "
            "it: PyTorch has no CPU kernel for it (only device kernels, such as CUDA's). "
            "Please report it to torchtpu."
        )
    mode = policy()
    if mode == "error":
        raise NotImplementedError(
            f"torchtpu.fallback: aten op '{name}' has no tpu lowering and "
            "TORCHTPU_CPU_FALLBACK=error "
            "forbids running it on CPU"
        )
    if mode == "warn" and name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"torchtpu.fallback: aten op '{name}' has no tpu lowering; running it on CPU "
            "(counted in torchtpu.metrics; TORCHTPU_CPU_FALLBACK=error makes this an error)",
            stacklevel=3,
        )
    metrics.count_fallback(name)
    cpu_args, cpu_kwargs = tree_map(_to_cpu, (args, kwargs))
    result = op(*cpu_args, **cpu_kwargs)

    oi = schema.info(op)
    values, outs = schema.bind(oi, args, kwargs)
    cpu_values, cpu_outs = schema.bind(oi, cpu_args, cpu_kwargs)
    written = [(values[i], cpu_values[i]) for i in oi.written] + list(zip(outs, cpu_outs))
    aliases = {}
    for dev, cpu in written:
        for d, c in zip(_flat(dev), _flat(cpu)):
            if isinstance(d, torch.Tensor):
                if d.shape != c.shape:
                    d.resize_(c.shape)
                d.copy_(c)
                aliases[id(c)] = d
    return tree_map(lambda r: aliases.get(id(r), _to_device(r)), result)


def _flat(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _to_device(x):
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return x.to("tpu")
    return x
