"""One multiple-choice question: a prompt, its choices and the index of the right one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MCExample"]


def _short(text: str, width: int = 80) -> str:
    """``text`` quoted, cut to ``width`` characters for an error message."""
    return repr(text if len(text) <= width else text[: width - 3] + "...")


@dataclass(frozen=True)
class MCExample:
    """A multiple-choice question scored as continuations of its prompt.

    Parameters
    ----------
    prompt : str
        The rendered question (the template already applied), without few-shot examples.
    choices : tuple of str
        Its K >= 2 distinct choices, each a continuation of the prompt (put after a delimiter);
        two identical choices get identical scores, so such a question is refused.
    answer : int
        Index of the right choice in ``[0, K)``.
    meta : dict
        Where the example came from (file, row), kept for error messages and reports.
    """

    prompt: str
    choices: tuple[str, ...]
    answer: int
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = f" ({self.meta['source']})" if "source" in self.meta else ""
        if not isinstance(self.prompt, str):
            raise TypeError(f"MCExample{where}: prompt must be a string, got {self.prompt!r}.")
        if isinstance(self.choices, str) or not isinstance(self.choices, Sequence):
            raise TypeError(
                f"MCExample{where}: choices must be a list of strings, got {self.choices!r}."
            )
        choices = tuple(self.choices)
        if len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(
                f"MCExample{where}: needs >= 2 non-empty string choices, got {list(choices)!r}."
            )
        repeated = sorted({c for c in choices if choices.count(c) > 1})
        if repeated:
            raise ValueError(
                f"MCExample{where}: the question {_short(self.prompt)} lists the choice(s) "
                f"{repeated!r} more than once ({list(choices)!r}); identical choices score the "
                "same, so the question cannot be answered. Remove the duplicate from the data."
            )
        object.__setattr__(self, "choices", choices)
        if isinstance(self.answer, bool) or not isinstance(self.answer, int):
            raise TypeError(
                f"MCExample{where}: answer must be an integer choice index, got {self.answer!r}."
            )
        if not 0 <= self.answer < len(choices):
            raise ValueError(
                f"MCExample{where}: answer {self.answer} does not index its {len(choices)} choices."
            )

    @property
    def target(self) -> str:
        """The right choice's text."""
        return self.choices[self.answer]
