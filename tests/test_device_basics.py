"""The quick-start path: creating tensors on tpu, moving them, simple math, printing."""

import torch

from torchtpu.testing.compare import check_against_cpu


def test_quickstart_runs_on_tpu():
    x = torch.ones((4, 4), device="tpu")
    y = torch.full((4, 4), 2.0).to("tpu")
    result = torch.matmul(x, y).cpu()
    assert x.device == torch.device("tpu", 0)
    assert str(x.device) == "tpu:0"
    torch.testing.assert_close(result, torch.full((4, 4), 8.0))


def test_add_mul_match_cpu():
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    check_against_cpu(lambda a, b: a + b * 2 - a / 3, a, b)


def test_is_plain_tensor():
    x = torch.zeros(2, device="tpu")
    assert type(x) is torch.Tensor
    assert x.is_tpu


def test_non_blocking_copy_to_host_keeps_strides_and_autograd():
    # DCP's checkpoint writer and many training loops copy this way; PyTorch's own kernel
    # would ask the backend for pinned host memory.
    base = torch.arange(6.0).view(2, 3)
    x = base.to("tpu").t().requires_grad_()
    host = x.to("cpu", non_blocking=True)
    assert host.stride() == (1, 3) and host.requires_grad
    torch.testing.assert_close(host, base.t())
    (host * 3).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.full((3, 2), 3.0))
    half = x.detach().to(torch.float16)
    assert half.device.type == "tpu" and half.dtype == torch.float16 and half.stride() == (1, 3)


def test_the_device_guard_answers_its_type_without_a_python_frame():
    # Every guard PyTorch makes asks the device type (~5,300 times a 12-layer Llama step):
    # a C-level answer, no frame of ours a call; backward across tpu still right.
    import sys

    from torchtpu import registration

    a = torch.randn(3, 4, requires_grad=True)
    x = a.detach().to("tpu").requires_grad_()
    frames = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "type_":
            frames.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        (x * 2).sin().sum().backward()
        x.grad.cpu()
    finally:
        sys.setprofile(None)
    assert not [f for f in frames if f == registration.__file__]
    (a * 2).sin().sum().backward()
    torch.testing.assert_close(x.grad.cpu(), a.grad)
