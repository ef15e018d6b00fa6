"""Held gradients in host memory (``offload_state(opt)``, ``held_grads=True`` by default).

Every test trains the same model three ways from one seed - torch.optim,
layeropt, layeropt with the state offloaded and its held gradients in host
memory - through the same accumulation window, and compares parameters and
optimizer state bit for bit, under both bucket schedules (``bucket_cap_mb=0``
and the library default). Memory is measured in bytes on CPU, with the host
tensors allocated outside torch's allocator (numpy), so that what the
profiler counts is what a GPU would hold.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import layeropt
from harness import (
    OPTIMIZER_CONFIGS,
    REPRESENTATIVE,
    Boom,
    assert_models_equal,
    assert_same,
    clone_kwargs,
    config_id,
)
from layeropt.offload.held import HostHeld
from layeropt.errors import AttachError, LayeroptError
from layeropt.memory import PeakMemory
from layeropt.models import make_model
from layeropt.offload import offload_state

CAPS = pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])


def _three(model_name: str, opt_name: str, kw: dict[str, Any], cap: float, model=None,
           attachments: list[Any] | None = None, **offload_kw: Any):
    """(torch model, opt), (layeropt ...), (layeropt offloaded ...), handle, batch, loss;
    ``attachments``: the two layeropt runs' attachments appended to it."""
    if model is None:
        model, batch_fn, loss_fn = make_model(model_name)
    else:
        batch_fn = loss_fn = None
    cls = getattr(torch.optim, opt_name)
    ref = copy.deepcopy(model)
    runs = [(ref, cls(ref.parameters(), **clone_kwargs(kw)))]
    for _ in range(2):
        m = copy.deepcopy(model)
        o = layeropt.in_backward(cls)(m.parameters(), **clone_kwargs(kw))
        h = layeropt.attach(m, o, bucket_cap_mb=cap)
        if attachments is not None:
            attachments.append(h)
        runs.append((m, o))
    handle = offload_state(runs[2][1], **offload_kw)
    return runs, handle, batch_fn, loss_fn


def _assert_all_same(runs) -> None:
    (m0, o0), *rest = runs
    for m, o in rest:
        assert_models_equal(m0, m)
        assert_same(o0.state_dict(), o.state_dict())


def _window(runs, handle, micro, loss_fn, *, last=True):
    """One accumulation window: torch sums every micro-batch then steps; layeropt runs
    all but the last inside no_step() (the last too with ``last=False``, then step())."""
    n = len(micro)
    (ref, ref_opt), *ours = runs
    for mb in micro:
        (loss_fn(ref, mb) / n).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    for i, (m, o) in enumerate(ours):
        for k, mb in enumerate(micro):
            if k < n - 1 or not last:
                with o.no_step():
                    (loss_fn(m, mb) / n).backward()
                if i == 1:  # offloaded: nothing of the window left in .grad
                    assert all(p.grad is None for p in m.parameters())
                    assert len(handle.held) > 0
            else:
                (loss_fn(m, mb) / n).backward()
        o.step()
        o.zero_grad()
    assert len(handle.held) == 0


def _micro(batch_fn, gen, n):
    return [batch_fn(gen) for _ in range(n)]


@CAPS
@pytest.mark.parametrize("cfg", OPTIMIZER_CONFIGS, ids=config_id)
def test_every_optimizer_matches_torch_and_no_offload(cfg, cap):
    opt_name, kw = cfg
    runs, handle, batch_fn, loss_fn = _three("gpt", opt_name, kw, cap)
    gen = torch.Generator().manual_seed(1)
    for n in (3, 2, 4):
        _window(runs, handle, _micro(batch_fn, gen, n), loss_fn)
    _assert_all_same(runs)
    g = sum(p.numel() * p.element_size() for p in runs[0][0].parameters())
    assert handle.held.down_bytes == (2 + 1 + 3) * g  # every held micro-batch's gradient down
    assert handle.held.up_bytes == 3 * g  # each window's sum up once


