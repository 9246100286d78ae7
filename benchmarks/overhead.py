"""Overhead of ``pyrobayes.fit`` / ``pyrobayes.predict`` against hand-written PyTorch (issue 2).

Two adapters, measured in one run:

* **mlp** - ``Linear(64,256)-ReLU-Linear(256,256)-ReLU-Linear(256,10)`` with LoRA-XS r=8 on the
  two hidden layers, the last layer a point-estimated head, Gaussian likelihood (10-d target,
  σ=1), batch 64.
* **minilm** - ``all-MiniLM-L6-v2`` with LoRA-XS r=8 on ``query``/``value`` (12 cores), a
  2-class point-estimated head, categorical likelihood, batch 16, sequence length 64 (tokenized
  text).

(a) fit step. ``pb.fit(model, MeanFieldGuide, batches, optim=Optimization(num_steps=n))``
(default ELBO, 1 particle, Adam) wall time / n, nothing subtracted, against a plain reparameterized step with the same maths:
``σ = softplus(ρ)``, ``θ = μ + σ ε``, the same network forward with ``θ`` injected
(``torch.func.functional_call`` into the same LoRA-XS layers; for the MLP also a fully hand-written
``F.linear`` forward), ``−(N/B) log p(y|θ) + KL(q‖p)`` analytic, backward, Adam step. Pyro's own
``SVI(model, guide, Adam, Trace_ELBO())`` on the same guide is the reference.

* **llama** - a config-built LLaMA (hidden 256, 4 layers, 4 heads / 2 KV heads, vocabulary
  49,152 as SmolLM2) with LoRA-XS r=8 on ``q_proj``/``v_proj``, the multiple-choice likelihood with
  continuations (4 prompts of 24-30 words x 4 choices of 2-8 words: every prompt at least 3x its
  longest choice, left padded; predict only).
* **minilm_demo** - the demo's MiniLM: LoRA-XS r=8 on ``query``/``value`` of layers 3-5 of 6 only
  (``pyrobayes.demo.pipeline``), batch 16 x 64 tokens; predict only, S = 16.
* **tv_vit** - a config-built torchvision ``VisionTransformer`` (64 x 64 images, 8 x 8 patches,
  6 blocks in ``encoder.layers``, width 128, MLP 256), LoRA-XS r=8 on the MLPs of blocks 4-5, a
  point-estimated head, ``(x, y)`` batches of 16 bare image tensors; predict only, S = 16, the
  lower blocks shared as in minilm_demo (torchvision's ``nn.Sequential`` of blocks).

(b) predict with S=16. ``pb.predict(..., samples_per_forward=k)`` for k in {1, 4, 16} against
the two plain ways to run the network S times (S forwards at batch B; one forward at batch S*B
with per-sample cores in the batched layers) and against sequential
``pyro.infer.Predictive(model, guide=guide, num_samples=16, parallel=False)``.

(c) llama: ``pb.predict`` with S = 4 and 16 (default chunking, and one wide forward) against
the plain ways: S ``functional_call`` forwards at B·K rows, or one forward at S·B·K rows with the
per-draw cores in the batched layers, each reading its logits at the continuation positions only
(``logits_to_keep``) with ``log_softmax`` and a gather; and, at S = 4, pb.predict and the plain
loop with the full-vocabulary head at every position (the predict-time gain of head gathering).
``--threads 1`` for this case in the reported table. ``pb.predict`` runs each prompt once per draw
and scores the K choices from its key/value cache, the head on the real continuation tokens only
(``pyrobayes.models.sharing``); ``pb.predict unshared`` is the same call inside
``sharing.unshared()`` (every row in full). Paired ratios are reported with their range over
the rounds. ``llama_smol``: the same with 8 blocks and an 8,192-token vocabulary, so that the
head costs about what SmolLM2-135M's does next to its blocks (0.36x against 0.27x a token's
blocks; the 49,152 x 256 head of ``llama`` costs 4.5x).

(e) minilm_demo_fit: the demo's MAP fit (its MiniLM, LoRA r = 8 on layers 3-5, its 768 VADER
training sentences in batches of 32, three epochs, no validation) with the frozen blocks 0-2
read from the fit's per-example cache (``pyrobayes.models.lower_cache``) against the same fit
inside ``sharing.unshared()`` (every block in every step); a fresh model per fit, built outside
the timed call; paired per round.

(d) minilm_demo: ``pb.predict`` at S = 16 (the blocks below layer 3 once per batch for all draws
and chunks) against the plain ways of (b) and ``pb.predict`` inside ``sharing.unshared()``;
tv_vit the same, the blocks below block 4 once per batch.

Timing: ``time.perf_counter`` (CUDA synchronised), one warm-up, variants interleaved round-robin,
medians over repeats. ``torch.set_num_threads(2)`` unless ``--threads``.

Run::

    .venv/bin/python benchmarks/overhead.py            # full (a few minutes on 2 CPU cores)
    .venv/bin/python benchmarks/overhead.py --quick    # fewer repeats
    .venv/bin/python benchmarks/overhead.py --only mlp --threads 1 --fit-only --repeats 60
    .venv/bin/python benchmarks/overhead.py --device cuda
    .venv/bin/python benchmarks/overhead.py --only llama --threads 1 \
        --out benchmarks/results/overhead_llama_t1.json                # the causal-LM case
    .venv/bin/python benchmarks/overhead.py --only llama_smol --threads 1 \
        --out benchmarks/results/overhead_llama_smol_t1.json           # SmolLM2's head share
    .venv/bin/python benchmarks/overhead.py --only minilm_demo --threads 1 \
        --out benchmarks/results/overhead_minilm_demo_t1.json          # lower layers shared
    .venv/bin/python benchmarks/overhead.py --only minilm_demo_fit \
        --out benchmarks/results/overhead_minilm_demo_fit.json         # the fit's lower-block cache
    .venv/bin/python benchmarks/overhead.py --only tv_vit --threads 1 \
        --out benchmarks/results/overhead_tv_vit_t1.json               # image blocks shared
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyro
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pyrobayes as pb
from pyrobayes.batch import expand_samples, split_batch
from pyrobayes.guides import MeanFieldGuide
from pyrobayes.models import FineTuneModel, LoRAXS, sharing
from pyrobayes.models.layers import LoRAXSLinear
from pyrobayes.models.likelihoods import Gaussian, network_output

RESULTS = Path(__file__).resolve().parent / "results" / "overhead.json"
NUM_SAMPLES = 16
CHUNKS = (1, 4, 16)
INIT_SCALE = 1e-2
PRIOR_SCALE = 1.0
LR = 1e-3

WORDS = (
    "the a movie film plot actor story was is not very quite really good bad great boring "
    "terrible wonderful fun slow long short scene music ending character script acting director "
    "and but or with without I you we they it this that loved hated enjoyed watched again never "
    "always best worst year time people performance beautiful awful funny sad"
).split()


# ------------------------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(
    fns: dict[str, Callable[[], Any]], repeats: int, device: torch.device, per_call: dict[str, int]
) -> dict[str, dict[str, float]]:
    """Median / min seconds per unit (call time / ``per_call[name]``), variants interleaved."""
    for fn in fns.values():  # warm-up
        fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / per_call[name])
            cpu[name].append((time.process_time() - c0) / per_call[name])
    return {
        k: {
            "median_s": statistics.median(v),
            "min_s": min(v),
            "cpu_median_s": statistics.median(cpu[k]),
            "repeats": len(v),
            "times_s": v,
            "cpu_times_s": cpu[k],
        }
        for k, v in times.items()
    }


def paired_ratio(
    res: dict[str, dict[str, Any]], name: str, ref: str, key: str = "times_s"
) -> float:
    """Median over rounds of ``time[name] / time[ref]`` measured in the same round.

    The VM's speed drifts by tens of percent between rounds; a ratio taken within one round (the
    variants run back to back) cancels most of that drift, unlike a ratio of medians.
    ``key="cpu_times_s"``: the same of the process's CPU time (on a loaded machine, the time
    spent waiting for a core drops out).
    """
    return statistics.median(a / b for a, b in zip(res[name][key], res[ref][key], strict=True))


def paired_spread(res: dict[str, dict[str, Any]], ref: str) -> None:
    """Add each variant's per-round ratios to ``ref`` (``paired_ratios``) and print the shared
    cases' summary: paired median and range over the rounds."""
    for name, v in res.items():
        ratios = [a / b for a, b in zip(v["times_s"], res[ref]["times_s"], strict=True)]
        v["paired_ratios"] = ratios
        print(
            f"    {name:<34} paired {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}, {max(ratios):.3f}] x {ref}",
            flush=True,
        )


