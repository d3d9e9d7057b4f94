"""The categories every torchtpu error and warning message starts with, and their glossary.

A message reads ``"torchtpu.<category>: <what happened and what to do>"``. The prefix is stable,
so a program can filter on it (``warnings.filterwarnings("ignore", message="torchtpu.fallback")``)
and a person can look it up: ``GLOSSARY`` gives each category's cause and fix, and the
glossary of docs/reference.md is ``glossary_markdown()``. Raise sites keep their Python exception
types (``ValueError``, ``RuntimeError``, ...); only the text carries the category:

    raise ValueError(errors.message("config", f"TORCHTPU_PLATFORM={v!r} is not one of ..."))
    raise ValueError(f"torchtpu.config: TORCHTPU_PLATFORM={v!r} is not one of ...")  # the same

``tests/test_error_messages.py`` reads the source and fails on a literal message made into an
exception or warning without a known category.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import NamedTuple

from torchtpu import settings


class Entry(NamedTuple):
    cause: str
    fix: str


GLOSSARY: dict[str, Entry] = {
    "config": Entry(
        "An environment variable or setting torchtpu reads has a value it does not accept.",
        "Use one of the values the message lists (docs, Settings); `python -m torchtpu.doctor` "
        "checks them all."),
    "device": Entry(
        "A device that does not exist was asked for (an index other than 0, a platform with no "
        "devices), or none could be opened.",
        "Use `tpu` / `tpu:0` (one process per device); pick the chip with TORCHTPU_LOCAL_DEVICE "
        "or torchrun's LOCAL_RANK, the platform with TORCHTPU_PLATFORM."),
    "placement": Entry(
        "An op got a tensor on another device (usually CPU) where a tpu tensor was needed.",
        "Move the tensor with `.to(\"tpu\")` (inputs, targets, buffers created in `forward`)."),
    "dtype": Entry(
        "A dtype the device cannot hold or an op cannot take.",
        "Cast to a supported dtype (float32, bfloat16, float16, float64, the float8 types, the "
        "integer and bool types, complex32/64/128; on a TPU no complex128: its chips have no "
        "64-bit complex arithmetic)."),
    "fallback": Entry(
        "An ATen op has no tpu lowering and no decomposition: eager mode ran it on CPU (a "
        "warning; copies both ways each call) or refused it (TORCHTPU_CPU_FALLBACK=error); a "
        "compiled graph cannot hold it.",
        "Avoid the op, or add a lowering (docs, Adding an op); `python -m torchtpu.onboard` "
        "lists every fallback with the module it came from."),
    "check": Entry(
        "An op got an argument CPU refuses and the device would not notice (an index out of "
        "bounds, uniform_ with from > to, ...); checked in every eager mode, and worded as "
        "CPU words it whenever CPU can say it (then without this prefix). Where the values "
        "are not on the host yet (DeferAndFuse, torch.compile graphs, a TPU or GPU), the device "
        "checks them and the error comes at the next host read, with a note naming the call's "
        "line (in Debug mode, at the call).",
        "Fix the argument at the line the error points to."),
    "numerics": Entry(
        "TORCHTPU_DEBUG_NANS=1 found a NaN or an infinity in an op's result.",
        "Look at the op the message names and at its inputs (learning rate, log of zero, "
        "division by zero, overflow in float16)."),
    "deferred": Entry(
        "A value DeferAndFuse recorded could not be computed: the fused program that computes "
        "it failed (its error is attached).",
        "Read the attached error; rerun in Debug mode (TORCH_TPU_LAUNCH_BLOCKING=1) to see the "
        "failing op at its line."),
    "capture": Entry(
        "A captured step (torch.tpu.graph, TPUGraph, make_graphed_callables, "
        "mode=\"reduce-overhead\") met something a replay cannot repeat: a host read inside "
        "the capture, optimizer settings or tensors changed since it, arguments unlike the "
        "captured ones.",
        "Move host reads out of the captured region, capture again after changing the "
        "optimizer, call with tensors of the captured shapes and flags."),
    "compile": Entry(
        "The torch.compile backend \"tpu\" could not compile a graph as asked (an option it "
        "does not take, a graph it cannot run exactly).",
        "Follow the message; a graph that cannot compile may run eagerly "
        "(`torch.compiler.disable`) until it is supported."),
    "memory": Entry(
        "The device ran out of memory: a program asked for more bytes than the device (or the "
        "limit TORCHTPU_MEMORY_LIMIT / torch.tpu.set_per_process_memory_fraction sets) has "
        "free. The message names the program, its line, the bytes and the largest live "
        "tensors.",
        "Free tensors you no longer need (del them), lower the batch size, or checkpoint "
        "activations; record memory history (torch.tpu.memory._record_memory_history()) for "
        "the stack that made each tensor."),
    "cache": Entry(
        "A persistent compile cache entry was unreadable (damaged, truncated), or the cache "
        "directory cannot be used, or (a warning) warm starts are off because the directory is "
        "not yours alone.",
        "Nothing for a damaged entry: it is deleted and recompiled. For the directory, set "
        "TORCHTPU_CACHE_DIR to a writable one (or `off`); for warm starts, `chmod go-w` it or "
        "use a directory of your own."),
    "distributed": Entry(
        "torch.distributed on the tpu_dist backend got what it cannot do: CPU tensors in a "
        "collective, collectives that differ between ranks, an operation it does not serve, a "
        "rank that did not answer in time.",
        "Follow the message: put tensors on \"tpu\", make every rank call the same collectives "
        "in the same order, check that all ranks started."),
    "profiler": Entry(
        "torch.profiler with ProfilerActivity.TPU or TpuProfilerConfig got an option it does not "
        "take, or the JAX profiler could not start or wrote no trace.",
        "Use the options the message lists; stop any other jax.profiler trace; leave "
        "ProfilerActivity.TPU out to profile the host alone."),
    "kernel": Entry(
        "A custom kernel (jax_op, a Pallas, Tokamax or Helion kernel) was defined or called "
        "wrongly: an annotation with no schema type, a fake kernel that disagrees with the "
        "function, a Pallas kernel that cannot lower on this platform.",
        "Follow the message: it names the op and the fix (annotations, register_fake, "
        "TORCHTPU_PALLAS_INTERPRET)."),
    "export": Entry(
        "torchtpu.export or torchtpu.jax.to_jax met a program it cannot turn into JAX (an op "
        "with no lowering, a data-dependent shape, random ops), or an exported artifact was "
        "called with inputs unlike its manifest's.",
        "Follow the message: it names the op and the module it was called in, or the input "
        "and the shape (with its symbolic dimensions) the artifact takes."),
    "unsupported": Entry(
        "A feature or argument combination torchtpu does not implement yet.",
        "Use the alternative the message names, or file an issue with the call."),
    "argument": Entry(
        "A torchtpu API got an argument of the wrong type or value.",
        "Pass what the message and the function's docstring ask for."),
    "experimental": Entry(
        "An experimental API was used: it works, but its behaviour may change.",
        "Nothing to do; filter the warning by its prefix to silence it."),
    "tool": Entry(
        "A torchtpu tool (doctor, onboard, diagnose, the MCP server) got input it cannot use: "
        "a target that does not import, a model that fails on CPU, inputs on the wrong device.",
        "Follow the message: the tools name the problem and never need a traceback to explain "
        "it."),
    "tpu": Entry(
        "A TPU target (TORCHTPU_TPU_TARGET, python -m torchtpu.aot) could not be used or "
        "refused a program: an unknown topology, libtpu missing or not the version JAX pins, "
        "more ranks than the topology's chips, a program the TPU compiler does not take, a "
        "step that does not fit in the chip's HBM.",
        "Follow the message: it names the topologies, the libtpu to install, the program, its "
        "line and the compiler's words; TORCHTPU_TPU_TARGET_ON_ERROR=warn keeps running."),
}

_PREFIX = re.compile(r"^torchtpu\.([a-z]+): ")


def message(category: str, text: str) -> str:
    """text with category's prefix, ``"torchtpu.<category>: <text>"``."""
    if category not in GLOSSARY:
        raise ValueError(f"torchtpu.argument: unknown error category {category!r}; "
                         f"use one of {', '.join(GLOSSARY)}")
    return f"torchtpu.{category}: {text}"


