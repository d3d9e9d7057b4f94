"""Benchmark registry: model rows x forms, one table of step times, start-up cost and memory.

Each row is one model (``MODELS``: small configs of Hugging Face Llama-3.2, Gemma-3 and Qwen3
built from configs with random weights, the TinyGPT of ``bench/compile.py``, timm ResNet-50 and
ViT) in one kind (``forward``: the loss under ``no_grad``; ``train``: one AdamW step, zero_grad +
forward + backward (+ clipping where the row asks for it) + ``opt.step()``) and one form
(``FORMS``): native CPU eager, tpu Strict, tpu DeferAndFuse, the whole step under
``torch.compile(backend="tpu")``, the step captured once with ``torch.tpu.graph`` and replayed,
and the same step in one ``jax.jit`` where a JAX port exists (TinyGPT: ``bench/compile.py``'s;
the Hugging Face rows: ``bench/jax_models.py``, loading the torch model's weights).

Per row: the post-warm-up step time (mean of the timed steps, each ending in a host read of the
loss), the first step's time (for the captured form: capture + first replay, after one eager step
that creates the optimizer state), the warm-up overhead (the untimed steps' time beyond that many
steady steps), the peak device memory above the row's starting point (``torch.tpu``'s figures;
on XLA:CPU they are the live arrays sampled after each step, so in-program temporaries are not
seen), the ratios to Strict, CPU eager and JAX, and the largest loss difference from CPU eager.

    python bench/registry.py [--models llama-3.2,qwen3] [--kinds train] [--forms strict,captured]
                             [--steps 5] [--warmup 2] [--rounds N] [--threads 1]
                             [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.testing.hf_rows import HF_BATCH, HF_CONFIGS, HF_SEQ, HF_VOCAB, hf, tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_spec = importlib.util.spec_from_file_location(
    "bench_compile", os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile.py"))
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)
jm = cb.jm  # bench/jax_models.py: the JAX ports of the Hugging Face rows


@dataclasses.dataclass(frozen=True)
class Model:
    """One registry model: how to build it, feed it and score it."""

    name: str
    build: Callable[[], torch.nn.Module]      # seeded, on CPU
    batch: Callable[[torch.Generator], tuple]  # (input, target) on CPU
    loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    max_norm: float | None = None              # gradient clipping in the train step
    jax: Callable | None = None                # (kind, batches) -> (step(i) -> loss, sample)


def _images(size: int, classes: int, batch: int) -> Callable[[torch.Generator], tuple]:
    def draw(gen: torch.Generator) -> tuple:
        return (torch.randn(batch, 3, size, size, generator=gen),
                torch.randint(classes, (batch,), generator=gen))
    return draw


def _timm(arch: str, **kwargs) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import timm  # not in the dev venv: see SKIPPED
        torch.manual_seed(0)
        return timm.create_model(arch, pretrained=False, **kwargs)
    return build


def hf_loss(model, x, y):
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())


def _classifier_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def jax_form(port: Callable[[], tuple], max_norm: float | None = None) -> Callable:
    """A Model.jax: the row's step in one jax.jit, from ``port() -> (params, loss)`` (the torch
    model's own weights, the same batches); train: AdamW (+ clipping) with the parameters and
    moments donated."""
    def run(kind: str, batches: list) -> tuple[Callable, Callable]:
        p, loss = port()
        data = [(jnp.asarray(x.numpy()), jnp.asarray(y.numpy())) for x, y in batches]
        if kind == "forward":
            fn = jax.jit(loss)
            call = lambda x, y: fn(p, x, y)  # noqa: E731
        else:
            step = jax.jit(jm.train_step(loss, cb.LR, cb.BETAS, cb.EPS, cb.WD, max_norm),
                           donate_argnums=(0, 1, 2))
            state = [p, jax.tree.map(jnp.zeros_like, p), jax.tree.map(jnp.zeros_like, p),
                     jnp.zeros((), jnp.float32)]

            def call(x, y):
                *state[:], loss_value = step(*state, x, y)  # new parameters, moments, count
                return loss_value
        # The arrays live on the device torchtpu measures, so its figures hold for JAX too.
        return lambda i: float(call(*data[i])), torch.tpu.max_memory_allocated
    return run


def _hf_port(name: str) -> Callable[[], tuple]:
    return lambda: jm.port(hf(name)())


MODELS = {m.name: m for m in (
    *(Model(name, hf(name), tokens(HF_VOCAB, HF_SEQ, HF_BATCH), hf_loss,
            jax=jax_form(_hf_port(name))) for name in HF_CONFIGS),
    Model("tinygpt", cb._model, tokens(cb.VOCAB, cb.BLOCK, cb.BATCH),
          lambda m, x, y: m(x, y)[1], max_norm=cb.MAX_NORM,
          jax=jax_form(lambda: (cb._jax_params(cb._model()), cb._jax_loss), cb.MAX_NORM)),
    Model("resnet-50", _timm("resnet50", num_classes=10), _images(64, 10, 2), _classifier_loss),
    Model("vit", _timm("vit_tiny_patch16_224", img_size=64, num_classes=10), _images(64, 10, 2),
          _classifier_loss),
)}
# timm (and the torchvision it imports) lives in a venv of its own with torch 2.14.1: PyPI's only
# torchvision for torch 2.13 is a CUDA build that does not load against torch 2.13.0+cpu.
_NO_TIMM = ("timm is not installed (it needs torch 2.14.1 + torchvision 0.29.1 in a venv of its "
            "own: pip install -e '.[timm]', README: timm)")
SKIPPED = {} if importlib.util.find_spec("timm") else {"resnet-50": _NO_TIMM, "vit": _NO_TIMM}
KINDS = ("forward", "train")


def _timed(step: Callable[[int], float], sample: Callable, n: int,
           start: int = 0) -> tuple[list, list]:
    times, losses = [], []
    for i in range(start, start + n):
        start = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - start)
        sample()
    return times, losses


def _optimizer(model: torch.nn.Module, kind: str,
               capturable: bool) -> torch.optim.Optimizer | None:
    if kind == "forward":  # none: building one imports Dynamo, seconds a smoke test need not pay
        return None
    return torch.optim.AdamW(model.parameters(), lr=cb.LR, betas=cb.BETAS, eps=cb.EPS,
                             weight_decay=cb.WD, capturable=capturable)


def _body(spec: Model, kind: str, model, opt) -> Callable:
    """The step without zero_grad (what a capture records), returning the loss."""
    if kind == "forward":
        def forward(x, y):
            with torch.no_grad():
                return spec.loss(model, x, y)
        return forward

    def train(x, y):
        loss = spec.loss(model, x, y)
        loss.backward()
        if spec.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_norm)
        opt.step()
        return loss
    return train


def _step(body: Callable, opt) -> Callable:
    if opt is None:
        return body

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        return body(x, y)
    return step


def _eager(device: str, mode=None, compiled: bool = False) -> Callable:
    def run(spec: Model, kind: str, batches: list) -> tuple[Callable, Callable]:
        model = spec.build().to(device)
        opt = _optimizer(model, kind, capturable=device != "cpu")
        step = _step(_body(spec, kind, model, opt), opt)
        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, backend="tpu")
        data = [(x.to(device), y.to(device)) for x, y in batches]
        sample = torch.tpu.max_memory_allocated if device != "cpu" else lambda: None

        def one(i: int) -> float:
            with torch.tpu.set_eager_mode(mode) if mode else contextlib.nullcontext():
                return step(*data[i]).item()
        return one, sample
    return run


def _captured(spec: Model, kind: str, batches: list) -> tuple[Callable, Callable]:
    """The CUDA Graphs notes' pattern: one eager step, capture, then copy_ + replay per step."""
    model = spec.build().to("tpu")
    opt = _optimizer(model, kind, capturable=True)
    body = _body(spec, kind, model, opt)
    # On the device beforehand, as the other forms' batches are: a step copies device to device.
    data = [(x.to("tpu"), y.to("tpu")) for x, y in batches]
    static_x, static_y = (t.clone() for t in data[0])
    graph, static_loss = torch.tpu.TPUGraph(), None

    def step(i: int) -> float:
        nonlocal static_loss
        static_x.copy_(data[i][0])
        static_y.copy_(data[i][1])
        if i == 0:  # creates the optimizer state outside the capture
            return _step(body, opt)(static_x, static_y).item()
        if static_loss is None:
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            with torch.tpu.graph(graph):
                static_loss = body(static_x, static_y)
        graph.replay()
        return static_loss.item()
    return step, torch.tpu.max_memory_allocated


