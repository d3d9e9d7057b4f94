"""Higher-order ops of a compiled graph: ``torch.ops.higher_order.scan`` as one XLA while loop.

Dynamo hands ``torch._higher_order_ops.scan`` to the backend as one node whose first argument
is the body's own FX graph (``combine_fn(*carry, *x_slices, *additional_inputs) ->
(*next_carry, *ys)``); AOTAutograd writes its backward as another scan over the reversed
residuals, so forward and backward both reach here. The body becomes a nested
``GraphFunction`` traced once inside ``jax.lax.scan``: XLA compiles the body once, whatever the
number of iterations, which is what keeps a deep model's compile time flat in its depth.

What the body needs from the enclosing program comes through it: the Python numbers its ops
trace are inputs of the outer program (popped in order, as every node's are), and each random
draw in the body takes one key of the outer program, folded with the iteration index so every
iteration draws afresh. Checks of data inside the body give one flag per iteration; the first
failing iteration's flag is the node's.

The partitioner's RNG wrappers are the other higher-order ops: a region that activation
checkpointing recomputes in the backward and that draws random numbers (dropout,
``scaled_dot_product_attention``, tagged ``nondeterministic_seeded``) becomes
``run_and_save_rng_state(op, *args)`` in the forward graph, returning the RNG state beside the
op's result, and ``run_with_rng_state(state, op, *args)`` in the backward, which must draw the
same numbers. Here the inner op is an ordinary step of the lowering table; the state is the key
data it drew (the forward program's inputs), laid into the bytes of the state tensor AOTAutograd
expects, and the backward's step draws from the keys it reads back from that tensor: the
recomputation is exact, and neither program asks the host for a state.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx as fx

from torchtpu.device import dtypes

SCAN = torch.ops.higher_order.scan
RUN_AND_SAVE_RNG = torch.ops.higher_order.run_and_save_rng_state
RUN_WITH_RNG = torch.ops.higher_order.run_with_rng_state
_HIGHER_ORDER = (SCAN, RUN_AND_SAVE_RNG, RUN_WITH_RNG)

# Bytes of one key's data (4 uint32 words) inside an RNG state tensor.
_KEY_BYTES = 16


def is_higher_order(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _HIGHER_ORDER


def higher_order_step(node: fx.Node, key_slots: list, graph_function: type, plain_step: type):
    """The step serving a higher-order node (``plain_step`` serves the ops the RNG wrappers
    apply, ``graph_function`` scan's body)."""
    if node.target is SCAN:
        return ScanStep(node, key_slots, graph_function)
    return RngStateStep(node, key_slots, plain_step)


def _view_of(op):
    """The view op whose value ``op`` (a functionalized ``X_copy``) computes, or None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op._schema.name.split("::")[1]
    if not name.endswith("_copy") or name in ("_to_copy", "lift_fresh_copy"):
        return None
    packet = getattr(torch.ops.aten, name[:-len("_copy")], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _views_for_copies(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with each functionalized view (``t_copy``, ``expand_copy``...) as its view op:
    AOTAutograd writes a body's views that way; in a JAX program the two are the same value,
    and the views are the ones the graph ops serve."""
    for n in gm.graph.nodes:
        view = _view_of(n.target) if n.op == "call_function" else None
        if view is not None:
            n.target = view
    return gm


def _iteration_key(data, i):
    """Key data (4 uint32 words, ``eager.program.prng_key``'s form) for iteration i of a draw."""
    key = jax.random.fold_in(jax.random.wrap_key_data(data[:2], impl="threefry2x32"), i)
    folded = jax.random.key_data(key)
    return jnp.concatenate([folded, data[2:]]).astype(np.uint32)


def _first_failure(flags):
    """One [bad, value] flag from one per iteration: the first failing iteration's."""
    return flags[jnp.argmax(flags[:, 0] != 0)]


def _as(x, val):
    # The carry's type must match exactly across iterations (no weak types, no promotion).
    return jax.lax.convert_element_type(x, dtypes.to_jax(val.dtype))


class ScanStep:
    """One scan node, prepared once (the body's GraphFunction); ``run`` evaluates it."""

    # What the graph's passes read of a step (an ATen op's lowering, its traced arguments).
    lowering = None
    traced = frozenset()

    def __init__(self, node: fx.Node, key_slots: list, graph_function: type) -> None:
        self.node = node
        combine, init, xs, additional = node.args
        body_gm = getattr(node.graph.owning_module, combine.target)
        self.body = graph_function(_views_for_copies(body_gm))
        if self.body.constants:
            raise NotImplementedError(
                "torchtpu.compile: a scan body holding tensor constants "
                f"({[n.target for n in self.body.constants]}) is not supported; pass them as "
                "inputs of the scanned function")
        if self.body.mutations:
            raise NotImplementedError(
                "torchtpu.compile: a scan body that mutates its inputs is not supported")
        self.init, self.xs, self.additional = list(init), list(xs), list(additional)
        self.carry_vals = [n.meta["val"] for n in self.init]
        self.key_slots = []
        for _ in self.body.key_nodes:
            self.key_slots.append(len(key_slots))
            key_slots.append(node)
        self.check = True if self.body.checked else None
        self._flags: list = []

    def scalar_args(self) -> list:
        return list(self.body.scalars)

    def device_checks(self, env: dict) -> list:
        """(flag, error) for each check of data in the body, set when ``run`` traced it."""
        return list(zip(self._flags, [e for _, e in self.body.check_errors], strict=True))

    def run(self, env: dict, keys: tuple, scalars: list) -> list:
        body = self.body
        n_scalars = len(body.scalars)
        body_scalars = tuple(scalars[:n_scalars])
        del scalars[:n_scalars]
        body_keys = [keys[k] for k in self.key_slots]
        extra = [env[n] if isinstance(n, fx.Node) else n for n in self.additional]
        n_carry, n_checks = len(self.init), len(body.checked)
        xs = [env[n] for n in self.xs]
        length = xs[0].shape[0]

        def step(carry, sliced):
            i, x = sliced
            inputs = [*carry, *x, *extra]
            arrays = tuple(v for v, t in zip(inputs, body.tensor_inputs, strict=True) if t)
            symbols = tuple(v for v, t in zip(inputs, body.tensor_inputs, strict=True) if not t)
            iteration_keys = tuple(_iteration_key(k, i) for k in body_keys)
            outs = body.run(arrays, (), body_scalars, iteration_keys, symbols)
            flags = outs[len(outs) - n_checks:] if n_checks else []
            outs = outs[:len(outs) - n_checks]
            new_carry = tuple(_as(o, v) for o, v in zip(outs[:n_carry], self.carry_vals,
                                                        strict=True))
            return new_carry, (tuple(outs[n_carry:]), tuple(flags))

        init = tuple(_as(env[n], v) for n, v in zip(self.init, self.carry_vals, strict=True))
        carry, (ys, flags) = jax.lax.scan(
            step, init, (jnp.arange(length, dtype=np.uint32), tuple(xs)), length=length)
        self._flags = [_first_failure(f) for f in flags]
        return [*carry, *ys]



class _Call:
    """The op an RNG wrapper applies, standing as a node of its own (what a step is built of)."""

    op = "call_function"

    def __init__(self, target, args: tuple, kwargs: dict, val) -> None:
        self.target, self.args, self.kwargs = target, tuple(args), dict(kwargs)
        self.meta = {"val": val}


def _val(v):
    return v.meta.get("val") if isinstance(v, fx.Node) else v


def _call_value(node: fx.Node, op, args: tuple, kwargs: dict):
    """The fake value of op's result: the wrapper's own (run_with_rng_state's), the user that
    takes it from run_and_save_rng_state's pair, or op run on its arguments' fake values (the
    partitioner gives its new nodes none)."""
    if node.target is RUN_AND_SAVE_RNG:
        for user in node.users:
            if user.target is operator.getitem and user.args[1] == 1 and "val" in user.meta:
                return user.meta["val"]
    elif "val" in node.meta:
        return node.meta["val"]
    return op(*fx.node.map_arg(args, _val), **fx.node.map_arg(kwargs, _val))


class RngStateStep:
    """One ``run_and_save_rng_state`` / ``run_with_rng_state`` node (see the module docstring)."""

    lowering = None
    traced = frozenset()

    def __init__(self, node: fx.Node, key_slots: list, plain_step: type) -> None:
        self.node = node
        self.saves = node.target is RUN_AND_SAVE_RNG
        op, *args = node.args if self.saves else node.args[1:]
        call = _Call(op, args, node.kwargs, _call_value(node, op, args, node.kwargs))
        # The forward's op draws its keys as any op does; the backward's, from the state only.
        start = len(key_slots)
        self.inner = plain_step(call, key_slots if self.saves else [])
        key_slots[start:] = [node] * (len(key_slots) - start)  # the graph's node draws them
        self.n_keys = len(self.inner.key_slots)
        state = (_state_value(node) if self.saves else _val(node.args[0]))
        if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8
                and state.numel() >= self.n_keys * _KEY_BYTES):
            raise NotImplementedError(
                f"torchtpu.compile: {node.target.name()} of {op} with an RNG state "
                f"{getattr(state, 'dtype', state)}{list(getattr(state, 'shape', ()))} that cannot "
                f"hold its {self.n_keys} key(s)")
        self.state_shape = tuple(state.shape)
        self.check = getattr(self.inner, "check", None)
        self.dtypes = self.inner.dtypes

    def scalar_args(self) -> list:
        return self.inner.scalar_args()

    def device_checks(self, env: dict) -> list:
        return self.inner.device_checks(env)

    def run(self, env: dict, keys: tuple, scalars: list):
        if not self.saves:
            state = env[self.node.args[0]].reshape(-1)[:self.n_keys * _KEY_BYTES]
            words = jax.lax.bitcast_convert_type(state.reshape(self.n_keys, 4, 4), np.uint32)
            return self.inner.run(env, tuple(words), scalars)
        out = self.inner.run(env, keys, scalars)
        drawn = [jax.lax.bitcast_convert_type(jnp.asarray(keys[k], np.uint32), np.uint8)
                 for k in self.inner.key_slots]
        size = int(np.prod(self.state_shape))
        state = jnp.zeros(size - self.n_keys * _KEY_BYTES, np.uint8)
        state = jnp.concatenate([*(d.reshape(-1) for d in drawn), state])
        return state.reshape(self.state_shape), out


def _state_value(node: fx.Node):
    """The fake RNG state run_and_save_rng_state returns (its user taking element 0)."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == 0:
            return user.meta.get("val")
    return None
