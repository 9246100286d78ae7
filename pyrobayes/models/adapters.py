"""Adapter configurations (LoRA, LoRA-XS) and their injection into a network.

An adapter config is a small validated dataclass, as peft's ``LoraConfig``. ``inject`` replaces
each targeted ``nn.Linear`` / GPT-2 ``Conv1D`` by a pyrobayes layer from :mod:`.layers` and returns
the latent tensors as :class:`SiteSpec` records with stable, readable site names derived from the
module path (``<module path>.core`` for a LoRA-XS core, ``<module path>.lora_A`` / ``.lora_B``
for LoRA).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import operator
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .layers import BatchedLinear, LoRALinear, LoRAXSLinear, base_weight_in_out, is_conv1d
from .projections import PROJECTIONS, collect_input_moments, project

logger = logging.getLogger(__name__)

__all__ = [
    "SiteSpec",
    "LoRA",
    "LoRAXS",
    "find_target_modules",
    "inject_adapter",
    "make_latent",
    "check_real",
    "check_int",
]


def check_real(
    name: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    owner: str = "",
) -> float:
    """``value`` as a float, or an error naming the option ``name`` and what it must be.

    Finite real numbers only: NaN and ±inf are refused whatever the bounds (``x <= 0`` alone
    lets NaN through). Explicit checks, so they hold under ``python -O``.

    Parameters
    ----------
    name : str
        The option's name, as the caller spells it (``"prior_scale"``).
    value : Any
    gt, ge, lt, le : float, optional
        ``value > gt``, ``value >= ge``, ``value < lt``, ``value <= le``.
    owner : str
        Prefix of the message, e.g. ``"IVONGuide: "``.

    Returns
    -------
    float

    Raises
    ------
    TypeError
        When ``value`` is not a real number (a bool, a string, a tensor with several entries).
    ValueError
        When it is NaN, infinite or out of bounds.
    """
    limits = ((">", gt), (">=", ge), ("<", lt), ("<=", le))
    bounds = [f"{op} {b:g}" for op, b in limits if b is not None]
    expected = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")
    number = None
    if not isinstance(value, (bool, str)):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            number = float(value)  # ints, NumPy scalars, one-element tensors
    if number is None:
        raise TypeError(
            f"{owner}{name} must be {expected}; got {value!r} ({type(value).__name__})."
        )
    if (
        not math.isfinite(number)
        or (gt is not None and not number > gt)
        or (ge is not None and not number >= ge)
        or (lt is not None and not number < lt)
        or (le is not None and not number <= le)
    ):
        raise ValueError(f"{owner}{name} must be {expected}; got {value!r}.")
    return number


def check_int(name: str, value: Any, *, ge: int | None = None, owner: str = "") -> int:
    """``value`` as an int, or an error naming the option ``name``.

    Integers only (``int``, NumPy integers): a float such as ``2.5`` or ``100.0`` is refused
    rather than truncated, and so are bools.

    Parameters
    ----------
    name : str
    value : Any
    ge : int, optional
        ``value >= ge``.
    owner : str
        Prefix of the message.

    Returns
    -------
    int

    Raises
    ------
    TypeError
        When ``value`` is not an integer.
    ValueError
        When it is below ``ge``.
    """
    expected = "an integer" + (f" >= {ge}" if ge is not None else "")
    number = None
    if not isinstance(value, (bool, float)):
        with contextlib.suppress(TypeError):
            number = operator.index(value)  # ints, NumPy integers, one-element integer tensors
    if number is None:
        whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
        hint = f" (pass {name}={int(value)})" if whole else ""
        raise TypeError(
            f"{owner}{name} must be {expected}; got {value!r} ({type(value).__name__}){hint}."
        )
    if ge is not None and number < ge:
        raise ValueError(f"{owner}{name} must be {expected}; got {number}.")
    return number


@dataclass(frozen=True)
class SiteSpec:
    """One latent tensor of the network.

    Attributes
    ----------
    site : str
        Pyro sample-site name, e.g. ``"bert.encoder.layer.0.attention.self.query.core"``.
    param_name : str
        Key of the tensor for ``torch.func.functional_call`` (``"<path>.core.weight"``).
    module_path : str
        Path of the adapted module inside the network.
    shape : tuple[int, ...]
        Shape of one parameter set.
    kind : str
        ``"lora_xs_core"``, ``"lora_A"``, ``"lora_B"``, ``"weight"`` or ``"bias"``.
    """

    site: str
    param_name: str
    module_path: str
    shape: tuple[int, ...]
    kind: str


def _is_adaptable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


#: Layers a ``target_modules`` regex may well match by accident (a ``proj`` / ``embed`` name)
#: that no adapter here can act on: a regex that selects one is warned about, a list entry that
#: names one is refused.
_UNSUPPORTED_LEAVES: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Embedding,
    nn.EmbeddingBag,
)

_SUPPORTED = "nn.Linear layers and transformers' GPT-2 Conv1D"


def _module_aliases(net: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    """``{id(module): (module, every path it is registered under)}`` in network order.

    ``named_modules()`` lists a module registered under two names (``net.dec = net.enc``) once;
    every name is kept here, the first one first.
    """
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, module in net.named_modules(remove_duplicate=False):
        if name:
            found.setdefault(id(module), (module, []))[1].append(name)
    return found


def _unreachable_reason(module: nn.Module, path: str, net: nn.Module) -> str | None:
    """Why an adapter on the linear ``module`` at ``path`` could never act, or ``None``.

    ``nn.MultiheadAttention`` reads ``out_proj.weight`` / ``.bias`` itself (``F.multi_head_
    attention_forward``) and never calls ``out_proj``, so a layer put there is never run.
    """
    parent_path, _, child = path.rpartition(".")
    parent = net.get_submodule(parent_path) if parent_path else net
    if child == "out_proj" and isinstance(parent, nn.MultiheadAttention):
        return (
            f"{path!r} is the output projection of the nn.MultiheadAttention {parent_path!r}, "
            "which reads out_proj.weight and out_proj.bias directly and never calls out_proj, "
            "so an adapter there could never act. Leave it out of target_modules (a regex over "
            "full paths can skip it), or adapt the linear layers around the attention"
        )
    return None


def _inside_adapter(module_paths: list[str], adapter_paths: list[str]) -> bool:
    return any(p.startswith(a + ".") for p in module_paths for a in adapter_paths)


_Found = list[tuple[nn.Module, list[str]]]  # (module, every path it is registered under)


def _skipped_warning(target_modules: Any, skipped: list[str], more: str = "") -> None:
    """Warn that ``target_modules`` also matches the Conv / Embedding layers ``skipped``."""
    if skipped:
        warnings.warn(
            f"target_modules={target_modules!r} also matches {', '.join(skipped[:6])}"
            f"{' ...' if len(skipped) > 6 else ''}, which no adapter supports (only "
            f"{_SUPPORTED}): left as they are.{more}",
            UserWarning,
            stacklevel=4,
        )


def _by_regex(target_modules: str, modules: _Found, candidates: _Found) -> _Found:
    """The candidates a regex over whole paths selects (any of a module's names)."""
    pattern = re.compile(target_modules)
    chosen = [(m, paths) for m, paths in candidates if any(pattern.fullmatch(p) for p in paths)]
    skipped = [
        f"{paths[0]!r} ({type(m).__name__})"
        for m, paths in modules
        if isinstance(m, _UNSUPPORTED_LEAVES) and any(pattern.fullmatch(p) for p in paths)
    ]
    if chosen:
        _skipped_warning(target_modules, skipped, " Narrow the regex to silence this.")
    return chosen


def _matches(paths: list[str], entry: str) -> bool:
    return any(p == entry or p.endswith("." + entry) for p in paths)


def _unsupported_entry(entry: str, others: _Found) -> ValueError:
    """The error for a list entry that names only modules no adapter supports."""
    module, paths = others[0]
    inner = sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, c in module.named_modules()
            if n and _is_adaptable(c) and _unreachable_reason(c, n, module) is None
        }
    )
    hint = (
        f"; it is a container: name the linear layers inside it, e.g. {inner[:6]}" if inner else ""
    )
    more = f" (and {len(others) - 1} more modules)" if len(others) > 1 else ""
    return ValueError(
        f"target_modules entry {entry!r} names {paths[0]!r}, a {type(module).__name__}{more}, "
        f"which no adapter supports: LoRA and LoRA-XS adapt {_SUPPORTED} only{hint}. Remove "
        f"{entry!r} from target_modules."
    )