def _jax(spec: Model, kind: str, batches: list) -> tuple[Callable, Callable]:
    return spec.jax(kind, batches)


FORMS = {
    "cpu": _eager("cpu"),
    "strict": _eager("tpu", torch.tpu.EagerMode.DEFER_NEVER),
    "defer": _eager("tpu", torch.tpu.EagerMode.DEFER_AND_FUSE),
    "compile": _eager("tpu", compiled=True),
    "captured": _captured,
    "jax": _jax,
}


def run_row(model: str | Model, kind: str, form: str, steps: int, warmup: int) -> dict:
    """One registry row's figures (times in seconds, memory in bytes, None where not measured;
    ``times``: every step's, warm-up included, for statistics of one's own).

    ``model`` is a name in MODELS or a Model of one's own."""
    spec = MODELS[model] if isinstance(model, str) else model
    # The captured form's first step is its eager step, its second the capture and first replay.
    lead = 1 if form == "captured" else 0
    warmup = max(warmup, 2 * lead)
    gen = torch.Generator().manual_seed(1)
    batches = [spec.batch(gen) for _ in range(warmup + steps)]
    gc.collect()
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.memory_allocated()
    times, losses = _timed(*FORMS[form](spec, kind, batches), len(batches))
    steady = sum(times[warmup:]) / steps
    on_device = form not in ("cpu", "jax")
    return {"model": spec.name, "kind": kind, "form": form, "steady": steady, "first": times[lead],
            "overhead": sum(times[:warmup]) - warmup * steady,
            "peak": torch.tpu.max_memory_allocated() - base if form != "cpu" else None,
            "device": on_device, "losses": losses, "times": times}


