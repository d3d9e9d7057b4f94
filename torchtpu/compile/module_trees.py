"""Each module's ``modules()``, walked again only when its tree changed.

A whole step's signature (``compile/whole_step.py``) holds the train/eval mode of every module
it can reach, so each call listed every submodule of every module among its arguments and its
function's globals and closure: ``Module.modules()`` is a Python generator with a memo set, ~1
µs a module (a transformer of a few hundred modules: hundreds of µs a call, before any work).

``ModuleTrees`` keeps each root's list with a snapshot of what the walk read: every listed
module's ``_modules`` children, in order. ``named_modules`` (which ``modules()`` runs) visits
exactly those, so while each listed module's children are the very objects of the snapshot
(one C-level identity pass) the walk would list the same modules in the same order. A module
class that overrides the walk itself is walked every time.
"""

from __future__ import annotations

import functools
import itertools
import operator

import torch

_CHILDREN = operator.attrgetter("_modules")
_PARAMETERS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
_STORAGE = torch.Tensor.untyped_storage
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NOT_NONE = functools.partial(operator.is_not, None)  # (a bias=False layer's bias)
_WALK = (torch.nn.Module.modules, torch.nn.Module.named_modules)
_MAX_ROOTS = 16


def _children(modules: list) -> list:
    return list(itertools.chain.from_iterable(map(dict.values, map(_CHILDREN, modules))))


class ModuleTrees:
    """``root.modules()`` per root, cached while the tree under it is unchanged."""

    def __init__(self) -> None:
        self._trees: dict = {}  # id(root) -> (root, its modules, their children then)

    def modules(self, root: torch.nn.Module) -> list:
        tree = self._trees.get(id(root))
        if tree is not None and tree[0] is root:
            try:
                now = _children(tree[1])
            except (AttributeError, TypeError):  # a module's _modules is no dict any more
                now = None
            if now is not None and len(now) == len(tree[2]) \
                    and all(map(operator.is_, now, tree[2])):
                return tree[1]
        modules = list(root.modules())
        if all((type(m).modules, type(m).named_modules) == _WALK for m in modules):
            if len(self._trees) >= _MAX_ROOTS:  # (roots passed once each: hold none forever)
                self._trees.clear()
            self._trees[id(root)] = (root, modules, _children(modules))
        return modules


def held(modules: list) -> list:
    """The modules' parameters and buffers, their storages and ``requires_grad`` flags, one
    flat list that stays the very same objects (``operator.is_``) while none was replaced or
    toggled."""
    tensors = list(filter(_NOT_NONE, itertools.chain(
        itertools.chain.from_iterable(map(dict.values, map(_PARAMETERS, modules))),
        itertools.chain.from_iterable(map(dict.values, map(_BUFFERS, modules))))))
    return [*tensors, *map(_STORAGE, tensors), *map(_REQUIRES_GRAD, tensors)]


def same(now: list, then: list) -> bool:
    return len(now) == len(then) and all(map(operator.is_, now, then))
