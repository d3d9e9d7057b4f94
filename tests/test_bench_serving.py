"""bench/serving_chip.py and bench/serving_jax.py (the chip's serving benchmark) at tiny sizes on
CPU: the model directory it makes loads in Hugging Face, the JAX anchor's greedy tokens are
Hugging Face's for the same weights, its figures are filled in, and ``--jax-only`` needs neither
torch nor vLLM (the vLLM part's smoke run: bench/RESULTS.md, serving, issue 38)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench")


@pytest.fixture(scope="module")
def chip():
    pytest.importorskip("transformers")
    sys.path.insert(0, BENCH)
    try:
        import serving_chip
        import serving_jax
    finally:
        sys.path.remove(BENCH)
    return serving_chip, serving_jax


def test_the_jax_anchor_decodes_hugging_faces_greedy_tokens(chip, tmp_path):
    serving_chip, serving_jax = chip
    model = serving_chip.make_model("tiny", tmp_path / "tiny")
    want, margins = serving_chip.hf_greedy(model)
    assert [len(m) for m in margins] == [len(t) for t in want]
    assert all(m >= 0 for ms in margins for m in ms)
    c, p = serving_jax.load(model)
    got = [serving_jax.generate(c, p, serving_chip._pad(prompt), serving_chip.HF_NEW_TOKENS)
           ["tokens"][0].tolist() for prompt in serving_chip.PROMPTS]
    assert got == want
    # the scaled layers make the tokens depend on the prompt, not echo its last token
    assert any(len(set(t)) > 1 for t in want) and any(t[0] != p[-1] for t, p in
                                                      zip(want, serving_chip.PROMPTS))
    run = serving_jax.bench(c, p, batch=3, prompt=8, output=4)
    assert run["decode_tok_s"] > 0 and run["roofline_step_s"] > 0
    assert run["roofline_step_s"] == (serving_jax.weight_bytes(c) + 3 * 12 * serving_jax
                                      .kv_bytes_per_token(c)) / serving_jax.V5E_HBM_BYTES_S


def test_jax_only_runs_without_torch(tmp_path):
    # torch and vLLM are made unimportable: the chip's JAX-only run has neither
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.modules['vllm'] = None; "
            f"sys.argv = ['serving_chip.py', '--part', 'jax', '--json', '{tmp_path}/jax.json', "
            "'--models', 'tiny', '--shapes', '8x3', '--concurrency', '2', '--models-dir', "
            f"'{tmp_path}/none']; runpy.run_path('{BENCH}/serving_chip.py', run_name='__main__')")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SERVING_JAX_TOKENS": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "jax.json").read_text())
    assert "error" not in result, result
    (row,) = result["tiny"]["runs"]
    assert row["batch"] == 2 and row["decode_tok_s"] > 0, row


def test_tokens_are_compared_up_to_hugging_faces_first_near_tie(chip):
    serving_chip, _ = chip
    tol = serving_chip.MARGIN_TOL
    hf = {"m": [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
          serving_chip.MARGINS: {"m": [[5.0, tol / 2, 5.0], [5.0, 5.0, 5.0], [tol / 4, 5, 5]]}}
    # prompt 0 differs after its near-tie (allowed), prompt 1 before any (a real difference),
    # prompt 2 has a near-tie at its first token (nothing to hold it to)
    got = {"m": {"greedy": [[1, 9, 9], [4, 0, 6], [0, 0, 0]]}}
    out = serving_chip.compare(hf, got)["m"]
    assert out["equal"] == 0 and out["of"] == 3
    assert out["clear_tokens"] == [1, 3, 0] and out["equal_until_near_tie"] == 2
    assert out["first_mismatch"]["prompt"] == 0


def test_serving_diag_splits_a_step_and_profiles_it(chip):
    sys.path.insert(0, BENCH)
    try:
        import serving_diag
    finally:
        sys.path.remove(BENCH)

    class Runner:
        def _prepare_inputs(self):
            return "p"

        def _model_forward(self):
            return "f"

        def _sample(self):
            return "s"

        def _to_list(self):
            return "t"

    runner = Runner()
    phases = serving_diag.Phases(runner)
    assert (runner._prepare_inputs(), runner._model_forward(), runner._to_list()) == \
        ("p", "f", "t")
    step = phases.take(1.0)
    assert set(step) == {"prepare", "forward", "to_list", "other"}
    assert 0.99 < step["other"] < 1.0 and phases.take(0.5) == {"other": 0.5}
    assert serving_diag.phase_medians([{"phases": {"a": 1.0}}, {"phases": {"a": 3.0}},
                                       {"phases": None}]) == {"a": 2.0}
    prof = serving_diag.host_profile(lambda: sum(range(1000)), steps=2)
    assert prof["steps"] == 2 and prof["by_own_time"], prof
    # a failure is reported, not raised: a diagnostic never costs the run around it
    assert "ZeroDivisionError" in serving_diag.host_profile(lambda: 1 / 0)["error"]


def test_serving_diag_floors_on_the_device(chip):
    import torch

    sys.path.insert(0, BENCH)
    try:
        import serving_diag
    finally:
        sys.path.remove(BENCH)
    out = serving_diag.floors(repeats=2)
    assert out["synchronize_s"] > 0 and out["tiny_op_to_host_s"] > 0, out
    assert torch.ones(1, device="tpu").device.type == "tpu"


# the chip's 265-ms step (session 21): a merged weight stored as bytes, re-typed in every step
_BYTES_WEIGHT_HLO = """\
%fused_computation.3 (param_0: bf16[8,896]) -> bf16[8,896] {
  %param_0 = bf16[8,896]{1,0} parameter(0)
  ROOT %convert.1 = f32[8,896]{1,0} convert(%param_0)
}

