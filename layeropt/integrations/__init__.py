"""Integrations of layeropt with other libraries.

Each integration lives in its own module and imports its library only when
that module is imported, so ``import layeropt`` never needs them:

* :mod:`layeropt.integrations.hf` - Hugging Face ``transformers.Trainer``
  (``LayeroptTrainer``, ``LayeroptCallback``); needs ``pip install
  'layeropt[hf]'``.
"""

from __future__ import annotations

__all__: list[str] = []
