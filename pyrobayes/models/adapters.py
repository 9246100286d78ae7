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
from typing import Any, NoReturn

import torch
from torch import nn

from ..user_frame import user_stacklevel
from .layers import (
    BatchedLinear,
    LoRALinear,
    LoRAXSLinear,
    base_weight_in_out,
    is_conv1d,
    torch_layer_sequence_first,
    user_forward_hooks,
)
from .projections import PROJECTIONS, InputMoments, collect_input_moments, project

logger = logging.getLogger(__name__)

__all__ = [
    "SiteSpec",
    "LoRA",
    "LoRAXS",
    "find_target_modules",
    "attention_target_modules",
    "IneffectiveCoreWarning",
    "inject_adapter",
    "make_latent",
    "module_path_list",
    "check_real",
    "check_int",
    "check_flag",
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


def check_flag(name: str, value: Any, *, owner: str = "") -> bool:
    """``value`` if it is ``True`` or ``False``, or a ``TypeError`` naming the option ``name``:
    a string such as ``"False"`` is truthy, and ``0``/``None`` would pass as false, choosing a
    form in silence."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{owner}{name} must be True or False; got {value!r} ({type(value).__name__}). "
            f"Pass {name}=True or {name}=False."
        )
    return value


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


#: Modules (``module.qualname`` of a class in the module's MRO) that read some linear children's
#: ``weight`` and ``bias`` themselves and never call them: torchvision's Swin attention passes
#: ``qkv`` and ``proj`` to its ``shifted_window_attention`` (``F.linear`` on the tensors).
_READ_DIRECTLY = {
    "torchvision.models.swin_transformer.ShiftedWindowAttention": ("qkv", "proj"),
}


def _read_directly(path: str, net: nn.Module) -> str | None:
    """How the parent of the linear layer at ``path`` reads its ``weight`` without calling it,
    or ``None`` when it calls it.

    ``nn.MultiheadAttention`` reads ``out_proj.weight`` / ``.bias`` itself
    (``F.multi_head_attention_forward``); torchvision's Swin attention its ``qkv`` and ``proj``
    (:data:`_READ_DIRECTLY`). A layer put there is never run, and a latent weight there holds
    S draws the reader cannot take.
    """
    parent_path, _, child = path.rpartition(".")
    parent = net.get_submodule(parent_path) if parent_path else net
    if child == "out_proj" and isinstance(parent, nn.MultiheadAttention):
        return (
            f"{path!r} is the output projection of the nn.MultiheadAttention {parent_path!r}, "
            "which reads out_proj.weight and out_proj.bias directly and never calls out_proj"
        )
    names = _class_names(parent)
    for reader, children in _READ_DIRECTLY.items():
        if reader in names and child in children:
            return (
                f"{path!r} is the {child} projection of {type(parent).__name__} "
                f"{parent_path!r} (torchvision), which passes {child}.weight and {child}.bias "
                "to F.linear itself and never calls the layer"
            )
    return None


def _unreachable_reason(module: nn.Module, path: str, net: nn.Module) -> str | None:
    """Why an adapter on the linear ``module`` at ``path`` could never act, or ``None``
    (:func:`_read_directly`)."""
    how = _read_directly(path, net)
    if how is None:
        return None
    return (
        f"{how}, so an adapter there could never act. Leave it out of target_modules (a regex "
        "over full paths can skip it), or adapt the linear layers around the attention (a "
        "block's MLP)"
    )


#: Modules (``module.qualname`` of a class in the module's MRO) that call their linear children
#: on sequence-first hidden states ``(T, B, d)``: Longformer's and LED's self-attention
#: transpose the batch's ``(B, T, d)`` before their projections, FSMT keeps ``(T, B, d)``
#: throughout. An adapter there sees the sample-major rows on axis 1, not 0.
_SEQUENCE_FIRST_PARENTS = frozenset(
    {
        "transformers.models.longformer.modeling_longformer.LongformerSelfAttention",
        "transformers.models.led.modeling_led.LEDEncoderSelfAttention",
        "transformers.models.fsmt.modeling_fsmt.Attention",
    }
)


def _sequence_first(net: nn.Module, path: str) -> bool:
    """Whether the module at ``path`` is called on sequence-first inputs ``(T, B, d)``: its
    parent is one of :data:`_SEQUENCE_FIRST_PARENTS` (or a subclass), or torch's
    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` built with
    ``batch_first=False`` (torch's default: its ``linear1`` / ``linear2`` and norms see
    ``(T, B, d)``). A draw per row must then act on axis 1 (:func:`~pyrobayes.models.layers.rows_first`): on axis 0 the S draws would
    split the positions instead, silently when the length is a multiple of S."""
    parent_path = path.rpartition(".")[0]
    parent = net.get_submodule(parent_path) if parent_path else net
    if torch_layer_sequence_first(parent):
        return True
    return not _class_names(parent).isdisjoint(_SEQUENCE_FIRST_PARENTS)


def _class_names(module: nn.Module) -> set[str]:
    """``module.qualname`` of every class in ``module``'s MRO (a subclass counts as its base)."""
    return {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}


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
            stacklevel=user_stacklevel(),
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
            stacklevel=user_stacklevel(),
        )
    return chosen


#: Leaf names of attention query and value projections, by architecture family: BERT's (and
#: ELECTRA's, RoBERTa's, ViT's ...), DistilBERT's and XLM's (FlauBERT), LLaMA-likes' (EuroBERT,
#: CLIP, Whisper), DeBERTa-v2's, Funnel's, MPNet's and T5's, Meta's reference LLaMA's, and the
#: ``to_q`` / ``to_v`` of diffusers and many hand-written attentions. And of fused
#: query-key-value projections: ModernBERT's and MPT's, Phi-3's and CodeGen's, GPT-NeoX's,
#: BLOOM's and Falcon's, GPT-2's, DeBERTa's, timm's and torchvision's Swin ``qkv``,
#: InternLM2's, Baichuan's, and ``to_qkv``.
_QUERY_VALUE_NAMES = (
    ("query", "value"),
    ("q_lin", "v_lin"),
    ("q_proj", "v_proj"),
    ("query_proj", "value_proj"),
    ("q_head", "v_head"),
    ("q", "v"),
    ("wq", "wv"),
    ("to_q", "to_v"),
)
_FUSED_QKV_NAMES = (
    "Wqkv",
    "qkv_proj",
    "query_key_value",
    "c_attn",
    "in_proj",
    "qkv",
    "wqkv",
    "W_pack",
    "to_qkv",
)


def attention_target_modules(net: nn.Module) -> list[str]:
    """The leaf names of ``net``'s attention query and value projections, or of its fused
    query-key-value projections: the modules a LoRA or LoRA-XS adapter without
    ``target_modules`` adapts (peft's default choice per architecture, Hu et al. 2022, Sec. 7.1;
    found here from the names, so an architecture peft's table does not list is covered too).

    Every query/value pair whose two names both name linear layers of ``net`` counts (an
    encoder-decoder or a vision-text model may use two conventions), and every fused
    projection. ``[]`` when there is none (an MLP, a convolutional network).

    Parameters
    ----------
    net : nn.Module

    Returns
    -------
    list of str
        Leaf names, e.g. ``["query", "value"]`` (BERT), ``["q_proj", "v_proj"]`` (LLaMA),
        ``["c_attn"]`` (GPT-2), ``["query_key_value"]`` (GPT-NeoX).

    Examples
    --------
    >>> from torch import nn
    >>> attention = nn.Module()
    >>> attention.q_proj, attention.k_proj, attention.v_proj = (nn.Linear(4, 4) for _ in "qkv")
    >>> attention_target_modules(nn.ModuleDict({"attn": attention, "mlp": nn.Linear(4, 4)}))
    ['q_proj', 'v_proj']
    """
    names = _adaptable_leaf_names(net)
    pairs = [name for pair in _QUERY_VALUE_NAMES if set(pair) <= names for name in pair]
    return pairs + [name for name in _FUSED_QKV_NAMES if name in names]


def _adaptable_leaf_names(net: nn.Module) -> set[str]:
    """The last path components of ``net``'s linear layers an adapter could act on."""
    return {
        path.rsplit(".", 1)[-1]
        for module, paths in _module_aliases(net).values()
        if _is_adaptable(module)
        for path in paths
        if _unreachable_reason(module, path, net) is None
    }


def _default_targets(net: nn.Module) -> list[str]:
    """:func:`attention_target_modules`, logged; an error when ``net`` has none."""
    names = attention_target_modules(net)
    if not names:
        leaf_names = sorted(_adaptable_leaf_names(net))
        raise ValueError(
            f"target_modules was not given, and {type(net).__name__} has no attention query "
            f"and value projections pyrobayes recognises (by name: "
            f"{', '.join('/'.join(pair) for pair in _QUERY_VALUE_NAMES)}, or a fused "
            f"{'/'.join(_FUSED_QKV_NAMES)}), which are what the default adapts. Name the "
            f"modules to adapt: target_modules=[...] from its linear layers {leaf_names[:12]}"
            f"{' ...' if len(leaf_names) > 12 else ''} (a list of names, each matching a path "
            "or its dot-separated suffix, or a regex over full paths)." + _unwrappable_hint(net)
        )
    logger.info(
        "target_modules not given: adapting %s's attention projections %s.",
        type(net).__name__,
        names,
    )
    return names


def _unwrappable_hint(net: nn.Module) -> str:
    """Why ``net``'s attention has no projection an adapter can wrap, when it has one: an
    ``nn.MultiheadAttention`` (one in-projection parameter), or projections the attention reads
    without calling them (:func:`_read_directly`); ``""`` otherwise."""
    for path, module in net.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            return (
                f" Its attention {path!r} is an nn.MultiheadAttention, whose query, key and "
                "value projection is one parameter (in_proj_weight), not a layer an adapter can "
                "wrap, and whose out_proj it never calls: adapt the linear layers around it "
                "(nn.TransformerEncoderLayer's feed-forward 'linear1' and 'linear2')."
            )
        how = _read_directly(path, net) if _is_adaptable(module) else None
        if how is not None:
            return (
                f" Its attention's projections cannot be adapted: {how}. Adapt the linear "
                "layers around the attention (a block's MLP)."
            )
    return ""


def _attention_hint(net: nn.Module) -> str:
    """The default's targets (:func:`attention_target_modules`) named for an error whose
    targets matched nothing; ``""`` if ``net`` has none."""
    found = attention_target_modules(net)
    if not found:
        return ""
    fused = [name for name in found if name in _FUSED_QKV_NAMES]
    what = (
        f"computes attention queries, keys and values in one projection, {fused[0]!r}"
        if fused == found
        else f"names its attention query and value projections {found}"
    )
    return (
        f" {type(net).__name__} {what}: target_modules={found!r} adapts them (leave "
        "target_modules out for exactly these)."
    )


def _no_match_hint(net: nn.Module, target_modules: Any) -> str:
    """More for the "matched no linear module" error: the network's attention projections
    (:func:`_attention_hint`), peft's ``"all-linear"``, which is no regex here, and a network
    that is itself the one linear layer (no path to name)."""
    if target_modules != "all-linear" and not _is_adaptable(net):
        return _attention_hint(net)
    if target_modules == "all-linear":
        return (
            " 'all-linear' is peft's special value (every linear layer but the output layer), "
            "which pyrobayes does not expand: name the modules (a list, or a regex such as "
            "r'.*\\.(query|key|value)'), or wrap the network with peft.get_peft_model(net, "
            "LoraConfig(target_modules='all-linear', ...)) and pass that peft model, whose "
            "adapted modules are imported as they are."
        )
    if _is_adaptable(net):
        return (
            f" The network itself is the {type(net).__name__}, which has no path to name: wrap "
            "it, nn.Sequential(net), and target '0'."
        )
    return ""


def find_target_modules(net: nn.Module, target_modules: Sequence[str] | str | None) -> list[str]:
    """Paths of the linear modules of ``net`` that ``target_modules`` selects.

    A list matches a module whose path equals an entry or ends with ``"." + entry`` (peft's rule);
    a string is a regular expression that must match the whole path; ``None`` (an adapter's
    default) selects the attention query and value projections,
    :func:`attention_target_modules`. A module registered under
    several names (``net.dec = net.enc``) is selected when any of its names matches and is
    returned once, under its first name (the one ``named_modules()`` gives); the adapter layer
    then replaces it under every name.

    Raises
    ------
    ValueError
        When nothing matches (the message lists the candidate module names; for ``None``, when
        ``net`` has no attention projection pyrobayes recognises by name); when a list entry
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
    if target_modules is None:
        target_modules = _default_targets(net)
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
            + _no_match_hint(net, target_modules)
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


def _is_collection(value: Any) -> bool:
    """``value`` can list names: iterable, and neither ``None``, bytes nor a dict."""
    return (
        value is not None
        and not isinstance(value, (bytes, bytearray, dict))
        and isinstance(value, Iterable)
    )


def _checked_targets(value: Any, owner: str) -> Sequence[str] | str | None:
    """An adapter's ``target_modules``: ``None`` (the default: the attention projections), a
    regex (str) as it is, a list or tuple of module names checked, a set as a sorted list (a
    fixed order for saved files); anything else refused."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as err:  # not a ValueError: it escaped as a bare traceback
            raise ValueError(
                f"{owner}target_modules {value!r} is a regex over full module paths that does "
                f"not compile ({err}); escape the special characters (re.escape), or pass a "
                "list of module names."
            ) from None
        return value
    if not _is_collection(value):
        raise TypeError(
            f"{owner}target_modules must be a list of module names (each matching a path or "
            "its dot-separated suffix) or a regex over full module paths (str); got "
            f"{value!r} ({type(value).__name__})."
        )
    names = module_path_list("target_modules", value, owner=owner)
    if isinstance(value, (list, tuple)):
        return value
    return sorted(names) if isinstance(value, (set, frozenset)) else names


@dataclass
class LoRA:
    """LoRA adapter: ``W = W0 + (α/r) B A`` with ``A ∈ R^{r×d_in}``, ``B ∈ R^{d_out×r}``.

    Parameters
    ----------
    rank : int
        r, the adapter rank.
    alpha : float, optional
        Scaling numerator; defaults to ``rank`` (scaling 1).
    target_modules : list of str or str, optional
        Module names (suffix match) or a regex over full module paths. By default the
        network's attention query and value projections, found by their names
        (:func:`attention_target_modules`: ``query``/``value`` on BERT, ``q_proj``/``v_proj``
        on LLaMA, the fused ``c_attn`` on GPT-2, ...), as Hu et al. (2022, Sec. 7.1) adapt.
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
    target_modules: Sequence[str] | str | None = None
    latent: str = "AB"
    kind: str = field(default="lora", init=False)

    def __post_init__(self) -> None:
        self.rank = check_int("rank", self.rank, ge=1, owner="LoRA: ")
        self.target_modules = _checked_targets(self.target_modules, "LoRA: ")
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
        ranks or scalings, ``lora_bias``'s bias on ``B``, ``trainable_token_indices``' trained
        embedding rows, peft's default targets). ``scoped``: the caller resolves which modules
        peft adapted (a peft model's own layers, whose ``unload()`` keeps its trained
        ``modules_to_save`` and biases), so ``layers_to_transform``, ``layers_pattern``,
        ``exclude_modules``, ``modules_to_save``, ``bias`` and ``init_lora_weights`` are taken
        care of; without it they are refused too (name the modules to train beside the adapter
        in ``FineTuneModel(trainable_modules=[...])``; an initialisation other than peft's
        default or ``"gaussian"`` is peft's to apply: wrap the network with peft first).
        """
        settings: list[tuple[str, Any]] = [
            ("use_rslora", getattr(config, "use_rslora", False)),
            ("use_dora", getattr(config, "use_dora", False)),
            ("rank_pattern", getattr(config, "rank_pattern", None)),
            ("alpha_pattern", getattr(config, "alpha_pattern", None)),
            ("lora_bias", getattr(config, "lora_bias", False)),
            ("trainable_token_indices", getattr(config, "trainable_token_indices", None)),
        ]
        # peft's default initialisation (B = 0, A random; "gaussian" draws A otherwise) is
        # pyrobayes' own; the others rewrite the base weights (PiSSA, OLoRA, LoftQ), read data
        # (EVA, CorDA) or start B away from 0 (False): peft applies them when it wraps a model
        init = getattr(config, "init_lora_weights", True)
        if not scoped:  # a peft model's own modules_to_save and biases are kept by its unload()
            settings += [
                (name, getattr(config, name, None))
                for name in ("layers_to_transform", "layers_pattern", "exclude_modules")
            ]
            bias = getattr(config, "bias", "none")
            settings += [
                ("modules_to_save", getattr(config, "modules_to_save", None)),
                ("bias", None if bias in (None, "none") else bias),
            ]
        unsupported = [f"{name}={value!r}" for name, value in settings if value]
        if not scoped and init is not True and init != "gaussian":
            unsupported.append(f"init_lora_weights={init!r}")
        if unsupported:
            raise ValueError(
                f"LoRA.from_peft: the LoraConfig sets {', '.join(unsupported)}, which pyrobayes' "
                "LoRA (W0 + (alpha/r) B A, one rank and alpha for every targeted module, no bias "
                "of its own) does not represent; importing it would silently change the adapted "
                "function or leave trained parts out. Use a plain LoraConfig (and target_modules "
                "naming exactly the modules to adapt); modules to train beside the adapter (peft's "
                "modules_to_save, or a layer whose bias peft would train) are named in "
                "FineTuneModel(trainable_modules=[...]). A trained peft model with such settings: "
                "pass peft_model.merge_and_unload() (its adapter folded into the weights) with a "
                "fresh adapter."
            )
        targets = config.target_modules
        if targets is None:  # peft's per-architecture table is not always the attention's
            raise ValueError(
                "LoRA.from_peft: the LoraConfig has target_modules=None (peft picks defaults "
                "per model type when it wraps a model, e.g. q_proj, v_proj, fc1 and fc2 on "
                "Phi); name the modules, or pass the peft-wrapped model itself. pyrobayes' "
                "LoRA() without target_modules adapts the attention query and value "
                "projections found by name (pyrobayes.models.adapters.attention_target_modules)."
            )
        if isinstance(targets, set):
            targets = sorted(targets)
        return cls(rank=int(config.r), alpha=float(config.lora_alpha), target_modules=targets)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "rank": self.rank,
            "alpha": self.alpha,
            "target_modules": _targets_to_dict(self.target_modules),
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
    target_modules : list of str or str, optional
        Module names (suffix match) or a regex over full module paths; by default the
        network's attention query and value projections (:func:`attention_target_modules`).
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
    target_modules: Sequence[str] | str | None = None
    init_scale: float = 1e-5
    moment: str = "centered"
    seed: int = 0
    kind: str = field(default="lora_xs", init=False)

    def __post_init__(self) -> None:
        self.rank = check_int("rank", self.rank, ge=1, owner="LoRAXS: ")
        self.target_modules = _checked_targets(self.target_modules, "LoRAXS: ")
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
            "target_modules": _targets_to_dict(self.target_modules),
            "init_scale": self.init_scale,
            "moment": self.moment,
            "seed": self.seed,
        }


def _targets_to_dict(targets: Sequence[str] | str | None) -> list[str] | str | None:
    """``target_modules`` as a saved file holds it (a list, a regex, or ``None``)."""
    return targets if targets is None or isinstance(targets, str) else list(targets)


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
        layer.sequence_first = _sequence_first(net, path)
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
        stacklevel=user_stacklevel(),
    )


def _wsvd_covariances(
    moments: dict[str, InputMoments], moment: str, max_batches: int | None
) -> dict[str, torch.Tensor]:
    """Each targeted layer's input covariance for W-SVD, or an error naming the layer and the
    calibration argument when the calibration batches gave it too few rows."""
    out: dict[str, torch.Tensor] = {}
    for path, m in moments.items():
        need = 2 if moment == "centered" else 1
        if m.n < need:
            if m.n == 0:
                what = (
                    "no input rows: calibration_data yielded no batch (it is empty or "
                    "exhausted, e.g. a generator already consumed)"
                    if max_batches is None
                    else f"no input rows from calibration_data (max_calibration_batches="
                    f"{max_batches})"
                )
            else:
                what = f"{m.n} input row (the batches' unmasked rows reaching it)"
            raise ValueError(
                f"LoRAXS(projection='wsvd'): the targeted layer {path!r} got {what}, but the "
                f"{moment} input covariance of W-SVD needs at least {need}. Pass calibration_"
                "data with more rows (e.g. the training DataLoader), or another projection "
                "(projection='svd')."
            )
        out[path] = m.covariance(moment=moment)
    return out


def _check_xs_rank(net: nn.Module, rank: int, paths: list[str]) -> None:
    """Refuse a LoRA-XS rank above ``min(d_in, d_out)`` of a targeted layer, naming them."""
    dims = {
        path: tuple(int(n) for n in base_weight_in_out(net.get_submodule(path)).shape)
        for path in paths
    }
    too_small = {path: d for path, d in dims.items() if rank > min(d)}
    if too_small:
        listed = ", ".join(f"{p!r} (d_in={i}, d_out={o})" for p, (i, o) in too_small.items())
        raise ValueError(
            f"LoRAXS(rank={rank}) exceeds the smaller dimension of {listed}: an r x r "
            "core needs r <= min(d_in, d_out). Lower the rank to at most "
            f"{min(min(d) for d in too_small.values())}, or leave these layers out of "
            "target_modules."
        )


class IneffectiveCoreWarning(UserWarning):
    """A LoRA-XS core some of whose directions cannot change the output: the frozen bases
    built from a zero or rank-deficient weight span fewer than ``r`` dimensions, so the
    posterior over those directions stays the prior."""


#: Singular values of a LoRA-XS base below this fraction of its largest count as zero.
_DEAD_BASE_RTOL = 1e-6


def _base_rank(basis: torch.Tensor) -> int:
    """The numerical rank of a frozen LoRA-XS base (0 for a zero one)."""
    sv = torch.linalg.svdvals(basis.detach().to(torch.float64))
    top = float(sv.max()) if sv.numel() else 0.0
    return int((sv > _DEAD_BASE_RTOL * top).sum()) if top > 0 else 0


def _warn_if_core_spans_less(path: str, a: torch.Tensor, b: torch.Tensor, adapter: LoRAXS) -> None:
    """Warn when ``ΔW = A R B`` (``A`` ``(d_in, r)``, ``B`` ``(r, d_out)``) leaves directions of
    the ``r × r`` core ``R`` without effect: ``r² − rank(A) rank(B)`` of them."""
    r = adapter.rank
    rank_a, rank_b = _base_rank(a), _base_rank(b)
    if rank_a == r and rank_b == r:
        return
    dead = r * r - rank_a * rank_b
    usable = min(rank_a, rank_b)
    fix = (
        f"Lower the rank to {usable}, or leave {path!r} out of target_modules"
        if usable
        else f"Leave {path!r} out of target_modules"
    )
    warnings.warn(
        f"LoRAXS(projection={adapter.projection!r}, rank={r}): the frozen bases of {path!r} "
        f"span {rank_a} x {rank_b} of the {r} x {r} core (its weight is zero or of rank below "
        f"{r}), so {dead} of the core's {r * r} directions never change the output and their "
        f"posterior stays the prior. {fix} (LoRA's factors do not depend on the weight).",
        IneffectiveCoreWarning,
        stacklevel=user_stacklevel(),
    )


def _warn_if_hooked(net: nn.Module, paths: list[str]) -> None:
    """Warn about targeted layers with forward hooks or pre-hooks: the adapter wraps the layer,
    so they stay on its frozen base and act on ``W0 x`` alone."""
    hooked = [p for p in paths if user_forward_hooks(net.get_submodule(p))]
    if not hooked:
        return
    listed = ", ".join(repr(p) for p in hooked[:4]) + (" ..." if len(hooked) > 4 else "")
    warnings.warn(
        f"target_modules selects {listed}, with forward hook(s) or pre-hook(s) registered on "
        f"the layer: the adapter wraps it, so they stay on its frozen base ('{hooked[0]}.base'): "
        "a forward hook sees (and changes) the base's output W0 x alone, not the adapter's "
        "update ΔW x added after it, and a pre-hook changes the base's input only. To act on "
        "the whole adapted layer, remove them before building the model and register them on "
        f"model.net.get_submodule({hooked[0]!r}) after (pyrobayes.models.merged_network "
        "refuses to merge a base layer that keeps hooks).",
        UserWarning,
        stacklevel=user_stacklevel(),
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
    _warn_if_hooked(net, paths)
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
        covariances = _wsvd_covariances(moments, adapter.moment, max_calibration_batches)
    _check_xs_rank(net, adapter.rank, paths)
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
        _warn_if_core_spans_less(path, a, b, adapter)
        down = a.T.to(dtype=w0.dtype, device=w0.device)
        up = b.T.to(dtype=w0.dtype, device=w0.device)
        xs_layer = LoRAXSLinear(
            base, down, up, scaling=adapter.scaling, init_scale=adapter.init_scale
        )
        xs_layer.core.module_path = path  # named by its errors
        xs_layer.sequence_first = _sequence_first(net, path)
        _set_submodule(net, path, xs_layer)
        sites.append(SiteSpec(f"{path}.core", f"{path}.core.weight", path, (rank, rank), "core"))
    return sites


def module_path_list(name: str, value: Any, *, owner: str = "", also: str = "") -> list[str]:
    """``value``, one module path or a collection of them, as a list of paths; or an error
    naming the argument ``name``.

    A single string is one path (``latent_modules="classifier"``), never split into characters.

    Parameters
    ----------
    name : str
        The argument's name, as the caller spells it (``"latent_modules"``).
    value : Any
    owner : str
        Prefix of the message, e.g. ``"FineTuneModel: "``.
    also : str
        Other accepted values named in the message (``"'auto', "``).

    Returns
    -------
    list of str

    Raises
    ------
    TypeError
        ``value`` is not a string or a collection (``None``, a number, bytes), or an entry is
        not a string.
    ValueError
        An entry is ``""``: the network itself, which has no path to name.
    """
    if isinstance(value, str):
        return [value] if value else _root_path_error(name, owner)
    if not _is_collection(value):
        raise TypeError(
            f"{owner}{name} must be {also}a module path (str) or a list of them ([] for none); "
            f"got {value!r} ({type(value).__name__})."
        )
    items = list(value)
    for item in items:
        if not isinstance(item, str):
            hint = f" (write {str(item)!r})" if isinstance(item, int) else ""
            raise TypeError(
                f"{owner}{name} entries must be module paths (str); got {item!r} "
                f"({type(item).__name__}){hint} in {name}={items!r}."
            )
        if not item:
            _root_path_error(name, owner)
    return items


def _root_path_error(name: str, owner: str) -> NoReturn:
    """Raise: ``""`` names the network itself, whose attributes a layer cannot replace."""
    raise ValueError(
        f"{owner}{name} names '' (the network itself), which cannot be replaced from inside: "
        "name its submodules by path (e.g. '0', 'classifier'); a network that is one layer, "
        "wrap it first: nn.Sequential(net), then name '0'."
    )


def _latent_candidate(net: nn.Module, path: str) -> nn.Linear:
    """The ``nn.Linear`` at ``path`` that :func:`make_latent` may convert, or an error naming
    ``path`` and why not (nothing is changed yet)."""
    try:
        module = net.get_submodule(path)
    except AttributeError:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in net.named_modules() if n})
        close = difflib.get_close_matches(path.rsplit(".", 1)[-1], names, n=3)
        raise ValueError(
            f"latent_modules: {path!r} is no module of {type(net).__name__}"
            + (f" (did you mean {close}?)" if close else "")
            + "; name nn.Linear modules by their full path (as in net.named_modules())."
        ) from None
    parts = path.split(".")
    for i in range(len(parts), -1, -1):  # the module itself, then its ancestors
        where = ".".join(parts[:i])
        adapted = net.get_submodule(where)
        if isinstance(adapted, (LoRALinear, LoRAXSLinear)):
            what = "is" if where == path else f"sits inside the {type(adapted).__name__} {where!r},"
            raise ValueError(
                f"latent_modules: {path!r} {what} an adapted layer (its frozen base and its "
                "adapter factors belong to the adapter), which cannot also be made latent. "
                f"Remove {path!r} from latent_modules, or {where!r} from target_modules."
            )
    if isinstance(module, BatchedLinear):  # e.g. one module registered under two names
        raise ValueError(
            f"latent_modules: {path!r} is latent already (as {module.module_path!r}: a "
            "module registered under several names is one module); name it once."
        )
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"latent_modules: {path!r} is a {type(module).__name__}; only nn.Linear modules "
            "can be made latent."
        )
    if module._parameters.get("weight") is not module.weight:  # parametrize / weight_norm
        raise ValueError(
            f"latent_modules: the weight of {path!r} is computed by a parametrization "
            "(torch.nn.utils.parametrize, weight_norm), which a latent weight would bypass. "
            "Turn it into a plain weight first: torch.nn.utils.parametrize."
            f"remove_parametrizations(net.get_submodule({path!r}), 'weight') (the older "
            "torch.nn.utils.weight_norm: torch.nn.utils.remove_weight_norm)."
        )
    how = _read_directly(path, net)
    if how is not None:
        raise ValueError(
            f"latent_modules: {how}, so S draws of a latent weight there would reach a function "
            f"that takes one matrix. Remove {path!r} from latent_modules, or make latent the "
            "linear layers around the attention (a block's MLP, the head)."
        )
    if type(module).forward is not nn.Linear.forward:
        raise TypeError(
            f"latent_modules: {path!r} is a {type(module).__name__}, an nn.Linear subclass with "
            "a forward of its own, which the latent layer (a plain x W^T + b per draw) would "
            "drop, changing the network. Only nn.Linear layers computing x W^T + b can be "
            "made latent; leave it out of latent_modules."
        )
    return module


def make_latent(net: nn.Module, module_paths: Sequence[str] | str) -> list[SiteSpec]:
    """Turn whole ``nn.Linear`` modules (e.g. a classifier head) into latent sites.

    Each becomes a :class:`BatchedLinear` with sites ``<path>.weight`` and ``<path>.bias``.
    Every path is checked before any module is converted, so a refused call changes nothing.

    Parameters
    ----------
    net : nn.Module
    module_paths : list of str or str
        Full module paths; a single string is one path.

    Returns
    -------
    list of SiteSpec

    Raises
    ------
    TypeError
        A path is not a string, or names a module other than a plain ``nn.Linear`` (an
        ``nn.Linear`` subclass with its own ``forward`` included).
    ValueError
        A path names no module, the network itself (``""``), a module named twice, a module
        latent already, an adapted layer or a module inside one, or a parametrized layer.
    """
    paths = module_path_list("latent_modules", module_paths)
    seen: dict[int, str] = {}
    for path in paths:
        module = _latent_candidate(net, path)
        if id(module) in seen:
            raise ValueError(
                f"latent_modules: {path!r} is latent already (as {seen[id(module)]!r}: the same "
                "module, a module registered under several names being one module); name it "
                "once."
            )
        seen[id(module)] = path
    sites: list[SiteSpec] = []
    for path in paths:
        layer = BatchedLinear.from_linear(net.get_submodule(path))  # type: ignore[arg-type]
        layer.module_path = path
        layer.sequence_first = _sequence_first(net, path)
        _set_submodule(net, path, layer)
        for role in ("weight", "bias"):
            p = getattr(layer, role)
            if p is None:
                continue
            p.requires_grad_(False)
            sites.append(SiteSpec(f"{path}.{role}", f"{path}.{role}", path, tuple(p.shape), role))
    return sites
