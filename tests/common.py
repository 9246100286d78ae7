"""Shared test helpers: a LoRA-XS linear-Gaussian problem with a closed-form posterior over the
core, and tiny randomly initialised transformers (BERT, GPT-2, LLaMA) built from a config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pyrobayes.models import FineTuneModel, LoRAXS


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
) -> ConjugateCore:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d_out, d_in, generator=g))
    model = FineTuneModel(
        nn.Sequential(lin),
        LoRAXS(rank=rank, projection="svd", target_modules=["0"], alpha=float(rank)),
        likelihood="gaussian",
        obs_scale=noise,
        prior_scale=prior_scale,
        num_data=num_data,
        trainable_modules=[],
    )
    layer = model.net[0]
    site = next(iter(model.latent_sites))
    down, up, s = layer.down, layer.up, layer.scaling
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
