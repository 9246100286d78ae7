r"""Multiple choice on causal LMs: encoding prompts with continuations, and scoring them.

A choice :math:`k` of example :math:`b` is a continuation :math:`c_{bk} = (c_1, …, c_{T_{bk}})`
of the prompt :math:`x_b`; under parameters :math:`θ` it scores

.. math::

    s_{bk}(θ) = \frac{1}{n_{bk}} \sum_{t=1}^{T_{bk}} \log p_θ(c_t \mid x_b, c_{<t}),

with :math:`n_{bk} = 1` (``normalize="none"``), the number of continuation tokens
:math:`T_{bk}` (``"length"``) or the number of characters of the choice (``"chars"``, the
``acc_norm`` of lm-evaluation-harness; Gao et al. 2021, "A framework for few-shot language model
evaluation"). The likelihood of the answer is :math:`y_b \sim \operatorname{Categorical}
(\operatorname{softmax}_k s_{bk}(θ))`.

The batch carries ``input_ids``, ``attention_mask`` and ``continuation_mask`` of shape
``(B, K, L)`` (prompt then continuation, one row per choice), ``labels`` ``(B,)`` and, for
``"chars"``, ``continuation_chars`` ``(B, K)``. The network sees the ``B·K`` rows flattened; its
output head is applied only at the positions the scores read (the position before each
continuation token), through ``logits_to_keep`` when the network accepts it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import compute_dtype
from ..user_frame import user_stacklevel

__all__ = [
    "encode_multiple_choice",
    "continuation_targets",
    "continuation_scores",
    "last_positions",
    "head_positions_supported",
    "NORMALIZATIONS",
    "SCORE_KEYS",
]

#: Accepted ``normalize`` values of the continuation scores.
NORMALIZATIONS = ("none", "length", "chars")

#: Batch keys read by the likelihood and never handed to the network.
SCORE_KEYS = ("continuation_mask", "continuation_chars", "choice_mask")


_FORWARD_ARGUMENTS: dict[type, frozenset[str]] = {}


def _forward_arguments(cls: type) -> frozenset[str]:
    """Argument names of ``cls.forward`` (looked up once per class)."""
    names = _FORWARD_ARGUMENTS.get(cls)
    if names is None:
        try:
            names = frozenset(inspect.signature(cls.forward).parameters)  # type: ignore[attr-defined]
        except (TypeError, ValueError, AttributeError):
            names = frozenset()
        _FORWARD_ARGUMENTS[cls] = names
    return names


@functools.lru_cache(maxsize=1)
def _transformers_gathers_per_row() -> bool:
    """Whether the installed transformers takes a ``(rows, P)`` position tensor as
    ``logits_to_keep`` (``slice_logits_to_keep``); older versions index with it as one tensor."""
    try:
        from transformers import modeling_utils
    except ImportError:
        return False
    return hasattr(modeling_utils, "slice_logits_to_keep")


def head_positions_supported(net: nn.Module) -> bool:
    """Whether ``net`` applies its output head only at given per-row positions
    (a Hugging Face causal LM taking ``logits_to_keep`` as a ``(rows, P)`` tensor)."""
    return "logits_to_keep" in _forward_arguments(type(net)) and _transformers_gathers_per_row()


def accepts_argument(net: nn.Module, name: str) -> bool:
    """Whether ``net.forward`` names ``name`` among its arguments."""
    return name in _forward_arguments(type(net))


def _attends_fully(config: Any) -> bool:
    """Whether every layer of ``config`` attends causally over the whole row (no sliding window
    or chunked layers, which one 4D mask could not describe)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return (
        getattr(config, "sliding_window", None) is None
        and getattr(config, "attention_chunk_size", None) is None
    )


def _alibi_from_mask(config: Any) -> bool:
    """Whether the network builds its ALiBi position biases from the 2D attention mask (BLOOM,
    Falcon with ``alibi``), so that it takes no 4D mask."""
    return getattr(config, "model_type", None) == "bloom" or getattr(config, "alibi", None) is True