@CAPS
@pytest.mark.parametrize("model_name", ["mlp", "unet", "loop", "frozen"])
@pytest.mark.parametrize("cfg", REPRESENTATIVE, ids=config_id)
def test_every_model(cfg, model_name, cap):
    opt_name, kw = cfg
    runs, handle, batch_fn, loss_fn = _three(model_name, opt_name, kw, cap)
    gen = torch.Generator().manual_seed(2)
    for n in (3, 2):
        _window(runs, handle, _micro(batch_fn, gen, n), loss_fn)
    _assert_all_same(runs)


@CAPS
def test_window_ended_by_step(cap):
    """Every micro-batch inside no_step(), then step() (the trainers' way when the
    window's last backward holds too): step() brings each bucket's sum back to step it."""
    runs, handle, batch_fn, loss_fn = _three("gpt", "AdamW", dict(lr=0.01), cap)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        _window(runs, handle, _micro(batch_fn, gen, 3), loss_fn, last=False)
    _assert_all_same(runs)


class TwoBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = (torch.nn.Linear(6, 6), torch.nn.Linear(6, 6),
                                     torch.nn.Linear(6, 2))

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(h))
        return self.head(h)


@CAPS
@pytest.mark.parametrize("unused_in", ["last", "first"])
def test_a_layer_some_micro_batches_do_not_reach(unused_in, cap):
    """The stepping micro-batch does not reach ``b`` (its sum is stepped at the end of
    that backward), or the first does not (``b``'s host sum starts later)."""
    runs, handle, _, _ = _three(None, "Adam", dict(lr=0.01), cap, model=TwoBranch())
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        xs = [torch.randn(3, 6, generator=gen) for _ in range(3)]
        skip = 2 if unused_in == "last" else 0
        (ref, ref_opt), *ours = runs
        for k, x in enumerate(xs):
            ref(x, use_b=k != skip).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for m, o in ours:
            for k, x in enumerate(xs):
                with o.no_step() if k < 2 else _nothing():
                    m(x, use_b=k != skip).square().mean().backward()
            o.step()
            o.zero_grad()
    _assert_all_same(runs)


@CAPS
@pytest.mark.parametrize("collected", ["at once", "by gc"])
def test_an_optimizer_deleted_mid_window_leaves_its_held_sums_in_grad(collected, cap):
    """An optimizer deleted mid-window, without ``remove()``: torch's ``.grad`` still holds
    the micro-batches' sum for the next optimizer's ``step()``; layeropt's host sums went
    with the deleted one (multifuzz offload seed 180,144, a handover by deletion: the
    layers whose sums were in host memory stepped without them). They go back to
    ``.grad`` when it is collected: at once, or by gc (a reference cycle of its own)."""
    import gc

    torch.manual_seed(5)
    base = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    results = []
    for layer in (False, True):
        m = copy.deepcopy(base)
        lib = layeropt if layer else torch.optim
        opt = lib.AdamW(m.parameters(), lr=0.01)
        if layer:
            layeropt.attach(m, opt, bucket_cap_mb=cap)
            offload_state(opt, held_device_bytes=m[0].weight.nbytes + m[0].bias.nbytes)
        for x in xs[:2]:
            with opt.no_step() if layer else _nothing():
                m(x).square().mean().backward()
        if collected == "by gc":
            opt.cycle = opt  # (kept alive by itself until gc runs)
        del opt
        if collected == "by gc":
            gc.collect()
        opt = lib.Adagrad(m.parameters(), lr=0.1)
        handle = layeropt.attach(m, opt, bucket_cap_mb=cap) if layer else None
        m(xs[2]).square().mean().backward()
        opt.step()
        results.append(([p.detach() for p in m.parameters()], opt.state_dict()))
        if handle is not None:
            handle.remove()
    assert_same(results[1], results[0])


