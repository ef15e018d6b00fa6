"""LAYEROPT_VERIFY: the first training steps run both ways, the first difference named.

* Every exact loop of the rules table (tests/test_rules.py) passes verification on a
  plain model, DDP and FSDP2 and stays bit-identical to torch.optim, through the
  verified steps and the in-backward steps after them.
* Each loop that differs from torch where layeropt cannot see it (docs/rules.md, "what
  cannot be detected") raises VerifyError naming its cause, on every kind; so does a
  deliberately wrong in-backward update (the comparison itself works).
* Each loop layeropt refuses (the rules table's loud rows) raises under verification
  too, no later than without it: verification never passes it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from layeropt.engine.stepper import PLAIN
import layeropt
import test_rules
from harness import scaled_step

# Not in the per-step table: loops that never call step(). Under LAYEROPT_VERIFY a
# backward's update is applied at the loop's next forward or zero_grad()
# (Verifier.settle), so the parameters after a step's last line lag one step; tested at
# the end of a run below instead.
NOT_VERIFIED_PER_STEP = {
    "no step(): layeropt.backward(max_norm) is the step",
    "no step(), no zero_grad(): each backward is the step",
}
EXACT_RULES = [r for r, (_, expected, _, _) in test_rules.RULES.items()
               if expected == test_rules.EXACT and r not in NOT_VERIFIED_PER_STEP]


@pytest.mark.parametrize("kind", test_rules.KINDS)
@pytest.mark.parametrize("rule", EXACT_RULES)
def test_exact_loops_pass_verification_and_stay_exact(process_group, monkeypatch, kind, rule):
    """Two verified steps (torch's semantics for real), then one in backward: bit for bit
    torch.optim's after each, no VerifyError."""
    if kind in test_rules.NOT_ON.get(rule, ()):
        pytest.skip(test_rules.NOT_ON_WHY)
    monkeypatch.setenv("LAYEROPT_VERIFY", "2")
    out = test_rules.run_rule(kind, rule)
    assert out["error"] is None, out["error"]
    assert len(out["steps"]) == test_rules.STEPS
    for step, s in enumerate(out["steps"]):  # (verified steps keep .grad until zero_grad)
        for what in ("params", "state", "norms"):
            test_rules.assert_same(*s[what], f"{what} after step {step}")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def _cancel_last_layer(m, opt, x):
    """DINO's cancel_gradients_last_layer: edits .grad after backward, skipping None."""
    m(x).pow(2).mean().backward()
    inner = m.module if hasattr(m, "module") else m
    for p in inner[2].parameters():
        if p.grad is not None:
            p.grad.zero_()
    opt.step()
    opt.zero_grad()


def _hand_scaling(m, opt, x):
    """Loss scaling by hand: the gradients divided after backward."""
    (m(x).pow(2).mean() * 64).backward()
    for p in m.parameters():
        if p.grad is not None:
            p.grad /= 64
    opt.step()
    opt.zero_grad()


def _never_zeroed(m, opt, x):
    """A loop that never zeroes: torch adds each step's gradient to the next."""
    m(x).pow(2).mean().backward()
    opt.step()


def _discarded(m, opt, x):
    """Gradients dropped by hand before step() (a skipped update, as on a NaN loss)."""
    m(x).pow(2).mean().backward()
    for p in m.parameters():
        p.grad = None
    opt.step()
    opt.zero_grad()


class GlobalNormAdam(torch.optim.Adam):
    """An optimizer whose step() reads every parameter's gradient (LAMB-like global norm)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.stack([g.norm() for g in grads]).norm() if grads else None
        for g in grads:  # (normalised by the norm of every gradient it was given)
            g.div_(total)
        return super().step(closure)


def _plain(m, opt, x):
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _first_batch_skipped(by_module: bool) -> Callable[..., None]:
    """A bad first batch skipped with zero_grad() and no step(): torch drops its gradients;
    layeropt, before a loop's first step(), took that backward for a step and applied it."""
    def loop(m, opt, x):
        m(x).pow(2).mean().backward()
        if not opt.state:  # (no step() yet: the first batch)
            m.zero_grad() if by_module else opt.zero_grad()
            return
        opt.step()
        opt.zero_grad()
    return loop


def _state_reset(m, opt, x):
    """The optimizer's moments reset between backward and step() (from the second step)."""
    m(x).pow(2).mean().backward()
    for state in opt.state.values():
        state["exp_avg"].zero_()
    opt.step()
    opt.zero_grad()


def _stepped_twice(m, opt, x):
    """step() twice on one backward's gradients: torch applies them twice."""
    m(x).pow(2).mean().backward()
    opt.step()
    opt.step()
    opt.zero_grad()


# case -> (loop, optimizer class name or class, wrong update injected, words of the cause)
CASES: dict[str, tuple[Any, Any, bool, str]] = {
    "gradient edited after backward (DINO)": (_cancel_last_layer, "AdamW", False,
                                              "changed between backward and step()"),
    "hand loss scaling": (_hand_scaling, "AdamW", False, "changed between backward and step()"),
    "never zeroed": (_never_zeroed, "AdamW", False, "not zeroed"),
    "gradients discarded before step()": (_discarded, "AdamW", False, "discarded"),
    "step() reads other parameters' gradients": (_plain, GlobalNormAdam, False,
                                                 "reads other parameters' gradients"),
    "a wrong in-backward update (injected)": (_plain, "AdamW", True, "the update differs"),
    "first batch skipped with opt.zero_grad()": (
        _first_batch_skipped(False), "AdamW", False,
        "a backward's gradients discarded by zero_grad() before the first step(): layeropt "
        "had already applied them"),
    "first batch skipped with model.zero_grad()": (
        _first_batch_skipped(True), "AdamW", False,
        "a backward's gradients discarded by zero_grad() before the first step()"),
    "optimizer state reset between backward and step()": (
        _state_reset, "AdamW", False, "optimizer state changed between backward and step()"),
    "step() twice per backward": (_stepped_twice, "AdamW", False,
                                  "step() was called again on a gradient already applied"),
}


@pytest.mark.parametrize("kind", test_rules.KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_what_cannot_be_detected_is_found_by_verification(process_group, kind, case):
    loop, opt_name, inject, words = CASES[case]
    model = test_rules._wrap(kind, _model())
    cls = layeropt.in_backward(opt_name) if isinstance(opt_name, type) else getattr(
        layeropt, opt_name)
    opt = cls(model.parameters(), lr=0.01)
    handle = layeropt.attach(model, opt, verify=3)
    if inject:
        original = opt._lo_stepper  # every update's call of torch's step (engine/subset.py)

        def wrong(optimizer: Any, params: list[torch.Tensor], key: object) -> None:
            original(optimizer, params, key)
            with torch.no_grad():
                params[0].mul_(1.0 + 2.0**-10)

        opt._lo_stepper = wrong
    try:
        with pytest.raises(layeropt.VerifyError, match="LAYEROPT_VERIFY") as info:
            for step in range(3):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
                loop(model, opt, x)
        assert words in str(info.value).replace("\n", " "), str(info.value)
    finally:
        handle.remove()


def test_verification_ends_with_a_warning_and_training_goes_on_in_backward():
    model = _model()
    opt = layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    layeropt.attach(model, opt, verify=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            kept = [p.grad is not None for p in model.parameters()]
            assert all(kept) == (step < 2)  # verified: torch's semantics; then in backward
            opt.step()
            opt.zero_grad()
    passed = [w for w in caught if "LAYEROPT_VERIFY: 2 training step(s)" in str(w.message)]
    assert len(passed) == 1
    assert opt._lo_engine.stepper is PLAIN  # the verifier unwrapped itself


@pytest.mark.parametrize("order", ["offload-then-verify", "verify-then-offload"])
def test_verifying_with_the_state_offloaded_is_refused_at_once(order):
    """Either order is refused when the second call is made, naming the fix, and leaves
    the optimizer as it was: no hooks from the refused attach, no state moved."""
    from layeropt.offload import offload_state

    model = _model()
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    if order == "offload-then-verify":
        offload_state(opt)
        with pytest.raises(layeropt.LayeroptError, match="verify the same loop without"):
            layeropt.attach(model, opt, verify=2)
        assert not opt.attached
    else:
        layeropt.attach(model, opt, verify=2)
        with pytest.raises(layeropt.LayeroptError, match="verify the same loop without"):
            offload_state(opt)
        assert opt._lo_engine.stepper.inner is PLAIN  # the verifier alone: no offload


def test_layeropt_verify_must_be_a_count(monkeypatch):
    monkeypatch.setenv("LAYEROPT_VERIFY", "yes")
    model = _model()
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="LAYEROPT_VERIFY='yes'"):
        layeropt.attach(model, opt)


# How a trainer integration is told to verify: the environment variable (read by
# layeropt.attach), or the integration's own verify= argument.
HOW = pytest.mark.parametrize("how", ["env", "argument"])


def _verify_setting(how: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    if how == "env":
        monkeypatch.setenv("LAYEROPT_VERIFY", "2")
        return {}
    monkeypatch.delenv("LAYEROPT_VERIFY", raising=False)
    return {"verify": 2}


@HOW
@pytest.mark.parametrize("kind, opts", [("layeropt", dict(ga=2, max_grad_norm=0.5)),
                                        ("layeropt", dict(ga=1)), ("callback", dict(ga=2))],
                         ids=["trainer-accumulate-clip", "trainer-plain", "callback-accumulate"])
def test_hugging_face_trainer_under_layeropt_verify(tmp_path, monkeypatch, kind, opts, how):
    """The Trainer's layeropt integrations verify when told (LAYEROPT_VERIFY, or their
    verify= argument): the verified steps pass, and the run equals the Trainer with
    torch.optim bit for bit."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import test_hf

    ref_trainer, ref, _ = test_hf._trainer(tmp_path, "torch", **opts)
    ref_trainer.train()
    trainer, model, _ = test_hf._trainer(tmp_path, kind, **opts,
                                         **_verify_setting(how, monkeypatch))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert any("LAYEROPT_VERIFY: 2 training step(s)" in str(w.message) for w in caught)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        test_rules.assert_same(p.detach(), q.detach(), name)


@HOW
def test_lightning_under_layeropt_verify(monkeypatch, how):
    """Lightning's callback verifies when told (LAYEROPT_VERIFY, or verify=)."""
    pytest.importorskip("lightning.pytorch")
    import test_lightning

    setup = test_lightning._kw(test_lightning.SETUPS["accumulate-3-clip"])
    ref = test_lightning.Net(torch.optim.AdamW, weight_decay=0.1)
    test_lightning._fit(ref, steps=4, **setup)
    module = test_lightning.Net(layeropt.AdamW, weight_decay=0.1)
    callback = test_lightning.LayeroptCallback(bucket_cap_mb=0,
                                               **_verify_setting(how, monkeypatch))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        test_lightning._fit(module, [callback], steps=4, **setup)
    assert any("LAYEROPT_VERIFY: 2 training step(s)" in str(w.message) for w in caught)
    for p, q in zip(module.parameters(), ref.parameters()):
        test_rules.assert_same(p.detach(), q.detach())


@HOW
@pytest.mark.parametrize("case", ["ga2-clip-norm", "ga3-scaler-clip", "clip-value"])
def test_accelerate_under_layeropt_verify(monkeypatch, case, how):
    """LayeroptAccelerator verifies when told (LAYEROPT_VERIFY, or verify=), through its
    clipping - learned on the first step - and a GradScaler: equal to accelerate with
    torch.optim bit for bit, norms included."""
    pytest.importorskip("accelerate")
    import test_accelerate
    from accelerate.state import AcceleratorState, GradientState

    def fresh() -> None:  # (accelerate's global state, as a Trainer earlier may leave it)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    fresh()
    ref = test_accelerate._loop("torch", **test_accelerate.CASES[case])
    fresh()
    setting = _verify_setting(how, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = test_accelerate._loop("layeropt", **test_accelerate.CASES[case], accel_kw=setting)
    fresh()
    assert any("LAYEROPT_VERIFY: 2 training step(s)" in str(w.message) for w in caught)
    test_accelerate._compare(ref, got)


def test_an_example_under_layeropt_verify_prints_the_same_numbers(tmp_path):
    """examples/custom_loss_amp.py (custom loss, AMP, three runs compared bit for bit)
    with LAYEROPT_VERIFY=2: both its steps verified, its comparison still bit for bit."""
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parent.parent / "examples" / "custom_loss_amp.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LAYEROPT_VERIFY": "2"}
    proc = subprocess.run([sys.executable, str(script), "--tiny"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max |difference| = 0.0e+00 (bit for bit)" in proc.stdout, proc.stdout
    assert "LAYEROPT_VERIFY: 2 training step(s)" in proc.stderr, proc.stderr[-2000:]


def _stepless(verify: int, clip: bool, zero: str | None, steps: int = 5) -> Any:
    """A loop that never calls step(): each backward (layeropt.backward) is the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    handle = layeropt.attach(model, opt, verify=verify)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            if zero == "module":
                model.zero_grad()
            elif zero == "optimizer":
                opt.zero_grad()
            loss = model(torch.randn(5, 4, generator=gen)).square().sum()
            layeropt.backward(loss, max_norm=0.05) if clip else loss.backward()
    handle.remove()
    return model, opt, [str(w.message) for w in caught if "LAYEROPT_VERIFY" in str(w.message)]


@pytest.mark.parametrize("zero", ["module", "optimizer", None])
@pytest.mark.parametrize("clip", [True, False], ids=["layeropt.backward(max_norm)", "backward"])
def test_a_loop_without_step_trains_the_same_under_layeropt_verify(clip, zero):
    """word_language_model's loop (each layeropt.backward a step, never opt.step()) under
    LAYEROPT_VERIFY: its first step is applied at the next zero_grad() or forward, compared,
    and said; the run ends with torch.optim's parameters and state, as without verify."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):  # the same loop with torch.optim: backward, clip, step
        ref(torch.randn(5, 4, generator=gen)).square().sum().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    for verify in (0, 3):
        model, opt, said = _stepless(verify, clip, zero)
        for p, q in zip(model.parameters(), ref.parameters()):
            test_rules.assert_same(p.detach(), q.detach(), f"verify={verify}")
        test_rules.assert_same(opt.state_dict()["state"], ref_opt.state_dict()["state"])
        assert len(said) == (1 if verify else 0) and (not said or "without calling step()" in said[0])


def test_a_program_that_ends_before_its_verified_steps_says_so():
    """A loop shorter than LAYEROPT_VERIFY's N says, when the program exits, how many
    steps were verified (and that the last update waits for a step() that never came)."""
    import subprocess
    import sys

    code = (
        "import torch, layeropt\n"
        "m = torch.nn.Linear(3, 2); opt = layeropt.SGD(m.parameters(), lr=0.1)\n"
        "layeropt.attach(m, opt, verify=5)\n"
        "for _ in range(2):\n"
        "    m(torch.randn(4, 3)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "m(torch.randn(4, 3)).sum().backward()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ended after 2 of 5 training step(s) were verified" in proc.stderr, proc.stderr
    assert "no step() followed it" in proc.stderr


def test_a_detached_verifier_no_longer_acts():
    """A pending verified update of a model whose attachment was removed is not applied at
    its next forward: what the loop abandoned stops acting (and its forward hook goes)."""
    model = torch.nn.Linear(3, 2)
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    handle = layeropt.attach(model, opt, verify=3)
    model(torch.randn(4, 3)).sum().backward()  # verified: the update waits for step()
    handle.remove()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no LAYEROPT_VERIFY warning either
        model(torch.randn(4, 3))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not model._forward_pre_hooks


def _train(model: torch.nn.Module, opt: Any, step: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _torch_saved(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _copied_then_verified(make_copy: Callable[[Any], Any]) -> Callable[..., Any]:
    def case(model: torch.nn.Module, held: dict[str, Any]) -> torch.nn.Module:
        twin = make_copy(model)  # (an EMA, a saved model) with the verifier's forward hook
        for step in (1, 2):  # verification ends: the verifier goes
            _train(model, held["opt"], step)
        return twin
    return case


def _optimizer_deleted(detach: bool) -> Callable[..., Any]:
    def case(model: torch.nn.Module, held: dict[str, Any]) -> torch.nn.Module:
        if detach:
            held["handle"].remove()
        held.clear()  # the optimizer (its verifier) deleted while verifying
        return model
    return case


# how a verifier is abandoned -> the model its forward hook was left on, to train on
ABANDONED = {
    "deepcopy made while verifying": _copied_then_verified(copy.deepcopy),
    "torch.save made while verifying": _copied_then_verified(_torch_saved),
    "detached, then its optimizer deleted": _optimizer_deleted(detach=True),
    "its optimizer deleted while attached": _optimizer_deleted(detach=False),
}


@pytest.mark.filterwarnings("ignore:the layeropt optimizer attached to these parameters was")
@pytest.mark.parametrize("case", list(ABANDONED))
def test_a_forward_hook_of_an_abandoned_verifier_does_nothing(case):
    """After one verified step, the verifier is abandoned (table); the model its forward
    pre-hook was left on then trains with torch.optim exactly as the same model trained
    by torch alone. The hook returned ``False`` once its verifier was gone, which torch
    passed to forward as its arguments: ``linear(): argument 'input' must be Tensor``
    (and a lambda could not be pickled by ``torch.save``)."""
    model = _model()
    ref = copy.deepcopy(model)
    held: dict[str, Any] = {"opt": layeropt.AdamW(model.parameters(), lr=1e-3)}
    held["handle"] = layeropt.attach(model, held["opt"], verify=2)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (LAYEROPT_VERIFY: 2 training steps ... equal)
        _train(model, held["opt"], 0)
        twin = ABANDONED[case](model, held)
    gc.collect()
    ref_opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, twin))
    for step in (3, 4):
        _train(ref, ref_opt, step)
        _train(twin, twin_opt, step)
    for p, q in zip(twin.parameters(), ref.parameters()):
        test_rules.assert_same(p.detach(), q.detach(), case)
    test_rules.assert_same(twin_opt.state_dict(), ref_opt.state_dict())
    assert twin is not model or not model._forward_pre_hooks  # gone with the verifier


def test_gradients_zeroed_in_place_by_hand_verify_clean():
    """A loop that zeroes with ``p.grad.zero_()`` keeps the same tensors: exact, and verify
    no longer calls it "not zeroed" (it did: identity alone)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    layeropt.attach(model, opt, verify=3)
    for step in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).sum().backward()
            o.step()
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.zero_()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def _zero_by_hand(m: torch.nn.Module) -> None:
    for p in m.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _zeroed_after_forward(m, opt, x, step, lo):
    """Gradients zeroed in place between forward and backward."""
    loss = m(x).pow(2).mean()
    _zero_by_hand(m)
    loss.backward()
    opt.step()


def _zeroed_submodules_called(m, opt, x, step, lo):
    """Gradients zeroed in place; the layers called one by one, not the attached model."""
    _zero_by_hand(m)
    for layer in m:
        x = layer(x)
    x.pow(2).mean().backward()
    opt.step()


def _zeroed_compiled(m, opt, x, step, lo):
    """Gradients zeroed in place; the forward of a torch.compile'd model."""
    _zero_by_hand(m)
    torch.compile(m, backend="aot_eager")(x).pow(2).mean().backward()
    opt.step()


def _reattached(verify: int) -> Callable[..., None]:
    """attach(model, opt, verify=...) again between the second backward and step()."""
    def loop(m, opt, x, step, lo):
        m(x).pow(2).mean().backward()
        if lo and step == 1:
            layeropt.attach(m, opt, verify=verify)  # (the same handle, its settings anew)
        opt.step()
        opt.zero_grad()
    return loop


def _kept_zeros_then_reattached(m, opt, x, step, lo):
    """``zero_grad(set_to_none=False)``, ``remove()``, the model's ``zero_grad()`` (to
    None, unwatched: detached), attached again: the next ``step()`` finds no gradient
    (verify had left torch's zeros in ``.grad`` and kept counting them as zeros)."""
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    if lo:
        layeropt.attach(m, opt, verify=3).remove()
    m.zero_grad()
    if lo:
        layeropt.attach(m, opt, verify=3)
    opt.step()


def _removed_before_step(m, opt, x, step, lo):
    """``remove()`` between a verified backward and its ``step()``: that step() verifies
    it and steps torch's gradients (it was refused as a second update)."""
    m(x).pow(2).mean().backward()
    if lo and step == 1:
        layeropt.attach(m, opt).remove()  # (the handle attach() gave; detached from here)
    opt.step()
    opt.zero_grad()


# loop -> the kinds it runs on (DDP: not the layers one by one, which bypass DDP's
# forward, nor a second attach, which a DDP model refuses; FSDP2: its sharded gradients
# are written by FSDP, where no tensor hook sees a zeroing in place - docs/rules.md,
# "How to check your loop")
EXACT_BY_HAND: dict[str, tuple[Callable[..., None], tuple[str, ...]]] = {
    "gradients zeroed in place after the forward": (_zeroed_after_forward, ("plain", "ddp")),
    "gradients zeroed in place, layers called one by one": (_zeroed_submodules_called,
                                                            ("plain",)),
    "gradients zeroed in place, torch.compile'd model": (_zeroed_compiled, ("plain",)),
    "re-attached with verify=0 between backward and step()": (_reattached(0), ("plain",)),
    "re-attached with verify=2 between backward and step()": (_reattached(2), ("plain",)),
    "kept zeros, removed, the model's zero_grad(), attached again": (
        _kept_zeros_then_reattached, ("plain",)),
    "removed between a verified backward and its step()": (_removed_before_step, ("plain",)),
}


@pytest.mark.parametrize("kind", test_rules.KINDS)
@pytest.mark.parametrize("case", list(EXACT_BY_HAND))
def test_more_exact_loops_pass_verification_and_stay_exact(process_group, kind, case):
    """Exact loops verify still called wrong: gradients zeroed in place where no
    zero_grad() or forward of the attached model shows it ("not zeroed"), and a
    re-attach while a backward waited for step() (a "gradient set after backward")."""
    loop, kinds = EXACT_BY_HAND[case]
    if kind not in kinds:
        pytest.skip("not on this kind (EXACT_BY_HAND says why)")
    gc.collect()  # (earlier tests' attachments gone: once detached, no watcher is left)
    ref, model = (test_rules._wrap(kind, _model()) for _ in range(2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    handle = layeropt.attach(model, opt, verify=3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (LAYEROPT_VERIFY: ... equal)
            for step in range(5):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
                loop(ref, ref_opt, x, step, False)
                loop(model, opt, x, step, True)
                for p, q in zip(model.parameters(), ref.parameters()):
                    test_rules.assert_same(p.detach(), q.detach(), f"{case}, step {step}")
        test_rules.assert_same(opt.state_dict()["state"], ref_opt.state_dict()["state"])
    finally:
        handle.remove()


def _plain_step_order(layeropt_first: bool) -> Callable[..., None]:
    """A plain torch.optim optimizer owning the attached model's first layer too."""
    def loop(m, opt, extra, x):
        m(x).pow(2).mean().backward()
        for o in (opt, extra) if layeropt_first else (extra, opt):
            o.step()
        opt.zero_grad()
        extra.zero_grad()
    return loop


@pytest.mark.parametrize("layeropt_first", [True, False], ids=["opt.step() first",
                                                                "plain step() first"])
def test_a_plain_optimizer_sharing_a_parameter_is_refused_as_without_verify(layeropt_first):
    """Verifying, the plain optimizer's step() is refused where the attached loop's is - in
    the first step, with the same message - though torch's gradients are still in .grad
    (it passed verification, and was refused once the optimizer updated in backward)."""
    loop = _plain_step_order(layeropt_first)
    raised = {}
    for verify in (0, 3):
        model = _model()
        opt = layeropt.AdamW(model.parameters(), lr=0.01)
        extra = torch.optim.SGD(model[0].parameters(), lr=0.1)
        handle = layeropt.attach(model, opt, verify=verify)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                for step in range(4):
                    loop(model, opt, extra, torch.randn(4, 6))
            except layeropt.BackwardStateError as e:
                raised[verify] = (step, str(e))
            finally:
                handle.remove()
    assert raised.get(0) == raised.get(3) and raised[0][0] == 0, raised
    assert "is about to skip parameter '0.weight'" in raised[0][1]


LOUD_RULES = [r for r, (_, expected, _, _) in test_rules.RULES.items()
              if expected != test_rules.EXACT]


@pytest.mark.parametrize("kind", test_rules.KINDS)
@pytest.mark.parametrize("rule", LOUD_RULES)
def test_loops_layeropt_refuses_do_not_pass_verification(process_group, monkeypatch, kind,
                                                          rule):
    """Each loop of the rules table that layeropt refuses raises under LAYEROPT_VERIFY as
    well, no later than without it: its refusal, or a VerifyError naming the difference
    (a plain step() after layeropt's, over held gradients, passed)."""
    if kind in test_rules.NOT_ON.get(rule, ()):
        pytest.skip(test_rules.NOT_ON_WHY)
    monkeypatch.setenv("LAYEROPT_VERIFY", "3")
    out = test_rules.run_rule(kind, rule)
    assert out["error"] is not None, "passed verification"
    name, message, step = out["error"]
    assert name in ("VerifyError", test_rules.RULES[rule][2].__name__), out["error"]
    assert step <= test_rules.LATE.get(rule, 0), out["error"]


# -- found by tests/verifyfuzz.py: a loop and whether verify must raise -------------------
def _fb(m, o, x, held=False, retain=False):
    with o.no_step() if held and hasattr(o, "no_step") else _nothing():
        m(x).pow(2).mean().backward(retain_graph=retain)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


VERIFY_FOUND = {
    # step() twice on one backward's gradients, the model attached again between: the
    # verifier keeps what it saw (it was replaced, and forgot the gradient step() applied)
    "attach again between two step()s": (
        lambda m, o, xs, again: (_fb(m, o, xs[0]), o.step(), again(), o.step()), "again"),
    # zeros zero_grad(set_to_none=False) keeps, stepped twice: torch updates on them at
    # each step(), and so does in-backward updating (it was called a gradient applied twice)
    "kept zeros stepped twice": (
        lambda m, o, xs, again: (_fb(m, o, xs[0]), o.step(), o.zero_grad(set_to_none=False),
                                 o.step(), o.step()), None),
    "kept zeros stepped twice after a held backward": (
        lambda m, o, xs, again: (_fb(m, o, xs[0], retain=True),
                                 o.zero_grad(set_to_none=False), o.step(), o.step()), None),
    # a backward held onto the kept zeros, then one more onto its gradient, not zeroed
    "a gradient held onto kept zeros, not zeroed after its step()": (
        lambda m, o, xs, again: (_fb(m, o, xs[0]), o.step(), o.zero_grad(set_to_none=False),
                                 _fb(m, o, xs[1], retain=True), o.step(),
                                 _fb(m, o, xs[2], held=True), o.step()), "not zeroed"),
}


def _pair(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two copies of ``_model()``, wrapped for ``kind`` (test_rules.KINDS): torch's, ours."""
    return test_rules._wrap(kind, _model()), test_rules._wrap(kind, _model())


def _assert_torchs(model, lo, ref, ro) -> None:
    """Parameters and optimizer state bit for bit (FSDP2's DTensors as full tensors)."""
    for p, q in zip(model.parameters(), ref.parameters()):
        test_rules.assert_same(*test_rules._local([p, q]))
    test_rules.assert_same(*test_rules._local([lo.state_dict(), ro.state_dict()]))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", test_rules.KINDS)
@pytest.mark.parametrize("case", list(VERIFY_FOUND))
def test_verify_finds_these_and_only_these(process_group, kind, case):
    """Each loop with verify on every step: ``VerifyError`` naming the cause where the
    loop differs from torch's, otherwise torch's parameters and state bit for bit."""
    loop, cause = VERIFY_FOUND[case]
    ref, model = _pair(kind)
    ro = torch.optim.NAdam(ref.parameters(), lr=0.05)
    lo = layeropt.in_backward(torch.optim.NAdam)(model.parameters(), lr=0.05)
    handles = [layeropt.attach(model, lo, verify=100)]

    def again() -> None:  # (a DDP or FSDP2 model is attached again after remove())
        if kind != "plain":
            handles[-1].remove()
        handles.append(layeropt.attach(model, lo, verify=100))

    xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    loop(ref, ro, xs, lambda: None)
    if cause is not None:
        with pytest.raises(layeropt.VerifyError, match=cause):
            loop(model, lo, xs, again)
        return
    loop(model, lo, xs, again)
    _assert_torchs(model, lo, ref, ro)


@pytest.mark.parametrize("kind", test_rules.KINDS)
def test_another_models_zero_grad_leaves_the_verified_loop_alone(process_group, kind):
    """A plain model's ``zero_grad()`` (another model, trained by torch.optim beside it)
    between the verified loop's backward and its ``step()``: not this loop's - it applied
    this loop's pending step as a loop without ``step()``'s and failed its ``step()``
    (tests/verifyfuzz.py, torch's side of a program)."""
    (ref, model), other = _pair(kind), _model()
    ro = torch.optim.Adamax(ref.parameters(), lr=0.01)
    lo = layeropt.in_backward(torch.optim.Adamax)(model.parameters(), lr=0.01)
    layeropt.attach(model, lo, verify=100)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing said either)
        for m, o in ((ref, ro), (model, lo)):
            m(x).pow(2).mean().backward()
            other(x).sum().backward()
            other.zero_grad()
            o.step()
            o.zero_grad()
    _assert_torchs(model, lo, ref, ro)


def _scaled_steps(m, o, scaler, xs, lo, stn):
    """GradScaler steps (torch's recipe, or layeropt.backward's): the first batch's
    loss NaN (a skipped step), ``zero_grad(set_to_none=stn)``, then the rest."""
    for i, x in enumerate(xs):
        scaled_step(lo, m(x).pow(2).mean() * (float("nan") if i == 0 else 1.0), o, scaler)
        o.zero_grad(set_to_none=stn)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("scale", [1024.0, 1000.0], ids=["power of two", "1000"])
@pytest.mark.parametrize("stn", [True, False], ids=["set_to_none", "zeros kept"])
@pytest.mark.parametrize("fused", [False, True], ids=["", "fused"])
@pytest.mark.parametrize("kind", test_rules.KINDS)
def test_verified_gradscaler_steps_are_torchs(process_group, kind, fused, stn, scale):
    """Verified GradScaler steps end as torch's (tests/ampfuzz.py's verify mix found both):
    a fused Adam's kernel divides by a scale that is not a power of two (the real side
    had unscaled by multiplying: a false alarm), and the zeros zero_grad(set_to_none=False)
    keeps after a skipped step are stepped at the next one (the real side had dropped
    them)."""
    if kind == "fsdp2" and fused:
        pytest.skip("torch's fused kernels have no DTensor sharding rule")
    ref, model = _pair(kind)
    ro = torch.optim.Adam(ref.parameters(), lr=0.05, fused=fused)
    lo = layeropt.Adam(model.parameters(), lr=0.05, fused=fused)
    layeropt.attach(model, lo, verify=100)
    xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for m, o, lo_side in ((ref, ro, False), (model, lo, True)):
        _scaled_steps(m, o, torch.amp.GradScaler("cpu", init_scale=scale), xs, lo_side, stn)
    _assert_torchs(model, lo, ref, ro)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("call", ["scaler.step(opt)", "opt.step()"])
def test_a_verified_fused_step_unscales_in_its_kernel_once(call):
    """A fused optimizer verified after ``layeropt.backward(scaler=)``: its real step
    divides by the scale in the kernel whether the loop calls ``scaler.step(opt)`` (on
    torch before 2.6 that sets no ``grad_scale`` for a scaler left as after
    ``unscale_``: the real step had applied the scaled gradient, a false alarm) or
    ``opt.step()``, and leaves no ``grad_scale`` behind (it had divided the next,
    unscaled, step's gradients by the old scale). Three steps: two verified, one not."""
    ref, model = _pair("plain")
    ro = torch.optim.Adam(ref.parameters(), lr=0.05, fused=True)
    lo = layeropt.Adam(model.parameters(), lr=0.05, fused=True)
    layeropt.attach(model, lo, verify=2)
    xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    rs, ls = torch.amp.GradScaler("cpu", init_scale=1000.0), torch.amp.GradScaler(
        "cpu", init_scale=1000.0)
    for x in xs[:2]:
        rs.scale(ref(x).pow(2).mean()).backward()
        rs.step(ro)
        rs.update()
        ro.zero_grad()
        layeropt.backward(ls.scale(model(x).pow(2).mean()), scaler=ls)
        ls.step(lo) if call == "scaler.step(opt)" else lo.step()
        ls.update()
        lo.zero_grad()
    for x in xs[2:]:  # unscaled from here, as after switching the scaler off
        for m, o in ((ref, ro), (model, lo)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    _assert_torchs(model, lo, ref, ro)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", test_rules.KINDS)
def test_a_gradient_not_zeroed_is_found_through_a_checkpoint_and_a_clip(process_group, kind,
                                                                        reentrant):
    """step() without zero_grad(), then ``layeropt.backward(max_norm=)`` through torch's
    checkpoint: torch adds onto the last step's gradient. Verify finds it through the
    reentrant checkpoint too (its measure pass put a copy of the gradient back in
    ``.grad``, not the tensor torch kept: tests/multifuzz.py's vck mix found it)."""
    import torch.utils.checkpoint as tuc

    model = test_rules._wrap(kind, _model())
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    layeropt.attach(model, opt, verify=10)
    gen = torch.Generator().manual_seed(0)

    def loss() -> torch.Tensor:
        x = torch.randn(5, 6, generator=gen, requires_grad=True)
        return tuc.checkpoint(model, x, use_reentrant=reentrant).pow(2).mean()

    layeropt.backward(loss(), max_norm=1.0)
    opt.step()  # no zero_grad(): the next backward adds onto these gradients
    with pytest.raises(layeropt.VerifyError, match="not zeroed"):
        layeropt.backward(loss(), max_norm=1.0)
        opt.step()


@pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])
@pytest.mark.parametrize("opt_name", ["SGD", "Adam", "Rprop"])
def test_a_tensor_learning_rate_passes_verification(opt_name, cap):
    """``lr=torch.tensor(...)``, which a scheduler updates in place: verify's shadow
    restored the groups' values by copying them in place even where unchanged, and the
    loop's check of hyperparameters set after backward (a tensor by its version) then
    refused step() (cap 0: every layer's shadow bumped it)."""
    results = []
    for layer in (False, True):
        model = _model()
        cls = (getattr(layeropt, opt_name, None) or layeropt.in_backward(
            getattr(torch.optim, opt_name))) if layer else getattr(torch.optim, opt_name)
        opt = cls(model.parameters(), lr=torch.tensor(0.01))
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)
        handle = layeropt.attach(model, opt, verify=3, bucket_cap_mb=cap) if layer else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (LAYEROPT_VERIFY: ... equal)
            for step in range(4):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
                model(x).pow(2).mean().backward()
                opt.step()
                sched.step()
                opt.zero_grad()
        if handle is not None:
            handle.remove()
        results.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()))
    test_rules.assert_same(results[1], results[0])


class _Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if branch else self.a(x)


@pytest.mark.parametrize("ddp", [False, True], ids=["plain", "ddp"])
def test_kept_zeros_of_an_unreached_layer_are_clipped_as_torch_clips_them(process_group, ddp):
    """``zero_grad(set_to_none=False)`` keeps zeros in a layer's ``.grad``; a backward that
    does not reach it, clipped at a non-finite norm (a NaN loss): torch's
    ``clip_grad_norm_`` scales those zeros too (0 * NaN: NaN) and ``step()`` updates the
    layer on them. Verified on a DDP model the zeros came back from DDP's bucket after
    the shadowing and were stepped unclipped: the layer stayed finite, silently
    (ampfuzz ``verify`` on DDP, seeds 310,194, 310,389, 310,395; fails before)."""
    runs = []
    for layer in (False, True):
        torch.manual_seed(0)
        model = _Branch()
        top = torch.nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=True) if ddp else model
        opt = (layeropt.SGD if layer else torch.optim.SGD)(model.parameters(), lr=0.1)
        if layer:
            layeropt.attach(top, opt, verify=5)
        x = torch.randn(5, 4)
        top(x, True).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss = top(x, False).sum() * float("nan")
        if layer:
            layeropt.backward(loss, opt, max_norm=1.0)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (verify's end of program)
            opt.step()
        runs.append(model)
    ref, ours = runs
    assert ref.b.weight.isnan().all()  # (torch's: the zeros times NaN)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p.isnan(), q.isnan())
        assert torch.equal(p.nan_to_num(), q.nan_to_num())


@pytest.mark.parametrize("hook", ["feedback", "fp16"])
def test_verify_on_ddp_names_a_held_backward_onto_the_last_steps_gradient(process_group,
                                                                          hook):
    """On a DDP model, a ``no_step()`` backward after ``step()`` without ``zero_grad()``
    adds onto the gradient the step applied, which in-backward updating has freed
    (docs/rules.md). A comm hook that keeps state reduces that sum there and keeps it in
    its state, whatever ``zero_grad()`` comes next: verify names it at that backward,
    before the hook runs (verifyfuzz ``chaos`` seed 321,017 on DDP: silent before). With
    torch's stateless hooks it is found at ``step()`` as without DDP, and a
    ``zero_grad()`` before any step leaves the loop exact."""
    from harness import comm_hook

    torch.manual_seed(0)
    model = _Branch()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fn, state = comm_hook(hook)
    layeropt.attach(ddp, opt, verify=5, comm_hook=fn, comm_state=state)
    x = torch.randn(5, 4)
    ddp(x, True).sum().backward()
    opt.step()
    calls = getattr(state, "calls", None)
    with opt.no_step():
        if hook == "feedback":
            with pytest.raises(layeropt.VerifyError, match="zero_grad"):
                ddp(x, True).sum().backward()
            assert state.calls == calls  # (before the hook ran)
        else:
            ddp(x, True).sum().backward()


def _same_runs(ref: tuple[Any, Any], got: tuple[Any, Any]) -> None:
    """Two runs' (model, optimizer or optimizers): parameters and state bit for bit."""
    (ref_model, ref_opts), (model, opts) = ref, got
    for p, q in zip(model.parameters(), ref_model.parameters()):
        test_rules.assert_same(p.detach(), q.detach())
    for o, r in zip(*(x if isinstance(x, list) else [x] for x in (opts, ref_opts))):
        test_rules.assert_same(o.state_dict()["state"], r.state_dict()["state"])


@pytest.mark.parametrize("n", [1, 2])
def test_training_goes_on_exact_after_the_last_verified_step(monkeypatch, n):
    """The last verified ``step()`` drops the gradients torch's step applied, as
    in-backward updating leaves none: kept, they were stepped again as new where a
    layer frozen after its forward is reached (the GAN's discriminator around the
    generator's backward), and the next ``zero_grad()`` refused this exact loop
    (``LAYEROPT_VERIFY=1``; at 2 the hooks happened to be gone)."""
    monkeypatch.setenv("LAYEROPT_VERIFY", str(n))
    out = test_rules.run_rule("plain", "GAN, D frozen after its forward, around G's backward")
    assert out["error"] is None, out["error"]
    assert len(out["steps"]) == test_rules.STEPS > n
    for step, s in enumerate(out["steps"]):
        for what in ("params", "state", "norms"):
            test_rules.assert_same(*s[what], f"{what} after step {step}")


@pytest.mark.parametrize("bucket_schedule", ["cap0", "default-cap"], indirect=True)
@pytest.mark.parametrize("verify", [0, 3], ids=["alone", "verified"])
def test_a_layer_frozen_for_a_held_backward_is_hooked_again_at_step_under_verify(
        verify, bucket_schedule):
    """Two optimizers attached together (the first layer's, the last one's). A held
    backward with the last layer frozen leaves it without hooks (rule 7); the ``step()``
    applying the held gradients hooks it again. Under verify that ``step()`` is torch's
    own, and it did not: the next backwards took other routes than layeropt's alone, and
    verify refused this exact loop ("not zeroed"; multifuzz ``--mix verify`` seed
    342,021). Both runs equal torch.optim."""
    runs = []
    for lo in (False, True):
        m = _model()
        first, last = m[0], m[2]
        opts = [(layeropt.SGD if lo else torch.optim.SGD)(first.parameters(), lr=0.1,
                                                          momentum=0.9),
                (layeropt.in_backward(torch.optim.NAdam) if lo else torch.optim.NAdam)(
                    last.parameters(), lr=0.1)]
        if lo:
            handle = layeropt.attach(m, opts, verify=verify)

        def backward(frozen, seed, held=False):
            for layer in frozen:
                layer.requires_grad_(False)
            with contextlib.ExitStack() as stack:
                for o in opts if held and lo else ():
                    stack.enter_context(o.no_step())
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
                m(x).pow(2).mean().backward()
            for layer in frozen:
                layer.requires_grad_(True)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (LAYEROPT_VERIFY: ... ended after)
            backward([last], 0, held=True)
            opts[0].step()  # (its gradient stays in torch's .grad: not zeroed)
            backward([first], 1)
            opts[1].step()
            backward([last], 2)  # (onto the kept gradient: held, then dropped)
            for o in opts:
                o.zero_grad()
            for seed in (3, 4):  # then training as usual
                backward([], seed)
                for o in opts:
                    o.step()
                    o.zero_grad()
        if lo:
            handle.remove()
        runs.append((m, opts))
    _same_runs(*runs)


@pytest.mark.parametrize("bucket_schedule", ["cap0", "default-cap"], indirect=True)
@pytest.mark.parametrize("clip", [False, True], ids=["backward", "layeropt.backward(max_norm)"])
@pytest.mark.parametrize("verify", [0, 1], ids=["alone", "verify=1"])
def test_kept_zeros_after_the_last_verified_step_are_stepped_once(verify, clip,
                                                                  bucket_schedule):
    """``verify=1``: the verified ``step()``, then ``zero_grad(set_to_none=False)`` and a
    loss that does not reach the layer (the head on detached features), clipped: torch's
    ``step()`` updates the layer once on its kept zeros (weight decay, the step count).
    The last verified step left torch's gradients in ``.grad``, zeroed in place there,
    and in backward mode they were stepped at the end of ``layeropt.backward`` and again
    by ``step()`` - silently (multifuzz ``--mix verify`` seed 169, verifying 3 steps)."""
    runs = []
    for lo in (False, True):
        torch.manual_seed(0)
        trunk, head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        model = torch.nn.Sequential(trunk, torch.nn.Tanh(), head)
        o1 = (layeropt.RMSprop if lo else torch.optim.RMSprop)(trunk.parameters(), lr=0.01,
                                                               weight_decay=0.01)
        o2 = torch.optim.Adam(head.parameters(), lr=0.05)  # (plain beside it)
        handle = layeropt.attach(model, o1, verify=verify) if lo else None
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (LAYEROPT_VERIFY: ... equal)
            model(x).pow(2).mean().backward()
            o1.step()
            o2.step()
            o1.zero_grad(set_to_none=False)
            o2.zero_grad()
            loss = head(torch.tanh(trunk(x)).detach()).pow(2).mean()
            if clip and lo:
                layeropt.backward(loss, max_norm=0.1)
            else:
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            o1.step()
            o2.step()
        if handle is not None:
            handle.remove()
        runs.append((model, o1))
    _same_runs(*runs)


@pytest.mark.parametrize("ddp", [False, True], ids=["plain", "ddp"])
def test_verify_names_a_clip_over_the_last_steps_gradient_of_an_unreached_layer(
        process_group, ddp):
    """Two optimizers; ``step()`` of one (``b``'s held gradient applied, kept in ``.grad``
    by torch), then a clipped backward that does not reach ``b``: torch's
    ``clip_grad_norm_`` measures that kept gradient, in-backward updating (which freed
    it) does not, so the other layer is clipped differently. Verify names it ("not
    zeroed") - on a DDP model (``find_unused_parameters``) too, where it was silent
    (multifuzz ``--mix verify`` seed 350,000 on DDP)."""
    torch.manual_seed(0)
    model = _Branch()
    wrapped = (torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
               if ddp else model)
    opt_b = layeropt.SGD(model.b.parameters(), lr=0.1)
    opt_a = layeropt.SGD(model.a.parameters(), lr=0.1)
    layeropt.attach(wrapped, [opt_a, opt_b], verify=5)
    x = torch.randn(5, 4)
    with opt_a.no_step(), opt_b.no_step():
        wrapped(x, True).sum().backward()
    opt_b.step()
    with pytest.raises(layeropt.VerifyError, match="not zeroed"):
        layeropt.backward(wrapped(x, False).sum(), max_norm=0.01)


@pytest.mark.parametrize("bucket_schedule", ["cap0", "default-cap"], indirect=True)
@pytest.mark.parametrize("who", ["model", "optimizer"])
@pytest.mark.parametrize("retain", [False, True], ids=["backward", "retain_graph"])
def test_zeros_kept_after_the_last_verified_step_are_torchs(retain, who, bucket_schedule):
    """``verify=1``, then ``zero_grad(set_to_none=False)`` and ``step()`` with no backward:
    torch's step updates on the zeros it keeps (weight decay, the step count), and so
    must the loop once verification has ended (verifyfuzz seed 350,041, a hand-over
    that dropped the gradients torch keeps as zeros)."""
    runs = []
    for lo in (False, True):
        model = _model()
        opt = (layeropt.in_backward(torch.optim.Adagrad) if lo else torch.optim.Adagrad)(
            model.parameters(), lr=0.1, lr_decay=0.01, weight_decay=0.01)
        handle = layeropt.attach(model, opt, verify=1) if lo else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (LAYEROPT_VERIFY: ... equal; held: retain)
            model(torch.randn(4, 6)).pow(2).mean().backward(retain_graph=retain)
            opt.step()
            (model if who == "model" else opt).zero_grad(set_to_none=False)
            opt.step()
        if handle is not None:
            handle.remove()
        runs.append((model, opt))
    _same_runs(*runs)


class _TwoLosses(torch.nn.Module):
    """A trunk and a head, each its optimizer's; ``forward(x, part)``: a loss on either."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x, part):
        if part == "trunk":
            return self.trunk(x).pow(2).sum()
        return self.head(self.trunk(x).detach()).pow(2).sum()


def test_a_forward_between_a_backward_and_its_step_ends_verification_and_its_step_says_so():
    """Two optimizers of one model, a loss for each, then their steps: the second loss's
    forward comes between the first's backward and its step(), which verify takes for a
    loop without step() (it applies the update there and updates in backward after).
    The step() then warns that the steps since are not verified: a loop that differs
    from torch there (gradients never zeroed, docs/rules.md) was passed without a word
    (multifuzz's vgan mix, seed 510,028; silent before 2026-12-06). This loop is exact."""
    torch.manual_seed(0)
    base = _TwoLosses()
    runs = []
    for lo in (False, True):
        model = copy.deepcopy(base)
        cls = layeropt.SGD if lo else torch.optim.SGD
        o1, o2 = cls(model.trunk.parameters(), lr=0.1), cls(model.head.parameters(), lr=0.1)
        if lo:
            layeropt.attach(model, [o1, o2], verify=5)
        gen = torch.Generator().manual_seed(1)
        said = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                x = torch.randn(3, 4, generator=gen)
                model(x, "head").backward()
                model(x, "trunk").backward()  # (the forward before o2's step)
                o2.step()
                o1.step()
                o1.zero_grad()
                o2.zero_grad()
            said += [str(w.message) for w in seen if "LAYEROPT_VERIFY" in str(w.message)]
        runs.append((model, said))
    (ref, _), (ours, said) = runs
    assert any("step() after verification ended at a forward" in s for s in said), said
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters()))


def _actor_critic(lo: bool, order: list[str], verify: int | None = None) -> list[torch.Tensor]:
    """An actor-critic loop: each iteration the critic's backward, then the actor's loss
    through the (frozen) critic - after the critic's step() ("stepped") as CleanRL's DDPG
    orders it, or before it ("between"), both steps at the end."""
    torch.manual_seed(0)
    actor = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    critic = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    cls = layeropt.Adam if lo else torch.optim.Adam
    opt_a, opt_c = cls(actor.parameters(), lr=0.01), cls(critic.parameters(), lr=0.01)
    if lo:
        layeropt.attach(actor, opt_a, verify=verify)
        layeropt.attach(critic, opt_c, verify=verify)
    gen = torch.Generator().manual_seed(1)
    for where in order:
        s, a, r = (torch.randn(6, n, generator=gen) for n in (3, 2, 1))
        (critic(torch.cat([s, a], 1)) - r).pow(2).mean().backward()
        if where == "stepped":
            opt_c.step()
        critic.requires_grad_(False)
        (-critic(torch.cat([s, actor(s)], 1)).mean()).backward()
        critic.requires_grad_(True)
        if where == "between":
            opt_c.step()
        opt_a.step()
        opt_c.zero_grad()
        opt_a.zero_grad()
    return [p.detach().clone() for p in [*actor.parameters(), *critic.parameters()]]


# (loop order, verify=) -> the error, and the words its message must hold
READ_AHEAD = {
    (("between",) * 3, None): (layeropt.BackwardStateError, "reads parameter '0.weight'"),
    (("between",) * 3, 5): (layeropt.VerifyError, "reads parameter '0.weight'.*training step 1:"),
    (("stepped", "between"), None): (layeropt.BackwardStateError, "Nothing of this forward ran"),
    (("stepped", "between"), 5): (layeropt.BackwardStateError, "reads parameter '0.weight'"),
}


@pytest.mark.parametrize("order,verify", list(READ_AHEAD), ids=[
    f"{'-'.join(o)}-verify{v}" for o, v in READ_AHEAD])
def test_a_forward_through_a_model_its_backward_updated_before_its_step_is_refused(order, verify):
    """The actor's loss reads the critic its backward updated, where torch's reads the
    critic before its step(): refused at that forward once the loop has called step()
    (verified or not); in the first training step (the forward may have been a loop
    without step()'s next iteration) verify finds it at the step() after it, and without
    verify it is refused at the next one. In DDPG's order: exact, verify quiet."""
    error, words = READ_AHEAD[order, verify]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=words):
            _actor_critic(True, list(order), verify=verify)
        exact = ["stepped"] * 3
        assert all(torch.equal(a, b) for a, b in zip(_actor_critic(False, exact),
                                                      _actor_critic(True, exact, verify=5)))
