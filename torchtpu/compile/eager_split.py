"""Graphs that hold ops which must run outside any XLA program (collectives) are split there.

A collective inside a compiled program would make every rank's program a different one the
moment ranks trace different code around it, and an XLA program cannot call the process group.
So the graph is cut at each such op: the pieces between cuts compile as usual, and the ops
themselves run eagerly on the tpu tensors the pieces produce (a collective flushes nothing and
fuses with nothing). Which ops: those of a namespace an upper layer registered with
``run_eagerly`` (``torchtpu.distributed`` registers ``_c10d_functional``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

_NAMESPACES: set[str] = set()


def run_eagerly(namespace: str) -> None:
    """Ops of this torch.ops namespace run eagerly between compiled pieces of a graph."""
    _NAMESPACES.add(namespace)


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


def split(gm: fx.GraphModule, compile_piece: Callable[[fx.GraphModule], Callable]
          ) -> Callable | None:
    """gm cut at its eager ops, each other piece compiled by compile_piece; None when gm has
    no eager op. The result takes AOTAutograd's boxed argument list."""
    if not _NAMESPACES or not any(_eager(n) for n in gm.graph.nodes):
        return None
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
