"""Diffusers pipelines on tpu, eager and compiled: a tiny UNet2D (DDPM) and a tiny DiT (DDIM with
a VAE), built from configs with random weights (no hub), denoise to the same image as on CPU."""

import copy

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="needs diffusers (pip install -e '.[dev]')")

TOL = dict(atol=1e-5, rtol=1e-5)


def _unet_pipeline():
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4).eval()
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=10)
    return diffusers.DDPMPipeline(unet=unet, scheduler=scheduler)


def _dit_pipeline():
    torch.manual_seed(0)
    transformer = diffusers.Transformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
        sample_size=4, patch_size=2, norm_type="ada_norm_zero", num_embeds_ada_norm=10,
        activation_fn="gelu-approximate").eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=4,
        norm_num_groups=4, layers_per_block=1, sample_size=8).eval()
    return diffusers.DiTPipeline(transformer=transformer, vae=vae,
                                 scheduler=diffusers.DDIMScheduler(num_train_timesteps=10))


def _denoise(pipe, name):
    kwargs = dict(generator=torch.Generator().manual_seed(0), num_inference_steps=2,
                  output_type="np")
    if name == "dit":
        return pipe(class_labels=[1], guidance_scale=1.0, **kwargs).images
    return pipe(batch_size=1, **kwargs).images


@pytest.mark.parametrize("name, compiled", [
    ("unet", False), pytest.param("unet", True, marks=pytest.mark.full), ("dit", False),
    ("dit", True)], ids=["unet-eager", "unet-compiled", "dit-eager", "dit-compiled"])
def test_pipeline_denoises_as_on_cpu(name, compiled, fresh_dynamo):
    pipe = {"unet": _unet_pipeline, "dit": _dit_pipeline}[name]()
    expected = _denoise(pipe, name)
    pipe = copy.deepcopy(pipe).to("tpu")
    if compiled:
        denoiser = "unet" if name == "unet" else "transformer"
        setattr(pipe, denoiser, torch.compile(getattr(pipe, denoiser), backend="tpu"))
    got = _denoise(pipe, name)
    assert got.shape == expected.shape
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(expected), **TOL)
