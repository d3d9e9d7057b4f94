"""``torchtpu.settings``: every ``TORCHTPU_*`` variable declared once and read only through its
declaration (an AST scan of the package), each parsed one way at call time, a bad value refused
naming the variable, the in-process overrides scoped, and docs/reference.md's table the
declarations'."""

import ast
import os
import re
from pathlib import Path

import pytest

from torchtpu import settings

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torchtpu", "torch_tpu", "torchtpu_artifact")
_NAME = re.compile(r"TORCHTPU_[A-Z0-9_]+")
# TORCHTPU_ names in the package that are no environment variable
NOT_VARIABLES = {"TORCHTPU_ATTN": "the name vLLM knows torchtpu's attention backend by"}


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != ROOT / "torchtpu" / "settings.py":
                yield path, ast.parse(path.read_text())


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _names_torchtpu_variable(node: ast.AST) -> bool:
    """Whether an expression names a TORCHTPU_ variable: a string holding one, or a
    declaration's ``.name``."""
    for part in ast.walk(node):
        if isinstance(part, ast.Constant) and isinstance(part.value, str) \
                and "TORCHTPU_" in part.value:
            return True
        if isinstance(part, ast.Attribute) and part.attr == "name" and \
                isinstance(part.value, ast.Attribute) and \
                isinstance(part.value.value, ast.Name) and part.value.value.id == "settings":
            return True
    return False


def _environ_keys(tree: ast.AST):
    """(line, key expression) for each read or write of the environment by key."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and _is_environ(fn.value) and node.args:
                yield node.lineno, node.args[0]  # get, pop, setdefault
            if isinstance(fn, ast.Attribute) and _is_environ(fn.value) and fn.attr == "update":
                for keyword in node.keywords:
                    if keyword.arg and keyword.arg.startswith("TORCHTPU_"):
                        yield node.lineno, ast.Constant(keyword.arg)
            if isinstance(fn, ast.Attribute) and fn.attr in ("getenv", "putenv", "unsetenv") \
                    and node.args:
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            yield node.lineno, node.left


def test_only_settings_reads_or_writes_a_torchtpu_variable_in_the_environment():
    found = [f"{path.relative_to(ROOT)}:{line}" for path, tree in _modules()
             for line, key in _environ_keys(tree) if _names_torchtpu_variable(key)]
    assert not found, f"read TORCHTPU_* through torchtpu.settings, not os.environ: {found}"


def test_no_module_spells_a_variable_name_as_a_key():
    """A variable's name as a whole string (a key, a constant) appears only in its declaration:
    elsewhere it is ``settings.X.name``, so every use is found from the declaration."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}"
             for path, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and _NAME.fullmatch(node.value) and node.value not in NOT_VARIABLES]
    assert not found, found


def test_every_torchtpu_name_in_the_package_is_declared_and_every_declaration_used():
    """Names in code, docstrings and messages alike; and no declaration nothing reads."""
    named = {name for path, _ in _modules() for name in _NAME.findall(path.read_text())}
    assert named - {s.name for s in settings.declared()} - set(NOT_VARIABLES) == set()
    used = {node.attr for _, tree in _modules() for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "settings"}
    assert {s.name.removeprefix("TORCHTPU_") for s in settings.declared()} - used == set()


def test_each_declaration_is_its_module_attribute():
    for setting in settings.declared():
        assert getattr(settings, setting.name.removeprefix("TORCHTPU_")) is setting
        assert settings.named(setting.name) is setting
        assert setting.meaning.endswith(".") and "|" not in setting.meaning
    with pytest.raises(ValueError, match="not a new TORCHTPU_ name"):
        settings.Flag("TORCHTPU_DEBUG", False, "again.")


def test_the_reference_page_lists_the_declarations():
    page = (ROOT / "docs" / "reference.md").read_text()
    assert settings.reference_markdown() in page
    rows = [line for line in settings.reference_markdown().splitlines()[2:]]
    assert len(rows) == len(settings.declared())
    assert "| `TORCHTPU_CPU_FALLBACK` | `warn` \\| `error` \\| `silent` | `warn` |" in page


