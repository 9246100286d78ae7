"""The checks on the network :class:`~pyrobayes.models.FineTuneModel` wraps, at construction.

:func:`task_head_modules`, the modules ``trainable_modules="auto"`` point-estimates, and the
refusals of a network the model cannot run as asked: a sequence classifier without a pad token,
a regression or multi-label head under the categorical likelihood (multi-label:
``likelihood="bernoulli"``), and gradient checkpointing under a training backbone. A network
handed over inside ``torch.compile``'s or data parallelism's wrapper is taken out of it, with
a warning (:func:`_unwrap_network`). And one check of the batches, on the first forwards: a
sequence classifier that finds the padding by its token id, given batches padded with another
id (:func:`_check_pooled_padding`).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import flagged_examples
from ..user_frame import user_stacklevel
from .layers import BatchedLinear, LoRALinear, LoRAXSLinear
from .likelihoods import Categorical, Likelihood

__all__ = ["HEAD_NAMES", "pools_last_non_pad", "task_head_modules"]

#: Module names treated as the task head of Hugging Face models (trained as point estimates by
#: ``trainable_modules="auto"``, besides the modules a task model adds outside its base model:
#: :func:`task_head_modules`).
HEAD_NAMES = ("classifier", "score", "qa_outputs", "pre_classifier")

#: Forwards of a :func:`pools_last_non_pad` classifier whose batch is checked by
#: :func:`_check_pooled_padding` until one holding padding passes (one host synchronisation
#: each): data without padding in so many batches has rows of one length.
PADDING_CHECKS = 16


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


def _wrapper_of(net: nn.Module) -> tuple[nn.Module, str, str] | None:
    """``(wrapped network, how to reach it, why it is not used)`` when ``net`` is a wrapper
    :func:`_unwrap_network` takes apart, else ``None``."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if isinstance(optimized, type) and isinstance(net, optimized):
        why = (
            "pyrobayes swaps each draw's adapter values into the network's modules and places "
            "forward hooks on them (Laplace's K-FAC, the lower-block cache, calibration), which "
            "a compiled graph does not follow (torch ignores hooks added after compiling: "
            "torch._dynamo.config.skip_nnmodule_hook_guards), and the draws' shapes change with "
            "S, recompiling"
        )
        return net.get_submodule("_orig_mod"), "net._orig_mod", why
    if isinstance(net, (DataParallel, DistributedDataParallel)):
        why = (
            "it would split each forward's S·B rows, the batch copied once per draw, across "
            "devices apart from the draws they belong to, and it hides the wrapped model's "
            "config from FineTuneModel's checks (its pad token, problem_type) and adds "
            "'module.' to every name a posterior file holds. pb.fit runs on several GPUs "
            "itself: launch with torchrun and call torch.distributed.init_process_group()"
        )
        return net.module, "net.module", why
    return None


