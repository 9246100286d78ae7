"""The symmetrized fit measures the hidden units' symmetry on its first batch.

The structure (two latent ``nn.Linear`` in an ``nn.Sequential``) and the record of the
network's calls left two gaps: a parent that uses the modules' weights without calling them
(``F.linear(x, self.seq[2].weight)``, ``self.seq[0].bias`` read in its forward) breaks the
symmetry with no call to see, so it was claimed and the bound was silently wrong; and a parent
that runs the children itself in their own order (``for m in self.seq: x = m(x)``) keeps it,
but its units were dropped with a warning. The output before and after permuting each unit
layer's units, on a few rows of the first batch, now settles both.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pyrobayes.infer import BatchedSymmetrizedELBO, SymmetrizedELBO
from pyrobayes.models import FineTuneModel, PermutationSpec
from tests.models.symmetry_helpers import spread_guide, sym_batch

#: float64 round-off of a true symmetry: a permutation only reorders sums of 6 terms of size
#: O(1), a few ulps (measured 6e-17 to 1.1e-16); 1e-10 leaves a wide margin and is 1e9 below
#: the change of the broken symmetries
ROUNDOFF = 1e-10
#: a broken symmetry changes the outputs by their own size (measured 0.41 to 0.61 here,
#: outputs of size 0.36 to 0.68): a bound four times below the smallest
BROKEN = 0.1


class _Parent(nn.Module):
    """``mlp`` called as a whole (a true symmetry), then ``seq`` used as ``how`` says."""

    def __init__(self, how: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.how = how
        self.mlp = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
        self.seq = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Dropout(dropout), nn.Linear(6, 3))

    def forward(self, x: Tensor) -> Tensor:
        x = self.mlp(x)
        seq = self.seq
        if self.how == "linear":  # seq called as a whole, and its last weight used directly
            return seq(x) + F.linear(x, seq[3].weight)
        if self.how == "bias":  # seq called as a whole, and its first bias read
            return seq(x) + seq[0].bias[:3]
        if self.how == "functional":  # no call of seq at all, a residual around the tanh
            h = torch.tanh(F.linear(x, seq[0].weight, seq[0].bias)) + x
            return F.linear(h, seq[3].weight, seq[3].bias)
        if self.how == "loop":  # the children run by the parent, in their own order
            for module in seq:
                x = module(x)
            return x
        if self.how == "chained":
            return seq[3](seq[2](seq[1](seq[0](x))))
        if self.how == "draws":  # a forward that draws from the global RNG in any mode
            return seq(x) + 0.0 * torch.rand((), dtype=x.dtype)
        return seq(x)


UNCALLED = ["linear", "bias", "functional"]
IN_ORDER = ["loop", "chained"]


def _model(
    how: str, latent: tuple[str, ...] = ("mlp.0", "mlp.2", "seq.0", "seq.3"), dropout: float = 0.0
) -> FineTuneModel:
    torch.manual_seed(0)
    net = _Parent(how, dropout)
    # the network's dropout acts in a fit only with the backbone in train mode
    return FineTuneModel(
        net, latent_modules=list(latent), num_data=12, train_backbone_mode=dropout > 0
    ).double()


def _change(model: FineTuneModel, spec: PermutationSpec, layer: str) -> float:
    """``max |f(x; h·θ) − f(x; θ)|`` for a random permutation of ``layer``'s units only, at the
    network's own values (measured independently of ``layer_changes``)."""
    values = model.init_values()
    perms = spec.identity()
    i = [u.name for u in spec.layers].index(layer)
    perms[i] = torch.randperm(spec.layers[i].size, generator=torch.Generator().manual_seed(3))[None]
    moved = spec.act({s: v.unsqueeze(0) for s, v in values.items()}, perms)
    x = sym_batch()[0]
    with torch.no_grad():
        before = model.output(x, values)
        after = model.output(x, {s: v[0, 0] for s, v in moved.items()})
    return float((after - before).abs().max())


def _record(model: FineTuneModel, spec: PermutationSpec) -> dict[str, str]:
    """What the record of the network's calls alone catches on one forward."""
    record = spec.record_calls(model.net)
    with torch.no_grad():
        model.net(sym_batch()[0])
    return record.close()


@pytest.mark.parametrize("how", UNCALLED)
def test_weights_used_without_a_call_are_left_out_on_the_first_batch(how: str) -> None:
    model = _model(how)
    spec = PermutationSpec.from_model(model)
    assert [u.name for u in spec.layers] == ["mlp.0", "seq.0"]
    assert _change(model, spec, "seq.0") > BROKEN  # not a symmetry (measured 0.41 to 0.61)
    assert _change(model, spec, "mlp.0") <= ROUNDOFF  # a true one
    assert _record(model, spec) == {}  # no call outside the Sequential: the record sees nothing
    guide = spread_guide(model)
    # before: no warning, and I_K averaged over permutations of seq.0's units too
    with pytest.warns(UserWarning, match=r"'seq.0' has its hidden units.*changes the network's"):
        BatchedSymmetrizedELBO(num_permutations=8).loss(model, guide, sym_batch())
    assert [u.name for u in guide.spec.layers] == ["mlp.0"]
    with warnings.catch_warnings():  # checked once: later steps do not warn
        warnings.simplefilter("error")
        BatchedSymmetrizedELBO(num_permutations=8).loss(model, guide, sym_batch())


