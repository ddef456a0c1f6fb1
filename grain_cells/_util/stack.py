"""Where a warning should point: the first frame outside grain_cells (and Grain)."""

from __future__ import annotations

import os
import sys

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def stacklevel_outside_package() -> int:
    """`stacklevel` for the caller's `warnings.warn`: the first frame outside ours."""
    grain = sys.modules.get("grain")
    folder = os.path.dirname(os.path.abspath(getattr(grain, "__file__", None) or ""))
    skip = (_PACKAGE, folder + os.sep) if grain is not None else (_PACKAGE,)
    frame, level = sys._getframe(2), 2  # the warning function's caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        skip
    ):
        frame, level = frame.f_back, level + 1
    return level
