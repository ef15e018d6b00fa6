"""Lightning ``Trainer`` + layeropt equals the same ``Trainer`` + torch.optim, bit for bit.

Every set-up is trained twice from the same seed and data: with
``torch.optim.AdamW`` and with ``layeropt.AdamW`` plus
:class:`layeropt.integrations.lightning.LayeroptCallback` (or attached by
hand, without it). Parameters and optimizer state are compared bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from harness import assert_same

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.plugins.precision import MixedPrecision, Precision  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import layeropt  # noqa: E402
from layeropt.integrations.lightning import LayeroptCallback, LightningSetupError  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, opt_cls: Any, attach_by_hand: bool = False, groups: bool = False,
                 **kw: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
        )
        self.opt_cls, self.kw, self.attach_by_hand = opt_cls, kw, attach_by_hand
        self.groups = groups  # (no weight decay on biases and norms, as HF and timm do)
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        params: Any = self.parameters()
        if self.groups:
            named = list(self.named_parameters())
            params = [{"params": [p for _, p in named if p.ndim > 1]},
                      {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0}]
        opt = self.opt_cls(params, lr=1e-2, **self.kw)
        if self.attach_by_hand:
            self.handle = layeropt.attach(self, opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return [opt], [sched]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if isinstance(self.opt_cls, type) and not issubclass(self.opt_cls, layeropt.InBackwardOptimizer):
            self.norms.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=g) * 3,
                                    torch.randn(32, 4, generator=g)), batch_size=4)


def _fit(module: Net, callbacks: list = (), steps: int = 3, ckpt_path: str | None = None,
         **trainer_kw: Any) -> L.Trainer:
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=list(callbacks), **trainer_kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*litlogger.*")
        warnings.filterwarnings("ignore", ".*ended before the epoch ended.*")  # (same in both)
        warnings.filterwarnings("ignore", ".*`training_step` returned `None`.*")
        trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return trainer


def _fp16() -> dict:
    """Lightning's fp16 recipe with a GradScaler, on CPU (its default there is bf16)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    return dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])


SETUPS = {
    "plain": dict(),
    "clip-norm": dict(gradient_clip_val=0.05),
    "clip-value": dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    "accumulate-2": dict(accumulate_grad_batches=2),
    "accumulate-3-clip": dict(accumulate_grad_batches=3, gradient_clip_val=0.05),
    "bf16-mixed": dict(precision="bf16-mixed", gradient_clip_val=0.05),
    "16-mixed": dict(_fp16=True, gradient_clip_val=0.05, accumulate_grad_batches=2),
}


def _kw(setup: dict) -> dict:
    kw = dict(setup)
    if kw.pop("_fp16", False):
        kw.update(_fp16())
    return kw


@pytest.mark.parametrize("setup", list(SETUPS), ids=list(SETUPS))
def test_lightning_with_callback_matches_torch_optim(setup):
    ref = Net(torch.optim.AdamW, weight_decay=0.1)
    _fit(ref, steps=4, **_kw(SETUPS[setup]))
    module = Net(layeropt.AdamW, weight_decay=0.1)
    callback = LayeroptCallback(bucket_cap_mb=0, log_grad_norm=True)
    trainer = _fit(module, [callback], steps=4, **_kw(SETUPS[setup]))
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())
    ref_opt = ref.trainer.optimizers[0]
    assert_same(ref_opt.state_dict(), trainer.optimizers[0].state_dict())
    opt = trainer.optimizers[0]
    assert not opt.attached  # detached when fit ended
    assert opt.last_grad_norm is not None and float(opt.last_grad_norm) > 0
    if setup in ("plain", "clip-norm"):  # the norm Lightning's own utility computes
        assert float(opt.last_grad_norm) == pytest.approx(ref.norms[-1], rel=1e-6)


