"""KV offload to host memory on device "tpu" (``kv_offloading_size``: vLLM's OffloadingConnector
with torchtpu's copy worker, ``integrations/vllm/offload.py``).

A prompt is served, then prompts that need the whole small device KV cache push its blocks out
of it, then the prompt comes again: with offload its blocks are read back from host memory
(vLLM's external prefix-cache hits, the worker's loads), without they are computed again; the
tokens are the same. vLLM venv only; skipped elsewhere.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_vllm_features import run_engine

_ENGINE = r"""
import json, sys
import vllm
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

model, prompts, options = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
# 16-token blocks of 16 KiB (2 layers): 24 of them, so the fillers evict the first prompt's
llm = vllm.LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=2,
               max_num_batched_tokens=256, gpu_memory_utilization=0.01,
               kv_cache_memory_bytes=24 * 16 * 1024, enable_prefix_caching=True,
               disable_log_stats=False, **options)
params = vllm.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
names = ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits",
         "vllm:external_prefix_cache_queries")

def counters():
    m = {x.name: x.value for x in llm.get_metrics() if hasattr(x, "value")}
    return {n: m.get(n, 0) for n in names}

def transfers(worker):
    if not has_kv_transfer_group():
        return None
    w = get_kv_transfer_group().connector_worker.worker
    return [type(w).__name__, w.stores, w.loads]

phases = []
for prompt in prompts:
    before = counters()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    after = counters()
    phases.append({"ids": list(out.outputs[0].token_ids),
                   **{n: after[n] - before[n] for n in names}})
print("RESULT " + json.dumps({"phases": phases, "blocks": llm.llm_engine.vllm_config
                              .cache_config.num_gpu_blocks,
                              "transfers": llm.collective_rpc(transfers)[0]}))
"""

_rng = np.random.default_rng(0)
# printable bytes (one token each), no shared prefixes beyond chance
_text = lambda n: "".join(map(chr, _rng.integers(97, 123, n)))  # noqa: E731
FIRST = _text(120)
PROMPTS = [FIRST, _text(200), _text(200), _text(200), FIRST]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed: "
                        "python -m torchtpu.integrations.vllm.install")
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("vllm") / "llama", "llama"))


def _run(model: str, options: dict) -> dict:
    proc, got = run_engine(_ENGINE, model, json.dumps(PROMPTS), json.dumps(options))
    assert got, proc.stderr[-5000:]
    return got


def test_worker_copies_blocks_to_host_chunks_and_back_as_cpu_indexing_does():
    """Two KV-cache groups (two layer tensors each side of one group), 2 device blocks a host
    chunk, the second group starting mid-chunk: the worker's host bytes and the blocks it
    writes back equal plain CPU indexing of the same caches."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from torchtpu.integrations.vllm.offload import TpuHostOffloadingWorker

    g = torch.Generator().manual_seed(0)
    caches = [torch.randint(-128, 128, (10, 24), generator=g, dtype=torch.int8)
              for _ in range(3)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(c.tpu(), 24) for c in caches],
                           [[CanonicalKVCacheRef(0, 24), CanonicalKVCacheRef(1, 24)],
                            [CanonicalKVCacheRef(2, 24)]])
    worker = TpuHostOffloadingWorker(kv, blocks_per_chunk=2, num_chunks=4)
    # group 0: device blocks 7, 2, 5 from its request's block 0 -> host chunks 3, 0 (sub-blocks
    # 6, 7, 0); group 1: device blocks 4, 9 from block 3 -> chunks 1, 2 (sub-blocks 3, 4)
    device = GPULoadStoreSpec([7, 2, 5, 4, 9], group_sizes=[3, 2], block_indices=[0, 3])
    assert worker.submit_store(1, device, CPULoadStoreSpec([3, 0, 1, 2]))
    for t, rows in ((0, {6: 7, 7: 2, 0: 5}), (1, {6: 7, 7: 2, 0: 5}), (2, {3: 4, 4: 9})):
        for sub, block in rows.items():
            assert torch.equal(worker.host_tensors[t][sub], caches[t][block]), (t, sub)
    # back into other device blocks
    back = GPULoadStoreSpec([1, 3, 0, 6, 8], group_sizes=[3, 2], block_indices=[0, 3])
    assert worker.submit_load(2, CPULoadStoreSpec([3, 0, 1, 2]), back)
    for t, pairs in ((0, [(1, 7), (3, 2), (0, 5)]), (2, [(6, 4), (8, 9)])):
        got = kv.tensors[t].tensor.cpu()
        for dst, src in pairs:
            assert torch.equal(got[dst], caches[t][src]), (t, dst)
    assert [r.job_id for r in worker.get_finished()] == [1, 2] and worker.get_finished() == []


@pytest.mark.full  # two engines of their own: minutes
def test_a_prefix_evicted_from_device_memory_is_read_back_from_host(tiny_llama):
    plain = _run(tiny_llama, {})
    offload = _run(tiny_llama, {"kv_offloading_size": 0.01})
    assert plain["blocks"] == offload["blocks"] <= 25, plain["blocks"]
    assert plain["transfers"] is None
    # the first prompt's 7 whole blocks left device memory: no device prefix hit either time
    for run in (plain, offload):
        assert run["phases"][-1]["vllm:prefix_cache_hits"] == 0, run["phases"][-1]
    assert plain["phases"][-1]["vllm:external_prefix_cache_hits"] == 0
    # with offload they came back from host memory: 7 blocks of 16 tokens
    again = offload["phases"][-1]
    assert again["vllm:external_prefix_cache_hits"] == 7 * 16, again
    kind, stores, loads = offload["transfers"]
    assert kind == "TpuHostOffloadingWorker" and stores >= 4 and loads == 1, offload["transfers"]
    ids = [p["ids"] for p in offload["phases"]]
    assert ids == [p["ids"] for p in plain["phases"]]
    assert ids[-1] == ids[0]
    print(f"KV offload: {stores} stores, {loads} load; the prompt's second time "
          f"{again['vllm:external_prefix_cache_hits']:.0f} of "
          f"{again['vllm:external_prefix_cache_queries']:.0f} tokens from host memory")