def _by_names(targets: list[str], net: nn.Module, modules: _Found, candidates: _Found) -> _Found:
    """The candidates a list of names selects (peft's suffix rule on any of a module's names)."""
    chosen = [(m, paths) for m, paths in candidates if any(_matches(paths, t) for t in targets)]
    unmatched: list[str] = []
    skipped: list[str] = []
    for t in targets:
        if any(_matches(paths, t) for _, paths in candidates):
            skipped += [
                f"{paths[0]!r} ({type(m).__name__})"
                for m, paths in modules
                if isinstance(m, _UNSUPPORTED_LEAVES) and _matches(paths, t)
            ]
            continue
        others = [(m, paths) for m, paths in modules if _matches(paths, t)]
        if others:
            raise _unsupported_entry(t, others)
        unmatched.append(t)
    _skipped_warning(targets, skipped)
    if chosen and unmatched:
        leaf_names = sorted({p.rsplit(".", 1)[-1] for _, paths in modules for p in paths})
        listed = []
        for t in unmatched:
            close = difflib.get_close_matches(t, leaf_names, n=3)
            listed.append(f"{t!r}" + (f" (did you mean {close}?)" if close else ""))
        warnings.warn(
            f"target_modules entries {', '.join(listed)} match no module of "
            f"{type(net).__name__} and are ignored; only the other entries are adapted.",
            UserWarning,
            stacklevel=3,
        )
    return chosen


