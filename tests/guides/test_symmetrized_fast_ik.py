"""The symmetrized guide's I_K on its fast path: the same values and gradients as the former
per-copy computation (kept here as the reference), one pass over the K·D terms, no K·D-sized
temporaries in the pass without a graph, one read to the host per evaluation."""

from __future__ import annotations

import copy
import math

import pyro
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pyrobayes as pb
from pyrobayes.guides.symmetrized import SymmetrizedGuide, _infonce, _inverse_permutations
from pyrobayes.models import FineTuneModel

EPS64 = torch.finfo(torch.float64).eps


def _mlp(width: int = 5, dtype: torch.dtype = torch.float64) -> FineTuneModel:
    """3-w-w-2 MLP, every layer latent: the middle weight is permuted on both axes (rows by the
    second hidden layer, columns by the first), the output weight on its columns."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(3, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2)
    )
    model = FineTuneModel(
        net, None, latent_modules=["0", "2", "4"], num_data=8, trainable_modules=[]
    )
    return model.to(dtype)


def _guide(model: FineTuneModel, spread: float = 0.5, scale: float = 0.3) -> SymmetrizedGuide:
    """q with locs ~ N(0, spread²) and per-coordinate scales in [scale, scale + 0.2)."""
    pyro.clear_param_store()
    guide = pb.posterior(model, "symmetrized")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for site, shape in guide.sites.items():
            dtype = guide.base.loc_param(site).dtype
            guide.base.set_site(
                site,
                loc=spread * torch.randn(shape, generator=g, dtype=dtype),
                scale=scale + 0.2 * torch.rand(shape, generator=g, dtype=dtype),
            )
    return guide


def _perms(guide: SymmetrizedGuide, num: int, seed: int = 2) -> list[Tensor]:
    drawn = guide.spec.sample(num - 1, generator=torch.Generator().manual_seed(seed))
    return [torch.cat([i, d]) for i, d in zip(guide.spec.identity(), drawn, strict=True)]


# ---------------------------------------------------------------- the reference (former code)
def _reference_relative_log_prob(guide: SymmetrizedGuide, values: dict, perms: list) -> Tensor:
    """The former mean-field ``_relative_log_prob``: per site, μ and 1/σ permuted by
    ``PermutationSpec.act_on_params`` (one index_select per axis, a per-copy select for the
    second axis of a doubly permuted site), the inverse elements by ``argsort``."""
    inverse = guide.spec.inverse(perms)
    total = None
    for site in guide.sites:
        if site not in guide.spec.sites:
            continue
        loc, scale = guide.base._loc_scale(site)
        v = values[site].unsqueeze(1)
        loc_k = guide.spec.act_on_params(loc, site, inverse)
        inv_k = guide.spec.act_on_params(scale.reciprocal(), site, inverse)
        sq = ((v - loc_k) * inv_k).square().flatten(2).sum(-1)
        total = sq if total is None else total + sq
    assert total is not None
    return -0.5 * total


def _reference_infonce(guide: SymmetrizedGuide, values: dict, perms: list) -> Tensor:
    """The former active-path I_K: one differentiable pass and the same log-mean-exp."""
    lq = _reference_relative_log_prob(guide, values, perms)
    return _infonce(lq - lq[:, :1], int(perms[0].shape[0]))


def _params(guide: SymmetrizedGuide) -> list[Tensor]:
    return [p for p in guide.parameters() if p.requires_grad]


def _term_magnitudes(guide: SymmetrizedGuide, values: dict, perms: list, wrt: list) -> list:
    """Per entry of each tensor of ``wrt``, ``Σ_{s,k} c_{sk} |∂ lq_{sk} / ∂x|`` with ``lq`` the
    reference's relative log densities and ``c_{sk}`` I_K's weight on them (the softmax weight
    of copy k, plus 1 for θ₀'s column): the sum of the magnitudes of the terms that autograd
    adds up into I_K's gradient, from S·K separate backward passes."""
    lq = _reference_relative_log_prob(guide, values, perms)
    diff = (lq - lq[:, :1]).detach()
    weights = torch.softmax(diff, dim=1)
    weights[:, 0] += 1.0
    total = [torch.zeros_like(x) for x in wrt]
    for s in range(lq.shape[0]):
        for k in range(lq.shape[1]):
            grads = torch.autograd.grad(lq[s, k], wrt, retain_graph=True, allow_unused=True)
            for acc, g in zip(total, grads, strict=True):
                if g is not None:
                    acc += weights[s, k] * g.abs()
    return total


def test_fast_path_equals_the_reference_values_and_gradients():
    """3-5-5-2 MLP in float64 (a doubly permuted middle weight and a column-permuted output
    weight), S = 1 and S = 3 draws, K = 9 (the identity first), overlapping copies so that I_K
    is active: the relative log densities, I_K and its gradient with respect to every parameter
    of q and to the draws agree with the reference.

    Tolerances: both paths gather the same operands exactly and apply the same elementwise
    operations, so every term is the same bit for bit; only the order of a sum can differ. A
    sum of m terms in any order is within (m − 1)·u·Σ|terms| of the exact one (u = eps/2), so two
    orders differ by at most (m − 1)·eps·Σ|terms|. log q: m = n, the permuted coordinates, and
    Σ|terms| = 2|lq| (the terms are the squares); I_K (1-Lipschitz in each log ratio, a difference
    of two lq): twice that. Gradients: each entry adds up at most S·(K + 1) terms whose
    magnitudes sum to :func:`_term_magnitudes`; the softplus and reciprocal chain after the sum
    multiplies the error by a factor of at most 4 here (margin). Measured: 0 (bitwise equal)."""
    model = _mlp()
    guide = _guide(model, spread=0.2, scale=0.4)  # overlapping copies: I_K active
    perms = _perms(guide, 9)
    num = 9
    n = sum(torch.Size(guide.sites[s]).numel() for s in guide.spec.sites)
    for num_draws in (1, 3):
        torch.manual_seed(3)
        values = {s: v.detach().requires_grad_() for s, v in guide.rsample(num_draws).items()}
        with torch.no_grad():
            fast = guide._relative_log_prob(values, perms)
            ref = _reference_relative_log_prob(guide, values, perms)
        tol = (n - 1) * EPS64 * 2 * float(ref.abs().max())
        assert (fast - ref).abs().max() <= tol
        guide.__dict__["last_saturation"] = (False, 0.0)  # active: the differentiable pass
        got = guide.infonce(values, perms=perms)
        expected = _reference_infonce(guide, values, perms)
        assert (got - expected).abs().max() <= 2 * tol
        wrt = [*_params(guide), *values.values()]
        grads = torch.autograd.grad(got.sum(), wrt, allow_unused=True)
        ref_grads = torch.autograd.grad(expected.sum(), wrt, allow_unused=True)
        magnitudes = _term_magnitudes(guide, values, perms, wrt)
        assert any(g is not None and float(g.abs().max()) > 1e-3 for g in grads)
        m = num_draws * (num + 1)
        for g, r, mag in zip(grads, ref_grads, magnitudes, strict=True):
            if r is None:  # the output bias: no unit layer acts on it, it cancels from I_K
                assert g is None or not g.any()
                continue
            assert g is not None
            assert ((g - r).abs() <= 4 * (m - 1) * EPS64 * mag).all()


def test_scatter_inverse_is_argsort():
    """The inverse elements by one scatter equal ``argsort`` (both are the unique inverse)."""
    guide = _guide(_mlp(width=7))
    perms = _perms(guide, 33)
    for got, expected in zip(_inverse_permutations(perms), guide.spec.inverse(perms), strict=True):
        assert torch.equal(got, expected)


def test_an_active_i_k_computes_its_terms_once(monkeypatch):
    """Overlapping copies (σ comparable to the spread of the units): after an active
    evaluation, a training evaluation computes the K·D terms in one differentiable pass. The
    former code always ran a pass without the graph first and then the differentiable one (2
    calls); the value and gradient are the same whichever pass comes first."""
    guide = _guide(_mlp(), spread=0.3, scale=0.4)
    calls = []
    inner = SymmetrizedGuide._relative_log_prob

    def counting(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(SymmetrizedGuide, "_relative_log_prob", counting)
    torch.manual_seed(4)
    values = guide.rsample(2)
    perms = _perms(guide, 8)
    first = guide.infonce(values, perms=perms)  # no state yet: measured without the graph first
    assert not guide.last_saturation[0]
    calls.clear()
    second = guide.infonce(values, perms=perms)
    assert calls == [True]
    assert torch.equal(first, second)
    params = _params(guide)
    grads = torch.autograd.grad(second.sum(), params, retain_graph=True, allow_unused=True)
    again = torch.autograd.grad(first.sum(), params, allow_unused=True)
    for a, b in zip(grads, again, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


class _FreshOutputs(TorchDispatchMode):
    """Counts the elements of the tensors aten ops allocate: outputs whose storage is none of
    the inputs' (views, ``out=`` and in-place results are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, Tensor)
        }
        for r in tree_flatten(out)[0]:
            if isinstance(r, Tensor) and r.untyped_storage().data_ptr() not in inputs:
                self.elements += r.numel()
                self.ops.append((str(func), r.numel()))
        return out


def test_the_pass_without_a_graph_allocates_no_k_by_d_temporaries():
    """3-16-16-2 MLP, K = 16, one draw, float32 (the fit's case): the pass without a graph
    (an inert step's only pass) allocates fewer elements than one K·D-sized tensor: the gathered
    μ and 1/σ, the flat index and the squared terms live in reused buffers and are updated in
    place. The former code allocated five to six K·D tensors per site (two gathers, a copy for
    the second axis, the difference, the product, the square)."""
    guide = _guide(_mlp(width=16, dtype=torch.float32))
    perms = _perms(guide, 16)
    values = guide.rsample(1)
    permuted = sum(torch.Size(guide.sites[s]).numel() for s in guide.spec.sites)
    with torch.no_grad():
        expected = _reference_relative_log_prob(guide, values, perms)
        guide._relative_log_prob(values, perms)  # the first call sizes the buffers
        mode = _FreshOutputs()
        with mode:
            got = guide._relative_log_prob(values, perms)
    # the same operations on the same operands: the reference's bits
    assert torch.equal(got, expected)
    assert 0 < mode.elements < 16 * permuted, mode.ops


def test_one_read_to_the_host_per_evaluation(monkeypatch):
    """An inert training evaluation (separated units, σ = 1e-3) reads the device once (the
    saturation flags together), not once per number (the former ``bool(any)`` then
    ``float(max)``): counted as ``_local_scalar_dense`` dispatches plus ``tolist`` calls."""
    guide = _guide(_mlp(dtype=torch.float32), spread=1.0, scale=1e-3)
    values = guide.rsample(1)
    perms = _perms(guide, 16)
    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self, *args, **kwargs):
        reads.append("tolist")
        return tolist(self, *args, **kwargs)

    class Scalars(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append("item")
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    with Scalars():
        value = guide.infonce(values, perms=perms)
    assert guide.last_saturation[0]
    assert torch.allclose(value, torch.full_like(value, math.log(16)), atol=1e-6, rtol=0)
    assert len(reads) == 1, reads


def test_copies_leave_the_scratch_buffers_behind():
    """A deep copy of the guide does not carry the reused buffers of the pass without a graph
    (megabytes on a wide network); it makes its own and gives the same values."""
    guide = _guide(_mlp())
    values = guide.rsample(1)
    perms = _perms(guide, 6)
    with torch.no_grad():
        before = guide._relative_log_prob(values, perms)
    assert "_workspace" in guide.__dict__
    clone = copy.deepcopy(guide)
    assert "_workspace" not in clone.__dict__
    with torch.no_grad():
        assert torch.equal(clone._relative_log_prob(values, perms), before)
