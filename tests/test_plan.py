"""python -m torchtpu.plan: a step's sizes measured on the host, layouts priced and ranked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtpu.tools import plan as planner

D, F, LAYERS = 64, 256, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.up_proj, self.down_proj = nn.Linear(D, F), nn.Linear(F, D)

    def forward(self, x):
        h = self.norm(x)
        a = torch.softmax(self.q_proj(h) @ self.k_proj(h).transpose(-1, -2), -1) @ self.v_proj(h)
        x = x + self.o_proj(a)
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 100)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.layers:
            x = b(x)
        return self.head(x).logsumexp(-1).mean()


def make(batch=2):
    torch.manual_seed(0)
    return Net(), (torch.randint(0, 100, (batch, 32)),)


def test_sizes_are_measured_not_guessed():
    model, inputs = make()
    s = planner.measure(model, inputs)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert (s.parameters, s.gradients, s.optimizer) == (params, params, 2 * params)
    assert s.blocks == LAYERS and s.blocks_path == "layers" and s.hidden == D
    assert s.block_input == 2 * 32 * D * 4
    linear = sum(p.numel() for n, p in model.layers.named_parameters() if "proj" in n) * 4
    assert s.tp_parameters == linear
    # saved activations grow with the batch; parameters saved for backward are not activations
    s4 = planner.measure(*make(batch=4))
    assert s4.activations == pytest.approx(2 * s.activations, rel=0.05)
    assert s4.residual_activations == 2 * s.residual_activations > 0


def test_layouts_are_priced_by_their_shards_and_collectives():
    model, inputs = make()
    p = planner.plan(model, inputs, chips=4, hbm_bytes=1 << 30)
    by = {lay.name: lay for lay in p.layouts}
    assert set(by) == {"DDP", "FSDP2", "FSDP2 x TP (2x2)", "TP (4)", "HSDP (2x2)"}
    s = p.sizes
    state = s.parameters + s.gradients + s.optimizer
    assert by["DDP"].memory == {"state": state, "activations": s.activations}
    assert by["DDP"].collective_bytes == int(2 * s.gradients * 3 / 4)
    assert by["FSDP2"].memory["state"] == state // 4
    assert by["FSDP2"].collective_bytes == 2 * int(s.parameters * 3 / 4) + int(s.gradients * 3 / 4)
    assert by["HSDP (2x2)"].collectives["dp_replicate"] == int(2 * s.gradients / 2 / 2)
    # TP keeps what it does not split (embedding, norms, head) whole on each rank
    assert by["TP (4)"].memory["state"] > state / 4
    assert by["TP (4)"].collectives == {"tp": 4 * LAYERS * int(2 * s.block_input * 3 / 4)}
    assert [lay.collective_bytes for lay in p.layouts] == sorted(
        lay.collective_bytes for lay in p.layouts)  # all fit: ranked by bytes sent


def test_a_tight_chip_ranks_what_fits_first_and_the_code_is_python():
    model, inputs = make()
    ddp = planner.plan(model, inputs, chips=4, hbm_bytes=1 << 30).layouts
    need = {lay.name: lay.bytes_per_chip for lay in ddp}
    hbm = (need["FSDP2"] + need["DDP"]) // 2  # FSDP2 fits, DDP does not
    p = planner.plan(model, inputs, chips=4, hbm_bytes=hbm)
    fits = {lay.name for lay in p.layouts if lay.fits}
    assert "FSDP2" in fits and "DDP" not in fits
    assert p.layouts[:len(fits)] == [lay for lay in p.layouts if lay.fits]
    for lay in p.layouts:
        compile(lay.code, lay.name, "exec")
    tp = next(lay for lay in p.layouts if lay.name == "FSDP2 x TP (2x2)").code
    assert '"q_proj": ColwiseParallel()' in tp and '"down_proj": RowwiseParallel()' in tp
    assert 'fully_shard(block, mesh=mesh["dp_shard"])' in tp
    assert "fully_shard(model, mesh=mesh)" in next(
        lay for lay in p.layouts if lay.name.startswith("HSDP")).code


def _cli(tmp_path, *args):
    script = tmp_path / "m.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})\n"
                      "from test_plan import make\n"
                      "def broken():\n    return __import__('torch').nn.Linear(3, 3), "
                      "(__import__('torch').ones(2, 4),)\n")
    return planner.main([f"{script}:{args[0]}", *args[1:]])


def test_cli_and_its_clear_errors(tmp_path, capsys):
    assert _cli(tmp_path, "make", "--topology", "v5e:2x2") == 0
    assert "best: TP (4)" in capsys.readouterr().out
    cases = [(("make", "--chips", "0", "--hbm", "1"), "must be a positive int"),
             (("make", "--chips", "8", "--topology", "v5e:2x2"), "more than v5e:2x2's 4 chips"),
             (("make", "--chips", "2"), "--hbm GiB or --topology"),
             (("make", "--topology", "v9z:2x2"), "is not a TPU topology"),
             (("make", "--chips", "2", "--hbm", "0.0001"), "no layout fits 2 chips"),
             (("broken", "--chips", "2", "--hbm", "1"), "the training step fails on CPU")]
    for args, words in cases:
        assert _cli(tmp_path, *args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("torchtpu.tool:") and words in err, (args, err)
        assert "Traceback" not in err
