"""The checks on the network :class:`~pyrobayes.models.FineTuneModel` wraps, at construction.

:func:`task_head_modules`, the modules ``trainable_modules="auto"`` point-estimates, and the
refusals of a network the model cannot run as asked: a sequence classifier without a pad token,
a regression or multi-label head under the categorical likelihood, and gradient checkpointing
under a training backbone.
"""

from __future__ import annotations

import contextlib
import inspect

from torch import nn

from .likelihoods import MULTI_LABEL_ADVICE, Categorical, Likelihood

__all__ = ["HEAD_NAMES", "task_head_modules"]

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