ENTRY %main.66 (p0: u8[17432576]) -> bf16[9728,896] {
  %p0 = u8[17432576]{0} parameter(0)
  %convert.2 = u16[17432576]{0} convert(%p0)
  %bitcast.9 = u16[8716288,2]{1,0} bitcast(%convert.2)
  ROOT %reshape.4 = bf16[9728,896]{1,0:T(8,128)(2,1)} reshape(%bitcast.9)
}
"""


def test_serving_aot_lists_weight_sized_moves_not_bitcasts():
    sys.path.insert(0, BENCH)
    try:
        import serving_aot
    finally:
        sys.path.remove(BENCH)
    found = serving_aot.big_ops(_BYTES_WEIGHT_HLO, 1 << 20)
    assert [(o["op"], o["shape"], o["in"]) for o in found] == [
        ("convert", "u16[17432576]", "%main.66"), ("reshape", "bf16[9728, 896]", "%main.66")]
    assert serving_aot.big_ops(_BYTES_WEIGHT_HLO, 64 << 20) == []


# a decode step's kinds of op as libtpu's optimized HLO writes them: a weight prefetched into
# VMEM (S(1)) then read by its product, the vocabulary head read from HBM, the embedding's row
# sliced out of the table, a cache row updated in place, the paged kernel over the cache
_STEP_HLO = """\
%fused_computation.1 (param_0.1: bf16[1024,896], param_1.1: bf16[896]) -> bf16[1024] {
  %param_0.1 = bf16[1024,896]{1,0} parameter(0)
  ROOT %r.1 = bf16[1024]{0} reduce(%param_0.1, %param_1.1)
}

%fused_computation.2 (param_0.2: bf16[4096,896], param_1.2: s32[]) -> bf16[1,896] {
  %param_0.2 = bf16[4096,896]{1,0} parameter(0)
  %param_1.2 = s32[]{:T(128)} parameter(1)
  ROOT %dynamic-slice.1 = bf16[1,896]{1,0} dynamic-slice(%param_0.2, %param_1.2), \
dynamic_slice_sizes={1,896}
}

%fused_computation.3 (param_0.3: bf16[8192,2,128], param_1.3: bf16[1,2,128], param_2.3: s32[]) \
-> bf16[8192,2,128] {
  %param_0.3 = bf16[8192,2,128]{2,1,0} parameter(0)
  %param_1.3 = bf16[1,2,128]{2,1,0} parameter(1)
  %param_2.3 = s32[]{:T(128)} parameter(2)
  ROOT %dynamic-update-slice.1 = bf16[8192,2,128]{2,1,0} dynamic-update-slice(%param_0.3, \
%param_1.3, %param_2.3)
}