@pytest.mark.parametrize("setup", ["plain", "accumulate-3-clip"])
def test_lightning_weight_averaging_matches_torch_optim(setup):
    """Lightning's ``EMAWeightAveraging`` callback (an ``AveragedModel`` updated after each
    optimizer step, swapped into the module when fit ends) beside ``LayeroptCallback``."""
    import lightning.pytorch.callbacks as callbacks

    EMAWeightAveraging = getattr(callbacks, "EMAWeightAveraging", None)
    if EMAWeightAveraging is None:
        pytest.skip(f"lightning {L.__version__} has no EMAWeightAveraging")
    ref, ref_ema = Net(torch.optim.AdamW, weight_decay=0.1), EMAWeightAveraging(decay=0.5)
    _fit(ref, [ref_ema], steps=4, **_kw(SETUPS[setup]))
    module, ema = Net(layeropt.AdamW, weight_decay=0.1), EMAWeightAveraging(decay=0.5)
    _fit(module, [LayeroptCallback(bucket_cap_mb=0), ema], steps=4, **_kw(SETUPS[setup]))
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())
    for p, q in zip(ema._average_model.parameters(), ref_ema._average_model.parameters()):
        assert_same(p.detach(), q.detach())


class _LateBranch(Net):
    """A branch the first step does not reach: its first gradient, and its momentum
    buffer, come a step later."""

    def __init__(self, opt_cls: Any, **kw: Any) -> None:
        super().__init__(opt_cls, **kw)
        self.branch = torch.nn.Linear(32, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.net[:3](x)
        out = self.net[3](h) + (self.branch(h) if self.global_step >= 1 else 0)
        return torch.nn.functional.mse_loss(out.float(), y.float())  # (torch 2.4: one dtype)


@pytest.mark.parametrize("setup", ["plain", "accumulate-2"])
def test_a_step_torch_takes_by_its_whole_list_is_held_under_the_callback(setup):
    """torch's foreach SGD with momentum, bf16 on the CPU, a layer's first gradient a step
    later (tests/test_exact.py's case) through the callback: the step where the branch
    first lands is held to the end of backward, with the warning, and training stays
    Lightning's with torch.optim bit for bit."""
    kw = dict(momentum=0.9, foreach=True)
    ref = _LateBranch(torch.optim.SGD, **kw)
    _fit(ref, steps=3, precision="bf16-true", **SETUPS[setup])
    module = _LateBranch(layeropt.SGD, **kw)
    with pytest.warns(UserWarning, match="holds this backward's gradients"):
        trainer = _fit(module, [LayeroptCallback(bucket_cap_mb=0)], steps=3,
                       precision="bf16-true", **SETUPS[setup])
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())
    assert_same(ref.trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict())


@pytest.mark.parametrize("setup", ["clip-norm", "accumulate-3-clip"])
def test_clip_norm_over_param_groups_matches_torch_optim(setup):
    """Decay and no-decay param groups: Lightning's clip_gradients sums the norm over
    ``Precision.main_params`` - the param groups' order, not the module's - and the
    callback now measures in that order (the last bits of the clip coefficient differed;
    found by a fuzzer over trainer configurations)."""
    ref = Net(torch.optim.AdamW, groups=True, weight_decay=0.1)
    _fit(ref, steps=4, **_kw(SETUPS[setup]))
    module = Net(layeropt.AdamW, groups=True, weight_decay=0.1)
    trainer = _fit(module, [LayeroptCallback()], steps=4, **_kw(SETUPS[setup]))
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())
    assert_same(ref.trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict())


def test_a_fused_optimizer_clipped_under_mixed_precision_is_refused_as_lightning_does():
    """Lightning's MixedPrecision refuses to clip a fused optimizer (it unscales inside
    its kernel); the callback trained it instead, a result Lightning never gives. Now
    refused at fit start, before anything is updated."""
    setup = dict(precision="bf16-mixed", gradient_clip_val=0.05)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(Net(torch.optim.AdamW, fused=True), **setup)
    module = Net(layeropt.AdamW, fused=True)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(LightningSetupError, match="does not allow for gradient clipping"):
        _fit(module, [LayeroptCallback()], **setup)
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters()))


def test_callback_with_library_defaults_matches_torch_optim():
    setup = _kw(SETUPS["accumulate-3-clip"])
    ref = Net(torch.optim.AdamW)
    _fit(ref, **setup)
    module = Net(layeropt.AdamW)
    _fit(module, [LayeroptCallback()], **setup)
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())