# ------------------------------------------------------------------------------------ setups
def build_mlp(device: torch.device, num_batches: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    batch = 64
    num_data = batch * 100
    model = FineTuneModel(
        net,
        LoRAXS(rank=8, target_modules=["0", "2"]),
        likelihood="gaussian",
        obs_scale=1.0,
        prior_scale=PRIOR_SCALE,
        num_data=num_data,
        trainable_modules=["4"],
    ).to(device)
    batches = [
        (torch.randn(batch, 64, device=device), torch.randn(batch, 10, device=device))
        for _ in range(num_batches)
    ]
    return {"name": "mlp", "model": model, "batches": batches, "num_data": num_data}


#: the demo's targets (pyrobayes.demo.pipeline): the top half of MiniLM's six layers
DEMO_TARGETS = r"bert\.encoder\.layer\.[345]\.attention\.self\.(query|value)"


def build_minilm(
    device: torch.device, num_batches: int, targets: Any = ("query", "value")
) -> dict[str, Any]:
    from pyrobayes.demo.data import load_minilm_classifier

    torch.manual_seed(0)
    net, tokenizer = load_minilm_classifier(2)
    batch, seq = 16, 64
    num_data = batch * 100
    model = FineTuneModel(
        net,
        LoRAXS(rank=8, target_modules=targets if isinstance(targets, str) else list(targets)),
        prior_scale=PRIOR_SCALE,
        num_data=num_data,
    ).to(device)
    rng = random.Random(0)
    batches = []
    for _ in range(num_batches):
        texts = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 70))) for _ in range(batch)
        ]
        enc = tokenizer(
            texts, padding="max_length", truncation=True, max_length=seq, return_tensors="pt"
        )
        b = {k: v.to(device) for k, v in enc.items()}
        b["labels"] = torch.randint(0, 2, (batch,), device=device)
        batches.append(b)
    return {"name": "minilm", "model": model, "batches": batches, "num_data": num_data}


