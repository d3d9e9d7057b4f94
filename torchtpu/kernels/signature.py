"""A JAX function's type annotations as a ``torch.library`` schema.

``jax.Array`` is ``Tensor``; ``int``, ``float``, ``bool`` and ``str`` are themselves;
``Optional[X]`` is ``X?``; a homogeneous ``tuple[X, ...]`` is ``X[]``. The return annotation is a
``jax.Array`` or a fixed tuple of them. Anything else (or a missing annotation) is a ValueError
that names the function, the parameter and what to write instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable

import jax

from torchtpu import errors

_SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    type: str            # the schema type: "Tensor", "Tensor?", "int[]", ...
    default: object = inspect.Parameter.empty

    @property
    def is_tensor(self) -> bool:
        return self.type in ("Tensor", "Tensor?")

    def schema(self) -> str:
        if self.default is inspect.Parameter.empty:
            return f"{self.type} {self.name}"
        return f"{self.type} {self.name}={_default_text(self.default)}"


@dataclasses.dataclass(frozen=True)
class Signature:
    params: tuple[Param, ...]
    returns: tuple[str, ...]     # one schema type per result
    single: bool                 # the function returns one array, not a tuple

    def schema(self) -> str:
        args = ", ".join(p.schema() for p in self.params)
        rets = self.returns[0] if self.single else f"({', '.join(self.returns)})"
        return f"({args}) -> {rets}"

    @property
    def tensor_positions(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.params) if p.is_tensor)


def _default_text(v) -> str:
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_default_text(x) for x in v) + "]"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def _is_array(t) -> bool:
    return t is jax.Array


def _optional_of(t):
    """X for Optional[X] / X | None, else None."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(t) if a is not type(None)]
        if len(members) == 1 and len(typing.get_args(t)) == 2:
            return members[0]
    return None


def _base_type(t) -> str | None:
    if _is_array(t):
        return "Tensor"
    if t in _SCALARS:
        return _SCALARS[t]
    if typing.get_origin(t) is tuple:
        args = typing.get_args(t)
        if len(args) == 2 and args[1] is Ellipsis:
            inner = _base_type(args[0])
            if inner is not None and not inner.endswith("[]") and inner != "str":
                return inner + "[]"
    return None


def param_type(t) -> str | None:
    """The schema type for an annotation, or None if it has none."""
    inner = _optional_of(t)
    if inner is not None:
        base = _base_type(inner)
        return None if base is None else base + "?"
    return _base_type(t)


_HOW = ("annotate it as jax.Array, int, float, bool, str, Optional[...] of those, or "
        "tuple[X, ...] of one of them")


def from_function(name: str, fn: Callable) -> Signature:
    """The schema of fn from its annotations (see the module doc)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: cannot read the type annotations of {fn!r}: {e}")) \
            from e
    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(errors.message(
                "kernel", f"jax_op {name!r}: *{p.name} / **{p.name} cannot be part of a torch "
                "op schema; give each argument its own annotated parameter"))
        if p.name not in hints:
            raise ValueError(errors.message(
                "kernel", f"jax_op {name!r}: parameter {p.name!r} of {fn.__qualname__} has no "
                f"type annotation; {_HOW}"))
        t = param_type(hints[p.name])
        if t is None:
            raise ValueError(errors.message(
                "kernel", f"jax_op {name!r}: parameter {p.name!r} is annotated "
                f"{hints[p.name]!r}, which has no torch schema type; {_HOW}"))
        default = p.default
        if isinstance(default, list):
            default = tuple(default)
        params.append(Param(p.name, t, default))
    if "return" not in hints:
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: {fn.__qualname__} has no return annotation; annotate "
            "it -> jax.Array or -> tuple[jax.Array, jax.Array] (one per result)"))
    ret = hints["return"]
    if _is_array(ret):
        returns, single = ("Tensor",), True
    elif typing.get_origin(ret) is tuple and typing.get_args(ret) and all(
            _is_array(a) for a in typing.get_args(ret)):
        returns, single = ("Tensor",) * len(typing.get_args(ret)), False
    else:
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: return annotation {ret!r} is not a jax.Array or a "
            "fixed tuple of them (tuple[jax.Array, jax.Array])"))
    sig = Signature(tuple(params), returns, single)
    if not any(p.type.startswith("Tensor") for p in sig.params):
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: {fn.__qualname__} takes no jax.Array; a tpu op needs "
            "at least one tensor argument to run on the device"))
    return sig
