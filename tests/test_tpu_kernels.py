"""Pallas kernels compiled for a real TPU (v5e) through Mosaic, not interpreted: torchtpu's flash
attention and RMSNorm, Tokamax's TPU kernels and JAX's ragged paged attention, forward and
backward, at TPU block sizes (128 lanes and more than one block), with the TPU compiler's verdict
and cost. Needs libtpu (``pip install -e '.[tpu-aot]'``; run in .venv-tpu); skipped without it.
Each case is one TPU compile of a few seconds."""

import functools
import importlib

import pytest

pytest.importorskip("libtpu", reason="libtpu is not installed: pip install -e '.[tpu-aot]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from torchtpu.kernels import pallas_mode  # noqa: E402
from torchtpu.kernels.flash_attention import flash_attention_jax  # noqa: E402
from torchtpu.kernels.ragged_paged_attention import _ragged_paged_attention  # noqa: E402
from torchtpu.kernels.rms_norm import rms_norm_jax  # noqa: E402
from torchtpu.lowering import attention  # noqa: E402
from torchtpu.targets import tpu_target  # noqa: E402

_TARGET = "v5e:2x2"


@pytest.fixture(scope="module")
def device():
    try:
        return tpu_target.devices(1, _TARGET)[0]
    except tpu_target.TargetError as e:
        pytest.skip(f"no compile-only TPU target here: {e}")


def _compile(device, fn, *structs):
    """(the lowered StableHLO text, the TPU compiler's report) of fn at structs' shapes."""
    placed = [jax.ShapeDtypeStruct(s.shape, s.dtype,
                                   sharding=jax.sharding.SingleDeviceSharding(device))
              for s in structs]
    # As tpu_target.compile_function traces (a TPU as the default device: see pallas_mode).
    with jax.default_device(device):
        lowered = jax.jit(fn).lower(*placed)
    report = tpu_target.compile_lowered(lowered, name=getattr(fn, "__name__", "kernel"),
                                        target_name=_TARGET)
    return lowered.as_text(), report


def _mosaic_kernels(text: str) -> int:
    return text.count("@tpu_custom_call")


def _grads(fn, argnums):
    return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=argnums)


