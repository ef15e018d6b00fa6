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

__all__ = ["LayeroptError", "AttachError", "BackwardStateError", "VerifyError", "warn",
           "user_frame"]


IN_A_TRAINER = (
    "in a trainer, use its integration (layeropt.integrations.lightning.LayeroptCallback, "
    "layeropt.integrations.accelerate.LayeroptAccelerator, "
    "layeropt.integrations.hf.LayeroptTrainer or layeropt.integrations.hf.LayeroptCallback); "
    "with LayeroptAccelerator, accumulate through accelerator.accumulate(model) and "
    "gradient_accumulation_steps=, not accelerator.no_sync() or backwards alone."
)


# -- the messages of layeropt's refusals and warnings, in one place ---------------------

ACCUMULATION_ERROR = (
    "{what} before optimizer.step() or zero_grad(): torch would sum these "
    "gradients into one step (gradient accumulation), but layeropt applies each "
    "attached backward at once, so the result would differ. {outcome} Run all but the last micro-batch inside "
    "`with opt.no_step():` (or use layeropt.LoopAccumulator); if every backward is "
    "meant to be a full step, call opt.step() after each one; " + IN_A_TRAINER
)

EARLY_DISCARD_ERROR = (
    "this loop's first step(): before it, a zero_grad() discarded gradients that an "
    "attached backward had already applied (a batch skipped before the first step, say): "
    "torch dropped them, layeropt updated the parameters with them, so the results "
    "differ from there on. {this} Skip a batch before "
    "its backward, or run that backward inside `with opt.no_step():` so that zero_grad() "
    "drops its gradients as torch does."
)
EARLY_DISCARD_APPLIED = "This step() itself was applied as torch's."

REMOVE_OPEN_WARNING = (
    "remove() inside a training step: an attached backward since the last step() or "
    "zero_grad() already updated the parameters. The optimizer's own step() or "
    "zero_grad() next ends that step as torch's would (or is refused where it differs), "
    "but a module's zero_grad(), which torch would use to drop those gradients, is no "
    "longer watched. Call remove() after step() or zero_grad()."
)

SAVE_OPEN_WARNING = (
    "{what} between an attached backward and step(): that backward's update is already in "
    "the parameters and the optimizer's state, where torch.optim applies it at step(), so a "
    "checkpoint saved here (or an average of the weights read here) is a step ahead of "
    "torch's (and a run resumed from it applies that backward twice if it runs it again). "
    "Save after step(). (Said once per optimizer.)"
)

CLOSURE_HOLD_WARNING = (
    "this backward runs inside optimizer.step(closure), whose caller may clip or "
    "inspect the gradients before the update: layeropt holds them until the "
    "closure returns, exactly as torch does, so nothing is saved in this step. In "
    "Lightning use layeropt.integrations.lightning.LayeroptCallback; otherwise "
    "call loss.backward() and then optimizer.step() without a closure."
)

DISCARD_ERROR = (
    "{where} discards gradients that an attached backward since the last step() has "
    "already applied to {n} parameter(s) (the first: {name}): torch would drop them "
    "here, but layeropt updated the parameters in that backward, so the results "
    "differ from here on (a GAN's generator loss backpropagating into the "
    "discriminator, an actor's loss into the critic). That update was applied; "
    "nothing more is. Keep such a backward from updating these parameters: freeze "
    "them during it (model.requires_grad_(False), then requires_grad_(True) after "
    "it), or run it inside `with opt.no_step():` so that its gradients wait in .grad "
    "and zero_grad() drops them as torch does."
)

ATTACHED_TWICE = (
    "parameter {name!r} is already attached to this optimizer, through another attachment "
    "({other}): the two models share it (a tied weight, or one model inside the other). "
    "Attach one module that holds both, once, or call .remove() on the other attachment "
    "first."
)

AUTOCAST_STEP_ERROR = (
    "{name}.step() runs inside torch.autocast, but layeropt updated the parameters during "
    "backward with autocast off, as torch's step() runs where loops call it outside the "
    "autocast block; {name}'s update may compute differently under autocast (a matrix "
    "product, as torch's Adafactor's, runs in bf16 there), so torch.optim's result here "
    "could differ. Call step() outside the autocast block, as torch's AMP recipe does "
    "(the forward and the loss inside it, backward and step() after it)."
)

