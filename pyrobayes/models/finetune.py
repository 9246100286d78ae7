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
import dataclasses
import inspect
import itertools
import logging
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ..batch import batch_size, expand_samples, split_batch, token_mask
from .adapters import (
    LoRA,
    LoRAXS,
    SiteSpec,
    check_int,
    check_real,
    find_target_modules,
    inject_adapter,
    make_latent,
)
from .layers import LoRALinear, LoRAXSLinear
from .likelihoods import (
    MULTI_LABEL_ADVICE,
    Categorical,
    Gaussian,
    Likelihood,
    OutputKey,
    make_likelihood,
    network_output,
)
from .lower_cache import LowerBlockCache, stubbed_below
from .sharing import (
    TokenLogProbs,
    batch_memo,
    first_adapted_block,
    lower_inputs,
    lower_layers_shared,
    prefix_applies,
    prefix_shared_logits,
    reusing_within_batch,
    sharing_enabled,
    tokens_per_draw,
)

logger = logging.getLogger(__name__)

__all__ = ["FineTuneModel", "HEAD_NAMES", "NOISE_PARAM", "task_head_modules"]

#: Module names treated as the task head of Hugging Face models (trained as point estimates by
#: ``trainable_modules="auto"``, besides the modules a task model adds outside its base model:
#: :func:`task_head_modules`).
HEAD_NAMES = ("classifier", "score", "qa_outputs", "pre_classifier")


def task_head_modules(net: nn.Module) -> list[str]:
    """The modules ``trainable_modules="auto"`` point-estimates: the task head, in network order.

    Two rules, joined:

    - every module named in :data:`HEAD_NAMES` (``classifier``, ``score``, ``qa_outputs``,
      ``pre_classifier``), in any network;
    - in a Hugging Face task model, every child module outside the base model
      (``net.base_model_prefix``: ``bert``, ``deberta``, ``model``, ...) that holds parameters:
      the layers the task head adds on top of the pretrained encoder, which ``from_pretrained``
      initialises fresh, such as DeBERTa's ``pooler`` beside its ``classifier`` (BERT's and
      ALBERT's poolers sit inside the base model, pretrained, and stay frozen). A child that
      is or holds the output embeddings (a causal or masked LM's ``lm_head``, pretrained and
      usually tied to the input embeddings) or that shares a tensor with the base model is left
      out.

    Parameters
    ----------
    net : nn.Module

    Returns
    -------
    list of str
        Module paths.
    """
    chosen = {n for n, _ in net.named_modules() if n and n.rsplit(".", 1)[-1] in HEAD_NAMES}
    prefix = getattr(net, "base_model_prefix", None)
    base = getattr(net, prefix, None) if isinstance(prefix, str) and prefix else None
    if isinstance(base, nn.Module) and base is not net:
        output_embeddings = None
        get_output = getattr(net, "get_output_embeddings", None)
        if callable(get_output):
            with contextlib.suppress(Exception):  # some models raise instead of returning None
                output_embeddings = get_output()
        base_tensors = {id(p) for p in base.parameters()}
        for name, child in net.named_children():
            tensors = list(child.parameters())
            if (
                child is base
                or not tensors
                or any(id(p) in base_tensors for p in tensors)
                or any(m is output_embeddings for m in child.modules())
            ):
                continue
            chosen.add(name)
    return [n for n, _ in net.named_modules() if n in chosen]


