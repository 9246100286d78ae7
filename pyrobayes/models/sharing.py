r"""Posterior draws for less than their forwards: shared prompt states and shared lower layers.

Two computations of the S-draw predictive repeat work that does not depend on the draw or the
choice, and this module runs that work once:

* **Prompt states shared across choices.** A causal LM scoring the K continuations
  :math:`c_{bk}` of one prompt :math:`x_b` (:mod:`pyrobayes.models.multiple_choice`) computes the
  keys and values of :math:`x_b` K times when the rows are full sequences. Causal attention makes
  the states of the prompt independent of what follows it, so the prompt runs once per draw,
  its last position gives the distribution of every choice's first token (one softmax for the
  K choices), its key/value cache is repeated over the K choices
  (``DynamicCache.batch_repeat_interleave``) and only the continuations but their last token run
  per choice; the output head and the vocabulary's softmax then run on the real continuation
  tokens only (not on the padding of the shorter ones) when the network's logits are its output
  embedding of the last hidden states (checked once per network). The positions of every
  token are those of the unshared rows, so the scores are the same function (Kwon et al.,
  2023, share prompt states across sequences in the same way for serving).
* **Layers below the first adapted layer once for all S draws.** When the latent sites all sit
  in layers ``i ≥ i_0`` of a network's stack of blocks (the demo's MiniLM adapts layers 3–5 of
  6), the embeddings and blocks ``< i_0`` see the same input under every draw. The network then
  runs on the B un-expanded rows and a forward pre-hook on block ``i_0`` expands its hidden
  states (and every per-row argument: BLOOM's ALiBi biases of ``rows·heads`` entries too)
  S-fold, sample-major, as :func:`pyrobayes.batch.expand_samples` would have done at the
  input. Where that is not the unshared computation the plain forward runs, and the reason is
  logged once per network (INFO): a block of the stack that runs more than once in a forward,
  or a lower block after a later one (ALBERT's shared layer groups and inner layers), a stack
  holding one module twice, an output that loses the S-fold rows (a pooled head indexing with
  the un-expanded ``input_ids``: LLaMA's and Qwen2's sequence classifiers) or a forward that
  fails on them (GPTBigCode reshapes its last hidden states to its input's shape), a one-row batch
  whose blocks take another one-row tensor (shared by the batch or the row's: the leading size
  cannot tell, :func:`_expand`), or a batch with as many rows as MPT has heads (its per-head
  ALiBi biases, shared by the batch, would be taken for the rows', :func:`_bias_refusal`).

Both are on by default wherever they apply (the prompt states in prediction, with gradients off)
and fall back to the plain computation otherwise; a network that cannot share prompts (no
key/value cache, ``logits_to_keep`` or ``position_ids``) and a batch whose rows reach past the
length at which the network's rotary frequencies change (``longrope``, ``dynamic``: the prompts
alone would be rotated otherwise than in the full rows) or whose prompts of different lengths,
left-padded for the prompt pass, would give NaN in float64 eager attention with sliding-window
layers (:func:`~pyrobayes.models.multiple_choice.eager_mask_refusal`) are logged once per
network (INFO). Where the prompts of a batch are not shared, its full rows still share the
layers below the first adapted one (:func:`prefix_plan` tells which, once per batch).
Inside :func:`reuse_within_batch`
(``pyrobayes.predict`` opens it) the lower layers' output of a batch is kept for all its chunks
of draws. In a fit the frozen lower blocks' output is kept per example across epochs
(:mod:`pyrobayes.models.lower_cache`). :func:`unshared` turns everything off (for reference
computations and benchmarks).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import batch_size, compute_dtype, expand_samples, image_tokens
from .layers import BatchedLinear, _AdapterBase
from .lower_cache import rope_length_limit, stubbed_below
from .multiple_choice import (
    SCORE_KEYS,
    accepts_argument,
    attend_trailing_padding,
    eager_attention_mask,
    eager_mask_refusal,
)
from .net_call import _RowsMismatch

logger = logging.getLogger(__name__)

__all__ = [
    "unshared",
    "sharing_enabled",
    "prefix_applies",
    "prefix_plan",
    "batch_prefix_plan",
    "prefix_shared_logits",
    "TokenLogProbs",
    "block_stack",
    "first_adapted_block",
    "lower_layers_shared",
    "lower_inputs",
    "reuse_within_batch",
    "batch_memo",
    "reusing_within_batch",
    "tokens_per_draw",
]

_STATE = threading.local()

#: Batch keys the prompt-sharing path understands (any other key: the plain path).
_PREFIX_KEYS = frozenset({"input_ids", "attention_mask", "position_ids", *SCORE_KEYS, "labels"})

#: Network arguments that feed the embeddings and the blocks (sliced to the un-expanded rows when
#: the lower layers are shared; anything else, e.g. ``logits_to_keep``, is read above the blocks):
#: token ids and their masks, and the inputs of audio and vision networks (Wav2Vec2's and
#: HuBERT's waveforms ``input_values``, Whisper's log-mel ``input_features``, an image
#: classifier's ``pixel_values``). Left S-fold, a waveform met its mask cut to the B rows in the
#: feature encoder's padding (an ``IndexError`` before the first adapted block: no fallback).
_LOWER_INPUTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "inputs_embeds",
    "input_values",
    "input_features",
    "pixel_values",
)


@contextlib.contextmanager
def unshared() -> Iterator[None]:
    """Within the block, compute every draw and choice from the full rows (no sharing), and
    every block of every training step (no lower-block cache in :func:`pyrobayes.fit`).

    Examples
    --------
    >>> with unshared():  # doctest: +SKIP
    ...     reference = model.batched_output(batch, values)
    """
    previous = getattr(_STATE, "off", False)
    _STATE.off = True
    try:
        yield
    finally:
        _STATE.off = previous


def sharing_enabled() -> bool:
    """Whether sharing is on in this thread (off inside :func:`unshared`)."""
    return not getattr(_STATE, "off", False)


# ---------------------------------------------------------------------- prompt states
def _prefix_layout(inputs: Mapping[str, Any]) -> dict[str, Tensor] | None:
    """The prompt and continuation tensors of a ``(B, K, L)`` multiple-choice batch, or ``None``
    when the K rows of a question do not share their prompt tokens and positions (a prompt
    truncated differently per choice, say)."""
    ids, mask, cont = inputs["input_ids"], inputs["attention_mask"], inputs["continuation_mask"]
    num, k_choices, length = (int(n) for n in ids.shape)
    real, cmask = mask.bool(), cont.bool()
    pos = inputs.get("position_ids")
    if not isinstance(pos, Tensor):
        pos = torch.arange(length, device=ids.device).expand(num, k_choices, length)
    prompt = real & ~cmask
    counts = prompt.sum(-1)  # (B, K)
    if not bool((counts == counts[:, :1]).all()) or bool((counts < 2).any()):
        return None  # a one-token prompt has nothing to cache before its last token
    if bool((cmask & ~real).any()):
        return None
    width = int(counts.max())
    # prompt tokens of every row first, in order (a stable sort), then the rest
    order = torch.argsort((~prompt).to(torch.int8), dim=-1, stable=True)[..., :width]
    p_ids, p_pos = torch.gather(ids, 2, order), torch.gather(pos, 2, order)
    slot = torch.arange(width, device=ids.device)
    p_valid = slot < counts[..., None]  # (B, K, W), right-padded
    if not bool((torch.where(p_valid, p_ids - p_ids[:, :1], 0) == 0).all()):
        return None
    if not bool((torch.where(p_valid, p_pos - p_pos[:, :1], 0) == 0).all()):
        return None
    shift = width - counts[:, 0]  # left padding of each prompt
    src = (slot[None, :] - shift[:, None]).clamp_min(0)  # (B, W)
    left = slot[None, :] >= shift[:, None]
    prompt_ids = torch.where(left, torch.gather(p_ids[:, 0], 1, src), 0)
    prompt_pos = torch.where(left, torch.gather(p_pos[:, 0], 1, src), 0)
    c_count = cmask.sum(-1)  # (B, K)
    c_width = int(c_count.max())
    c_order = torch.argsort((~cmask).to(torch.int8), dim=-1, stable=True)[..., :c_width]
    c_valid = torch.arange(c_width, device=ids.device) < c_count[..., None]
    return {
        "prompt_ids": prompt_ids,  # (B, W) left-padded
        "prompt_mask": left.to(mask.dtype),
        "prompt_pos": prompt_pos,
        "cont_ids": torch.where(c_valid, torch.gather(ids, 2, c_order), 0),  # (B, K, C)
        "cont_mask": c_valid.to(mask.dtype),
        "cont_pos": torch.where(c_valid, torch.gather(pos, 2, c_order), 0),
    }


#: Why prompts are not shared for a network, per network, each reason logged once (INFO).
_TOLD: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _tell(net: nn.Module, why: str) -> None:
    """Log (INFO, once per network and reason) that ``net``'s prompts run in the full rows."""
    told = _TOLD.setdefault(net, set())
    if why not in told:
        told.add(why)
        logger.info(
            "sharing: %s scores every choice from its full row (no shared prompt): %s",
            type(net).__name__,
            why,
        )