TWO_PASSES_ERROR = (
    "layeropt.backward(loss, max_norm=... or scaler=...) runs backward twice over one graph (a "
    "measure pass that keeps it, then the step pass), and an op in this graph lets its backward "
    "run only once ({error}). Use ops whose backward can run twice: for "
    "layeropt.losses.linear_cross_entropy, impl='chunked' (the default takes torch's own op where "
    "there is one); or clip with attach(..., bucket_max_norm=...) per layer, which needs one pass."
)

DONATED_BUFFERS_ERROR = (
    "layeropt.backward(max_norm=/scaler=) runs backward twice over one graph; torch.compile "
    "built this one with AOTAutograd's donated buffers, which let it run once ({error}). "
    "Nothing was updated: compile and train inside `with layeropt.two_pass_compile():`."
)

FAULT_WARNING = (
    "a backward raised after layeropt had already updated {n} parameter(s) in it (the "
    "first: {name}): torch.optim would have applied none of this backward, so the model "
    "now differs from that run. The update cannot be undone; what was not applied yet "
    "stays in .grad, as torch leaves it. To stay exact, restore the model and the "
    "optimizer from a checkpoint (or end the run); the step's next step() or zero_grad() "
    "raises BackwardStateError to say so."
)

FAULT_ERROR = (
    "{where} follows a backward that raised after layeropt had already updated {n} "
    "parameter(s) in it (the first: {name}), where torch.optim would have applied none of "
    "it: from here on the results differ from torch.optim's (a skipped out-of-memory "
    "batch is the usual case). The update cannot be undone. To stay exact, restore the "
    "model and the optimizer from a checkpoint; to go on anyway, catch this error (it is "
    "raised once) and call {where} again."
)

NO_GRAPH_TASK_ERROR = (
    "a gradient landed outside any autograd graph task, so layeropt cannot tell "
    "when this backward ends (torch's compiled autograd does this in some versions, "
    "2.4 to 2.6 among them; nothing of this backward was applied). Turn "
    "torch._dynamo.config.compiled_autograd off, or upgrade torch."
)

COMPILED_AUTOGRAD_TWO_PASSES = (
    "layeropt.backward(max_norm=/scaler=) under torch's compiled autograd: the callback "
    "that ends each of its passes does not run there, so the step pass would leave its "
    "gradients unclipped (and unscaled) for step(). Nothing of this backward was "
    "applied. Call layeropt.backward outside the compiled function, or turn "
    "torch._dynamo.config.compiled_autograd off for it."
)

ORPHAN_WARNING = (
    "the layeropt optimizer attached to these parameters was deleted, so this "
    "backward does not update them: their gradients stay in .grad, as without "
    "layeropt, and the hooks are removed. Keep a reference to the optimizer for as "
    "long as you train (opt = layeropt.AdamW(...))."
)

RETAIN_HOLD_WARNING = (
    "this backward keeps its graph (retain_graph=True), so more backwards over it may "
    "follow before the update: layeropt holds its gradients in .grad, and the next "
    "backward that does not keep its graph, or step(), applies their sum, exactly as "
    "torch does - nothing is saved in this step. If no second backward over this graph "
    "follows, drop retain_graph=True to update each layer during backward."
)

SCALED_CLIP_ERROR = (
    "attach(clip_value=/bucket_max_norm=) clips each bucket's gradients before its "
    "update, but GradScaler.step hands this fused optimizer its gradients still scaled "
    "(the kernel unscales them), so they would be clipped at the wrong scale. Call "
    "scaler.unscale_(opt) before scaler.step(opt), or use layeropt.backward("
    "scaler.scale(loss), scaler=scaler). Nothing of this step was applied."
)

SCALER_HOLD_WARNING = (
    "this backward runs through a GradScaler-scaled loss (scaler.scale(loss).backward()), "
    "whose gradients must all be checked for inf/NaN before any update: layeropt "
    "holds them until scaler.step(opt), exactly as torch does, so nothing is saved "
    "in this step. Call layeropt.backward(scaler.scale(loss), scaler=scaler) instead "
    "to update each layer during backward (or use bf16 autocast, which needs no scaler)."
)

