"""A new user's first minutes: ``import torch`` stays cheap (no JAX, no sympy until the first tpu
use) and leaves the environment as the user had it, also after the first op."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

import torchtpu
from torchtpu.targets import tpu_target

# Children import the torchtpu this process imported (a checkout, not another install).
_ROOT = os.path.dirname(os.path.dirname(torchtpu.__file__))

_HEAVY = ("jax", "jaxlib", "sympy", "torchtpu.lowering")
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _child(code: str, env: dict | None = None) -> dict:
    """Run code in a fresh interpreter; it prints one JSON line, returned parsed."""
    full = {k: v for k, v in os.environ.items() if k != tpu_target.ENV}
    full.update(env or {})
    full = {k: v for k, v in full.items() if v is not None}  # None: unset
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=full, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_torch_registers_tpu_without_jax():
    out = _child(f"""
        import json, sys
        import torch
        heavy = {_HEAVY!r}
        after_import = [m for m in heavy if m in sys.modules]
        # What a script does before its first tpu tensor loads nothing either.
        torch.manual_seed(1)
        torch.set_float32_matmul_precision("high")
        model = torch.nn.Linear(4, 2)
        torch.Generator()
        device = torch.device("tpu")
        before_op = [m for m in heavy if m in sys.modules]
        x = torch.ones(4, device=device)
        loaded = [m for m in heavy if m in sys.modules]
        y = model.to(device)(x)
        reference = torch.nn.Linear(4, 2)
        reference.load_state_dict(model.state_dict())
        close = torch.allclose(y.cpu(), reference(torch.ones(4)))
        torch.manual_seed(1)
        again = torch.randn(3, device="tpu").tolist()
        print(json.dumps([after_import, before_op, loaded, close,
                          str(torch.tpu.get_precision()), torch.tpu.is_available(), again]))
    """)
    after_import, before_op, loaded, close, precision, available, again = out
    assert after_import == [] and before_op == []
    assert "jax" in loaded and "torchtpu.lowering" in loaded
    assert close and available
    assert precision == "Precision.HIGH"  # set before the device loaded, applied when it did


def test_seed_given_before_the_device_loads_is_its_seed():
    code = """
        import json, torch
        {first}
        torch.manual_seed(7)
        print(json.dumps(torch.randn(4, device="tpu").tolist()))
    """
    lazy = _child(code.format(first=""))
    loaded = _child(code.format(first="torch.ones(1, device='tpu')"))
    assert lazy == loaded


def test_first_use_from_another_thread_and_storage():
    out = _child("""
        import json, sys, threading
        import torch
        results = []
        def make():
            results.append(torch.arange(6, device="tpu").sum().item())
        threads = [threading.Thread(target=make) for _ in range(3)]
        for t in threads: t.start()
        for t in threads: t.join()
        s = torch.UntypedStorage(8, device="tpu")
        print(json.dumps([results, s.device.type, s.nbytes()]))
    """)
    assert out == [[15, 15, 15], "tpu", 8]


def test_a_setting_the_device_refuses_fails_each_first_op_by_name():
    """The device loads at the first op and reads its settings then: a bad one is that op's
    error, and the next op's, in torchtpu's words (not a missing kernel), while CPU works."""
    out = _child("""
        import json, torch
        seen = []
        for _ in range(2):
            try:
                torch.ones(2, device="tpu")
            except Exception as e:
                seen.append(f"{type(e).__name__}: {e}")
        print(json.dumps([seen, torch.ones(2).sum().item()]))
    """, env={"TORCHTPU_MEMORY_LIMIT": "1.5"})
    seen, on_cpu = out
    assert len(seen) == 2 and on_cpu == 2.0
    for error in seen:
        assert error.startswith("ValueError: torchtpu.config: TORCHTPU_MEMORY_LIMIT='1.5' is "
                                "neither a whole number of bytes"), error


def test_storage_built_first_loads_the_device():
    out = _child("""
        import json, torch
        s = torch.UntypedStorage(8, device="tpu")
        t = torch.empty(0, dtype=torch.uint8, device="tpu").set_(s)
        print(json.dumps([s.device.type, s.nbytes(), t.fill_(3).sum().item()]))
    """)
    assert out == ["tpu", 8, 24]


_ENV_PROBE = """
    import json, os
    before = dict(os.environ)
    import torch
    after_import = dict(os.environ)
    x = (torch.ones(3, device="tpu") * 2).sum().item()
    after_op = dict(os.environ)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    def changed(now):
        # PyTorch itself sets TORCHINDUCTOR_CACHE_DIR to its default as Dynamo loads (its
        # meta kernels import Dynamo): that one is PyTorch's, not ours.
        if "TORCHINDUCTOR_CACHE_DIR" not in before and \\
                now.get("TORCHINDUCTOR_CACHE_DIR") == default_cache_dir():
            now = {k: v for k, v in now.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        return sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))

    print(json.dumps([changed(after_import), changed(after_op), x]))
