"""TPU targets (targets/tpu_target.py, runtime/libtpu.py, targets/tpu_hook.py); the aot tool
is tests/test_tpu_aot.py's.

Most tests need libtpu (the ``tpu-aot`` extra) and are skipped without it; CI's ``tpu`` stage
runs them. What needs no TPU compiler (names, the libtpu check, the HBM verdict's message) runs
everywhere. Processes that set a target run as subprocesses: a target is one per process.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest
import torch

from torchtpu import settings
from torchtpu.runtime import libtpu
from torchtpu.targets import tpu_target

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed "
                                  "(pip install -e '.[tpu-aot]')")


# ---------------------------------------------------------------------------- no libtpu needed


def test_unknown_topology_lists_the_known_ones():
    with pytest.raises(tpu_target.TargetError, match=r"torchtpu.tpu: 'v9:2x2' .*v5e:2x2.*v6e"):
        tpu_target.check_name("v9:2x2")
    assert tpu_target.check_name(" V5E:2x2 ") == "v5e:2x2"


def test_libtpu_check_names_the_version_jax_pins(monkeypatch):
    wanted = libtpu.required_libtpu()
    assert wanted, "jax's metadata names the libtpu of its tpu extra"

    def version(name):
        if name == "libtpu":
            raise importlib.metadata.PackageNotFoundError(name)
        return "0"

    monkeypatch.setattr(libtpu.importlib.metadata, "version", version)
    with pytest.raises(tpu_target.TargetError, match=rf"not installed.*libtpu=={wanted}"):
        libtpu.check_libtpu()
    monkeypatch.setattr(libtpu.importlib.metadata, "version", lambda name: "0.0.1")
    with pytest.raises(tpu_target.TargetError, match=rf"libtpu 0.0.1 is installed.*pins {wanted}"):
        libtpu.check_libtpu()


def test_a_step_over_the_chips_hbm_fails_naming_how_much_and_the_largest(monkeypatch, capsys,
                                                                         tmp_path):
    from torchtpu.tools import aot, aot_step

    step = aot_step.Step(seconds=1e-3, flops=1e9, mfu=0.5, hbm_peak_bytes=20 << 30,
                         hbm_capacity_bytes=16 << 30, fits=False, peak_flops=197e12,
                         chip="TPU v5 lite", programs_run=2,
                         largest=[{"name": "jit_small", "runs": 1, "seconds": 1e-4,
                                   "hbm_bytes": 1 << 20},
                                  {"name": "jit_big", "runs": 1, "seconds": 9e-4,
                                   "hbm_bytes": 19 << 30}])
    monkeypatch.setattr(aot, "report", lambda *a, **k: aot_step.AotReport(
        "v5e:2x2", "compile", "train", 1, [], step))
    monkeypatch.setattr(aot, "load", lambda target: (None, ()))
    assert aot.main(["--topology", "v5e:2x2", "x.py:make"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("torchtpu.tool: the step does not fit in v5e:2x2's HBM")
    assert "over by 4.00 GiB" in err and err.index("jit_big") < err.index("jit_small")


def test_no_target_wraps_nothing():
    """Unset, the host's compile path is JAX's own: a target costs nothing when off."""
    from jax._src import compiler

    from torchtpu.targets import tpu_hook

    if os.environ.get(settings.TPU_TARGET.name):
        pytest.skip("this process has a TPU target")
    assert not tpu_hook.active()
    # JAX's own, under at most the slow-compile watch (runtime/notices.py, which says so).
    fn, chain = compiler.compile_or_get_cached, []
    while fn is not None:
        chain.append(fn.__module__)
        fn = getattr(fn, "__wrapped__", None)
    assert chain in (["jax._src.compiler"], ["torchtpu.runtime.notices", "jax._src.compiler"])


# ---------------------------------------------------------------------------- the compiler


@needs_libtpu
def test_topology_devices_and_too_many_ranks():
    t = tpu_target.target("v5e:2x2")
    assert (len(t.devices), t.chips, t.chip.device_kind) == (4, 4, "TPU v5 lite")
    assert len(tpu_target.target("v5e:1x1").devices) == 1  # one chip: its own host bounds
    with pytest.raises(tpu_target.TargetError, match="8 devices were asked of v5e:2x2"):
        tpu_target.devices(8, "v5e:2x2")


@needs_libtpu
def test_compile_function_reports_cost_hbm_and_tile_padding():
    import jax
    import jax.numpy as jnp

    def mm(a, b):
        return a @ b

    m, k, n = 256, 512, 384
    r = tpu_target.compile_function(mm, jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                    jax.ShapeDtypeStruct((k, n), jnp.bfloat16), name="mm")
    assert r.compiles and r.error is None and r.chip == "TPU v5 lite"
    assert r.flops == pytest.approx(2 * m * k * n, rel=0.01)
    assert r.hbm["arguments"] == 2 * (m * k + k * n) and r.hbm["outputs"] == 2 * m * n
    assert r.padding_bytes == 0 and r.seconds > 0
    # 100 and 64 are no multiples of a tile's 128 lanes: what the tiles add is counted.
    odd = tpu_target.compile_function(mm, jax.ShapeDtypeStruct((100, 64), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((64, 128), jnp.bfloat16))
    logical = 2 * (100 * 64 + 64 * 128 + 100 * 128)
    assert odd.compiles and odd.padding_bytes > 0
    assert odd.padding_bytes == odd.hbm["arguments"] + odd.hbm["outputs"] - logical


@needs_libtpu
def test_sharded_function_compiles_across_the_mesh():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = tpu_target.mesh((4,), ("x",), "v5e:2x2")
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    r = tpu_target.compile_function(lambda a: (a * 2).sum(), x)
    assert r.compiles and r.devices == 4
    assert r.hbm["arguments"] == 1024 * 256 * 4 // 4  # per chip: its shard


@needs_libtpu
def test_a_collective_program_with_64_bit_ops_has_a_narrowed_time():
    """An SPMD program (an FSDP step's forward: all-gathers, 64-bit ops) gets the cost model's
    time from its narrowed twin, whose collectives keep their i64 device ids."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = tpu_target.mesh((2,), ("g",), "v5e:2x2")

    def body(a):  # a float64 product: libtpu's cost model has no time for it
        return jax.lax.all_gather(a, "g", tiled=True) @ jnp.ones((128, 128), jnp.float64)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("g"), out_specs=P("g"),
                               check_vma=False))
    x = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=NamedSharding(mesh, P("g")))
    r = tpu_target.compile_function(fn, x, name="gathered")
    assert r.compiles and r.devices == 2 and r.wide_ops["float64"] > 0
    assert r.seconds is not None and r.seconds > 0 and r.seconds_narrowed


