"""Compiler options (TORCH_TPU_INTERNAL_XLA_OPTIONS, custom_compiler_options) reach every compile,
are part of every program's key, and a name XLA does not know is refused where it is set."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import torch

from torchtpu.cache import cache_writer, warm, warm_keys
from torchtpu.runtime import compiler_options


def _programs(directory) -> set:
    """The programs XLA compiled into directory (its xla_dump_to files are module_N.<name>.*)."""
    return {f.split(".")[1] for f in os.listdir(directory)} if os.path.isdir(directory) else set()


def test_parse_takes_the_references_format():
    parsed = compiler_options.parse("  xla_optimization_level=O3  xla_cpu_enable_fast_math=TRUE "
                                    "xla_memory_fitting_level=o1 exec_time_optimization_effort=.5")
    assert parsed == {"optimization_level": 39, "xla_cpu_enable_fast_math": True,
                      "memory_fitting_level": 19, "exec_time_optimization_effort": 0.5}
    with pytest.raises(ValueError, match=r"torchtpu\.compile: .*'xla_foo' is not key=value"):
        compiler_options.parse("xla_foo")
    with pytest.raises(ValueError, match=r"torchtpu\.compile: .*O4.* not one of O0"):
        compiler_options.parse("xla_optimization_level=O4")
    with pytest.raises(ValueError, match=r"torchtpu\.compile: .*not a number in \[-1, 1\]"):
        compiler_options.normalize({"memory_fitting_effort": 3})


def test_options_reach_each_compile_and_a_program_built_without_them_is_not_reused(tmp_path):
    x = torch.arange(12.0, device="tpu").reshape(3, 4)
    ref = x.cpu() * 3 - 1
    assert torch.equal((x * 3 - 1).cpu(), ref)  # op programs compiled (and cached) without options
    zeros = warm.Program(jax.jit(jnp.zeros_like), warm_keys.key_of("test_compiler_options.zeros"))
    zeros(jnp.ones(5))
    dump = tmp_path / "xla"
    before = compiler_options.generation
    with compiler_options.custom_compiler_options({"xla_dump_to": str(dump),
                                                   "xla_optimization_level": "O1"}):
        assert "optimization_level=19" in compiler_options.key()
        assert torch.equal((x * 3 - 1).cpu(), ref)
        assert float(zeros(jnp.ones(5)).sum()) == 0.0
    assert compiler_options.generation == before + 2 and compiler_options.key() == ""
    # XLA compiled each again under the options (neither JAX's in-memory executables, the
    # persistent cache, nor the warm program's executable was reused).
    built = _programs(dump)
    # (Strict holds the multiply by a Python number: the subtraction's program computes it.)
    assert {"jit_aten_sub_Tensor", "jit_zeros_like"} <= built, built
    # Outside the context again: nothing compiles into the directory any more. (The cache's
    # writer thread reads each new entry back first, and XLA:CPU's deserialization dumps the
    # optimized module again into the directory its options name: under load that ran after the
    # unlinking below and left jit__reduce_sum there, session 41's run.)
    assert cache_writer.WRITES.flush(timeout=120)
    for f in dump.iterdir():
        f.unlink()
    assert torch.equal((x * 5).cpu(), x.cpu() * 5)
    assert _programs(dump) == set()


def test_an_option_xla_does_not_know_is_refused_where_it_is_set():
    with pytest.raises(ValueError, match=r"torchtpu\.compile: custom_compiler_options: .*"
                                         r"No such compile option: 'xla_no_such_option'"):
        with compiler_options.custom_compiler_options({"xla_no_such_option": True}):
            pass
    with pytest.raises(ValueError, match=r"torchtpu\.compile: .*xla_cpu_enable_fast_math"):
        with compiler_options.custom_compiler_options({"xla_cpu_enable_fast_math": "maybe"}):
            pass
    assert compiler_options.key() == ""
    # TPU-only names are kept for TPU compiles (the host's compiler would refuse them).
    with torch.tpu.custom_compiler_options({"xla_tpu_enable_latency_hiding_scheduler": True}):
        assert compiler_options.for_platform("cpu") == {}
        assert compiler_options.for_platform("tpu") == {
            "xla_tpu_enable_latency_hiding_scheduler": True}
        assert torch.equal((torch.ones(3, device="tpu") * 7).cpu(), torch.full((3,), 7.0))


_CHILD = """
import torch, torchtpu
from torchtpu.runtime import compiler_options
print(compiler_options.key())
print((torch.arange(4.0, device="tpu") * 11).sum().item())
"""


def test_the_environment_variable_sets_every_compile_and_a_bad_one_fails_at_the_first(tmp_path):
    dump = tmp_path / "xla"
    runs = {}
    for name, value in (("good", f"xla_optimization_level=O1 xla_dump_to={dump}"),
                        ("bad", "xla_optimization_level=O1 xla_not_an_option=3")):
        env = {**os.environ, compiler_options.ENV: value,
               "TORCHTPU_CACHE_DIR": str(tmp_path / "cache")}
        runs[name] = subprocess.Popen([sys.executable, "-c", _CHILD], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out = {name: p.communicate(timeout=240) + (p.returncode,) for name, p in runs.items()}
    finally:
        for p in runs.values():
            p.kill()
    stdout, stderr, rc = out["good"]
    assert rc == 0, stderr[-2000:]
    assert stdout.split()[-1] == "66.0" and "optimization_level=19" in stdout
    assert {"jit_aten_mul_Tensor", "jit_aten_sum_default"} <= _programs(dump)
    stdout, stderr, rc = out["bad"]
    assert rc != 0
    assert ("torchtpu.compile: TORCH_TPU_INTERNAL_XLA_OPTIONS: XLA refused"
            in stderr) and "xla_not_an_option" in stderr, stderr[-2000:]