"""


# What JAX's import and libtpu's compile-only start would set: unset for the child, so that it
# starts as a user's shell would (this process may hold them, if something here set them).
_UNSET = {name: None for name in (
    "TF_CPP_MIN_LOG_LEVEL", "TPU_LIBRARY_PATH", "TPU_SKIP_MDS_QUERY", "ALLOW_MULTIPLE_LIBTPU_LOAD",
    "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID",
    "TORCHTPU_LIBTPU_COMPILE_ONLY")}


def test_import_and_first_op_leave_the_environment_as_it_was():
    """No TPU_*, ALLOW_MULTIPLE_LIBTPU_LOAD or TF_CPP_MIN_LOG_LEVEL reaches child processes."""
    assert _child(_ENV_PROBE, _UNSET) == [[], [], 6.0]


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed (pip install -e "
                    "'.[tpu-aot]')")
def test_tpu_target_leaves_the_environment_as_it_was(tmp_path):
    """libtpu's compile-only settings exist only while it starts, for a program compiled for a
    TPU target too."""
    env = {**_UNSET, tpu_target.ENV: "v5e:2x2", "TORCHTPU_CACHE_DIR": str(tmp_path)}
    assert _child(_ENV_PROBE, env) == [[], [], 6.0]


# ---------------------------------------------------------------------------- notices


_NOTICE_PROBE = """
    import torch
    from jax._src import compiler
    # Every compile takes 0.4 s longer, as a big one would; written as JAX's own code (its
    # file), so that the line a notice names is the user's below.
    exec(compile(
        "import time\\n"
        "compile_ = compiler.compile_or_get_cached\\n"
        "def slow(*args, **kwargs):\\n"
        "    time.sleep(0.4)\\n"
        "    return compile_(*args, **kwargs)\\n"
        "compiler.compile_or_get_cached = slow\\n", compiler.__file__, "exec"),
        {"compiler": compiler})
    x = torch.ones(3, device="tpu")
    y = torch.cumsum(x, 0)  # NOTICED
    print(y.sum().item())
"""


def _stderr_of(code: str, tmp_path, env: dict) -> str:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    full = {**os.environ, "TORCHTPU_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": _ROOT,
            **env}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=full, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    return run.stderr


def test_first_op_says_where_tpu_runs_once(tmp_path):
    err = _stderr_of(_NOTICE_PROBE, tmp_path, {"TORCHTPU_SLOW_COMPILE_S": "0"})
    lines = [x for x in err.splitlines() if x.startswith("torchtpu: ")]
    assert lines == ["torchtpu: device tpu:0 is XLA:CPU (cpu), a CPU standing in for a TPU, "
                     f"JAX {_jax_version()} (TORCHTPU_NOTICES=0 silences these lines)"], err


def _jax_version() -> str:
    import jax

    return jax.__version__


def test_a_slow_compile_names_its_program_and_line_then_its_time(tmp_path):
    err = _stderr_of(_NOTICE_PROBE, tmp_path, {"TORCHTPU_SLOW_COMPILE_S": "0.2"})
    code = textwrap.dedent(_NOTICE_PROBE).splitlines()
    line = next(i for i, text in enumerate(code, 1) if "# NOTICED" in text)
    where = f"{tmp_path / 'script.py'}:{line}"
    assert f"torchtpu: compiling jit_aten_cumsum_default for {where}, 0 s so far" in err, err
    assert f"torchtpu: compiled jit_aten_cumsum_default for {where} in 0." in err, err


@pytest.mark.parametrize("env", [{"TORCHTPU_NOTICES": "0", "TORCHTPU_SLOW_COMPILE_S": "0.2"},
                                 {"TORCHTPU_NOTICES": "0"}])
def test_notices_can_be_turned_off(tmp_path, env):
    assert "torchtpu: " not in _stderr_of(_NOTICE_PROBE, tmp_path, env)


@pytest.mark.full
def test_demo_says_where_it_runs():
    run = subprocess.run([sys.executable, "-m", "torchtpu.demo", "--steps", "2",
                          "--sample-chars", "2", "--eager-mode", "strict"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "device tpu = CPU (cpu), 2 steps" in run.stdout, run.stdout