SPARSE_ERROR = (
    "a parameter got a sparse gradient; layeropt steps dense gradients only. Use a "
    "dense embedding (sparse=False) or leave this parameter to a separate, plain "
    "torch.optim optimizer."
)

LOAD_BETWEEN_ERROR = (
    "{name}.load_state_dict() between an attached backward and step(): that backward "
    "already updated the parameters and this state, so the load would drop its update "
    "(torch's step() applies it to the loaded state). Load before backward (at the top "
    "of the iteration), or after step(); to roll back a bad step, call step() and "
    "zero_grad() first, then load both the model and the optimizer. Nothing was loaded."
)

CLIP_AFTER_BACKWARD = (
    "{fn} was called on parameters that an attached backward has already updated, "
    "so their gradients are gone and nothing would be clipped ({result}). Clip inside "
    "backward instead: layeropt.backward(loss, max_norm=...) for the global norm, or "
    "layeropt.attach(model, opt, clip_value=... / bucket_max_norm=...) per layer; "
    + IN_A_TRAINER
)

CLIP_EMPTY = (
    "on no parameters right after an attached backward updated some (a list filtered "
    "on `p.grad is not None` finds none: every gradient was applied and freed; with "
    "torch.optim it would hold them all)"
)

ALSO_APPLIED = (
    " Before this clip, {n} attached backwards since the last step() were each applied "
    "as an update of its own (torch would sum them into one step): run all but the "
    "last inside `with opt.no_step():`, then clip through layeropt.backward(loss, "
    "max_norm=...) on the last."
)

CLIP_HELD_ON_HOST = (
    "{fn} was called on parameters whose held gradients wait in host memory "
    "(layeropt.offload.offload_state moves gradients held by no_step() or "
    "retain_graph=True there), so .grad is None and nothing would be clipped. Clip the "
    "whole window's gradient in its last backward instead: layeropt.backward(loss, "
    "max_norm=...) outside no_step(); or keep held gradients in .grad with "
    "offload_state(opt, held_grads=False). Nothing was clipped or updated."
)

SHARED_PARAMETER_ERROR = (
    "{optimizer}.step() is about to skip parameter {name}: it has no gradient because "
    "the layeropt optimizer {owner}, which also owns it, updated it during the latest "
    "attached backward and freed its gradient; torch would update it with both "
    "optimizers. Give each "
    "parameter to one optimizer, or run the backwards that reach the shared "
    "parameters inside `with opt.no_step():` (opt: the layeropt optimizer) so that "
    "their gradients stay in .grad, and call {optimizer}.step() before opt.step(): "
    "layeropt's step() applies and frees the gradients it holds, as torch's step() "
    "then zero_grad() would. If {optimizer} replaces the layeropt optimizer, call "
    ".remove() on that attachment (the handle attach() returned) first, or delete the "
    "layeropt optimizer."
)

DEFER_WARNING = (
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=True) runs a nested backward per "
    "segment; to stay exact, layeropt holds every gradient of this backward and steps "
    "them all when it ends, so in-backward updates save no memory here. Use "
    "layeropt.checkpoint(fn, *args) or use_reentrant=False (Hugging Face: "
    "activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': "
    "False}), in older releases gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "...)) to update layers during backward again."
)

NESTED_ERROR = (
    "a gradient landed in a backward nested inside the backward of an autograd "
    "Function (a reentrant activation checkpoint other than torch's, e.g. DeepSpeed's "
    "or a custom one), so parameters would be stepped on partial gradients. Use "
    "layeropt.checkpoint(fn, *args) or torch.utils.checkpoint.checkpoint("
    "fn, *args, use_reentrant=False) instead."
)

GLOBAL_ESTIMATE_ERROR = (
    "{name} keeps state outside its per-parameter state (param-group values or "
    "attributes of the optimizer: {keys}) that depends on the gradients of all its "
    "parameters together (a global estimate, as in D-Adaptation or Prodigy), so it "
    "cannot update one layer at a time during backward. {outcome} "
    "Use it as a plain optimizer (without layeropt.attach), or an optimizer whose "
    "state is per parameter."
)