def _network_refusal(net: nn.Module) -> str | None:
    """Why ``net`` cannot run the shared prompts (no key/value cache, no per-row head gather,
    an argument the shared passes need), or ``None``."""
    if _cache_argument(net) is None:
        return "its forward takes no key/value cache (cache or past_key_values)"
    from . import likelihoods  # the prompt path yields the gathered head's output only

    if not likelihoods.head_positions_supported(net):
        return "its head does not gather per-row positions (logits_to_keep)"
    for name in ("use_cache", "position_ids", "attention_mask"):
        if not accepts_argument(net, name):
            return f"its forward takes no {name}"
    return None


def prefix_applies(net: nn.Module, likelihood: Any, inputs: Any) -> bool:
    """Whether :func:`prefix_shared_logits` may apply: sharing on, gradients off (prediction), a
    continuation likelihood, a ``(R, K, L)`` batch of known keys and a network taking a
    key/value cache and gathering its head per row (where it does not, the reason is logged
    once per network)."""
    if not sharing_enabled() or not getattr(likelihood, "continuations", False):
        return False
    if torch.is_grad_enabled():
        return False  # prediction only: a training step's recorded layer outputs (Kronecker
        # IVON's, say) are those of the full rows
    if not isinstance(inputs, Mapping) or not set(inputs) <= _PREFIX_KEYS:
        return False
    ids = inputs.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 3 or int(ids.shape[1]) < 2:
        return False
    if not isinstance(inputs.get("attention_mask"), Tensor):
        return False
    why = _network_refusal(net)
    if why is not None:
        _tell(net, why)
        return False
    return True


def prefix_plan(net: nn.Module, likelihood: Any, inputs: Any) -> dict[str, Tensor] | None:
    """The prompt and continuation layout :func:`prefix_shared_logits` runs ``inputs`` with, or
    ``None`` when it will not share their prompts: :func:`prefix_applies` is false, the choices
    of a question do not share their prompt, or the shared passes would not give the full rows'
    outputs for this batch (:func:`_layout_refusal`, logged once per network). The layers below
    the first adapted block are then shared by the full rows instead
    (:func:`lower_layers_shared`).

    Reading the layout synchronises with the device (its checks read the batch's values):
    compute it once per batch and hand it to :func:`prefix_shared_logits` (``layout``).

    Parameters
    ----------
    net : nn.Module
    likelihood : MultipleChoice
    inputs : dict of str to Tensor
        A (sample-expanded) ``(R, K, L)`` batch.

    Returns
    -------
    dict of str to Tensor or None
    """
    if not prefix_applies(net, likelihood, inputs):
        return None
    return _checked_layout(net, inputs)