class _Unfreeze(L.Callback):
    """Gradual unfreezing: the first layer trains from optimizer step 2 on."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.net[0].requires_grad_(trainer.global_step >= 2)


@pytest.mark.parametrize("setup", ["clip-norm", "accumulate-3-clip"])
def test_callback_with_layers_unfrozen_mid_training(setup):
    """Clipping measures the unfrozen layer (its first step, accumulated ones too)."""
    modules = []
    for cls, callbacks in ((torch.optim.AdamW, []), (layeropt.AdamW, [LayeroptCallback()])):
        module = Net(cls)
        module.net[0].requires_grad_(False)
        _fit(module, [*callbacks, _Unfreeze()], steps=4, **_kw(SETUPS[setup]))
        modules.append(module)
    ref, module = modules
    assert not torch.equal(ref.net[0].weight, Net(torch.optim.AdamW).net[0].weight)  # trained
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())


@pytest.mark.parametrize("setup", ["clip-norm", "bf16-mixed", "16-mixed"])
def test_attached_without_callback_is_exact_but_warns(setup):
    """Without the callback an attached optimizer under Lightning holds its gradients
    (the closure or the GradScaler) until the step: exact, saves nothing, says so."""
    kw = _kw(SETUPS[setup])
    kw.pop("accumulate_grad_batches", None)
    ref = Net(torch.optim.AdamW)
    _fit(ref, **kw)
    module = Net(layeropt.AdamW, attach_by_hand=True)
    with pytest.warns(UserWarning, match="holds them"):
        _fit(module, **kw)
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())


def test_attached_without_callback_refuses_accumulation():
    module = Net(layeropt.AdamW, attach_by_hand=True)
    with pytest.raises(layeropt.BackwardStateError, match="LayeroptCallback"):
        _fit(module, accumulate_grad_batches=2)


def test_callback_refuses_what_it_cannot_make_exact():
    with pytest.raises(LightningSetupError, match="no layeropt optimizer"):
        _fit(Net(torch.optim.AdamW), [LayeroptCallback()])

    class Manual(Net):
        def __init__(self) -> None:
            super().__init__(layeropt.AdamW)
            self.automatic_optimization = False

    with pytest.raises(LightningSetupError, match="manual optimization"):
        _fit(Manual(), [LayeroptCallback()])


class _ClipsFromStep2(Net):
    """Lightning's own conditional-clipping example: configure_gradient_clipping clips
    only from the third step on."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        if self.global_step >= 2:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


class _ClipsEveryStep(Net):
    """An override that clips on every step, as the default does."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def test_a_step_that_configure_gradient_clipping_skips_is_refused():
    """The callback clips every step during backward: a step the module's override does not
    clip was clipped all the same (silently, before); now refused at that step's end. An
    override that clips every step stays exact."""
    with pytest.raises(LightningSetupError, match="did not call clip_gradients"):
        _fit(_ClipsFromStep2(layeropt.AdamW), [LayeroptCallback()], steps=4,
             gradient_clip_val=0.05)
    ref, got = _ClipsEveryStep(torch.optim.AdamW), _ClipsEveryStep(layeropt.AdamW)
    _fit(ref, steps=4, gradient_clip_val=0.05)
    _fit(got, [LayeroptCallback()], steps=4, gradient_clip_val=0.05)
    for p, q in zip(got.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_callback_with_a_compiled_module_and_clipping():
    """A ``torch.compile``'d module: the two passes of clipping run its graph twice."""
    from torch._functorch import config as functorch_config

    modules = []
    for cls, callbacks in ((torch.optim.AdamW, []), (layeropt.AdamW, [LayeroptCallback()])):
        torch._dynamo.reset()
        module = Net(cls)
        _fit(torch.compile(module, backend="aot_eager"), callbacks, steps=4,
             **_kw(SETUPS["accumulate-3-clip"]))
        modules.append(module)
    ref, module = modules
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())
    assert getattr(functorch_config, "donated_buffer", True)  # restored when fit ended


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() > 0)


