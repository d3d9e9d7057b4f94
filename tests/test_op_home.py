"""One home per op (issue 36): an op's rules live in its lowering record, and only
``registration.py`` registers anything with PyTorch."""

import ast
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_IMPORT_REGISTERS_NOTHING = """
import torch
import torchtpu.lowering
from torchtpu import registration

has = torch._C._dispatch_has_kernel_for_dispatch_key
declared = [("aten::geqrf", "Meta"), ("aten::_fused_sgd_", "Meta"),
            ("aten::_thnn_fused_gru_cell", "Meta"), ("aten::equal", "PrivateUse1"),
            ("aten::rrelu_with_noise", "PrivateUse1")]
assert not registration._state["loaded"]
before = [k for k in declared if has(*k)]
registration.ensure_loaded()
after = [k for k in declared if has(*k)]
print(before, len(after) == len(declared))
"""


def test_importing_the_lowering_modules_registers_nothing():
    # A fresh process: the suite's own has long loaded the device.
    out = subprocess.run([sys.executable, "-c", _IMPORT_REGISTERS_NOTHING], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert out.split("\n")[-2] == "[] True", out


# --------------------------------------------------------------------------- the AST scan
# Run ``python tests/test_op_home.py [ROOT]`` for the figures of a checkout (bench/RESULTS.md
# records them before and after issue 36).

# Modules outside lowering/ that may name ATen ops, each with its reason.
OP_NAMING_EXCEPTIONS = {
    "device/": "the device's own kernels (allocation, copies, views, equal) are registered per op",
    "compile/checkpoint.py": "builds the activation barrier's zero tie as FX nodes",
    "compile/spmd.py": "builds the flatten / cat / split of bucketed collectives as FX nodes",
    "compile/host_cones.py": "finds a CPU input the graph only copies to the device "
                             "(an aten._to_copy node) to send it at the call",
    "compile/eager_buckets.py": "routes aten.cat calls to the growing-cat kernel (padded_cat.py)",
    "eager/sdpa_routing.py": "routes scaled_dot_product_attention to the fused overload",
    "distributed/dtensor_sdpa.py": "DTensor's sharding strategy for the fused attention ops",
    "testing/checkpoint_memory.py": "selective checkpointing's policy saves aten.mm's outputs",
}
# Every way up is a field of the one interface, ``device/hooks.py``'s HOOKS: no module writes
# another module's attributes.
# The core layers, lowest first: an import from one into a later one is an arrow up.
_LAYERS = ("runtime", "device", "lowering", "eager", "compile")


def _modules(root: Path):
    for path in sorted((root / "torchtpu").rglob("*.py")):
        yield path.relative_to(root / "torchtpu").as_posix(), ast.parse(path.read_text())


def _aten_overloads(tree: ast.AST) -> set:
    """The ``aten.name.overload`` attribute chains a module holds."""
    return {f"{n.value.attr}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and isinstance(n.value.value, ast.Name)
            and n.value.value.id == "aten"}


def _aten_names(tree: ast.AST) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "aten") or (
                    isinstance(v, ast.Attribute) and v.attr == "aten"):
                names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"aten::\w+", node.value):
            names.add(node.value[6:])
    return names


def _imported_modules(tree: ast.AST) -> dict:
    """alias -> dotted torchtpu module, for ``import torchtpu.x as y`` / ``from torchtpu.x import
    y`` (y a module or not: only attribute writes through it are counted)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtpu"):
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torchtpu") and a.asname:
                    out[a.asname] = a.name
    return out


def figures(root: Path) -> dict:
    """Op names outside lowering/, overwritten slots of other modules, arrows up."""
    ops_outside, slots, arrows, homes = {}, set(), set(), {}
    for rel, tree in _modules(root):
        layer = rel.split("/")[0]
        if not _excepted(rel):
            for op in _aten_overloads(tree):
                homes.setdefault(op, set()).add(rel)
        if layer != "lowering":
            names = _aten_names(tree)
            if names:
                ops_outside[rel] = names
        aliases = _imported_modules(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id in aliases:
                    slots.add((aliases[t.value.id], t.attr))
            mod = node.module if isinstance(node, ast.ImportFrom) else None
            if mod and mod.startswith("torchtpu.") and layer in _LAYERS:
                up = mod.split(".")[1]
                if up in _LAYERS and _LAYERS.index(up) > _LAYERS.index(layer):
                    arrows.add((rel, mod))
    # Per op, the modules that hold its rules (the exceptions serve or route ops, hold none).
    return {"ops_outside": ops_outside, "slots": slots, "arrows": arrows, "homes": homes}


def _excepted(rel: str) -> bool:
    return any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in OP_NAMING_EXCEPTIONS)


def test_no_module_outside_lowering_names_an_op():
    found = figures(ROOT)["ops_outside"]
    assert {rel: sorted(n) for rel, n in found.items() if not _excepted(rel)} == {}
    # Every exception is still needed.
    assert {e for e in OP_NAMING_EXCEPTIONS if not any(
        rel == e or (e.endswith("/") and rel.startswith(e)) for rel in found)} == set()


def test_each_value_check_sits_in_its_ops_family_file():
    # An op's @check is declared in the module that lowers it; an op without a lowering (its
    # decomposition's pieces have one) in the module that lowers another overload of it, or in
    # some family module. lowering/checks.py keeps the pieces checks share and names no op.
    import torchtpu.lowering  # noqa: F401  (fills the table)
    from torchtpu.lowering import registry

    by_packet: dict = {}
    for op, low in registry.TABLE.items():
        by_packet.setdefault(op.overloadpacket, set()).add(low.family)
    every = set().union(*by_packet.values())
    elsewhere = {}
    for op, fn in registry.CHECKS.items():
        home = fn.__module__.rsplit(".", 1)[-1]
        low = registry.TABLE.get(op)
        if home not in ({low.family} if low else by_packet.get(op.overloadpacket, every)):
            elsewhere[str(op)] = home
    assert elsewhere == {}
    assert _aten_names(ast.parse((ROOT / "torchtpu/lowering/checks.py").read_text())) == set()


def test_lower_layers_call_up_through_one_interface():
    f = figures(ROOT)
    assert {s for s in f["slots"] if s[0] != "torchtpu.device.hooks.HOOKS"} == set()
    assert f["arrows"] == set()


if __name__ == "__main__":
    f = figures(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    ops = f["ops_outside"]
    outside = {rel: n for rel, n in ops.items() if not _excepted(rel)}
    print(f"op names outside lowering/: {sum(map(len, ops.values()))} in {len(ops)} modules; "
          f"outside the listed exceptions: {sum(map(len, outside.values()))} in "
          f"{len(outside)} modules {sorted(outside)}")
    print(f"slots of other modules overwritten: {len(f['slots'])} {sorted(f['slots'])}")
    print(f"arrows up: {len(f['arrows'])} {sorted(f['arrows'])}")
    spans = collections.Counter(len(m) for m in f["homes"].values())
    print(f"modules holding one op's rules: {dict(sorted(spans.items()))} (modules: ops); "
          f"in more than one package: "
          f"{sum(len({r.split('/')[0] for r in m}) > 1 for m in f['homes'].values())} ops")
