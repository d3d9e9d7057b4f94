"""``python -m torchtpu.demo``: train a small character-level GPT on device "tpu", then sample.

It shows the ordinary PyTorch training loop (AdamW, gradient clipping, ``loss.item()`` every step)
running unchanged on the device, a progress bar with loss and tokens/s, a generated sample, and
``torchtpu.metrics`` at the end (compiles, executions, transfers, and any CPU fallbacks).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from tqdm import tqdm

import torchtpu
from torchtpu.demo.gpt import TinyGPT, train_steps
from torchtpu.demo.model import CharVocab, load_text, sample

BLOCK, LAYERS, HEADS, WIDTH, BATCH = 64, 2, 4, 64, 16
MODES = {"strict": "DEFER_NEVER", "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING",
         "defer_and_fuse": "DEFER_AND_FUSE"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchtpu.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--device", default="tpu", help="torch device (default tpu)")
    parser.add_argument("--eager-mode", choices=sorted(MODES), default="defer_and_fuse",
                        help="torch.tpu eager mode on tpu (default defer_and_fuse: each step "
                             "runs as one fused program)")
    parser.add_argument("--sample-chars", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def eager_mode(device: torch.device, name: str):
    if device.type != "tpu":
        return contextlib.nullcontext()
    return torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, MODES[name]))


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    text = load_text()
    vocab = CharVocab(text)
    data = vocab.encode(text)
    torch.manual_seed(args.seed)
    # Built on the device directly: the head stays tied to the token embedding.
    with torch.device(device):
        model = TinyGPT(len(vocab), BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH)
    n_params = sum(p.numel() for p in model.parameters())
    # Where "tpu" is: XLA's CPU here, a TPU chip on a TPU VM (torchtpu also logs it once).
    where = f" = {torch.tpu.get_device_name()}" if device.type == "tpu" else ""
    print(f"TinyGPT: {n_params:,} parameters, {len(vocab)} characters, {len(data):,} tokens of "
          f"text; device {device}{where}, {args.steps} steps of batch {BATCH}x{BLOCK}")

    bar = tqdm(total=args.steps, unit="step")
    start = [time.perf_counter()]

    def on_step(step: int, loss: float) -> None:
        if step == 0:  # the first step compiles; the rate counts the steps after it
            start[0] = time.perf_counter()
        rate = step * BATCH * BLOCK / max(time.perf_counter() - start[0], 1e-9)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")
        bar.update(1)

    with eager_mode(device, args.eager_mode):
        losses = train_steps(model, data, args.steps, device, batch_size=BATCH, lr=3e-3,
                             seed=args.seed, on_step=on_step)
    bar.close()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    prompt = data[:BLOCK]
    ids = sample(model, prompt, args.sample_chars, seed=args.seed)
    print("\n--- sample (prompt, then generated) ---")
    print(vocab.decode(prompt.tolist()) + vocab.decode(ids))
    print("---\n")
    print(torchtpu.metrics.report())


if __name__ == "__main__":
    main()