def interleaved_rows(model: str | Model, kind: str, forms: list, steps: int, warmup: int,
                     rounds: int) -> list:
    """One row per form of model and kind, the forms' steps taken in interleaved rounds: every
    form is built and warmed up, then each round runs ``steps`` steps of every form in turn, so
    a change of the machine's load falls on all of them. A row's step time is the median over
    rounds of its rounds' means (``round_means`` has them all); peak memory is not told apart
    (all forms are alive at once)."""
    spec = MODELS[model] if isinstance(model, str) else model
    warmup = max(warmup, 2)  # the captured form's eager step, then its capture
    gen = torch.Generator().manual_seed(1)
    batches = [spec.batch(gen) for _ in range(warmup + rounds * steps)]
    runs = {form: FORMS[form](spec, kind, batches) for form in forms}
    done = {form: _timed(*run, warmup) for form, run in runs.items()}
    means: dict = {form: [] for form in forms}
    for r in range(rounds):
        for form, run in runs.items():
            times, losses = _timed(*run, steps, start=warmup + r * steps)
            done[form][0].extend(times)
            done[form][1].extend(losses)
            means[form].append(sum(times) / steps)
    rows = []
    for form in forms:
        times, losses = done[form]
        steady = statistics.median(means[form])
        rows.append({"model": spec.name, "kind": kind, "form": form, "steady": steady,
                     "first": times[1 if form == "captured" else 0],
                     "overhead": sum(times[:warmup]) - warmup * steady, "peak": None,
                     "device": form not in ("cpu", "jax"), "losses": losses, "times": times,
                     "round_means": means[form]})
    return rows


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list) -> str:
    """The rows as a markdown table, with ratios to the same model and kind's other forms."""
    by = {(r["model"], r["kind"], r["form"]): r for r in rows}
    lines = ["| model | kind | form | ms/step | first step ms | warm-up overhead s | peak MB "
             "| vs Strict | vs CPU | vs JAX | max loss diff vs CPU |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratios = []
        for other in ("strict", "cpu", "jax"):
            ref = by.get((r["model"], r["kind"], other))
            ratios.append(None if ref is None else ref["steady"] / r["steady"])
        cpu = by.get((r["model"], r["kind"], "cpu"))
        diff = None if cpu is None else max(
            abs(a - b) for a, b in zip(r["losses"], cpu["losses"], strict=True))
        peak = None if r["peak"] is None else r["peak"] / 2**20
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['form']} | {r['steady'] * 1e3:.2f} | "
            f"{r['first'] * 1e3:.0f} | {r['overhead']:.2f} | {_cell(peak, '.1f')} | "
            + " | ".join(_cell(x, ".2f") + ("x" if x is not None else "") for x in ratios)
            + f" | {_cell(diff, '.1e')} |")
    return "\n".join(lines)


def _names(text: str, known) -> list:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"torchtpu.argument: unknown {unknown}; choose from {list(known)}")
    return names


def main(argv: list | None = None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(m for m in MODELS if m not in SKIPPED))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (torch.set_num_threads); "
                        "on a loaded machine 1 keeps CPU eager out of OpenMP's spin waits")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of --steps steps per form "
                        "(all of a row's forms alive at once; ratios that hold on a loaded "
                        "machine); without it each form runs its steps alone")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("torchtpu.argument: --steps must be >= 1 and --warmup >= 0")
    models, kinds = _names(args.models, MODELS), _names(args.kinds, KINDS)
    forms = _names(args.forms, FORMS)
    rows, notes = [], []
    load_before = os.getloadavg()[0]
    for model in models:
        if model in SKIPPED:
            notes.append(f"{model}: skipped: {SKIPPED[model]}")
            continue
        for kind in kinds:
            present = [f for f in forms if f != "jax" or MODELS[model].jax is not None]
            if args.rounds:
                rows.extend(interleaved_rows(model, kind, present, args.steps, args.warmup,
                                             args.rounds))
                continue
            for form in present:
                rows.append(run_row(model, kind, form, args.steps, args.warmup))
    missing = [m for m in models if m not in SKIPPED and MODELS[m].jax is None]
    if "jax" in forms and missing:
        notes.append(f"no JAX port: {', '.join(missing)}")
    rounds = f" x {args.rounds} interleaved rounds (median of round means)" if args.rounds else ""
    print(f"platform {torchtpu.runtime.platform.platform()}; {args.steps} timed steps{rounds} "
          f"after {args.warmup} warm-up; torch CPU threads {torch.get_num_threads()}; load "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(table(rows))
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
