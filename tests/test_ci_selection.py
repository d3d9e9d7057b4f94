"""Every test file that skips without an extra runs in the CI stage that installs it (issue 49).

Main's stage installs the extras in ``.ci/run``'s ``MAIN_REQUIRE``; a test that skips without any
other package (vLLM, SGLang, verl, TorchTitan, Ray, TRL, libtpu...) passes main as a skip, so
unless ``.ci/run`` names its file in a stage that installs that package, breaking what it guards
passes CI. This scan reads each test file's ``pytest.importorskip("x")`` and
``importlib.util.find_spec("x")`` and asks ``.ci/run`` to name the file.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()

# Always in main's venv: the core's own dependencies and what its dev extra brings.
_CORE = {"jax", "numpy", "torch", "pytest", "mkdocs"}


def _main_extras() -> set[str]:
    line = re.search(r"^MAIN_REQUIRE=(\S+)$", CI, re.M)
    assert line, ".ci/run no longer sets MAIN_REQUIRE: this scan must learn its new form"
    return {name.split(".")[0] for name in line.group(1).split(",")}


def extras_needed(source: str) -> set[str]:
    """The top-level packages a test file skips without."""
    asked = re.findall(r"""(?:importorskip|find_spec)\(\s*["']([A-Za-z0-9_.]+)["']""", source)
    return {name.split(".")[0] for name in asked}


def outside_main() -> dict[str, set[str]]:
    """Test file -> the extras it needs that main's stage does not install."""
    installed = _main_extras() | _CORE
    found = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.name == Path(__file__).name:  # its own examples
            continue
        missing = extras_needed(path.read_text()) - installed
        if missing:
            found[f"tests/{path.name}"] = missing
    return found


def test_the_scan_sees_the_extras_a_file_skips_without():
    assert extras_needed('pytest.importorskip("vllm_router", reason="x")\n'
                         'importlib.util.find_spec("libtpu")') == {"vllm_router", "libtpu"}
    assert "tests/test_verl.py" in outside_main()
    assert "tests/test_hf_models.py" not in outside_main()  # Transformers: main installs it


def test_each_file_needing_an_extra_is_named_in_a_ci_stage():
    unnamed = {name: sorted(needs) for name, needs in outside_main().items() if name not in CI}
    assert not unnamed, (
        f"these test files skip in main's stage and no stage of .ci/run names them, so CI never "
        f"runs them: {unnamed}")


def test_each_test_file_ci_names_exists():
    named = set(re.findall(r"tests/test_[a-z0-9_]+\.py", CI))
    gone = sorted(name for name in named if not (ROOT / name).exists())
    assert not gone, f".ci/run selects test files that do not exist: {gone}"
