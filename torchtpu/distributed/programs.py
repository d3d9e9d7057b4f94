"""Which compiled graphs keep their collectives inside their program: those whose functional
collectives all run on one tpu_dist group of the XLA transport (``compile/eager_split.py`` asks
``resolve``). Their program runs over that group's mesh (``compile/spmd.py``), and before its
first run the ranks compare the program's collective signature in one header exchange
(the group's ``check_program``): a mismatch raises ``CollectiveMismatchError`` on every rank,
within the group's timeout, instead of deadlocking inside XLA. Graphs on the host transport, on
several groups, or with an uneven ``all_to_all_single`` keep today's cut graphs (the collectives
run eagerly).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from torchtpu.distributed import xla
from torchtpu.eager.spmd import Spmd

c10d = torch.ops._c10d_functional


def _even(n: fx.Node) -> bool:
    splits = [*n.args[1], *n.args[2]]
    return all(isinstance(s, int) for s in splits) and len(set(splits)) <= 1


def resolve(nodes: list[fx.Node]) -> Spmd | None:
    """The Spmd to run a graph holding these collectives as one program, or None (cut it)."""
    names = set()
    for n in nodes:
        if n.target is c10d.wait_tensor.default:
            continue
        if n.target is c10d.all_to_all_single.default and not _even(n):
            return None
        names.add(n.kwargs.get("group_name", n.args[-1]))
    if len(names) != 1:
        return None
    try:
        group = dist.distributed_c10d._resolve_process_group(names.pop())
    except (RuntimeError, ValueError, KeyError):
        return None
    if not isinstance(group, xla.XlaProcessGroup):
        return None
    return group.spmd