@needs_libtpu
def test_a_process_first_function_is_lowered_as_its_later_ones(tmp_path):
    """compile_function lowers under torchtpu's JAX settings (x64, float32 products at
    "highest") even as a fresh process's first call: before them, the first lowering truncated
    float64 and kept DEFAULT precision, so the same function got another report (and the
    sliced-prefetch test's 32-bit program another layout) depending on what ran first."""
    code = """\
        import json
        import jax, jax.numpy as jnp
        from torchtpu.targets import tpu_target
        args = (jax.ShapeDtypeStruct((512, 512), jnp.float32),
                jax.ShapeDtypeStruct((8,), jnp.float64))
        reports = []
        for _ in range(2):
            tpu_target._results.clear()
            r = tpu_target.compile_function(lambda a, b: (a @ a, b * 2), *args, name="first")
            reports.append([r.wide_ops, r.flops, r.seconds, r.seconds_twin, r.from_cache])
        print(json.dumps(reports))
    """
    run = _python(code, tmp_path, env={"TORCHTPU_CACHE_DIR": "off"})
    assert run.returncode == 0, run.stderr[-2000:]
    first, again = json.loads(run.stdout.strip().splitlines()[-1])
    assert first == again and first[0]["float64"] > 0 and not first[4]


@needs_libtpu
def test_programs_of_empty_arrays_or_a_64_bit_scalar_result_have_a_time():
    """Every program of a step needs a time, or the step has none: an SPMD program's int64
    scalar result made 0-d again (libtpu: no cost) takes its narrowed twin's, a program of
    empty arrays (libtpu: no time) takes 0."""
    scalar = tpu_target.compile_module(textwrap.dedent("""\
        module @jit_reshape {
          func.func public @main(%a: tensor<1xi64>) -> tensor<i64> {
            %0 = stablehlo.reshape %a : (tensor<1xi64>) -> tensor<i64>
            return %0 : tensor<i64>
          }
        }"""), name="scalar")
    assert scalar.compiles and scalar.seconds is not None and scalar.seconds_narrowed
    empty = tpu_target.compile_module(textwrap.dedent("""\
        module @jit_copy {
          func.func public @main(%a: tensor<0x4xf32>) -> tensor<0x4xf32> {
            %0 = stablehlo.add %a, %a : tensor<0x4xf32>
            return %0 : tensor<0x4xf32>
          }
        }"""), name="empty")
    assert empty.compiles and empty.seconds == 0.0 and not empty.seconds_narrowed
    assert 0 < empty.compile_seconds < 600  # the compile's own time, not the cost model's
    assert 0 < empty.compile_cpu_seconds  # the process's CPU over it (the figure under load)


