"""The recipe "Gradient accumulation with clipping (and GradScaler)" of docs/recipes.md
against the plain torch loop it replaces, bit for bit.

torch: ``n`` backwards of ``loss / n`` (scaled by the ``GradScaler``), then
``scaler.unscale_(opt)``, ``clip_grad_norm_(model.parameters(), max_norm)``,
``scaler.step(opt); scaler.update()`` (or ``opt.step()``), ``opt.zero_grad()``,
``sched.step()``. layeropt: micro-batches ``0..n-2`` inside ``opt.no_step()``, the
last through ``layeropt.backward(..., max_norm=, scaler=)``, then the same calls.
Parameters, optimizer state, scale and the returned total norm are compared
with ``torch.equal``. (docs/recipes.md's block itself runs in tests/test_docs.py.)
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
import torch
from harness import InfGrad, assert_models_equal, assert_same, clone_kwargs, make_pair

import layeropt

# attach's own default (read before conftest's fixture sets the test default, 0)
DEFAULT_CAP = layeropt.attach.__kwdefaults__["bucket_cap_mb"]
CAPS = sorted({0.0, DEFAULT_CAP})
OPTIMIZERS = [("AdamW", dict(lr=0.01)), ("SGD", dict(lr=0.1, momentum=0.9))]
STEPS = 4
CLIP = 0.05  # below the models' gradient norms here: the clipping is active

CASES = [(opt, n, clip, scaler, cap) for opt in OPTIMIZERS for n in (1, 3)
         for clip in (None, CLIP) for scaler in (False, True) for cap in CAPS]


def case_id(case: tuple[Any, ...]) -> str:
    (name, _), n, clip, scaler, cap = case
    return f"{name}-n{n}-clip{clip}-{'scaler' if scaler else 'noscaler'}-cap{cap:g}"


def make_scaler() -> torch.amp.GradScaler:
    # a small scale that grows every 2 steps: the recipe must follow its schedule
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def make_sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=STEPS)


def torch_step(model: Any, opt: Any, sched: Any, scaler: Any, micro: list[Any],
               loss_fn: Any, max_norm: float | None) -> torch.Tensor | None:
    """The plain torch loop the recipe replaces."""
    for batch in micro:
        loss = loss_fn(model, batch) / len(micro)
        (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(opt)
    norm = None
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()
    sched.step()
    return norm


def recipe_step(model: Any, opt: Any, sched: Any, scaler: Any, micro: list[Any],
                loss_fn: Any, max_norm: float | None) -> torch.Tensor | None:
    """docs/recipes.md, "Gradient accumulation with clipping (and GradScaler)"."""
    accum = len(micro)
    for i, batch in enumerate(micro):
        loss = loss_fn(model, batch) / accum
        if i < accum - 1:
            with opt.no_step():
                (scaler.scale(loss) if scaler else loss).backward()
        else:
            norm = layeropt.backward(scaler.scale(loss) if scaler else loss,
                                     max_norm=max_norm, scaler=scaler)
    assert all(p.grad is None for p in model.parameters())  # stepped and freed
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()
    sched.step()
    return norm


def test_default_cap_is_not_the_test_default():
    assert DEFAULT_CAP > 0 and len(CAPS) == 2


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_accumulation_with_clipping_and_scaler_equals_torch(case):
    (name, kw), n, clip, use_scaler, cap = case
    model, ref, opt, ref_opt, batch_fn, loss_fn, handle = make_pair(
        "gpt", name, kw, attach=dict(bucket_cap_mb=cap))
    sched, ref_sched = make_sched(opt), make_sched(ref_opt)
    scaler, ref_scaler = (make_scaler(), make_scaler()) if use_scaler else (None, None)
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(STEPS):
            micro = [batch_fn(gen) for _ in range(n)]
            ref_norm = torch_step(ref, ref_opt, ref_sched, ref_scaler, micro, loss_fn, clip)
            norm = recipe_step(model, opt, sched, scaler, micro, loss_fn, clip)
            if clip is None:
                assert norm is None
            else:
                assert torch.equal(norm, ref_norm) and ref_norm > clip  # clipping is active
            if use_scaler:
                assert scaler.get_scale() == ref_scaler.get_scale()
    finally:
        handle.remove()
    if use_scaler:
        assert scaler.get_scale() > 2.0**10  # grew on schedule: no step was skipped
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())  # state, and the scheduled lr
    assert ref_sched.state_dict() == sched.state_dict()


@pytest.mark.parametrize("where", ["first", "last"])
def test_recipe_skips_a_step_with_an_inf_as_torch(where):
    """An inf/NaN in a held micro-batch (``first``) or in the last one: no parameter and
    no optimizer state changes at that step, and the scale halves, as with torch."""
    model, ref, opt, ref_opt, batch_fn, loss_fn, handle = make_pair(
        "gpt", "AdamW", clone_kwargs(dict(lr=0.01)), attach={})
    sched, ref_sched = make_sched(opt), make_sched(ref_opt)
    scaler, ref_scaler = make_scaler(), make_scaler()
    bad = 0 if where == "first" else 2
    gen = torch.Generator().manual_seed(0)

    def inf_at(step: int) -> Any:
        def fn(m: Any, batch: Any) -> torch.Tensor:
            loss = loss_fn(m, batch)
            return InfGrad.apply(loss) if step == 1 and batch is micro[bad] else loss
        return fn

    try:
        for step in range(3):
            micro = [batch_fn(gen) for _ in range(3)]
            torch_step(ref, ref_opt, ref_sched, ref_scaler, micro, inf_at(step), CLIP)
            before = [p.detach().clone() for p in model.parameters()]
            recipe_step(model, opt, sched, scaler, micro, inf_at(step), CLIP)
            assert scaler.get_scale() == ref_scaler.get_scale()
            if step == 1:
                assert scaler.get_scale() == 2.0**9
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    finally:
        handle.remove()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_the_recipe_in_the_docs_is_the_one_tested_here():
    """docs/recipes.md shows the loop of :func:`recipe_step`, line for line."""
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "recipes.md").read_text()
    section = text.split("## Gradient accumulation with clipping (and GradScaler)", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    squeeze = lambda s: re.sub(r"\s+", " ", s)  # noqa: E731
    for line in ("with opt.no_step():",
                 "(scaler.scale(loss) if scaler else loss).backward()",
                 "layeropt.backward(scaler.scale(loss) if scaler else loss, max_norm=",
                 "scaler=scaler)",
                 "scaler.step(opt)", "scaler.update()", "opt.step()", "opt.zero_grad()",
                 "sched.step()", "/ accum"):
        assert squeeze(line) in squeeze(block), line
