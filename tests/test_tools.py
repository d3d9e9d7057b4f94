"""The tools: onboard, diagnose, doctor, their command lines on bad input, the host-read hook."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtpu.commands import ToolError
from torchtpu.device.hooks import HOOKS
from torchtpu.tools import diagnose, doctor, onboard
from torchtpu.tools.watch import Watch

ROOT = Path(__file__).resolve().parents[1]


@torch.library.custom_op("ttpu_tools_test::scale", mutates_args=(), device_types="cpu")
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@scale.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.register_kernel("ttpu_tools_test::scale", "tpu")
def _scale_wrong_on_tpu(x):
    return x * 3.01  # the deliberate bug the onboarding must find


scale.register_autograd(lambda ctx, g: g * 3)

# An op with a CPU kernel and nothing for tpu: the CPU fallback serves it.
@torch.library.custom_op("ttpu_tools_test::shift", mutates_args=(), device_types="cpu")
def shift(x: torch.Tensor) -> torch.Tensor:
    return x + 1


shift.register_fake(lambda x: torch.empty_like(x))
shift.register_autograd(lambda ctx, g: g)


class Scale(nn.Module):
    def forward(self, x):
        return scale(x)


class Shift(nn.Module):
    def forward(self, x):
        return shift(x)


def test_onboard_finds_the_wrong_custom_op_at_its_module():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Tanh(), Scale()), nn.Linear(8, 4))
    report = onboard.run(model, (torch.randn(2, 8),), modes=("strict", "defer_and_fuse"),
                         steps=1)
    assert not report.ok
    for m in report.modes:
        assert m.error is None
        assert (m.divergence.module, m.divergence.module_type) == ("1.1", "Scale")
        assert m.divergence.max_abs_error > 1e-3
    assert "1.1 (Scale) output" in onboard.format_report(report)


def test_onboard_gradients_and_fallbacks_with_module_paths():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), Shift()), nn.Linear(8, 4))
    report = onboard.run(model, (torch.randn(3, 8),), backward=True, modes=("strict",), steps=1)
    (m,) = report.modes
    assert m.ok, onboard.format_report(report)
    assert m.fallbacks == [{"op": "ttpu_tools_test.shift.default", "count": 1,
                            "modules": {"1.1": 1}}]
    assert m.ms_per_step > 0
    json.dumps(report.to_dict())  # the --json form


def test_onboard_catches_a_wrong_gradient():
    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * (2.5 if g.device.type == "tpu" else 2)

    class Doubler(nn.Module):
        def forward(self, x):
            return BadGrad.apply(x)

    model = nn.Sequential(nn.Linear(4, 4), Doubler(), nn.Linear(4, 2))
    x = torch.randn(2, 4, requires_grad=True)
    (m,) = onboard.run(model, (x,), backward=True, modes=("strict",), steps=1).modes
    assert m.divergence is None
    assert (m.grad_divergence.module, m.grad_divergence.kind) == ("1", "input_grad")


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.parametrize("body, factory, says", [
    ("import no_such_package_here\n", "make", "does not import: ModuleNotFoundError"),
    ("def other():\n    pass\n", "make", "has no function 'make'; it defines: other"),
    ("""
     import torch
     def make():
         return torch.nn.Linear(8, 4), (torch.randn(2, 5),)
     """, "make", "fails on CPU itself"),
    ("""
     import torch
     def make():
         return torch.nn.Linear(8, 4), (torch.randn(2, 8, device="tpu"),)
     """, "make", "inputs are on tpu but the model's parameters on cpu"),
    ("""
     import torch
     def make():
         return torch.nn.Linear(8, 4), (torch.randn(2, 8, device="meta"),)
     """, "make", "tensors on meta"),
])
def test_onboard_command_on_bad_input(tmp_path, capsys, body, factory, says):
    target = f"{_script(tmp_path, body)}:{factory}"
    assert onboard.main([target, "--modes", "strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtpu.tool: ") and says in err, err
    assert "Traceback" not in err


def test_diagnose_names_a_per_step_item():
    model = nn.Linear(16, 4).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, device="tpu")
    seen = []

    def train_step():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        seen.append(loss.item())

    d = diagnose.step(train_step, steps=3, profile=True)
    line = train_step.__code__.co_firstlineno + 5
    assert d.top.kind == "host_sync", diagnose.format_report(d)
    assert f"`seen.append(loss.item())` at {__file__}:{line} syncs every step" in d.top.problem
    assert d.per_step["host_syncs"] == 1 and d.per_step["programs_built"] == 0
    # The profiled step's trace: the device ran the linear layer's programs.
    assert d.profile["device_busy_share"] > 0 and d.profile["span_ms"] > 0
    assert any(p["name"].startswith("aten::") for p in d.profile["device"]), d.profile
    assert "programs by device time" in diagnose.format_report(d)
    assert HOOKS.host_read_watcher is None  # the hook is off again


def test_diagnose_names_a_shape_that_recompiles():
    count = [0]

    def step_with_new_lengths():
        count[0] += 1
        return (torch.ones(8, 40 + count[0], device="tpu") * 2).sum(1)

    d = diagnose.step(step_with_new_lengths, steps=3)
    assert d.top.kind == "new_shapes", diagnose.format_report(d)
    assert "shape (float32[8,43]) recompiles at `return (torch.ones(8, 40 + count[0]" \
        in d.top.problem and "dynamic=True" in d.top.fix
    with pytest.raises(ToolError, match="torchtpu.tool: steps=1, warmup=1"):
        diagnose.step(step_with_new_lengths, steps=1)


def test_watch_counts_a_program_the_warm_start_cache_held():
    # A second CI run on the same machine loads the steps' programs by key instead of compiling
    # them: a new shape every step is a new program either way (the diagnosis above failed so).
    import jax
    import jax.numpy as jnp

    from torchtpu.cache import warm

    if not warm.cache_on():
        pytest.skip("the persistent cache is off (TORCHTPU_CACHE_DIR=off)")
    jitted, args = jax.jit(lambda x: x * 3 + 1), (jnp.ones((3, 7), jnp.float32),)
    warm.compiled_for(jitted, "test_tools.watch_load", args)  # its entry, if it was not there
    with Watch() as w:
        warm.compiled_for(jitted, "test_tools.watch_load", args)
    assert [p["shapes"] for p in w.record.programs_built] == [["float32[3,7]"]]
    assert w.record.metrics["programs_loaded_by_key"] == 1


def test_diagnose_gives_dynamo_recompile_reasons(fresh_dynamo):
    f = torch.compile(lambda x: (x * 2).sum(), backend="tpu", dynamic=False)
    count = [0]

    def step():
        count[0] += 1
        return f(torch.ones(4, 8 + count[0], device="tpu"))

    d = diagnose.step(step, steps=3)
    assert d.top.kind == "recompile", diagnose.format_report(d)
    assert "recompiles 1 time(s) per step" in d.top.problem
    assert "tensor 'x' size mismatch at index 1" in d.top.problem
    assert d.per_step["dynamo_recompiles"] == 1


def test_watch_records_syncs_only_while_open():
    x = torch.ones(3, device="tpu")
    with Watch() as w:
        x.sum().item()
    x.sum().item()
    assert [s["code"] for s in w.record.host_syncs] == ["x.sum().item()"]


def test_doctor_flags_bad_settings(monkeypatch):
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "sometimes")
    monkeypatch.setenv("TORCHTPU_CAHCE_DIR", "/tmp")
    result = doctor.run(self_test=False)
    assert not result["ok"]
    problems = {p["name"]: p for p in result["problems"]}
    assert problems["env TORCHTPU_CPU_FALLBACK"]["fix"] == "use one of warn, error, silent"
    assert "TORCHTPU_CACHE_DIR" in problems["env TORCHTPU_CAHCE_DIR"]["fix"]
    assert doctor.main(["--no-self-test"]) == 1


def test_doctor_reports_damaged_cache_entries(tmp_path, monkeypatch):
    from torchtpu.cache.compile_cache import SUFFIX, EntryStore

    store = EntryStore(tmp_path)
    store.put("whole", b"payload")
    store.entry("bad").write_bytes(b"\x00" * 40)
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path))
    check, state = doctor.check_cache()
    assert check.status == "warning" and "2 entries" in check.detail
    assert "1 refused (it has no torchtpu header)" in check.detail
    assert state["damaged"] == [f"bad{SUFFIX}"]


def test_doctor_command_json():
    # Only this suite's own settings are dropped: CI sets TORCHTPU_TESTS_REQUIRE, which the
    # conftest reads and torchtpu does not, so the doctor rightly warns about it.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHTPU_TEST", "TORCHTPU_CPU_FALLBACK"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "torchtpu.doctor", "--json", "--no-self-test"],
                          env=env, capture_output=True, text=True, timeout=120)
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"], proc.stdout + proc.stderr
    names = [c["name"] for c in result["checks"]]
    assert names == ["platform", "versions", "autoload", "compile cache", "environment"]
    assert result["device"]["devices"] and result["versions"]["torch"] == "2.13.0"
    assert result["compile_cache"]["writable"] and not result["compile_cache"]["damaged"]


def test_doctor_self_test(fresh_dynamo):
    # In this process (the command's own run of it is the same code): the process start is
    # what the command adds, and the test above pays it once.
    checks = doctor.check_self_test()
    assert [c.name for c in checks] == [
        "self-test: eager DEFER_NEVER", "self-test: eager DEFER_NEVER_AND_LAUNCH_BLOCKING",
        "self-test: eager DEFER_AND_FUSE", "self-test: torch.compile graph",
        "self-test: persistent cache round trip"]
    assert all(c.status == "ok" for c in checks), checks


def test_error_categories_prefix_messages_and_the_docs_have_the_glossary():
    from torchtpu import errors

    text = errors.message("fallback", "aten op 'x' has no tpu lowering")
    assert text.startswith("torchtpu.fallback: ") and errors.category_of(text) == "fallback"
    assert errors.category_of(RuntimeError("torchtpu.nope: x")) is None
    with pytest.raises(ValueError, match="torchtpu.argument: unknown error category"):
        errors.message("nope", "x")
    assert errors.glossary_markdown() in (ROOT / "docs" / "reference.md").read_text()


def test_torch_tpu_tools_is_the_same_api():
    assert torch.tpu.tools.onboard is onboard.run
    assert torch.tpu.tools.diagnose_step is diagnose.step
    assert torch.tpu.tools.doctor is doctor.run


def test_onboard_compile_mode_reports_graph_breaks(fresh_dynamo):
    class Branchy(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum().item() > 0 else x  # .item(): Dynamo breaks the graph

    model = nn.Sequential(nn.Linear(4, 4), Branchy(), nn.Linear(4, 2))
    (m,) = onboard.run(model, (torch.ones(2, 4),), modes=("compile",), steps=1).modes
    assert m.ok and m.graphs >= 1, m
    assert any("item" in b["reason"].lower() for b in m.graph_breaks), m.graph_breaks