def build_tv_vit(device: torch.device, num_batches: int) -> dict[str, Any]:
    """Case tv_vit: a config-built torchvision ViT, LoRA-XS on the MLPs of its top 2 blocks."""
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.VisionTransformer(
        image_size=64, patch_size=8, num_layers=6, num_heads=4, hidden_dim=128, mlp_dim=256,
        num_classes=10,
    )  # fmt: skip
    nn.init.normal_(net.heads.head.weight, std=0.1)  # torchvision's new head is zeros
    batch = 16
    num_data = batch * 100
    model = FineTuneModel(
        net,
        LoRAXS(rank=8, target_modules=r".*encoder_layer_(4|5)\.mlp\.(0|3)"),
        prior_scale=PRIOR_SCALE,
        num_data=num_data,
        trainable_modules=["heads"],
    ).to(device)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(batch, 3, 64, 64, generator=g).to(device),
            torch.randint(0, 10, (batch,), generator=g).to(device),
        )
        for _ in range(num_batches)
    ]
    return {"name": "tv_vit", "model": model, "batches": batches, "num_data": num_data}


# ------------------------------------------------------------------------------------ plain code
class PlainMeanField:
    """Hand-written mean-field reparameterized VI over the same sites (no pyrobayes, no Pyro)."""

    def __init__(self, model: FineTuneModel, num_data: int, manual_forward: bool = False) -> None:
        self.model = copy.deepcopy(model)  # its own head parameters
        self.net = self.model.net
        self.num_data = num_data
        self.names = [s.param_name for s in self.model.latent_sites.values()]
        self.locs = [
            self.net.get_parameter(n).detach().clone().requires_grad_() for n in self.names
        ]
        rho0 = math.log(math.expm1(INIT_SCALE))
        self.rhos = [torch.full_like(loc, rho0).requires_grad_() for loc in self.locs]
        self.head = [p for p in self.net.parameters() if p.requires_grad]
        self.optim = torch.optim.Adam(self.locs + self.rhos + self.head, lr=LR)
        self.gaussian = isinstance(self.model.likelihood, Gaussian)
        self.obs_scale = getattr(self.model.likelihood, "obs_scale", 1.0)
        self.manual_forward = manual_forward
        if manual_forward:  # MLP only: the whole forward written with F.linear
            # (layer, base W, base b, down, up, scaling, site param name) per module
            self.layers = []
            for path, layer in self.net.named_children():
                if isinstance(layer, LoRAXSLinear):
                    b = layer.base
                    spec = (
                        b.weight,
                        b.bias,
                        layer.down,
                        layer.up,
                        layer.scaling,
                        f"{path}.core.weight",
                    )
                    self.layers.append((layer, spec))
                else:
                    self.layers.append((layer, None))

    def _forward(self, inputs: Any, params: dict[str, Tensor]) -> Tensor:
        if self.manual_forward:
            h = inputs
            for layer, spec in self.layers:
                if spec is not None:
                    w, b, down, up, scaling, name = spec
                    h = F.linear(h, w, b) + scaling * F.linear(
                        F.linear(F.linear(h, down), params[name]), up
                    )
                else:
                    h = layer(h)
            return h
        if isinstance(inputs, dict):
            out = torch.func.functional_call(self.net, params, args=(), kwargs=inputs)
        else:
            out = torch.func.functional_call(self.net, params, (inputs,))
        return network_output(out)

    def _log_lik(self, out: Tensor, targets: Tensor) -> Tensor:
        if self.gaussian:
            s = self.obs_scale
            return (
                -0.5 * ((targets - out) / s) ** 2 - math.log(s) - 0.5 * math.log(2 * math.pi)
            ).sum()
        return out.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).sum()

    def step(self, batch: Any) -> float:
        inputs, targets = split_batch(batch, "labels")
        self.optim.zero_grad(set_to_none=True)
        params, kl = {}, 0.0
        s2 = PRIOR_SCALE**2
        for name, loc, rho in zip(self.names, self.locs, self.rhos, strict=True):
            sigma = F.softplus(rho)
            params[name] = loc + sigma * torch.randn_like(loc)
            kl = (
                kl
                + (math.log(PRIOR_SCALE) - sigma.log() + (sigma**2 + loc**2) / (2 * s2) - 0.5).sum()
            )
        out = self._forward(inputs, params)
        loss = -(self.num_data / targets.shape[0]) * self._log_lik(out, targets) + kl
        value = float(loss.detach())
        loss.backward()
        self.optim.step()
        return value

    def fit(self, batches: list[Any], num_steps: int) -> None:
        for i in range(num_steps):
            self.step(batches[i % len(batches)])

    # -------------------------------------------------------------- prediction
    def draws(self, num_samples: int) -> list[Tensor]:
        with torch.no_grad():
            return [
                loc + F.softplus(rho) * torch.randn(num_samples, *loc.shape, device=loc.device)
                for loc, rho in zip(self.locs, self.rhos, strict=True)
            ]

    def _post(self, out: Tensor) -> Tensor:
        return out if self.gaussian else out.log_softmax(-1)

    def predict_loop(self, batches: list[Any], num_samples: int) -> Tensor:
        """S forwards at batch B."""
        theta = self.draws(num_samples)
        outs = []
        with torch.no_grad():
            for batch in batches:
                inputs, _ = split_batch(batch, "labels")
                per = [
                    self._post(
                        self._forward(
                            inputs, {n: t[s] for n, t in zip(self.names, theta, strict=True)}
                        )
                    )
                    for s in range(num_samples)
                ]
                outs.append(torch.stack(per))
        return torch.cat(outs, 1)

    def predict_wide(self, batches: list[Any], num_samples: int) -> Tensor:
        """One forward at batch S*B with per-sample cores (the batched LoRA-XS layers)."""
        theta = self.draws(num_samples)
        params = dict(zip(self.names, theta, strict=True))
        outs = []
        with torch.no_grad():
            for batch in batches:
                inputs, _ = split_batch(batch, "labels")
                rows = targets_rows(inputs)
                out = self._forward(expand_samples(inputs, num_samples), params)
                outs.append(self._post(out.reshape(num_samples, rows, *out.shape[1:])))
        return torch.cat(outs, 1)