def test_a_switch_reads_1_0_and_words_at_call_time(monkeypatch):
    monkeypatch.delenv("TORCHTPU_FUSED_STEPS", raising=False)
    assert settings.FUSED_STEPS.get() is True  # the default
    for text, value in (("0", False), ("1", True), (" off ", False), ("TRUE", True),
                        ("no", False), ("", True)):
        monkeypatch.setenv("TORCHTPU_FUSED_STEPS", text)
        assert settings.FUSED_STEPS.get() is value, text
    monkeypatch.setenv("TORCHTPU_FUSED_STEPS", "2")
    with pytest.raises(ValueError, match=r"torchtpu.config: TORCHTPU_FUSED_STEPS='2' is not 0 "
                                         r"or 1"):
        settings.FUSED_STEPS.get()
    monkeypatch.delenv("TORCHTPU_VLLM", raising=False)
    assert settings.VLLM.get() is None  # unset: the caller decides (the installer's marker)
    monkeypatch.setenv("TORCHTPU_DEBUG", "1")
    assert settings.DEBUG.get() is True


def test_numbers_and_choices(monkeypatch):
    monkeypatch.setenv("TORCHTPU_LOCAL_DEVICE", " 3 ")
    assert settings.LOCAL_DEVICE.get() == 3
    monkeypatch.setenv("TORCHTPU_LOCAL_DEVICE", "three")
    with pytest.raises(ValueError, match="TORCHTPU_LOCAL_DEVICE='three' is not an integer"):
        settings.LOCAL_DEVICE.get()
    monkeypatch.delenv("TORCHTPU_TPU_PROCESS_PORT", raising=False)
    assert settings.TPU_PROCESS_PORT.get() == 8476
    monkeypatch.setenv("TORCHTPU_SLOW_COMPILE_S", "2.5")
    assert settings.SLOW_COMPILE_S.get() == 2.5
    monkeypatch.setenv("TORCHTPU_SLOW_COMPILE_S", "soon")
    with pytest.raises(ValueError, match="'soon' is not a number of seconds"):
        settings.SLOW_COMPILE_S.get()
    monkeypatch.setenv("TORCHTPU_PLATFORM", "CPU")
    assert settings.PLATFORM.get() == "cpu"
    monkeypatch.setenv("TORCHTPU_PLATFORM", "npu")
    with pytest.raises(ValueError, match="TORCHTPU_PLATFORM='npu' is not one of tpu, gpu, cpu"):
        settings.PLATFORM.get()
    monkeypatch.setenv("TORCHTPU_DUMP", " /tmp/x ")
    assert settings.DUMP.get() == "/tmp/x"


def test_an_override_is_scoped_nested_and_checked(monkeypatch):
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "warn")
    with settings.CPU_FALLBACK.overridden("error"):
        assert settings.CPU_FALLBACK.get() == "error"
        with settings.CPU_FALLBACK.overridden("silent"):
            assert settings.CPU_FALLBACK.get() == "silent"
            assert settings.active_overrides() == {"TORCHTPU_CPU_FALLBACK": "silent"}
        assert settings.CPU_FALLBACK.get() == "error"
    assert settings.CPU_FALLBACK.get() == "warn" and settings.active_overrides() == {}
    with pytest.raises(ValueError, match="TORCHTPU_CPU_FALLBACK='sometimes' is not one of"):
        with settings.CPU_FALLBACK.overridden("sometimes"):
            pass
    assert settings.active_overrides() == {}


def test_the_fallback_policy_reads_the_override_and_the_tools_use_it(monkeypatch):
    from torchtpu.eager import fallback
    from torchtpu.testing import conformance

    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "warn")
    with conformance.fallback_as_error():
        assert fallback.policy() == "error"
        with fallback.allowed(True):  # the reference's block still wins inside
            assert fallback.policy() == "warn"
    assert fallback.policy() == "warn"


def test_only_a_variable_torchtpu_sets_is_written(monkeypatch):
    monkeypatch.delenv("TORCHTPU_VLLM", raising=False)
    assert settings.child_env({settings.VLLM: True, settings.DIST_TRANSPORT: "xla"}) == \
        {"TORCHTPU_VLLM": "1", "TORCHTPU_DIST_TRANSPORT": "xla"}
    with settings.VLLM.exported(False):
        assert settings.VLLM.get() is False
    assert "TORCHTPU_VLLM" not in os.environ
    with pytest.raises(ValueError, match="TORCHTPU_CPU_FALLBACK is the user's to set"):
        settings.child_env({settings.CPU_FALLBACK: "error"})
    with pytest.raises(ValueError, match="TORCHTPU_DIST_TRANSPORT='grpc' is not one of"):
        settings.child_env({settings.DIST_TRANSPORT: "grpc"})