ENTRY %main.9 (w: bf16[1024,896], head: bf16[4096,896], cache: bf16[8192,2,128], t: s32[]) \
-> bf16[4096] {
  %w = bf16[1024,896]{1,0:T(8,128)(2,1)} parameter(0)
  %head = bf16[4096,896]{1,0:T(8,128)(2,1)} parameter(1)
  %cache = bf16[8192,2,128]{2,1,0:T(2,128)(2,1)} parameter(2)
  %t = s32[]{:T(128)} parameter(3)
  %embed_fusion = bf16[1,896]{1,0:T(2,128)(2,1)S(1)} fusion(%head, %t), kind=kLoop, \
calls=%fused_computation.2, backend_config={"estimated_cycles":"1900"}
  %bitcast.1 = bf16[896]{0:T(1024)S(1)} bitcast(%embed_fusion)
  %copy-start = (bf16[1024,896]{1,0:T(8,128)(2,1)S(1)}, bf16[1024,896]{1,0:T(8,128)(2,1)}, \
u32[]{:S(2)}) copy-start(%w)
  %copy-done = bf16[1024,896]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %multiply_reduce_fusion.1 = bf16[1024]{0:T(1024)S(1)} fusion(%copy-done, %bitcast.1), \
kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/dot_general"}, \
backend_config={"estimated_cycles":"15000"}
  %row = bf16[1,2,128]{2,1,0:T(2,128)(2,1)S(1)} bitcast(%multiply_reduce_fusion.1)
  %dus_fusion = bf16[8192,2,128]{2,1,0:T(2,128)(2,1)} fusion(%cache, %row, %t), kind=kLoop, \
calls=%fused_computation.3, backend_config={"estimated_cycles":"900"}
  %kernel = bf16[1,2,128]{2,1,0:T(2,128)(2,1)} custom-call(%row, %dus_fusion), \
custom_call_target="tpu_custom_call"
  ROOT %multiply_reduce_fusion.2 = bf16[4096]{0:T(1024)} fusion(%head, %bitcast.1), kind=kLoop, \
calls=%fused_computation.1, metadata={op_name="jit(step)/dot_general"}, \
backend_config={"estimated_cycles":"60000"}
}
"""


def test_step_breakdown_counts_each_array_once_and_a_slice_as_its_row():
    """bench/step_breakdown.py: the prefetched weight's bytes once (its copy), the head's read,
    the embedding's row (not its table), the cache row (not the cache), nothing of the paged
    kernel's pages, nothing read from VMEM; kinds by what each op reads."""
    sys.path.insert(0, BENCH)
    try:
        import step_breakdown
    finally:
        sys.path.remove(BENCH)
    found = step_breakdown.breakdown(_STEP_HLO, vocab=4096, weight_min=1 << 20)
    kinds = found["kinds"]
    weight, head, row, cache_row = 1024 * 896 * 2, 4096 * 896 * 2, 896 * 2, 2 * 128 * 2
    assert kinds["prefetch"]["hbm_bytes"] == weight
    assert kinds["weight products"]["weight_bytes"] == weight
    assert kinds["weight products"]["hbm_bytes"] == 0  # it reads the VMEM copy
    assert kinds["vocab head"]["hbm_bytes"] == head + 4096 * 2  # the table read, logits out
    assert kinds["cache writes"]["hbm_bytes"] == cache_row + 4  # the row in place, its index
    assert kinds["attention kernel"]["hbm_bytes"] == cache_row  # its output, not the pages
    assert found["total"]["hbm_bytes"] == weight + head + 4096 * 2 + row + 2 * cache_row + 8
    assert found["total"]["cycles"] == 1900 + 15000 + 900 + 60000


