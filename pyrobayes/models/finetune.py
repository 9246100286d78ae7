r"""``FineTuneModel``: a Pyro model over the adapter parameters of a pretrained network.

.. math::

    θ_l \sim \mathcal N(0, s_p^2 I) \text{ for each adapter site } l, \qquad
    y_i \mid x_i, θ \sim p(y_i \mid f(x_i; θ)),\ i \in \text{plate("data", N, subsample=B)}

The frozen backbone is held outside Pyro (never in the param store, never changed); the sampled
adapter values are swapped into the network for the duration of one forward (as
``torch.func.functional_call`` does, through cached slots). Other trainable parts
(a classifier head) are point estimates registered with ``pyro.param`` unless made latent.
With ``likelihood="gaussian", obs_scale="learn"`` the observation noise is one more point
parameter, ``σ = softplus(ρ)``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor, nn

from ..batch import batch_size, split_batch, token_mask
from .adapters import (
    LoRA,
    LoRAXS,
    SiteSpec,
    check_int,
    check_real,
    inject_adapter,
    make_latent,
    module_path_list,
)
from .draw_forward import NOISE_PARAM, DrawForward
from .layers import BatchedLinear, LoRALinear, LoRAXSLinear
from .likelihoods import Gaussian, Likelihood, OutputKey, make_likelihood
from .net_checks import (
    HEAD_NAMES,
    PADDING_CHECKS,
    _check_pad_token,
    _check_pooled_padding,
    _check_problem_type,
    _refuse_checkpointing,
    _set_backbone_mode,
    _unfuse_transformer_layers,
    _unwrap_network,
    _warn_if_output_frozen_at_zero,
    pools_last_non_pad,
    task_head_modules,
)
from .peft_import import _peft_to_pyrobayes, _warn_if_dropout

logger = logging.getLogger(__name__)

__all__ = ["FineTuneModel", "HEAD_NAMES", "NOISE_PARAM", "task_head_modules"]

_INSTANCES = itertools.count()


def _make_likelihood(
    likelihood: str | Likelihood, obs_scale: float | str | None, choice_token_ids: Any
) -> Likelihood:
    """``FineTuneModel``'s likelihood; an ``obs_scale`` without a Gaussian is refused."""
    lik_kwargs: dict[str, Any] = {}
    if likelihood == "gaussian":
        lik_kwargs["obs_scale"] = 1.0 if obs_scale is None else obs_scale
    elif obs_scale is not None:  # never ignored: σ belongs to the Gaussian likelihood only
        name = likelihood if isinstance(likelihood, str) else type(likelihood).__name__
        raise ValueError(
            f"FineTuneModel: obs_scale={obs_scale!r} is the noise σ of a Gaussian likelihood "
            f"but likelihood={name!r} has none, so it would be ignored. Drop obs_scale, or "
            "pass likelihood='gaussian' (a Gaussian instance carries its own obs_scale)."
        )
    if likelihood == "multiple_choice":
        lik_kwargs["choice_token_ids"] = choice_token_ids  # None: choices as continuations
    return make_likelihood(likelihood, **lik_kwargs)


def _check_module_arguments(
    trainable_modules: Any, latent_modules: Any
) -> tuple[list[str] | str, list[str]]:
    """``trainable_modules`` (``"auto"`` as it is) and ``latent_modules`` (``None``: none) as
    lists of module paths, a single string being one path; checked before the network is
    changed (:func:`~pyrobayes.models.adapters.module_path_list`)."""
    trainable: list[str] | str = "auto"
    if not (isinstance(trainable_modules, str) and trainable_modules == "auto"):
        trainable = module_path_list(
            "trainable_modules", trainable_modules, owner="FineTuneModel: ", also="'auto', "
        )
    if latent_modules is None:
        return trainable, []
    return trainable, module_path_list("latent_modules", latent_modules, owner="FineTuneModel: ")


def _check_calibration(max_calibration_batches: Any) -> int | None:
    """``max_calibration_batches`` checked: ``None`` or a positive integer (without
    ``calibration_data`` it limits nothing, as for an adapter that reads none)."""
    if max_calibration_batches is None:
        return None
    return check_int(
        "max_calibration_batches", max_calibration_batches, ge=1, owner="FineTuneModel: "
    )