@CAPS
@pytest.mark.parametrize("frozen", ["head", "trunk"])
@pytest.mark.parametrize("together", ["one attachment", "two", "one optimizer"])
@pytest.mark.parametrize("micro", [3, 4], ids=["3-micro-batches", "4"])
def test_a_layer_frozen_for_one_micro_batch_of_a_window(micro, together, frozen, cap):
    """Two optimizers (the trunk's and the head's; or one of both), their held gradients
    in host memory; one whole layer frozen for the second micro-batch. The third lands on it
    without a hook (its hooks went with the freeze, rule 7) and no backward of that
    optimizer's brings the first micro-batch's host sum back: its ``step()`` does. It
    stepped the third micro-batch's gradient alone before (multifuzz offload seed
    140,358, with any held_grads mode). With a fourth micro-batch (the hooks back), the
    third's gradient stayed in ``.grad`` and the fourth was added to it there: ``g1 + (g3
    + g4)``, not autograd's ``(g1 + g3) + g4`` - one rounding off, silently (multifuzz
    offload seed 541,054; 8 of these 12 ``4`` rows differed, all but ``two``, where no
    backward of the frozen layer's optimizer takes its hooks away). The frozen layer's
    host sum now comes back to ``.grad`` when its hooks go."""
    torch.manual_seed(3)
    base = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(k)) for k in range(micro)]
    results = []
    for mode in ("torch", "offload", "plain"):
        m = copy.deepcopy(base)
        lib = torch.optim if mode == "torch" else layeropt
        opts = ([lib.AdamW(m.parameters(), lr=0.1)] if together == "one optimizer" else
                [lib.AdamW(m[0].parameters(), lr=0.1), lib.RMSprop(m[2].parameters(), lr=0.01)])
        handles = []
        if mode != "torch":
            handles = ([layeropt.attach(m, o, bucket_cap_mb=cap) for o in opts]
                       if together == "two" else [layeropt.attach(m, opts, bucket_cap_mb=cap)])
        if mode == "offload":
            handles += [offload_state(o) for o in opts]
        frozen_layer = m[2] if frozen == "head" else m[0]
        for k, x in enumerate(xs):
            holds = mode != "torch" and k < micro - 1
            with contextlib.ExitStack() as window:
                for o in opts if holds else ():
                    window.enter_context(o.no_step())
                frozen_layer.requires_grad_(k != 1)
                m(x).square().mean().backward()
                frozen_layer.requires_grad_(True)
        for o in opts:
            o.step()
        results.append(([p.detach() for p in m.parameters()], [o.state_dict() for o in opts]))
        for h in reversed(handles):
            h.remove()
    assert_same(results[1], results[0])
    assert_same(results[2], results[0])


@CAPS
@pytest.mark.parametrize("fused", [False, True], ids=["", "fused"])
def test_a_skipped_step_after_a_layer_only_held_gradients_reach(fused, cap):
    """A GradScaler-skipped step (an inf in the last micro-batch) where ``b`` has only a
    gradient held in host memory (the first micro-batch's): torch's fused Adam makes
    ``b``'s state (zeros, step 0) on that skipped step as for every parameter with a
    ``.grad``, so layeropt does too (the tests/ampfuzz.py offload mix found it missing)."""
    runs, handle, _, _ = _three(None, "Adam", dict(lr=0.01, fused=fused), cap,
                                model=TwoBranch())
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in runs]
    gen = torch.Generator().manual_seed(4)
    for step in range(2):
        xs = [torch.randn(3, 6, generator=gen) for _ in range(2)]
        boost = [1.0, 1e38 if step == 0 else 1.0]  # the first window's last: inf, skipped
        (ref, ref_opt), *ours = runs
        for k, x in enumerate(xs):
            scalers[0].scale(ref(x, use_b=k == 0).square().mean() * boost[k]).backward()
        scalers[0].step(ref_opt)
        scalers[0].update()
        ref_opt.zero_grad()
        for (m, o), s in zip(ours, scalers[1:]):
            with o.no_step():
                s.scale(m(xs[0], use_b=True).square().mean()).backward()
            loss = m(xs[1], use_b=False).square().mean() * boost[1]
            layeropt.backward(s.scale(loss), scaler=s)
            s.step(o)
            s.update()
            o.zero_grad()
        if step == 0:
            assert [len(o.state) for _, o in runs] == [len(runs[0][1].state)] * 3
    _assert_all_same(runs)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@CAPS
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["active", "inactive"])
@pytest.mark.parametrize("scaler", [False, True], ids=["", "scaler"])
def test_layeropt_backward_measures_the_held_part(max_norm, scaler, cap):
    """``layeropt.backward(max_norm=, scaler=)`` on the window's last micro-batch: its
    measure pass sees each gradient plus its held sum in host memory."""
    runs, handle, batch_fn, loss_fn = _three("gpt", "AdamW", dict(lr=0.01), cap)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
               for _ in runs]
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        micro = _micro(batch_fn, gen, 3)
        boost = 1e38 if scaler and step == 1 else 1.0  # an overflow: the step skipped
        (ref, ref_opt), s = runs[0], scalers[0]
        for mb in micro:
            loss = loss_fn(ref, mb) * boost / 3
            (s.scale(loss) if s else loss).backward()
        if s:
            s.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        if s:
            s.step(ref_opt)
            s.update()
        else:
            ref_opt.step()
        ref_opt.zero_grad()
        norms = []
        for (m, o), s in zip(runs[1:], scalers[1:]):
            for mb in micro[:-1]:
                loss = loss_fn(m, mb) * boost / 3
                with o.no_step():
                    (s.scale(loss) if s else loss).backward()
            loss = loss_fn(m, micro[-1]) * boost / 3
            norms.append(layeropt.backward(s.scale(loss) if s else loss, max_norm=max_norm,
                                           scaler=s))
            if s:
                s.step(o)
                s.update()
            o.zero_grad()
        torch.testing.assert_close(*norms, rtol=0, atol=0, equal_nan=True)  # (an inf step: nan)
        assert len(handle.held) == 0
    _assert_all_same(runs)


