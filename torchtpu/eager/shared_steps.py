"""One device buffer for a capturable optimizer's step counts, made when a capture records its
step.

A ``capturable=True`` optimizer (AdamW, Adam, ...) keeps one 0-dim device tensor
``state["step"]`` per parameter, each its own storage: a captured step reads and writes every one
of them (an 80-parameter AdamW: 80 arrays in and 80 out of the program, where the JAX step
carries one count). Before the step is recorded, the counts of each (dtype, device) become views
of one device buffer, made from their values while the capture is paused: each count stays the
same tensor object (``Tensor.set_`` re-points its storage; the guards compare identities) with
its own value, so the program reads and writes one array for all of them, and a count written
alone (a loaded state, a parameter stepped on its own) is still its own element.

Outside a capture the counts stay views of that buffer: an eager step writes each element (a
program per count for a foreach update of views; the buffer is made for replays).
"""

from __future__ import annotations

import torch

from torchtpu.eager.capture import Capture, storage_of


def share(opt: torch.optim.Optimizer, capture: Capture) -> None:
    """Make opt's 0-dim device step counts views of one buffer per (dtype, device)."""
    by_kind: dict = {}
    for group in opt.param_groups:
        for p in group["params"]:
            count = opt.state.get(p, {}).get("step")
            if (type(count) is torch.Tensor and count.dim() == 0
                    and count.device.type == "tpu" and not count.requires_grad):
                by_kind.setdefault((count.dtype, count.device), {})[id(count)] = count
    for counts in by_kind.values():
        counts = list(counts.values())
        # One count, or some in a buffer already (an earlier capture's, whose program reads
        # that buffer): none is moved again.
        if len(counts) < 2 or any(storage_of(c).nbytes() != c.element_size() for c in counts):
            continue
        with capture.paused(), torch.no_grad():
            buffer = torch.stack(counts)
            st = buffer.untyped_storage()
            capture.made_outside(st)
            for k, count in enumerate(counts):
                count.set_(st, k, (), ())
