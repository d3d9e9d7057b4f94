"""torchtpu.jax.to_jax: PyTorch modules as pure JAX functions, against torch on CPU.

Outputs and jax.grad gradients are compared with the module and its autograd on CPU; vmap runs a
module written for one example over a batch; a few steps of training in a JAX loop (optax's SGD
where optax is installed) end where torch.optim.SGD ends.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchtpu.demo.gpt import TinyGPT
from torchtpu.jax import to_jax


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.GELU(), torch.nn.Linear(16, 4))


def _parameters(module: torch.nn.Module, params: dict) -> dict:
    return {n: params[n] for n, _ in module.named_parameters()}


def test_outputs_and_gradients_equal_torch_autograd():
    model = TinyGPT(32, 16, n_layer=1, n_head=2, n_embd=16).eval()
    fn, params = to_jax(model)
    x = torch.randint(32, (3, 10))
    y = torch.randint(32, (3, 10))
    logits, loss = fn(params, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    ref_logits, ref_loss = model(x, y)
    np.testing.assert_allclose(np.asarray(logits), ref_logits.detach().numpy(), atol=1e-5)
    ref_loss.backward()
    grads = jax.jit(jax.grad(lambda p, a, b: fn(p, a, b)[1]))(
        _parameters(model, params), jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), p.grad.numpy(), atol=1e-5,
                                   err_msg=name)


def test_vmap_over_a_module_of_one_example():
    lin = torch.nn.Linear(8, 3)
    fn, params = to_jax(lin)
    x = torch.randn(5, 8)
    out = jax.vmap(lambda xi: fn(params, xi))(jnp.asarray(x.numpy()))
    np.testing.assert_allclose(np.asarray(out), lin(x).detach().numpy(), atol=1e-6)


def test_batchnorm_in_training_mode_gives_its_new_buffers():
    model = _mlp().train()
    fn, params = to_jax(model)
    x = torch.randn(6, 8)
    out, buffers = fn(params, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(np.asarray(out), model(x).detach().numpy(), atol=1e-5)
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        np.testing.assert_allclose(np.asarray(buffers[name]), model.get_buffer(name).numpy(),
                                   atol=1e-6)


def test_trains_in_a_jax_loop_as_torch_sgd_does():
    model = _mlp().eval()
    fn, params = to_jax(model)
    weights = _parameters(model, params)
    xs = [torch.randn(4, 8) for _ in range(3)]

    def loss(p, x):
        return jnp.mean(fn(p, x) ** 2)

    try:
        import optax
        opt = optax.sgd(0.1)
        state = opt.init(weights)

        @jax.jit
        def step(p, state, x):
            grads = jax.grad(loss)(p, x)
            updates, state = opt.update(grads, state)
            return optax.apply_updates(p, updates), state
    except ImportError:  # plain SGD in JAX
        state = None

        @jax.jit
        def step(p, state, x):
            return jax.tree.map(lambda w, g: w - 0.1 * g, p, jax.grad(loss)(p, x)), state

    for x in xs:
        weights, state = step(weights, state, jnp.asarray(x.numpy()))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        sgd.zero_grad()
        (model(x) ** 2).mean().backward()
        sgd.step()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(weights[name]), p.detach().numpy(), atol=1e-5,
                                   err_msg=name)


def test_a_jax_program_calls_the_module_and_retraces_per_shape():
    model = _mlp().eval()
    fn, params = to_jax(model)

    @jax.jit
    def program(p, x):
        return jnp.tanh(fn(p, x * 2.0)).sum(-1)

    for n in (3, 5):
        x = torch.randn(n, 8)
        expected = torch.tanh(model(x * 2.0)).sum(-1).detach().numpy()
        np.testing.assert_allclose(np.asarray(program(params, jnp.asarray(x.numpy()))),
                                   expected, atol=1e-5)


def test_missing_parameter_and_random_ops_are_named():
    model = _mlp().eval()
    fn, params = to_jax(model)
    with pytest.raises(KeyError, match=r"torchtpu.argument: params has no '0.weight'"):
        fn({k: v for k, v in params.items() if k != "0.weight"}, jnp.zeros((2, 8)))
    drop = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
    fn, params = to_jax(drop)
    with pytest.raises(NotImplementedError, match=r"torchtpu.export: .*dropout.* \(called in "
                       r"module '1' \(Dropout\)\) draws random numbers"):
        fn(params, jnp.zeros((2, 4)))