@CAPS
def test_loop_accumulator(cap):
    runs, handle, batch_fn, loss_fn = _three("loop", "AdamW", dict(lr=0.01), cap)
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        micro = _micro(batch_fn, gen, 3)
        (ref, ref_opt), *ours = runs
        for mb in micro:
            (loss_fn(ref, mb) / 3).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for m, o in ours:
            acc = layeropt.LoopAccumulator(3, o)
            for mb in micro:
                acc.backward(loss_fn(m, mb))
            acc.step()
    _assert_all_same(runs)


@CAPS
def test_retain_graph_backwards_hold_in_host_memory(cap):
    """Two losses over one graph: the first backward (it keeps the graph) is held in
    host memory, the second steps with the sum."""
    runs, handle, batch_fn, loss_fn = _three("mlp", "AdamW", dict(lr=0.01), cap)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        x, y = batch_fn(gen)
        for i, (m, o) in enumerate(runs):
            out = m(x)
            with pytest.warns(UserWarning, match="retain_graph") if i else _nothing():
                F.mse_loss(out, y).backward(retain_graph=True)
            if i == 2:
                assert all(p.grad is None for p in m.parameters()) and len(handle.held)
            out.square().mean().backward()
            o.step()
            o.zero_grad()
    _assert_all_same(runs)


@CAPS
def test_recipes_that_read_grad_get_the_sum_in_grad(cap):
    """A window in no_step() ended by torch's GradScaler recipe (unscale_, clip, step):
    the recipe's backward brings the host sums back into ``.grad``, where it reads them."""
    runs, handle, batch_fn, loss_fn = _three("mlp", "Adam", dict(lr=0.01), cap)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in runs]
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        micro = _micro(batch_fn, gen, 3)
        for i, ((m, o), s) in enumerate(zip(runs, scalers)):
            for k, mb in enumerate(micro):
                loss = s.scale(loss_fn(m, mb) / 3)
                if i and k < 2:
                    with o.no_step():
                        loss.backward()
                elif i:
                    with pytest.warns(UserWarning, match="GradScaler"):
                        loss.backward()
                else:
                    loss.backward()
            if i == 2:
                assert all(p.grad is not None for p in m.parameters()) and not len(handle.held)
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            s.step(o)
            s.update()
            o.zero_grad()
    _assert_all_same(runs)


@CAPS
def test_step_closure_after_a_window(cap):
    runs, handle, batch_fn, loss_fn = _three("mlp", "SGD", dict(lr=0.1, momentum=0.9), cap)
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        micro = _micro(batch_fn, gen, 3)
        for i, (m, o) in enumerate(runs):
            for mb in micro[:-1]:
                with o.no_step() if i else _nothing():
                    (loss_fn(m, mb) / 3).backward()

            def closure(m=m, mb=micro[-1]):
                loss = loss_fn(m, mb) / 3
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
                return loss

            with pytest.warns(UserWarning, match="closure") if i else _nothing():
                o.step(closure)
            o.zero_grad()
    _assert_all_same(runs)