def _resolve_adapter(
    net: nn.Module, adapter: Any, latent_modules: list[str]
) -> tuple[nn.Module, Any, dict[str, Tensor]]:
    """The network and adapter to build on: the network inside a ``torch.compile`` or data
    parallel wrapper (:func:`~pyrobayes.models.net_checks._unwrap_network`), a peft model taken
    apart (its base network, its LoRA as a :class:`LoRA` and its trained weights), a
    ``peft.LoraConfig`` converted, and a network that already holds pyrobayes layers refused."""
    net = _unwrap_network(net)
    _refuse_adapted_network(net)
    peft_weights: dict[str, Tensor] = {}
    if hasattr(net, "peft_config") and hasattr(net, "unload"):
        net, adapter, peft_weights = _peft_to_pyrobayes(net, adapter)
    elif adapter is not None and type(adapter).__name__ == "LoraConfig":
        _warn_if_dropout(adapter, "adapter=LoraConfig(...)", "pass it with lora_dropout=0")
        adapter = LoRA.from_peft(adapter)
    if adapter is None and not latent_modules:
        raise ValueError(
            "FineTuneModel needs something to be Bayesian about: pass adapter=LoRAXS(...) or "
            "LoRA(...), or latent_modules=[...] naming nn.Linear modules."
        )
    return net, adapter, peft_weights


def _refuse_adapted_network(net: nn.Module) -> None:
    """Refuse a network an earlier :class:`FineTuneModel` adapted (it changes its network in
    place): its adapter, latent and member-norm layers would be taken for pretrained ones."""
    from .signorm import MemberNorm  # (signorm imports this module)

    found: list[str] = []
    for path, m in net.named_modules():
        inside = any(path.startswith(f + ".") for f in found)
        if not inside and isinstance(m, (LoRALinear, LoRAXSLinear, BatchedLinear, MemberNorm)):
            found.append(path)
    if found:
        listed = ", ".join(f"{p!r} ({type(net.get_submodule(p)).__name__})" for p in found[:3])
        raise ValueError(
            f"FineTuneModel: the network already holds pyrobayes layers ({listed}"
            f"{' ...' if len(found) > 3 else ''}): an earlier FineTuneModel was built on it, and "
            "FineTuneModel modifies the network it is given in place. Build each model from a "
            "fresh copy of the pretrained network (copy.deepcopy(net) before the first model, "
            "or load it again with from_pretrained)."
        )


def _check_tied_sites(
    net: nn.Module,
    names: Sequence[str],
    latent: Iterable[str],
    point_params: Mapping[str, nn.Parameter],
    owner: str = "FineTuneModel",
) -> None:
    r"""Check the latent sites' tensors ``names`` (parameter names in ``net``) for tied weights:
    the same ``nn.Parameter`` used by another module too, as a Hugging Face causal LM's output
    head tied to its input embeddings (``tie_word_embeddings=True``).

    A draw replaces a site's tensor in the site's own module only (its cached slot), so the
    other module keeps using the stored tensor:

    * tied to a frozen module, that is the last-layer convention (laplace-torch's last-layer
      Laplace, Daxberger et al. 2021): the features, the embeddings included, stay fixed at
      their trained values and only the head's use of the weight is latent. Allowed, with a
      logged note naming both uses;
    * tied to a point parameter (``trainable_modules`` lists the other module), the tensor
      would be both trained in place by the optimizer and the site's starting value and
      prior-centred slot: the tie is broken inside the model in silence (the embeddings move
      with training, the head follows its draws) and the site's initial value moves with
      training. Refused;
    * tied to another latent site, each draw would give the two uses independent values and
      the prior would count the tensor twice. Refused.

    ``latent`` are all the latent sites' parameter names (``names`` included).

    Raises
    ------
    ValueError
        Naming the site's module, the other module and what to do: leave the other module
        frozen, or untie the weights before building the model.
    """
    aliases: dict[int, list[str]] = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    latent = set(latent)
    for name in names:
        param = net.get_parameter(name)
        others = [n for n in aliases.get(id(param), []) if n != name]
        if not others:
            continue
        path = name.rpartition(".")[0]
        trained = [n for n, p in point_params.items() if p is param and n != name]
        clash = trained or [n for n in others if n in latent]
        if clash:
            other = clash[0].rpartition(".")[0]
            role = "a point parameter (trainable_modules)" if trained else "another latent site"
            raise ValueError(
                f"{owner}: the latent site {name!r} (module {path!r}) is the same tensor as "
                f"{clash[0]!r} of module {other!r}, {role}: tied weights (an output head tied "
                "to the input embeddings, tie_word_embeddings=True). A draw replaces the "
                f"weight in {path!r} only, so the tie would be broken inside the model in "
                f"silence. Leave {other!r} frozen (out of trainable_modules / latent_modules: "
                "only the head's use of the weight is then latent, as in last-layer Laplace), "
                "or untie the weights and build the model from a fresh copy of the network (this "
                "one was changed in place): "
                f"net.get_submodule({path!r}).weight = "
                f"nn.Parameter(net.get_submodule({path!r}).weight.detach().clone()) (and, in a "
                "Hugging Face model, net.config.tie_word_embeddings = False)."
            )
        logger.info(
            "%s: the latent site %r is the same tensor as the frozen %s (tied weights), which "
            "keep its stored value in every draw: only its use in module %r is latent (the "
            "last-layer convention, features fixed; untie the weights to change that).",
            owner,
            name,
            others,
            path,
        )


