"""Exceptions raised by layeropt.

Every error names what went wrong and what to do instead. They subclass the
builtin exception a caller would expect (``RuntimeError`` for misuse at run
time, ``ValueError`` for bad arguments), so ``except RuntimeError`` keeps
working in code written for ``torch.optim``.
"""

from __future__ import annotations

__all__ = ["LayeroptError", "AttachError", "BackwardStateError"]


class LayeroptError(RuntimeError):
    """Base class of every error layeropt raises on its own."""


class AttachError(LayeroptError):
    """``layeropt.attach`` cannot hook these parameters (see the message)."""


class BackwardStateError(LayeroptError):
    """A gradient arrived in a way that cannot give an exact update."""
