"""The sampled tokens of an async-scheduled step, read to the host without blocking the launch.

With async scheduling vLLM's GPU runner hands the engine an ``AsyncGPUModelRunnerOutput``: it
starts the tokens' copy to the host on a side stream and records an event, and the engine waits
on it (``get_output``) only after it has scheduled and launched the next step. On "tpu" a
``to("cpu", non_blocking=True)`` waits for the step's program, which would serialize the two
steps again; :class:`TpuAsyncOutput` starts JAX's asynchronous copy of the tokens' array instead
(held, so a later replay that rebinds their storage cannot change them) and fills the CPU tensor
vLLM reads when the event is waited on.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput

from torchtpu import metrics
from torchtpu.eager.capture import storage_of


class _HostCopy:
    """The event vLLM waits on: fills ``into`` from the array's host copy, once."""

    def __init__(self, array, into: torch.Tensor, offset: int) -> None:
        self._array, self._into, self._offset = array, into, offset
        array.copy_to_host_async()

    def synchronize(self) -> None:
        if self._array is None:
            return
        flat = np.asarray(self._array).reshape(-1)
        n = self._into.numel()
        # written through its NumPy view, in place (an inference tensor, made under vLLM's
        # inference mode: torch's copy_ into it would need that mode again; ~21 -> 6 us)
        self._into.numpy().reshape(-1)[:] = flat[self._offset:self._offset + n]
        self._array = None

    def query(self) -> bool:
        return self._array is None or self._array.is_ready()


class TpuAsyncOutput(AsyncGPUModelRunnerOutput):
    """vLLM's async output with the tokens' copy started, not waited for (greedy steps without
    logprobs; anything else is vLLM's own)."""

    def __init__(self, model_runner_output, sampled_token_ids: torch.Tensor, logprobs_tensors,
                 invalid_req_indices: list[int], async_output_copy_stream, vocab_size: int,
                 check_ep_fault: bool = False, num_nans=None) -> None:
        array = storage_of(sampled_token_ids)._tpu_array
        if (logprobs_tensors is not None or num_nans is not None or check_ep_fault
                or not sampled_token_ids.is_contiguous() or not isinstance(array, jax.Array)
                or np.dtype(array.dtype) != np.dtype(np.int32)
                or sampled_token_ids.dtype != torch.int32):
            metrics.count("vllm_async_copies_waited")  # vLLM's copy: it waits for the step
            super().__init__(model_runner_output, sampled_token_ids, logprobs_tensors,
                             invalid_req_indices, async_output_copy_stream, vocab_size,
                             check_ep_fault, num_nans)
            return
        self._model_runner_output = model_runner_output
        self._invalid_req_indices = invalid_req_indices
        self._sampled_token_ids = sampled_token_ids
        self.vocab_size = vocab_size
        self._logprobs_tensors = self._logprobs_tensors_cpu = None
        self._num_nans = self._num_nans_cpu = self._has_fault = None
        self.sampled_token_ids_cpu = torch.empty(sampled_token_ids.shape, dtype=torch.int32)
        self.async_copy_ready_event = _HostCopy(array, self.sampled_token_ids_cpu,
                                                sampled_token_ids.storage_offset())
