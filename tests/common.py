"""Shared test helpers: a LoRA-XS linear-Gaussian problem with a closed-form posterior over the
core, and tiny randomly initialised transformers (BERT, GPT-2, LLaMA) built from a config.

Small MLPs with adapters and random data (``mlp_problem``), and their batches, are built here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyrobayes.models import FineTuneModel, LoRAXS
from tests import families

#: ``"cpu"`` in every run, ``"cuda"`` with ``-m gpu`` on a machine with a GPU (parametrize a
#: device-dependent test over it)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@dataclass
class ConjugateCore:
    """``y = W0 x + s·up·Rᵀ·down·x + ε``, ε ~ N(0, σ² I), prior vec(R) ~ N(0, τ⁻¹ I).

    ``up`` has orthonormal columns (SVD projection) and the design makes ``Z Zᵀ`` diagonal
    (``z = down·x``), so the exact posterior over the core weight is a diagonal Gaussian:
    precision ``τ + s² Σ_n z_nj² / σ²`` for entry (i, j).
    """

    model: FineTuneModel
    x: torch.Tensor
    y: torch.Tensor
    post_loc: torch.Tensor
    post_scale: torch.Tensor
    site: str
    log_evidence: float


def conjugate_core(
    num_data: int = 64,
    d_in: int = 6,
    d_out: int = 5,
    rank: int = 3,
    noise: float = 0.5,
    prior_scale: float = 1.0,
    seed: int = 0,
    family: str | None = None,
) -> ConjugateCore:
    """The linear-Gaussian core problem; ``family`` applies that family's registry-test transforms
    (:mod:`tests.families`) to the model, the data and the exact posterior staying those of the
    LoRA-XS core (valid only when the transforms keep the model's function)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d_out, d_in, generator=g))
    adapter = LoRAXS(rank=rank, projection="svd", target_modules=["0"], alpha=float(rank))
    reference = FineTuneModel(
        nn.Sequential(lin),
        adapter,
        likelihood="gaussian",
        obs_scale=noise,
        prior_scale=prior_scale,
        num_data=num_data,
        trainable_modules=[],
    )
    layer = reference.net[0]
    site = next(iter(reference.latent_sites))
    down, up, s = layer.down, layer.up, layer.scaling
    model = reference
    if family is not None and (family in families.ADAPTERS or family in families.NETS):
        base = nn.Linear(d_in, d_out, bias=False)
        base.load_state_dict(layer.base.state_dict())  # the same frozen W0
        model = FineTuneModel(
            families.net_for(family, nn.Sequential(base)),
            families.adapter_for(family, adapter),
            likelihood="gaussian",
            obs_scale=noise,
            prior_scale=prior_scale,
            num_data=num_data,
            trainable_modules=[],
        )
        site = next(iter(model.latent_sites))
    # design: z_n = down x_n with orthogonal rows of Z (r × N) of different norms
    q, _ = torch.linalg.qr(torch.randn(num_data, rank, generator=g))
    z = (q * torch.tensor([3.0, 2.0, 1.0][:rank] + [1.0] * max(0, rank - 3))).T  # (r, N)
    x = (torch.linalg.pinv(down) @ z).T  # (N, d_in), down x_n = z_n
    true_core = torch.randn(rank, rank, generator=g)
    mean = (lin.weight @ x.T).T + s * (up @ true_core @ z).T
    y = mean + noise * torch.randn(num_data, d_out, generator=g)
    tau = 1.0 / prior_scale**2
    resid = (y - (lin.weight.detach() @ x.T).T) @ up  # (N, r): upᵀ (y − W0 x)
    zz = (z**2).sum(1)  # (r,)
    precision = tau + s**2 * zz / noise**2  # (r,) per column j
    post_loc = (s * resid.T @ z.T / noise**2) / precision  # (r, r): entry (i, j)
    post_scale = precision.rsqrt().expand(rank, rank)
    # exact log evidence: y ~ N(W0 x + ..., Σ) with Σ = σ² I + s² Kᵀ K / τ over the stacked outputs
    feats = torch.einsum("ia,jn->niaj", up, z).reshape(num_data * d_out, rank * rank) * s
    cov = noise**2 * torch.eye(num_data * d_out) + feats @ feats.T / tau
    centred = (y - (lin.weight.detach() @ x.T).T).reshape(-1)
    log_evidence = torch.distributions.MultivariateNormal(torch.zeros_like(centred), cov).log_prob(
        centred
    )
    return ConjugateCore(model, x, y, post_loc, post_scale.clone(), site, float(log_evidence))


# ------------------------------------------------------------------------------------------------
# tiny transformers (no download)
# ------------------------------------------------------------------------------------------------

_TINY_VOCAB = 99


def tiny_bert(num_labels: int = 2, **overrides: Any) -> Any:
    """Randomly initialised two-layer ``BertForSequenceClassification`` (hidden size 32, vocab 99).

    Parameters
    ----------
    num_labels : int
        Classes of the head.
    **overrides
        ``BertConfig`` fields that replace the defaults.

    Returns
    -------
    transformers.BertForSequenceClassification
    """
    from transformers import BertConfig, BertForSequenceClassification

    cfg: dict[str, Any] = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=_TINY_VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=num_labels,
    )
    cfg.update(overrides)
    return BertForSequenceClassification(BertConfig(**cfg))