def _unwrap_network(net: nn.Module) -> nn.Module:
    """The network inside the wrappers a user may apply before handing it to
    :class:`~pyrobayes.models.FineTuneModel`, which runs that network itself: ``torch.compile``'s
    ``OptimizedModule`` (``net._orig_mod``) and ``nn.DataParallel`` /
    ``DistributedDataParallel`` (``net.module``), nested ones too, with a warning naming each.

    Left wrapped, a compiled network failed in K-FAC Laplace (the adapted layers' input
    statistics never recorded: their hooks were not run) and a compiled Hugging Face BERT
    failed in tracing; a ``DataParallel`` one ran, with its module paths prefixed by
    ``module.`` and the checks that read the Hugging Face config skipped in silence (a
    regression head accepted under the categorical likelihood, batches padded with another id
    than the pad token scored at their padding). The wrapped network is modified in place, as
    any network given to the model is.

    Parameters
    ----------
    net : nn.Module

    Returns
    -------
    nn.Module
        ``net`` itself when it is not such a wrapper.
    """
    found = _wrapper_of(net)
    while found is not None:
        inner, where, why = found
        warnings.warn(
            f"FineTuneModel: the network is wrapped in {type(net).__name__}; pyrobayes runs the "
            f"network it wraps ({where}) instead, unwrapped: {why}. Pass {where} to silence "
            "this.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        net, found = inner, _wrapper_of(inner)
    return net


def _text_config(net: nn.Module) -> tuple[Any, str]:
    """The config a Hugging Face classifier reads ``pad_token_id`` from (its text config in a
    multimodal one) and how a message names it; ``(None, "")`` without a config."""
    config = getattr(net, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    return text, "net.config" if text is config else "net.config.get_text_config()"


def pools_last_non_pad(net: nn.Module) -> bool:
    """Whether ``net`` is a Hugging Face sequence classifier that reads each row at its last
    token whose id is not ``config.pad_token_id`` (GPT-2, LLaMA, Qwen2, Mistral, ...
    ``ForSequenceClassification``: transformers' ``GenericForSequenceClassification`` and the
    classes that raise "Cannot handle batch sizes > 1 if no padding token is defined"), which
    finds the padding by its token ids, not by the attention mask."""
    cls = type(net)
    if not cls.__name__.endswith("ForSequenceClassification"):
        return False
    with contextlib.suppress(ImportError):
        from transformers.modeling_layers import GenericForSequenceClassification

        if isinstance(net, GenericForSequenceClassification):
            return True
    with contextlib.suppress(OSError, TypeError):
        return "no padding token" in inspect.getsource(cls.forward)
    return False


def _check_pad_token(net: nn.Module) -> None:
    """Refuse a sequence classifier that pools at the last non-pad token but has no pad token
    (:func:`pools_last_non_pad`): it runs only one row at a time without
    ``config.pad_token_id``, while every draw of a posterior runs S·B rows."""
    text, where = _text_config(net)
    if text is None or getattr(text, "pad_token_id", 0) is not None:
        return
    if not pools_last_non_pad(net):
        return
    raise ValueError(
        f"FineTuneModel: {type(net).__name__} reads each sequence's last non-pad token, and its "
        f"{where}.pad_token_id is None, so transformers runs one row at a time only ('Cannot "
        "handle batch sizes > 1 if no padding token is defined'); every posterior draw runs S·B "
        f"rows, even for batches of one. Set {where}.pad_token_id = tokenizer.pad_token_id (a "
        "tokenizer without a pad token: tokenizer.pad_token = tokenizer.eos_token, and "
        f"{where}.pad_token_id = tokenizer.eos_token_id) before building the model."
    )


def _check_pooled_padding(net: nn.Module, inputs: Any) -> bool:
    """Refuse a batch whose padding a :func:`pools_last_non_pad` classifier would read.

    Such a head pools each row at its last token whose id is not ``pad_token_id`` (the last
    position with ``inputs_embeds``). A batch padded with another id (a tokenizer whose pad
    token is not the one the config names, e.g. ``pad_token_id`` set to the EOS id while the
    collator pads with ``tokenizer.pad_token_id``) is then read at a padding position under
    right padding: each padded row scores as its last padding token, not as itself, and the
    fit's lower-block cache, whose padded positions hold zeros, computes yet another
    function. Rows without padding, and left padding (the last position is real), are read
    where they should be.

    Parameters
    ----------
    net : nn.Module
        The classifier (:func:`pools_last_non_pad`).
    inputs : Any
        The network's keyword arguments; a dict with a 2-d ``attention_mask`` is checked.

    Returns
    -------
    bool
        Whether the batch was checked and holds padding (later batches, padded by the same
        collator, need no check).

    Raises
    ------
    ValueError
        Naming the rows, the ids found where the head reads and what to set.
    """
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[1] == 0:
        return False
    ids = inputs.get("input_ids")
    text, where = _text_config(net)
    pad = getattr(text, "pad_token_id", None)
    if isinstance(ids, Tensor) and (pad is None or ids.shape != mask.shape):
        return False  # no pad token: transformers refuses the batch itself
    padded = mask == 0
    if not bool(padded.any()):  # a synchronisation, until a batch with padding passed
        return False
    if isinstance(ids, Tensor):
        positions = torch.arange(ids.shape[1], device=ids.device)
        read = (positions * (ids != pad)).argmax(-1)  # transformers' own choice
    else:  # inputs_embeds: the last position
        read = torch.full(mask.shape[:1], mask.shape[1] - 1, device=mask.device)
    wrong = padded.gather(1, read[:, None]).squeeze(1) & ~padded.all(1)
    if not bool(wrong.any()):
        return True
    rows = flagged_examples(wrong)
    if isinstance(ids, Tensor):
        found = sorted(set(ids.gather(1, read[:, None]).squeeze(1)[wrong].tolist()))
        what = f"padded with token id(s) {found[:4]}, and {where}.pad_token_id is {pad}"
        fix = (
            f"Set {where}.pad_token_id to the id the batches are padded with "
            "(tokenizer.pad_token_id, the collator's), or pad with its id"
        )
    else:
        what = "given as inputs_embeds, where transformers reads the last position"
        fix = "Pass input_ids, or pad on the left (tokenizer.padding_side = 'left')"
    raise ValueError(
        f"FineTuneModel: {type(net).__name__} reads each row at its last token whose id is not "
        f"{where}.pad_token_id, and in rows {rows} of the batch (its S-fold copy under S "
        "draws) that token is padding "
        f"(attention_mask 0): the rows are {what}, so each would be scored as its padding, "
        f"not as itself. {fix}."
    )


def _warn_if_output_frozen_at_zero(net: nn.Module, point_params: Mapping[str, Tensor]) -> None:
    """Warn when the network's last ``nn.Linear`` (its output layer, in module order) is frozen
    with an all-zero weight: the output is then its bias for every input and every draw.

    torchvision initialises a new classification head to zeros (``VisionTransformer``'s
    ``heads.head``, ``SwinTransformer``'s ``head``) and names it so that
    ``trainable_modules="auto"`` (:func:`task_head_modules`) does not find it: left frozen,
    the adapter's updates never reach the output, and the fit learns nothing (a uniform
    predictive, a loss that does not move). Latent and adapted layers are not frozen."""
    inside = (LoRALinear, LoRAXSLinear)  # an adapted layer's frozen base and factors
    adapters = [path + "." for path, m in net.named_modules() if isinstance(m, inside)]
    linears = [
        (path, m)
        for path, m in net.named_modules()
        if isinstance(m, nn.Linear)
        and not isinstance(m, BatchedLinear)
        and not path.startswith(tuple(adapters))
    ]
    if not linears:
        return
    path, head = linears[-1]
    trained = {id(p) for p in point_params.values()}
    if any(id(p) in trained for p in head.parameters()) or bool(head.weight.any()):
        return
    warnings.warn(
        f"FineTuneModel: the network's last linear layer {path!r} ({head}), its output layer, "
        "is frozen with an all-zero weight (as torchvision initialises a new classification "
        "head), so the network's output is its bias for every input and every draw: the "
        "adapter cannot reach it and a fit learns nothing. Train it as a point estimate, "
        f"trainable_modules=[{path!r}] (trainable_modules='auto' takes the modules named "
        f"{list(HEAD_NAMES)} and the layers a Hugging Face task model adds), or make it latent "
        f"(latent_modules=[{path!r}]); build the model from a fresh copy of the network (this "
        "one was changed in place).",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _check_problem_type(net: nn.Module, likelihood: Likelihood) -> None:
    """Refuse a Hugging Face multi-label classifier or a regression head under the categorical
    likelihood, and a regression head under the multi-label (Bernoulli) one: each names the
    likelihood that reads the head's outputs as they are meant."""
    problem = getattr(getattr(net, "config", None), "problem_type", None)
    if problem == "regression" and (
        isinstance(likelihood, Categorical) or getattr(likelihood, "multi_label", False)
    ):
        raise ValueError(
            "FineTuneModel: the network's config.problem_type is 'regression' (its outputs "
            f"are real-valued targets), but the likelihood is {likelihood.name}, which reads "
            "them as class logits. Pass likelihood='gaussian' (with obs_scale=... or 'learn'), "
            "or build a classifier (problem_type='single_label_classification' or None)."
        )
    if problem == "multi_label_classification" and isinstance(likelihood, Categorical):
        raise ValueError(
            f"FineTuneModel: the network's config.problem_type is {problem!r} (a 0/1 target "
            "per label, any number of 1s per example), but the categorical likelihood models "
            "one class per example (a softmax over classes). Pass likelihood='bernoulli' "
            "(a sigmoid per label, as the model's own BCEWithLogitsLoss), or build a "
            "single-label classifier with problem_type='single_label_classification' (or None)."
        )


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


def _set_backbone_mode(net: nn.Module, mode: bool) -> None:
    """Put the frozen backbone in training ``mode`` (dropout active) or eval mode, keeping every
    normalisation layer that tracks running statistics (BatchNorm, InstanceNorm with
    ``track_running_stats``) in eval mode: in training mode it would update its statistics
    from every fit step's S-fold expanded batch, changing the frozen network, and those
    statistics are not saved with a posterior. It normalises with its pretrained statistics."""
    net.train(mode)
    if mode:
        for module in net.modules():
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
                module.eval()


def _unfuse_transformer_layers(net: nn.Module) -> None:
    """Turn off torch's fused inference path in every ``nn.TransformerEncoderLayer`` (and the
    nested-tensor path of every ``nn.TransformerEncoder``) that holds an adapted, latent or
    member layer.

    In eval mode a batch-first ``nn.TransformerEncoderLayer`` gathers its children's
    ``linear1.weight`` / ``norm1.weight`` ... for one fused kernel
    (``torch._transformer_encoder_layer_fwd``), and an ``nn.TransformerEncoder`` given a
    ``src_key_padding_mask`` gathers its first layer's for a nested tensor, reading the weights
    instead of calling the layers: an adapter layer, which keeps its weight in its frozen
    ``base``, failed there with an ``AttributeError`` (blamed on the adapted layer), and a
    latent layer's S draws would have reached the fused kernel. The unfused path (the layer's
    own ``forward`` of modules, used in training mode) computes the same function.
    ``activation_relu_or_gelu`` and ``use_nested_tensor`` are the flags torch's own checks read
    first (:mod:`torch.nn.modules.transformer`); the network's math is left as it is.
    """
    from .signorm import MemberNorm  # (signorm imports the modules that import this one)

    ours = (LoRALinear, LoRAXSLinear, BatchedLinear, MemberNorm)
    for module in net.modules():
        if not isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerEncoder)):
            continue
        if not any(isinstance(m, ours) for m in module.modules()):
            continue
        if isinstance(module, nn.TransformerEncoderLayer):
            module.activation_relu_or_gelu = 0
        else:
            module.use_nested_tensor = False
