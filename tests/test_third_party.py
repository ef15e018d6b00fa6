"""Third-party optimizers through ``layeropt.in_backward``: equal to themselves, or refused.

Each optimizer is trained twice from the same seed - plainly
(``backward(); step(); zero_grad()``) and attached - and parameters and
optimizer state are compared bit for bit. Optimizers whose update of one layer
depends on the gradients of all (global estimates) must be refused before
anything changes. Needs the ``integrations`` extra; each case skips if its
package is missing.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings
from typing import Any

import pytest
import torch
from harness import assert_same

import layeropt
from layeropt.models import make_model


def _cls(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(pytest.importorskip(module), name)


class Wide(torch.nn.Module):
    """Layers large enough (4096 elements) for torchao / bitsandbytes to quantize
    their state, of two shapes only (torchao compiles its step per shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 64)
        self.body = torch.nn.Linear(64, 64, bias=False)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.body(self.emb(ids)))))


def _wide() -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = Wide()

    def batch(gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, 64, (4, 8), generator=gen)

    def loss(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())

    return model, batch, loss


# (optimizer class path, kwargs, model): trained plainly and attached, bit for bit.
CASES = [
    ("schedulefree.AdamWScheduleFree", dict(lr=1e-2, warmup_steps=2), "gpt"),
    ("schedulefree.SGDScheduleFree", dict(lr=1e-2, warmup_steps=2, weight_decay=0.1), "unet"),
    ("schedulefree.RAdamScheduleFree", dict(lr=1e-2), "gpt"),
    ("bitsandbytes.optim.Adam8bit", dict(lr=1e-2), "wide"),
    ("bitsandbytes.optim.AdamW8bit", dict(lr=1e-2, weight_decay=0.1), "wide"),
    ("bitsandbytes.optim.Lion8bit", dict(lr=1e-3), "wide"),
    ("torchao.optim.AdamW8bit", dict(lr=1e-2), "wide"),
    ("torchao.optim.AdamW4bit", dict(lr=1e-2), "wide"),
    ("torchao.optim.AdamWFp8", dict(lr=1e-2), "wide"),
    ("torch.optim.NAdam", dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1), "gpt"),
    ("torch.optim.RAdam", dict(lr=1e-2), "unet"),
]
REFUSED = [
    ("prodigyopt.Prodigy", dict(lr=1.0)),
    ("dadaptation.DAdaptAdam", dict(lr=1.0)),
    ("dadaptation.DAdaptSGD", dict(lr=1.0)),
]


def _model(name: str) -> tuple[torch.nn.Module, Any, Any]:
    return _wide() if name == "wide" else make_model(name)


def _groups(model: torch.nn.Module, split: bool) -> Any:
    params = list(model.parameters())
    if not split:
        return params
    return [{"params": params[::2]}, {"params": params[1::2], "lr": 5e-3}]


def _train(cls: Any, kw: dict, model_name: str, *, split: bool = False, steps: int = 3,
           cap: float | None = None, before: Any = None) -> tuple[Any, Any, Any, Any]:
    model, batch_fn, loss_fn = _model(model_name)
    ref = copy.deepcopy(model)
    ref_opt = cls(_groups(ref, split), **kw)
    opt = layeropt.in_backward(cls)(_groups(model, split), **kw)
    for o, m in ((ref_opt, ref), (opt, model)):
        if hasattr(o, "train"):
            o.train()  # schedule-free
        if before is not None:
            before(o, m)
    handle = layeropt.attach(model, opt, **({} if cap is None else {"bucket_cap_mb": cap}))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, data).backward()
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    handle.remove()
    return ref, ref_opt, model, opt


def _plain(x: Any) -> Any:
    """Quantized state (tensor subclasses) as the plain tensors they are made of."""
    if isinstance(x, torch.Tensor) and hasattr(x, "__tensor_flatten__"):
        names, _ = x.__tensor_flatten__()
        return {n: getattr(x, n) for n in names}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _same_training(ref: Any, ref_opt: Any, model: Any, opt: Any) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), name)
    assert_same(_plain(ref_opt.state_dict()), _plain(opt.state_dict()))