def targets_rows(inputs: Any) -> int:
    if isinstance(inputs, dict):
        return int(next(iter(inputs.values())).shape[0])
    return int(inputs.shape[0])


# ------------------------------------------------------------------------------------ cases
def fit_case(setup: dict[str, Any], steps: int, repeats: int, device: torch.device) -> dict:
    model, batches, num_data = setup["model"], setup["batches"], setup["num_data"]
    pyro.clear_param_store()
    guide = MeanFieldGuide(model, init_scale=INIT_SCALE).to(device)
    plain = PlainMeanField(model, num_data)
    fns: dict[str, Callable[[], Any]] = {
        "pb.fit": lambda: pb.fit(
            model, guide, batches, optim=pb.Optimization(num_steps=steps), lr=LR, progress=False
        ),
        "plain (functional_call)": lambda: plain.fit(batches, steps),
    }
    if setup["name"] == "mlp":
        manual = PlainMeanField(model, num_data, manual_forward=True)
        fns["plain (hand-written F.linear fwd)"] = lambda: manual.fit(batches, steps)
    svi_model = copy.deepcopy(model)
    svi_guide = MeanFieldGuide(svi_model, init_scale=INIT_SCALE).to(device)
    svi = pyro.infer.SVI(
        svi_model, svi_guide, pyro.optim.Adam({"lr": LR}), loss=pyro.infer.Trace_ELBO()
    )

    def run_svi() -> None:
        svi_model.train(True)
        for i in range(steps):
            svi.step(batches[i % len(batches)])

    fns["pyro SVI(Trace_ELBO)"] = run_svi
    res = time_round_robin(fns, repeats, device, dict.fromkeys(fns, steps))
    plain_keys = [k for k in res if k.startswith("plain")]
    ref = min(plain_keys, key=lambda k: res[k]["median_s"])
    for k in res:
        res[k]["ratio_vs_fastest_plain"] = res[k]["median_s"] / res[ref]["median_s"]
        res[k]["paired_ratio_vs_fastest_plain"] = paired_ratio(res, k, ref)
        res[k]["paired_ratio_vs_functional_call"] = paired_ratio(res, k, "plain (functional_call)")
        res[k]["paired_cpu_ratio_vs_functional_call"] = paired_ratio(
            res, k, "plain (functional_call)", "cpu_times_s"
        )
    return {"steps_per_call": steps, "reference": ref, "variants": res}