def _eager_wide_dtype(net: nn.Module) -> torch.dtype | None:
    """The dtype of ``net``'s eager attention when its mask's minimum overflows the float32
    softmax (float64), else ``None`` (another attention, or a dtype whose minimum stays finite)."""
    config = getattr(net, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "eager":
        return None
    getter = getattr(net, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        return None
    if torch.finfo(weight.dtype).min >= torch.finfo(torch.float32).min:
        return None  # the mask's minimum stays finite in the float32 softmax: no NaN
    return weight.dtype


def _mask_refusal(config: Any) -> str | None:
    """Why a network of ``config`` takes no 4D mask without the left padding's NaN, or ``None``."""
    if _alibi_from_mask(config):
        return (
            "it builds its ALiBi position biases from the 2D attention_mask, so it takes no 4D mask"
        )
    if not _attends_fully(config):
        return (
            "it has sliding-window or chunked attention layers, which one 4D mask cannot describe"
        )
    return None


def eager_mask_refusal(net: nn.Module, attention_mask: Any) -> str | None:
    """Why :func:`eager_attention_mask` refuses these rows (some start with padding, and the
    network's float64 eager attention takes no safe 4D mask for them), or ``None``.

    Parameters
    ----------
    net : nn.Module
    attention_mask : Tensor `(R, L)` or None
        Nonzero on real tokens.

    Returns
    -------
    str or None
        The reason, in words that follow "cannot hand it a mask without such rows: ".
    """
    if _eager_wide_dtype(net) is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        return None
    why = _mask_refusal(getattr(net, "config", None))
    if why is None or bool(attention_mask[:, 0].bool().all()):
        return None  # no left padding: every real query sees the first token
    return why


def attend_trailing_padding(net: nn.Module, attention_mask: Tensor) -> Tensor:
    """``attention_mask`` with the padding after each row's last real token marked real, where
    ``net``'s eager attention in float64 has sliding-window or chunked layers; otherwise
    ``attention_mask`` itself.

    A right-padding query more than a window past the row's last real token sees no key, so
    eager attention gives it NaN (see :func:`eager_attention_mask`), which the next layer spreads
    to every real token of the row. Marked real, it sees the padding keys of its window; no real
    query attends to a key after it (causal attention), so the real tokens' outputs are those
    of the network's own mask, in every layer and with a key/value cache (transformers builds
    each layer's mask from the 2D one).

    Parameters
    ----------
    net : nn.Module
    attention_mask : Tensor `(R, L)`
        Nonzero on real tokens; the queries are its last columns (a cached pass).

    Returns
    -------
    Tensor `(R, L)`
        Of ``attention_mask``'s dtype.
    """
    if _eager_wide_dtype(net) is None or _attends_fully(getattr(net, "config", None)):
        return attention_mask
    real = attention_mask.bool()
    after = real.flip(-1).cumsum(-1).flip(-1) == 0  # no real token at or after the position
    return (real | after).to(attention_mask.dtype)


def eager_attention_mask(net: nn.Module, attention_mask: Any) -> Tensor | None:
    r"""An attention mask for a Hugging Face causal LM whose eager attention would return NaN
    on padded rows, or ``None`` when the network's own mask is safe.

    The eager attention of transformers adds a mask holding ``finfo(dtype).min`` at the masked
    keys and takes the softmax in float32. In float64 that minimum overflows to ``-inf``, so a
    query that sees no real key gets a softmax over ``-inf`` only: NaN. The next layer
    multiplies that position's value by an attention weight of exactly 0 at every real query,
    and :math:`0 \cdot \mathrm{NaN} = \mathrm{NaN}` reaches every real token. Such queries are
    the left padding, and with sliding-window or chunked layers also the right padding more
    than a window past the row's last real token.

    On left-padded rows the mask returned, of shape ``(R, 1, L, L)`` in the network's dtype
    (additive: 0 where query ``i`` attends key ``j``, the dtype's minimum elsewhere), is the
    causal padding mask the network would build, :math:`j \le i` and ``attention_mask[j] = 1``,
    with each query that sees no key attending to itself instead. Real queries attend exactly
    as before (their rows are unchanged), so their outputs are those of the network's own mask;
    padding queries get finite outputs that no real query reads. On rows that all start with a
    real token, a network with sliding-window or chunked layers gets the ``(R, L)`` mask of
    :func:`attend_trailing_padding` (the right padding marked real), which transformers turns
    into each layer's mask.

    Parameters
    ----------
    net : nn.Module
        The network; only a transformers model with ``config._attn_implementation == "eager"``
        in a dtype wider than float32 (float64) needs the mask.
    attention_mask : Tensor `(R, L)` or None
        Nonzero on real tokens.

    Returns
    -------
    Tensor `(R, 1, L, L)`, Tensor `(R, L)` or None
        ``None`` when the network's own mask has no fully masked row it would turn into NaN.

    Raises
    ------
    ValueError
        When a row starts with padding and the network has sliding-window or chunked attention
        layers, or builds its ALiBi biases from the 2D mask (BLOOM), so that it takes no 4D mask
        for them (:func:`eager_mask_refusal`).
    """
    dtype = _eager_wide_dtype(net)
    if dtype is None or not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        return None
    real = attention_mask.bool()
    config = getattr(net, "config", None)
    if bool(real[:, 0].all()):  # no left padding: only right padding past a window sees no key
        return None if _attends_fully(config) else attend_trailing_padding(net, attention_mask)
    why = _mask_refusal(config)
    if why is not None:
        fix = (
            "Pad on the right"
            if _alibi_from_mask(config)  # transformers has no sdpa attention for BLOOM
            else "Load it with attn_implementation='sdpa' (where transformers has it), pad on "
            "the right"
        )
        raise ValueError(
            f"multiple_choice likelihood: {type(net).__name__} runs eager attention in {dtype} "
            "on left-padded rows, whose padding queries see no key; transformers' eager "
            "attention then returns NaN (its float32 softmax overflows the float64 mask), and "
            f"pyrobayes cannot hand it a mask without such rows: {why}. {fix} "
            "(encode_multiple_choice(..., padding_side='right'): each row then scores as it "
            "would alone) or run the network in float32."
        )
    length = int(real.shape[-1])
    arange = torch.arange(length, device=real.device)
    causal = arange[None, :] <= arange[:, None]  # (L, L): key j <= query i
    attend = causal[None] & real[:, None, :]  # (R, L, L)
    unattended = ~attend.any(-1, keepdim=True)  # queries that see no key
    attend = attend | (unattended & torch.eye(length, dtype=torch.bool, device=real.device))
    mask = torch.zeros(attend.shape, dtype=dtype, device=real.device)
    return mask.masked_fill_(~attend, torch.finfo(dtype).min).unsqueeze(1)


def last_positions(attention_mask: Tensor | None, rows: int, length: int, device: Any) -> Tensor:
    """Index of the last real token of each row ``(rows,)`` (left or right padding)."""
    if attention_mask is None:
        return torch.full((rows,), length - 1, device=device, dtype=torch.long)
    mask = attention_mask.reshape(rows, length)
    return length - 1 - torch.argmax(mask.flip(-1).to(torch.long), dim=-1)


def continuation_targets(
    continuation_mask: Tensor,
    attention_mask: Tensor | None = None,
    choice_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Positions of each row's continuation tokens, padded to the longest continuation.

    The checks of the masks cost one synchronisation together (the longest continuation is
    read with them).

    Parameters
    ----------
    continuation_mask : Tensor `(R, L)`
        Nonzero on continuation tokens; never at position 0 (a continuation is scored given at
        least one token before it).
    attention_mask : Tensor `(R, L)`, optional
        Nonzero on real tokens; a continuation token must be one (a padding token is no part
        of a choice).
    choice_mask : Tensor `(B, K)`, optional
        Nonzero on the real choices of a ragged batch (``R = B·K``); every example needs one.

    Returns
    -------
    positions : Tensor `(R, P)`
        Token positions ``t`` in increasing order; slots past a row's continuation repeat its
        first position. The head reads position ``t - 1``.
    valid : Tensor `(R, P)` bool
        Whether a slot holds a continuation token.

    Raises
    ------
    ValueError
        When a row's continuation starts at position 0 or right after padding (no real token
        before it), a row has no continuation token, a continuation token is padding
        (``attention_mask`` 0), or an example has no real choice.
    """
    mask = continuation_mask.bool()
    rows, length = mask.shape
    counts = mask.sum(-1)
    none = torch.zeros((), dtype=torch.bool, device=mask.device)
    padding = after_padding = none
    if attention_mask is not None:
        real = attention_mask.reshape(rows, length).bool().to(mask.device)
        padding = (mask & ~real).any()
        # a continuation's first token right after a left-padded row's padding (an empty
        # prompt): the head would read its score at a padding position
        after_padding = (mask[:, 1:] & ~mask[:, :-1] & ~real[:, :-1]).any()
    unchosen = none
    if choice_mask is not None:
        unchosen = (~choice_mask.bool().any(-1)).any().to(mask.device)
    checks = [mask[:, 0].any(), (counts == 0).any(), padding, after_padding, unchosen]
    # one synchronisation for every check and the longest continuation
    flags = torch.stack([check.to(torch.long) for check in [*checks, counts.max()]]).tolist()
    _check_continuation_flags(*(bool(flag) for flag in flags[:5]))
    num = int(flags[5])
    arange = torch.arange(length, device=mask.device)
    key = torch.where(mask, arange, arange + length)  # continuation tokens first, in order
    positions = key.argsort(dim=-1)[:, :num]
    valid = torch.gather(mask, 1, positions)
    positions = torch.where(valid, positions, positions[:, :1])
    return positions, valid


def _check_continuation_flags(
    first: bool, empty: bool, padding: bool, after_padding: bool, unchosen: bool
) -> None:
    """The ``ValueError`` of :func:`continuation_targets`' first failed check, if any."""
    if first:
        raise ValueError(
            "continuation_mask marks position 0 of a row: a continuation is scored given the "
            "tokens before it, so each choice needs at least one prompt token (a BOS token or "
            "a non-empty prompt) before its continuation."
        )
    if empty:
        raise ValueError(
            "continuation_mask: a row has no continuation token; every choice needs at least "
            "one token (check for empty choices or a max_length that truncated them)."
        )
    if padding:
        raise ValueError(
            "multiple_choice likelihood: continuation_mask marks a padding token "
            "(attention_mask 0) as part of a choice, so the padding's log-probability would be "
            "added to that choice's score. Mark only the choice's own tokens (a mask built as "
            "'every position after the prompt' covers right padding too): "
            "continuation_mask & attention_mask, or encode_multiple_choice."
        )
    if after_padding:
        raise ValueError(
            "continuation_mask: a row's continuation starts right after padding (a "
            "left-padded row with an empty prompt), so its first token would be scored from a "
            "padding position. A continuation is scored given the tokens before it: give each "
            "choice at least one prompt token (a BOS token or a non-empty prompt)."
        )
    if unchosen:
        raise ValueError(
            "multiple_choice likelihood: choice_mask marks no real choice for an example (a "
            "row of zeros), so every choice would score -inf and its probabilities be NaN. "
            "Give each example at least one choice_mask 1 (encode_multiple_choice(..., "
            "ragged=True) builds it), or drop the example."
        )


def continuation_scores(
    logits: Tensor,
    input_ids: Tensor,
    positions: Tensor,
    valid: Tensor,
    *,
    normalize: str = "none",
    chars: Tensor | None = None,
    token_log_probs: Tensor | None = None,
) -> Tensor:
    r"""Summed (normalised) log-probabilities of each row's continuation tokens.

    Parameters
    ----------
    logits : Tensor `(R, P, V)`
        Head outputs at the read positions ``positions - 1`` (the head-gathered output).
    input_ids : Tensor `(R, L)`
    positions, valid : Tensor `(R, P)`
        From :func:`continuation_targets`.
    normalize : {"none", "length", "chars"}
    chars : Tensor `(R,)`, optional
        Characters of each choice (``"chars"``).
    token_log_probs : Tensor `(R, P)`, optional
        The tokens' log-probabilities when computed already (``logits`` is then not read).

    Returns
    -------
    Tensor `(R,)`
        :math:`\frac{1}{n}\sum_t \log p(c_t \mid \text{prompt}, c_{<t})`.
    """
    tokens = torch.gather(input_ids, 1, positions)  # (R, P)
    # one fused pass over the vocabulary (logsumexp takes several: 1.3x the time on CPU), in
    # float32 at least: a bf16 log-softmax keeps 8 bits (a sum of 20 tokens' -3.4 nats each
    # lands on a multiple of 0.25-0.5 nats), enough to tie or reorder a question's choices
    if token_log_probs is None:
        log_probs = (
            torch.log_softmax(logits, dim=-1, dtype=compute_dtype(logits.dtype))
            .gather(-1, tokens.unsqueeze(-1))
            .squeeze(-1)
        )
    else:
        log_probs = token_log_probs.to(compute_dtype(token_log_probs.dtype))
    total = torch.where(valid, log_probs, torch.zeros_like(log_probs)).sum(-1)
    if normalize == "length":
        return total / valid.sum(-1).to(total.dtype)
    if normalize == "chars":
        if chars is None:
            raise ValueError(
                "multiple_choice likelihood: normalize='chars' needs 'continuation_chars' "
                "(B, K) in the batch (encode_multiple_choice adds it)."
            )
        return total / chars.to(total.dtype).clamp_min(1)
    return total


def _as_choice_lists(prompts: Sequence[str], choices: Any, ragged: bool = False) -> list[list[str]]:
    if isinstance(choices, str):
        raise TypeError(
            f"encode_multiple_choice: choices is one string ({choices!r}), which would be read "
            "as one choice per character; pass a list of strings (the K choices shared by all "
            "prompts), e.g. ['yes', 'no'], or one list per prompt."
        )
    if isinstance(choices, Sequence) and choices and all(isinstance(c, str) for c in choices):
        if len(choices) < 2:
            raise ValueError(
                f"encode_multiple_choice: choices holds {len(choices)} shared choice "
                f"({list(choices)!r}); a multiple-choice question needs K >= 2 choices (one "
                "choice always has probability 1). Pass every choice, or one list per prompt."
            )
        return _checked_texts([list(choices) for _ in prompts])  # one list shared by all
    if not isinstance(choices, Sequence) or len(choices) != len(prompts):
        raise ValueError(
            f"encode_multiple_choice: choices must be one list of strings shared by all prompts or "
            f"one list per prompt ({len(prompts)} lists); got {type(choices).__name__} of "
            f"length {len(choices) if isinstance(choices, Sequence) else '?'}."
        )
    for b, options in enumerate(choices):
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise TypeError(
                f"encode_multiple_choice: choices[{b}] is {options!r} "
                f"({type(options).__name__}); per-prompt choices are lists of strings, one "
                "list per prompt (a string would be read as one choice per character)."
            )
        bad = [c for c in options if not isinstance(c, str)]
        if bad:
            raise TypeError(
                f"encode_multiple_choice: choices[{b}] holds {bad[0]!r} "
                f"({type(bad[0]).__name__}); every choice is a string."
            )
    lists = [list(c) for c in choices]
    sizes = sorted({len(c) for c in lists})
    if sizes[0] < 2 or (len(sizes) != 1 and not ragged):
        raise ValueError(
            f"encode_multiple_choice: every prompt needs the same number (>= 2) of choices; got "
            f"sizes {sizes}. Pass ragged=True for a batch of questions with different numbers "
            "of choices (padded choices masked out by 'choice_mask'), or group prompts by size."
        )
    return _checked_texts(lists)


def _warn_double_whitespace(prompts: list[str], lists: list[list[str]], delimiter: str) -> None:
    """Warn (once per call) when a row's text ``prompt + delimiter + choice`` holds whitespace on
    both sides of a join: a prompt ending in a space before a delimiter (or choice) starting
    with whitespace, or a delimiter ending in a space before a choice starting with whitespace.

    The row then reads ``"Answer:  yes"``: the tokens are scored after a whitespace token that
    a BPE tokenizer would have attached to the next word, text the model rarely saw, which
    shifts every choice's score (lm-evaluation-harness warns on the same)."""
    for b, (prompt, options) in enumerate(zip(prompts, lists, strict=True)):
        for k, choice in enumerate(options):
            pieces = [piece for piece in (prompt, delimiter, choice) if piece]
            if any(
                left[-1] in " \t" and right[0].isspace()
                for left, right in zip(pieces, pieces[1:], strict=False)
            ):
                warnings.warn(
                    f"encode_multiple_choice: prompt {b} + delimiter {delimiter!r} + choice {k} "
                    f"reads {(prompt[-12:] + delimiter + choice[:12])!r}: whitespace on both "
                    "sides of a join, so each choice is scored after an extra whitespace token. "
                    "Drop the prompt's trailing spaces (prompt.rstrip(' ')) and the choices' "
                    "leading ones (choice.lstrip()), and let the delimiter (' ') separate them.",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
                return


def _checked_texts(lists: list[list[str]]) -> list[list[str]]:
    """Refuse an empty answer text and an answer given twice to one question."""
    for b, options in enumerate(lists):
        empty = [k for k, c in enumerate(options) if not c.strip()]
        if empty:
            raise ValueError(
                f"encode_multiple_choice: choices[{b}][{empty[0]}] is {options[empty[0]]!r}, an "
                "empty answer: it would be scored on the delimiter alone (or nothing), which "
                "no answer text competes with. Drop it, or give it its text."
            )
        seen: dict[str, int] = {}
        for k, c in enumerate(options):
            if c in seen:
                raise ValueError(
                    f"encode_multiple_choice: choices[{b}] holds {c!r} twice (choices "
                    f"{seen[c]} and {k}): the two always get the same score, so neither can "
                    "have a probability above 1/2. Remove the duplicate."
                )
            seen[c] = k
    return lists


def _as_prompts(prompts: Any) -> list[str]:
    if isinstance(prompts, str):
        raise TypeError(
            f"encode_multiple_choice: prompts is one string ({prompts[:40]!r}), which would be "
            "read as one prompt per character; pass a list of strings, e.g. [prompt] for one."
        )
    if not isinstance(prompts, Sequence):
        raise TypeError(
            "encode_multiple_choice: prompts must be a list of strings; got "
            f"{type(prompts).__name__}."
        )
    bad = [p for p in prompts if not isinstance(p, str)]
    if bad:
        raise TypeError(
            f"encode_multiple_choice: prompts holds {bad[0]!r} ({type(bad[0]).__name__}); every "
            "prompt is a string."
        )
    return list(prompts)


def _as_answers(answers: Any, num_prompts: int, num_choices: int) -> Tensor:
    """``answers`` as ``(B,)`` long indices in ``[0, K)``: never truncated."""
    values = torch.as_tensor(answers)
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise TypeError(
            f"encode_multiple_choice: answers must be integer choice indices; got "
            f"{values.dtype} values (e.g. {values.reshape(-1)[:3].tolist()}), which are not "
            "truncated. Pass ints (0 for the first choice)."
        )
    labels = values.to(torch.long).reshape(-1)
    if labels.numel() != num_prompts:
        raise ValueError(
            f"encode_multiple_choice: {labels.numel()} answers for {num_prompts} prompts; pass "
            "one answer index per prompt."
        )
    if bool(((labels < 0) | (labels >= num_choices)).any()):
        raise ValueError(
            f"encode_multiple_choice: answers must index the {num_choices} choices "
            f"(0..{num_choices - 1}); got {labels.tolist()[:8]}."
        )
    return labels


def _trailing(ids: Sequence[int], special: set[int]) -> int:
    """How many of ``ids``' last ids are in ``special``."""
    count = 0
    while count < len(ids) and int(ids[-1 - count]) in special:
        count += 1
    return count


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids as a continuation follows them: encoded with the tokenizer's
    special tokens, less those it appends after the text.

    A tokenizer that appends an end-of-sequence token to every encoded text (T5 / ByT5, a
    LLaMA tokenizer saved with ``add_eos_token=True``) would put ``</s>`` between the prompt and
    each choice, so every continuation would be scored after an end of sequence. The special
    ids (``all_special_ids``, else ``eos_token_id``) that end the encoding but not the text
    encoded without special tokens are dropped, so the continuation follows the prompt's own
    tokens, as in lm-evaluation-harness. Tokenizers that append nothing (LLaMA, GPT-2) are
    unchanged (the encoding without special tokens is only computed when a special id ends
    the encoding). A BOS token the tokenizer puts before the text is kept even where it is
    also the end-of-sequence id (OPT's ``</s>``) and ends the encoding of an empty prompt."""
    context = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        special.add(int(eos))
    if not context or int(context[-1]) not in special:
        return context
    plain = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    extra = _trailing(context, special) - _trailing(plain, special)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and int(context[0]) == int(bos) and plain[:1] != context[:1]:
        extra = min(extra, len(context) - 1)  # the BOS before the text is not after it
    return context[: len(context) - extra] if extra > 0 else context


def _leading_specials(tokenizer: Any, prompt: str, context: list[int], limit: int) -> list[int]:
    """The ids the tokenizer puts before ``prompt``'s text (a BOS token; ``[]`` for none or when
    they would fill ``limit``): the head of ``context`` that the encoding without special tokens
    lacks, where the rest of ``context`` is that encoding."""
    plain = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    extra = len(context) - len(plain)
    if extra <= 0 or extra >= limit or context[extra:] != plain:
        return []
    return context[:extra]


def _tokenize_rows(
    tokenizer: Any,
    prompts: list[str],
    lists: list[list[str]],
    delimiter: str,
    max_length: int | None,
) -> list[list[tuple[list[int], int]]]:
    """Token ids of every (prompt, choice) row and its number of continuation tokens."""
    rows: list[list[tuple[list[int], int]]] = []
    for b, (prompt, options) in enumerate(zip(prompts, lists, strict=True)):
        context = prompt_ids(tokenizer, prompt)
        if not context:
            raise ValueError(
                f"encode_multiple_choice: prompt {b} encodes to no tokens and the tokenizer "
                "adds no BOS token; a continuation needs a token before it."
            )
        row = []
        for k, choice in enumerate(options):
            cont = list(tokenizer(delimiter + choice, add_special_tokens=False)["input_ids"])
            if not cont:
                raise ValueError(
                    f"encode_multiple_choice: choice {k} of prompt {b} ({choice!r}) encodes to "
                    "no tokens."
                )
            ids, lead = context + cont, []
            if max_length is not None and len(ids) > max_length:
                lead = _leading_specials(tokenizer, prompt, context, max_length)
                ids = lead + ids[len(ids) - max_length + len(lead) :]
            num_cont = min(len(cont), len(ids) - max(1, len(lead)))
            if num_cont < len(cont) or len(ids) < 2:
                raise ValueError(
                    f"encode_multiple_choice: choice {k} of prompt {b} does not fit in "
                    f"max_length={max_length} "
                    + (
                        f"after the tokenizer's leading special tokens {lead}"
                        if lead
                        else "with a prompt token before it"
                    )
                    + "; raise max_length."
                )
            row.append((ids, num_cont))
        rows.append(row)
    return rows


def _pad_rows(
    rows: list[list[tuple[list[int], int]]], pad: int, padding_side: str
) -> tuple[Tensor, Tensor, Tensor]:
    """``(num, K, L)`` input ids, attention mask and continuation mask of the tokenized rows."""
    num, k_choices = len(rows), len(rows[0])
    length = max(len(ids) for row in rows for ids, _ in row)
    input_ids = torch.full((num, k_choices, length), pad, dtype=torch.long)
    attention = torch.zeros((num, k_choices, length), dtype=torch.long)
    cont_mask = torch.zeros((num, k_choices, length), dtype=torch.long)
    for b, row in enumerate(rows):
        for k, (ids, num_cont) in enumerate(row):
            n = len(ids)
            start = length - n if padding_side == "left" else 0
            input_ids[b, k, start : start + n] = torch.tensor(ids, dtype=torch.long)
            attention[b, k, start : start + n] = 1
            cont_mask[b, k, start + n - num_cont : start + n] = 1
    return input_ids, attention, cont_mask


def encode_multiple_choice(
    tokenizer: Any,
    prompts: Sequence[str],
    choices: Sequence[str] | Sequence[Sequence[str]],
    answers: Sequence[int] | Tensor | None = None,
    *,
    max_length: int | None = None,
    padding_side: str = "left",
    delimiter: str = " ",
    position_ids: bool = True,
    ragged: bool = False,
) -> dict[str, Tensor]:
    r"""Encode prompts and their choices as continuations, one row per (prompt, choice).

    Each row is ``tokens(prompt) + tokens(delimiter + choice)``, the prompt encoded with the
    tokenizer's special tokens and the continuation without (as lm-evaluation-harness does),
    truncated from the left to ``max_length`` and padded to the longest row. Special tokens the
    tokenizer appends after the prompt's text (an end-of-sequence token, e.g. T5's) are left
    out, so each continuation follows the prompt's tokens directly (:func:`prompt_ids`).

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Called as ``tokenizer(text, add_special_tokens=...)["input_ids"]``; its
        ``pad_token_id`` (else ``eos_token_id``, else 0) fills the padding.
    prompts : list of str
        B prompts (a single string is refused: it would be B one-character prompts).
    choices : list of str, or list of B lists of K str
        The K >= 2 choices, shared by all prompts or one list per prompt (a string where a
        list is expected is refused).
    answers : list of int or Tensor, optional
        Index of the right choice per prompt, in ``[0, K)``; becomes ``labels``. Integers
        only: float answers are refused, not truncated.
    max_length : int, optional
        Longest row in tokens; longer rows lose prompt tokens from the left (as
        lm-evaluation-harness does) but keep the tokens the tokenizer puts before the text: with
        a tokenizer that adds a BOS token (LLaMA, SmolLM2) a cut row is BOS followed by its last
        ``max_length - 1`` tokens, the start of sequence the model was trained with. A choice
        that does not fit after them is refused.
    padding_side : {"left", "right"}
    delimiter : str
        Put before each choice (lm-evaluation-harness's ``target_delimiter``).
    position_ids : bool
        Add ``position_ids`` counting real tokens only, so that a left-padded row sees the
        positions of its unpadded form.
    ragged : bool
        Accept per-prompt lists of different sizes (each >= 2): K is the largest, a shorter
        list is padded with copies of its first choice, and ``choice_mask`` `(B, K)` (1 on real
        choices) is added; the likelihood gives padded choices a score of ``-inf``, so they get
        probability 0 and the answer's likelihood is that of the question scored alone.

    Returns
    -------
    dict of str to Tensor
        ``input_ids``, ``attention_mask``, ``continuation_mask`` `(B, K, L)` (long),
        ``continuation_chars`` `(B, K)` (characters of each choice, for ``normalize="chars"``),
        ``position_ids`` `(B, K, L)` when asked, ``labels`` `(B,)` when ``answers`` is given,
        ``choice_mask`` `(B, K)` (long) when ``ragged``.

    Raises
    ------
    TypeError
        A string where a list of strings is expected (``prompts``, ``choices``, a per-prompt
        choice list), or non-integer ``answers``.
    ValueError
        Fewer than two choices, lists of different sizes, an answer outside ``[0, K)``, or a
        choice that does not fit in ``max_length``.

    Warns
    -----
    UserWarning
        When a row's text has whitespace on both sides of a join (``"Answer: "`` then the
        delimiter ``" "``, or a choice with a leading space after it): every choice would be
        scored after an extra whitespace token.

    Examples
    --------
    >>> batch = encode_multiple_choice(tok, ["The ground is wet because"],
    ...                                [["it rained", "it is sunny"]], answers=[0])  # doctest: +SKIP
    """
    if padding_side not in ("left", "right"):
        raise ValueError(
            f"encode_multiple_choice: padding_side must be 'left' or 'right', got {padding_side!r}."
        )
    prompts = _as_prompts(prompts)
    if not prompts:
        raise ValueError("encode_multiple_choice: prompts is empty; pass at least one prompt.")
    lists = _as_choice_lists(prompts, choices, ragged)
    sizes = [len(options) for options in lists]
    if ragged:  # pad with copies of the first choice: real rows, masked scores
        width = max(sizes)
        lists = [options + [options[0]] * (width - len(options)) for options in lists]
    if max_length is not None and max_length < 2:
        raise ValueError(f"encode_multiple_choice: max_length must be >= 2, got {max_length}.")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    pad = 0 if pad is None else int(pad)
    _warn_double_whitespace(prompts, lists, delimiter)
    rows = _tokenize_rows(tokenizer, prompts, lists, delimiter, max_length)
    num, k_choices = len(rows), len(rows[0])
    input_ids, attention, cont_mask = _pad_rows(rows, pad, padding_side)
    out = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "continuation_mask": cont_mask,
        "continuation_chars": torch.tensor(
            [[float(len(c)) for c in options] for options in lists], dtype=torch.float32
        ),
    }
    if position_ids:
        out["position_ids"] = (attention.cumsum(-1) - 1).clamp_min(0)
    if answers is not None:
        out["labels"] = _as_answers(answers, num, k_choices)
        if ragged:
            short = [b for b, label in enumerate(out["labels"].tolist()) if label >= sizes[b]]
            if short:
                b = short[0]
                raise ValueError(
                    f"encode_multiple_choice: answer {int(out['labels'][b])} of prompt {b} "
                    f"indexes past its {sizes[b]} choices; answers index each prompt's own list."
                )
    if ragged:
        out["choice_mask"] = (torch.arange(k_choices)[None, :] < torch.tensor(sizes)[:, None]).to(
            torch.long
        )
    return out


def flatten_choices(inputs: Mapping[str, Any]) -> tuple[dict[str, Any], int, int]:
    """``(rows, K, L)`` network inputs as ``(rows·K, L)`` without the scoring keys;
    also returns ``rows`` and ``K``."""
    ids = inputs["input_ids"]
    rows, k_choices, length = (int(n) for n in ids.shape)
    flat: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in SCORE_KEYS:
            continue
        if isinstance(value, Tensor) and value.dim() >= 3 and value.shape[:2] == ids.shape[:2]:
            value = value.reshape(rows * k_choices, *value.shape[2:])
        flat[key] = value
    return flat, rows, k_choices