@needs_libtpu
def test_refused_module_and_64_bit_work_are_reported():
    refused = tpu_target.compile_module(textwrap.dedent("""\
        module @jit_lu {
          func.func public @main(%a: tensor<4x4xf32>) -> tensor<4x4xf32> {
            %0 = stablehlo.custom_call @lapack_sgetrf(%a) : (tensor<4x4xf32>) -> tensor<4x4xf32>
            return %0 : tensor<4x4xf32>
          }
        }"""), name="lu")
    assert not refused.compiles and "lapack_sgetrf" in refused.error
    assert "lowered for the host" in refused.error
    wide = tpu_target.compile_module(textwrap.dedent("""\
        module @jit_wide {
          func.func public @main(%a: tensor<8xf64>, %b: tensor<8xi64>) -> tensor<8xf64> {
            %0 = stablehlo.multiply %a, %a : tensor<8xf64>
            %1 = stablehlo.add %b, %b : tensor<8xi64>
            %2 = stablehlo.convert %1 : (tensor<8xi64>) -> tensor<8xf64>
            %3 = stablehlo.add %0, %2 : tensor<8xf64>
            return %3 : tensor<8xf64>
          }
        }"""), name="wide")
    assert wide.compiles and wide.wide_ops == {"float64": 3, "int64": 1}
    # libtpu's cost model has no time for 64-bit ops: the time is the narrowed program's.
    assert wide.seconds > 0 and wide.seconds_narrowed


@needs_libtpu
def test_complex128_is_refused_before_libtpu_which_would_end_the_process(tmp_path):
    """libtpu ends the process on a complex128 value ("Unsupported CVT X{64|128} expansion from
    c128[]"): the target refuses such a program with a message instead. ``2j * w`` of a
    complex64 ``w`` used to be one (the Python complex entered as complex128); it now enters
    as complex64, as torch computes it, and compiles."""
    code = """\
        import torch
        from torchtpu.targets import tpu_hook
        for dtype in (torch.complex64, torch.complex128):
            w = torch.randn(4, dtype=dtype, device="tpu")
            print((2j * w).abs().sum().item() > 0,
                  [r.error for r in tpu_hook.wait() if not r.compiles])
    """
    run = _python(code, tmp_path, env={settings.TPU_TARGET.name: "v5e:2x2",
                                       "TORCHTPU_TPU_TARGET_ON_ERROR": "keep"})
    assert run.returncode == 0, run.stderr[-2000:]
    c64, c128 = run.stdout.strip().splitlines()[-2:]
    assert c64 == "True []"  # tpu_hook.wait() gives each program once: these are complex128's
    ran, errors = c128.split(" ", 1)
    errors = ast.literal_eval(errors)
    assert ran == "True" and errors
    assert all(e.startswith("the program holds complex128 values") and "use complex64" in e
               for e in errors), errors