def tiny_gpt2(num_labels: int = 2, **overrides: Any) -> Any:
    """Randomly initialised two-layer ``GPT2ForSequenceClassification`` (n_embd 32, vocab 99).

    Token 0 is the pad token (``pad_token_id=0``), so the classifier reads the last non-pad
    position; BOS/EOS are token 98.

    Parameters
    ----------
    num_labels : int
        Classes of the head.
    **overrides
        ``GPT2Config`` fields that replace the defaults.

    Returns
    -------
    transformers.GPT2ForSequenceClassification
    """
    from transformers import GPT2Config, GPT2ForSequenceClassification

    cfg: dict[str, Any] = dict(
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        vocab_size=_TINY_VOCAB,
        pad_token_id=0,
        bos_token_id=_TINY_VOCAB - 1,
        eos_token_id=_TINY_VOCAB - 1,
        num_labels=num_labels,
    )
    cfg.update(overrides)
    return GPT2ForSequenceClassification(GPT2Config(**cfg))


def tiny_llama(**overrides: Any) -> Any:
    """Randomly initialised two-layer ``LlamaForCausalLM`` (hidden size 32, vocab 99).

    Parameters
    ----------
    **overrides
        ``LlamaConfig`` fields that replace the defaults.

    Returns
    -------
    transformers.LlamaForCausalLM
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg: dict[str, Any] = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=37,
        vocab_size=_TINY_VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg))


# ------------------------------------------------------------------------------------------------
# small MLPs with adapters, and their data
# ------------------------------------------------------------------------------------------------


def mlp(*widths: int, activation: type[nn.Module] | None = nn.Tanh) -> nn.Sequential:
    """``Linear(widths[0], widths[1]), activation(), ..., Linear(widths[-2], widths[-1])``.

    With an activation the linear layers are the even-numbered modules ("0", "2", ...), the names
    ``target_modules`` and ``trainable_modules`` refer to; ``activation=None`` stacks the linear
    layers alone. The weights are the global RNG's next draws.
    """
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(pairwise(widths)):
        if i and activation is not None:
            layers.append(activation())
        layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers)


@dataclass
class MLPProblem:
    """A small MLP with adapters as a ``FineTuneModel``, and a random data set ``(x, y)``."""

    model: FineTuneModel
    x: torch.Tensor
    y: torch.Tensor


def mlp_problem(
    widths: Sequence[int],
    adapter: Any,
    *,
    num_data: int,
    seed: int | None = None,
    data_seed: int | None = None,
    activation: type[nn.Module] | None = nn.Tanh,
    likelihood: str = "categorical",
    family: str | None = None,
    **model_kw: Any,
) -> MLPProblem:
    """An MLP of ``widths`` with ``adapter`` (LoRA-XS cores or LoRA factors) and random data.

    Parameters
    ----------
    widths : sequence of int
        Layer widths, input first (see :func:`mlp`).
    adapter : LoRAXS or LoRA
        The model's adapter configuration.
    num_data : int
        Examples drawn, and the model's ``num_data``.
    seed : int, optional
        ``torch.manual_seed(seed)`` first. Either way the network's and the adapter's initial
        values are the global RNG's next draws.
    data_seed : int, optional
        Draw ``x`` and ``y`` from a ``torch.Generator`` seeded with it; without one they are the
        global RNG's draws after the model's.
    activation : type of nn.Module or None
        Between the linear layers.
    likelihood : {"categorical", "gaussian"}
        Categorical: ``y`` uniform over the ``widths[-1]`` classes. Gaussian: ``y`` standard
        normal, ``(num_data,)`` for one output and ``(num_data, widths[-1])`` otherwise.
    family : str, optional
        Build the problem ``family`` uses in the registry-wide tests (its adapter and network
        transforms in :mod:`tests.families`).
    **model_kw
        Further ``FineTuneModel`` arguments (``trainable_modules``, ``obs_scale``, ...).

    Returns
    -------
    MLPProblem
        ``x`` is ``(num_data, widths[0])`` standard normal.
    """
    if seed is not None:
        torch.manual_seed(seed)
    net = families.net_for(family, mlp(*widths, activation=activation))
    adapter = families.adapter_for(family, adapter)
    model = FineTuneModel(net, adapter, likelihood=likelihood, num_data=num_data, **model_kw)
    g = None if data_seed is None else torch.Generator().manual_seed(data_seed)
    x = torch.randn(num_data, widths[0], generator=g)
    if likelihood == "gaussian":
        shape = (num_data,) if widths[-1] == 1 else (num_data, widths[-1])
        y = torch.randn(shape, generator=g)
    else:
        y = torch.randint(0, widths[-1], (num_data,), generator=g)
    return MLPProblem(model, x, y)


def small_lora_xs_classifier() -> Any:
    """A five-input, 3-class MLP with LoRA-XS r = 3 on both hidden layers and a point head, 60
    examples (``mlp_problem``'s seed 3, data seed 4): small enough that a five-epoch MAP
    leaves the data determining no direction beyond its posterior sd."""
    from pyrobayes.models import LoRAXS

    return mlp_problem(
        (5, 8, 8, 3),
        LoRAXS(rank=3, target_modules=["0", "2"]),
        num_data=60,
        seed=3,
        data_seed=4,
        trainable_modules=["4"],
    )


def split_batches(
    x: torch.Tensor, y: torch.Tensor, size: int = 16
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` in consecutive batches of ``size`` examples (the last one may be smaller)."""
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def tensor_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> DataLoader:
    """``DataLoader(TensorDataset(x, y), batch_size)``: unshuffled batches of tensors."""
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def teacher_mlp(
    num_examples: int, num_data: int
) -> tuple[FineTuneModel, torch.Tensor, torch.Tensor]:
    """A 4 -> 16 -> 3 tanh MLP with LoRA-XS cores (rank 2) on both layers (``num_data`` its N)
    and ``num_examples`` standard-normal inputs labelled by a random linear teacher (labels a
    fit can learn), all seeded: the same problem in every test that asks for it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_examples, 4, generator=g)
    y = (x @ torch.randn(4, 3, generator=g)).argmax(-1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    model = FineTuneModel(net, LoRAXS(rank=2, target_modules=["0", "2"]), num_data=num_data)
    return model, x, y


class TiedNet(nn.Module):
    """Embeddings, a hidden layer and an output head tied to the embeddings
    (``tie_word_embeddings=True``); ``forward`` takes ``(B, 3)`` token ids."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x).mean(1))))


def tied_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four batches of 10 (token ids ``(10, 3)``, labels in 0..9) for :class:`TiedNet`."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 10, (40, 3), generator=gen), torch.randint(0, 10, (40,), generator=gen)
    return [(x[i : i + 10], y[i : i + 10]) for i in range(0, 40, 10)]


def init_gloo_rank(rank: int, init_file: str, dtype: str, seconds: float = 15.0) -> None:
    """Join a two-rank gloo group in a spawned test process, in the test session's default
    ``dtype`` (its name, e.g. ``"float64"``: tests/conftest.py), on one thread, with a short
    timeout: a rank left waiting fails the test in ``seconds`` instead of hanging it for gloo's
    30 minutes."""
    import datetime

    import torch.distributed as torch_dist

    torch.set_default_dtype(getattr(torch, dtype))
    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=seconds),
    )