@pytest.mark.full  # two engines of their own: ~5 min here
def test_serving_extras_give_their_figures_at_tiny_sizes(tmp_path):
    """bench/serving_extras.py's prefix-caching, structured-output and FP8-KV parts on XLA:CPU
    (vLLM venv): a prefix hit read from the cache, valid JSON, the FP8 cache at half the bytes a
    token with its loads' figures (the n-gram part: bench/RESULTS.md, serving4)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, f"{BENCH}/serving_extras.py", "--parts", "cache", "fp8", "--models",
         "tiny", "--out", str(out), "--models-dir", str(tmp_path / "models"), "--shapes",
         "16x4", "--concurrency", "2", "--prefix-tokens", "64", "--suffix-tokens", "8",
         "--kv-bytes", "8e6"],
        env={**os.environ, "TORCHTPU_VLLM": "1",  # this checkout's torchtpu in the parts
             "PYTHONPATH": os.pathsep.join([os.path.dirname(BENCH),
                                            os.environ.get("PYTHONPATH", "")])},
        capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cache = json.loads((out / "cache.json").read_text())["tiny"]
    assert cache["prefix_caching"]["hit"]["cached_tokens"] >= 48, cache
    assert cache["structured_output"]["valid"], cache
    fp8 = json.loads((out / "fp8.json").read_text())["tiny"]
    kv = fp8["kv_cache"]
    assert kv["bytes_per_token"] * 2 == kv["model_dtype_bytes_per_token"], kv
    (load,) = fp8["loads"]
    assert load["output_tokens"] == 2 * 4 and load["decode_tok_s"] > 0, load


def test_a_chip_call_leaves_one_summary_and_one_archive_and_keeps_the_jax_parts_time(chip,
                                                                                     tmp_path):
    """The device call returns a few files of its output folder (session 24's first serving
    call lost the vLLM part's JSON and log that way): ``--out`` holds the summary and one
    archive of every part's JSON and log. The jax part's ``--jax-seconds`` are kept while it is
    still to run: with a budget of less than that and 10 s, the part before it is skipped and
    jax still runs."""
    import tarfile

    serving_chip, _ = chip
    out, work = tmp_path / "out", tmp_path / "work"
    env = {"JAX_PLATFORMS": "cpu", "SERVING_JAX_TOKENS": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        summary = serving_chip.main([
            "--parts", "make", "jax", "--models", "tiny", "--shapes", "8x3", "--concurrency",
            "2", "--models-dir", str(tmp_path / "none"), "--out", str(out), "--work",
            str(work), "--budget", "300", "--jax-seconds", "295"])
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert summary["parts"]["make"]["rc"] == "skipped: budget", summary["parts"]["make"]
    assert summary["parts"]["jax"]["rc"] == 0, summary["parts"]["jax"]
    assert sorted(os.listdir(out)) == ["serving_chip.json", "serving_chip_logs.tar.gz"]
    assert json.loads((out / "serving_chip.json").read_text())["parts"]["jax"]["result"][
        "tiny"]["runs"][0]["decode_tok_s"] > 0
    with tarfile.open(out / "serving_chip_logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["jax.json", "jax.log"]
        log = tar.extractfile("jax.log").read().decode()
    assert "decode_tok_s" in log


def test_fed_transfers_compares_one_by_one_feeds_with_one_packed_transfer(tmp_path):
    """bench/fed_transfers.py (the chip call's measure of what packing the step's nine host
    buffers buys): both programs run, the packed one takes one fed argument of the rows read."""
    sys.path.insert(0, BENCH)
    try:
        import fed_transfers
    finally:
        sys.path.remove(BENCH)
    out = fed_transfers.main(["--weights", "3", "--max-tokens", "64", "--max-reqs", "8",
                              "--blocks", "4", "--tokens", "2", "--reqs", "2", "--rounds", "2",
                              "--replays", "2", "--json", str(tmp_path / "f.json")])
    assert json.loads((tmp_path / "f.json").read_text())["packed"] == out["packed"]
    # 9 whole buffers, in bytes: ids 64 x 4; positions, slots, last rows 64 x 8 each; padding
    # 64; starts 9 x 4; lengths 8 x 4; sampled rows 8 x 8; table 32 x 4
    assert out["one_by_one"]["fed_arguments"] == 9
    assert out["one_by_one"]["fed_bytes"] == 256 + 3 * 512 + 64 + 36 + 32 + 64 + 128
    # one int32 array of the rows a 2-token, 2-request step reads, in words: ids 2, positions
    # 4, starts 3, lengths 2, table 2 x 4, slots 4, padding 2, sampled rows 4, last rows 4
    assert out["packed"]["fed_arguments"] == 1
    assert out["packed"]["fed_bytes"] == 4 * (2 + 4 + 3 + 2 + 8 + 4 + 2 + 4 + 4)
    assert out["packed"]["launch_cpu_us"] > 0 and out["one_by_one"]["ready_wall_us"] > 0


def test_diagnose_names_the_loads_it_follows_and_reaches_the_vllm_part(chip, tmp_path):
    """``--diagnose 64`` diagnoses after the 64-request load only (where the chip's step may be
    device-bound), a bare ``--diagnose`` after the first load; the vLLM part's process gets the
    concurrencies, other parts no flag."""
    import argparse
    import time

    serving_chip, _ = chip
    sys.path.insert(0, BENCH)
    try:
        import chip_parts
    finally:
        sys.path.remove(BENCH)

    def after(diagnose, loads):
        args, result, picked = argparse.Namespace(diagnose=diagnose), {}, []
        for c in loads:
            if serving_chip._diagnosed_after(args, c, result):
                result.setdefault("diagnoses", {})[str(c)] = {}
                picked.append(c)
        return picked

    assert after([64], [1, 8, 64, 256]) == [64]
    assert after([1, 64], [1, 8, 64, 256]) == [1, 64]
    assert after([], [1, 8, 64]) == [1]
    assert after(None, [1, 8, 64]) == []
    script = tmp_path / "argv.py"
    script.write_text("import json, sys\n"
                      "json.dump(sys.argv, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
    args = argparse.Namespace(work=str(tmp_path), models=["tiny"], models_dir="m",
                              shapes=["8x3"], concurrency=[1, 64], kv_bytes=None,
                              diagnose=[64], part_timeout=60,
                              deadline=time.perf_counter() + 60)
    argv = chip_parts.run_part("vllm", args, dict(os.environ), script=str(script))["result"]
    assert argv[argv.index("--diagnose"):][:2] == ["--diagnose", "64"], argv
    argv = chip_parts.run_part("hf", args, dict(os.environ), script=str(script))["result"]
    assert "--diagnose" not in argv, argv