WRAPPED_STEP_ERROR = (
    "{name} wraps a layeropt optimizer and has a step() of its own (a Lookahead, an "
    "average of the weights, a schedule around the inner step): layeropt steps the inner "
    "optimizer during backward and frees the gradients, so {name}.step() would then find "
    "none and skip its own part. Use {name} around a plain torch optimizer, without "
    "layeropt."
)

BASE_OPTIMIZER_ERROR = (
    "{name} steps the layeropt optimizer in its .base_optimizer after moving the weights "
    "between two backwards (sharpness-aware minimization: its first_step reads every "
    "gradient of the first backward). Attach the base optimizer, "
    "layeropt.attach(model, opt.base_optimizer), and run both backwards inside "
    "`with opt.base_optimizer.no_step():` - their gradients stay in .grad for {name}, "
    "and its second_step applies them, as torch's does (docs/recipes.md, SAM)."
)

RANDOM_STEP_ERROR = (
    "{name}.step() draws random numbers (stochastic rounding, gradient noise): stepped "
    "one layer at a time during backward it would draw them in another order than one "
    "step() over every parameter, so the results would differ. Nothing was updated. Use "
    "it as a plain optimizer (without layeropt.attach), or turn its randomness off "
    "(torchao: bf16_stochastic_round=False)."
)

SKIP_CONTRACT_ERROR = (
    "{name}.step() changed a parameter that had no gradient in the call, or its state "
    "(shape {shape}, param group {group}): it does not skip parameters whose .grad is "
    "None, the contract "
    "of torch's optimizers that updating one layer at a time relies on (weight decay "
    "applied before checking p.grad is the usual cause), so each layer's call would "
    "change every parameter again. That call may have changed other parameters too "
    "(layeropt undid it only on those it checked): start again from a checkpoint or the "
    "initial weights, and use this optimizer as a plain one (without layeropt.attach), "
    "or make its step() skip parameters without a gradient before changing them."
)

LATE_MOVE_ERROR = (
    "{name} changed values it keeps outside its per-parameter state ({keys}) in a "
    "step call although earlier "
    "calls of the same training step did not, so its layers would be stepped with "
    "different group state. {outcome} Use it as a plain optimizer (without "
    "layeropt.attach)."
)

DDP_JOIN_ERROR = (
    "DDP's join() (uneven inputs) is not supported with in-backward updates: a "
    "process that ran out of data would all-reduce zero buckets through layeropt's "
    "hook without any gradient of its own. Give every process the same number of "
    "batches (DistributedSampler with drop_last=True), or call .remove() on the "
    "attachment for a loop that needs join()."
)

DDP_UNUSED_ERROR = (
    "a parameter DDP synchronises got no gradient in this backward (an unused "
    "parameter under static_graph=True); layeropt cannot tell whether other "
    "processes used it, so it would step on a wrong gradient. Construct DDP with "
    "find_unused_parameters=True (exact with layeropt, static_graph or not), use every "
    "parameter in every forward, or leave the unused ones to a plain torch.optim "
    "optimizer."
)


