"""How DeferAndFuse's recording becomes one program (``eager/defer.py`` records; this builds).

``replay`` is the fused function: the recorded calls in order, returning the wanted outputs.
``donatable`` picks the inputs (and kept spare buffers) whose buffers the program may take, and
``in_place_order`` orders the outputs so that each donated input's buffer goes to the output that
updates it, which JAX pairs by shape in argument order. ``committed`` places the arrays an earlier
program left uncommitted. ``keyed`` is the jitted program, known in a new process by what it
traces, so that a warm cache loads its executable without tracing or lowering it.
"""

from __future__ import annotations

import collections
import sys

import jax
from jax._src.array import ArrayImpl

from torchtpu.cache import warm_dispatch, warm_keys


def replay(nodes: tuple, wanted: tuple):
    """The fused function: every recorded call in order, returning the wanted outputs."""

    def defer_and_fuse(*inputs):
        values = []
        for fn, tree, refs in nodes:
            args = [inputs[r] if r.__class__ is int else values[r[0]][r[1]] for r in refs]
            if tree is not None:
                args = tree.unflatten(args)
            values.append(jax.tree_util.tree_leaves(fn(*args)))
        return [values[n][leaf] for n, leaf in wanted]

    return defer_and_fuse


def keyed(nodes: tuple, outs: tuple, donate: tuple):
    """replay(nodes, outs) jitted, donating donate, called through JAX's per-signature dispatch
    whose misses load the executable by key when a warm cache has it (``warm_dispatch``).

    The key names every fact the trace depends on: each call's program (its ``warm_keys.named``
    parts: op, spec, view geometry), its argument structure and where each argument comes from
    (an input's position, an earlier call's output), the outputs in program order and the
    donated positions; ``warm.compiled_for`` adds each input's shape, dtype and weak type, the
    JAX settings, the compiler options and the fingerprint (versions, torchtpu's source). A
    number a call takes is either its spec's constant (in the parts) or an input of the program
    (``numbers.py``). A recording naming a program with no stable form (a closure) has no key:
    jit traces it in every process.
    """
    # keep_unused: the appended spares are parameters only so that XLA can alias them.
    jitted = jax.jit(replay(nodes, outs), donate_argnums=donate, keep_unused=True)
    return warm_dispatch.dispatched(warm_keys.named(jitted, "deferred", nodes, outs, donate))


def committed(inputs: list) -> tuple[list, frozenset]:
    """(inputs, with the arrays that are not committed to a device committed to the device of
    the others; the positions so placed). JAX commits no result that depends on no input
    (``torch.randn``'s), and a program keys its executable by its inputs' commitment: an
    optimizer's first step, reading the zeros its state starts as, would compile again at the
    next step, reading its own results. A placed array is a new object over the same buffer:
    where something outside the recording (a storage that is read, not replaced) still holds the
    old object, ``donatable`` must not take it (the new one's refcount says nothing of the old).
    Where nothing does (an optimizer's zeros, replaced in place), it is donated as any input:
    else the next step, donating its own results there, would compile the program again."""
    # (``_committed``, the attribute ``committed`` reads: the property is a Python step an
    # input, ~440 an optimizer step's program.)
    loose = [i for i, x in enumerate(inputs) if x.__class__ is ArrayImpl and not x._committed]
    if not loose:
        return inputs, frozenset()
    devices = {d for x in inputs if x.__class__ is ArrayImpl and x._committed
               for d in x.devices()}
    if len(devices) != 1:
        return inputs, frozenset()
    device = devices.pop()
    # References to a loose array the caller's list alone holds: that list and the argument.
    held = frozenset(i for i in loose if sys.getrefcount(inputs[i]) > 2)
    inputs = list(inputs)
    for i in loose:
        inputs[i] = jax.device_put(inputs[i], device)
    return inputs, held


def donatable(inputs: list, targets: list, spares: list, placed: frozenset = frozenset()
              ) -> tuple:
    """Inputs nothing outside the recording holds, with an output of the same shape to reuse,
    but those at ``placed`` (``committed``'s); then, for outputs still without one, spares
    nothing holds, appended to inputs (the program does not read them: only their buffers are
    taken).

    Which spares are appended is canonical (by shape, in the order the outputs first have
    it), so that the program, which depends only on their shapes, is the same every step."""
    free: dict = {}
    for p in targets:
        k = (p.shape, p.dtype)
        free[k] = free.get(k, 0) + 1
    donate = []
    for i in range(len(inputs)):
        x = inputs[i]
        # References: the inputs list, x and getrefcount's argument (enumerate would add one).
        # (A computed array's shape and dtype from its aval: the properties are Python steps,
        # ~670 inputs an optimizer step's program.)
        exact = x.__class__ is ArrayImpl
        if (exact or isinstance(x, jax.Array)) and sys.getrefcount(x) <= 3 and i not in placed:
            k = (x.aval.shape, x.aval.dtype) if exact else (x.shape, x.dtype)
            if free.get(k):
                free[k] -= 1
                donate.append(i)
    dead: dict = {}
    for i in range(len(spares)):
        x = spares[i]
        if sys.getrefcount(x) <= 3:  # the spares list, x and the argument
            dead.setdefault((x.shape, x.dtype), []).append(x)
    for k, n in free.items():
        for x in dead.get(k, ())[:n]:
            donate.append(len(inputs))
            inputs.append(x)
    return tuple(donate)


def _origin(nodes: list, node: int, leaf: int, memo: dict):
    """The input whose storage the value (node, leaf) replaces, if it is an in-place update.

    In-place ops and view writes take the tensor they write as their first argument, a foreach
    op's i-th output writes its i-th: following those back from an output reaches the input it
    updates (or a number, or None). Only a guess, used to pair buffers: never for values.
    """
    path, key = [], (node, leaf)
    while key not in memo:
        path.append(key)
        refs = nodes[key[0]][2]
        if not refs:
            found = None
            break
        r = refs[key[1]] if key[1] < len(refs) else refs[0]
        if r.__class__ is int:
            found = r
            break
        key = r
    else:
        found = memo[key]
    for k in path:
        memo[k] = found
    return found


def in_place_order(nodes: list, wanted: tuple, targets: list, inputs: list,
                    donate: tuple) -> list:
    """The outputs in the order that pairs each donated input with the output updating it.

    JAX gives the donated inputs of one shape, in argument order, to the outputs of that shape,
    in output order; a parameter's buffer handed to another parameter's new value makes XLA copy
    both (an AdamW update ran 4 extra 32 MB copies). Outputs that update a donated input in
    place come first, in that input's order; each other donated input takes the next free output
    of its shape; the rest follow.
    """
    memo: dict = {}
    claimed: dict = {}   # donated input -> output
    donated = set(donate)
    for j, (n, leaf) in enumerate(wanted):
        i = _origin(nodes, n, leaf, memo)
        x = inputs[i] if i in donated and i not in claimed else None
        if x is not None and (x.shape, x.dtype) == (targets[j].shape, targets[j].dtype):
            claimed[i] = j
    taken = set(claimed.values())
    free: dict = {}      # shape -> outputs of it no donated input claimed, in order
    for j, p in enumerate(targets):
        if j not in taken:
            free.setdefault((p.shape, p.dtype), collections.deque()).append(j)
    order = []
    for i in sorted(donate):
        j = claimed.get(i)
        order.append(j if j is not None else free[(inputs[i].shape, inputs[i].dtype)].popleft())
    return order + sorted(j for js in free.values() for j in js)
