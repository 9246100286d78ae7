"""Where a warning points: the user's line, the first caller outside the package.

A warning raised deep inside a fit (an argument the fit does not use, say) is only useful when
it names the line of the user's script that passed it; a fixed ``stacklevel`` is right for one
call path and wrong for the next (``pyrobayes.fit`` against ``pyrobayes.infer.make_fitter``).
"""

from __future__ import annotations

import os
import sys
from types import FrameType

__all__ = ["user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for :func:`warnings.warn`, called in the caller of this function, that
    points at the first frame outside the pyrobayes package (1 when the caller is outside)."""
    frame: FrameType | None = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