def batch_prefix_plan(
    net: nn.Module, likelihood: Any, inputs: Any, copies: int = 1
) -> dict[str, Tensor] | None:
    """:func:`prefix_plan` of ``inputs`` expanded ``copies``-fold, sample-major
    (:func:`~pyrobayes.batch.expand_samples`), from the layout of the un-expanded ``inputs``.

    The layout is row-wise (each row's prompt and continuation are found from that row alone;
    the widths are the longest row's), so that of S copies of the rows is S copies of theirs.
    Inside :func:`reuse_within_batch` it is computed once per batch (kept in its
    :func:`batch_memo`): the chunks of draws of :func:`pyrobayes.predict`, each a fresh
    expansion, and the chunk sizing (:func:`tokens_per_draw`) share its synchronisations with
    the device.

    Parameters
    ----------
    net : nn.Module
    likelihood : MultipleChoice
    inputs : dict of str to Tensor
        The un-expanded ``(B, K, L)`` batch (the same object for every chunk of a batch).
    copies : int
        The draws the batch is expanded for.

    Returns
    -------
    dict of str to Tensor or None
        As :func:`prefix_plan` of the expanded batch.
    """
    if not prefix_applies(net, likelihood, inputs):
        return None
    memo = batch_memo(inputs, ("prompts", id(net), id(likelihood)))
    if memo is not None and "layout" in memo:
        layout: dict[str, Tensor] | None = memo["layout"]
    else:
        layout = _checked_layout(net, inputs)
        if memo is not None:
            memo["layout"] = layout
    if layout is None or copies == 1:
        return layout
    return {name: expand_samples(value, copies) for name, value in layout.items()}


def _checked_layout(net: nn.Module, inputs: Mapping[str, Any]) -> dict[str, Tensor] | None:
    """:func:`_prefix_layout` of ``inputs``, or ``None`` where it is ``None`` or
    :func:`_layout_refusal` refuses it (the reason logged once per network)."""
    layout = _prefix_layout(inputs)
    if layout is None:
        return None
    why = _layout_refusal(net, layout)
    if why is not None:
        _tell(net, why)
        return None
    return layout


def _layout_refusal(net: nn.Module, layout: Mapping[str, Tensor]) -> str | None:
    """Why the shared passes would not give the full rows' outputs for ``layout``
    (:func:`_rope_refusal`), or could not run: float64 eager attention whose left-padded prompts
    would give NaN (:func:`~pyrobayes.models.multiple_choice.eager_mask_refusal`; the prompts
    are left-padded whatever the batch's padding side); ``None`` when they apply."""
    why = _rope_refusal(net, layout)
    if why is not None:
        return why
    eager = eager_mask_refusal(net, layout["prompt_mask"])
    if eager is None:
        return None
    return (
        "its eager attention in float64 would give NaN on the prompts of different lengths, "
        f"left-padded for the prompt pass, and {eager}"
    )


def _rope_refusal(net: nn.Module, layout: Mapping[str, Tensor]) -> str | None:
    """Why the shared passes would rotate the batch's keys and queries otherwise than its full
    rows do (rotary frequencies chosen by each forward's largest position id: ``longrope``,
    ``dynamic``; the prompt pass stops at the prompts'), or ``None``."""
    limit = rope_length_limit(net)
    if limit is None:
        return None
    longest = int(torch.maximum(layout["prompt_pos"].max(), layout["cont_pos"].max())) + 1
    if longest <= limit:
        return None  # every pass, shared or full, keeps the short frequencies
    return (
        f"its rotary frequencies change past position {limit} (longrope or dynamic scaling) "
        f"and the batch reaches position {longest - 1}: the prompts alone would get others"
    )


def _cache_argument(net: nn.Module) -> str | None:
    """The name a causal LM takes its key/value cache by (``cache`` in transformers >= 5.x,
    ``past_key_values`` before), or ``None``."""
    for name in ("cache", "past_key_values"):
        if accepts_argument(net, name):
            return name
    return None


class TokenLogProbs:
    """Log-probabilities of the continuation tokens, ``values`` of shape ``(R·K, P)`` in the
    slots of :func:`~pyrobayes.models.multiple_choice.continuation_targets` (0 past a
    continuation): what :func:`prefix_shared_logits` returns when it applies the head to the
    continuation tokens only (the multiple-choice likelihood sums them)."""

    __slots__ = ("values",)

    def __init__(self, values: Tensor) -> None:
        self.values = values


#: Networks whose logits were checked to be their output embedding of the decoder's last
#: hidden states (``True``), or found not to be (``False``: a scaled or capped head).
_PLAIN_HEAD: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _output_head(net: nn.Module, body: nn.Module) -> nn.Module | None:
    """``net``'s output embedding when its logits are that layer of ``body``'s last hidden
    states (checked once per network), else ``None``."""
    getter = getattr(net, "get_output_embeddings", None)
    if body is net or not callable(getter):
        return None
    head = getter()
    if not isinstance(head, nn.Module) or _PLAIN_HEAD.get(net) is False:
        return None
    if any(isinstance(m, (_AdapterBase, BatchedLinear)) for m in head.modules()):
        return None  # per-draw head weights: its rows must stay sample-major (the full slots)
    return head


def _check_head(
    net: nn.Module, head: nn.Module, hidden: Tensor, kwargs: dict[str, Any]
) -> Tensor | None:
    r"""``None`` when ``net`` called with ``kwargs`` (its last position kept) gives ``head`` of
    the decoder's last ``hidden`` state, else those logits (a network that scales or caps its
    logits); the finding is kept per network.

    A soft cap :math:`c \tanh(z / c)` (Gemma-2's ``final_logit_softcapping``) moves logits
    :math:`|z| \ll c` by :math:`|z|^3 / 3c^2` only (5e-5 at :math:`|z| = 0.5`, :math:`c = 30`),
    below the comparison's tolerance on small logits: a configured cap is never plain."""
    logits = net(**kwargs, use_cache=False, logits_to_keep=1).logits[:, -1]
    plain = head(hidden)
    capped = getattr(getattr(net, "config", None), "final_logit_softcapping", None) is not None
    same = (
        not capped
        and logits.shape == plain.shape
        and torch.allclose(logits, plain, rtol=1e-4, atol=1e-4)
    )
    _PLAIN_HEAD[net] = bool(same)
    if not same:
        logger.info(
            "sharing: %s's logits are not its output embedding of the last hidden states; the "
            "head runs on every continuation slot.",
            type(net).__name__,
        )
    return None if same else logits