def fake_lm_run(folder: Any, seed: int) -> Any:
    """A causal-LM run folder of one seed with the files a fit writes (``config.json``,
    ``metrics.json``, the posterior and its plot; a join copies the posterior's bytes without
    reading them). Returns ``folder`` (a ``pathlib.Path``)."""
    from pyrobayes.demo.run_folder import write_json

    (folder / "guides").mkdir(parents=True)
    (folder / "plots").mkdir()
    config = {"causal_lm": {"model": "tiny"}, "families": ["map"], "seeds": [seed]}
    write_json(folder / "config.json", {**config, "training": {"device": "cpu"}})
    metrics = {"accuracy": 0.5, "ece": 0.1, "nll": 0.7, "brier": 0.3}
    records = [{"family": "zero-shot", "seed": None, **metrics}]
    write_json(folder / "metrics.json", [*records, {"family": "map", "seed": seed, **metrics}])
    (folder / f"guides/map-seed{seed}.safetensors").write_bytes(b"posterior")
    (folder / f"plots/reliability_map-seed{seed}.png").write_bytes(b"png")
    return folder


def run_two_gloo_ranks(worker: Any, folder: Any, name: str) -> list[dict[str, Any]]:
    """Spawn ``worker(rank, init_file, folder, dtype)`` on two processes (each joins the gloo
    group with :func:`init_gloo_rank` and saves its results as ``<name><rank>.pt`` in
    ``folder``) and return both ranks' results; skips where torch has no ``torch.distributed``."""
    import pytest
    import torch.distributed as torch_dist
    import torch.multiprocessing as mp

    if not torch_dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    dtype = str(torch.get_default_dtype()).removeprefix("torch.")
    mp.spawn(worker, args=(str(folder / "init"), str(folder), dtype), nprocs=2, join=True)
    return [torch.load(folder / f"{name}{r}.pt", weights_only=True) for r in range(2)]