def find_target_modules(net: nn.Module, target_modules: Sequence[str] | str) -> list[str]:
    """Paths of the linear modules of ``net`` that ``target_modules`` selects.

    A list matches a module whose path equals an entry or ends with ``"." + entry`` (peft's rule);
    a string is a regular expression that must match the whole path. A module registered under
    several names (``net.dec = net.enc``) is selected when any of its names matches and is
    returned once, under its first name (the one ``named_modules()`` gives); the adapter layer
    then replaces it under every name.

    Raises
    ------
    ValueError
        When nothing matches (the message lists the candidate module names); when a list entry
        names only modules of a type no adapter supports (a Conv2d, an Embedding, a container:
        only ``nn.Linear`` and GPT-2 ``Conv1D``); when a selected linear layer could never act
        (``nn.MultiheadAttention.out_proj``, which its attention never calls).

    Warns
    -----
    UserWarning
        When a list entry matches no module at all while other entries do (a typo: the message
        names close matches), and when a regex matches a Conv or Embedding layer it cannot
        adapt (it is left as it is).
    """
    modules = list(_module_aliases(net).values())
    adapter_paths = [paths[0] for m, paths in modules if isinstance(m, (LoRALinear, LoRAXSLinear))]
    candidates = [
        (m, paths)
        for m, paths in modules
        if _is_adaptable(m)
        and not isinstance(m, (LoRALinear, LoRAXSLinear))
        and not _inside_adapter(paths, adapter_paths)
    ]
    if isinstance(target_modules, str):
        chosen = _by_regex(target_modules, modules, candidates)
    else:
        chosen = _by_names(list(target_modules), net, modules, candidates)
    if not chosen:
        names = [paths[0] for _, paths in candidates]
        leaf_names = sorted({n.rsplit(".", 1)[-1] for n in names})
        as_regex = (
            f" A string is a regular expression matched against whole paths; for module "
            f"names pass a list, target_modules=[{target_modules!r}]."
            if isinstance(target_modules, str) and target_modules in leaf_names
            else ""
        )
        raise ValueError(
            f"target_modules={target_modules!r} matched no linear module of "
            f"{type(net).__name__}. Candidate module names: {leaf_names} "
            f"(full paths, e.g. {names[:4]}). Pass some of these, or a regex over full paths."
            + as_regex
        )
    for _, paths in chosen:
        for path in paths:
            reason = _unreachable_reason(net.get_submodule(path), path, net)
            if reason is not None:
                raise ValueError(f"target_modules={target_modules!r} selects {reason}.")
    return [paths[0] for _, paths in chosen]