def predict_case(setup: dict[str, Any], num_pred_batches: int, repeats: int, device) -> dict:
    model, num_data = setup["model"], setup["num_data"]
    batches = setup["batches"][:num_pred_batches]
    pyro.clear_param_store()
    guide = MeanFieldGuide(model, init_scale=INIT_SCALE).to(device)
    plain = PlainMeanField(model, num_data)
    model.train(False)
    fns: dict[str, Callable[[], Any]] = {}
    for k in CHUNKS:
        fns[f"pb.predict k={k}"] = lambda k=k: pb.predict(
            model, guide, batches, num_samples=NUM_SAMPLES, samples_per_forward=k
        )
    fns["pb.predict default"] = lambda: pb.predict(model, guide, batches, num_samples=NUM_SAMPLES)
    fns["plain S forwards at B"] = lambda: plain.predict_loop(batches, NUM_SAMPLES)
    fns["plain 1 forward at S*B"] = lambda: plain.predict_wide(batches, NUM_SAMPLES)
    predictive = pyro.infer.Predictive(
        model, guide=guide, num_samples=NUM_SAMPLES, parallel=False, return_sites=["obs"]
    )
    inputs_only = [split_batch(b, model.label_key)[0] for b in batches]
    inputs_only = [x if isinstance(x, dict) else (x,) for x in inputs_only]

    def run_predictive() -> None:
        with torch.no_grad():
            for x in inputs_only:
                predictive(x)

    fns["pyro Predictive (sequential)"] = run_predictive
    if setup.get("shared"):
        fns["pb.predict unshared"] = _unshared(
            lambda: pb.predict(model, guide, batches, num_samples=NUM_SAMPLES)
        )
    res = time_round_robin(fns, repeats, device, dict.fromkeys(fns, 1))
    ref = min(("plain S forwards at B", "plain 1 forward at S*B"), key=lambda k: res[k]["median_s"])
    if setup.get("shared"):
        paired_spread(res, ref)
    for k in res:
        res[k]["ratio_vs_fastest_plain"] = res[k]["median_s"] / res[ref]["median_s"]
        res[k]["paired_ratio_vs_fastest_plain"] = paired_ratio(res, k, ref)
        res[k]["ratio_vs_predictive"] = (
            res[k]["median_s"] / res["pyro Predictive (sequential)"]["median_s"]
        )
    best_k = min(CHUNKS, key=lambda k: res[f"pb.predict k={k}"]["median_s"])
    return {
        "num_samples": NUM_SAMPLES,
        "batches_per_call": len(batches),
        "reference": ref,
        "best_samples_per_forward": best_k,
        "variants": res,
    }


# ------------------------------------------------------------------------------------ llama
LLAMA_VOCAB = 49152