def _one_name_per_tensor(
    net: nn.Module, chosen: dict[str, nn.Parameter]
) -> dict[str, nn.Parameter]:
    r"""``chosen`` with one entry per ``nn.Parameter``: a tensor that two chosen modules share
    (tied weights, e.g. ``trainable_modules=["embed_tokens", "lm_head"]`` with
    ``tie_word_embeddings=True``) is kept under its first name in network order, once.

    Listed twice it would reach the optimizer twice, which steps it twice per iteration
    (torch warns "duplicate parameters"), and be stored twice in a saved posterior.
    """
    order = {n: i for i, (n, _) in enumerate(net.named_parameters(remove_duplicate=False))}
    kept: dict[int, str] = {}
    for name, param in chosen.items():
        first = kept.get(id(param))
        if first is None or order.get(name, math.inf) < order.get(first, math.inf):
            kept[id(param)] = name
    dropped = sorted(n for n, p in chosen.items() if kept[id(p)] != n)
    if dropped:
        logger.info(
            "FineTuneModel: the point parameters %s are tied to (the same tensor as) %s, which "
            "is trained once, under that name.",
            dropped,
            sorted({kept[id(chosen[n])] for n in dropped}),
        )
    return {n: p for n, p in chosen.items() if kept[id(p)] == n}


def _check_tied_adapter_bases(
    net: nn.Module, adapted: Iterable[str], point_params: Mapping[str, nn.Parameter]
) -> None:
    r"""Refuse an adapted layer whose frozen base weight is the same tensor as a point
    parameter: a LoRA / LoRA-XS target tied to a trained module (an output head tied to the
    input embeddings, ``tie_word_embeddings=True``, with the embeddings in
    ``trainable_modules``). The optimizer would train the adapter's "frozen" base in place,
    and LoRA-XS's bases, computed once from it, would go stale.

    Raises
    ------
    ValueError
        Naming the adapted module, the trained module and what to do.
    """
    trained = {id(p): n for n, p in point_params.items()}
    for path in sorted(adapted):
        base = getattr(net.get_submodule(path), "base", None)
        if not isinstance(base, nn.Module):
            continue
        for pname, param in base.named_parameters():
            other = trained.get(id(param))
            if other is None:
                continue
            module = other.rpartition(".")[0]
            raise ValueError(
                f"FineTuneModel: the adapted module {path!r} (target_modules) is built on the "
                f"frozen weight {f'{path}.{pname}'!r}, which is the same tensor as {other!r} of "
                f"module {module!r}, a point parameter (trainable_modules): tied weights (an "
                "output head tied to the input embeddings, tie_word_embeddings=True). The "
                "optimizer would train the adapter's frozen base weight in place (and LoRA-XS's "
                f"bases, computed from it, would go stale). Freeze {module!r} (remove it from "
                f"trainable_modules), leave {path!r} out of target_modules, or untie the "
                "weights and build the model from a fresh copy of the network (this one was "
                f"changed in place): net.get_submodule({path!r}).{pname} = nn.Parameter("
                f"net.get_submodule({path!r}).{pname}.detach().clone()) (and, in a Hugging "
                "Face model, net.config.tie_word_embeddings = False)."
            )


