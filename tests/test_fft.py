"""torch.fft against CPU: the three ATen transforms, every normalization, onesided and not,
explicit sizes (last_dim_size of c2r), and gradients through them."""

import pytest
import torch

from torchtpu.testing.compare import assert_same, check_against_cpu

X = torch.randn(4, 6)
Z = torch.randn(4, 6, dtype=torch.complex64)


@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_transforms_each_norm(norm):
    def fn(x, z):
        return (torch.fft.fft(x, norm=norm), torch.fft.ifft(z, norm=norm),
                torch.fft.rfft2(x, norm=norm), torch.fft.irfft(z, norm=norm),
                torch.fft.irfftn(z, s=(3, 7), norm=norm), torch.fft.hfft(z, n=9, norm=norm),
                torch.fft.ihfft(x, norm=norm), torch.fft.fftn(z, dim=(0, 1), norm=norm))

    check_against_cpu(fn, X, Z, atol=1e-5, rtol=1e-5)


def test_not_onesided_and_sizes():
    def fn(x):
        full = torch.stft(x, 8, hop_length=4, window=torch.ones(8, device=x.device),
                          onesided=False, return_complex=True)
        return full, torch.fft.rfft(x, n=5), torch.fft.fft(x, n=10, dim=0)

    check_against_cpu(fn, torch.randn(32), atol=1e-5, rtol=1e-5)


def test_gradients():
    def grads(x, z):
        x = x.detach().requires_grad_()
        z = z.detach().requires_grad_()
        out = (torch.fft.rfft(x).abs().sum() + torch.fft.irfft(z, n=8).sum()
               + torch.fft.fft2(z).real.pow(2).sum())
        return torch.autograd.grad(out, (x, z))

    assert_same(grads(X.to("tpu"), Z.to("tpu")), grads(X, Z), atol=1e-4, rtol=1e-5)