def _check_pad_token(net: nn.Module) -> None:
    """Refuse a sequence classifier that pools at the last non-pad token but has no pad token.

    Such a Hugging Face classifier (GPT-2, LLaMA, Qwen2, Mistral, ... ``ForSequenceClassification``:
    transformers' ``GenericForSequenceClassification`` and the classes that raise "Cannot handle
    batch sizes > 1 if no padding token is defined") runs only one row at a time without
    ``config.pad_token_id``, while every draw of a posterior runs S·B rows.
    """
    cls = type(net)
    if not cls.__name__.endswith("ForSequenceClassification"):
        return
    config = getattr(net, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    if config is None or getattr(text, "pad_token_id", 0) is not None:
        return
    pools_last = False
    with contextlib.suppress(ImportError):
        from transformers.modeling_layers import GenericForSequenceClassification

        pools_last = isinstance(net, GenericForSequenceClassification)
    if not pools_last:
        with contextlib.suppress(OSError, TypeError):
            pools_last = "no padding token" in inspect.getsource(cls.forward)
    if not pools_last:
        return
    where = "net.config" if text is config else "net.config.get_text_config()"
    raise ValueError(
        f"FineTuneModel: {cls.__name__} reads each sequence's last non-pad token, and its "
        f"{where}.pad_token_id is None, so transformers runs one row at a time only ('Cannot "
        "handle batch sizes > 1 if no padding token is defined'); every posterior draw runs S·B "
        f"rows, even for batches of one. Set {where}.pad_token_id = tokenizer.pad_token_id (a "
        "tokenizer without a pad token: tokenizer.pad_token = tokenizer.eos_token, and "
        f"{where}.pad_token_id = tokenizer.eos_token_id) before building the model."
    )


def _check_problem_type(net: nn.Module, likelihood: Likelihood) -> None:
    """Refuse a Hugging Face multi-label classifier, or a regression head, under the
    categorical likelihood."""
    problem = getattr(getattr(net, "config", None), "problem_type", None)
    if problem == "regression" and isinstance(likelihood, Categorical):
        raise ValueError(
            "FineTuneModel: the network's config.problem_type is 'regression' (its outputs "
            "are real-valued targets), but the likelihood is categorical, which reads them as "
            "class logits. Pass likelihood='gaussian' (with obs_scale=... or 'learn'), or "
            "build a classifier (problem_type='single_label_classification' or None)."
        )
    if problem == "multi_label_classification" and isinstance(likelihood, Categorical):
        raise ValueError(
            f"FineTuneModel: the network's config.problem_type is {problem!r}, but the "
            "categorical likelihood models one class per example (a softmax over classes); "
            "multi-label classification (a 0/1 target per class) is not supported. "
            f"{MULTI_LABEL_ADVICE} Build such a classifier with problem_type="
            "'single_label_classification' (or None)."
        )


#: ``point_params`` key of a learned Gaussian noise ``ρ`` (``σ = softplus(ρ)``).
NOISE_PARAM = "likelihood.raw_scale"


def _refuse_checkpointing(net: nn.Module) -> None:
    """Gradient (activation) checkpointing re-runs a forward during the backward pass, after
    the sampled adapter weights were swapped back out: the adapter would get no gradient (or
    torch's checkpoint would fail on the changed tensors). Hugging Face modules run it only in
    training mode, i.e. under ``train_backbone_mode``."""
    on = [
        name or "<net>"
        for name, m in net.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
    ]
    if on:
        raise ValueError(
            f"FineTuneModel(train_backbone_mode=True): the network has gradient checkpointing on "
            f"({', '.join(on[:3])}{', ...' if len(on) > 3 else ''}), which recomputes the forward "
            "after pyrobayes has put the sampled adapter weights back, so the adapter would not "
            "train. Turn it off (net.gradient_checkpointing_disable()), or keep "
            "train_backbone_mode=False (the backbone in eval mode, where Hugging Face models "
            "do not checkpoint)."
        )


def _peft_to_pyrobayes(net: Any, explicit: Any = None) -> tuple[nn.Module, LoRA, dict[str, Tensor]]:
    """Unwrap a ``peft.PeftModel`` with LoRA layers: base network, LoRA config, trained weights.

    ``net`` is duck-typed (``peft_config``, ``active_adapter``, ``unload``), as the caller checks.
    The adapter targets exactly the modules peft adapted (its ``layers_to_transform`` and
    ``exclude_modules`` included); an ``explicit`` adapter may only change which factors are
    latent (``LoRA(latent="A")``), not the rank, scaling or modules of the trained weights.
    """
    config = net.peft_config[net.active_adapter]
    adapter = LoRA.from_peft(config, scoped=True)
    weights: dict[str, Tensor] = {}
    prefix = "base_model.model."
    for name, module in net.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and net.active_adapter in lora_a:
            path = name[len(prefix) :] if name.startswith(prefix) else name
            lora_b = getattr(module, "lora_B", None)
            for role, holder in (("lora_A", lora_a), ("lora_B", lora_b)):
                weight = getattr(holder[net.active_adapter], "weight", None) if holder else None
                if not isinstance(weight, Tensor):
                    raise TypeError(
                        f"FineTuneModel: the peft LoRA layer {name!r} has no {role} weight for "
                        f"adapter {net.active_adapter!r}; pass a peft model with LoRA layers "
                        "(or the unloaded base network and adapter=LoRA(...))."
                    )
                weights[f"{path}.{role}.weight"] = weight.detach().clone()
    base = net.unload()
    adapted = sorted({name.rsplit(".", 2)[0] for name in weights})
    if adapted and sorted(find_target_modules(base, adapter.target_modules)) != adapted:
        # peft's layers_to_transform / exclude_modules narrowed its targets: name the paths
        adapter = dataclasses.replace(
            adapter, target_modules="^(" + "|".join(re.escape(p) for p in adapted) + ")$"
        )
    if explicit is not None:  # (no LoRA layers left, e.g. merged: nothing trained to fit)
        adapter = _explicit_peft_adapter(explicit, adapter, base, adapted) if adapted else explicit
    return base, adapter, weights


def _explicit_peft_adapter(
    explicit: Any, adapter: LoRA, base: nn.Module, adapted: list[str]
) -> LoRA:
    """``explicit``, checked against the peft model's own ``adapter`` (its trained weights fix
    the rank, scaling and modules): only ``latent`` may differ."""
    same = (
        isinstance(explicit, LoRA)
        and explicit.rank == adapter.rank
        and math.isclose(explicit.scaling, adapter.scaling)
        and sorted(find_target_modules(base, explicit.target_modules)) == adapted
    )
    if not same:
        raise ValueError(
            f"FineTuneModel: net is a peft LoRA model (r={adapter.rank}, alpha={adapter.alpha:g} "
            f"on {adapted}) and adapter={explicit!r} differs from it, so its trained weights do "
            "not fit. Drop adapter= to keep the peft adapter (LoRA(rank, alpha, the same targets, "
            "latent='A') may change only which factors are latent), or pass net.unload() (the "
            "base network) with the adapter you want."
        )
    return dataclasses.replace(adapter, latent=explicit.latent)


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


class FineTuneModel(nn.Module):
    r"""Pyro model over the adapter (or LoRA-XS core) parameters of a network.

    Parameters
    ----------
    net : nn.Module
        A Hugging Face model, a plain ``nn.Module``, or a ``peft.PeftModel`` with LoRA adapters
        (its trained LoRA weights become the starting point). Modified in place: targeted
        modules are replaced by pyrobayes adapter layers; all original weights are frozen.
    adapter : LoRA or LoRAXS or peft.LoraConfig, optional
        Which adapter to inject. ``None`` with ``latent_modules`` gives a Bayesian network over
        whole linear layers (e.g. a small MLP).
    likelihood : {"categorical", "gaussian", "multiple_choice"} or Likelihood
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
    latent_modules : list of str
        ``nn.Linear`` modules whose weight and bias become latent sites instead.
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
        Input batches for the W-SVD input covariance (padding masked by ``attention_mask``).
    max_calibration_batches : int, optional
        Use at most this many calibration batches.
    label_key : str
        Key of the targets in dict batches.
    train_backbone_mode : bool
        Keep dropout active in the backbone during fitting (default off: deterministic network).
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
        latent_modules: Sequence[str] = (),
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
        peft_weights: dict[str, Tensor] = {}
        if hasattr(net, "peft_config") and hasattr(net, "unload"):
            explicit = adapter if isinstance(adapter, (LoRA, LoRAXS)) else None
            net, adapter, peft_weights = _peft_to_pyrobayes(net, explicit)
        elif adapter is not None and type(adapter).__name__ == "LoraConfig":
            adapter = LoRA.from_peft(adapter)
        if adapter is None and not latent_modules:
            raise ValueError(
                "FineTuneModel needs something to be Bayesian about: pass adapter=LoRAXS(...) or "
                "LoRA(...), or latent_modules=[...] naming nn.Linear modules."
            )
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

        for p in net.parameters():
            p.requires_grad_(False)
        if train_backbone_mode:
            _refuse_checkpointing(net)
        net.train(train_backbone_mode)
        self.net = net

        specs = self._make_sites(
            adapter, latent_modules, calibration_data, max_calibration_batches, peft_weights
        )
        self.latent_sites: dict[str, SiteSpec] = {s.site: s for s in specs}
        if len(self.latent_sites) != len(specs):
            raise RuntimeError("Duplicate site names; please report this as a pyrobayes bug.")
        self.point_params: dict[str, nn.Parameter] = self._select_point_params(
            trainable_modules,
            {s.module_path for s in specs if s.kind in ("weight", "bias")},
            {s.module_path for s in specs if s.kind not in ("weight", "bias")},
        )
        self.point_params.update(self._point_lora_factors(specs))
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
            specs += make_latent(net, list(latent_modules))
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
        elif isinstance(trainable_modules, str):
            names = [trainable_modules]
        else:
            names = list(trainable_modules)
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
        return chosen

    def make_latent(self, modules: Sequence[str]) -> list[str]:
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
        modules : list of str
            Paths of ``nn.Linear`` modules whose every parameter is a point parameter
            (``trainable_modules``; the Hugging Face head by default).

        Returns
        -------
        list of str
            The new sites, in order.
        """
        paths = [modules] if isinstance(modules, str) else list(modules)
        for path in paths:
            names: list[str] = []
            with contextlib.suppress(AttributeError):  # no such module: refused below
                module = self.net.get_submodule(path)
                parent = self.net.get_submodule(path.rpartition(".")[0])  # "": the network
                # a point LoRA factor (LoRA(latent="A")'s B) is the adapter's choice, not a head
                if not isinstance(parent, LoRALinear):
                    names = [f"{path}.{n}" for n, _ in module.named_parameters()]
            if not names or any(n not in self.point_params for n in names):
                raise ValueError(
                    f"FineTuneModel.make_latent: {path!r} is not a point-estimated module (its "
                    f"parameters must all be point parameters); the point-estimated modules are "
                    f"{self.head_modules()}. Pass one of them, or build the model with "
                    'latent_modules=[...] (a LoRA factor: LoRA(latent="AB")).'
                )
        specs = make_latent(self.net, paths)
        for spec in specs:
            del self.point_params[spec.param_name]
        self.latent_sites.update({s.site: s for s in specs})
        for cache in ("_slot_cache", "_lower_block"):  # they list the sites and point params
            self.__dict__.pop(cache, None)
        return [s.site for s in specs]

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
    def device(self) -> torch.device:
        for t in self.net.parameters():
            return t.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        for spec in self.latent_sites.values():
            return self.net.get_parameter(spec.param_name).dtype
        return torch.get_default_dtype()

    def site_value(self, site: str) -> Tensor:
        """The tensor currently stored in the network for ``site`` (its initial value)."""
        return self.net.get_parameter(self.latent_sites[site].param_name).detach()

    def init_values(self) -> dict[str, Tensor]:
        return {s: self.site_value(s) for s in self.latent_sites}

    def train(self, mode: bool = True) -> FineTuneModel:
        # the backbone keeps its own mode (dropout off unless train_backbone_mode)
        self.training = mode
        if mode and self.train_backbone_mode:
            _refuse_checkpointing(self.net)
        self.net.train(mode and self.train_backbone_mode)
        return self

    # ------------------------------------------------------------------ evaluation
    def _call_net(self, net: nn.Module, inputs: Any) -> Any:
        """``net`` on ``inputs`` as the likelihood wants it called (``network_inputs``: e.g. the
        ``(B, K, L)`` choices flattened and the head restricted to the positions read)."""
        return _call(net, self.likelihood.network_inputs(inputs, net))

    def _run(self, inputs: Any) -> Any:
        """:meth:`_call_net` with the work shared across choices and draws (``sharing``): a
        multiple-choice batch runs each prompt once for its K choices; inside
        :meth:`_lower_shared` the blocks below the first adapted one see the un-expanded rows."""
        check_positions = getattr(self.likelihood, "check_positions", None)
        if check_positions is not None:
            check_positions(inputs, self.net)
        shared = prefix_shared_logits(
            self.net, self.likelihood, inputs, self._draws_in_net(), self._first_adapted()
        )
        if shared is not None:
            return shared
        lower = self.__dict__.get("_lower_rows")  # set by _lower_shared
        net_inputs = self.likelihood.network_inputs(inputs, self.net)
        if lower is None or not isinstance(net_inputs, Mapping):
            return _call(self.net, net_inputs)
        out = _call(self.net, lower_inputs(net_inputs, lower[0]))
        if int(self.network_prediction(out).shape[0]) != lower[0] * lower[1]:
            raise _RowsMismatch  # a head that reads the (un-expanded) inputs again
        return out

    def output(
        self,
        inputs: Any,
        values: Mapping[str, Tensor],
        overrides: Mapping[str, Tensor] | None = None,
    ) -> Tensor:
        """Likelihood parameters for one parameter set (or a sample-major batch): ``(B, ...)``.

        A value of another floating dtype than the tensor it replaces runs in the network's
        dtype (a guide keeps a half-precision network's parameters in float32: its steps would
        round away in bfloat16)."""
        slots = self._slots()
        params = {}
        for site, value in values.items():
            name = self.latent_sites[site].param_name
            module, leaf = slots[name]
            held = module._parameters[leaf]
            if held is not None and value.dtype != held.dtype:
                value = value.to(held.dtype)
            params[name] = value
        if overrides:
            params.update(overrides)
        cached = None if "_lower_rows" in self.__dict__ else self._cached_lower(inputs)
        if cached is None:
            out = self._functional(inputs, params)
        else:
            with stubbed_below(cached[0], cached[1]):
                out = self._functional(inputs, params)
        if isinstance(out, TokenLogProbs):  # the shared prompts' scored continuations
            return self.likelihood.params(out, inputs)  # type: ignore[arg-type]
        return self.likelihood.params(self.network_prediction(out), inputs)

    def network_prediction(self, out: Any) -> Tensor:
        """The prediction tensor in the network's output ``out`` (``output_key``)."""
        return network_output(out, self.output_key, first_of_tuple=self._tuple_first)

    def _draws_in_net(self) -> int:
        """Parameter sets the network holds now: the leading size of a site swapped in with a
        sample axis (a sample-major batch, or the linearised predictive's per-row copies)."""
        for spec in self.latent_sites.values():
            module, leaf = self._slots()[spec.param_name]
            value = module._parameters[leaf]
            if value is not None and value.dim() > len(spec.shape):
                return int(value.shape[0])
        return 1

    def _slots(self) -> dict[str, tuple[nn.Module, str]]:
        """``{parameter name: (owning module, attribute)}`` for every site and point parameter."""
        slots = self.__dict__.get("_slot_cache")
        if slots is None:
            slots = {}
            names = [s.param_name for s in self.latent_sites.values()]
            names += [n for n in self.point_params if n != NOISE_PARAM]  # the rest: the network's
            for name in names:
                parent, _, leaf = name.rpartition(".")
                module = self.net.get_submodule(parent) if parent else self.net
                if leaf not in module._parameters:
                    raise RuntimeError(f"{name!r} is not a registered parameter of the network.")
                slots[name] = (module, leaf)
            self.__dict__["_slot_cache"] = slots
        return slots

    def _functional(self, inputs: Any, params: dict[str, Tensor]) -> Any:
        """Run the network with ``params`` in place of its own tensors (as ``functional_call``).

        The sites and point parameters are known in advance, so their slots are cached and
        swapped directly (``functional_call`` walks every module each call, a millisecond-scale
        fixed cost per step on small networks); other names go through ``functional_call``.
        """
        slots = self._slots()
        if not all(name in slots for name in params):
            net_inputs = self.likelihood.network_inputs(inputs, self.net)
            return _functional_call(self.net, net_inputs, params)
        saved = []
        try:
            for name, value in params.items():
                module, leaf = slots[name]
                saved.append((module, leaf, module._parameters[leaf]))
                module._parameters[leaf] = value  # type: ignore[assignment]
            return self._run(inputs)
        finally:
            for module, leaf, original in reversed(saved):
                module._parameters[leaf] = original

    def batched_output(self, inputs: Any, values: Mapping[str, Tensor]) -> Tensor:
        """Likelihood parameters for S parameter sets in ONE forward: ``(S, B, ...)``.

        ``values[site]`` has shape ``(S, *site_shape)``. The input batch is expanded S-fold
        (sample-major) and each adapter layer applies its own sample to its slice.
        """
        return self._batched(inputs, values)

    def _batched(
        self,
        inputs: Any,
        values: Mapping[str, Tensor],
        overrides: Mapping[str, Tensor] | None = None,
    ) -> Tensor:
        num_samples = _num_samples(values)
        num_rows = batch_size(inputs)
        if num_samples == 1 and not reusing_within_batch():
            out = self.output(inputs, {s: v[0] for s, v in values.items()}, overrides)
            return out.unsqueeze(0)
        expanded = expand_samples(inputs, num_samples)
        shared = self._lower_shared(inputs, expanded, values, overrides, num_samples)
        out = self.output(expanded, values, overrides) if shared is None else shared
        return out.reshape(num_samples, num_rows, *out.shape[1:])

    def _lower_shared(
        self,
        inputs: Any,
        expanded: Any,
        values: Mapping[str, Tensor],
        overrides: Mapping[str, Tensor] | None,
        num_samples: int,
    ) -> Tensor | None:
        """:meth:`output` of the S-fold ``expanded`` batch with the network's blocks below the
        first adapted one run once on the un-expanded rows (``sharing``), or ``None`` where
        that does not apply (or the network's output does not keep the expanded rows)."""
        if (
            not sharing_enabled()
            or not isinstance(inputs, Mapping)
            or "_lower_rows" in self.__dict__
        ):
            return None
        if prefix_applies(self.net, self.likelihood, expanded):
            return None  # the prompt-sharing path runs the choices instead
        found = self._first_adapted()
        if found is None:
            return None
        rows = batch_size(inputs) * (self.likelihood.rows_per_output(inputs) or 1)
        cached = self._cached_lower(inputs)  # the fit's per-example memory of the lower blocks
        self.__dict__["_lower_rows"] = (rows, num_samples)
        key = tuple(sorted(self.latent_sites))
        memo = batch_memo(inputs, ("lower", key))  # the chunks of one batch in pb.predict
        if cached is not None:
            memo = {} if memo is None else memo
            memo["below"] = cached[1]
        try:
            blocks, first = found
            below = list(blocks)[:first]
            with lower_layers_shared(list(blocks)[first:], rows, num_samples, below, memo):
                out = self.output(expanded, values, overrides)
        except _RowsMismatch:
            if memo is not None:
                memo.pop("below", None)
            return None
        finally:
            del self.__dict__["_lower_rows"]
        return out

    @contextlib.contextmanager
    def caching_lower_blocks(self, *datasets: Iterable[Any]) -> Iterator[None]:
        """Within the block (:func:`pyrobayes.fit` opens it with its training and validation
        data), the frozen blocks below the first adapted one are not run on the examples of
        ``datasets``: their output is computed once per example on entry and read back
        (:mod:`pyrobayes.models.lower_cache`). Where that does not apply, the plain forward
        runs. Data other than a ``DataLoader``, list or tuple is not read ahead (the first, the
        training data, must be one)."""
        found = self._first_adapted()
        readable = [d for d in datasets if isinstance(d, (DataLoader, list, tuple))]
        if (
            found is None
            or not datasets
            or not isinstance(datasets[0], (DataLoader, list, tuple))
            or "_lower_cache" in self.__dict__
            or not sharing_enabled()
        ):
            yield
            return
        changing = [spec.param_name for spec in self.latent_sites.values()]
        changing += [name for name in self.point_params if name != NOISE_PARAM]
        cache = LowerBlockCache(self.net, list(found[0]), found[1], changing)

        def network_inputs(batch: Any) -> Any:
            return self.likelihood.network_inputs(split_batch(batch, self.label_key)[0], self.net)

        if cache.build(readable, network_inputs, self.device):
            self.__dict__["_lower_cache"] = cache
        try:
            yield
        finally:
            self.__dict__.pop("_lower_cache", None)

    def _cached_lower(self, inputs: Any) -> tuple[list[nn.Module], Any] | None:
        """``(lower blocks, their output for inputs)`` from the fit's lower-block cache, or
        ``None`` outside :meth:`caching_lower_blocks` or where it does not apply."""
        cache = self.__dict__.get("_lower_cache")
        if cache is None or not sharing_enabled():
            return None
        if prefix_applies(self.net, self.likelihood, inputs):
            return None  # prompts and continuations run as rows of their own
        output = cache.output(self.likelihood.network_inputs(inputs, self.net))
        return None if output is None else (cache.below, output)

    def tokens_per_draw(self, inputs: Any) -> int | None:
        """Token positions one more draw costs on ``inputs`` in prediction, the work
        shared across draws left out (:func:`~pyrobayes.models.sharing.tokens_per_draw`);
        ``None`` when nothing is shared. :func:`pyrobayes.predict` sizes its chunks of draws
        by it."""
        return tokens_per_draw(self.net, self.likelihood, inputs, self._first_adapted())

    def _first_adapted(self) -> tuple[nn.ModuleList, int] | None:
        """:func:`~pyrobayes.models.sharing.first_adapted_block` of the latent sites (cached)."""
        key = tuple(sorted(self.latent_sites))
        cached = self.__dict__.get("_lower_block")
        if cached is None or cached[0] != key:
            names = [spec.param_name for spec in self.latent_sites.values()]
            cached = (key, first_adapted_block(self.net, names))
            self.__dict__["_lower_block"] = cached
        return cached[1]

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


class _RowsMismatch(Exception):
    """The network's output lost the S-fold rows of the shared lower layers."""


def _call(net: nn.Module, inputs: Any) -> Any:
    try:
        if isinstance(inputs, Mapping):
            return net(**inputs)
        if isinstance(inputs, (tuple, list)):
            return net(*inputs)
        return net(inputs)
    except (TypeError, RuntimeError) as err:
        explained = _explain_call_error(net, inputs, err)
        if explained is None:
            raise
        raise explained from err


def _functional_call(net: nn.Module, inputs: Any, params: dict[str, Tensor]) -> Any:
    try:
        if isinstance(inputs, Mapping):
            return torch.func.functional_call(net, params, args=(), kwargs=dict(inputs))
        if isinstance(inputs, (tuple, list)):
            return torch.func.functional_call(net, params, tuple(inputs))
        return torch.func.functional_call(net, params, (inputs,))
    except (TypeError, RuntimeError) as err:
        explained = _explain_call_error(net, inputs, err)
        if explained is None:
            raise
        raise explained from err


def _tensor_dtypes(obj: Any) -> set[torch.dtype]:
    """The dtypes of the tensors in a (nested) batch part."""
    if isinstance(obj, Tensor):
        return {obj.dtype}
    if isinstance(obj, Mapping):
        return set().union(*(_tensor_dtypes(v) for v in obj.values()))
    if isinstance(obj, (tuple, list)):
        return set().union(*(_tensor_dtypes(v) for v in obj))
    return set()


def _explain_call_error(net: nn.Module, inputs: Any, err: Exception) -> Exception | None:
    """The two errors of a batch the network cannot take, said in the batch's terms: a dict
    batch with a key its ``forward`` does not accept, and inputs of another dtype than the
    network's parameters (``None``: another error, raised as it is)."""
    text = str(err)
    if isinstance(err, TypeError) and "unexpected keyword argument" in text:
        if not isinstance(inputs, Mapping):
            return None
        return TypeError(
            f"FineTuneModel: the network is called as net(**batch) with every key of a dict "
            f"batch but the labels ({sorted(map(str, inputs))}), and its forward refused one: "
            f"{text}. Drop that column from the batches (e.g. dataset.remove_columns([...]) "
            "or a collate_fn), or rename it to an argument of forward."
        )
    if not isinstance(err, RuntimeError) or not any(
        word in text for word in ("dtype", "scalar type", "Input type")
    ):
        return None
    weights = {p.dtype for p in net.parameters() if p.is_floating_point()}
    found = _tensor_dtypes(inputs)
    floats = {d for d in found if d.is_floating_point}
    if len(weights) != 1:
        return None
    (weight,) = weights
    if floats and floats != {weight}:
        listed = ", ".join(sorted(str(d) for d in floats))
        return TypeError(
            f"FineTuneModel: the batch's floating-point inputs are {listed} but the network's "
            f"parameters are {weight}; torch does not mix them ({text}). Cast the batches "
            f"(x.to({weight}), e.g. in a collate_fn; numpy arrays become float64) or the "
            "network before building the model."
        )
    if not floats and found and all(not d.is_floating_point and not d.is_complex for d in found):
        listed = ", ".join(sorted(str(d) for d in found))
        return TypeError(
            f"FineTuneModel: the batch's inputs are integer tensors ({listed}) and the "
            f"network's first layer wants {weight} values ({text}). Cast them (x.float()); "
            "integer inputs are for networks that embed token ids."
        )
    return None


def _num_samples(values: Mapping[str, Tensor]) -> int:
    sizes = {int(v.shape[0]) for v in values.values()}
    if len(sizes) != 1:
        raise ValueError(f"Expected one sample count across sites but got {sorted(sizes)}.")
    return sizes.pop()
