"""Graphs that hold collectives: one SPMD program with the collectives inside, or cut at them.

Which ops: those of a namespace an upper layer registered with ``run_eagerly``
(``torchtpu.distributed`` registers ``_c10d_functional``), with a ``resolve`` that says, from
the graph's collective nodes, whether they can run inside the program: a ``spmd.Spmd`` (their
group's mesh, on the XLA transport) or None. Kept, the graph compiles whole as one SPMD program
(``compile/spmd.py``, the collectives lowered by ``lowering/collectives.py``), and before its
first run every rank checks, through ``Spmd.check``, that all ranks' programs hold the same
collectives (op, shapes, dtypes, arguments, in order): ranks that traced different code raise
instead of deadlocking inside XLA.

Otherwise (the host transport, several groups, uneven all_to_all) the graph is cut at each such
op, as an XLA program cannot call the process group: the pieces between cuts compile as usual,
and the ops themselves run eagerly on the tpu tensors the pieces produce (a collective flushes
nothing and fuses with nothing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from torchtpu import metrics
from torchtpu.compile.spmd import combine

_NAMESPACES: dict[str, Callable | None] = {}


def run_eagerly(namespace: str, resolve: Callable | None = None) -> None:
    """Ops of this torch.ops namespace run eagerly between compiled pieces of a graph, unless
    resolve(their nodes) gives the ``Spmd`` to run the graph, them inside, as one program."""
    _NAMESPACES[namespace] = resolve


def _eager(n: fx.Node) -> bool:
    target = n.target
    return (n.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace in _NAMESPACES)


class _Piece(torch.nn.Module):
    """A compiled piece called like the submodule it replaces (positional args, its outputs)."""

    def __init__(self, compiled: Callable, single: bool) -> None:
        super().__init__()
        self.compiled, self.single = compiled, single

    def forward(self, *args):
        out = self.compiled(list(args))
        return out[0] if self.single else tuple(out)


def signature(nodes: list[fx.Node]) -> bytes:
    """What ranks must agree on: each collective's op, argument shapes and dtypes, and other
    arguments (its group's name included), in graph order."""
    def describe(a):
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            return f"{val.dtype}{list(val.shape)}" if isinstance(val, torch.Tensor) else "?"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(describe(x) for x in a) + "]"
        return repr(a)

    text = ";".join(f"{n.target}({','.join(describe(a) for a in n.args)})" for n in nodes)
    return hashlib.sha256(text.encode()).digest()


class _Checked:
    """A whole-graph SPMD program whose first run checks the collective signature first."""

    def __init__(self, compiled: Callable, check: Callable[[bytes], None], sig: bytes) -> None:
        self._boxed_call = True
        self.compiled, self.check, self.sig = compiled, check, sig

    def __call__(self, args: list) -> list:
        if self.sig is not None:
            self.check(self.sig)
            self.sig = None
        metrics.count("collective_programs")
        return self.compiled(args)


def _in_program(gm: fx.GraphModule, nodes: list, compile_piece: Callable) -> Callable | None:
    by_namespace: dict[str, list] = {}
    for n in nodes:
        by_namespace.setdefault(n.target.namespace, []).append(n)
    if len(by_namespace) != 1:
        return None
    ((namespace, found),) = by_namespace.items()
    resolve = _NAMESPACES[namespace]
    spmd = resolve(found) if resolve is not None else None
    if spmd is None:
        return None
    sig = signature(found)  # what every rank traced, before combine() merges collectives
    combine(gm)
    compiled = compile_piece(gm, spmd)
    if getattr(compiled, "padded", False):  # bucketed dynamic shapes: not in SPMD programs
        return None
    return _Checked(compiled, spmd.check, sig)


def split(gm: fx.GraphModule, compile_piece: Callable[..., Callable]) -> Callable | None:
    """gm as one SPMD program (see the module doc), or cut at its eager ops with each other
    piece compiled by compile_piece; None when gm has no eager op. The result takes
    AOTAutograd's boxed argument list."""
    nodes = [n for n in gm.graph.nodes if _eager(n)]
    if not nodes:
        return None
    whole = _in_program(gm, nodes, compile_piece)
    if whole is not None:
        return whole
    part, parts = 0, {}
    for n in gm.graph.nodes:
        if _eager(n):
            part += 1
            parts[n] = part
            part += 1
        else:
            parts[n] = part
    top = split_module(gm, None, lambda n: parts[n], keep_original_order=True)
    for name, sub in list(top.named_children()):
        calls = [n for n in sub.graph.nodes if n.op == "call_function"]
        if calls and all(_eager(n) for n in calls):
            continue  # runs as plain PyTorch: the collective dispatches to the process group
        (out,) = [n for n in sub.graph.nodes if n.op == "output"]
        single = not isinstance(out.args[0], (tuple, list))
        if single:
            out.args = ((out.args[0],),)
            sub.recompile()
        setattr(top, name, _Piece(compile_piece(sub), single))

    def run(args: list):
        values = list(args)
        args.clear()
        out = top(*values)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    run._boxed_call = True
    return run