VERIFY_ERROR = (
    "LAYEROPT_VERIFY: parameter {name} differs in training step {step} between the loop "
    "as torch runs it and in-backward updating ({size}): {cause}"
)
VERIFY_CAUSES = {
    "edited": (
        "its gradient changed between backward and step() (an edit after backward - "
        "clipping, scaling, noise -, a clip over other parameters, or another backward "
        "added to it). In backward mode the update uses the gradient as it lands and .grad "
        "is None afterwards, so that edit is silently lost. Change gradients before they "
        "are applied: a post-accumulate-grad hook (param.register_post_accumulate_grad_hook), "
        "layeropt.backward(loss, max_norm=..., scaler=...) for global clipping and "
        "unscaling, attach(..., clip_value=/bucket_max_norm=) per layer; see docs/rules.md."
    ),
    "discarded": (
        "its gradient was discarded before step() (set to None, or a zero_grad() the loop "
        "makes before stepping), but in-backward updating would already have applied it. "
        "Keep that backward from updating the parameter (requires_grad_(False) during it) or "
        "run it inside `with opt.no_step():`; see docs/rules.md."
    ),
    "not zeroed": (
        "its gradient was not zeroed since the last step(), so torch adds this step's "
        "gradient to the last one's, while in-backward updating frees each gradient once "
        "applied. Zero gradients between steps (optimizer.zero_grad()), or accumulate inside "
        "`with opt.no_step():`."
    ),
    "moved": (
        "the parameter itself changed between its gradient's landing and step() (another "
        "optimizer, or code between backward and step(), wrote it), which in-backward "
        "updating would have preceded. Give each parameter to one optimizer, and change "
        "parameters before backward or after step()."
    ),
    "update": (
        "with the same gradient, parameter and hyperparameters, the update differs: an "
        "optimizer whose step() reads other parameters' gradients (a global-norm clip or "
        "statistic inside step(); in backward it sees one bucket at a time) cannot be used "
        "in backward - use it without layeropt.attach; if it is a torch.optim optimizer, "
        "this is a layeropt bug: please report it."
    ),
}
OVERLAP_HELD_ERROR = (
    "offload_state(overlap=True) without prefetch=True, with held gradients in host memory "
    "(held_grads=True, the default), has not been shown bit-identical to torch.optim on a "
    "GPU yet, so it is refused. Use offload_state(opt, overlap=True, prefetch=True) "
    "(bit-identical on an H200, 2026-12-04, also at 7B), held_grads=False (held gradients "
    "stay in .grad on the device), or overlap=False (the default)."
)

VERIFY_OFFLOAD_ERROR = (
    "LAYEROPT_VERIFY (attach(..., verify=)) does not support an optimizer whose state is "
    "in host memory (layeropt.offload.offload_state) yet: verify the same loop without "
    "offload_state first, then train with it."
)
VERIFY_PASSED = (
    "LAYEROPT_VERIFY: {n} training step(s) gave the same parameters and optimizer state "
    "bit for bit with torch's semantics and with in-backward updating; updating in "
    "backward from now on."
)

VERIFY_NO_STEP = (
    "LAYEROPT_VERIFY: this loop went on ({where}) without calling step() after a "
    "backward, so each backward is its own training step: that step was applied with "
    "torch's semantics and gave the same parameters and optimizer state bit for bit as "
    "in-backward updating ({n} training step(s) verified); updating in backward from now on."
)

VERIFY_ENDED = (
    "LAYEROPT_VERIFY: the program ended after {n} of {total} training step(s) were "
    "verified, all equal bit for bit{pending}."
)


class LayeroptError(RuntimeError):
    """Base class of every error layeropt raises on its own."""


class AttachError(LayeroptError):
    """``layeropt.attach`` cannot hook these parameters (see the message)."""


class BackwardStateError(LayeroptError):
    """A gradient arrived in a way that cannot give an exact update."""


class VerifyError(BackwardStateError):
    """``LAYEROPT_VERIFY``: in-backward updating would have given other numbers than the
    loop with torch's semantics (``layeropt/checking/verify.py``)."""


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

NO_OWNER_ERROR = (
    "no layeropt optimizer owns any parameter of this model. Create one first, e.g. "
    "opt = layeropt.Adam(model.parameters()), then call layeropt.attach(model, opt)."
)

NOT_LEAF_ERROR = (
    "parameter {name!r} is not a leaf tensor, so autograd never accumulates its "
    "gradient. Make it an nn.Parameter (or a leaf with requires_grad=True)."
)

SPARSE_MODULE_ERROR = (
    "parameter {name!r} belongs to {module}(sparse=True), whose gradients are sparse; "
    "layeropt steps dense gradients only. Set sparse=False, or give this parameter to a "
    "separate plain torch.optim optimizer (e.g. torch.optim.SparseAdam)."
)

OWNED_TWICE_ERROR = (
    "parameter {name!r} is owned by {n} layeropt optimizers, so it would be stepped twice "
    "per backward. Give each parameter to one optimizer (use param groups for different "
    "settings)."
)

COMPILED_STEP_ERROR = (
    "{name}.step() inside a torch.compile'd function while attached: torch would compile "
    "its own step there (Adam's step count becomes a tensor, and its last bits can "
    "differ from an eager step), while layeropt's updates run eagerly, in backward. "
    "Keep step() and zero_grad() outside the compiled function: compile the model "
    "(torch.compile(model)) or the loss instead. Nothing was updated by this call."
)