def warn(category: str, text: str, warning: type[Warning] = UserWarning,
         stacklevel: int = 2) -> None:
    """warnings.warn with category's prefix, attributed stacklevel frames above the caller."""
    warnings.warn(message(category, text), warning, stacklevel=stacklevel + 1)


def category_of(error: BaseException | Warning | str) -> str | None:
    """The category a torchtpu message (an exception, a warning or its text) starts with."""
    found = _PREFIX.match(str(error))
    return found.group(1) if found and found.group(1) in GLOSSARY else None


def glossary_markdown() -> str:
    """The glossary as docs/reference.md's table: one row per category, cause and fix."""
    rows = ["| prefix | cause | fix |", "| --- | --- | --- |"]
    rows += [f"| `torchtpu.{name}` | {e.cause} | {e.fix} |" for name, e in GLOSSARY.items()]
    return "\n".join(rows)


_HIDDEN = "torchtpu: the frames inside torchtpu are hidden; TORCHTPU_DEBUG=1 shows them"


def show_internals() -> bool:
    """TORCHTPU_DEBUG=1: errors keep torchtpu's frames and the errors they came from; otherwise
    an error raised at an op's call shows the user's line and one message, as on CPU."""
    return settings.DEBUG.get()


_CPU_WORDS = "_torchtpu_cpu_words"


def from_cpu(error: BaseException) -> BaseException:
    """Mark error as PyTorch's CPU kernels' own (raised on stand-ins of a call's inputs)."""
    setattr(error, _CPU_WORDS, True)
    return error


def note_hidden_frames(error: BaseException) -> None:
    """Say, under an error that is neither CPU's nor one of torchtpu's own, how to see its
    frames."""
    if (category_of(error) is None and not getattr(error, _CPU_WORDS, False)
            and _HIDDEN not in getattr(error, "__notes__", ())):
        error.add_note(_HIDDEN)


def trim(error: BaseException) -> BaseException:
    """error, made to show as CPU's errors do once re-raised with a bare ``raise``: only the
    frames it passes from then on (the user's), and no "During handling of the above exception"
    chain; unchanged under TORCHTPU_DEBUG=1."""
    if not show_internals():
        error.__traceback__ = None
        error.__suppress_context__ = True
    return error


def at_user(kernel: Callable) -> Callable:
    """kernel (a device kernel the dispatcher calls for the user's op) with its errors trimmed."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        try:
            return kernel(*args, **kwargs)
        except Exception as error:
            trim(error)
            raise  # bare: adds no frame of this one

    return run
