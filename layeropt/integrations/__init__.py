"""Integrations of layeropt with other libraries.

Each integration lives in its own module and imports its library only when
that module is imported, so ``import layeropt`` never needs them:

* :mod:`layeropt.integrations.hf` - Hugging Face ``transformers.Trainer``
  (``LayeroptTrainer``, ``LayeroptCallback``); needs ``pip install
  'layeropt[hf]'``.
* :mod:`layeropt.integrations.lightning` - Lightning (``LayeroptCallback``).
* :mod:`layeropt.integrations.accelerate` - ``LayeroptAccelerator``.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__: list[str] = []


def two_pass_compile() -> Any:
    """A context in which ``torch.compile`` builds graphs that two backwards can run.

    ``layeropt.backward`` (clipping, a ``GradScaler``) runs a measuring
    backward and then the stepping one over the same graph; AOTAutograd's
    donated buffers would refuse the second ("compiled with non-empty donated
    buffers"). The integrations turn them off while they train (a memory
    optimisation of the compiled backward only; the numbers do not change).
    """
    try:
        from torch._functorch import config
    except ImportError:  # pragma: no cover - a torch without functorch
        return contextlib.nullcontext()
    if not hasattr(config, "donated_buffer"):  # older torch: nothing donated
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)
