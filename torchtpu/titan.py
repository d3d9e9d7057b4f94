"""``python -m torchtpu.titan ARGS``: TorchTitan's trainer (``python -m torchtitan.train ARGS``)
on torch 2.13, with the one shim it needs (``integrations/titan.py``); also under torchrun."""

from torchtpu.integrations.titan import main

if __name__ == "__main__":
    main()