def test_create_graph_backward_keeps_its_gradient_in_grad():
    """``create_graph=True``: the gradient carries a graph (a penalty's backward reads
    it), so it is brought back and kept in ``.grad``; step() applies the sum."""
    runs, handle, batch_fn, loss_fn = _three("mlp", "AdamW", dict(lr=0.01), 0.0)
    gen = torch.Generator().manual_seed(10)
    for _ in range(2):
        micro = _micro(batch_fn, gen, 2)
        for i, (m, o) in enumerate(runs):
            with o.no_step() if i else _nothing():
                loss_fn(m, micro[0]).backward()
            loss_fn(m, micro[1]).backward(create_graph=True)
            if i == 2:
                assert all(p.grad is not None for p in m.parameters())
                assert any(p.grad.requires_grad for p in m.parameters())
            o.step()
            o.zero_grad()
    _assert_all_same(runs)


@CAPS
def test_exception_mid_window(cap):
    """A no_step() backward raises half-way: what autograd accumulated before stays held
    (torch keeps it in ``.grad``); the window goes on, as torch's does."""
    runs, handle, batch_fn, _ = _three("mlp", "AdamW", dict(lr=0.01), cap)
    gen = torch.Generator().manual_seed(11)
    (x0, y0), (x1, y1), (x2, y2) = _micro(batch_fn, gen, 3)
    for i, (m, o) in enumerate(runs):
        with o.no_step() if i else _nothing():
            F.mse_loss(m(x0), y0).backward()
        with o.no_step() if i else _nothing():
            h = m.layers[0](x1)
            out = m.head(F.gelu(m.layers[2](F.gelu(m.layers[1](Boom.apply(F.gelu(h)))))))
            with pytest.raises(ValueError, match="boom"):
                F.mse_loss(out, y1).backward()
        F.mse_loss(m(x2), y2).backward()
        o.step()
        o.zero_grad()
    _assert_all_same(runs)


@CAPS
def test_resume_mid_window(cap):
    """``state_dict()`` holds no gradients (torch's neither): loading it into the same
    optimizer mid-window keeps the held sums; a fresh model and optimizer loaded
    mid-window start the window over, exactly as torch's do."""
    runs, handle, batch_fn, loss_fn = _three("gpt", "AdamW", dict(lr=0.01), cap)
    gen = torch.Generator().manual_seed(12)
    _window(runs, handle, _micro(batch_fn, gen, 2), loss_fn)
    micro = _micro(batch_fn, gen, 3)
    saved = []
    for i, (m, o) in enumerate(runs):
        with o.no_step() if i else _nothing():
            (loss_fn(m, micro[0]) / 3).backward()
        sd = copy.deepcopy(o.state_dict())
        assert "grad" not in str(sd.keys())
        saved.append((copy.deepcopy(m.state_dict()), copy.deepcopy(sd)))
        o.load_state_dict(sd)  # the same optimizer: held gradients stay (it keeps sd's tensors)
        for k, mb in enumerate(micro[1:]):
            with o.no_step() if i and k == 0 else _nothing():
                (loss_fn(m, mb) / 3).backward()
        o.step()
        o.zero_grad()
    _assert_all_same(runs)
    # a resumed run: a new model and optimizer from the mid-window checkpoint
    resumed = []
    for i, ((m, o), (msd, osd)) in enumerate(zip(runs, saved)):
        m2 = copy.deepcopy(runs[0][0])  # (never attached: a copy without hooks)
        m2.load_state_dict(msd)
        o2 = type(o)(m2.parameters(), lr=0.01)
        if i:
            layeropt.attach(m2, o2, bucket_cap_mb=cap)
        if i == 2:
            offload_state(o2)
        o2.load_state_dict(osd)
        for k, mb in enumerate(micro[1:]):
            with o2.no_step() if i and k == 0 else _nothing():
                (loss_fn(m2, mb) / 3).backward()
        o2.step()
        o2.zero_grad()
        resumed.append((m2, o2))
    _assert_all_same(resumed)


def test_clipping_held_gradients_in_host_memory_is_refused():
    runs, handle, batch_fn, loss_fn = _three("mlp", "AdamW", dict(lr=0.01), 0.0)
    m, o = runs[2]
    with o.no_step():
        loss_fn(m, batch_fn(torch.Generator().manual_seed(0))).backward()
    with pytest.raises(LayeroptError, match="host memory.*held_grads=False"):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)


