"""Integrations of layeropt with other libraries.

Each integration lives in its own module and imports its library only when
that module is imported, so ``import layeropt`` never needs them:

* :mod:`layeropt.integrations.hf` - Hugging Face ``transformers.Trainer``
  (``LayeroptTrainer``, ``LayeroptCallback``); needs ``pip install
  'layeropt[hf]'``.
* :mod:`layeropt.integrations.lightning` - Lightning (``LayeroptCallback``).
* :mod:`layeropt.integrations.accelerate` - ``LayeroptAccelerator``.

Each takes ``offload_state=``: ``True`` (or the keyword arguments of
:func:`layeropt.offload.offload_state`, e.g. ``{"overlap": True, "prefetch": True}``) keeps the
optimizer state in host memory, each bucket's brought to the device for its
step, and the gradients the tool's accumulation holds between micro-batches
too (``{"held_grads": False}`` keeps those in ``.grad``;
:func:`offload_state_once`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from ..backward_pass import two_pass_compile  # (layeropt.two_pass_compile; kept here too)

__all__ = ["two_pass_compile", "offload_state_once", "attach_kwargs"]


def attach_kwargs(**given: Any) -> dict[str, Any]:
    """An integration's ``layeropt.attach`` arguments: those given (``None``: attach's
    default, ``LAYEROPT_VERIFY`` for ``verify``).

    Example:
        >>> attach_kwargs(bucket_cap_mb=None, verify=2)
        {'verify': 2}
    """
    return {k: v for k, v in given.items() if v is not None}


def offload_state_once(optimizer: Any, setting: bool | Mapping[str, Any] | None,
                       done: MutableMapping[Any, Any]) -> None:
    """An integration's ``offload_state=`` argument, applied to ``optimizer`` once.

    Args:
        optimizer: a layeropt optimizer (unwrapped).
        setting: ``False``/``None`` (nothing), ``True`` (the defaults), or the
            keyword arguments of :func:`layeropt.offload.offload_state`.
        done: the integration's ``{optimizer: StateOffload}`` (a
            ``WeakKeyDictionary``); an optimizer already in it is left as it
            is (a second ``fit``/``train``).

    Raises:
        TypeError: ``setting`` is neither a bool nor a mapping.

    Example:
        >>> import torch, layeropt
        >>> opt = layeropt.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
        >>> done = {}
        >>> offload_state_once(opt, True, done)
        >>> type(done[opt]).__name__
        'StateOffload'
    """
    if not setting or optimizer in done:
        return
    if setting is True:
        kwargs: dict[str, Any] = {}
    elif isinstance(setting, Mapping):
        kwargs = dict(setting)
    else:
        raise TypeError(
            "offload_state= takes True or the keyword arguments of "
            "layeropt.offload.offload_state (e.g. {'overlap': True, 'prefetch': True}), "
            f"got {setting!r}."
        )
    from ..offload.state import offload_state  # (imported on first use, as layeropt.offload is)

    done[optimizer] = offload_state(optimizer, **kwargs)
