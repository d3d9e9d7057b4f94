"""torch.tpu.pallas.jax_op (torchtpu/kernels/jax_op.py): schema, fake kernel, every eager mode,
torch.compile, autograd (derived and registered), mesh, and the errors it gives."""


import jax
import jax.numpy as jnp
import pytest
import torch
from jax.sharding import Mesh, PartitionSpec

from torchtpu import errors
from torchtpu.kernels import pallas_mode
from torchtpu.kernels.jax_op import jax_op
from torchtpu.testing.compare import assert_same

EagerMode = torch.tpu.EagerMode


def _scaled_sin(x: jax.Array, y: jax.Array | None = None, scale: float = 2.0,
                dims: tuple[int, ...] = (0,)) -> tuple[jax.Array, jax.Array]:
    out = jnp.sin(x) * scale
    if y is not None:
        out = out + y * y
    return out, out.sum(dims)


scaled_sin = jax_op("test_jax_op::scaled_sin", _scaled_sin)


def _reference(x, y=None, scale=2.0, dims=(0,)):
    out = torch.sin(x) * scale
    if y is not None:
        out = out + y * y
    return out, out.sum(dims)


def _inputs():
    return torch.randn(3, 5), torch.randn(3, 5)


def _grads_of(fn, device, *inputs, **kwargs):
    leaves = [t.detach().to(device).requires_grad_() for t in inputs]
    out, total = fn(*leaves, **kwargs)
    (out * out).sum().add(total.sum()).backward()
    return (out, total), [t.grad for t in leaves]


def test_exposed_where_the_reference_has_it():
    import torch_tpu.pallas

    import torchtpu.pallas

    assert torch.tpu.pallas.jax_op is jax_op
    assert torchtpu.pallas.jax_op is jax_op
    assert torch_tpu.pallas.jax_op is jax_op
    assert isinstance(scaled_sin, torch._library.custom_ops.CustomOpDef)


def test_schema_comes_from_the_annotations():
    schema = str(torch.ops.test_jax_op.scaled_sin.default._schema)
    assert schema == ("test_jax_op::scaled_sin(Tensor x, Tensor? y=None, float scale=2., "
                      "int[] dims=[0]) -> (Tensor, Tensor)")


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
                                  EagerMode.DEFER_AND_FUSE])
def test_values_and_derived_gradients_in_every_eager_mode(mode):
    x, y = _inputs()
    expected = _grads_of(_reference, "cpu", x, y, scale=3.0, dims=(1,))
    with torch.tpu.set_eager_mode(mode):
        got = _grads_of(scaled_sin, "tpu", x, y, scale=3.0, dims=(1,))
    assert_same(got, expected)


def test_defer_and_fuse_records_the_op_without_a_flush():
    x, _ = _inputs()
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        a = x.to("tpu") * 2
        out, _ = scaled_sin(a)
        assert not torch.tpu.is_materialized(out)
        assert "scaled_sin" in torch.tpu.pending_hlo()
        assert_same(out, torch.sin(x * 2) * 2)


def test_compiled_graph_lowers_it_into_its_own_program(fresh_dynamo):
    x, y = _inputs()
    seen = []
    fn = torch.compile(lambda a, b: scaled_sin(a * 2, b)[0].exp(), backend="tpu",
                       options={"debug_callback": lambda gm, hlo: seen.append((gm.code, hlo))})
    leaves = [t.to("tpu").requires_grad_() for t in (x, y)]
    out = fn(*leaves)
    out.sum().backward()
    ref = [t.clone().requires_grad_() for t in (x, y)]
    expected = _reference(ref[0] * 2, ref[1])[0].exp()
    expected.sum().backward()
    assert_same([out, *[t.grad for t in leaves]], [expected, *[t.grad for t in ref]], atol=1e-4)
    forward_code, forward_hlo = seen[0]
    assert "test_jax_op.scaled_sin" in forward_code
    assert "sin" in forward_hlo  # the op's math is inside the graph's program, not a call out
    assert any("scaled_sin_vjp" in code for code, _ in seen[1:])