def prefix_shared_logits(
    net: nn.Module,
    likelihood: Any,
    inputs: Any,
    num_samples: int = 1,
    lower: tuple[nn.ModuleList, int] | None = None,
    layout: Mapping[str, Tensor] | None = None,
    copies: bool = False,
) -> Tensor | TokenLogProbs | None:
    r"""Head outputs at the positions a multiple-choice likelihood reads, with each prompt run
    once and its key/value cache shared by its K choices; ``None`` where this does not apply.

    Parameters
    ----------
    net : nn.Module
        A Hugging Face causal LM (takes ``past_key_values``, ``use_cache``, ``position_ids``).
    likelihood : MultipleChoice
        Scores continuations (``likelihood.continuations``).
    inputs : dict of str to Tensor
        A (sample-expanded) batch from :func:`~pyrobayes.models.encode_multiple_choice`:
        ``input_ids`` ``(R, K, L)``, left or right padded, ragged or not.
    num_samples : int
        Parameter sets swapped into ``net`` (sample-major: draw ``s`` owns rows
        ``s·R/S … (s+1)·R/S − 1``); when S does not divide R the sets are per row (the
        linearised predictive's per-row copies) and the prompts are not shared.
    lower : (blocks, i0), optional
        The network's stack of blocks and its first adapted block
        (:func:`first_adapted_block`): the blocks below ``i0`` then run the prompts and the
        continuations once for the S draws (on sample 0's rows; :func:`lower_layers_shared`
        expands them at block ``i0``), and their key/value cache holds those rows only.
    layout : dict of str to Tensor, optional
        :func:`prefix_plan` of ``inputs`` when the caller computed it (not computed again: no
        second synchronisation with the device).
    copies : bool
        ``inputs`` are known to be ``num_samples`` sample-major copies of their first rows
        (the caller expanded them: :func:`~pyrobayes.batch.expand_samples`), so they are not
        compared (a synchronisation with the device per tensor of the batch).

    Returns
    -------
    TokenLogProbs, Tensor `(R·K, P, V)` or None
        The continuation tokens' log-probabilities (:class:`TokenLogProbs`) when ``net``'s
        logits are its output embedding of the decoder's last hidden states: the head and the
        vocabulary's softmax then run on the continuation tokens only, not on the padding slots
        of the shorter continuations. Otherwise slot ``j`` of row ``r·K + k`` holds the logits
        predicting continuation token ``j``, as the head-gathered output of the full rows
        (slots past a continuation hold finite logits the likelihood masks).
        ``None`` when the batch has other keys, the network is not a cached causal LM, or the
        choices of a question do not share their prompt tokens.
    """
    if layout is None and not prefix_applies(net, likelihood, inputs):
        return None
    if int(inputs["input_ids"].shape[0]) % num_samples:
        return None  # one parameter set per choice row: a prompt row would have K of them
    layout = _checked_layout(net, inputs) if layout is None else layout
    if layout is None:
        return None
    num, k_choices = (int(n) for n in inputs["input_ids"].shape[:2])
    # lower blocks shared: the network runs on sample 0's rows, expanded S-fold at block i0
    draws = num_samples if lower is not None and num_samples > 1 else 1
    if draws > 1 and not (copies or _sample_copies(inputs, draws)):
        draws = 1  # rows of different examples (per-row parameter sets): nothing to share
    if draws > 1 and lower is not None and _lower_declined(lower, num // draws, draws):
        draws = 1  # known not to apply to this network (logged once)
    if draws > 1:
        try:
            return _prefix_pass(net, layout, num, k_choices, draws, lower)
        except _RowsMismatch:
            pass  # a block of the stack runs twice, say (logged once): every row runs them
    return _prefix_pass(net, layout, num, k_choices, 1, None)


def _prefix_pass(
    net: nn.Module,
    layout: Mapping[str, Tensor],
    num: int,
    k_choices: int,
    draws: int,
    lower: tuple[nn.ModuleList, int] | None,
) -> Tensor | TokenLogProbs:
    """:func:`prefix_shared_logits` of the ``num`` rows of ``layout``, the blocks below the
    first adapted one run once for ``draws`` draws (on sample 0's rows)."""
    rows = num // draws

    def shared(width: int) -> contextlib.AbstractContextManager[None]:
        # one context per forward: lower_layers_shared checks that each block runs once
        if draws == 1 or lower is None:
            return contextlib.nullcontext()
        blocks = list(lower[0])
        return lower_layers_shared(blocks[lower[1] :], rows * width, draws, blocks[: lower[1]])

    # the whole prompt once per row (left-padded: its last token in the last column), whose last
    # position predicts every choice's first token; then the continuations but their last token
    safe = eager_attention_mask(net, layout["prompt_mask"][:rows])  # float64 eager: no NaN
    prompt = {
        "input_ids": layout["prompt_ids"][:rows],
        "attention_mask": layout["prompt_mask"][:rows] if safe is None else safe,
        "position_ids": layout["prompt_pos"][:rows],
    }
    body = getattr(net, "base_model", net)  # the decoder without the LM head, when separate
    head = _output_head(net, body)
    with shared(1):
        if head is None:  # the network's own head, at the positions read
            out = net(**prompt, use_cache=True, logits_to_keep=1)
            first = out.logits[:, -1]  # (R, V)
        else:
            out = body(**prompt, use_cache=True)
            first = out.last_hidden_state[:, -1]  # (R, H): the head runs below, with the rest
    if head is not None and net not in _PLAIN_HEAD:
        with shared(1):
            logits = _check_head(net, head, first, prompt)
        if logits is not None:  # not the plain head: the network's own logits
            head, first = None, logits
    cache = getattr(out, "cache", None)
    cache = out.past_key_values if cache is None else cache
    with shared(k_choices):
        rest = _continuation_pass(net if head is None else body, cache, layout, k_choices, rows)
    if head is None:
        slots = [first.unsqueeze(1).repeat_interleave(k_choices, 0)]  # (R·K, 1, V)
        return torch.cat(slots if rest is None else [*slots, rest.logits], dim=1)
    valid = layout["cont_mask"].reshape(num * k_choices, -1).bool()  # slot j: token j
    tokens = layout["cont_ids"].reshape(num * k_choices, -1)
    later = valid[:, 1:]  # slots 1..: the real continuation tokens only (no padding slots)
    states = first if rest is None else torch.cat([first, rest.last_hidden_state[later]])
    # one head call over (R + N, V): each prompt's row is read at its K choices' first tokens
    # (one softmax per prompt), each later row at its own token (repeated to K columns)
    read = tokens[:, 0].reshape(num, k_choices)
    if rest is not None:
        read = torch.cat([read, tokens[:, 1:][later].unsqueeze(-1).expand(-1, k_choices)])
    log_probs = head_log_probs(head, states, read)
    values = torch.zeros(valid.shape, dtype=log_probs.dtype, device=log_probs.device)
    values[:, 0] = log_probs[:num].reshape(-1)
    if rest is not None:
        values[:, 1:] = values[:, 1:].masked_scatter(later, log_probs[num:, 0])
    return TokenLogProbs(values)


#: Logits per vocabulary block of :func:`head_log_probs` on the CPU: 2^20 (4 MiB in float32)
#: stay in cache from the matrix product through the log-sum-exp and the gather.
_HEAD_BLOCK_LOGITS = 1 << 20


def head_log_probs(head: nn.Module, states: Tensor, tokens: Tensor) -> Tensor:
    r"""``log_softmax(head(states))`` read at ``tokens`` ``(R, m)``, in float32 at least.

    An ``nn.Linear`` head on the CPU runs over blocks of its vocabulary, each block's logits
    reduced while they are in cache, :math:`\log p_{rv} = z_{rv} - \operatorname{logsumexp}_b
    \operatorname{logsumexp}_{u \in b} z_{ru}`: the R x V logits are never written out (for a
    49,152-token vocabulary 1.35x faster than one product and a log-softmax over them, on one
    core). Elsewhere (a GPU, another head): one call and a log-softmax.
    """
    dtype = compute_dtype(states.dtype)
    if type(head) is not nn.Linear or states.device.type != "cpu":
        logits = head(states)  # in float32 at least: bf16 rounds a token's log-probability
        return torch.log_softmax(logits, dim=-1, dtype=compute_dtype(logits.dtype)).gather(
            -1, tokens
        )
    weight, bias = head.weight, head.bias
    vocab = int(weight.shape[0])
    width = min(vocab, max(1024, _HEAD_BLOCK_LOGITS // max(1, int(states.shape[0]))))
    starts = range(0, vocab, width)
    block_lse = torch.empty((states.shape[0], len(starts)), dtype=dtype)
    picked = torch.zeros(tokens.shape, dtype=dtype)
    for n, start in enumerate(starts):
        stop = min(vocab, start + width)
        part = None if bias is None else bias[start:stop]
        logits = nn.functional.linear(states, weight[start:stop], part).to(dtype)
        block_lse[:, n] = logits.logsumexp(-1)
        inside = (tokens >= start) & (tokens < stop)
        local = (tokens - start).clamp(0, stop - start - 1)
        picked = torch.where(inside, logits.gather(-1, local), picked)
    return picked - block_lse.logsumexp(-1, keepdim=True)


def _sample_copies(inputs: Mapping[str, Any], draws: int) -> bool:
    """Whether every tensor of ``inputs`` is ``draws`` copies of its first ``1/draws`` rows
    (a sample-major expanded batch)."""
    for value in inputs.values():
        if isinstance(value, Tensor) and value.dim() > 0:
            copies = value.reshape(draws, -1, *value.shape[1:])
            if not bool((copies == copies[:1]).all()):
                return False
    return True


def _continuation_pass(
    model: nn.Module, cache: Any, layout: Mapping[str, Tensor], k_choices: int, num: int
) -> Any:
    """``model`` on each choice's continuation but its last token for the first ``num``
    prompts, from the prompt's key/value ``cache`` repeated over the K choices; ``None`` when
    every continuation is one token."""
    rows = num * k_choices
    if int(layout["cont_ids"].shape[-1]) < 2:
        return None
    cache.batch_repeat_interleave(k_choices)

    def flat(name: str) -> Tensor:
        return layout[name][:num].reshape(rows, -1)[:, :-1]

    mask = torch.cat(
        [layout["prompt_mask"][:num].repeat_interleave(k_choices, 0), flat("cont_mask")], dim=1
    )
    # float64 eager sliding-window layers: padding slots past a window would see no key (NaN)
    mask = attend_trailing_padding(model, mask)
    return model(
        input_ids=flat("cont_ids"),
        attention_mask=mask,
        position_ids=flat("cont_pos"),
        use_cache=True,
        **{str(_cache_argument(model)): cache},
    )


def tokens_per_draw(
    net: nn.Module, likelihood: Any, inputs: Any, lower: tuple[nn.ModuleList, int] | None
) -> int | None:
    """Token positions one more draw costs on ``inputs`` once the shared work is done: the
    prompts and continuations of :func:`prefix_shared_logits`, or every token (an image's
    patches: :func:`~pyrobayes.batch.image_tokens`), scaled by the share of blocks at or
    above the first adapted one when the lower ones are shared; ``None`` when nothing is
    shared (the plain rows' tokens, then).

    The lower blocks are looked up as the forward shares them: on the R prompts when the
    prompts are shared (:func:`prefix_shared_logits`), else on the network's rows (R·K for K
    choices a row each, ``likelihood.rows_per_output``), whose known refusals
    (:func:`_refusal`: a batch of as many rows as MPT has heads, say) are per row count."""
    if not sharing_enabled():
        return None
    images = image_tokens(inputs)
    if images is not None:  # the lower blocks on the B images, once for every draw
        if lower is None or _lower_declined(lower, batch_size(inputs), 2):
            return None
        return _upper_share(images, lower)
    if not isinstance(inputs, Mapping):
        return None
    ids = inputs.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() == 0:
        return None
    tokens, rows = None, int(ids.shape[0])
    layout = batch_prefix_plan(net, likelihood, inputs)  # the forwards' own, in pb.predict
    if layout is not None:
        tokens = layout["prompt_ids"].numel() + layout["cont_ids"][..., 1:].numel()
    else:
        per_output = getattr(likelihood, "rows_per_output", None)
        rows *= (per_output(inputs) if callable(per_output) else None) or 1
    if lower is None or _lower_declined(lower, rows, 2):
        return tokens  # (lower blocks known not to be shared for this network)
    return _upper_share(int(ids.numel()) if tokens is None else tokens, lower)


def _upper_share(tokens: int, lower: tuple[nn.ModuleList, int]) -> int:
    """``tokens`` scaled by the share of ``lower``'s blocks at or above the first adapted one
    (rounded up): the work a draw adds once the blocks below run for all draws."""
    blocks, first = lower
    return max(1, -(-tokens * (len(blocks) - first) // len(blocks)))


# ---------------------------------------------------------------------- lower layers
def block_stack(
    net: nn.Module, param_names: Sequence[str] | None = None
) -> nn.ModuleList | nn.Sequential | None:
    """The network's stack of blocks: the longest list of two or more modules of one type that
    each have a forward, held in an ``nn.ModuleList`` or in an ``nn.Sequential`` that chains
    them (its own forward: block ``i`` takes block ``i - 1``'s output; torchvision's
    ``VisionTransformer`` keeps its encoder blocks in ``encoder.layers``, ResNet and Swin the
    blocks of their stages in plain ``nn.Sequential`` containers). A subclass of
    ``nn.Sequential`` with a forward of its own is not known to chain its members and is not a
    stack.

    Parameters
    ----------
    net : nn.Module
    param_names : list of str, optional
        Names (in ``net``) of the parameters that change with the draw: the longest of the
        stacks holding every one of them in its blocks (of equal lengths, the outermost), so that
        a longer list elsewhere (Wav2Vec2's convolutional feature encoder, longer than a small
        transformer's layer list; a mixture of experts' per-layer experts) is not taken for it.
        ``None``: the longest stack (of equal lengths, the first in ``net.modules()``).

    Returns
    -------
    nn.ModuleList or nn.Sequential or None
    """
    best: nn.ModuleList | nn.Sequential | None = None
    for path, module in net.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or not _is_stack(module):
            continue
        if best is not None and len(module) <= len(best):
            continue
        if param_names is not None and not _holds(module, path, param_names):
            continue
        best = module
    return best


def _is_stack(module: nn.ModuleList | nn.Sequential) -> bool:
    """Whether ``module`` holds two or more modules of one type, each with a forward of its own
    (not a list of lists), in an ``nn.ModuleList`` or a chaining ``nn.Sequential``."""
    if isinstance(module, nn.Sequential) and type(module).forward is not nn.Sequential.forward:
        return False  # its own forward: the members may not run as a chain
    kinds = {type(member) for member in module}
    if len(module) < 2 or len(kinds) != 1:
        return False
    return next(iter(kinds)).forward is not nn.Module.forward


def _holds(stack: nn.Module, path: str, param_names: Sequence[str]) -> bool:
    """Whether every name of ``param_names`` is a parameter's inside a block of ``stack``, the
    module at ``path`` in the network."""
    prefixes = tuple(
        f"{path}.{name}." if path else f"{name}." for name, _ in stack.named_children()
    )
    return bool(param_names) and all(name.startswith(prefixes) for name in param_names)


def first_adapted_block(
    net: nn.Module, param_names: Sequence[str]
) -> tuple[nn.ModuleList, int] | None:
    """``net``'s stack of blocks holding ``param_names`` (:func:`block_stack`; the blocks of an
    ``nn.Sequential`` in an ``nn.ModuleList`` of their own, not attached to ``net``) and the
    index of the first block holding one of them, or ``None`` when no stack holds them all or
    they are not all in blocks above the first (nothing to share).

    Parameters
    ----------
    net : nn.Module
    param_names : list of str
        Names (in ``net``) of the parameters that change with the draw.
    """
    blocks = block_stack(net, param_names) if param_names else None
    if blocks is None:
        return None
    if len({id(block) for block in blocks}) != len(blocks):
        logger.debug("sharing: %s's stack of blocks holds one module twice", type(net).__name__)
        return None  # one block at two depths: its output at the cut is not the next input
    paths = {id(module): name for name, module in net.named_modules()}
    # by name, not by identity: inside a forward the sites hold swapped-in draws
    prefixes = [paths[id(block)] + "." for block in blocks]
    indices = []
    for name in param_names:
        owner = [i for i, prefix in enumerate(prefixes) if name.startswith(prefix)]
        if not owner:
            return None  # a site outside the blocks (embeddings, head): nothing below it
        indices.append(owner[0])
    first = min(indices)
    if first == 0:
        return None
    return (blocks if isinstance(blocks, nn.ModuleList) else nn.ModuleList(blocks)), first


#: Why the lower layers are not shared below a first adapted block (weakly keyed by that block:
#: per network and cut), by kind: ``"order"`` a block of the stack runs more than once in a
#: forward, or a lower block after a later one (ALBERT's shared layer groups): never shared;
#: ``"rows"`` the network's output does not keep the expanded rows (a pooled head indexing with
#: the un-expanded ``input_ids``): not for S > 1; ``"one_row"`` a one-row batch's block
#: arguments are ambiguous (see :func:`_ambiguous`): not for one row and S > 1; ``"size=R"`` a
#: batch of R rows whose block arguments are ambiguous (see :func:`_bias_refusal`): not for R rows
#: and S > 1.
_DECLINED: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def _refusal(block: nn.Module, rows: int, num_samples: int) -> str | None:
    """Why the layers below ``block`` are known not to be shared for ``rows`` rows and
    ``num_samples`` draws, or ``None``."""
    reasons = _DECLINED.get(block, {})
    if "order" in reasons:
        return reasons["order"]
    if num_samples > 1 and "rows" in reasons:
        return reasons["rows"]
    if num_samples > 1 and rows == 1 and "one_row" in reasons:
        return reasons["one_row"]
    if num_samples > 1 and f"size={rows}" in reasons:
        return reasons[f"size={rows}"]
    return None


def _lower_declined(lower: tuple[nn.ModuleList, int], rows: int, num_samples: int) -> bool:
    """Whether the layers below ``lower``'s first adapted block are known not to be shared."""
    blocks, first = lower
    return _refusal(blocks[first], rows, num_samples) is not None


def _decline(block: nn.Module, kind: str, why: str) -> Exception:
    """Remember (once per network and kind, logged) why the layers below ``block`` are not
    shared; the exception to raise so that the caller runs the plain forward."""
    reasons = _DECLINED.setdefault(block, {})
    if kind not in reasons:
        reasons[kind] = why
        logger.info(
            "sharing: the layers below %s run for every draw%s: %s",
            type(block).__name__,
            _scope(kind),
            why,
        )
    return _RowsMismatch(why)


def _scope(kind: str) -> str:
    """The batches a decline of ``kind`` applies to, as the log line says it."""
    if kind.startswith("size="):
        return f" on batches of {kind.removeprefix('size=')} rows"
    return {"order": "", "rows": " (S > 1)", "one_row": " on one-row batches"}[kind]


def _hidden_states(args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """A block's hidden states: its first argument (Hugging Face blocks), or ``hidden_states``."""
    return args[0] if args else kwargs.get("hidden_states")


def _ambiguous(value: Any, hidden: Any) -> bool:
    """Whether ``value`` holds a tensor (of two or more dims) with one leading row other than
    the ``hidden`` states: with a one-row batch it may carry the batch's row (a 2-d attention
    mask) or be shared by the batch (DeBERTa's ``relative_pos`` ``(1, L, L)``)."""
    if isinstance(value, Tensor):
        return value is not hidden and value.dim() >= 2 and int(value.shape[0]) == 1
    if isinstance(value, (tuple, list)):
        return any(_ambiguous(v, hidden) for v in value)
    return False


#: Block keywords whose tensor holds ``k`` entries per row, row-major: ``(rows·k, ...)``, row
#: ``r``'s at ``r·k … r·k + k − 1``. BLOOM's ALiBi biases (Press et al., 2022) ``alibi``,
#: ``(rows·heads, 1, L)`` (transformers' ``build_alibi_tensor`` flattens ``(rows, heads)``):
#: the S-fold sample-major rows' is the whole tensor repeated S times.
_ROW_MAJOR_KEYWORDS = frozenset({"alibi"})


def _bias_refusal(kwargs: Mapping[str, Any], rows: int) -> str | None:
    """Why a block's arguments cannot be expanded for ``rows`` rows, or ``None``: a 3-d
    ``position_bias`` of ``rows`` leading entries may be MPT's per-head ALiBi biases
    ``(heads, 1, max_seq_len)``, shared by the batch (a network with as many heads as the batch
    has rows), or a bias per row; the leading size cannot tell."""
    bias = kwargs.get("position_bias")
    if isinstance(bias, Tensor) and bias.dim() == 3 and int(bias.shape[0]) == rows:
        return (
            f"its 3-d position_bias {tuple(bias.shape)} has as many entries as the batch has "
            "rows: per-head biases shared by the batch (MPT's ALiBi) or the rows', the leading "
            "size cannot tell"
        )
    return None


def _expand_arguments(
    args: tuple, kwargs: Mapping[str, Any], rows: int, num_samples: int
) -> tuple[tuple, dict[str, Any]]:
    """A block's arguments for the S-fold rows (:func:`_expand`); the tensors of
    :data:`_ROW_MAJOR_KEYWORDS` by their ``rows·k`` entries."""
    expanded = {
        k: _expand(v, rows, num_samples, per_row=k in _ROW_MAJOR_KEYWORDS)
        for k, v in kwargs.items()
    }
    return _expand(args, rows, num_samples), expanded


def _expand(value: Any, rows: int, num_samples: int, per_row: bool = False) -> Any:
    """Sample-major S-fold copy of every tensor (of two or more dims) holding ``rows`` rows
    (with ``per_row``, ``rows·k`` entries, ``k`` per row, row-major).

    A block's tensor arguments either carry the batch's rows (hidden states, attention masks,
    per-row positions and rotary embeddings) or are shared by the batch (DeBERTa's relative
    positions and embeddings): only the leading size tells them apart, so with ``rows == 1``
    (ambiguous) :func:`lower_layers_shared` does not share unless the hidden states are the only
    one-row tensor (:func:`_ambiguous`). With ``rows > 1`` a tensor shared by the batch is
    copied only if it holds exactly ``rows`` entries (DeBERTa's ``rel_embeddings`` of
    ``2·position_buckets`` rows: harmless, its layers read the first ``2·position_buckets``,
    sample 0's copy). A block keyword whose tensor is known to hold ``k`` entries per row,
    row-major (``per_row``: BLOOM's ALiBi biases, :data:`_ROW_MAJOR_KEYWORDS`), is repeated
    whole: sample ``s``'s row ``r`` is then entry block ``s·rows + r``, as in the expanded batch.
    """
    if isinstance(value, Tensor):
        size = int(value.shape[0]) if value.dim() >= 2 else 0
        if size == rows or (per_row and size > 0 and size % rows == 0):
            return (
                value.unsqueeze(0).expand(num_samples, *value.shape).reshape(-1, *value.shape[1:])
            )
        return value
    if isinstance(value, tuple):
        return tuple(_expand(v, rows, num_samples, per_row) for v in value)
    if isinstance(value, list):
        return [_expand(v, rows, num_samples, per_row) for v in value]
    return value


@contextlib.contextmanager
def lower_layers_shared(
    blocks: Sequence[nn.Module],
    rows: int,
    num_samples: int,
    below: Sequence[nn.Module] = (),
    recorded: dict[str, Any] | None = None,
) -> Iterator[None]:
    """Within the block, the inputs of ``blocks`` with ``rows`` rows are expanded S-fold
    (sample-major): the hidden states at the first, and at every block the arguments its stack
    computed once for the un-expanded rows (attention masks, rotary embeddings).

    The block holds one forward of the network. That forward raises the callers' fallback
    exception (``net_call._RowsMismatch``: the plain forward then runs) when sharing does not
    give the unshared computation, and the reason is kept per network and logged once, so that
    later calls fall back on entry: a block of the stack runs more than once, or a block of
    ``below`` after a later block (ALBERT's layer groups and inner layers: the lower blocks'
    output at the cut is not the first adapted block's input), or the network's output loses
    the expanded rows (a head that reads the un-expanded inputs), or fails on them once the
    first adapted block took them (a ``RuntimeError``: GPTBigCode views its last hidden states
    to the shape of its un-expanded ``input_ids``; an ``IndexError``: GPT-NeoX's sequence
    classifier indexes its logits by them), or a one-row batch whose block arguments
    cannot be told to carry the row or not (:func:`_expand`).

    Parameters
    ----------
    blocks : list of nn.Module
        The first adapted block and those above it (:func:`first_adapted_block`).
    rows : int
        Rows of the un-expanded batch the network is called on.
    num_samples : int
        S, the draws of the adapted blocks above.
    below : list of nn.Module
        The blocks under the first adapted one, in order (the rest of the stack).
    recorded : dict, optional
        Memory of the lower blocks' output for these inputs (:func:`reuse_within_batch`): when
        it holds ``"below"``, the blocks in ``below`` return it without computing (their input
        is the same as when it was recorded); otherwise the last of them records its output.
    """
    if not blocks:
        yield
        return
    key = blocks[0]
    why = _refusal(key, rows, num_samples)
    if why is not None:
        raise _RowsMismatch(why)
    stack = [*below, *blocks]
    if len({id(block) for block in stack}) != len(stack):
        raise _decline(key, "order", "the stack of blocks holds one module twice")
    position = {id(block): i for i, block in enumerate(stack)}
    ran: list[int] = []  # the stack's blocks called so far in this forward
    declined: list[bool] = []
    expanded: list[bool] = []  # the first adapted block took the S-fold rows

    def refuse(kind: str, why: str) -> Exception:
        declined.append(True)
        return _decline(key, kind, why)

    def in_order(module: nn.Module) -> None:
        i = position[id(module)]
        if ran and i <= ran[-1]:
            again = "more than once in a forward" if i in ran else f"after block {ran[-1]}"
            raise refuse("order", f"block {i} of the stack runs {again}")
        ran.append(i)

    def check(module: nn.Module, args: tuple) -> None:
        in_order(module)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        in_order(module)
        if rows == 1 and num_samples > 1:
            hidden = _hidden_states(args, kwargs)
            known = {k: v for k, v in kwargs.items() if k not in _ROW_MAJOR_KEYWORDS}
            if _ambiguous(args, hidden) or _ambiguous(tuple(known.values()), hidden):
                raise refuse(
                    "one_row",
                    "a one-row tensor argument may be shared by the batch or be the row's",
                )
        why = _bias_refusal(kwargs, rows) if num_samples > 1 else None
        if why is not None:
            raise refuse(f"size={rows}", why)
        expanded.append(True)
        return _expand_arguments(args, kwargs, rows, num_samples)

    def record(module: nn.Module, args: tuple, output: Any) -> None:
        if recorded is not None:
            recorded["below"] = output

    handles = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in blocks]
    handles += [block.register_forward_pre_hook(check) for block in below]
    try:
        with contextlib.ExitStack() as stack_:
            if recorded is not None and below:
                if "below" in recorded:
                    stack_.enter_context(stubbed_below(below, recorded["below"]))
                else:
                    handles.append(below[-1].register_forward_hook(record))
            try:
                yield
            except _RowsMismatch:
                if not declined and num_samples > 1:  # raised by the caller: rows lost
                    _decline(key, "rows", "the network's output does not keep the S-fold rows")
                raise
            except (RuntimeError, IndexError, AssertionError) as err:  # S-fold rows: plain runs
                oom = isinstance(err, torch.OutOfMemoryError)  # (plain needs more, not less)
                if declined or not expanded or num_samples == 1 or oom:
                    raise  # (where it fails of its own, it raises again)
                why = f"the network's forward fails on the S-fold rows: {err}"
                raise _decline(key, "rows", why) from err
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def reuse_within_batch() -> Iterator[None]:
    """Within the block, calls on the same inputs object (the chunks of draws of one batch in
    :func:`pyrobayes.predict`) compute the layers below the first adapted one, and the prompt
    layout (:func:`batch_prefix_plan`), only once.

    The parameters of those layers must not change inside the block (prediction).
    """
    previous = getattr(_STATE, "memo", None)
    _STATE.memo = {}
    try:
        yield
    finally:
        _STATE.memo = previous


def reusing_within_batch() -> bool:
    """Whether :func:`reuse_within_batch` is active (and sharing on) in this thread."""
    return getattr(_STATE, "memo", None) is not None and sharing_enabled()


def batch_memo(inputs: Any, key: Any) -> dict[str, Any] | None:
    """The memory of work shared by the calls on ``inputs`` under ``key`` inside
    :func:`reuse_within_batch` (created on first use), or ``None`` outside it or with sharing
    off. The keys of one inputs object are kept together; another inputs object clears them
    (one batch at a time)."""
    memo = getattr(_STATE, "memo", None)
    if memo is None or not sharing_enabled():
        return None
    entry = memo.get(key)
    if entry is None or entry["inputs"] is not inputs:
        if any(held["inputs"] is not inputs for held in memo.values()):
            memo.clear()  # one batch at a time (the keys of this one are kept together)
        entry = {"inputs": inputs}  # holds the inputs: their id is not reused meanwhile
        memo[key] = entry
    return entry


def lower_inputs(net: nn.Module, net_inputs: Any, rows: int, num_samples: int) -> Any:
    """``net_inputs`` of a sample-expanded batch (``num_samples`` copies of ``rows`` rows) with
    the arguments that feed the lower layers cut to the first ``rows`` rows (sample 0's: every
    sample's are the same rows).

    A Hugging Face model's arguments are known by name (:data:`_LOWER_INPUTS`). A plain
    network's keywords are its author's own (a ``src_key_padding_mask`` passed through an
    ``nn.TransformerEncoder``, a second input): every tensor of the S·B rows is cut, so that
    the lower blocks see one draw's rows throughout (left S-fold, such a mask met the cut
    token ids in torch's shape check). One read above the blocks then meets the S-fold hidden
    states, fails on their rows, and the plain forward runs (:func:`lower_layers_shared`).
    Positional inputs (a tensor, a tuple or a list: the images of torchvision's ``(x, y)``
    batches) are a plain network's too: every tensor of the S·B rows is cut."""
    named = getattr(net, "base_model_prefix", None) is not None
    expanded = rows * num_samples

    def cut(key: str | None, value: Any) -> bool:
        if not isinstance(value, Tensor) or value.dim() == 0:
            return False
        if named and key is not None:
            return key in _LOWER_INPUTS
        return int(value.shape[0]) == expanded

    if isinstance(net_inputs, Tensor):
        return net_inputs[:rows] if cut(None, net_inputs) else net_inputs
    if isinstance(net_inputs, (tuple, list)):
        values = [v[:rows] if cut(None, v) else v for v in net_inputs]
        return tuple(values) if isinstance(net_inputs, tuple) else values
    return {k: v[:rows] if cut(k, v) else v for k, v in net_inputs.items()}