class FineTuneModel(DrawForward, nn.Module):
    r"""Pyro model over the adapter (or LoRA-XS core) parameters of a network.

    Parameters
    ----------
    net : nn.Module
        A Hugging Face model, a plain ``nn.Module``, or a ``peft.PeftModel`` with LoRA adapters
        (its trained LoRA weights become the starting point). Modified in place: targeted
        modules are replaced by pyrobayes adapter layers; all original weights are frozen
        (whatever their ``requires_grad``: ``trainable_modules`` decides what trains). A
        network inside ``torch.compile``'s, ``nn.DataParallel``'s or
        ``DistributedDataParallel``'s wrapper is run unwrapped, with a warning.
    adapter : LoRA or LoRAXS or peft.LoraConfig, optional
        Which adapter to inject. ``None`` with ``latent_modules`` gives a Bayesian network over
        whole linear layers (e.g. a small MLP).
    likelihood : {"categorical", "gaussian", "multiple_choice", "bernoulli"} or Likelihood
        ``"bernoulli"`` (alias ``"multilabel"``): multi-label classification, a logit and a 0/1
        target per label.
    prior_scale : float
        ``s_p`` of the isotropic prior ``N(0, s_p² I)`` on every latent site.
    num_data : int, optional
        N, the training-set size; the data plate scales minibatch log-likelihoods by N/B.
        Needed to fit a posterior whose objective is weighted by N/B (the ELBO, and the MAP
        training of SWAG and Laplace): without it their fitters refuse to start. MAP
        (``DeltaGuide``) and IVON with an explicit ``ess`` fit without it.
    trainable_modules : list of str or "auto"
        Module paths (suffix match) whose parameters are point-estimated (``pyro.param``).
        ``"auto"`` picks the task head (:func:`task_head_modules`): modules named
        ``classifier``, ``score``, ``qa_outputs`` or ``pre_classifier``, and in a Hugging Face
        task model every module outside the base model but the output embeddings (the layers
        ``from_pretrained`` initialises fresh, e.g. DeBERTa's ``pooler``), less the layers that
        are latent (``latent_modules``, σN member heads) or adapted: a composite head such as
        RoBERTa's ``classifier`` with ``latent_modules=["classifier.out_proj"]`` trains
        ``classifier.dense``.
    latent_modules : list of str or str
        ``nn.Linear`` modules whose weight and bias become latent sites instead (full paths; a
        single string is one path). A plain ``nn.Linear`` only: a subclass with a forward of
        its own, a parametrized layer (``weight_norm``) and an adapted layer or a module inside
        one are refused.
    obs_scale : float or "learn", optional
        Only with ``likelihood="gaussian"`` (any other likelihood refuses it; default σ = 1):
        σ of the Gaussian likelihood, or ``"learn"``: :math:`σ = \operatorname{softplus}(ρ)`
        with ``ρ`` a point-estimated parameter (``point_params["likelihood.raw_scale"]``,
        starting at σ = 1), trained by every fitter with the other point parameters, saved by
        :func:`pyrobayes.save`, and registered with ``pyro.param`` in the Pyro program. Targets
        of a scalar output are ``(B,)`` or ``(B, 1)``, of a ``(B, D)`` output ``(B, D)``.
    choice_token_ids : list of int, optional
        Token ids of single-token answer choices for ``likelihood="multiple_choice"``; without
        them the choices are continuations scored by their summed token log-probabilities
        (batches from :func:`~pyrobayes.models.encode_multiple_choice`; pass
        ``likelihood=MultipleChoice(normalize="length")`` to normalise).
    calibration_data : iterable of batches, optional
        Input batches for the W-SVD input covariance (padding masked by ``attention_mask``);
        every targeted layer must receive at least two unmasked input rows (one with
        ``LoRAXS(moment="second")``), else the layer is named in an error.
    max_calibration_batches : int, optional
        Use at most this many calibration batches (a positive integer).
    label_key : str
        Key of the targets in dict batches.
    train_backbone_mode : bool
        Keep dropout active in the backbone during fitting (default off: deterministic network).
        Normalisation layers that track running statistics (BatchNorm) stay in eval mode even
        then: they normalise with their pretrained statistics and never update them, since the
        backbone is frozen and its statistics are not saved with a posterior (a σN ensemble's
        member norms, :class:`~pyrobayes.models.SigmaNorm`, keep statistics of their own).
    output_key : int, str or callable, optional
        Where the prediction (logits, or the Gaussian mean) is in what the network returns:
        ``out[output_key]`` (a tuple's index or a mapping's key), ``getattr(out, output_key)``,
        or ``output_key(out)``. Without it: a tensor, a Hugging Face output's ``logits``, or the
        first item of a Hugging Face model's tuple; a plain network that returns several items
        (``(features, logits)``) is refused until it is given.

    Examples
    --------
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    >>> model = FineTuneModel(net, LoRAXS(rank=2, target_modules=["0"]), num_data=100)
    >>> list(model.latent_sites)
    ['0.core']
    """

    def __init__(
        self,
        net: nn.Module,
        adapter: LoRA | LoRAXS | Any | None = None,
        *,
        likelihood: str | Likelihood = "categorical",
        prior_scale: float = 1.0,
        num_data: int | None = None,
        trainable_modules: Sequence[str] | str = "auto",
        latent_modules: Sequence[str] | str = (),
        obs_scale: float | str | None = None,
        choice_token_ids: Sequence[int] | None = None,
        calibration_data: Iterable[Any] | None = None,
        max_calibration_batches: int | None = None,
        label_key: str = "labels",
        train_backbone_mode: bool = False,
        output_key: OutputKey | None = None,
    ) -> None:
        super().__init__()
        # the param-store prefix of this model's point parameters: unique, so an earlier model's
        # head in Pyro's global store is never taken for this one's
        self._pyro_name = f"{type(self).__name__}_{next(_INSTANCES)}"
        prior_scale = check_real("prior_scale", prior_scale, gt=0, owner="FineTuneModel: ")
        if num_data is not None:
            num_data = check_int("num_data", num_data, ge=1, owner="FineTuneModel: ")
        trainable_modules, latent_paths = _check_module_arguments(trainable_modules, latent_modules)
        max_calibration_batches = _check_calibration(max_calibration_batches)
        net, adapter, peft_weights = _resolve_adapter(net, adapter, latent_paths)
        if output_key is not None and not (
            callable(output_key) or isinstance(output_key, (int, str))
        ):
            raise TypeError(
                "FineTuneModel: output_key must be an index, a key or attribute name, or a "
                f"callable taking the network's output; got {type(output_key).__name__}."
            )
        self.output_key = output_key
        # a Hugging Face model's tuple output (return_dict=False) holds its logits first
        self._tuple_first = getattr(net, "base_model_prefix", None) is not None
        self.label_key = label_key
        self.prior_scale = float(prior_scale)
        self.num_data = num_data
        self.adapter = adapter
        self.train_backbone_mode = train_backbone_mode
        self.likelihood = _make_likelihood(likelihood, obs_scale, choice_token_ids)
        _check_problem_type(net, self.likelihood)
        _check_pad_token(net)
        # forwards left whose padding is checked against the head's pad token id
        self._padding_checks = PADDING_CHECKS if pools_last_non_pad(net) else 0

        for p in net.parameters():
            p.requires_grad_(False)
        if train_backbone_mode:
            _refuse_checkpointing(net)
        _set_backbone_mode(net, train_backbone_mode)
        self.net = net

        specs = self._make_sites(
            adapter, latent_paths, calibration_data, max_calibration_batches, peft_weights
        )
        self.latent_sites: dict[str, SiteSpec] = {s.site: s for s in specs}
        if len(self.latent_sites) != len(specs):
            raise RuntimeError("Duplicate site names; please report this as a pyrobayes bug.")
        _unfuse_transformer_layers(self.net)  # nn.TransformerEncoderLayer's fused kernel
        adapted = {s.module_path for s in specs if s.kind not in ("weight", "bias")}
        self.point_params: dict[str, nn.Parameter] = self._select_point_params(
            trainable_modules,
            {s.module_path for s in specs if s.kind in ("weight", "bias")},
            adapted,
        )
        _check_tied_adapter_bases(self.net, adapted, self.point_params)
        self.point_params.update(self._point_lora_factors(specs))
        _warn_if_output_frozen_at_zero(self.net, self.point_params)
        names = [s.param_name for s in specs]
        _check_tied_sites(self.net, names, names, self.point_params)
        if isinstance(self.likelihood, Gaussian) and self.likelihood.raw_scale is not None:
            # a module parameter (moved by .to()), and a point parameter outside the network
            self.register_parameter("likelihood_raw_scale", self.likelihood.raw_scale)
            self.point_params[NOISE_PARAM] = self.likelihood.raw_scale

    # ------------------------------------------------------------------ structure
    def _make_sites(
        self,
        adapter: Any,
        latent_modules: Sequence[str],
        calibration_data: Iterable[Any] | None,
        max_calibration_batches: int | None,
        peft_weights: dict[str, Tensor],
    ) -> list[SiteSpec]:
        """Inject ``adapter`` and make ``latent_modules`` latent in ``self.net``: their sites."""
        net, label_key = self.net, self.label_key
        specs: list[SiteSpec] = []
        if adapter is not None:
            specs += inject_adapter(
                net,
                adapter,
                calibration_batches=calibration_data,
                calibration_forward=lambda m, b: self._call_net(m, split_batch(b, label_key)[0]),
                calibration_mask=token_mask,
                max_calibration_batches=max_calibration_batches,
            )
        if latent_modules:
            specs += make_latent(net, latent_modules)
        # adapter weights are sampled, never trained in place
        for m in net.modules():
            if isinstance(m, (LoRALinear, LoRAXSLinear)):
                for p in m.parameters():
                    p.requires_grad_(False)
        if peft_weights:
            state = net.state_dict()
            for k, v in peft_weights.items():
                state[k].copy_(v)
        return specs

    def _point_lora_factors(self, specs: list[SiteSpec]) -> dict[str, nn.Parameter]:
        """The LoRA factors that are not latent sites (``LoRA(latent="A")``: every ``B``):
        point parameters, trained in place as a head is."""
        latent = {s.param_name for s in specs}
        out: dict[str, nn.Parameter] = {}
        for path, module in self.net.named_modules():
            if isinstance(module, LoRALinear):
                for role in ("lora_A", "lora_B"):
                    name = f"{path}.{role}.weight"
                    if name not in latent:
                        param = self.net.get_parameter(name)
                        param.requires_grad_(True)
                        out[name] = param
        return out

    def _select_point_params(
        self, trainable_modules: Sequence[str] | str, latent_paths: set[str], adapted: set[str]
    ) -> dict[str, nn.Parameter]:
        """The point parameters: those of the modules ``trainable_modules`` names.

        A module that is (or holds) an adapted layer or a latent module cannot also be
        point-estimated: its tensors are latent sites, or the frozen weights an adapter is built
        on. Named in ``trainable_modules``, that is an error naming both; ``"auto"``
        (:func:`task_head_modules`) skips a head that is itself latent or adapted and, in a
        composite head (RoBERTa's ``classifier``: ``dense`` + ``out_proj``), trains the
        parameters outside its latent and adapted modules.
        """
        auto = isinstance(trainable_modules, str) and trainable_modules == "auto"
        if auto:
            names = task_head_modules(self.net)
        else:
            names = module_path_list("trainable_modules", trainable_modules, also="'auto', ")
        chosen: dict[str, nn.Parameter] = {}
        module_paths = [n for n, _ in self.net.named_modules() if n]
        for target in names:
            if auto:  # full paths already
                matched = [target]
            else:
                matched = [p for p in module_paths if p == target or p.endswith("." + target)]
            if not matched:
                raise ValueError(
                    f"trainable_modules: {target!r} matches no module. Some module names: "
                    f"{sorted({p.rsplit('.', 1)[-1] for p in module_paths})[:30]}."
                )
            for path in matched:
                inside = sorted(
                    m for m in adapted | latent_paths if m == path or m.startswith(path + ".")
                )
                if auto:  # the head's own parameters, its latent and adapted layers left out
                    skip = tuple(m + "." for m in inside)
                    for pname, p in self.net.get_submodule(path).named_parameters():
                        full = f"{path}.{pname}"
                        if path not in inside and not full.startswith(skip) and full not in chosen:
                            p.requires_grad_(True)
                            chosen[full] = p
                    continue
                if inside:
                    what = "an adapted layer" if inside[0] in adapted else "a latent module"
                    where = "target_modules" if inside[0] in adapted else "latent_modules"
                    raise ValueError(
                        f"trainable_modules: {target!r} (module {path!r}) is or holds {what}, "
                        f"{inside[0]!r}, which cannot also be point-estimated. Remove "
                        f"{target!r} from trainable_modules, or {inside[0]!r} from {where}."
                    )
                for pname, p in self.net.get_submodule(path).named_parameters():
                    full = f"{path}.{pname}"
                    if full not in chosen:
                        p.requires_grad_(True)
                        chosen[full] = p
        return _one_name_per_tensor(self.net, chosen)

    def make_latent(self, modules: Sequence[str] | str) -> list[str]:
        r"""Make point-estimated ``nn.Linear`` modules (a trained task head) latent, post hoc.

        The post-hoc form of ``latent_modules=``: each module's trained weight and bias become
        the sites ``<path>.weight`` and ``<path>.bias`` with the model's prior
        ``N(0, s_p² I)``, at the values the fit left them. A post-hoc posterior built afterwards
        covers them, e.g. laplace-torch's last-layer Laplace (Daxberger et al. 2021) on a MAP
        trained with a point head::

            pb.fit(model, map_guide, data)                    # the head a point parameter
            model.make_latent(["classifier"])
            la = pb.posterior(model, "laplace", init=map_guide, subset="last_layer")
            pb.fit(model, la, data, epochs=0)

        ``init=`` fills the new sites from the network (the trained head). Guides built before
        the call keep their own sites. To load a saved posterior over such a model, build the
        model the same way (``latent_modules=[...]`` or this call) first.

        Parameters
        ----------
        modules : list of str or str
            Paths of ``nn.Linear`` modules whose every parameter is a point parameter
            (``trainable_modules``; the Hugging Face head by default); a single string is one
            path.

        Returns
        -------
        list of str
            The new sites, in order.

        Raises
        ------
        ValueError, TypeError
            A path that is not a point-estimated plain ``nn.Linear`` (see
            :func:`~pyrobayes.models.adapters.make_latent`), or one named twice. Every path is
            checked before any module is converted, so a refused call changes nothing.
        """
        paths = module_path_list("modules", modules, owner="FineTuneModel.make_latent: ")
        for path in paths:
            names: list[str] = []
            with contextlib.suppress(AttributeError):  # no such module: refused below
                module = self.net.get_submodule(path)
                parent = self.net.get_submodule(path.rpartition(".")[0])  # "": the network
                # a point LoRA factor (LoRA(latent="A")'s B) is the adapter's choice, not a head
                if not isinstance(parent, LoRALinear):
                    names = [f"{path}.{n}" for n, _ in module.named_parameters()]
            point = {id(p) for p in self.point_params.values()}  # a tied one under one name
            if not names or any(id(self.net.get_parameter(n)) not in point for n in names):
                raise ValueError(
                    f"FineTuneModel.make_latent: {path!r} is not a point-estimated module (its "
                    f"parameters must all be point parameters); the point-estimated modules are "
                    f"{self.head_modules()}. Pass one of them, or build the model with "
                    'latent_modules=[...] (a LoRA factor: LoRA(latent="AB")).'
                )
        new = [n for path in paths for n, _ in self._module_params(path)]
        remaining = {n: p for n, p in self.point_params.items() if n not in new}
        latent = [spec.param_name for spec in self.latent_sites.values()] + new
        _check_tied_sites(self.net, new, latent, remaining, "FineTuneModel.make_latent")
        specs = make_latent(self.net, paths)
        _unfuse_transformer_layers(self.net)
        for spec in specs:
            del self.point_params[spec.param_name]
        self.latent_sites.update({s.site: s for s in specs})
        for cache in ("_slot_cache", "_lower_block"):  # they list the sites and point params
            self.__dict__.pop(cache, None)
        return [s.site for s in specs]

    def _module_params(self, path: str) -> list[tuple[str, nn.Parameter]]:
        """``(full name, parameter)`` of the module at ``path`` of the network."""
        return [(f"{path}.{n}", p) for n, p in self.net.get_submodule(path).named_parameters()]

    def head_modules(self) -> list[str]:
        """The network's modules trained as point parameters beside the adapter (the task head),
        in network order: the owners of ``point_params`` but the learned noise and the point
        LoRA factors (``LoRA(latent="A")``'s B, the adapter's own)."""
        owners = {
            n.rpartition(".")[0]
            for n in self.point_params
            if n != NOISE_PARAM and ".lora_" not in n
        }
        return [path for path, _ in self.net.named_modules() if path in owners]

    def site_prior(self, site: str) -> dist.TorchDistribution:
        """``N(0, s_p² I)`` over one site, event-shaped like the site."""
        spec = self.latent_sites[site]
        ref = self.net.get_parameter(spec.param_name)  # dtype/device without walking the network
        zero = torch.zeros((), dtype=ref.dtype, device=ref.device)
        prior = dist.Normal(zero, self.prior_scale, validate_args=False)
        return prior.expand(spec.shape).to_event(len(spec.shape))

    def prior_loc_scale(self, site: str) -> tuple[float, float]:
        """``(loc, scale)`` of the isotropic Gaussian prior of ``site`` (closed-form KL, log p)."""
        return 0.0, self.prior_scale

    @property
    def dtype(self) -> torch.dtype:
        for spec in self.latent_sites.values():
            return self.net.get_parameter(spec.param_name).dtype
        return torch.get_default_dtype()

    def site_value(self, site: str) -> Tensor:
        """The tensor currently stored in the network for ``site`` (its initial value)."""
        return self.net.get_parameter(self.latent_sites[site].param_name).detach()

    def init_values(self) -> dict[str, Tensor]:
        """The sites' values stored in the network (those the model was built with), as
        detached copies: editing them in place leaves the network and every later guide's
        starting point unchanged."""
        return {s: self.site_value(s).clone() for s in self.latent_sites}

    def train(self, mode: bool = True) -> FineTuneModel:
        # the backbone keeps its own mode (dropout off unless train_backbone_mode)
        self.training = mode
        if mode and self.train_backbone_mode:
            _refuse_checkpointing(self.net)
        _set_backbone_mode(self.net, mode and self.train_backbone_mode)
        return self

    # ------------------------------------------------------------------ evaluation
    def _run(self, inputs: Any) -> Any:
        """The network on ``inputs`` (:class:`DrawForward`'s), the first padded batch of a
        classifier that finds the padding by its token id checked against its pad token id
        (:func:`~pyrobayes.models.net_checks._check_pooled_padding`)."""
        if self._padding_checks:
            passed = _check_pooled_padding(self.net, inputs)
            self._padding_checks = 0 if passed else self._padding_checks - 1
        return super()._run(inputs)

    def log_likelihood(self, params: Tensor, targets: Tensor) -> Tensor:
        """Pointwise ``log p(y_i | θ_s)``: params ``(S, B, ...)`` → ``(S, B)``.

        ``targets`` are checked by the likelihood (``check_targets``); a Gaussian likelihood
        takes ``(B,)`` or ``(B, 1)`` for a scalar output and raises on any other mismatch.
        """
        return self.likelihood.log_prob(params, targets)

    def log_prior(self, values: Mapping[str, Tensor]) -> Tensor:
        """``Σ_sites log N(θ; 0, s_p² I)`` per sample: values ``(S, ...)`` → ``(S,)``."""
        total = None
        scale = self.prior_scale
        const = -math.log(scale) - 0.5 * math.log(2 * math.pi)
        for site, v in values.items():
            # = site_prior(site).log_prob(v) in closed form (the hot path of MAP / SWAG / Laplace)
            event_dims = len(self.latent_sites[site].shape)
            lp = -0.5 * (v / scale).pow(2) + const
            lp = lp.flatten(-event_dims).sum(-1) if event_dims else lp
            total = lp if total is None else total + lp
        if total is None:
            raise ValueError("FineTuneModel.log_prior: values holds no site; pass {site: draws}.")
        return total

    # ------------------------------------------------------------------ Pyro program
    def forward(self, batch: Any) -> Tensor:
        r"""Run the model as a Pyro program on one minibatch (targets observed when present).

        ``θ ~ p(θ)``; ``y_b ~ p(y_b | f(x_b; θ))`` in ``plate("data", N, subsample_size=B)``.

        Sample sites may carry leading batch dimensions (Pyro's vectorized particles,
        ``Predictive(parallel=True)``): the S parameter sets then run in one sample-batched
        forward and ``obs`` has shape ``(*sample_shape, B)``, the data plate staying at the
        right. More rows than ``num_data`` are allowed without targets (prediction); with
        targets that is an error (``num_data`` is the size of the training set).
        """
        inputs, targets = split_batch(batch, self.label_key)
        values = {site: pyro.sample(site, self.site_prior(site)) for site in self.latent_sites}
        overrides = {}
        for name, p in self.point_params.items():
            stored = pyro.param(f"{self._pyro_name}.{name}", p)
            if stored is not p:  # the store holds this model's parameter elsewhere: it wins
                overrides[name] = stored
        raw_scale = overrides.pop(NOISE_PARAM, None)  # the likelihood's, not the network's
        size = batch_size(inputs)
        lead = torch.broadcast_shapes(
            *(v.shape[: v.dim() - len(self.latent_sites[s].shape)] for s, v in values.items())
        )
        if len(lead):  # S = prod(lead) parameter sets in one sample-batched forward
            # sample plates sit left of the data plate (dim -1); a latent site has size 1 at
            # dim -1 when the values are aligned with the plates, and no such dim when they come
            # from Predictive(parallel=True) (which does not align sites with event dims)
            sample_shape = lead[:-1] if lead[-1] == 1 else lead
            shapes = {s: self.latent_sites[s].shape for s in values}
            flat = {
                s: v.expand(*lead, *shapes[s]).reshape(-1, *shapes[s]) for s, v in values.items()
            }
            params = self._batched(inputs, flat, overrides)  # (S, B, ...)
            params = params.reshape(*sample_shape, *params.shape[1:])
        else:
            params = self.output(inputs, values, overrides)
        num_data = self.num_data or size
        if size > num_data and targets is not None:
            raise ValueError(
                f"The batch has {size} observed rows but the model's num_data is {num_data}; "
                "num_data is the size of the training set (batches are subsets of it)."
            )
        plate = (
            pyro.plate("data", size, dim=-1)
            if size > num_data
            else pyro.plate("data", num_data, subsample_size=size, dim=-1)
        )
        obs_dist, targets = self._observation(params, targets, raw_scale)
        with plate:
            return pyro.sample("obs", obs_dist, obs=targets)

    def _observation(
        self, params: Tensor, targets: Tensor | None, raw_scale: Tensor | None
    ) -> tuple[dist.TorchDistribution, Tensor | None]:
        """The ``obs`` distribution (a stored noise ``ρ`` in place) and the checked targets."""
        lik = self.likelihood
        if isinstance(lik, Gaussian) and raw_scale is not None:
            obs_dist = lik.dist(params, raw_scale)
        else:
            obs_dist = lik.dist(params)
        return obs_dist, None if targets is None else lik.check_targets(params, targets)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # .to(device) replaces the head's parameter objects: drop their param-store entries so
        # the next Pyro call registers the new ones
        result = super()._apply(fn, *args, **kwargs)
        noise = self._parameters.get("likelihood_raw_scale")
        if noise is not None and isinstance(self.likelihood, Gaussian):  # keep one ρ object
            self.likelihood.raw_scale = noise
            self.point_params[NOISE_PARAM] = noise
        store = pyro.get_param_store()
        for key in [k for k in store.keys() if k.startswith(self._pyro_name + ".")]:
            del store[key]
        return result

    def extra_repr(self) -> str:
        return (
            f"sites={len(self.latent_sites)}, latent_numel="
            f"{sum(int(torch.Size(s.shape).numel()) for s in self.latent_sites.values())}, "
            f"likelihood={self.likelihood.name}, prior_scale={self.prior_scale}, "
            f"num_data={self.num_data}"
        )
