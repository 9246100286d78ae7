r"""The permutation symmetry group of a model's latent sites.

Permuting the hidden units of an MLP (rows of ``W_l`` and entries of ``b_l``, the matching columns
of ``W_{l+1}``) leaves its function unchanged, and so does permuting the rank axis of a LoRA update
(rows of ``A`` with the columns of ``B``: ``B A = (B Pᵀ)(P A)``). With a prior that is invariant
too (iid per layer), the posterior is invariant: ``p(g·θ | D) = p(θ | D)`` for every ``g`` in
``G = S_{n_1} × … × S_{n_H}`` (Gelberg et al., 2024, Sec. 3).

A :class:`PermutationSpec` lists, for each group factor ("unit layer") of size ``n_l``, the
``(site, axis)`` pairs one permutation of ``n_l`` elements acts on. A group element is a list of
index tensors, one per unit layer; ``(h·θ)[site] = θ[site].index_select(axis, h_l)`` on every
member ``(site, axis)`` of layer ``l``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import permutations as all_orderings
from itertools import product
from typing import Any, NoReturn

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..batch import compute_dtype
from ..user_frame import user_stacklevel

__all__ = ["UnitLayer", "PermutationSpec", "CallRecord"]

#: modules that act unit-wise (elementwise) on their input: they commute with a unit permutation
_UNITWISE = (
    nn.Identity,
    nn.Dropout,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.Softsign,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.LogSigmoid,
    nn.Tanhshrink,
)


@dataclass(frozen=True)
class UnitLayer:
    """One factor ``S_n`` of the group: ``size`` units and the ``(site, axis)`` pairs it permutes.

    Attributes
    ----------
    name : str
        A readable name (the module path of the layer whose outputs are the units, or
        ``"<path>.rank"`` for a LoRA rank axis).
    size : int
        n, the number of units.
    members : tuple of (str, int)
        ``(site, axis)``: the axis of the site's tensor (no sample axis) indexed by the units.
    sequential : str or None
        For hidden units found in an ``nn.Sequential`` (:meth:`PermutationSpec.from_model`):
        its module path (``""``: the network itself); the symmetrized fit measures their
        symmetry on its first batch (:meth:`PermutationSpec.layer_changes`). ``None`` for a
        LoRA rank axis or a hand-built layer.
    modules : tuple of str
        The module paths that carry the units: the layer whose outputs they are, the
        unit-wise modules after it and the next latent layer, which reads them.
    """

    name: str
    size: int
    members: tuple[tuple[str, int], ...]
    sequential: str | None = None
    modules: tuple[str, ...] = ()


class PermutationSpec:
    r"""The group ``G = S_{n_1} × … × S_{n_H}`` acting on a model's latent sites.

    Parameters
    ----------
    layers : sequence of UnitLayer
        The group factors. Build it from a model with :meth:`from_model`.

    Attributes
    ----------
    layers : tuple of UnitLayer
    """

    def __init__(self, layers: Sequence[UnitLayer]) -> None:
        if not layers:
            raise ValueError("A PermutationSpec needs at least one unit layer.")
        for layer in layers:
            if layer.size < 1 or not layer.members:
                raise ValueError(f"Unit layer {layer.name!r} has no units or no members.")
        self.layers = tuple(layers)

    def __repr__(self) -> str:
        parts = ", ".join(f"{u.name}: {u.size}" for u in self.layers)
        size = f"|G| = {self.order}" if self.log_order < 28 else f"log|G| = {self.log_order:.1f}"
        return f"PermutationSpec({parts}; {size})"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model(cls, model: Any) -> PermutationSpec:
        r"""The unit-permutation group of a :class:`~pyrobayes.models.FineTuneModel`.

        Two kinds of symmetry are found:

        * **whole-layer latent MLPs** (``latent_modules=[...]``): two latent ``nn.Linear``
          modules that follow each other in one ``nn.Sequential``, with only unit-wise modules
          (activations, dropout) or a parameter-free / constant-affine ``nn.LayerNorm`` between
          them, make the outputs of the first hidden units: rows of its ``weight`` and ``bias``,
          columns of the next ``weight``. The network's input and output units are never
          permuted. The structure alone cannot tell whether a parent module calls the
          Sequential's children itself (a residual connection around part of it) or uses
          their weights without calling them: the symmetrized fit checks that on its first
          batch (:meth:`record_calls`, :meth:`layer_changes`);
        * **LoRA rank axes**: rows of ``lora_A`` with the columns of ``lora_B`` of every adapted
          layer.

        Raises
        ------
        ValueError
            When the model has no such symmetry (LoRA-XS cores sit between fixed bases and have
            none: use ``LoRA(rank=r)``), when a norm layer between hidden layers has per-unit
            parameters that are trained or not constant, or when the prior is not invariant.
        TypeError
            When ``model`` has no ``latent_sites`` (not a ``FineTuneModel``).
        """
        specs = getattr(model, "latent_sites", None)
        net = getattr(model, "net", None)
        if not specs or net is None:
            raise TypeError(
                f"PermutationSpec.from_model needs a FineTuneModel (its latent sites name the "
                f"permutation symmetry); got {type(model).__name__}."
            )
        layers = _lora_rank_layers(specs) + _mlp_unit_layers(model, net, specs)
        if not layers:
            cores = [s for s, spec in specs.items() if spec.kind == "core"]
            if cores:
                raise ValueError(
                    f"The model's latent sites are LoRA-XS cores ({cores[:3]}...), which sit "
                    "between fixed SVD bases: permuting the core's rows and columns changes the "
                    "function, so there is no permutation symmetry to symmetrize over. Use "
                    "LoRA(rank=r, target_modules=...) (its rank axis is a symmetry), or make whole "
                    "layers latent with latent_modules=[...]."
                )
            raise ValueError(
                "The model has no permutation symmetry over its latent sites: none are LoRA "
                "factors, and no two latent nn.Linear modules follow each other in an "
                "nn.Sequential (with only activations, dropout or a LayerNorm between them)."
            )
        spec = cls(layers)
        spec.check_prior(model)
        return spec

    # ------------------------------------------------------------------ the group
    @property
    def sizes(self) -> tuple[int, ...]:
        """``(n_1, …, n_H)``."""
        return tuple(u.size for u in self.layers)

    @property
    def order(self) -> int:
        """``|G| = Π_l n_l!``."""
        return math.prod(math.factorial(n) for n in self.sizes)

    @property
    def log_order(self) -> float:
        """``log |G| = Σ_l log n_l!`` (the largest value of the mutual information ``I(g; θ)``)."""
        return sum(math.lgamma(n + 1) for n in self.sizes)

    @property
    def sites(self) -> set[str]:
        """The sites some unit layer acts on."""
        return {site for u in self.layers for site, _ in u.members}

    def identity(self, device: torch.device | None = None) -> list[Tensor]:
        """The identity element: ``arange(n_l)`` per layer, each ``(1, n_l)``."""
        return [torch.arange(n, device=device).unsqueeze(0) for n in self.sizes]

    def sample(
        self,
        num: int,
        *,
        device: torch.device | None = None,
        generator: torch.Generator | None = None,
    ) -> list[Tensor]:
        """``num`` uniform draws from G: per layer an index tensor ``(num, n_l)``.

        One ``argsort`` of uniform noise per layer (a uniform permutation per row), no loop over
        the draws.
        """
        out = []
        for n in self.sizes:
            noise = torch.rand(num, n, generator=generator, device=device)
            out.append(noise.argsort(dim=-1))
        return out

    def enumerate(self, device: torch.device | None = None) -> list[Tensor]:
        """Every element of G, the identity first: per layer ``(|G|, n_l)``.

        Raises
        ------
        ValueError
            When ``|G|`` exceeds 10⁶ (enumeration is for tiny networks).
        """
        if self.order > 10**6:
            raise ValueError(f"|G| = {self.order} is too large to enumerate (limit 10^6).")
        per_layer = [list(all_orderings(range(n))) for n in self.sizes]
        rows = list(product(*per_layer))  # the identity (sorted orderings) comes first
        return [
            torch.tensor([row[i] for row in rows], dtype=torch.long, device=device)
            for i in range(len(self.sizes))
        ]

    def inverse(self, perms: Sequence[Tensor]) -> list[Tensor]:
        """The inverse elements: ``argsort`` of each index tensor."""
        return [p.argsort(dim=-1) for p in perms]

    # ------------------------------------------------------------------ the action
    def act(self, values: Mapping[str, Tensor], perms: Sequence[Tensor]) -> dict[str, Tensor]:
        r"""``h_k·θ`` for every element ``h_k`` in ``perms`` and every draw of ``values``.

        Parameters
        ----------
        values : dict
            ``{site: (S, *shape)}``; sites no layer acts on are passed through (expanded).
        perms : list of Tensor
            Per unit layer an index tensor ``(K, n_l)`` (K elements of G).

        Returns
        -------
        dict
            ``{site: (S, K, *shape)}`` with ``[s, k] = h_k·θ_s``: one ``torch.gather`` per
            ``(site, axis)`` member, no loop over the K elements.
        """
        if len(perms) != len(self.layers):
            raise ValueError(f"Expected {len(self.layers)} index tensors but got {len(perms)}.")
        num = int(perms[0].shape[0])
        out = {}
        for site, v in values.items():
            out[site] = v.unsqueeze(1).expand(v.shape[0], num, *v.shape[1:])
        for layer, perm in zip(self.layers, perms, strict=True):
            for site, axis in layer.members:
                if site not in out:
                    continue
                out[site] = _gather(out[site], perm, axis + 2, lead=1)
        return out

    def act_on_params(self, param: Tensor, site: str, perms: Sequence[Tensor]) -> Tensor:
        """``h_k·param`` for one per-site tensor without a sample axis → ``(K, *shape)``."""
        num = int(perms[0].shape[0])
        out: Tensor | None = None
        for layer, perm in zip(self.layers, perms, strict=True):
            for member, axis in layer.members:
                if member != site:
                    continue
                if out is None:  # one index_select of all K·n rows (fast, as is its backward)
                    picked = param.index_select(axis, perm.reshape(-1))
                    shape = (*param.shape[:axis], num, perm.shape[1], *param.shape[axis + 1 :])
                    out = picked.reshape(shape).movedim(axis, 0)
                else:  # per-k permutations of another axis: offsets k·n into a merged axis
                    out = _select_per_element(out, perm, axis + 1)
        return param.unsqueeze(0).expand(num, *param.shape) if out is None else out

    # ------------------------------------------------------------------ checks
    def check_model(self, model: Any, values: Mapping[str, Tensor] | None = None) -> None:
        """Raise ``ValueError`` unless this spec describes ``model``'s latent sites.

        Every ``(site, axis)`` the spec permutes must be a latent site of ``model`` whose axis
        has the unit layer's size (and, with ``values``, a key of ``values``). A spec built on
        another model would otherwise leave the sites it does not know untouched, so that
        :meth:`check_function` measures no change and reports a symmetry that was never tested.
        """
        sites = getattr(model, "latent_sites", None)
        if not isinstance(sites, Mapping):
            raise TypeError(
                f"PermutationSpec: expected a FineTuneModel (with latent_sites) but got "
                f"{type(model).__name__}."
            )
        for layer in self.layers:
            for site, axis in layer.members:
                spec = sites.get(site)
                if spec is None:
                    raise ValueError(
                        f"PermutationSpec: unit layer {layer.name!r} permutes site {site!r}, "
                        f"which {type(model).__name__} does not have (its latent sites: "
                        f"{sorted(sites)[:6]}): the spec was built on another model. Build it "
                        "from this one with PermutationSpec.from_model(model)."
                    )
                shape = tuple(spec.shape)
                if axis >= len(shape) or shape[axis] != layer.size:
                    raise ValueError(
                        f"PermutationSpec: unit layer {layer.name!r} permutes {layer.size} units "
                        f"on axis {axis} of site {site!r}, whose shape in "
                        f"{type(model).__name__} is {shape}: the spec was built on another "
                        "model. Build it with PermutationSpec.from_model(model)."
                    )
                if values is not None and site not in values:
                    raise ValueError(
                        f"PermutationSpec: values has no entry for site {site!r}, which unit "
                        f"layer {layer.name!r} permutes; pass a value for every latent site "
                        "(e.g. guide.mean())."
                    )

    def check_prior(self, model: Any, *, num_checks: int = 3, rtol: float = 1e-5) -> None:
        r"""Raise ``ValueError`` unless ``log p(h·θ) = log p(θ)`` for random ``θ ~ p`` and ``h``.

        The symmetrized family targets an invariant posterior; a prior that treats units
        differently (per-unit scales) breaks that (Gelberg et al., 2024, Sec. 3).
        ``log p`` is evaluated in :func:`~pyrobayes.batch.compute_dtype` (float32 for a half
        model): a float16 sum of a 256 × 256 layer's ``log p`` is ``-inf``.
        """
        self.check_model(model)
        sites = sorted(self.sites)
        priors = {s: model.site_prior(s) for s in sites}
        with torch.no_grad():
            theta = {s: priors[s].sample((1,)) for s in sites}
            device = next(iter(theta.values())).device
            perms = self.sample(num_checks, device=device)
            moved = self.act(theta, perms)
            for s in sites:
                dtype = compute_dtype(theta[s].dtype)  # the permutation is exact in any dtype
                before = priors[s].log_prob(theta[s][0].to(dtype))
                if not bool(before.isfinite().all()):
                    _unevaluable_prior(model, s, priors[s], before, dtype)
                after = priors[s].log_prob(moved[s][0].to(dtype))
                gap = float((after - before).abs().max())
                if not gap <= rtol * max(1.0, float(before.abs())):
                    raise ValueError(
                        f"The prior of site {s!r} is not invariant under the unit permutations "
                        f"(log p changes by {gap:.3g}): the symmetrized posterior needs a "
                        "permutation-invariant prior, e.g. iid N(0, s²) per layer (the "
                        "FineTuneModel prior). Per-unit prior scales break the symmetry."
                    )

    def check_function(
        self,
        model: Any,
        inputs: Any,
        values: Mapping[str, Tensor],
        *,
        num_checks: int = 2,
        atol: float = 1e-5,
    ) -> float:
        """The largest ``|f(x; h·θ) − f(x; θ)|`` over ``num_checks`` random ``h``; raises above
        ``atol`` (a check of a hand-written spec).

        Raises
        ------
        ValueError
            When the output changes by more than ``atol``, or when the spec does not describe
            ``model``'s latent sites or ``values`` (:meth:`check_model`: a spec built on another
            model).
        """
        self.check_model(model, values)
        perms = self.sample(num_checks, device=next(iter(values.values())).device)
        moved = self.act({s: v.unsqueeze(0) for s, v in values.items()}, perms)
        with torch.no_grad():
            ref = model.output(inputs, values)
            worst = 0.0
            for k in range(num_checks):
                out = model.output(inputs, {s: v[0, k] for s, v in moved.items()})
                worst = max(worst, float((out - ref).abs().max()))
        if worst > atol:
            raise ValueError(
                f"The network's output changes by {worst:.3g} under a unit permutation: the "
                "spec does not describe a symmetry of this model."
            )
        return worst

    def layer_changes(
        self,
        model: Any,
        inputs: Any,
        values: Mapping[str, Tensor],
        *,
        names: Sequence[str] | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, tuple[float, float]]:
        """Per unit layer, how much permuting its units alone changes the network's output.

        For each layer of ``names`` (default: all) with two units or more, ``h`` is a random
        cycle through all of its units (every unit moves; the other layers stay put) and the
        change is ``max |f(x; h·θ) − f(x; θ)|`` over ``inputs``: 0 up to round-off for a true
        symmetry, of the order of ``f`` for a broken one (:func:`_roundoff_tolerance`). The
        forwards run without gradients, with the network in eval mode (dropout off, norm
        statistics not updated) and on a forked global RNG, so the caller's random stream and
        the network's state are as they were.

        Parameters
        ----------
        model : FineTuneModel
            The model the spec was built on.
        inputs : Any
            The network's inputs (a batch without its targets; a few rows suffice).
        values : dict
            ``θ``: one value per latent site, no sample axis (e.g. ``guide.mean()``).
        names : sequence of str, optional
            The unit layers to check.
        generator : torch.Generator, optional
            Source of the permutations (a CPU generator); default the global RNG (forked).

        Returns
        -------
        dict
            ``{layer name: (change, tolerance)}``; the symmetry holds where ``change <=
            tolerance`` (a NaN change does not).
        """
        self.check_model(model, values)
        wanted = {u.name for u in self.layers} if names is None else set(names)
        device = next(iter(values.values())).device
        devices = [device] if device.type == "cuda" else []
        changes: dict[str, tuple[float, float]] = {}
        with torch.no_grad(), _eval_mode(model.net), torch.random.fork_rng(devices=devices):
            ref = model.output(inputs, values)
            tolerance = _roundoff_tolerance(ref, model.dtype)
            for layer in self.layers:
                if layer.name not in wanted or layer.size < 2:
                    continue
                cycle = _random_cycle(layer.size, generator).to(device)
                moved = dict(values)  # h·θ for this layer alone: its members re-indexed
                for site, axis in layer.members:
                    moved[site] = moved[site].index_select(axis, cycle)
                out = model.output(inputs, moved)
                gap = (out - ref).abs().masked_fill(out == ref, 0.0)  # equal infinities: 0
                changes[layer.name] = (float(gap.max()), tolerance)
        return changes

    @staticmethod
    def worse_change(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
        """Of two measurements ``(change, tolerance)`` of one unit layer
        (:meth:`layer_changes`: other values, another batch), the one that speaks more against
        the symmetry: a broken one (``change > tolerance`` or NaN) before a kept one, then the
        larger ``change / tolerance``; so the layer is kept iff both keep it."""
        return max(a, b, key=_against_symmetry)

    # ------------------------------------------------------------------ the network's calls
    def record_calls(self, net: nn.Module) -> CallRecord:
        """Start noting which unit layers' modules run outside their ``nn.Sequential``.

        A parent module may call a Sequential's children itself (``h = self.seq[0](x);
        h = self.seq[1](h) + x``, or ``self.seq[2]`` on another input as well): the structure
        is a symmetric chain, but the function is not invariant under permuting its units.
        Run one forward of ``net`` (a training batch), then :meth:`CallRecord.close` the
        record (it removes its hooks) and pass what it returns to :meth:`without_stray`.

        Parameters
        ----------
        net : nn.Module
            The network the spec was built on (``model.net``).

        Returns
        -------
        CallRecord
            Forward pre-hooks on the Sequentials and the modules that carry the units of
            the layers :meth:`from_model` found there (none for LoRA rank axes).
        """
        return CallRecord(self, net)

    def without_stray(self, stray: Mapping[str, str]) -> PermutationSpec:
        """This spec without the unit layers in ``stray`` (:meth:`CallRecord.close`), each
        named in a ``UserWarning``; ``self`` when ``stray`` is empty.

        Raises
        ------
        ValueError
            When no unit layer is left: the model has no permutation symmetry.
        """
        if not stray:
            return self
        for layer in self.layers:
            if layer.name in stray:
                _left_out_stray(layer, stray[layer.name])
        return self._keeping([u for u in self.layers if u.name not in stray])

    def without_changed(
        self, changes: Mapping[str, tuple[float, float]], stray: Mapping[str, str] | None = None
    ) -> PermutationSpec:
        """This spec without the unit layers whose permutation changed the output by more than
        its tolerance (:meth:`layer_changes`), each named in a ``UserWarning``; ``self`` when
        none did.

        The measurement settles the call record: a layer in ``stray`` (:meth:`CallRecord.close`)
        whose units a parent runs in the Sequential's own order keeps them, and a layer whose
        weights are used without a call (``F.linear(h, self.seq[2].weight)``), which the record
        cannot see, loses them. Layers ``changes`` does not name are kept.

        Raises
        ------
        ValueError
            When no unit layer is left: the model has no permutation symmetry.
        """
        broken = {
            name: change
            for name, change in changes.items()
            if not change[0] <= change[1]  # a NaN change is not a symmetry
        }
        if not broken:
            return self
        for layer in self.layers:
            change = broken.get(layer.name)
            if change is None:
                continue
            measured = (
                f"permuting them changes the network's output by {change[0]:.3g} on the fit's "
                f"first batch (round-off tolerance {change[1]:.3g})"
            )
            called = (stray or {}).get(layer.name)
            if called is not None:
                _left_out_stray(layer, called, measured)
                continue
            _left_out(
                layer.name,
                f"has its hidden units in the nn.Sequential {layer.sequential or '<net>'!r}, but "
                f"{measured}: their weights are used without calling the modules (e.g. "
                "F.linear(h, seq[2].weight) or seq[0].weight read in a parent's forward)",
                fix="Use the modules' weights only through the nn.Sequential's forward",
                owner="PermutationSpec (the network's first forward)",
            )
        return self._keeping([u for u in self.layers if u.name not in broken])

    def _keeping(self, kept: list[UnitLayer]) -> PermutationSpec:
        """A spec of the ``kept`` layers; ``ValueError`` naming the others when none is left."""
        if not kept:
            names = [u.name for u in self.layers]
            raise ValueError(
                f"PermutationSpec: every unit layer ({names[:3]}) runs its modules outside "
                "their nn.Sequential or has its units permuted with a change of the network's "
                "output, so no permutation of their units is known to leave the network's "
                "function unchanged: there is nothing to symmetrize over. Call each "
                "nn.Sequential itself in its parent's forward (and use its modules' weights only "
                "through it), or fit the base family directly."
            )
        return PermutationSpec(kept)


class CallRecord:
    """Forward pre-hooks that note the unit layers whose modules run outside their
    ``nn.Sequential`` (:meth:`PermutationSpec.record_calls`).

    A Sequential's own forward calls only its children, in order; a call of one of them while
    that forward is not running comes from elsewhere (the parent's forward), which may treat
    the units differently.

    Attributes
    ----------
    stray : dict
        ``{unit layer name: path of the first of its modules called outside}``.
    """

    def __init__(self, spec: PermutationSpec, net: nn.Module) -> None:
        self.stray: dict[str, str] = {}
        self._running: dict[str, int] = {}  # Sequential path → forwards of it under way
        self._handles: list[RemovableHandle] = []
        watched: dict[str, list[tuple[str, str]]] = {}  # module → [(unit layer, Sequential)]
        for layer in spec.layers:
            if layer.sequential is None:
                continue
            self._running[layer.sequential] = 0
            for path in layer.modules:
                watched.setdefault(path, []).append((layer.name, layer.sequential))
        try:
            for path in self._running:
                self._watch_sequential(path, net.get_submodule(path))
            for path, owners in watched.items():
                self._watch_member(path, net.get_submodule(path), owners)
        except BaseException:
            self.close()
            raise

    def _watch_sequential(self, path: str, module: nn.Module) -> None:
        def enter(_module: nn.Module, _args: Any) -> None:
            self._running[path] += 1

        def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
            self._running[path] -= 1

        self._handles.append(module.register_forward_pre_hook(enter))
        self._handles.append(module.register_forward_hook(leave, always_call=True))

    def _watch_member(self, path: str, module: nn.Module, owners: list[tuple[str, str]]) -> None:
        def called(_module: nn.Module, _args: Any) -> None:
            for name, sequential in owners:
                if not self._running[sequential]:
                    self.stray.setdefault(name, path)

        self._handles.append(module.register_forward_pre_hook(called))

    def close(self) -> dict[str, str]:
        """Remove the hooks; return :attr:`stray`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return dict(self.stray)


def _left_out_stray(layer: UnitLayer, called: str, measured: str = "") -> None:
    """Warn that ``layer``'s units are left out: ``called`` runs outside their Sequential."""
    _left_out(
        layer.name,
        f"has its hidden units in the nn.Sequential {layer.sequential or '<net>'!r}, "
        f"but {called!r} runs outside that Sequential's forward (a "
        "parent that calls the Sequential's children itself, e.g. around a "
        "residual connection, or calls one of them elsewhere as well)"
        + (f", and {measured}" if measured else ""),
        fix="Call the nn.Sequential itself in the parent's forward (and nothing "
        "in it elsewhere) to have them symmetrized",
        owner="PermutationSpec (the network's first forward)",
    )


def _unevaluable_prior(
    model: Any, site: str, prior: Any, log_p: Tensor, dtype: torch.dtype
) -> NoReturn:
    """Raise ``ValueError``: ``prior``'s ``log_prob`` of its own draw of ``site`` is ``log_p``,
    non-finite (in ``dtype``, :func:`~pyrobayes.batch.compute_dtype`), so no permutation can be
    compared with it (the difference of two non-finite values is NaN or undefined)."""
    value = float(log_p.detach().reshape(-1)[~log_p.isfinite().reshape(-1)][0])
    raise ValueError(
        f"PermutationSpec.check_prior: the prior's log-density of site {site!r} cannot be "
        f"evaluated: {type(model).__name__}.site_prior({site!r}) "
        f"({type(prior).__name__}) gives log_prob {value} at its own draw (non-finite in "
        f"{str(dtype).removeprefix('torch.')}), so neither its invariance under the unit "
        "permutations nor the ELBO's prior term can be computed. Make site_prior return a "
        "distribution with a finite log-density at its draws (a positive scale in the normal "
        "range of the dtype, a support that holds the draws), e.g. FineTuneModel's own iid "
        "N(0, prior_scale²)."
    )


def _against_symmetry(change: tuple[float, float]) -> tuple[bool, float]:
    """The sort key of :meth:`PermutationSpec.worse_change`: ``(broken, change / tolerance)``
    (``inf`` for a NaN change or a broken one of tolerance 0, 0 for no change)."""
    value, tolerance = change
    if not value <= tolerance:
        return True, math.inf if math.isnan(value) or tolerance <= 0 else value / tolerance
    return False, value / tolerance if tolerance > 0 else 0.0


def _random_cycle(size: int, generator: torch.Generator | None) -> Tensor:
    """A uniformly random ``size``-cycle as an index tensor ``(size,)``: ``h[σ_i] = σ_{i+1}``
    for a random ordering ``σ``, so that every unit moves (a uniform permutation may fix the
    very units a parent treats differently)."""
    order = torch.randperm(size, generator=generator)
    cycle = torch.empty_like(order)
    cycle[order] = order.roll(-1)
    return cycle


def _roundoff_tolerance(reference: Tensor, dtype: torch.dtype) -> float:
    r"""The largest output change a true symmetry's round-off explains: ``√ε · max|f|``.

    Permuting the units of a true symmetry only reorders sums over them (the next layer's
    ``W h``, a norm's mean): each output moves by a few ulps of its terms, about ``√n · ε``
    relative for ``n`` units (measured up to 6e-7 of ``max|f|`` in float32 for four layers
    2048 wide, 3e-4 in bfloat16, 2e-16 in float64). A broken symmetry moves the outputs by
    their own order (measured 0.4 to 0.9 of ``max|f|`` for a residual connection or a weight
    read outside the modules' calls). ``√ε`` of the coarser of the network's and the output's
    dtypes splits the two by about three decades each way in float32 (3.5e-4), eight in
    float64 (1.5e-8) and stays 300 times above the bfloat16 round-off (0.088): half the
    digits agree.
    """
    eps = max(torch.finfo(reference.dtype).eps, torch.finfo(dtype).eps)
    finite = reference[reference.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return math.sqrt(eps) * scale


@contextmanager
def _eval_mode(net: nn.Module) -> Iterator[None]:
    """Every module of ``net`` in eval mode within the block, its own mode restored after."""
    training = {module: module.training for module in net.modules()}
    net.eval()
    try:
        yield
    finally:
        for module, flag in training.items():
            module.training = flag


def _select_per_element(x: Tensor, perm: Tensor, dim: int) -> Tensor:
    """``out[k] = x[k].index_select(dim − 1, perm[k])`` for ``x`` `(K, ...)`, one index_select."""
    num, size = int(perm.shape[0]), int(perm.shape[1])
    moved = x.movedim(dim, 1).contiguous()  # (K, n, ...)
    offsets = (perm + size * torch.arange(num, device=perm.device).unsqueeze(1)).reshape(-1)
    merged = moved.reshape(num * size, *moved.shape[2:]).index_select(0, offsets)
    return merged.reshape(moved.shape).movedim(1, dim)


def _gather(x: Tensor, perm: Tensor, dim: int, *, lead: int) -> Tensor:
    """``x`` re-indexed along ``dim`` by ``perm`` `(K, n)`, the K axis of ``x`` at ``lead``."""
    shape = [1] * x.dim()
    shape[lead] = perm.shape[0]
    shape[dim] = perm.shape[1]
    index = perm.reshape(shape).expand(*x.shape[:dim], perm.shape[1], *x.shape[dim + 1 :])
    return torch.gather(x, dim, index)


def _lora_rank_layers(specs: Mapping[str, Any]) -> list[UnitLayer]:
    """One unit layer per LoRA-adapted module: rows of ``lora_A`` and columns of ``lora_B``."""
    by_path: dict[str, dict[str, Any]] = {}
    for site, spec in specs.items():
        if spec.kind in ("lora_A", "lora_B"):
            by_path.setdefault(spec.module_path, {})[spec.kind] = (site, spec)
    layers = []
    for path, roles in by_path.items():
        if set(roles) == {"lora_A"}:
            raise ValueError(
                f"The symmetrized guide permutes the rank components of LoRA factor pairs, but "
                f"{path!r} has only its A latent (LoRA(latent='A'): B is a point parameter), so "
                "permuting A's rows alone would change the function. Use LoRA(latent='AB') for "
                "this family."
            )
        if set(roles) != {"lora_A", "lora_B"}:
            continue
        (a_site, a_spec), (b_site, b_spec) = roles["lora_A"], roles["lora_B"]
        rank = int(a_spec.shape[0])
        if int(b_spec.shape[1]) != rank:
            raise RuntimeError(f"LoRA factors of {path!r} disagree on the rank; please report.")
        layers.append(UnitLayer(f"{path}.rank", rank, ((a_site, 0), (b_site, 1))))
    return layers


def _mlp_unit_layers(model: Any, net: nn.Module, specs: Mapping[str, Any]) -> list[UnitLayer]:
    """The hidden units between consecutive latent ``nn.Linear`` modules of an ``nn.Sequential``."""
    latent: dict[str, dict[str, str]] = {}
    for site, spec in specs.items():
        if spec.kind in ("weight", "bias"):
            latent.setdefault(spec.module_path, {})[spec.kind] = site
    point_ids = {id(p) for p in getattr(model, "point_params", {}).values()}
    layers = []
    for parent_path, parent in net.named_modules():
        if not isinstance(parent, nn.Sequential):
            continue
        if type(parent).forward is not nn.Sequential.forward:
            paths = [f"{parent_path}.{n}" if parent_path else n for n, _ in parent.named_children()]
            if sum(p in latent for p in paths) >= 2:
                _left_out(
                    parent_path or "<net>",
                    f"is a {type(parent).__name__}, an nn.Sequential subclass with its own "
                    "forward, whose children need not run one after the other (a residual "
                    "connection)",
                )
            continue
        children = list(parent.named_children())
        for i, (name, module) in enumerate(children):
            path = f"{parent_path}.{name}" if parent_path else name
            if path not in latent or not isinstance(module, nn.Linear):
                continue
            width = int(module.out_features)
            between: list[tuple[str, nn.Module]] = []
            successor = None
            for other_name, other in children[i + 1 :]:
                other_path = f"{parent_path}.{other_name}" if parent_path else other_name
                if other_path in latent and isinstance(other, nn.Linear):
                    successor = (other_path, other)
                    break
                between.append((other_path, other))
            if successor is None or int(successor[1].in_features) != width:
                continue
            if not all(_unitwise(m, width, point_ids, p) for p, m in between):
                continue
            hooked = _hooked_on_units((path, module), between, successor)
            if hooked is not None:
                _left_out(path, f"has its hidden units seen by a hook on {hooked!r}")
                continue
            members = [(latent[path]["weight"], 0)]
            if "bias" in latent[path]:
                members.append((latent[path]["bias"], 0))
            members.append((latent[successor[0]]["weight"], 1))
            chain = (path, *(p for p, _ in between), successor[0])
            layers.append(UnitLayer(path, width, tuple(members), parent_path, chain))
    return layers


def _unitwise(module: nn.Module, width: int, point_ids: set[int], path: str) -> bool:
    """Whether ``module`` commutes with a permutation of its ``width`` input units.

    Raises ``ValueError`` for a LayerNorm whose per-unit affine parameters break the symmetry.
    """
    if isinstance(module, _UNITWISE):
        return True
    if isinstance(module, nn.LayerNorm) and tuple(module.normalized_shape) == (width,):
        for role in ("weight", "bias"):
            p = getattr(module, role, None)
            if p is None:
                continue
            if id(p) in point_ids:
                raise ValueError(
                    f"The LayerNorm {path!r} between two latent layers has its {role} "
                    "point-estimated (trainable_modules): trained per-unit parameters break "
                    "the permutation symmetry. Leave it out of trainable_modules, or use "
                    "nn.LayerNorm(..., elementwise_affine=False)."
                )
            if not bool((p == p.reshape(-1)[0]).all()):
                raise ValueError(
                    f"The LayerNorm {path!r} between two latent layers has a {role} that "
                    "differs between units: permuting the units changes the function. Use a "
                    "constant (default) affine or elementwise_affine=False."
                )
        return True
    return False


def _hooked_on_units(
    first: tuple[str, nn.Module],
    between: Sequence[tuple[str, nn.Module]],
    successor: tuple[str, nn.Module],
) -> str | None:
    """The path of a module whose hooks see the hidden units between ``first`` and
    ``successor`` (a forward hook of ``first``, any hook of a module between, a pre-hook of
    ``successor``), or ``None``: a hook may treat the units differently."""
    seen: list[tuple[tuple[str, nn.Module], tuple[str, ...]]] = [(first, ("_forward_hooks",))]
    seen += [(b, ("_forward_pre_hooks", "_forward_hooks")) for b in between]
    seen.append((successor, ("_forward_pre_hooks",)))
    for (path, module), kinds in seen:
        if any(getattr(module, kind, None) for kind in kinds):
            return path
    return None


def _left_out(
    path: str,
    why: str,
    fix: str = "Remove the hook (or use a plain nn.Sequential) to have them symmetrized",
    owner: str = "PermutationSpec.from_model",
) -> None:
    """Warn that the units after the latent layer(s) at ``path`` are left out of the group."""
    warnings.warn(
        f"{owner}: {path!r} {why}, so permuting the hidden units there may "
        "change the network's function; those units are left out of the symmetry group. "
        f"{fix}, or check a hand-built spec with spec.check_function(model, inputs, values).",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