@needs_libtpu
def test_svd_with_vectors_compiles_for_a_tpu(tmp_path):
    """libtpu ends the process compiling JAX's TPU SVD traced under x64 (a v5e chip aborted in
    ``svdvals``' backward and ``pinv``); 32-bit SVDs are traced without it
    (``runtime/tpu_x64.py``). Eager calls here lower for the host (LAPACK), so the functions are
    lowered for the TPU themselves, in a process of their own: a regression is an abort."""
    code = """\
        import jax, jax.numpy as jnp
        import torchtpu
        from torchtpu.targets import tpu_target
        a = jax.ShapeDtypeStruct((5, 3), jnp.float32)
        svd = lambda a: jnp.linalg.svd(a, full_matrices=False)
        print([tpu_target.compile_function(f, a).compiles for f in (svd, jnp.linalg.pinv)])
    """
    run = _python(code, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[True, True]"


def _svd_for_a_tpu(dtype) -> str:
    import jax.numpy as jnp

    # What is under test is torchtpu's JAX set-up (x64 on, tpu_x64's rule, JAX's TPU client left
    # out when no TPU is attached): made here, not left to an earlier test of the process. Alone,
    # the lowering's default device started the TPU client, which waited minutes on the
    # machine's metadata server.
    from torchtpu.runtime import platform  # noqa: F401

    f = jax.jit(lambda a: jnp.linalg.svd(a, full_matrices=False))  # a new function: no cache
    return jax.export.export(f, platforms=["tpu"])(jax.ShapeDtypeStruct((4, 3), dtype)) \
        .mlir_module()


def test_32_bit_svd_is_lowered_for_a_tpu_without_64_bit_values():
    import jax.numpy as jnp

    narrow = _svd_for_a_tpu(jnp.float32)
    assert "tensor<i64>" not in narrow and "tensor<f64>" not in narrow
    assert "tensor<i64>" in _svd_for_a_tpu(jnp.float64)  # JAX's own: float64 cannot narrow


def test_narrowed_programs_are_32_bit_or_none():
    import numpy as np

    from torchtpu.targets import tpu_narrow

    text = ("%0 = stablehlo.constant dense<0xFFF0000000000000> : tensor<f64>\n"
            "%1 = stablehlo.add %a, %a : tensor<8x4xi64>\n"
            "%2 = stablehlo.convert %b : (tensor<4xui64>) -> tensor<4xcomplex<f64>>")
    out = tpu_narrow.narrowed(text)
    assert "64" not in out.replace("0xFF800000", "")
    assert "dense<0xFF800000> : tensor<f32>" in out and "tensor<8x4xi32>" in out
    assert "tensor<4xui32>" in out and "complex<f32>" in out
    # INT64_MAX (a sentinel) has no int32 value: no narrowed program rather than a wrong one.
    assert tpu_narrow.narrowed("dense<9223372036854775807> : tensor<i64>") is None
    assert tpu_narrow.narrowed("tensor<4xf32>") is None  # nothing to narrow
    # Large constants print as raw bytes: re-encoded at 4 bytes an element.
    blob = np.array([1, -2, 3], "<i8").tobytes().hex()
    out = tpu_narrow.narrowed(f'dense<"0x{blob}"> : tensor<3xi64>')
    narrow = np.array([1, -2, 3], "<i4").tobytes().hex().upper()
    assert out == f'dense<"0x{narrow}"> : tensor<3xi32>'
    blob = np.array([1, 1 << 40], "<i8").tobytes().hex()
    assert tpu_narrow.narrowed(f'dense<"0x{blob}"> : tensor<2xi64>') is None
    # A collective's device ids are i64 by definition: kept, its data narrowed.
    groups = "replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>"
    out = tpu_narrow.narrowed(f'"stablehlo.all_gather"(%a) <{{{groups}}}> : '
                              "(tensor<4xi64>) -> tensor<8xi64>")
    assert groups in out and "(tensor<4xi32>) -> tensor<8xi32>" in out
    assert tpu_narrow.narrowed(groups) is None  # nothing else to narrow
    # So is a window's padding (an int64 cumsum's reduce_window).
    pad = "padding = dense<[[7, 0]]> : tensor<1x2xi64>"
    out = tpu_narrow.narrowed(f'"stablehlo.reduce_window"(%a, %b) <{{{pad}}}> : '
                              "(tensor<8xi64>, tensor<i64>) -> tensor<8xi64>")
    assert pad in out and "(tensor<8xi32>, tensor<i32>) -> tensor<8xi32>" in out


@needs_libtpu
@pytest.mark.parametrize("wide", [False, True], ids=["32-bit", "64-bit"])
def test_a_sliced_prefetch_program_is_timed_by_its_twin_without_it(wide, monkeypatch):
    """A bf16 linear's weight gradient on v5e: libtpu prefetches the f32 input into VMEM in
    slices (slice-start/done + a ConcatBitcast custom call) and its cost model then has no time
    for the program; the twin compiled without sliced prefetching has one. With an int64 cumsum
    beside it, the twin is also narrowed (its reduce_window padding stays i64), and no narrowed
    twin with sliced prefetches is compiled first: it has no time either, and libtpu spent over
    10 minutes on the one of a 2-block Llama's compiled forward (bench/results-log.md, model3)."""
    import jax
    import jax.numpy as jnp

    options = [0]
    real_options = tpu_target._options

    def counted(*args, **kwargs):
        options[0] += 1
        return real_options(*args, **kwargs)

    monkeypatch.setattr(tpu_target, "_options", counted)

    def grad_w(x, w, b, *ids):
        def loss(w):
            y = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16).T + b.astype(jnp.bfloat16)
            return (y.astype(jnp.float32) ** 2).sum()
        return (jax.grad(loss)(w), *(jnp.cumsum(i * 3) for i in ids))

    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct(s, f32) for s in ((1024, 768), (768, 768), (768,))]
    with jax.enable_x64(wide):
        ids = [jax.ShapeDtypeStruct((8,), jnp.int64)] if wide else []
        r = tpu_target.compile_function(grad_w, *args, *ids, name="grad_w",
                                        target_name="v5e:2x2")
    assert r.compiles and r.flops > 2.4e9
    # The program, then one twin (checked first: which twin the compiler needed).
    assert options[0] == (0 if r.from_cache else 1 + bool(r.seconds_twin)), options
    twin = "narrowed, no sliced prefetch" if wide else "no sliced prefetch"
    assert r.seconds_twin == twin and r.seconds_narrowed == wide
    # 2.4 GFLOP at v5e's 197 TFLOP/s is 12 us; its bytes make it slower, not 10x.
    assert 12e-6 < r.seconds < 120e-6