@pytest.mark.parametrize("setup", ["accumulate-3-clip", "16-mixed"])
def test_callback_offload_state_matches_torch_optim(setup):
    """``LayeroptCallback(offload_state=True)``: the same parameters and optimizer state
    as the callback without offload and as torch.optim, bit for bit; the state lives in
    host tensors that each step copies to the device and back."""
    ref = Net(torch.optim.AdamW, weight_decay=0.1)
    _fit(ref, steps=4, **_kw(SETUPS[setup]))
    runs = []
    for offload in (False, True):
        module = Net(layeropt.AdamW, weight_decay=0.1)
        callback = LayeroptCallback(bucket_cap_mb=0, offload_state=offload)
        trainer = _fit(module, [callback], steps=4, **_kw(SETUPS[setup]))
        runs.append((module, trainer.optimizers[0], callback))
    (plain, plain_opt, _), (module, opt, callback) = runs
    handle = callback.offloads[opt]
    assert handle.host_bytes == _state_bytes(opt) > 0  # every state tensor is a host copy
    assert 0 < handle.peak_device_bytes < handle.host_bytes  # one layer's state at a time
    assert handle.copied_bytes >= 4 * handle.host_bytes
    if setup.startswith("accumulate"):  # the accumulated micro-batches waited in host memory
        assert handle.held.down_bytes > 0 and handle.held.up_bytes > 0
    for other, other_opt in ((plain, plain_opt), (ref, ref.trainer.optimizers[0])):
        for p, q in zip(module.parameters(), other.parameters()):
            assert_same(p.detach(), q.detach())
        assert_same(opt.state_dict(), other_opt.state_dict())


def test_callback_offload_state_resumes_into_host_memory(tmp_path, monkeypatch):
    """A checkpoint's optimizer state loads into host memory (Lightning's move of the
    loaded state to the device is skipped for it) and training continues exactly."""
    import lightning.pytorch.strategies.strategy as strategy_module

    first = Net(torch.optim.AdamW)
    trainer = _fit(first, steps=2)
    ckpt = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(ckpt)
    moved = []
    original = strategy_module._optimizer_to_device
    monkeypatch.setattr(strategy_module, "_optimizer_to_device",
                        lambda o, device: (moved.append(o), original(o, device)))
    ref = Net(torch.optim.AdamW)
    _fit(ref, steps=4, ckpt_path=ckpt)
    assert moved == [ref.trainer.optimizers[0]]  # what Lightning does with a loaded state
    module = Net(layeropt.AdamW)
    callback = LayeroptCallback(offload_state=True)
    trainer = _fit(module, [callback], steps=4, ckpt_path=ckpt)
    opt = trainer.optimizers[0]
    assert moved == [ref.trainer.optimizers[0]]  # not the offloaded one
    assert callback.offloads[opt].host_bytes == _state_bytes(opt) > 0
    assert "load_optimizer_state_dict" not in vars(trainer.strategy)  # restored at fit end
    for p, q in zip(module.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())
    assert_same(opt.state_dict(), ref.trainer.optimizers[0].state_dict())