@pytest.mark.parametrize("cap", [0.0, None], ids=["cap0", "default-cap"])
@pytest.mark.parametrize("path, kw, model_name", CASES, ids=[c[0] for c in CASES])
def test_third_party_optimizer_matches_itself(path, kw, model_name, cap):
    _same_training(*_train(_cls(path), kw, model_name, cap=cap))


@pytest.mark.parametrize("path", ["schedulefree.AdamWScheduleFree", "torchao.optim.AdamW8bit"])
def test_third_party_with_two_param_groups(path):
    kw = dict(lr=1e-2, warmup_steps=2) if "schedulefree" in path else dict(lr=1e-2)
    ref, ref_opt, model, opt = _train(_cls(path), kw, "wide", split=True, cap=0.0)
    _same_training(ref, ref_opt, model, opt)


def test_schedulefree_group_counter_advances_once_per_step():
    """``k`` lives in the param group; one backward with many buckets is one step."""
    cls = _cls("schedulefree.AdamWScheduleFree")
    ref, ref_opt, model, opt = _train(cls, dict(lr=1e-2), "gpt", cap=0.0, steps=4)
    assert [g["k"] for g in opt.param_groups] == [g["k"] for g in ref_opt.param_groups] == [4]
    _same_training(ref, ref_opt, model, opt)


