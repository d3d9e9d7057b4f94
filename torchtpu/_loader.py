"""The ``torch.backends`` entry point: ``import torch`` calls ``load()`` to register "tpu"."""


def load() -> None:
    import torchtpu  # noqa: F401  (importing registers the device)
