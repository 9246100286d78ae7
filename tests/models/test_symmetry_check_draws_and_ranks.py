"""The symmetrized fit's first-batch symmetry check at a draw of q and across ranks, and the
prior check's message for a prior whose log-density cannot be evaluated.

1. The check measured each unit layer at the posterior mean only. Where the mean has
   identical units (a zero-initialised head: the rows of its next layer all 0), permuting them
   moves nothing, and a parent that breaks the symmetry (``F.linear(h, seq[3].weight)``) went
   unseen: the layer stayed in the group. It is now measured at one draw of q as well (a
   private generator: the fit's random stream is untouched).
2. Under ``torch.distributed`` each rank measured on its own first batch: an asymmetry that
   only one rank's rows expose left the ranks with different groups (different ``I_K``, and
   all-reduced gradients of two objectives). The ranks now agree, in one all-reduce on the
   first batch.
3. ``PermutationSpec.check_prior`` said "not invariant … changes by nan" for a custom prior
   whose ``log_prob`` of its own draw is non-finite; it now says the log-density cannot be
   evaluated and what to do.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

import pyrobayes as pb
from pyrobayes.guides import SymmetrizedGuide
from pyrobayes.infer import BatchedSymmetrizedELBO
from pyrobayes.models import FineTuneModel, PermutationSpec
from tests.common import init_gloo_rank
from tests.models.symmetry_helpers import sym_batch
from tests.models.test_permutation_numeric_check import _model

#: float64 round-off of a true symmetry: a permutation only reorders sums of 6 terms of size
#: O(1), a few ulps (measured up to 5e-18 here); 1e-10 leaves a wide margin
ROUNDOFF = 1e-10
#: the broken symmetry at a draw of q (scales 1e-2 about a zero head) moves the output by
#: 0.018 (measured), the size of the head's output; a bound ten times below it
BROKEN = 1e-3


def _zero_head_guide(model: FineTuneModel) -> SymmetrizedGuide:
    """A symmetrized guide with the default scales (1e-2) whose head ``seq.3`` has mean 0 (a
    zero-initialised head): the units of ``seq.0`` are identical at the mean."""
    pyro.clear_param_store()
    guide = pb.posterior(model, "symmetrized")
    with torch.no_grad():
        for site in guide.sites:
            if site.startswith("seq.3."):
                guide.base.loc_param(site).zero_()
    return guide


@pytest.mark.parametrize("plain", [True, False], ids=["meanfield", "other-base"])
@pytest.mark.parametrize("how", ["linear", "functional"])
def test_identical_units_at_the_mean_do_not_hide_a_broken_symmetry(how: str, plain: bool) -> None:
    model = _model(how)
    guide = _zero_head_guide(model)
    if not plain:  # a base that is not a plain mean-field Normal: its mean and sample_posterior
        guide.base.__dict__["_plain_normal"] = lambda: False
    mean = {s: guide.base.loc(s).detach() for s in guide.sites}
    x = sym_batch()[0][:8]
    at_mean = guide.spec.layer_changes(model, x, mean)
    assert at_mean["seq.0"][0] == 0.0  # identical units: the mean alone sees no change at all
    state = torch.random.get_rng_state()
    changes = guide._first_batch_changes(model, sym_batch())
    assert torch.equal(torch.random.get_rng_state(), state)  # the global stream not read
    assert changes["seq.0"][0] > BROKEN > changes["seq.0"][1]  # the draw of q shows it
    assert changes["mlp.0"][0] <= ROUNDOFF  # the true symmetry is still one
    # before: no warning, and seq.0 stayed in the group
    with pytest.warns(UserWarning, match=r"'seq.0' has its hidden units.*changes the network's"):
        BatchedSymmetrizedELBO(num_permutations=8).loss(model, guide, sym_batch())
    assert [u.name for u in guide.spec.layers] == ["mlp.0"]


@pytest.mark.parametrize("how", ["plain", "loop"])
def test_true_symmetries_with_identical_units_are_kept_and_the_fit_unchanged(how: str) -> None:
    """A zero head over a true symmetry: kept, no warning, and the losses are the unchecked
    guide's bit for bit (the draw of q comes from a generator of its own)."""
    model = _model(how)
    checked, unchecked = _zero_head_guide(model), _zero_head_guide(model)
    unchecked.__dict__["_calls_checked"] = True  # the structure's group, no check
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for guide in (checked, unchecked):
            torch.manual_seed(5)
            objective = BatchedSymmetrizedELBO(num_permutations=8)
            losses.append([objective.loss(model, guide, sym_batch()) for _ in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*losses, strict=True))
    assert [u.name for u in checked.spec.layers] == ["mlp.0", "seq.0"]


def test_the_worse_of_two_measurements_decides() -> None:
    """A broken measurement (NaN included) wins over a kept one whatever the ratios; among
    kept ones, or broken ones, the larger change / tolerance (a change with tolerance 0: none
    when the change is 0, infinitely broken otherwise)."""
    worse = PermutationSpec.worse_change
    assert worse((0.0, 1.0), (2e-3, 1e-3)) == (2e-3, 1e-3)  # broken beats kept
    assert worse((0.9, 1.0), (2e-3, 1e-3)) == (2e-3, 1e-3)  # though its ratio 2 > 0.9
    nan = worse((5.0, 1.0), (float("nan"), 1.0))
    assert nan[0] != nan[0]  # NaN is the worse: not a symmetry
    assert worse((1.0, 0.0), (100.0, 1.0)) == (1.0, 0.0)  # broken at tolerance 0: infinite
    assert worse((0.0, 0.0), (1e-9, 1e-6)) == (1e-9, 1e-6)  # two kept: the larger ratio