class _WordTokenizer:
    """Words to ids over the LLaMA case's vocabulary (BOS = 1 with special tokens, pad = 0)."""

    pad_token_id = 0

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [self.ids.setdefault(w, 3 + len(self.ids)) for w in text.split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


#: llama_smol: the 4-layer LLaMA's head costs 4.5x a token's blocks (49,152 x 256 against
#: 4 blocks of 256); SmolLM2-135M's costs 0.27x (49,152 x 576 against 30 blocks of 576). This
#: case keeps the widths and gives head and blocks SmolLM2's proportion (8 blocks, 0.36x).
SMOL_PROPORTIONS = {"num_hidden_layers": 8, "vocab_size": 8192}


def build_llama(device: torch.device, **config: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pyrobayes.models.multiple_choice import encode_multiple_choice

    torch.manual_seed(0)
    fields = {"num_hidden_layers": 4, "vocab_size": LLAMA_VOCAB, **config}
    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **fields,
    )
    net = LlamaForCausalLM(cfg).eval()
    model = FineTuneModel(
        net,
        LoRAXS(rank=8, target_modules=["q_proj", "v_proj"]),
        likelihood="multiple_choice",
        trainable_modules=[],
        prior_scale=PRIOR_SCALE,
        num_data=100,
    ).to(device)
    rng = random.Random(0)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    num, k_choices = 4, 4
    prompts = [words(24, 30) for _ in range(num)]  # >= 3x the longest choice (8 words)
    choices = [[words(2, 8) for _ in range(k_choices)] for _ in range(num)]
    batch = encode_multiple_choice(
        _WordTokenizer(), prompts, choices, answers=[0] * num, padding_side="left"
    )
    batch = {k: v.to(device) for k, v in batch.items()}
    return {"name": "llama", "model": model, "batches": [batch], "num_data": 100}


class PlainMultipleChoice:
    """Hand-written continuation scoring of S draws: ``functional_call`` of the same network,
    log-softmax at the read positions, gather of the continuation tokens, sum."""

    def __init__(self, model: FineTuneModel, values: dict[str, Tensor]) -> None:
        self.net = model.net
        self.params = {model.latent_sites[s].param_name: v for s, v in values.items()}
        self.num_samples = int(next(iter(values.values())).shape[0])

    def _scores(self, batch: dict[str, Tensor], params: dict[str, Tensor], gather: bool) -> Tensor:
        ids, cont = batch["input_ids"], batch["continuation_mask"].bool()
        num, k_choices, length = ids.shape
        first = next(iter(params.values()))
        reps = first.shape[0] if first.dim() == 3 else 1  # draws in one wide forward
        kw: dict[str, Any] = {
            k: batch[k].reshape(-1, length).repeat(reps, 1)
            for k in ("input_ids", "attention_mask", "position_ids")
        }
        kw["use_cache"] = False
        width = int(cont.sum(-1).max())  # left padding: continuations end at the last position
        read = torch.arange(length - 1 - width, length - 1, device=ids.device)
        if gather:
            kw["logits_to_keep"] = read.expand(kw["input_ids"].shape[0], -1)
        logits = torch.func.functional_call(self.net, params, args=(), kwargs=kw).logits
        if not gather:
            logits = logits[:, read]
        logp = logits.log_softmax(-1)
        tokens = kw["input_ids"][:, read + 1]
        picked = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        mask = cont.reshape(-1, length)[:, read + 1].repeat(reps, 1)
        return (picked * mask).sum(-1).reshape(reps, num, k_choices)

    def loop(self, batch: dict[str, Tensor], gather: bool = True) -> Tensor:
        """S forwards at B·K rows."""
        with torch.no_grad():
            return torch.cat(
                [
                    self._scores(batch, {n: v[s] for n, v in self.params.items()}, gather)
                    for s in range(self.num_samples)
                ]
            ).log_softmax(-1)

    def wide(self, batch: dict[str, Tensor]) -> Tensor:
        """One forward at S·B·K rows (per-draw cores in the batched layers)."""
        with torch.no_grad():
            return self._scores(batch, self.params, True).log_softmax(-1)


def _unshared(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run inside ``pyrobayes.models.sharing.unshared()`` (every row in full)."""
    from pyrobayes.models.sharing import unshared

    def run() -> Any:
        with unshared():
            return fn()

    return run


def llama_predict_case(setup: dict[str, Any], repeats: int, device: torch.device) -> dict:
    from pyrobayes.models import likelihoods

    model, batches = setup["model"], setup["batches"]
    pyro.clear_param_store()
    guide = MeanFieldGuide(model, init_scale=INIT_SCALE).to(device)
    model.train(False)
    gathers = likelihoods.head_positions_supported

    def full_head(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            likelihoods.head_positions_supported = lambda net: False  # type: ignore[assignment]
            try:
                return fn()
            finally:
                likelihoods.head_positions_supported = gathers

        return run

    out: dict[str, Any] = {}
    for num_samples in (4, 16):
        values = guide.sample_posterior(num_samples, generator=torch.Generator().manual_seed(0))
        plain = PlainMultipleChoice(model, values)
        fns: dict[str, Callable[[], Any]] = {
            "pb.predict default": lambda s=num_samples: pb.predict(
                model, guide, batches, num_samples=s
            ),
            "pb.predict 1 wide forward": lambda s=num_samples: pb.predict(
                model, guide, batches, num_samples=s, samples_per_forward=s
            ),
            "pb.predict unshared": _unshared(
                lambda s=num_samples: pb.predict(model, guide, batches, num_samples=s)
            ),
            "plain S forwards at B*K": lambda p=plain: p.loop(batches[0]),
            "plain 1 forward at S*B*K": lambda p=plain: p.wide(batches[0]),
        }
        if num_samples == 4:
            fns["pb.predict S=1"] = lambda: pb.predict(model, guide, batches, num_samples=1)
            fns["pb.predict full head"] = full_head(
                lambda: pb.predict(model, guide, batches, num_samples=4)
            )
            fns["plain S forwards, full head"] = lambda p=plain: p.loop(batches[0], gather=False)
        print(f"[llama] predict S={num_samples}, {repeats} repeats ...", flush=True)
        res = time_round_robin(fns, repeats, device, dict.fromkeys(fns, 1))
        ref = min(
            ("plain S forwards at B*K", "plain 1 forward at S*B*K"),
            key=lambda k: res[k]["median_s"],
        )
        paired_spread(res, ref)
        for k in res:
            res[k]["ratio_vs_fastest_plain"] = res[k]["median_s"] / res[ref]["median_s"]
            res[k]["paired_ratio_vs_fastest_plain"] = paired_ratio(res, k, ref)
        out[f"predict S={num_samples}"] = {
            "num_samples": num_samples,
            "reference": ref,
            "variants": res,
        }
    return out


# ------------------------------------------------------------------------------------ main
def demo_fit_case(repeats: int, epochs: int, device: torch.device) -> dict:
    """The demo's MAP fit with the lower-block cache against the same fit unshared."""
    from pyrobayes.demo import pipeline

    config = pipeline.resolve_config()
    config["training"]["device"] = device.type
    loaders = pipeline.build_data(config, pipeline._load_tokenizer(config))
    data = loaders["train"]

    def fit(shared: bool) -> Callable[[], Any]:
        def run() -> float:
            model, _ = pipeline.build_model(config, loaders["num_train"], data, family="map")
            model.to(device)
            guide = pb.posterior(model, "map")
            _sync(device)
            start = time.perf_counter()
            with contextlib.nullcontext() if shared else sharing.unshared():
                pb.fit(model, guide, data, epochs=epochs, lr=3e-3, seed=0, progress=False)
            _sync(device)
            return time.perf_counter() - start

        return run

    variants = {"pb.fit (lower blocks cached)": fit(True), "pb.fit unshared": fit(False)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            times[name].append(run())
    res: dict[str, dict[str, Any]] = {
        k: {
            "median_s": statistics.median(v),
            "min_s": min(v),
            "cpu_median_s": float("nan"),
            "times_s": v,
            "ratio_vs_fastest_plain": statistics.median(v)
            / statistics.median(times["pb.fit unshared"]),
            "paired_ratio_vs_fastest_plain": paired_ratio(
                {n: {"times_s": t} for n, t in times.items()}, k, "pb.fit unshared"
            ),
        }
        for k, v in times.items()
    }
    print(f"[minilm_demo_fit] {epochs} epochs x {repeats} rounds:", flush=True)
    paired_spread(res, "pb.fit unshared")
    return {"fit": {"epochs": epochs, "reference": "pb.fit unshared", "variants": res}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--only",
        choices=[
            "mlp",
            "minilm",
            "llama",
            "llama_smol",
            "minilm_demo",
            "minilm_demo_fit",
            "tv_vit",
        ],  # fmt: skip
        default=None,
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=None, help="fit rounds (default 25)")
    parser.add_argument("--fit-only", action="store_true", help="skip the predict parts")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    pyro.set_rng_seed(0)
    q = args.quick
    plans = {
        # steps per timed fit call, fit repeats, predict batches per call, predict repeats
        "mlp": (20 if q else 50, args.repeats or (3 if q else 25), 4, 3 if q else 9),
        "minilm": (2 if q else 4, 2 if q else 5, 1, 2 if q else 4),
    }
    if device.type == "cuda":
        plans["minilm"] = (10 if q else 20, 3 if q else 7, 4, 3 if q else 7)
    results: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
            "device": str(device)
            + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        },
        "versions": {
            "torch": torch.__version__,
            "pyro": pyro.__version__,
            "pyrobayes": pb.__version__,
        },
        "args": {
            "quick": q,
            "device": args.device,
            "threads": args.threads,
            "repeats": args.repeats,
            "fit_only": args.fit_only,
        },
        "cases": {},
    }
    builders = {"mlp": build_mlp, "minilm": build_minilm}
    for name, build in builders.items():
        if args.only != name and (args.only or name == "llama"):
            continue
        steps, fit_rep, pred_batches, pred_rep = plans[name]
        setup = build(device, max(pred_batches, 4))
        print(f"[{name}] fit: {steps} steps x {fit_rep} repeats ...", flush=True)
        fit_res = fit_case(setup, steps, fit_rep, device)
        results["cases"][name] = {"fit": fit_res}
        if args.fit_only:
            continue
        print(f"[{name}] predict: S={NUM_SAMPLES}, {pred_rep} repeats ...", flush=True)
        results["cases"][name]["predict"] = predict_case(setup, pred_batches, pred_rep, device)

    if args.only in (None, "minilm_demo") and not args.fit_only:
        setup = build_minilm(device, 4, DEMO_TARGETS)
        setup.update(name="minilm_demo", shared=True)
        print(f"[minilm_demo] predict: S={NUM_SAMPLES} ...", flush=True)
        pred_res = predict_case(setup, 1, 2 if q else 5, device)
        results["cases"]["minilm_demo"] = {"predict": pred_res}

    if args.only in (None, "tv_vit") and not args.fit_only:
        setup = build_tv_vit(device, 4)
        setup.update(shared=True)
        print(f"[tv_vit] predict: S={NUM_SAMPLES} ...", flush=True)
        results["cases"]["tv_vit"] = {"predict": predict_case(setup, 1, 2 if q else 5, device)}

    if args.only in (None, "minilm_demo_fit"):
        results["cases"]["minilm_demo_fit"] = demo_fit_case(2 if q else 5, 2 if q else 3, device)

    if args.only in (None, "llama") and not args.fit_only:
        setup = build_llama(device)
        results["cases"]["llama"] = llama_predict_case(setup, 2 if q else 5, device)

    if args.only in (None, "llama_smol") and not args.fit_only:
        setup = build_llama(device, **SMOL_PROPORTIONS)
        results["cases"]["llama_smol"] = llama_predict_case(setup, 2 if q else 5, device)

    results["machine"]["load_average_at_end"] = os.getloadavg()
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


def print_table(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(
        f"\n{results['date']}  {m['device']}  threads={m['threads']}  "
        f"torch {results['versions']['torch']}  load avg (1 min) "
        f"{m['load_average_at_start'][0]:.1f} -> {m['load_average_at_end'][0]:.1f}"
    )
    header = (
        f"{'case':<11} {'part':<12} {'variant':<36} {'wall ms':>9} {'min ms':>9} {'cpu ms':>9} "
        f"{'x plain':>8} {'paired':>8} {'x fcall':>8} {'x Pred.':>8}"
    )
    print(header)
    print("-" * len(header))
    for case, parts in results["cases"].items():
        for part, r in parts.items():
            for variant, v in r["variants"].items():
                mark = " *" if variant == r["reference"] else ""
                xp = v.get("ratio_vs_predictive")
                pr = v.get("paired_ratio_vs_fastest_plain")
                fc = v.get("paired_ratio_vs_functional_call")
                print(
                    f"{case:<11} {part:<12} {variant + mark:<36} {1e3 * v['median_s']:>9.2f} "
                    f"{1e3 * v['min_s']:>9.2f} {1e3 * v['cpu_median_s']:>9.2f} "
                    f"{v['ratio_vs_fastest_plain']:>8.3f} {'' if pr is None else f'{pr:.3f}':>8} "
                    f"{'' if fc is None else f'{fc:.3f}':>8} {'' if xp is None else f'{xp:.3f}':>8}"
                )
    for case, parts in results["cases"].items():
        fit = parts.get("fit", {}).get("variants", {}).get("pb.fit", {})
        if "paired_cpu_ratio_vs_functional_call" in fit:
            print(
                f"{case}: pb.fit step x functional_call plain step, paired: wall "
                f"{fit['paired_ratio_vs_functional_call']:.3f}, CPU time "
                f"{fit['paired_cpu_ratio_vs_functional_call']:.3f}"
            )
    print(
        "(* fastest plain reference; 'x plain' is a ratio of wall-clock medians, 'paired' the "
        "median of per-round ratios, 'x fcall' the paired ratio to the functional_call plain "
        "step; fit: per step, predict: per call over the batches)"
    )


if __name__ == "__main__":
    main()
