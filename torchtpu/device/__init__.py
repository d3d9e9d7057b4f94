"""The "tpu" device: tensors, storages, views, transfers, RNG and the ``torch.tpu`` module."""
