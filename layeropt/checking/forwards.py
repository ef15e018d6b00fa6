"""Forwards between an attached backward and ``step()``.

torch's ``step()`` updates the weights; an attached backward already has. A
forward in between (an actor's loss through the critic, a generator's through
the discriminator, an evaluation placed there) therefore reads this step's
weights where torch's reads the last step's. Two watches see it:

* :class:`ReadWatch`, a forward pre-hook ``attach`` puts on the attached model
  (it goes with the attachment). While an optimizer of the attachment holds
  updates a ``step()`` of a loop that calls ``step()`` has still to come
  (``Engine.awaits_step``; the updated parameters: ``StepRecord.updated``), the
  model's forward puts a pre-hook on each of its modules that holds one of them
  for that forward alone (:func:`watch_reads`): one that runs raises
  :data:`READ_AHEAD_ERROR` before its forward. Otherwise it costs a check per
  forward of the model, not of each module.
* While it verifies, a :class:`~layeropt.checking.verify.Verifier` puts a
  :class:`ForwardWatch` on each attached model and each of its modules that
  holds parameters (:func:`watch`), off when verification ends. An attached
  model's forward after a backward whose updates wait for a ``step()``, in a
  loop that has not called ``step()``, is where each backward is that loop's
  step: the verifier applies it there (``Verifier.settle``) and watches on,
  up to the model's next forward or that optimizer's ``step()``; a ``step()``
  says the steps since were not verified (:func:`say_at_next_step`), or
  raises where a forward read what was applied (:func:`read_ahead`): the first
  training step, where :class:`ReadWatch` cannot yet tell such a loop from one
  without ``step()``.

In a job of several processes each rank watches its own forwards: where the
ranks' forwards take the same path (the updated parameters are the same on every
rank: DDP and FSDP2 update what the reduced gradients reach) every rank raises at
the same module; where only some ranks' forwards read an updated parameter,
those raise and the others go on to their next collective, where they wait until
the launcher ends the job (torchrun and ``mp.spawn`` end it when a rank fails) -
loud where the alternative is a silently different run.

Not seen: a read that calls no module's forward (``F.linear(x, layer.weight)``),
a forward under ``torch.compile`` (the hooks return at once while compiling), a
forward inside backward (checkpointing's recomputation); under FSDP2, a module
whose parameters are gathered already when the model's forward begins (the
root's own group: :func:`watch_reads` finds the updated shards by identity) -
and, by verify, any (its module hooks look when each module's forward begins; in
a job of several processes, on each rank whose forward reads one, as above).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import Tensor

from ..engine.nesting import _graph_task_id
from ..engine.registry import world_size
from ..errors import BackwardStateError, VerifyError, warn

VERIFY_STEP_AFTER_FORWARD = (
    "LAYEROPT_VERIFY: step() after verification ended at a forward: the loop went on to "
    "a forward between a backward and this step() (another loss's), which verify took for "
    "a loop without step() ({n} training step(s) verified), so the steps since were not "
    "verified and a difference there (gradients not zeroed between steps, say) would not "
    "be found. To verify them, call step() before that forward, or verify each "
    "optimizer's loss in a loop of its own."
)

READ_AHEAD_ERROR = (
    "A forward of {module} between an attached backward and step() reads parameter "
    "{name}, which that backward already updated (torch.optim updates it at step()): "
    "it would compute with this step's weights where torch's computes with the last "
    "step's - the next micro-batch of an accumulation, an actor's loss through the "
    "critic, a generator's through the discriminator, an evaluation placed there. "
    "Nothing of this forward ran. Run that backward inside `with opt.no_step():` (its "
    "update then waits for step(), as torch's does; accumulating, every micro-batch but "
    "the last), or call step() before this forward (the order of the DCGAN tutorial and "
    "CleanRL's DDPG)."
)

READ_AHEAD_RANKS = (
    " (A job of {n} processes: this rank's forward reads it; a rank whose forward does not "
    "goes on, and waits in its next collective until the launcher ends the job.)"
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
        verifier.unwatch()  # (its watch after a settled forward ends here)
        if verifier.read is not None:
            raise VerifyError(verifier.read)
        warn(VERIFY_STEP_AFTER_FORWARD.format(n=verifier.done))

    handle.append(optimizer.register_step_pre_hook(said))


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
    parameter a forward settled (``verifier.settled``: the loop's next ``step()``, if
    one comes, says it); else ``None``."""
    if not verifier.settled or _graph_task_id() >= 0:
        return None
    read = _reading(module, verifier.settled)
    return None if read is None else VERIFY_READ_AHEAD.format(
        module=type(module).__name__, name=verifier.engine.name_of(read), step=verifier.done)


def _reading(module: Any, params: Any) -> Any:
    """The first of ``module``'s own parameters in ``params`` (by identity), or None."""
    return next((p for p in module._parameters.values() if p is not None and p in params),
                None)


class ReadWatch:
    """The forward pre-hook (``pre``) and post-hook (``post``, also where the forward
    raises) ``attach`` puts on the attached model (see the module docstring). Holds the
    attachment weakly; inert on any other module (a copy of the model carries it) and
    once the attachment is gone; a pickle of it is inert."""

    def __init__(self, attachment: Any = None) -> None:
        self.ref = None if attachment is None else weakref.ref(attachment)
        self.handles: list[Any] = []  # this forward's hooks on the modules (watch_reads)

    def pre(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # (first: traced, nothing else of it is)
        attachment = None if self.ref is None else self.ref()
        if attachment is None or module is not attachment.model:
            return
        engines = [o._lo_engine for o in attachment.optimizers]
        if any(e.awaits_step for e in engines) and _graph_task_id() < 0:
            self.handles += watch_reads(module, [e for e in engines if e.awaits_step])

    def post(self, module: Any, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return  # (nothing was put on while compiling)
        while self.handles:  # (not its own handle: torch iterates its dict after a raise)
            self.handles.pop().remove()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(self), ()


def watch_reads(model: Any, engines: list[Any]) -> list[Any]:
    """A pre-hook on each module of ``model`` that holds a parameter ``engines`` updated
    ahead of ``step()``, raising :data:`READ_AHEAD_ERROR` before that module's forward
    (``model``'s own: at once). Returns their handles, for the end of the forward. Each
    names the parameter found now: by its forward FSDP2 may have put the unsharded one,
    gathered from the updated shard, in its place."""
    updated = {p: e for e in engines for p in e.train_step.updated}

    def refuse(p: Tensor, module: Any, args: Any = ()) -> None:
        n = world_size()
        raise BackwardStateError(READ_AHEAD_ERROR.format(
            module=type(module).__name__, name=updated[p].name_of(p))
            + (READ_AHEAD_RANKS.format(n=n) if n > 1 else ""))

    own = _reading(model, updated)
    if own is not None:
        refuse(own, model)
    found = ((m, _reading(m, updated)) for m in model.modules())
    return [m.register_forward_pre_hook(functools.partial(refuse, p))
            for m, p in found if p is not None]
