"""Optimizer state and held gradients in host memory (see :mod:`layeropt.offload.state`)."""

from .state import StateOffload, offload_state

__all__ = ["StateOffload", "offload_state"]