def test_the_pyro_path_measures_on_its_batch_before_its_first_i_k() -> None:
    model = _model("linear")
    guide = spread_guide(model)
    with pytest.warns(UserWarning, match=r"'seq.0' has its hidden units.*F.linear"):
        SymmetrizedELBO(num_permutations=8).differentiable_loss(model, guide, sym_batch())
    assert [u.name for u in guide.spec.layers] == ["mlp.0"]


def test_no_symmetry_left_is_an_error_naming_the_layer() -> None:
    model = _model("bias", latent=("seq.0", "seq.3"))
    guide = spread_guide(model)
    with (
        pytest.warns(UserWarning, match="'seq.0' has its hidden units"),
        pytest.raises(ValueError, match=r"every unit layer \(\['seq.0'\]\).*Call each nn.Seq"),
    ):
        BatchedSymmetrizedELBO().loss(model, guide, sym_batch())


@pytest.mark.parametrize("how", IN_ORDER)
def test_children_run_in_their_own_order_keep_their_units_and_losses(how: str) -> None:
    model = _model(how)
    spec = PermutationSpec.from_model(model)
    assert _change(model, spec, "seq.0") <= ROUNDOFF  # a true symmetry
    assert _record(model, spec) == {"seq.0": "seq.0"}  # which the record alone dropped
    checked, unchecked = spread_guide(model), spread_guide(model)
    unchecked.__dict__["_calls_checked"] = True  # the structure's group, no check
    batch = sym_batch()
    with warnings.catch_warnings():  # before: "'seq.0' has its hidden units ..." and dropped
        warnings.simplefilter("error")
        for _ in range(2):
            torch.manual_seed(4)
            a = BatchedSymmetrizedELBO(num_permutations=8).loss(model, checked, batch)
            torch.manual_seed(4)
            b = BatchedSymmetrizedELBO(num_permutations=8).loss(model, unchecked, batch)
            assert torch.equal(a, b)
    assert [u.name for u in checked.spec.layers] == ["mlp.0", "seq.0"]


def test_the_check_leaves_the_random_stream_and_the_modes_as_they_were() -> None:
    """Dropout between the layers, on in the fit, and a forward that draws a random number
    even in eval mode: the check runs in eval mode (else the masks would differ between its
    forwards and the true symmetry be dropped) on a forked RNG (else its forwards' draws would
    shift the fit's masks and θ draws): the same losses bit for bit as without it."""
    model = _model("draws", dropout=0.5)
    model.train()
    modes = {name: m.training for name, m in model.net.named_modules()}
    assert modes["seq.2"]  # the dropout is on in the fit
    checked, unchecked = spread_guide(model), spread_guide(model)
    unchecked.__dict__["_calls_checked"] = True
    batch = sym_batch()
    losses = []
    for guide in (checked, unchecked):
        torch.manual_seed(5)
        losses.append([BatchedSymmetrizedELBO(4).loss(model, guide, batch) for _ in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*losses, strict=True))
    assert [u.name for u in checked.spec.layers] == ["mlp.0", "seq.0"]
    assert {name: m.training for name, m in model.net.named_modules()} == modes


def test_layer_changes_measures_each_layer_alone_against_its_roundoff_tolerance() -> None:
    model = _model("linear")
    spec = PermutationSpec.from_model(model)
    values = model.init_values()
    x = sym_batch()[0][:8]
    changes = spec.layer_changes(model, x, values, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scale = float(model.output(x, values).abs().max())
    # √ε(float64)·max|f|: half the digits (the tolerance's own derivation, recomputed)
    tolerance = torch.finfo(torch.float64).eps ** 0.5 * scale
    assert changes["mlp.0"][0] <= ROUNDOFF
    assert changes["seq.0"][0] > BROKEN
    assert all(abs(t - tolerance) <= 1e-12 * tolerance for _, t in changes.values())
    only = spec.layer_changes(model, x, values, names=["seq.0"])
    assert list(only) == ["seq.0"]


def test_without_a_batch_the_record_of_the_calls_decides() -> None:
    """A caller of recording_calls that passes no batch: the record alone, as before."""
    model = _model("loop")
    guide = spread_guide(model)
    with (
        pytest.warns(UserWarning, match="'seq.0' runs outside"),
        guide.recording_calls(model),
        torch.no_grad(),
    ):
        model.output(sym_batch()[0], model.init_values())
    assert [u.name for u in guide.spec.layers] == ["mlp.0"]