# ---------------------------------------------------------------------------- every program


def _python(code: str, tmp_path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    full = {k: v for k, v in os.environ.items() if k != settings.TPU_TARGET.name}
    full.update({"TORCHTPU_CACHE_DIR": str(tmp_path / "cache"), **(env or {})})
    full = {k: v for k, v in full.items() if v != "" or k == settings.TPU_TARGET.name}  # "": unset
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=full, timeout=600, cwd=tmp_path)


_OPS = """\
    import json, torch
    from torchtpu.targets import tpu_hook
    a = torch.randn(64, 128, device="tpu")
    b = (a @ a.T).relu().sum()
    torch.linalg.inv(torch.eye(4, device="tpu") * 2)
    print(json.dumps([[r.name, r.kind, r.compiles, r.line, r.flops, r.from_cache]
                      for r in tpu_hook.wait()]))
"""


@needs_libtpu
def test_every_program_is_compiled_for_the_target_and_cached(tmp_path):
    env = {settings.TPU_TARGET.name: "v5e:2x2", "TORCHTPU_TPU_TARGET_ON_ERROR": "keep"}
    first = _python(_OPS, tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    found = json.loads(first.stdout.strip().splitlines()[-1])
    by_name = {name: (kind, ok, line, flops) for name, kind, ok, line, flops, _ in found}
    kind, ok, line, flops = by_name["jit_aten_mm_default"]
    assert (kind, ok) == ("op", True) and line.endswith("script.py:4")
    assert flops == pytest.approx(2 * 64 * 128 * 64, rel=0.01)
    # inv lowers to a LAPACK call on the host: refused, with its line, and kept going.
    refused = [f for f in found if not f[2]]
    assert refused and all(f[3].endswith("script.py:5") for f in refused)
    assert not any(f[5] for f in found)
    again = _python(_OPS, tmp_path, env=env)
    assert again.returncode == 0, again.stderr
    assert all(f[5] for f in json.loads(again.stdout.strip().splitlines()[-1]))


@needs_libtpu
def test_a_refused_program_raises_naming_it_and_the_line(tmp_path):
    code = """\
        import torch
        x = torch.linalg.inv(torch.eye(4, device="tpu") * 2)
        torch.tpu.synchronize()
        from torchtpu.targets import tpu_hook
        tpu_hook.wait()
    """
    run = _python(code, tmp_path, env={settings.TPU_TARGET.name: "v5e:2x2"})
    assert run.returncode != 0
    assert "torchtpu.tpu: the v5e:2x2 compiler refused" in run.stderr
    assert "script.py:2" in run.stderr and "lapack" in run.stderr


@needs_libtpu
def test_libtpu_without_target_or_tpu_is_quiet_and_cpu(tmp_path):
    code = """\
        import jax, torch
        print((torch.ones(2, device="tpu") + 1).sum().item(), jax.devices()[0].platform)
        try:
            jax.devices("tpu")
        except RuntimeError as e:
            print("no-tpu")
    """
    # Without the libtpu settings this process may have made (libtpu.compile_only_env),
    # which would quiet a started TPU client too.
    ours = ("ALLOW_MULTIPLE_LIBTPU_LOAD", "TPU_SKIP_MDS_QUERY", "TPU_ACCELERATOR_TYPE",
            "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TORCHTPU_LIBTPU_COMPILE_ONLY")
    # torchtpu's own where-it-runs line names a TPU too; only libtpu's output is in question.
    run = _python(code, tmp_path, env={**{k: "" for k in ours}, "TORCHTPU_NOTICES": "0"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["4.0", "cpu", "no-tpu"]
    # libtpu's client, started, warns about TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES.
    assert "TPU" not in run.stderr and "libtpu" not in run.stderr, run.stderr


def _all_reduce_on_target(rank, world):
    import torch.distributed as dist

    from torchtpu.targets import tpu_hook

    tpu_hook.install("v5e:2x2", on_error="keep")
    x = torch.ones(256, 128, device="tpu") * (rank + 1)
    dist.all_reduce(x)
    total = x.sum().item()
    return total, [(r.name, r.kind, r.devices, r.compiles, r.error) for r in tpu_hook.wait()]


@needs_libtpu
def test_xla_collectives_across_processes_compile_over_the_targets_chips(tmp_path):
    """A collective program spans the world's processes: each rank compiles it for the target
    as one SPMD program over as many chips as there are ranks, its other programs on one."""
    from torchtpu.distributed.spawn import run

    results = run(_all_reduce_on_target, 2, timeout=600,
                  env={"TORCHTPU_DIST_TRANSPORT": "xla", settings.TPU_TARGET.name: "",
                       "TORCHTPU_CACHE_DIR": str(tmp_path / "cache")})
    for total, reports in results:
        assert total == 256 * 128 * 3
        collective = [r for r in reports if r[2] == 2]
        assert collective and all(r[3] and r[4] is None for r in collective), collective
        assert all(r[3] for r in reports if r[2] == 1)