@CAPS
def test_held_grads_false_keeps_them_on_the_device(cap):
    runs, handle, batch_fn, loss_fn = _three("gpt", "Adam", dict(lr=0.01), cap,
                                             held_grads=False)
    assert handle.held is None
    gen = torch.Generator().manual_seed(13)
    micro = _micro(batch_fn, gen, 2)
    (ref, ref_opt), *ours = runs
    for mb in micro:
        (loss_fn(ref, mb) / 2).backward()
    ref_opt.step()
    for m, o in ours:
        with o.no_step():
            (loss_fn(m, micro[0]) / 2).backward()
        assert all(p.grad is not None for p in m.parameters())
        (loss_fn(m, micro[1]) / 2).backward()
    _assert_all_same(runs)


@CAPS
@pytest.mark.parametrize("removed", ["offload", "attachment"])
def test_remove_mid_window_brings_them_back_into_grad(removed, cap):
    """``remove()`` in the middle of a window - the offload's, or the attachment's (the
    window then ends in plain backwards, a new attachment and ``step()``): the held sums
    are back in ``.grad``, where later backwards add to them in autograd's order
    (offloadfuzz chaos, seed 270,065: the attachment's left them on the host, and the step
    added them last - off by a rounding)."""
    attachments: list[Any] = []
    runs, handle, batch_fn, loss_fn = _three("gpt", "SGD", dict(lr=0.1, weight_decay=0.01),
                                             cap, attachments=attachments)
    gen = torch.Generator().manual_seed(14)
    micro = _micro(batch_fn, gen, 3)
    (ref, ref_opt), *ours = runs
    for mb in micro:
        (loss_fn(ref, mb) / 3).backward()
    ref_opt.step()
    for i, (m, o) in enumerate(ours):
        with o.no_step():
            (loss_fn(m, micro[0]) / 3).backward()
        if removed == "offload" and i == 1:
            handle.remove()
        if removed == "attachment":
            attachments[i].remove()
        assert all(p.grad is not None for p in m.parameters())
        with o.no_step():
            (loss_fn(m, micro[1]) / 3).backward()
        (loss_fn(m, micro[2]) / 3).backward()  # (attached: it steps)
        if removed == "attachment":
            layeropt.attach(m, o, bucket_cap_mb=cap)
            o.step()
    _assert_all_same(runs)


def test_ddp_no_sync_window_is_exact(process_group):
    """Under DDP the reducer reads ``.grad`` (and its buckets already hold one gradient's
    worth of memory): held gradients stay where DDP keeps them, exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    runs = []
    for kind in ("torch", "layeropt", "offload"):
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        cls = torch.optim.AdamW if kind == "torch" else layeropt.AdamW
        o = cls(ddp.parameters(), lr=0.01)
        if kind != "torch":
            layeropt.attach(ddp, o)
        if kind == "offload":
            offload_state(o)
        runs.append((ddp, o))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        xs = [torch.randn(4, 6, generator=gen) for _ in range(3)]
        for i, (ddp, o) in enumerate(runs):
            for x in xs[:-1]:
                with ddp.no_sync(), o.no_step() if i else _nothing():
                    ddp(x).square().mean().backward()
            ddp(xs[-1]).square().mean().backward()
            o.step()
            o.zero_grad()
    _assert_all_same([(d.module, o) for d, o in runs])


def test_plain_hooks_on_a_ddp_models_submodules_are_refused_not_summed_twice(process_group):
    """A DDP model (one process) whose submodules are attached one by one with plain
    hooks: DDP's reducer writes each gradient back into ``.grad`` at the end of backward,
    after it was moved to host memory, and the step added both (multifuzz's DDP
    ``offload`` mix, seed 260,214: silently different before). DDP's forward refuses such
    a model; attached after that forward, its backward is refused, the copies dropped and
    the sums kept. The DDP model attached as a whole is exact (above)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    handles = [layeropt.attach(model[0], opt), layeropt.attach(model[2], opt)]
    off = offload_state(opt)
    try:
        with opt.no_step(), pytest.raises(AttachError, match="DistributedDataParallel model "
                                          "carries a plain layeropt hook"):
            ddp(torch.randn(4, 6))
        assert not off.held
        for h in handles:
            h.remove()
        loss = ddp(torch.randn(4, 6)).square().mean()
        handles = [layeropt.attach(model[0], opt), layeropt.attach(model[2], opt)]
        with opt.no_step(), pytest.raises(LayeroptError, match="written back into .grad"):
            loss.backward()
        assert all(p.grad is None for p in model.parameters())
        assert len(off.held) == 4  # (every sum kept in host memory)
    finally:
        off.remove()
        for h in handles:
            h.remove()
        opt.zero_grad()