def _bf16(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def test_flash_attention_forward_and_backward_compile_through_mosaic(device):
    attention = functools.partial(flash_attention_jax, scale=0.125, causal=True)
    # 640 = 5 blocks of 128 queries and keys; head_dim 128 fills the lanes.
    qkv = [_bf16(2, 2, 640, 128)] * 3
    text, forward = _compile(device, attention, *qkv)
    assert _mosaic_kernels(text) == 1, text[:2000]
    assert forward.compiles, forward.error
    # The kernel's cost estimate reaches the cost model (a Mosaic call is opaque without it).
    assert forward.flops >= 2 * 2 * 4 * 640 * 640 * 128 and forward.seconds > 0

    text, backward = _compile(device, _grads(attention, (0, 1, 2)), *qkv)
    assert _mosaic_kernels(text) == 3  # forward (residuals), dq, dk/dv
    assert backward.compiles, backward.error
    assert backward.flops > 2 * forward.flops and backward.seconds > forward.seconds


def test_sdpa_lowering_takes_the_splash_kernel_for_the_target(device):
    """SDPA's fused op as the lowering table has it: causal bf16 self-attention at 1024 positions
    lowers to JAX's splash kernel for a TPU (lowering/attention_tpu.py), forward and backward,
    and the TPU compiler takes both."""
    key = jax.random.key(0)

    def forward(q, k, v):
        return attention.sdpa_forward(key, q, k, v, is_causal=True)[:2]

    def backward(g, q, k, v, out, lse):
        return attention.sdpa_backward(g, q, k, v, None, [True, True, True, False], out, lse,
                                       None, None, 1024, 1024, 0.0, True, None, None)[:3]

    qkv = [_bf16(2, 8, 1024, 128)] * 3
    text, report = _compile(device, forward, *qkv)
    assert _mosaic_kernels(text) == 1 and report.compiles, report.error
    lse = jax.ShapeDtypeStruct((2, 8, 1024), jnp.float32)
    text, report = _compile(device, backward, qkv[0], *qkv, qkv[0], lse)
    assert _mosaic_kernels(text) == 1 and report.compiles, report.error  # the fused dq/dk/dv


def test_flash_attention_as_a_jax_op_traces_native_for_the_target(device):
    """jax_op traces its function under pallas_mode.interpreting(): on this CPU host that means
    the HLO interpreter, but not while a TPU target traces it."""
    assert pallas_mode.setting() is True  # the host: interpreted

    def op(q, k, v):
        with pallas_mode.interpreting("torchtpu::flash_attention"):
            return flash_attention_jax(q, k, v, 0.125, False)

    text, report = _compile(device, op, *[_bf16(1, 2, 256, 128)] * 3)
    assert _mosaic_kernels(text) == 1 and report.compiles, report.error


def test_rms_norm_forward_and_backward_compile_through_mosaic(device):
    norm = functools.partial(rms_norm_jax, eps=1e-6)
    # 600 rows: three blocks of 256 (the last one padded); 512 lanes.
    structs = _bf16(2, 300, 512), jax.ShapeDtypeStruct((512,), jnp.float32)
    text, forward = _compile(device, norm, *structs)
    assert _mosaic_kernels(text) == 1 and forward.compiles, forward.error
    assert forward.bytes_accessed >= 2 * 600 * 512 * 2 and forward.seconds > 0
    text, backward = _compile(device, _grads(norm, (0, 1)), *structs)
    assert _mosaic_kernels(text) == 2 and backward.compiles, backward.error


def test_ragged_paged_attention_compiles_through_mosaic(device):
    # 4 sequences, 16 pages of 16 tokens each; 8 query heads over 2 KV heads; head_dim 128.
    structs = (_bf16(64, 8, 128), _bf16(64, 16, 4, 128),
               jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 16), jnp.int32),
               jax.ShapeDtypeStruct((5,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    rpa = functools.partial(_ragged_paged_attention, sm_scale=0.088)
    text, report = _compile(device, rpa, *structs)
    assert _mosaic_kernels(text) == 1, text[:2000]
    assert report.compiles, report.error


@pytest.mark.parametrize("page,per_seq", [(16, 128), (64, 10)], ids=["pages-16", "pages-64"])
@pytest.mark.parametrize("q_heads,combined", [(14, 2), (32, 8)], ids=["qwen2-0.5b", "llama-1b"])
def test_ragged_paged_attention_compiles_at_the_served_models_packed_heads(device, q_heads,
                                                                          combined, page,
                                                                          per_seq):
    """vLLM's paged path (integrations/vllm/paged.py) packs two 64-wide KV heads into one
    128-wide head: Qwen2.5-0.5B's 14 query heads over 1 combined head, Llama-3.2-1B's 32 over
    4; a decode step of 256 requests reading 128 pages of 16 tokens each (vLLM's pages), or 10
    of 64 (the platform's pages at a max_model_len of 640: one KV block a sequence). Llama's
    needs more than Mosaic's default 16 MiB of scoped VMEM."""
    structs = (_bf16(256, q_heads, 128), _bf16(4096, page, combined, 128),
               jax.ShapeDtypeStruct((256,), jnp.int32),
               jax.ShapeDtypeStruct((256, per_seq), jnp.int32),
               jax.ShapeDtypeStruct((257,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    text, report = _compile(device, functools.partial(_ragged_paged_attention, sm_scale=0.125),
                            *structs)
    assert _mosaic_kernels(text) == 1 and report.compiles, report.error


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_ragged_paged_attention_reads_float8_pages_in_place_with_their_scales(device, kv_dtype):
    """An fp8 KV cache on the kernel (integrations/vllm/attention.py): Llama-3.2-1B's 32 query
    heads over 4 combined heads (8 float8 head rows a token, 2 words), a decode step of 64
    sequences writing its rows into a float8 cache of 400 MB (past VMEM) and attending through
    it, the cache donated: Mosaic lowers the float8 loads and their scales for v5e, and the
    cache is updated in place and read as it is, no cache-sized copy. The same cache held as
    bytes and viewed as float8 for the kernel costs a whole copy (why the backend keeps float8
    storage)."""
    slots, rows = 6400 * 64, 8

    def step(q, cache, new, where, lens, pages, cu, n):
        cache = cache.at[where].set(new)
        kv = cache if cache.dtype == kv_dtype else jax.lax.bitcast_convert_type(cache, kv_dtype)
        out = _ragged_paged_attention(q, kv.reshape(6400, 64, rows, 128), lens, pages, cu, n,
                                      sm_scale=0.125, k_scale=0.5, v_scale=2.0)
        return out, cache

    temporaries = {}
    for stored in (kv_dtype, jnp.uint8):
        structs = [_bf16(64, 32, 128), jax.ShapeDtypeStruct((slots, rows, 128), stored),
                   jax.ShapeDtypeStruct((64, rows, 128), stored),
                   *(jax.ShapeDtypeStruct(s, jnp.int32) for s in ((64,), (64,), (64, 10),
                                                                  (65,), (1,)))]
        placed = [jax.ShapeDtypeStruct(s.shape, s.dtype,
                                       sharding=jax.sharding.SingleDeviceSharding(device))
                  for s in structs]
        with jax.default_device(device):
            lowered = jax.jit(step, donate_argnums=1).lower(*placed)
        report = tpu_target.compile_lowered(lowered, name="fp8_pages", target_name=_TARGET)
        assert _mosaic_kernels(lowered.as_text()) == 1 and report.compiles, report.error
        assert report.hbm["aliased"] >= slots * rows * 128, report.hbm
        temporaries[str(jnp.dtype(stored))] = report.hbm["temporaries"]
    assert temporaries[str(jnp.dtype(kv_dtype))] == 0, temporaries
    assert temporaries["uint8"] >= slots * rows * 128, temporaries


def test_ragged_paged_attention_says_why_float8_pages_cannot_tile(device):
    """Qwen2.5-0.5B's fp8 cache: one combined head, 2 float8 head rows a token, half of the
    32-bit word the kernel loads 4 of them from."""
    structs = (_bf16(64, 14, 128), jax.ShapeDtypeStruct((1024, 64, 2, 128), jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct((64,), jnp.int32), jax.ShapeDtypeStruct((64, 10), jnp.int32),
               jax.ShapeDtypeStruct((65,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"torchtpu\.kernel: .*2 head rows a token \(keys and "
                                         r"values\) of 1-byte elements: the TPU kernel packs 4"):
        _compile(device, _ragged_paged_attention, *structs)


def _pallas_grids(jaxpr) -> list[tuple]:
    """The grid and first block shape of every pallas_call in a jaxpr, nested ones too."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            mapping = eqn.params["grid_mapping"]
            out.append((tuple(mapping.grid), mapping.block_mappings[0].block_shape[0]))
        for param in eqn.params.values():  # a jit's jaxpr is closed, a loop's body is not
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                out += _pallas_grids(inner)
    return out


@pytest.mark.parametrize("tokens,seqs,per_block", [(256, 256, 8), (512, 4, 32)],
                         ids=["decode", "prefill"])
def test_ragged_paged_attention_blocks_a_decode_by_fewer_queries(device, tokens, seqs, per_block):
    """The kernel scores each sequence's KV against its whole block of queries: a decode step
    (one query a sequence) takes blocks of 8, a prefill of 32 (Qwen2.5-0.5B's packed heads,
    pages of 16 tokens)."""
    structs = (_bf16(tokens, 14, 128), _bf16(4096, 16, 2, 128),
               jax.ShapeDtypeStruct((seqs,), jnp.int32),
               jax.ShapeDtypeStruct((seqs, 64), jnp.int32),
               jax.ShapeDtypeStruct((seqs + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    with jax.default_device(device):
        jaxpr = jax.make_jaxpr(functools.partial(_ragged_paged_attention, sm_scale=0.125))(*structs)
    (grid, queries), = _pallas_grids(jaxpr.jaxpr)
    assert grid == (1, tokens // per_block) and queries.block_size == per_block, (grid, queries)


def _kv_block_pages(jaxpr) -> list[int]:
    """The KV pages a block of every pallas_call in a jaxpr: its double buffer's scratch,
    [2, pages, page_size, combined heads, head_dim]."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out += [v.aval.shape[1] for v in eqn.params["jaxpr"].invars
                    if len(v.aval.shape) == 5 and v.aval.shape[0] == 2]
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns") and eqn.primitive.name != "pallas_call":
                out += _kv_block_pages(inner)
    return out


@pytest.mark.parametrize("page,per_seq,rows,pages", [
    (64, 10, 2, 10),  # Qwen2.5-0.5B served at 640 tokens: the whole sequence, one block
    (16, 64, 2, 16),  # vLLM's 16-token pages: 16 a block (256 tokens)
    (128, 16, 2, 8),  # 2,048 tokens in 16 pages: blocks of 1,024 tokens
    (128, 16, 32, 4),  # 16 combined heads: two 512-token buffers fill a quarter of the VMEM
], ids=["whole-sequence", "vllm-pages", "1024-tokens", "vmem"])
def test_ragged_paged_attention_copies_whole_sequences_a_kv_block(device, page, per_seq, rows,
                                                                  pages):
    """A decode step's KV blocks (kernels/ragged_paged_attention.blocks): a sequence's pages,
    at most 16 of them and 1,024 tokens, both buffers in a quarter of the 32 MiB VMEM limit."""
    structs = (_bf16(64, 14 * rows // 2, 128), _bf16(1024, page, rows, 128),
               jax.ShapeDtypeStruct((64,), jnp.int32),
               jax.ShapeDtypeStruct((64, per_seq), jnp.int32),
               jax.ShapeDtypeStruct((65,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    with jax.default_device(device):
        jaxpr = jax.make_jaxpr(functools.partial(_ragged_paged_attention, sm_scale=0.125))(*structs)
    assert _kv_block_pages(jaxpr.jaxpr) == [pages]


def test_ragged_paged_attention_says_why_a_head_dim_cannot_compile(device):
    structs = (_bf16(64, 8, 64), _bf16(64, 16, 4, 64), jax.ShapeDtypeStruct((4,), jnp.int32),
               jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((5,), jnp.int32),
               jax.ShapeDtypeStruct((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"torchtpu\.kernel: .*head_dim 64: JAX's TPU kernel "
                                         r"needs a multiple of 128"):
        _compile(device, _ragged_paged_attention, *structs)


def test_ragged_paged_attention_dense_path_matches_a_loop_over_sequences():
    """Off TPU the op is XLA attention; against per-sequence NumPy attention (decode, prefill and
    a padded row)."""
    rng = np.random.default_rng(0)
    page, pages, heads, kv_heads, d = 4, 12, 4, 2, 16
    kv_pages = rng.standard_normal((pages, page, 2 * kv_heads, d)).astype(np.float32)
    page_indices = np.array([[3, 7, 1], [0, 2, 5], [9, 10, 11]], np.int32)
    kv_lens = np.array([9, 5, 12], np.int32)
    q_lens = [1, 5, 3]  # a decode, a whole prefill, a partial prefill
    cu = np.array([0, 1, 6, 9], np.int32)
    q = rng.standard_normal((10, heads, d)).astype(np.float32)  # row 9: padding
    out = np.asarray(_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu,
                                             np.array([3], np.int32), sm_scale=0.25))
    for s in range(3):
        kv = kv_pages[page_indices[s]].reshape(-1, 2 * kv_heads, d)[:kv_lens[s]]
        k = np.repeat(kv[:, 0::2], heads // kv_heads, axis=1)
        v = np.repeat(kv[:, 1::2], heads // kv_heads, axis=1)
        for j in range(q_lens[s]):
            row, last = cu[s] + j, kv_lens[s] - q_lens[s] + j
            scores = np.einsum("hd,khd->hk", q[row], k[:last + 1]) * 0.25
            p = np.exp(scores - scores.max(-1, keepdims=True))
            want = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), v[:last + 1])
            np.testing.assert_allclose(out[row], want, rtol=1e-5, atol=1e-5)
    assert not out[9].any()


def test_ragged_paged_attention_dense_path_scales_float8_pages_as_the_kernel_does():
    """Float8 pages (an fp8 KV cache) off TPU: keys and values read in float32 times k_scale
    and v_scale, then in the queries' dtype, as JAX's kernel reads them."""
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((6, 4, 8, 128)).astype(np.float32)
    kv8 = jnp.asarray(kv, jnp.float8_e4m3fn)
    q = rng.standard_normal((3, 8, 128)).astype(np.float32)
    index = (np.array([7, 3, 12], np.int32), np.array([[0, 1, 2, 3], [4, 0, 0, 0], [5, 2, 3, 1]],
                                                      np.int32),
             np.array([0, 1, 2, 3], np.int32), np.array([3], np.int32))
    got = _ragged_paged_attention(q, kv8, *index, sm_scale=0.1, k_scale=0.5, v_scale=2.0)
    scaled = np.asarray(kv8, np.float32)
    scaled[:, :, 0::2] *= 0.5
    scaled[:, :, 1::2] *= 2.0
    want = _ragged_paged_attention(q, scaled, *index, sm_scale=0.1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


try:  # (pytest 9's importorskip passes on an ImportError that is not ModuleNotFoundError, as
    # this module's own is; and a skip here would skip the kernels above with the two below)
    tokamax = importlib.import_module("torchtpu.kernels.tokamax")
except ImportError:
    tokamax = None
needs_tokamax = pytest.mark.skipif(tokamax is None, reason="Tokamax is not installed: "
                                   "pip install -e '.[tokamax]'")


@needs_tokamax
def test_tokamax_attention_forward_and_backward_compile_through_mosaic(device):
    attention = functools.partial(tokamax._dot_product_attention, is_causal=True)
    text, report = _compile(device, _grads(attention, (0, 1, 2)), *[_bf16(2, 512, 4, 128)] * 3)
    assert _mosaic_kernels(text) >= 2 and report.compiles, report.error  # forward, backward


@needs_tokamax
def test_tokamax_ragged_dot_forward_and_backward_compile_through_mosaic(device):
    def grads(lhs, rhs, group_sizes):
        return jax.grad(lambda a, b: tokamax._ragged_dot(a, b, group_sizes)
                        .astype(jnp.float32).sum(), argnums=(0, 1))(lhs, rhs)

    text, report = _compile(device, grads, _bf16(512, 256), _bf16(4, 256, 256),
                            jax.ShapeDtypeStruct((4,), jnp.int64))
    assert _mosaic_kernels(text) >= 2 and report.compiles, report.error
