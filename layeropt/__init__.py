"""layeropt: update each layer during backward and free its gradient at once.

Swap ``torch.optim.Adam`` for ``layeropt.Adam`` and call
``layeropt.attach(model)``; the rest of a training loop keeps working.

Example:
    >>> import torch, layeropt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = layeropt.Adam(model.parameters(), lr=1e-3)
    >>> with layeropt.attach(model, opt):
    ...     model(torch.randn(3, 4)).sum().backward()  # updated here
    ...     opt.step()                                  # harmless no-op
"""

from . import distributed
from .attaching import Attachment, attach
from .backward_pass import backward, two_pass_compile
from .checkpointing import CheckpointHandle, checkpoint, checkpoint_modules
from .errors import AttachError, BackwardStateError, LayeroptError, VerifyError
from .engine.landing import Bucket
from .loop import LoopAccumulator, LoopStateError, loop_recurrent, loop_stack
from .optim import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    InBackwardOptimizer,
    RMSprop,
    in_backward,
    is_in_backward,
)

__version__ = "0.1.0"

_LAZY = ("losses", "memory", "offload", "report")  # imported on first use


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'layeropt' has no attribute {name!r}")

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "InBackwardOptimizer",
    "in_backward",
    "is_in_backward",
    "attach",
    "backward",
    "Attachment",
    "Bucket",
    "LayeroptError",
    "AttachError",
    "BackwardStateError",
    "VerifyError",
    "losses",
    "distributed",
    "memory",
    "offload",
    "report",
    "LoopAccumulator",
    "LoopStateError",
    "loop_stack",
    "loop_recurrent",
    "checkpoint",
    "checkpoint_modules",
    "CheckpointHandle",
    "two_pass_compile",
]

try:
    from .optim import Adafactor  # noqa: F401 - torch >= 2.5

    __all__.append("Adafactor")
except ImportError:  # pragma: no cover - old torch
    pass
try:
    from .optim import Muon  # noqa: F401 - torch >= 2.9

    __all__.append("Muon")
except ImportError:  # pragma: no cover - old torch
    pass
