"""The forwards a verifier watches (``layeropt/checking/verify.py``).

While it verifies, a :class:`~layeropt.checking.verify.Verifier` puts a forward
pre-hook (:class:`ForwardWatch`) on each attached model and on each of its
modules that holds parameters, and takes them off when verification ends. Two
things are seen there:

* **an attached model's forward** after a backward whose updates wait for a
  ``step()``, in a loop that has not called ``step()``: each backward is that
  loop's step, so the verifier applies it there (``Verifier.settle``) and
  watches that forward (:func:`after_forward`); a ``step()`` after it says
  that the steps since were not verified (:func:`say_at_next_step`) - or,
  where that forward read what it applied, raises, as below;
* **a module's forward that reads a parameter a verified backward updated**,
  before its ``step()``, in a loop that calls ``step()``: torch's forward reads
  the weights before the update, in-backward updating's reads them after it (an
  actor's loss through a critic, a generator's through a discriminator): a
  :class:`~layeropt.errors.VerifyError` (:data:`VERIFY_READ_AHEAD`). Without
  verify nothing sees it (docs/rules.md, "What cannot be detected"): a hook on
  every module costs each forward, so it is there only while verifying.

Not seen: a read that calls no module's forward (``F.linear(x, layer.weight)``),
a module's forward under ``torch.compile`` (its hook returns at once while
compiling) or FSDP2 (its modules hold the unsharded parameters in forward), a forward inside
backward (checkpointing's recomputation).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..engine.nesting import _graph_task_id
from ..errors import VerifyError, warn

VERIFY_STEP_AFTER_FORWARD = (
    "LAYEROPT_VERIFY: step() after verification ended at a forward: the loop went on to "
    "a forward between a backward and this step() (another loss's), which verify took for "
    "a loop without step() ({n} training step(s) verified), so the steps since were not "
    "verified and a difference there (gradients not zeroed between steps, say) would not "
    "be found. To verify them, call step() before that forward, or verify each "
    "optimizer's loss in a loop of its own."
)

VERIFY_READ_AHEAD = (
    "LAYEROPT_VERIFY: a forward of {module} between an attached backward and step() reads "
    "parameter {name}, which in-backward updating has already updated in that backward "
    "(torch updates it at step()), in training step {step}: without verify this forward "
    "reads this step's weights where torch's reads the last step's - an actor's loss "
    "through a critic, a generator's through a discriminator, an evaluation placed "
    "there. Call step() before this forward, or run that backward inside "
    "`with opt.no_step():` (its update then waits for step(), as torch's does)."
)


def say_at_next_step(optimizer: Any, verifier: Any) -> None:
    """At ``optimizer``'s next ``step()``, once: the verifier's noted read
    (``verifier.read``: :data:`VERIFY_READ_AHEAD`) raised, before anything of that step;
    else :data:`VERIFY_STEP_AFTER_FORWARD`."""
    handle: list[Any] = []

    def said(*_: Any) -> None:
        handle.pop().remove()
        if verifier.read is not None:
            raise VerifyError(verifier.read)
        warn(VERIFY_STEP_AFTER_FORWARD.format(n=verifier.done))

    handle.append(optimizer.register_step_pre_hook(said))


def after_forward(module: Any, then: Any) -> None:
    """``then()`` once ``module``'s forward running now has ended (or raised)."""
    handle: list[Any] = []

    def ended(*_: Any) -> None:
        handle.pop().remove()
        then()

    handle.append(module.register_forward_hook(ended, always_call=True))


class ForwardWatch:
    """The forward pre-hook a verifier puts on a module (``root``: an attached model):
    calls the verifier's ``on_forward``, and returns None - whatever else a pre-hook
    returns, torch passes to ``forward`` as its arguments.

    Inert on any other module and once the verifier is gone: a ``copy.deepcopy`` of
    the model (an EMA) copies its hooks, and its forward must not settle the original's
    step. A copy or a pickle of the hook itself (``torch.save(model)``) is inert.
    """

    def __init__(self, verifier: Any = None, module: Any = None, root: bool = False) -> None:
        self.refs = None if verifier is None else (weakref.ref(verifier), weakref.ref(module))
        self.root = root

    def __call__(self, module: Any, args: Any) -> None:
        if not self.root and torch.compiler.is_compiling():
            return  # (first: traced, nothing else of it is, no graph break per module)
        if self.refs is not None and module is self.refs[1]():
            verifier = self.refs[0]()
            if verifier is not None:
                verifier.on_forward(module, self.root)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(self), ()


def watch(verifier: Any, hooks: dict[int, Any]) -> None:
    """A :class:`ForwardWatch` on each attached model of ``verifier``'s engine and on
    each of its modules that holds parameters (``hooks``: ``id(module)`` -> handle)."""
    for attachment in list(verifier.engine.attachments):
        model = attachment.model
        if model is None:
            continue
        for module in model.modules():
            root = module is model
            if id(module) not in hooks and (root or module._parameters):
                hooks[id(module)] = module.register_forward_pre_hook(
                    ForwardWatch(verifier, module, root))


def read_ahead(module: Any, verifier: Any) -> str | None:
    """:data:`VERIFY_READ_AHEAD` where ``module``'s forward, outside backward, reads a
    parameter updated in backward mode before its ``step()``: one the verifier's shadows
    hold, in a loop that calls ``step()``, or one a forward settled (``verifier.settled``:
    the loop's next ``step()``, if one comes, says it); else ``None``."""
    if _graph_task_id() >= 0:
        return None
    engine, ahead = verifier.engine, verifier.settled
    if ahead is None:
        ahead = verifier.shadows if engine.awaits_step else None
    if not ahead:
        return None
    read = next((p for p in module._parameters.values() if p is not None and p in ahead),
                None)
    return None if read is None else VERIFY_READ_AHEAD.format(  # (a settled step: counted)
        module=type(module).__name__, name=engine.name_of(read),
        step=verifier.done + (verifier.settled is None))
