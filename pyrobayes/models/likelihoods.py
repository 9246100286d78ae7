"""Observation models: turn network outputs into a distribution over targets.

Each likelihood maps the raw network output to its parameters (``params``) and builds the
distribution (``dist``). Both work with any leading shape, so the same code scores one parameter
set inside a Pyro plate and S samples at once in the batched path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pyro.distributions as dist
import torch
from torch import Tensor

__all__ = ["Likelihood", "Categorical", "Gaussian", "MultipleChoice", "make_likelihood"]


def network_output(out: Any) -> Tensor:
    """The prediction tensor of a network output (HF ``ModelOutput.logits``, tuple, tensor)."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(
        f"Cannot find the prediction in a network output of type {type(out).__name__}; expected "
        "a tensor, an object with `.logits`, or a tuple whose first item is a tensor."
    )


class Likelihood:
    """Base class: ``params(output, inputs)`` then ``dist(params)`` with event shape of one target."""

    name: str = "base"
    #: True when the predictive is a probability vector over classes.
    is_classification: bool = True

    def params(self, output: Tensor, inputs: Any) -> Tensor:
        return output

    def dist(self, params: Tensor) -> dist.TorchDistribution:
        raise NotImplementedError

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        """Pointwise ``log p(y | params)`` with the leading shape of ``params`` (hot path)."""
        return self.dist(params).log_prob(targets)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name}


def _categorical_log_prob(logits: Tensor, targets: Tensor) -> Tensor:
    # = Categorical(logits=logits).log_prob(targets), without argument validation
    log_probs = torch.log_softmax(logits, dim=-1)
    index = targets.long().expand(logits.shape[:-1]).unsqueeze(-1)
    return log_probs.gather(-1, index).squeeze(-1)


class Categorical(Likelihood):
    """``y ~ Categorical(softmax(f(x; θ)))``."""

    name = "categorical"

    def dist(self, params: Tensor) -> dist.TorchDistribution:
        return dist.Categorical(logits=params)

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        return _categorical_log_prob(params, targets)


class Gaussian(Likelihood):
    """``y ~ N(f(x; θ), σ²)`` with a fixed observation scale σ (``obs_scale``).

    A ``(B, 1)`` output predicts a scalar target; a ``(B, D)`` output a D-vector target (the D
    outputs form one event, so the data plate stays over examples).
    """

    name = "gaussian"
    is_classification = False

    def __init__(self, obs_scale: float = 1.0) -> None:
        if obs_scale <= 0:
            raise ValueError(f"Expected obs_scale > 0 but got {obs_scale}.")
        self.obs_scale = float(obs_scale)
        self.event_dim = 0

    def params(self, output: Tensor, inputs: Any) -> Tensor:
        if output.dim() == 2 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        # output is (rows, *event): every dim after the leading row dim is part of one target
        self.event_dim = output.dim() - 1
        return output

    def dist(self, params: Tensor) -> dist.TorchDistribution:
        d = dist.Normal(params, self.obs_scale)
        return d.to_event(self.event_dim) if self.event_dim else d

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        z = (targets - params) / self.obs_scale
        lp = -0.5 * z.pow(2) - math.log(self.obs_scale) - 0.5 * math.log(2 * math.pi)
        return lp.flatten(-self.event_dim).sum(-1) if self.event_dim else lp

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "obs_scale": self.obs_scale}


class MultipleChoice(Likelihood):
    """Causal-LM multiple choice: next-token logits at the answer position, restricted to choices.

    ``y ~ Categorical(softmax(logits[b, t_b, choice_token_ids]))`` where ``t_b`` is the last
    non-padding position of example b (from ``attention_mask``; the last position without one).
    """

    name = "multiple_choice"

    def __init__(self, choice_token_ids: Sequence[int]) -> None:
        if len(choice_token_ids) < 2:
            raise ValueError(
                f"Expected at least 2 choice_token_ids but got {list(choice_token_ids)}."
            )
        self.choice_token_ids = [int(t) for t in choice_token_ids]

    def params(self, output: Tensor, inputs: Any) -> Tensor:
        if output.dim() != 3:
            raise ValueError(
                "likelihood='multiple_choice' expects causal-LM logits (batch, seq, vocab) but got "
                f"shape {tuple(output.shape)}."
            )
        mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
        seq = output.shape[1]
        if mask is None:
            pos = torch.full((output.shape[0],), seq - 1, device=output.device)
        else:  # index of the last 1 in each row (works for left and right padding)
            pos = seq - 1 - torch.argmax(mask.flip(-1).to(torch.long), dim=-1)
        rows = torch.arange(output.shape[0], device=output.device)
        ids = torch.as_tensor(self.choice_token_ids, device=output.device)
        return output[rows, pos][:, ids]  # (B, num_choices)

    def dist(self, params: Tensor) -> dist.TorchDistribution:
        return dist.Categorical(logits=params)

    def log_prob(self, params: Tensor, targets: Tensor) -> Tensor:
        return _categorical_log_prob(params, targets)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "choice_token_ids": self.choice_token_ids}


def make_likelihood(spec: str | Likelihood, **kwargs: Any) -> Likelihood:
    """Resolve ``"categorical"``, ``"gaussian"`` or ``"multiple_choice"`` (or pass an instance)."""
    if isinstance(spec, Likelihood):
        return spec
    table = {"categorical": Categorical, "gaussian": Gaussian, "multiple_choice": MultipleChoice}
    if spec not in table:
        raise ValueError(f"Expected likelihood in {sorted(table)} but got {spec!r}.")
    return table[spec](**kwargs)
