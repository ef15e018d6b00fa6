"""Exceptions and warnings raised by layeropt.

Every error names what went wrong and what to do instead. They subclass the
builtin exception a caller would expect (``RuntimeError`` for misuse at run
time, ``ValueError`` for bad arguments), so ``except RuntimeError`` keeps
working in code written for ``torch.optim``.

Warnings point at the user's line (:func:`warn`), not at layeropt's or
torch's internals: most of them are raised from inside a backward pass.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

__all__ = ["LayeroptError", "AttachError", "BackwardStateError", "warn", "user_frame"]


IN_A_TRAINER = (
    "in a trainer, use its integration (LayeroptCallback, LayeroptAccelerator, LayeroptTrainer)."
)


class LayeroptError(RuntimeError):
    """Base class of every error layeropt raises on its own."""


class AttachError(LayeroptError):
    """``layeropt.attach`` cannot hook these parameters (see the message)."""


class BackwardStateError(LayeroptError):
    """A gradient arrived in a way that cannot give an exact update."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_INTEGRATIONS = _PACKAGE + "integrations" + os.sep
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _internal(filename: str) -> bool:
    """Code of layeropt's core, of torch or of the standard library."""
    if filename.startswith("<frozen"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE):
        return not path.startswith(_INTEGRATIONS)
    torch = sys.modules.get("torch")
    if torch is not None and path.startswith(os.path.dirname(torch.__file__) + os.sep):
        return True
    return path.startswith(_STDLIB) and "site-packages" not in path[len(_STDLIB):]


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the first frame outside layeropt, torch and the stdlib.

    Args:
        message: the warning text.
        category: the warning class.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     warn("careful")
        >>> str(w[0].message)
        'careful'
    """
    frame, level = user_frame()
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)


def user_frame() -> tuple[Any, int]:
    """The caller's first frame outside layeropt, torch and the stdlib, and how many
    frames up from the function that asks it is (``None`` if there is none)."""
    level, frame = 1, sys._getframe(2)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return frame, level