# ---------------------------------------------------------------------- ranks
class _Gated(nn.Module):
    """``seq`` called as a whole, plus its last weight used directly on rows whose first
    feature is not 0: an asymmetry of seq.0's units that only such rows expose."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
        self.seq = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x: Tensor) -> Tensor:
        h = self.mlp(x)
        return self.seq(h) + x[:, :1] * F.linear(h, self.seq[2].weight)


def _gated_problem(rank: int) -> tuple[FineTuneModel, tuple[Tensor, Tensor]]:
    """The same model on every rank; rank 0's first batch has its first feature 0."""
    torch.manual_seed(0)
    net = _Gated()
    model = FineTuneModel(net, latent_modules=["mlp.0", "mlp.2", "seq.0", "seq.2"], num_data=24)
    x, y = sym_batch()
    x = x.to(torch.get_default_dtype())
    if rank == 0:
        x[:, 0] = 0.0
    return model, (x, y)


def _rank_check(rank: int) -> dict[str, Any]:
    """This rank's groups after the first loss and after a fit, its warnings, and its calls of
    ``all_reduce`` in the first and the second loss."""
    model, batch = _gated_problem(rank)
    pyro.clear_param_store()
    guide = pb.posterior(model, "symmetrized")
    calls = [0]
    original = torch_dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    objective = BatchedSymmetrizedELBO(num_permutations=4)
    torch_dist.all_reduce = counting
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            objective.loss(model, guide, batch)
            first = calls[0]
            objective.loss(model, guide, batch)
    finally:
        torch_dist.all_reduce = original
    own = PermutationSpec.from_model(model).layer_changes(model, batch[0][:8], model.init_values())
    model, batch = _gated_problem(rank)
    fitted = pb.posterior(model, "symmetrized")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pb.fit(model, fitted, [batch], epochs=1, lr=0.01, seed=0, progress=False)
    return {
        "layers": [u.name for u in guide.spec.layers],
        "fit layers": [u.name for u in fitted.spec.layers],
        "warned": [str(w.message) for w in caught],
        "calls": [first, calls[0] - first],
        "own change": own["seq.0"][0] / own["seq.0"][1],
    }


def _worker(rank: int, init_file: str, folder: str, dtype: str) -> None:
    """One gloo rank: :func:`_rank_check`, saved as ``rank<rank>.pt``."""
    init_gloo_rank(rank, init_file, dtype, seconds=15)
    try:
        result = _rank_check(rank)
        torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()
    os._exit(0)  # without gloo's interpreter teardown (see tests/infer/test_distributed.py)


@pytest.mark.integration  # spawns two gloo ranks
def test_the_ranks_agree_on_the_group_when_one_batch_exposes_an_asymmetry(
    tmp_path: Path,
) -> None:
    """Rank 1's rows expose the asymmetry of seq.0, rank 0's do not (its own measurement keeps
    the layer): both ranks drop it, warn, and make one all-reduce for it on the first batch
    only. Before, rank 0 kept seq.0 and its I_K averaged over a group rank 1 did not use."""
    if not torch_dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    dtype = str(torch.get_default_dtype()).removeprefix("torch.")
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), dtype), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # each rank's own measurement: kept on rank 0 (change/tolerance <= 1), broken on rank 1
    assert ranks[0]["own change"] <= 1.0 < ranks[1]["own change"]
    for result in ranks:
        assert result["layers"] == result["fit layers"] == ["mlp.0"], result
        assert any("'seq.0' has its hidden units" in m for m in result["warned"]), result
        assert result["calls"] == [1, 0], result  # one collective, on the first batch only
    # the same numbers in both ranks' warnings: rank 1's measurement
    assert ranks[0]["warned"] == ranks[1]["warned"]


def test_one_process_makes_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective in a one-process fit")

    monkeypatch.setattr(torch_dist, "all_reduce", refuse)
    model = _model("linear")
    guide = _zero_head_guide(model)
    with pytest.warns(UserWarning, match="'seq.0' has its hidden units"):
        BatchedSymmetrizedELBO(num_permutations=4).loss(model, guide, sym_batch())


# ---------------------------------------------------------------------- the prior
class _DegeneratePrior(FineTuneModel):
    """A custom prior of scale 0: its draw is 0 and ``log_prob`` there NaN (0/0) in any dtype."""

    def site_prior(self, site: str) -> dist.TorchDistribution:
        shape = self.latent_sites[site].shape
        zero = torch.zeros((), dtype=self.dtype)
        prior = dist.Normal(zero, zero, validate_args=False)
        return prior.expand(shape).to_event(len(shape))


def test_a_prior_whose_log_density_is_not_finite_is_named_as_such() -> None:
    torch.manual_seed(0)
    model = _DegeneratePrior(_Gated(), latent_modules=["mlp.0", "mlp.2"], num_data=12)
    # before: "The prior of site 'mlp.0.bias' is not invariant ... (log p changes by nan)"
    with pytest.raises(ValueError, match="mlp.0.bias") as err:
        PermutationSpec.from_model(model)
    message = str(err.value)
    assert "log-density of site 'mlp.0.bias' cannot be evaluated" in message
    assert "_DegeneratePrior.site_prior('mlp.0.bias')" in message
    assert "gives log_prob nan at its own draw (non-finite in float" in message
    assert "Make site_prior return a distribution with a finite log-density" in message
    assert "not invariant" not in message
