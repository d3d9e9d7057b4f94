"""Every error and warning torchtpu writes starts with a category from ``torchtpu.errors``.

The source is read, not run: a message written as a literal (a string, an f-string, or one
concatenated with more) where an exception or warning is made is a message without a category.
Those built by ``errors.message`` / ``errors.warn`` have one by construction, and so do
``ToolError``'s. Left alone:
``AttributeError`` (Python's attribute protocol reads it), ``ArgumentTypeError`` (argparse
prints it after the option's name), ``AssertionError`` (the conformance
runners' test assertions), and the reasons other sites put into messages of their own
(the ops' value checks, ``@check`` functions and the functions they call, which give CPU's
words and which the dispatcher prefixes; ``lowering/padding.py``'s ``Refused``).
"""

import ast
from pathlib import Path

from torchtpu import errors

ROOT = Path(__file__).resolve().parents[1]
EXEMPT_TYPES = {"AttributeError", "ArgumentTypeError", "AssertionError", "Refused",
                "ToolError"}
EXEMPT_FILES = {"torchtpu/lowering/checks.py"}


def _literal_start(node) -> str | None:
    """The text a literal message starts with ("" when it starts with a value); None when the
    message is not a literal."""
    if isinstance(node, ast.BinOp):
        return _literal_start(node.left)
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return first.value if isinstance(first, ast.Constant) else ""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _value_checks(tree: ast.Module) -> list:
    """The ``@check`` functions of a module and the module's functions they reach by name."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    todo = [f for f in defs.values() if any(
        isinstance(d, ast.Call) and getattr(d.func, "id", "") == "check" for d in f.decorator_list)]
    seen = {f.name for f in todo}
    for fn in todo:
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} | {
            n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and n.id in defs and n.id not in seen | local:
                seen.add(n.id)
                todo.append(defs[n.id])
    return todo


def _uncategorized(path: Path) -> list:
    found = []
    tree = ast.parse(path.read_text())
    in_checks = {id(n) for f in _value_checks(tree) for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in in_checks:
            continue
        if not isinstance(node, ast.Call) or not node.args:
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        via_errors = isinstance(fn, ast.Attribute) and getattr(fn.value, "id", "") == "errors"
        if via_errors or name in EXEMPT_TYPES:
            continue
        if not (name == "warn" or name.endswith(("Error", "Exception", "Warning"))):
            continue
        start = _literal_start(node.args[0])
        if start is not None and errors.category_of(start) is None:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}: {start[:50]!r}")
    return found


def test_every_message_has_a_category():
    files = [p for package in ("torchtpu", "torch_tpu") for p in (ROOT / package).rglob("*.py")]
    found = [site for p in sorted(files)
             if str(p.relative_to(ROOT)) not in EXEMPT_FILES for site in _uncategorized(p)]
    assert not found, "messages without a torchtpu.<category>: prefix (use errors.message):\n" \
        + "\n".join(found)


def test_categories_are_lowercase_words_with_cause_and_fix():
    for name, entry in errors.GLOSSARY.items():
        assert name.isalpha() and name.islower()
        assert entry.cause.endswith(".") and entry.fix.endswith(".")
        assert errors.category_of(errors.message(name, "x")) == name
