"""Neural-network ops: activations, softmax, normalization layers, losses, attention.

No lowerings live here yet, on purpose: every op of this family that reaches the device has a
``torch._decomp`` decomposition whose pieces are lowered elsewhere, and tests/test_nn_ops.py checks
each against CPU, forward and backward. That covers ``_softmax``/``_log_softmax`` and their
backward_data ops, gelu/silu/relu/leaky_relu/elu/hardtanh/softplus/mish/hardswish/hardsigmoid
and their backwards, ``native_layer_norm``, ``native_batch_norm`` (its decomposition writes the
running stats back with ``copy_``, which lands in the device storage), ``native_group_norm``,
``_fused_rms_norm``, the nll/mse/bce/smooth_l1/huber losses. ``scaled_dot_product_attention`` on
a tpu tensor takes the math path (no fused kernel is registered for PrivateUse1), which is
CompositeImplicitAutograd and so reaches the device as bmm/softmax/where pieces.

Lower an op here only when its decomposition is wrong or measurably too slow.
"""