class _SkipsBatches(Net):
    """``training_step`` returns ``None`` (Lightning skips that micro-batch) at the given
    positions of every other accumulation window; records the logged or measured norms."""

    def __init__(self, opt_cls: Any, accumulate: int, skip: tuple[int, ...]) -> None:
        super().__init__(opt_cls)
        self.accumulate, self.skip = accumulate, skip
        self.step_norms: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if (batch_idx // self.accumulate) % 2 and batch_idx % self.accumulate in self.skip:
            return None
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not issubclass(self.opt_cls, layeropt.InBackwardOptimizer):  # torch's: measured
            norm = grad_norm(self, norm_type=2).get("grad_2.0_norm_total")  # ({}: no grads)
            if norm is not None:
                self.step_norms[self.global_step] = float(norm)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name == "grad_2.0_norm_total":  # LayeroptCallback(log_grad_norm=True)'s
            self.step_norms[self.global_step] = float(value)
        super().log(name, value, *args, **kwargs)


# (trainer settings, accumulate_grad_batches, skipped positions in the window, offload_state)
SKIPS = {
    "norm-acc2-last": (SETUPS["clip-norm"], 2, (1,), False),
    "norm-acc3-last": (SETUPS["clip-norm"], 3, (2,), False),
    "norm-acc3-first-and-last": (SETUPS["clip-norm"], 3, (0, 2), False),
    "norm-acc3-middle": (SETUPS["clip-norm"], 3, (1,), False),
    "norm-acc3-first": (SETUPS["clip-norm"], 3, (0,), False),
    "norm-acc1-no-gradient": (SETUPS["clip-norm"], 1, (0,), False),
    "value-acc3-last": (SETUPS["clip-value"], 3, (2,), False),
    "16-mixed-acc2-last": (SETUPS["16-mixed"], 2, (1,), False),
    "norm-acc2-last-offload": (SETUPS["clip-norm"], 2, (1,), True),
    "no-clip-acc2-last": (SETUPS["plain"], 2, (1,), False),
}


@pytest.mark.parametrize("name", list(SKIPS), ids=list(SKIPS))
def test_training_step_returning_none_matches_torch_optim(name):
    """A micro-batch whose ``training_step`` returns ``None`` runs no backward. On the last
    one of a window nothing was clipped in backward: the held gradients are stepped as
    Lightning clips them (before: stepped unclipped, silently), and the logged norm is
    theirs (before: the previous step's)."""
    setup, accumulate, skip, offload = SKIPS[name]
    def kw() -> dict:  # (each Trainer its own GradScaler)
        return {**_kw(setup), "accumulate_grad_batches": accumulate}

    ref = _SkipsBatches(torch.optim.AdamW, accumulate, skip)
    _fit(ref, steps=4, **kw())
    module = _SkipsBatches(layeropt.AdamW, accumulate, skip)
    callback = LayeroptCallback(log_grad_norm=True, offload_state=offload)
    trainer = _fit(module, [callback], steps=4, **kw())
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert_same(trainer.optimizers[0].state_dict(), ref.trainer.optimizers[0].state_dict())
    assert module.step_norms == pytest.approx(ref.step_norms, rel=1e-6)
    assert len(ref.step_norms) == (2 if accumulate == 1 else 4)  # (none: no gradients)


class _OwnBackward(Net):
    """Lightning's documented ``backward`` hook, overridden."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        (3.0 * loss).backward(*args, **kwargs)


class _OwnPrecisionBackward(Precision):
    """A precision plugin with a ``backward`` of its own."""

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        super().backward(3.0 * tensor, model, optimizer, *args, **kwargs)


# (module, precision plugin or None, what the error names)
OWN_BACKWARDS = {
    "module": (_OwnBackward, None, "_OwnBackward.backward"),
    "precision-plugin": (Net, _OwnPrecisionBackward, "_OwnPrecisionBackward.backward"),
}


@pytest.mark.parametrize("name", list(OWN_BACKWARDS), ids=list(OWN_BACKWARDS))
def test_a_backward_of_its_own_is_refused(name):
    """The callback replaces the precision plugin's backward, which calls the module's: an
    override of either was skipped silently (the loss not tripled); now refused at fit start,
    nothing trained. torch.optim runs the override (the numbers the callback would miss)."""
    cls, plugin, owner = OWN_BACKWARDS[name]

    def kw() -> dict:
        return {"plugins": [plugin()]} if plugin is not None else {}

    ref, plain = cls(torch.optim.AdamW), Net(torch.optim.AdamW)
    _fit(ref, **kw())
    _fit(plain)
    assert not torch.equal(ref.net[0].weight, plain.net[0].weight)  # the override counts
    module = cls(layeropt.AdamW)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(LightningSetupError, match=rf"{owner} .*is overridden.*training_step"):
        _fit(module, [LayeroptCallback()], **kw())
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    assert not module.trainer.optimizers[0].attached


class _Clamped(Net):
    """Weights clamped in place each step (WGAN's weight clipping), in the hook ``where``."""

    def __init__(self, opt_cls: Any, where: str) -> None:
        super().__init__(opt_cls)
        self.where = where

    def _clamp(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.2, 0.2)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.where == "on_before_optimizer_step":
            self._clamp()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.where == "on_train_batch_end":
            self._clamp()


@pytest.mark.parametrize("where", ["on_before_optimizer_step", "on_train_batch_end"])
def test_weights_clamped_before_the_step_are_refused_after_it_exact(where):
    """Between backward and the step (``on_before_optimizer_step``) torch's step updates
    the clamped weights, the callback's backward updated them before the clamp: refused
    at the step (silent before 2026-12-07). After the step (``on_train_batch_end``): exact."""
    ref = _Clamped(torch.optim.AdamW, where)
    _fit(ref)
    module = _Clamped(layeropt.AdamW, where)
    if where == "on_train_batch_end":
        _fit(module, [LayeroptCallback()])
        for p, q in zip(module.parameters(), ref.parameters()):
            assert_same(p.detach(), q.detach())
        return
    with pytest.raises(layeropt.BackwardStateError, match="written in place after"):
        _fit(module, [LayeroptCallback()])