class _Body(torch.nn.Module):
    """Two layers and a third (``extra``) that a loop adds as a param group later."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.extra = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        return self.l2(h) + self.extra(h)


def _run_ops(side: tuple[torch.nn.Module, Any, Any], ops: list[str]) -> None:
    """A loop by name: ``fb`` a backward; ``fbx`` one with ``extra`` frozen; ``none`` one
    that reaches no parameter of the optimizer (all frozen, the loss through a leaf of its
    own); ``apg`` ``extra`` added as a param group; ``rm`` the attachment removed (if
    any); ``step``; ``zg``."""
    model, opt, handle = side
    gen = torch.Generator().manual_seed(4)
    for op in ops:
        x = torch.randn(3, 4, generator=gen)
        if op in ("fb", "fbx", "none"):
            frozen = op == "none"
            for name, p in model.named_parameters():
                p.requires_grad_(not frozen and not (op == "fbx" and name.startswith("extra")))
            leaf = torch.zeros((), requires_grad=frozen)
            (model(x).square().mean() + leaf).backward()
            for p in model.parameters():
                p.requires_grad_(True)
        elif op == "apg":
            opt.add_param_group({"params": list(model.extra.parameters()), "lr": 5e-3})
        elif op == "rm":
            if handle is not None:
                handle.remove()
        else:
            getattr(opt, {"step": "step", "zg": "zero_grad"}[op])()


# (loop, where the cap applies): the steps in which no parameter of the optimizer has a
# gradient still move its group values (schedule-free's k, weight_sum, lr_max) in
# torch's step(); a group added between a backward and step() starts its values there
GROUP_VALUES = {
    "step before any backward": ["step", "fb", "step", "zg", "fb", "step", "zg"],
    "a step after zero_grad, no backward between": ["fb", "step", "zg", "step", "fb", "step",
                                                    "zg"],
    "a backward reaching none of its parameters": ["fb", "step", "zg", "none", "step", "zg",
                                                   "fb", "step", "zg"],
    "a group added between backward and step": ["fb", "step", "zg", "fb", "apg", "step",
                                                "zg", "fb", "step", "zg"],
    "a group added after a backward that did not reach it": ["fb", "step", "zg", "fbx", "apg",
                                                             "step", "zg", "fb", "step", "zg"],
    "remove() between backward and step": ["fb", "step", "zg", "fb", "rm", "step", "zg",
                                           "fb", "step", "zg"],
    "remove() between backward and step, a group added": ["fb", "step", "zg", "fb", "rm",
                                                          "apg", "step", "zg"],
}


@pytest.mark.parametrize("cap", [0.0, None], ids=["cap0", "default-cap"])
@pytest.mark.parametrize("path", ["schedulefree.AdamWScheduleFree",
                                  "schedulefree.SGDScheduleFree"])
@pytest.mark.parametrize("case", list(GROUP_VALUES))
def test_group_values_move_as_in_torchs_steps(case, path, cap):
    cls, ops = _cls(path), GROUP_VALUES[case]
    torch.manual_seed(0)
    model = _Body()
    ref = copy.deepcopy(model)
    body = lambda m: [{"params": m.l1.parameters()}, {"params": m.l2.parameters()}]  # noqa: E731
    ref_opt = cls(body(ref), lr=1e-2, warmup_steps=2)
    opt = layeropt.in_backward(cls)(body(model), lr=1e-2, warmup_steps=2)
    ref_opt.train()
    opt.train()
    handle = layeropt.attach(model, opt, **({} if cap is None else {"bucket_cap_mb": cap}))
    _run_ops((ref, ref_opt, None), ops)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "remove\\(\\) inside a training step")
        _run_ops((model, opt, handle), ops)
    handle.remove()
    assert [g["k"] for g in opt.param_groups] == [g["k"] for g in ref_opt.param_groups]
    _same_training(ref, ref_opt, model, opt)


def test_bitsandbytes_module_override_lands_on_its_parameter():
    """``register_module_override`` keys its config by (group, param) index: kept whole."""
    bnb = pytest.importorskip("bitsandbytes")
    manager = bnb.optim.GlobalOptimManager.get_instance()

    def override(opt: Any, model: Any) -> None:
        manager.register_module_override(model.emb, "weight", {"optim_bits": 32})

    try:
        ref, ref_opt, model, opt = _train(
            bnb.optim.Adam8bit, dict(lr=1e-2), "wide", cap=0.0, before=override
        )
    finally:
        manager.module_weight_config_triple.clear()
        manager.index2config.clear()
        manager.pid2config.clear()
    _same_training(ref, ref_opt, model, opt)
    # the 32-bit override reached the embedding (32-bit state) and nothing else
    assert opt.state[model.emb.weight]["state1"].dtype == torch.float32
    assert opt.state[model.body.weight]["state1"].dtype == torch.uint8
    assert ref_opt.state[ref.body.weight]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("path, kw", REFUSED, ids=[r[0] for r in REFUSED])
def test_global_estimate_optimizers_are_refused_before_any_update(path, kw):
    """Refused at the first step whose layers would see different estimates, with
    nothing of that step applied: the model is the plain optimizer's before it."""
    cls = _cls(path)
    model, batch_fn, loss_fn = make_model("gpt")
    ref = copy.deepcopy(model)
    ref_opt = cls(ref.parameters(), **kw)
    opt = layeropt.in_backward(cls)(model.parameters(), **kw)
    handle = layeropt.attach(model, opt, bucket_cap_mb=0)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        data = batch_fn(gen)
        try:
            loss_fn(model, data).backward()
        except layeropt.BackwardStateError as e:
            assert "global estimate" in str(e) and "Nothing was updated" in str(e)
            break
        opt.step()
        opt.zero_grad()
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    else:
        pytest.fail(f"{path} was not refused")
    _same_training(ref, ref_opt, model, opt)
    assert all(p.grad is None for p in model.parameters())
    handle.remove()


def test_optimizer_wrappers_are_refused_or_unwrapped():
    torchao_optim = pytest.importorskip("torchao.optim")
    with pytest.raises(TypeError, match="wraps other optimizers"):
        layeropt.in_backward(torchao_optim.CPUOffloadOptimizer)