# -- memory, in bytes -------------------------------------------------------------
def _wide(width=384, depth=6):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                     torch.nn.Tanh()) for _ in range(depth)])


class _NumpyHost(HostHeld):
    """Host tensors outside torch's allocator: the profiler counts only the "device"."""

    def _new_host(self, like: torch.Tensor) -> torch.Tensor:
        assert like.dtype == torch.float32
        return torch.from_numpy(np.empty(tuple(like.shape), dtype=np.float32))


def _floor(model, x):
    """Peak of a backward whose every gradient is dropped the moment it lands."""
    floor_model = copy.deepcopy(model)
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
             for p in floor_model.parameters()]
    with PeakMemory() as mem:
        floor_model(x).square().mean().backward()
    for h in hooks:
        h.remove()
    return mem.peak


@pytest.mark.parametrize("held_grads", [True, False], ids=["host", "device"])
def test_device_bytes_of_a_window(held_grads):
    """During a no_step() window the device holds one bucket's held gradient at most
    (plus what backward keeps), not the model's; the stepping micro-batch brings each
    bucket's sum back just before its step (two of its buckets at once at most)."""
    model = _wide()
    opt = layeropt.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle = layeropt.attach(model, opt, bucket_cap_mb=0)
    off = offload_state(opt, held_grads=held_grads)
    if held_grads:
        off.held.__class__ = _NumpyHost
        off.held.pool_factory = None  # (its sums from numpy too, not a torch-made block)
    x = torch.randn(2, 384)
    for _ in range(2):  # state made (and offloaded)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(b.nbytes for b in handle.buckets)
    floor = _floor(model, x)
    with PeakMemory() as window:
        for _ in range(3):
            with opt.no_step():
                model(x).square().mean().backward()
    with PeakMemory() as last:
        model(x).square().mean().backward()
    if held_grads:
        assert window.end == 0 and off.held.host_bytes == 0  # nothing left on the device
        assert window.peak <= floor + largest, (window.peak, floor, largest)
        assert last.peak <= floor + 2 * largest + off.peak_device_bytes, (last.peak, floor)
    else:
        assert window.end == grads  # every held gradient on the device
        assert window.peak >= grads
    opt.step()
    opt.zero_grad()


