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

__all__ = ["two_pass_compile"]


def two_pass_compile() -> Any:
    """A context in which ``torch.compile`` builds graphs that two backwards can run.

    ``layeropt.backward`` with ``max_norm``/``clip_value``/``scaler`` runs a
    measuring backward and then the stepping one over the same graph;
    AOTAutograd's donated buffers refuse the second ("compiled with non-empty
    donated buffers"). Inside this context they are off (a memory
    optimisation of the compiled backward only; the numbers do not change).
    Enter it before the model is compiled and keep it while training. On a
    torch without donated buffers (2.4) it does nothing. The
    integrations enter it for you while they train.

    Returns:
        A context manager.

    Example:
        >>> import torch, layeropt
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = layeropt.AdamW(model.parameters(), lr=1e-3)
        >>> with layeropt.two_pass_compile():
        ...     compiled = torch.compile(model, backend="aot_eager")
        ...     with layeropt.attach(compiled, opt):
        ...         layeropt.backward(compiled(torch.randn(2, 4)).sum(), max_norm=1.0)
    """
    try:
        from torch._functorch import config
    except ImportError:  # pragma: no cover - a torch without functorch
        return contextlib.nullcontext()
    if not hasattr(config, "donated_buffer"):  # older torch: nothing donated
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)