def test_accelerate_prepared_optimizer_is_unwrapped():
    accelerate = pytest.importorskip("accelerate")
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    accelerator = accelerate.Accelerator(cpu=True)
    opt = layeropt.Adam(model.parameters(), lr=1e-2)
    model, prepared = accelerator.prepare(model, opt)
    handle = layeropt.attach(model, prepared)  # the wrapper: its layeropt optimizer is attached
    assert opt.attached
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        accelerator.backward(loss_fn(model, data))
        prepared.step()
        prepared.zero_grad()
    handle.remove()
    _same_training(ref, ref_opt, model, opt)


def test_refusals_name_the_fix():
    model = torch.nn.Linear(2, 2)
    plain = torch.optim.NAdam(model.parameters())
    with pytest.raises(layeropt.AttachError, match=r"layeropt.in_backward\(torch.optim.nadam.NAdam\)"):
        layeropt.attach(model, plain)
    with pytest.raises(layeropt.AttachError, match=r"layeropt.AdamW\(\.\.\.\)"):
        layeropt.attach(model, torch.optim.AdamW(model.parameters()))
    assert importlib.import_module("layeropt").in_backward(torch.optim.NAdam).__name__ == "NAdam"


class TwoStepSAM(torch.optim.Optimizer):
    """Sharpness-aware minimization (Foret et al., 2021, Algorithm 1) written as the
    common implementations are (davda54's ``sam.py``): ``first_step`` climbs to
    ``w + rho * g / |g|``, ``second_step`` climbs back and steps the base optimizer with
    the gradient taken there; both skip a parameter whose ``.grad`` is ``None``."""

    def __init__(self, params: Any, base: type, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["e_w"] = e_w = p.grad * (group["rho"] / (norm + 1e-12))
                p.add_(e_w)
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()
        self.zero_grad()


def _sam_training(layer: bool, held: bool, verify: int | None = None) -> torch.nn.Module:
    """Three SAM steps of an MLP over SGD with momentum: torch's, or layeropt's attached
    with both backwards inside the base optimizer's ``no_step()`` (``held``, the recipe
    of docs/recipes.md) or only the first (the second then steps in backward)."""
    model, batch_fn, loss_fn = make_model("mlp")
    opt = TwoStepSAM(model.parameters(), layeropt.SGD if layer else torch.optim.SGD,
                     rho=0.5, lr=0.1, momentum=0.9)
    handle = layeropt.attach(model, opt.base_optimizer, verify=verify) if layer else None
    hold = opt.base_optimizer.no_step if layer else contextlib.nullcontext
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        data = batch_fn(gen)
        with hold():
            loss_fn(model, data).backward()
        opt.first_step()
        with hold() if held else contextlib.nullcontext():
            loss_fn(model, data).backward()
        opt.second_step()
    handle and handle.remove()
    return model


def test_sam_with_both_backwards_held_equals_torch_and_verify_finds_the_other_loop():
    """SAM reads every gradient between its two backwards and skips a parameter whose
    ``.grad`` is ``None`` (docs/rules.md, "What cannot be detected"): with the second
    backward updating in backward it climbs back from nothing and the update is taken
    at the perturbed weights - silently. Verified, the gradients stay in ``.grad``, so it
    climbs back after the update: refused at ``step()``, naming the recipe. Both
    backwards held: exact."""
    ref = _sam_training(False, held=True)
    assert_same(list(ref.parameters()), list(_sam_training(True, held=True).parameters()))
    silent = _sam_training(True, held=False)
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), silent.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(layeropt.BackwardStateError, match="both backwards inside"):
            _sam_training(True, held=False, verify=3)
    sam = TwoStepSAM(ref.parameters(), layeropt.SGD, lr=0.1)  # attached itself: the recipe
    with pytest.raises(layeropt.AttachError, match=r"opt.base_optimizer.no_step\(\)"):
        layeropt.attach(ref, sam)