@CAPS
@pytest.mark.parametrize("who", ["optimizer", "model"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_mid_window_drops_the_held_sums(set_to_none, who, cap):
    """``zero_grad()`` in the middle of a window - the optimizer's, or the model's (which
    kept the host sums before) - discards what it held, as torch's does
    (``set_to_none=False``: zeros kept in ``.grad``, which torch's next ``step()`` uses)."""
    runs, handle, batch_fn, loss_fn = _three("mlp", "AdamW", dict(lr=0.01), cap)
    gen = torch.Generator().manual_seed(15)
    for _ in range(2):
        micro = _micro(batch_fn, gen, 3)
        for i, (m, o) in enumerate(runs):
            with o.no_step() if i else _nothing():
                loss_fn(m, micro[0]).backward()
            (o if who == "optimizer" else m).zero_grad(set_to_none=set_to_none)
            assert len(handle.held) == 0
            with o.no_step() if i else _nothing():
                loss_fn(m, micro[1]).backward()
            loss_fn(m, micro[2]).backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
    _assert_all_same(runs)


@CAPS
@pytest.mark.parametrize("opt_name,kw", [("SGD", dict(lr=0.1)),
                                         ("AdamW", dict(lr=0.01, weight_decay=0.1))])
def test_kept_zero_gradients_and_a_window_ended_by_step(opt_name, kw, cap):
    """A loop zeroing with ``set_to_none=False`` whose whole window is held and ended by
    ``step()``: a held sum is the parameter's gradient, not a kept zero (it was stepped
    twice: on a zero gradient, then on the sum)."""
    runs, handle, batch_fn, loss_fn = _three("mlp", opt_name, kw, cap)
    gen = torch.Generator().manual_seed(17)
    for _ in range(3):
        micro = _micro(batch_fn, gen, 2)
        for i, (m, o) in enumerate(runs):
            for mb in micro:
                with o.no_step() if i else _nothing():
                    loss_fn(m, mb).backward()
            o.step()
            o.zero_grad(set_to_none=False)
    _assert_all_same(runs)


class _Heads(torch.nn.Module):
    """A trunk and two heads, one head per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.t, self.x, self.y = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, inp: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(torch.tanh(self.t(inp)))


@pytest.mark.parametrize("create_graph_at", [0, 1, 2, 3])
@pytest.mark.parametrize("heads", ["xyxyy", "yxyyx", "xxyxy"])
def test_a_budget_freed_mid_window_keeps_autograds_order_of_additions(heads, create_graph_at):
    """With room for one layer's held gradients on the device, a ``create_graph=True``
    micro-batch brings the held sums back mid-window and frees the budget; a head whose
    sum is in host memory already must not then be kept on the device: autograd adds
    ``(g1 + g3) + g4``, not ``g1 + (g3 + g4)`` (a rounding apart, silently, before)."""
    torch.manual_seed(0)
    model = _Heads()
    runs, handle, _, _ = _three("", "SGD", dict(lr=0.1), 0.0, model=model,
                                held_device_bytes=(16 * 16 + 16) * 4)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(k)) for k in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: create_graph's reference cycle)
        for k, (head, x) in enumerate(zip(heads, xs)):
            for i, (m, o) in enumerate(runs):
                hold = o.no_step() if i and k < len(heads) - 1 else _nothing()
                with hold:
                    m(x, head).square().mean().backward(create_graph=k == create_graph_at)
    for m, o in runs:
        o.step()
        o.zero_grad()
    _assert_all_same(runs)


@CAPS
@pytest.mark.parametrize("share", [0.0, 0.3, 0.6, 1.0], ids=["none", "30%", "60%", "all"])
def test_a_device_budget_keeps_the_first_buckets_held_gradients_on_the_device(share, cap):
    """``held_device_bytes``: the held gradients of whole buckets stay in ``.grad`` up to
    the budget - the first to land in a window - and only the rest go to host memory;
    every result stays torch's bit for bit, whichever part moved."""
    model, batch_fn, loss_fn = make_model("gpt")
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(share * grads)
    runs, handle, _, _ = _three("gpt", "AdamW", dict(lr=0.01), cap, model=model,
                                held_device_bytes=budget)
    (ref, ref_opt), (m1, o1), (m2, o2) = runs
    gen = torch.Generator().manual_seed(3)
    for n in (3, 2):
        micro = _micro(batch_fn, gen, n)
        for mb in micro:
            (loss_fn(ref, mb) / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for m, o in ((m1, o1), (m2, o2)):
            for k, mb in enumerate(micro):
                if k < n - 1:
                    with o.no_step():
                        (loss_fn(m, mb) / n).backward()
                    if o is o2:
                        on_device = sum(p.grad.nbytes for p in m.parameters() if p.grad is not None)
                        assert on_device <= budget  # whole buckets, the first that fit
                        assert on_device + handle.held.host_bytes == grads
                        assert (on_device == grads) if share == 1.0 else (
                            (on_device > 0) == (share > 0))
                else:
                    (loss_fn(m, mb) / n).backward()
            o.step()
            o.zero_grad()
        assert len(handle.held) == 0 and not handle.held.kept
    _assert_all_same(runs)
    if share == 1.0:
        assert handle.held.down_bytes == 0  # all of it fit: nothing moved
    if share == 0.0:
        assert handle.held.down_bytes == (2 + 1) * grads


def test_the_device_budget_must_be_bytes():
    opt = layeropt.AdamW(torch.nn.Linear(2, 2).parameters())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="held_device_bytes"):
            offload_state(opt, held_device_bytes=bad)