def test_registered_autograd_with_a_second_jax_op():
    def square(x: jax.Array) -> jax.Array:
        return x * x

    def square_backward(x: jax.Array, g: jax.Array) -> jax.Array:
        return 2 * x * g + 1  # +1: tells this backward from the derived one

    op = jax_op("test_jax_op::square", square)
    backward = jax_op("test_jax_op::square_backward", square_backward)
    op.register_autograd(lambda ctx, g: backward(ctx.saved_tensors[0], g),
                         setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
    x = torch.randn(4)
    xt = x.to("tpu").requires_grad_()
    op(xt).sum().backward()
    assert_same(xt.grad, 2 * x + 1)


def test_register_fake_overrides_and_a_disagreeing_fake_is_an_error():
    def double(x: jax.Array) -> jax.Array:
        return x * 2

    op = jax_op("test_jax_op::double", double)
    op.register_fake(lambda x: x.new_empty(x.shape[::-1]))  # wrong: transposed
    with pytest.raises(ValueError, match=r"test_jax_op::double.*result 0 is float32\[2, 3\] but "
                                         r"its fake kernel says float32\[3, 2\].*register_fake"):
        op(torch.ones(2, 3, device="tpu"))
    op.register_fake(lambda x: torch.empty_like(x))
    assert_same(op(torch.ones(2, 3, device="tpu")), torch.full((2, 3), 2.0))


def test_mesh_and_partition_specs_on_one_device():
    mesh = Mesh(jax.devices()[:1], ("x",))

    def add(a: jax.Array, b: jax.Array) -> jax.Array:
        return a + b

    op = jax_op("test_jax_op::sharded_add", add, mesh=mesh,
                input_partition_specs=(PartitionSpec("x"), PartitionSpec("x")),
                output_partition_specs=PartitionSpec("x"))
    a, b = torch.randn(4, 2), torch.randn(4, 2)
    assert_same(op(a.to("tpu"), b.to("tpu")), a + b)
    with pytest.raises(ValueError, match="one per jax.Array parameter"):
        jax_op("test_jax_op::bad_specs", add, mesh=mesh,
               input_partition_specs=(PartitionSpec("x"),), output_partition_specs=PartitionSpec())


def test_bad_definitions_name_the_problem():
    def unannotated(x):
        return x

    with pytest.raises(ValueError, match="parameter 'x'.*no type annotation") as caught:
        jax_op("test_jax_op::unannotated", unannotated)
    assert errors.category_of(caught.value) == "kernel"

    def listy(x: jax.Array, n: list) -> jax.Array:
        return x

    with pytest.raises(ValueError, match="parameter 'n'.*no torch schema type"):
        jax_op("test_jax_op::listy", listy)

    def no_return(x: jax.Array):
        return x

    with pytest.raises(ValueError, match="no return annotation"):
        jax_op("test_jax_op::no_return", no_return)

    def ok(x: jax.Array, n: int = 1) -> jax.Array:
        return x

    with pytest.raises(ValueError, match="'namespace::op_name'"):
        jax_op("no_namespace", ok)
    with pytest.raises(ValueError, match="donate_argnums entry 1"):
        jax_op("test_jax_op::donating", ok, donate_argnums=(1,))
    with pytest.raises(ValueError, match="already exists"):
        jax_op("test_jax_op::scaled_sin", ok)


def test_cpu_tensors_are_refused_with_what_to_do():
    with pytest.raises(RuntimeError, match=r"scaled_sin' runs on tpu tensors.*\.to\('tpu'\)"):
        scaled_sin(torch.ones(2))


def _pallas_double(x: jax.Array) -> jax.Array:
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


pallas_double = jax_op("test_jax_op::pallas_double", _pallas_double)


def test_a_pallas_kernel_is_interpreted_off_tpu_unedited(monkeypatch):
    assert pallas_mode.setting() is True  # CPU: interpret
    x = torch.arange(6.0).reshape(2, 3)
    assert_same(pallas_double(x.to("tpu")), x * 2)


def test_a_kernel_jax_cannot_differentiate_says_what_to_do():
    x = torch.ones(3, device="tpu", requires_grad=True)
    with pytest.raises(ValueError, match=r"pallas_double': JAX cannot differentiate.*"
                                         r"register_autograd.*custom_vjp"):
        pallas_double(x).sum().backward()


def test_interpret_off_on_cpu_names_the_op_and_the_fix(monkeypatch):
    monkeypatch.setenv("TORCHTPU_PALLAS_INTERPRET", "off")
    with pytest.raises(RuntimeError, match=r"pallas_double'.*failed to lower.*"
                                           r"TORCHTPU_PALLAS_INTERPRET"):
        pallas_double(torch.ones(5, device="tpu"))


def test_tpu_interpreter_asked_for_where_it_does_not_run(monkeypatch):
    monkeypatch.setenv("TORCHTPU_PALLAS_INTERPRET", "tpu")
    monkeypatch.setattr(pallas_mode.platform, "platform", lambda: "gpu")
    with pytest.raises(RuntimeError, match=r"pallas_double'.*runs only on the CPU platform.*'gpu'"):
        pallas_double(torch.ones(7, device="tpu"))
    monkeypatch.setenv("TORCHTPU_PALLAS_INTERPRET", "sometimes")
    with pytest.raises(ValueError, match="TORCHTPU_PALLAS_INTERPRET='sometimes'"):
        pallas_mode.mode()