def _set_submodule(net: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path`` and under every other name of the module found there (a module
    registered twice, ``net.dec = net.enc``, stays one module: ``net.enc is net.dec``)."""
    old = net.get_submodule(path)
    paths = [p for p, m in net.named_modules(remove_duplicate=False) if m is old and p]
    for where in paths or [path]:
        parent_path, _, child = where.rpartition(".")
        parent = net.get_submodule(parent_path) if parent_path else net
        setattr(parent, child, module)


@dataclass
class LoRA:
    """LoRA adapter: ``W = W0 + (α/r) B A`` with ``A ∈ R^{r×d_in}``, ``B ∈ R^{d_out×r}``.

    Parameters
    ----------
    rank : int
        r, the adapter rank.
    alpha : float, optional
        Scaling numerator; defaults to ``rank`` (scaling 1).
    target_modules : list of str or str
        Module names (suffix match) or a regex over full module paths.
    latent : {"AB", "A"}
        Which factors are latent sites. ``"AB"`` (default): both, ``q(A, B)`` (Bayes by
        Backprop over the adapter, Blundell et al. 2015). ``"A"``: only ``A``; every ``B`` is a
        point parameter trained in place, as a head is (``FineTuneModel.point_params``), so
        ``ΔW = (α/r) B A`` is Gaussian given ``B`` — the parameterisation of BLoB (Wang et al.
        2024). The symmetrized guide needs both factors (its permutations act on the
        rows of ``A`` and the columns of ``B`` together).
    """

    rank: int = 8
    alpha: float | None = None
    target_modules: Sequence[str] | str = field(default_factory=lambda: ["query", "value"])
    latent: str = "AB"
    kind: str = field(default="lora", init=False)

    def __post_init__(self) -> None:
        self.rank = check_int("rank", self.rank, ge=1, owner="LoRA: ")
        if self.alpha is not None:
            self.alpha = check_real("alpha", self.alpha, gt=0, owner="LoRA: ")
        if self.latent not in ("AB", "A"):
            raise ValueError(
                f"LoRA: latent must be 'AB' (both factors latent) or 'A' (A latent, B a point "
                f"parameter) but got {self.latent!r}."
            )

    @property
    def latent_roles(self) -> tuple[str, ...]:
        """The factors that are latent sites: ``("lora_A", "lora_B")`` or ``("lora_A",)``."""
        return ("lora_A", "lora_B") if self.latent == "AB" else ("lora_A",)

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    @classmethod
    def from_peft(cls, config: Any, *, scoped: bool = False) -> LoRA:
        """Build from a ``peft.LoraConfig``.

        Settings that change the adapted function and have no counterpart here are refused by
        name rather than dropped (rsLoRA's ``α/√r`` scaling, DoRA's magnitudes, per-module
        ranks or scalings, peft's default targets). ``scoped``: the caller resolves which
        modules peft adapted (a peft model's own layers), so ``layers_to_transform``,
        ``layers_pattern`` and ``exclude_modules`` are taken care of; without it they are
        refused too.
        """
        unsupported = [
            f"{name}={value!r}"
            for name, value in (
                ("use_rslora", getattr(config, "use_rslora", False)),
                ("use_dora", getattr(config, "use_dora", False)),
                ("rank_pattern", getattr(config, "rank_pattern", None)),
                ("alpha_pattern", getattr(config, "alpha_pattern", None)),
            )
            if value
        ]
        if not scoped:
            unsupported += [
                f"{name}={value!r}"
                for name in ("layers_to_transform", "layers_pattern", "exclude_modules")
                if (value := getattr(config, name, None))
            ]
        if unsupported:
            raise ValueError(
                f"LoRA.from_peft: the LoraConfig sets {', '.join(unsupported)}, which pyrobayes' "
                "LoRA (W0 + (alpha/r) B A, one rank and alpha for every targeted module) does not "
                "represent; importing it would silently change the adapted function. Use a "
                "plain LoraConfig (and target_modules naming exactly the modules to adapt)."
            )
        targets = config.target_modules
        if targets is None:
            raise ValueError(
                "LoRA.from_peft: the LoraConfig has target_modules=None (peft picks defaults "
                "per architecture when it wraps a model); name the modules, e.g. "
                "target_modules=['query', 'value'], or pass the peft-wrapped model itself."
            )
        if isinstance(targets, set):
            targets = sorted(targets)
        return cls(rank=int(config.r), alpha=float(config.lora_alpha), target_modules=targets)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "rank": self.rank,
            "alpha": self.alpha,
            "target_modules": self.target_modules
            if isinstance(self.target_modules, str)
            else list(self.target_modules),
        }
        if self.latent != "AB":  # files saved before the option (both latent) still match
            out["latent"] = self.latent
        return out


@dataclass
class LoRAXS:
    """LoRA-XS adapter: ``W = W0 + (α/r) A R B`` with frozen bases and a trainable r×r core R
    (Bałazy et al., 2024, "LoRA-XS: low-rank adaptation with extremely small number of
    parameters").

    Parameters
    ----------
    rank : int
        r; the core has r² parameters per layer.
    alpha : float, optional
        Scaling numerator (default ``rank``: scaling 1; the papers use 16 for RoBERTa).
    projection : {"svd", "wsvd", "dct", "random"}
        How the frozen bases are built from W0 (see :mod:`pyrobayes.models.projections`).
        ``"wsvd"`` needs input statistics: pass ``calibration_data`` to ``FineTuneModel``.
    target_modules : list of str or str
        Module names (suffix match) or a regex over full module paths.
    init_scale : float
        Initial core entries are drawn from N(0, init_scale²) (1e-5: the pretrained function).
    moment : {"centered", "second"}
        Which input statistic whitens W-SVD.
    seed : int
        Seed of the random (Haar) projection.
    """

    rank: int = 8
    alpha: float | None = None
    projection: str = "svd"
    target_modules: Sequence[str] | str = field(default_factory=lambda: ["query", "value"])
    init_scale: float = 1e-5
    moment: str = "centered"
    seed: int = 0
    kind: str = field(default="lora_xs", init=False)

    def __post_init__(self) -> None:
        self.rank = check_int("rank", self.rank, ge=1, owner="LoRAXS: ")
        if self.alpha is not None:
            self.alpha = check_real("alpha", self.alpha, gt=0, owner="LoRAXS: ")
        self.init_scale = check_real("init_scale", self.init_scale, ge=0, owner="LoRAXS: ")
        self.seed = check_int("seed", self.seed, owner="LoRAXS: ")
        if self.projection not in PROJECTIONS:
            raise ValueError(
                f"Expected projection in {PROJECTIONS} but got projection={self.projection!r}."
            )
        if self.moment not in ("centered", "second"):
            raise ValueError(f"Expected moment 'centered' or 'second' but got {self.moment!r}.")

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "alpha": self.alpha,
            "projection": self.projection,
            "target_modules": self.target_modules
            if isinstance(self.target_modules, str)
            else list(self.target_modules),
            "init_scale": self.init_scale,
            "moment": self.moment,
            "seed": self.seed,
        }


def adapter_from_dict(config: dict[str, Any]) -> Any:
    """Inverse of ``to_dict`` (used by posterior I/O and the command line): a LoRA, LoRA-XS or
    σN-ensemble (:class:`~pyrobayes.models.signorm.SigmaNorm`, its inner adapter nested)."""
    config = dict(config)
    kind = config.pop("kind")
    if kind == "signorm":
        from .signorm import SigmaNorm  # signorm builds on this module

        inner = config.pop("adapter", None)
        return SigmaNorm(**config, adapter=None if inner is None else adapter_from_dict(inner))
    return {"lora": LoRA, "lora_xs": LoRAXS}[kind](**config)


def _inject_lora(net: nn.Module, adapter: LoRA, paths: list[str]) -> list[SiteSpec]:
    """Replace the modules at ``paths`` by :class:`LoRALinear` layers: their latent sites."""
    sites: list[SiteSpec] = []
    for path in paths:
        layer = LoRALinear(net.get_submodule(path), adapter.rank, scaling=adapter.scaling)
        layer.lora_A.module_path = layer.lora_B.module_path = path  # named by its errors
        _set_submodule(net, path, layer)
        for role in adapter.latent_roles:
            shape = tuple(getattr(layer, role).weight.shape)
            sites.append(SiteSpec(f"{path}.{role}", f"{path}.{role}.weight", path, shape, role))
    return sites


def _warn_if_unread(adapter: LoRA | LoRAXS) -> None:
    """Calibration batches given to an adapter that reads none (all but W-SVD's LoRA-XS)."""
    if isinstance(adapter, LoRAXS) and adapter.projection == "wsvd":
        return
    which = "LoRA" if isinstance(adapter, LoRA) else f"LoRAXS(projection={adapter.projection!r})"
    warnings.warn(
        f"FineTuneModel: calibration_data is read only by LoRAXS(projection='wsvd') (the input "
        f"statistics of its weighted SVD) and by SigmaNorm; {which} does not use it, so it was "
        "ignored. Temperature scaling on held-out data is pb.calibrate(model, guide, val_data), "
        "after the fit.",
        UserWarning,
        stacklevel=5,
    )


def inject_adapter(
    net: nn.Module,
    adapter: LoRA | LoRAXS,
    *,
    calibration_batches: Iterable[Any] | None = None,
    calibration_forward: Callable[[nn.Module, Any], Any] | None = None,
    calibration_mask: Callable[[Any], torch.Tensor | None] | None = None,
    max_calibration_batches: int | None = None,
) -> list[SiteSpec]:
    """Replace the targeted modules of ``net`` in place and return the latent sites.

    An adapter config other than LoRA / LoRA-XS that has an ``inject(net, **kwargs)`` method
    (e.g. :class:`pyrobayes.models.signorm.SigmaNorm`) converts the network itself.
    """
    inject = getattr(adapter, "inject", None)
    if not isinstance(adapter, (LoRA, LoRAXS)) and callable(inject):
        specs: list[SiteSpec] = inject(
            net,
            calibration_batches=calibration_batches,
            calibration_forward=calibration_forward,
            calibration_mask=calibration_mask,
            max_calibration_batches=max_calibration_batches,
        )
        return specs
    paths = find_target_modules(net, adapter.target_modules)
    sites: list[SiteSpec] = []
    if calibration_batches is not None:
        _warn_if_unread(adapter)
    if isinstance(adapter, LoRA):
        return _inject_lora(net, adapter, paths)
    if not isinstance(adapter, LoRAXS):
        raise TypeError(f"Expected a LoRA or LoRAXS adapter config but got {type(adapter)}.")
    covariances: dict[str, torch.Tensor] = {}
    if adapter.projection == "wsvd":
        if calibration_batches is None or calibration_forward is None:
            raise ValueError(
                "LoRAXS(projection='wsvd') needs input statistics of the targeted layers: pass "
                "calibration_data=<your training DataLoader> to FineTuneModel."
            )
        moments = collect_input_moments(
            net,
            paths,
            calibration_batches,
            forward=calibration_forward,
            mask_fn=calibration_mask,
            max_batches=max_calibration_batches,
        )
        covariances = {p: m.covariance(moment=adapter.moment) for p, m in moments.items()}
    too_small = {
        path: tuple(int(n) for n in base_weight_in_out(net.get_submodule(path)).shape)
        for path in paths
    }
    too_small = {path: dims for path, dims in too_small.items() if adapter.rank > min(dims)}
    if too_small:
        listed = ", ".join(f"{p!r} (d_in={i}, d_out={o})" for p, (i, o) in too_small.items())
        raise ValueError(
            f"LoRAXS(rank={adapter.rank}) exceeds the smaller dimension of {listed}: an r x r "
            "core needs r <= min(d_in, d_out). Lower the rank to at most "
            f"{min(min(d) for d in too_small.values())}, or leave these layers out of "
            "target_modules."
        )
    generator = torch.Generator().manual_seed(adapter.seed)
    for path in paths:
        base = net.get_submodule(path)
        w0 = base_weight_in_out(base)  # (d_in, d_out)
        rank = adapter.rank
        a, b = project(
            w0.detach().cpu(),  # project() computes in float64 whatever the dtype
            rank,
            adapter.projection,
            covariance=covariances.get(path),
            generator=generator,
        )  # A (d_in, r), B (r, d_out)
        down = a.T.to(dtype=w0.dtype, device=w0.device)
        up = b.T.to(dtype=w0.dtype, device=w0.device)
        xs_layer = LoRAXSLinear(
            base, down, up, scaling=adapter.scaling, init_scale=adapter.init_scale
        )
        xs_layer.core.module_path = path  # named by its errors
        _set_submodule(net, path, xs_layer)
        sites.append(SiteSpec(f"{path}.core", f"{path}.core.weight", path, (rank, rank), "core"))
    return sites


def make_latent(net: nn.Module, module_paths: Sequence[str]) -> list[SiteSpec]:
    """Turn whole ``nn.Linear`` modules (e.g. a classifier head) into latent sites.

    Each becomes a :class:`BatchedLinear` with sites ``<path>.weight`` and ``<path>.bias``.
    """
    sites: list[SiteSpec] = []
    for path in module_paths:
        module = net.get_submodule(path)
        if not isinstance(module, nn.Linear):
            raise TypeError(
                f"latent_modules: {path!r} is a {type(module).__name__}; only nn.Linear modules "
                "can be made latent."
            )
        if isinstance(module, BatchedLinear):  # e.g. one module registered under two names
            raise ValueError(
                f"latent_modules: {path!r} is latent already (as {module.module_path!r}: a "
                "module registered under several names is one module); name it once."
            )
        layer = BatchedLinear.from_linear(module)
        layer.module_path = path
        _set_submodule(net, path, layer)
        for role in ("weight", "bias"):
            p = getattr(layer, role)
            if p is None:
                continue
            p.requires_grad_(False)
            sites.append(SiteSpec(f"{path}.{role}", f"{path}.{role}", path, tuple(p.shape), role))
    return sites