def run_gloo_rank(
    rank: int,
    init_file: str,
    folder: str,
    dtype: str,
    name: str,
    cases: Any,
    *,
    seconds: float = 15.0,
) -> None:
    """The body of a rank spawned by :func:`run_two_gloo_ranks`: join the group
    (:func:`init_gloo_rank`, a short timeout: a rank left waiting fails the test in ``seconds``
    instead of hanging it for gloo's 30 minutes), run ``cases(rank)`` with warnings ignored and
    save its results as ``<name><rank>.pt`` in ``folder``, then leave without gloo's
    interpreter teardown (see tests/infer/test_distributed.py)."""
    import contextlib
    import os
    import warnings

    import torch.distributed as torch_dist

    init_gloo_rank(rank, init_file, dtype, seconds)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = cases(rank)
        torch.save(results, os.path.join(folder, f"{name}{rank}.pt"))
        with contextlib.suppress(RuntimeError):  # a group a case broke: each saved its own
            torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()
    os._exit(0)


#: the collectives :func:`counting_collectives` counts (looked up on ``torch.distributed``
#: per call)
COUNTED = ("all_gather_object", "broadcast", "all_reduce", "barrier")


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """The calls of each collective of :data:`COUNTED` made within the block (in a spawned
    rank: ``torch.distributed``'s functions are replaced by counting ones until it ends)."""
    import torch.distributed as torch_dist

    counts = dict.fromkeys(COUNTED, 0)
    originals = {name: getattr(torch_dist, name) for name in COUNTED}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in COUNTED:
        setattr(torch_dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch_dist, name, original)
