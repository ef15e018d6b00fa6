"""The rules as one table: each loop users write x each attachment kind x schedule.

Every cell trains the same model twice from one seed - the loop with
``torch.optim.Adam``, and the same loop (or its documented layeropt form) with
``layeropt.Adam`` attached - and is either **exact** (parameters and optimizer
state bit-identical after every step) or **loud** (an error naming the fix in
the first training step, the one whose numbers would differ). Kinds: a plain
model, ``DistributedDataParallel`` and FSDP2's ``fully_shard`` on one gloo
process (the two-process runs are in ``tests/test_distributed.py``). The
schedules come from ``conftest.py`` (``bucket_cap_mb=0`` and the default).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad_norm_ as imported_clip_grad_norm_  # as most scripts do

import layeropt
from harness import FSDP2_ON_CPU, assert_same, fully_shard

EXACT = "exact"
STEPS = 3


def _plain(m, opt, x, lo, ctx):
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _torch_accumulation(m, opt, x, lo, ctx):
    for half in x.chunk(2):
        (m(half).pow(2).mean() / 2).backward()
    opt.step()
    opt.zero_grad()


def _no_step(m, opt, x, lo, ctx):
    a, b = x.chunk(2)
    with opt.no_step() if lo else contextlib.nullcontext():
        (m(a).pow(2).mean() / 2).backward()
    (m(b).pow(2).mean() / 2).backward()
    opt.step()
    opt.zero_grad()


def _held_after_stepping(m, opt, x, lo, ctx):
    """The window the wrong way round: a stepping backward, then a held one."""
    a, b = x.chunk(2)
    (m(a).pow(2).mean() / 2).backward()
    with opt.no_step() if lo else contextlib.nullcontext():
        (m(b).pow(2).mean() / 2).backward()
    opt.step()
    opt.zero_grad()


def _clip_with(clip: Callable[..., Any]) -> Callable[..., None]:
    def loop(m, opt, x, lo, ctx):
        m(x).pow(2).mean().backward()
        clip(m.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    return loop


def _clip_filtered(m, opt, x, lo, ctx):
    m(x).pow(2).mean().backward()  # fairseq's and accelerate's style: those with a gradient
    torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.grad is not None], 0.05)
    opt.step()
    opt.zero_grad()


def _edit_grad(m, opt, x, lo, ctx):
    m(x).pow(2).mean().backward()
    for p in m.parameters():  # noise after backward, as Opacus adds it
        p.grad = torch.full_like(p, 0.01) if p.grad is None else p.grad + 0.01
    opt.step()
    opt.zero_grad()


def _averaged(before_step: bool) -> Callable[..., None]:
    """An EMA of the model (``AveragedModel``) updated after ``step()``, or before it."""
    def loop(m, opt, x, lo, ctx):
        m(x).pow(2).mean().backward()
        if before_step:
            ctx["average"].update_parameters(ctx["inner"])
        opt.step()
        if not before_step:
            ctx["average"].update_parameters(ctx["inner"])
        opt.zero_grad()
    return loop


def _clamped(where: str) -> Callable[..., None]:
    """The weights clamped in place (WGAN's weight clipping): after ``step()``, between
    backward and ``step()``, or there in torch's loop and - layeropt's form of it - in a
    post-accumulate-grad hook, which runs before the update."""
    def clamp(p: torch.Tensor) -> None:
        with torch.no_grad():
            p.clamp_(-0.3, 0.3)

    def loop(m, opt, x, lo, ctx):
        if where == "hook" and lo and "hooks" not in ctx:
            ctx["hooks"] = [p.register_post_accumulate_grad_hook(clamp) for p in m.parameters()]
        m(x).pow(2).mean().backward()
        if where == "between" or where == "hook" and not lo:
            for p in m.parameters():
                clamp(p)
        opt.step()
        if where == "after":
            for p in m.parameters():
                clamp(p)
        opt.zero_grad()
    return loop


def _lr_between(m, opt, x, lo, ctx):
    m(x).pow(2).mean().backward()
    for g in opt.param_groups:  # a warm-up written after backward
        g["lr"] = g["lr"] * 0.5
    opt.step()
    opt.zero_grad()


def _scaler_recipe(m, opt, x, lo, ctx):
    scaler = ctx["scaler"]
    scaler.scale(m(x).pow(2).mean()).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _clipped_step(m, opts, loss, lo, ctx):
    """layeropt.backward(max_norm=) vs backward + clip_grad_norm_(model), then every step."""
    if lo:
        ctx["norms"].append(layeropt.backward(loss, max_norm=0.05))
    else:
        loss.backward()
        ctx["norms"].append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    for o in opts:
        o.step()
        o.zero_grad()


def _layeropt_clip(m, opt, x, lo, ctx):
    _clipped_step(m, [opt], m(x).pow(2).mean(), lo, ctx)


def _layeropt_scaler(m, opt, x, lo, ctx):
    scaler = ctx["scaler"]
    loss = scaler.scale(m(x).pow(2).mean())
    if lo:
        ctx["norms"].append(layeropt.backward(loss, max_norm=0.05, scaler=scaler))
    else:
        loss.backward()
        scaler.unscale_(opt)
        ctx["norms"].append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _head_by_plain_sgd(m, opt, x, lo, ctx):
    """The last layer is trained by a second, plain optimizer; clip over the model."""
    loss = m(x).pow(2).mean()
    if lo:
        ctx["norms"].append(layeropt.backward(loss, max_norm=0.05, parameters=m.parameters()))
    else:
        loss.backward()
        ctx["norms"].append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    opt.step()
    ctx["head_opt"].step()
    opt.zero_grad()
    ctx["head_opt"].zero_grad()


# -- loops that reach past the attached model ------------------------------------
def _weighted(max_norm: float | None, scaled: bool = False) -> Callable[..., None]:
    """Uncertainty weighting (a learnable loss weight outside the model, owned by the
    same optimizer), clipped over the model and the weight, optionally with a scaler."""
    def loop(m, opt, x, lo, ctx):
        w = ctx["w"]
        loss = (torch.exp(-w) * m(x).pow(2).mean() + w).sum()
        scaler = ctx["scaler"] if scaled else None
        if scaler is not None:
            loss = scaler.scale(loss)
        if lo:
            norm = layeropt.backward(loss, max_norm=max_norm, scaler=scaler)
            ctx["norms"].append(norm) if max_norm is not None else None
        else:
            loss.backward()
            if scaler is not None:
                scaler.unscale_(opt)
            if max_norm is not None:
                ctx["norms"].append(torch.nn.utils.clip_grad_norm_([*m.parameters(), w], max_norm))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return loop


def _clip_subset(m, opt, x, lo, ctx):
    """clip_grad_norm_ over the last layer only: the others are not clipped."""
    inner = m.module if hasattr(m, "module") else m
    subset = list(inner[4].parameters())  # (before forward: FSDP2 swaps the root's in it)
    loss = m(x).pow(2).mean()
    if lo:
        ctx["norms"].append(layeropt.backward(loss, max_norm=0.05, parameters=subset))
    else:
        loss.backward()
        ctx["norms"].append(torch.nn.utils.clip_grad_norm_(subset, 0.05))
    opt.step()
    opt.zero_grad()


def _second_attach(m, opt, x, lo, ctx):
    """attach(model, opt, clip_value=0.01), then attach(head, opt): the model's clipping
    stays the model's (torch: clip_grad_value_ over the model's parameters)."""
    ctx["head"](m(x)).pow(2).mean().backward()
    if not lo:
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
    opt.step()
    opt.zero_grad()


def _no_step_call(clip: bool) -> Callable[..., None]:
    """A loop that never calls step() (word_language_model with layeropt.SGD): each
    layeropt.backward(max_norm=) - or, without clipping and zero_grad, each backward -
    is one training step."""
    def loop(m, opt, x, lo, ctx):
        if clip:
            m.zero_grad()
        loss = m(x).pow(2).mean()
        if lo:
            norm = layeropt.backward(loss, max_norm=0.05) if clip else loss.backward()
        else:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05) if clip else None
            opt.step()
            opt.zero_grad()
        if clip:
            ctx["norms"].append(norm)
    return loop


def _gan(fix: str | None) -> Callable[..., None]:
    """The DCGAN tutorial's loop (D: the model; its two losses accumulated, the first
    under no_step() as the accumulation rule says); the generator's loss reaches D."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def loop(D, optD, x, lo, ctx):
        G, optG = ctx["G"], ctx["optG"]
        D.zero_grad()  # netD.zero_grad(), as the tutorial: the module's
        G.zero_grad()  # (the tutorial's comes after G's forward, where FSDP2's root
        # module lists its unsharded parameters: it would zero nothing there)
        with optD.no_step() if lo else contextlib.nullcontext():
            bce(D(x).mean(1), torch.ones(4)).backward()
        fake = G(x[:, :4])
        bce(D(fake.detach()).mean(1), torch.zeros(4)).backward()
        optD.step()
        if fix == "freeze":
            D.requires_grad_(False)
        with optD.no_step() if lo and fix in ("no_step", "no_step clipped") \
                else contextlib.nullcontext():
            out = D(fake).mean(1)
            if fix == "freeze after forward":  # around the backward alone: torch still
                D.requires_grad_(False)  # fires D's hooks, its gradients are discarded
            if fix != "no_step clipped":
                bce(out, torch.ones(4)).backward()
            elif lo:  # (by default the optimizers that step now: optG, not the held optD)
                ctx["norms"].append(layeropt.backward(bce(out, torch.ones(4)), max_norm=0.05))
            else:  # G's step clipped, as the tutorial's loop would add it
                bce(out, torch.ones(4)).backward()
                ctx["norms"].append(torch.nn.utils.clip_grad_norm_(G.parameters(), 0.05))
        D.requires_grad_(True)
        optG.step()
    return loop


def _ddpg(fix: str | None) -> Callable[..., None]:
    """CleanRL's DDPG update (the critic: the model, zeroed by its optimizer); the
    actor's loss backpropagates through the critic (``"late step"``: the critic's
    ``step()`` after it, so the actor's forward reads a critic torch has not updated)."""
    def loop(qf, q_opt, x, lo, ctx):
        actor, actor_opt = ctx["G"], ctx["optG"]
        obs, act, target = x[:, :4], x[:, 4:], x[:, :1].sin()
        q_loss = (qf(torch.cat([obs, act], 1)).mean(1, keepdim=True) - target).pow(2).mean()
        q_opt.zero_grad()
        q_loss.backward()
        if fix != "freeze, late step":
            q_opt.step()
        if fix in ("freeze", "freeze, late step"):
            qf.requires_grad_(False)
        actor_loss = -qf(torch.cat([obs, torch.tanh(actor(obs))], 1)).mean()
        actor_opt.zero_grad()
        actor_loss.backward()
        qf.requires_grad_(True)
        actor_opt.step()
        if fix == "freeze, late step":
            q_opt.step()
    return loop


def _shared_with_plain(fix: bool, layeropt_first: bool = False) -> Callable[..., None]:
    """Actor-critic with a shared trunk (the model's first layer), the critic's plain
    torch optimizer owning it too: only the actor's optimizer was made layeropt."""
    def loop(m, opt, x, lo, ctx):
        critic, critic_opt = ctx["critic"], ctx["critic_opt"]
        h = m(x)
        loss = h.pow(2).mean() + critic(h).pow(2).mean()
        with opt.no_step() if lo and fix else contextlib.nullcontext():
            loss.backward()
        for o in (opt, critic_opt) if layeropt_first else (critic_opt, opt):
            o.step()
        critic_opt.zero_grad()
        opt.zero_grad()
    return loop


def _tbptt(m, opt, x, lo, ctx):
    """Truncated BPTT, a backward per time step (retain_graph=True), a step per chunk."""
    h = torch.zeros(x.shape[0], 3)
    for t in range(3):
        h = torch.tanh(m(torch.cat([x[:, :3] * (t + 1), h], 1)))
        h.pow(2).mean().backward(retain_graph=True)
    opt.step()
    opt.zero_grad()


# loop -> (expected, error class, words the message must contain)
RULES: dict[str, tuple[Callable[..., None], str, type | None, str]] = {
    "plain": (_plain, EXACT, None, ""),
    "no_step accumulation": (_no_step, EXACT, None, ""),
    "torch-style accumulation": (_torch_accumulation, "loud", layeropt.BackwardStateError,
                                 "no_step()"),
    # (the loop's first step(): refused there; after it, at the held backward)
    "no_step() after a stepping backward": (_held_after_stepping, "loud",
                                            layeropt.BackwardStateError, "1 of which already"),
    "clip_grad_norm_ after backward": (_clip_with(torch.nn.utils.clip_grad_norm_), "loud",
                                       layeropt.LayeroptError, "layeropt.backward(loss, max_norm"),
    "imported clip_grad_norm_": (_clip_with(imported_clip_grad_norm_), "loud",
                                 layeropt.LayeroptError, "layeropt.backward(loss, max_norm"),
    "clip_grad_norm_ of those with a gradient": (_clip_filtered, "loud", layeropt.LayeroptError,
                                                 "p.grad is not None"),
    "clip_grad_value_ after backward": (_clip_with(torch.nn.utils.clip_grad_value_), "loud",
                                        layeropt.LayeroptError, "clip_value="),
    "gradient edited after backward": (_edit_grad, "loud", layeropt.BackwardStateError,
                                       "tensor hook"),
    "AveragedModel updated after step()": (_averaged(False), EXACT, None, ""),
    "AveragedModel updated between backward and step()": (
        _averaged(True), "loud", layeropt.BackwardStateError, "after optimizer.step()"),
    "weights clamped after step()": (_clamped("after"), EXACT, None, ""),
    "weights clamped between backward and step()": (
        _clamped("between"), "loud", layeropt.BackwardStateError, "post-accumulate-grad hook"),
    "weights clamped in a post-accumulate-grad hook": (_clamped("hook"), EXACT, None, ""),
    "lr set between backward and step": (_lr_between, "loud", layeropt.BackwardStateError,
                                         "before backward"),
    "GradScaler recipe (unscale_ + clip)": (_scaler_recipe, EXACT, None, ""),
    "layeropt.backward(max_norm)": (_layeropt_clip, EXACT, None, ""),
    "layeropt.backward(max_norm, scaler)": (_layeropt_scaler, EXACT, None, ""),
    "head trained by a plain optimizer, clipped": (_head_by_plain_sgd, EXACT, None, ""),
    # loops that reach past the attached model
    "loss weight outside the model, layeropt.backward(max_norm)": (
        _weighted(0.05), EXACT, None, ""),
    "loss weight outside the model, layeropt.backward(max_norm, scaler)": (
        _weighted(0.05, scaled=True), EXACT, None, ""),
    "loss weight outside the model, GradScaler only": (
        _weighted(None, scaled=True), EXACT, None, ""),
    "loss weight outside the model, norm logged (max_norm=inf)": (
        _weighted(float("inf")), EXACT, None, ""),
    "layeropt.backward(parameters=subset) clips the subset": (_clip_subset, EXACT, None, ""),
    "second attach keeps the first's clip_value": (_second_attach, EXACT, None, ""),
    "GAN as the DCGAN tutorial writes it": (_gan(None), "loud", layeropt.BackwardStateError,
                                            "requires_grad_(False)"),
    "GAN, D frozen during G's backward": (_gan("freeze"), EXACT, None, ""),
    "GAN, G's backward inside optD.no_step()": (_gan("no_step"), EXACT, None, ""),
    "GAN, G's backward inside optD.no_step(), clipped": (_gan("no_step clipped"), EXACT,
                                                         None, ""),
    "GAN, D frozen after its forward, around G's backward": (
        _gan("freeze after forward"), EXACT, None, ""),
    "no step(): layeropt.backward(max_norm) is the step": (_no_step_call(True), EXACT, None, ""),
    "no step(), no zero_grad(): each backward is the step": (
        _no_step_call(False), EXACT, None, ""),
    "DDPG as CleanRL writes it": (_ddpg(None), "loud", layeropt.BackwardStateError, "no_step()"),
    "DDPG, critic frozen during the actor's backward": (_ddpg("freeze"), EXACT, None, ""),
    "DDPG, critic frozen, its step() after the actor's": (
        _ddpg("freeze, late step"), "loud", layeropt.BackwardStateError,
        "call step() before this forward"),
    "shared trunk also owned by a plain optimizer": (
        _shared_with_plain(False), "loud", layeropt.BackwardStateError, "no_step()"),
    "shared trunk, backward inside no_step()": (_shared_with_plain(True), EXACT, None, ""),
    "shared trunk, no_step(), layeropt's step() first": (  # the message names the order
        _shared_with_plain(True, layeropt_first=True), "loud", layeropt.BackwardStateError,
        ".step() before opt.step()"),
    "truncated BPTT, a backward per time step": (_tbptt, EXACT, None, ""),
}
# Loud rows whose loop differs only from a later step on (the zero_grad that would
# discard what a backward applied comes at the top of the next iteration).
LATE = {"GAN as the DCGAN tutorial writes it": 1, "DDPG as CleanRL writes it": 1,
        # (in the loop's first training step, before any step(), the actor's forward may
        # be a loop without step()'s next iteration: verify finds it there, tests/test_verify.py)
        "DDPG, critic frozen, its step() after the actor's": 1}
# Rows not run on some kinds, each with its reason (KINDS without them).
NOT_ON: dict[str, tuple[str, ...]] = {
    # DDP: refused (AttachError, the fix named): its reducer expects the frozen leaf's
    # gradient, which torch still computes; loud, not exact
    "GAN, D frozen after its forward, around G's backward": ("ddp",),
    # FSDP2: torch refuses to deepcopy an FSDP2 module, so AveragedModel cannot be built
    "AveragedModel updated after step()": ("fsdp2",),
    "AveragedModel updated between backward and step()": ("fsdp2",),
}
NOT_ON_WHY = "not run on this kind (NOT_ON says why)"
KINDS = ["plain", "ddp", pytest.param("fsdp2", marks=pytest.mark.skipif(
    not FSDP2_ON_CPU, reason="FSDP2 runs on CPU from torch 2.8"))]


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _wrap(kind: str, m: torch.nn.Module) -> torch.nn.Module:
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(m)
    if kind == "fsdp2":  # the last layer stays in the root's group (swapped in backward)
        for layer in list(m)[:-1]:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    return m


def _local(x: Any) -> Any:
    """Tensors as plain tensors (FSDP2's DTensors on one process hold everything)."""
    if isinstance(x, torch.Tensor):  # (full_tensor() of one process may be its shard itself)
        x = x.detach()
        return (x.full_tensor() if hasattr(x, "full_tensor") else x).clone()
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_local(v) for v in x)
    return x


def _wrap_other(kind: str, m: torch.nn.Module) -> torch.nn.Module:
    """A second model of the loop (a generator, an actor, a head), wrapped as the first."""
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(m)
    if kind == "fsdp2":
        fully_shard(m)
    return m


def _averaged(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad / dist.get_world_size()


def _others(kind: str, rule: str, lo: bool, ctx: dict[str, Any]) -> list[torch.Tensor]:
    """The loop's other models and parameters (in ``ctx``); returns the parameters the
    model's optimizer owns besides the model's own. Seeded: both runs build the same."""
    torch.manual_seed(1)
    lib = layeropt if lo else torch.optim
    if rule.startswith("loss weight"):
        ctx["w"] = torch.nn.Parameter(torch.zeros(1))
        if kind != "plain" and dist.get_world_size() > 1:  # outside DDP/FSDP2: averaged
            ctx["w"].register_hook(_averaged)  # by hand, as a loop must (in both passes)
        ctx["compare"] = [ctx["w"]]
        return [ctx["w"]]
    if rule.startswith("second attach"):
        ctx["head"] = _wrap_other(kind, torch.nn.Linear(3, 3))
        ctx["compare"] = list(ctx["head"].parameters())
        return list(ctx["head"].parameters())
    if rule.startswith(("GAN", "DDPG")):
        G = _wrap_other(kind, torch.nn.Linear(4, 6) if rule.startswith("GAN")
                        else torch.nn.Linear(4, 2))
        ctx["G"], ctx["optG"] = G, lib.Adam(G.parameters(), lr=0.01)
        ctx["compare"], ctx["opts"] = list(G.parameters()), [ctx["optG"]]
        ctx["grads_kept"] = "no_step" in rule  # (D's held gradients wait for zero_grad)
    if rule.startswith("AveragedModel"):  # (of the model DDP wraps, as users write it)
        inner = ctx["model"].module if kind == "ddp" else ctx["model"]
        ctx["inner"] = inner
        ctx["average"] = torch.optim.swa_utils.AveragedModel(
            inner, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        ctx["compare"] = list(ctx["average"].parameters())
    if rule.startswith("shared trunk"):
        critic = _wrap_other(kind, torch.nn.Linear(3, 1))
        trunk = _layers(ctx["model"], 0)
        ctx["critic"] = critic
        ctx["critic_opt"] = torch.optim.SGD([*trunk, *critic.parameters()], lr=0.1)
        ctx["compare"], ctx["opts"] = list(critic.parameters()), [ctx["critic_opt"]]
    return []


def _build(kind: str, rule: str, lo: bool, cap: float | None = None,
           ) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    model = _wrap(kind, _model())
    inner = model.module if kind == "ddp" else model
    head = list(inner[4].parameters()) if "head" in rule else []
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    ctx: dict[str, Any] = {"norms": [], "model": model}
    others = _others(kind, rule, lo, ctx)
    opt = (layeropt.Adam if lo else torch.optim.Adam)(body + others, lr=0.01)
    if head:
        ctx["head_opt"] = torch.optim.SGD(head, lr=0.1)
    if "caler" in rule:
        ctx["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    if lo:
        caps = {} if cap is None else {"bucket_cap_mb": cap}
        clip = {"clip_value": 0.01} if rule.startswith("second attach") else {}
        ctx["handle"] = layeropt.attach(model, opt, **caps, **clip)
        if "G" in ctx:
            ctx["handles"] = [layeropt.attach(ctx["G"], ctx["optG"], **caps)]
        if "head" in ctx:
            ctx["handles"] = [layeropt.attach(ctx["head"], opt, **caps)]
    return model, opt, ctx


def run_rule(kind: str, rule: str, rank: int = 0, cap: float | None = None) -> dict[str, Any]:
    """Train ``rule``'s loop with torch.optim and with layeropt (this process's batches).

    Returns, per step, both runs' parameters (the model's, then the loop's other
    models'), optimizer states and clipping norms, and the error the layeropt run
    raised, if any (``(class name, message, step)``).
    """
    loop, expected, _, _ = RULES[rule]
    gen = [torch.Generator().manual_seed(100 * rank + i) for i in range(STEPS)]
    batches = [torch.randn(4, 6, generator=g) for g in gen]
    ref, ref_opt, ref_ctx = _build(kind, rule, lo=False)
    model, opt, ctx = _build(kind, rule, lo=True, cap=cap)

    def params(m: torch.nn.Module, c: dict[str, Any]) -> list[torch.Tensor]:
        return _local([*m.parameters(), *c.get("compare", [])])

    def states(o: Any, c: dict[str, Any]) -> list[Any]:
        return _local([o.state_dict(), *(x.state_dict() for x in c.get("opts", []))])

    out: dict[str, Any] = {"steps": [], "error": None}
    for step, x in enumerate(batches):
        loop(ref, ref_opt, x, False, ref_ctx)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the GradScaler recipe warns that it holds)
                loop(model, opt, x, True, ctx)
        except Exception as e:  # noqa: BLE001 - what was raised is the result
            out["error"] = (type(e).__name__, str(e), step)
            break
        out["steps"].append({
            "grads_none": all(p.grad is None for p in model.parameters()) or "head" in rule
            or ctx.get("grads_kept", False),
            "params": (params(model, ctx), params(ref, ref_ctx)),
            "state": (states(opt, ctx), states(ref_opt, ref_ctx)),
            "norms": (_local(ctx["norms"]), _local(ref_ctx["norms"])),
        })
    for handle in [ctx.get("handle"), *ctx.get("handles", [])]:
        handle and handle.remove()
    return out


def check_rule(rule: str, out: dict[str, Any]) -> None:
    """Exact after every step, or loud in the first whose numbers differ, naming the fix."""
    _, expected, error, fix = RULES[rule]
    if expected == EXACT:
        assert out["error"] is None, out["error"]
        for step, s in enumerate(out["steps"]):
            assert s["grads_none"], f"a .grad survived step {step}"
            for what in ("params", "state", "norms"):
                assert_same(*s[what], f"{what} after step {step}")
    else:
        assert out["error"] is not None, "not refused"
        name, message, step = out["error"]
        assert (name, step) == (error.__name__, LATE.get(rule, 0)), out["error"]
        assert fix in message, message


def compare(kind: str, rule: str) -> None:
    check_rule(rule, run_rule(kind, rule))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_rule(process_group, kind, rule):
    if kind in NOT_ON.get(rule, ()):
        pytest.skip(NOT_ON_WHY)
    compare(kind, rule)



# -----------------------------------------------------------------------------
# Several optimizers, held gradients, layers (un)frozen: where they meet
# -----------------------------------------------------------------------------
def _layers(m: torch.nn.Module, *indices: int) -> list[torch.Tensor]:
    inner = m.module if hasattr(m, "module") else m
    return [p for i in indices for p in inner[i].parameters()]


def _two(m, lo):
    """Adam over layers 4 and 2 (in that order, two groups), SGD with momentum on layer 0."""
    adam = layeropt.Adam if lo else torch.optim.Adam
    sgd = layeropt.SGD if lo else torch.optim.SGD
    return [adam([{"params": _layers(m, 4)}, {"params": _layers(m, 2), "lr": 0.02}], lr=0.01),
            sgd(_layers(m, 0), lr=0.1, momentum=0.9)]


def _unfreeze_later(m, opts, x, step, lo, ctx):
    """Layers 2 (Adam's) and 0 (SGD's) frozen at attach, unfrozen at step 1; 2 frozen
    again at step 2 (gradual unfreezing, and a layer added to training late)."""
    for p in _layers(m, 2):
        p.requires_grad_(step == 1)
    for p in _layers(m, 0):
        p.requires_grad_(step >= 1)
    m(x).pow(2).mean().backward()
    for o in opts:
        o.step()
        o.zero_grad()


def _sgd_frozen_at_attach(m, opts, x, step, lo, ctx):
    """None of SGD's parameters trains at attach; unfrozen at step 1; clipped globally."""
    for p in _layers(m, 0):
        p.requires_grad_(step >= 1)
    _clipped_step(m, opts, m(x).pow(2).mean(), lo, ctx)


def _clip_default_order(m, opts, x, step, lo, ctx):
    """Groups in reverse depth order, two optimizers: the norm in model order by default."""
    _clipped_step(m, opts, m(x).pow(2).mean(), lo, ctx)


def _no_step_last_misses_sgd(m, opts, x, step, lo, ctx):
    """Accumulation whose last micro-batch reaches none of SGD's parameters, clipped."""
    inner = m.module if hasattr(m, "module") else m
    a, _ = x.chunk(2)
    with contextlib.ExitStack() as stack:
        if lo:
            for o in opts:
                stack.enter_context(o.no_step())
        (m(a).pow(2).mean() / 2).backward()
    h = torch.randn(2, 16, generator=torch.Generator().manual_seed(step))
    _clipped_step(m, opts, inner[1:](h).pow(2).mean() / 2, lo, ctx)


def _scaler_overflow_in_one(m, opts, x, step, lo, ctx):
    """An inf in SGD's gradients at step 1: only SGD's step is skipped, as scaler.step."""
    scaler = ctx["scaler"]
    handles = [p.register_hook(lambda g: g * float("inf")) for p in _layers(m, 0)] if step == 1 else []
    loss = scaler.scale(m(x).pow(2).mean())
    if lo:
        layeropt.backward(loss, scaler=scaler)
    else:
        loss.backward()
    for h in handles:
        h.remove()
    for o in opts:
        scaler.step(o)
    scaler.update()
    ctx["norms"].append(scaler.get_scale())
    for o in opts:
        o.zero_grad()


def _head_every_other(m, x, step):
    """A backward that reaches SGD's layer 0 on even steps only."""
    inner = m.module if hasattr(m, "module") else m
    if step % 2 == 0:
        m(x).pow(2).mean().backward()
    else:
        inner[1:](torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()


def _keep_zero_head_every_other(m, opts, x, step, lo, ctx):
    """zero_grad(set_to_none=False); SGD's layer 0 is used only on even steps."""
    _head_every_other(m, x, step)
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=False)


def _module_keeps_zero_head_every_other(m, opts, x, step, lo, ctx):
    """The same, zeroed by the model's ``zero_grad(set_to_none=False)`` before backward."""
    m.zero_grad(set_to_none=False)
    _head_every_other(m, x, step)
    for o in opts:
        o.step()


# loop -> kinds it runs on (a forward that skips layers bypasses DDP's wrapper)
def _regroup_in_place(m, opts, x, step, lo, ctx):
    """Adam's param_groups edited by hand at the top of steps 1 and 2 (not through
    add_param_group): a parameter moved to the other group, then the groups reordered."""
    groups = opts[0].param_groups
    if step == 1:
        groups[1]["params"].append(groups[0]["params"].pop())
    elif step == 2:
        groups.reverse()
    m(x).pow(2).mean().backward()
    for o in opts:
        o.step()
        o.zero_grad()


MULTI: dict[str, tuple[Callable[..., None], tuple[str, ...]]] = {
    "layer unfrozen later, two optimizers": (_unfreeze_later, ("plain", "ddp")),
    "optimizer with nothing trainable at attach": (_sgd_frozen_at_attach, ("plain",)),
    "global norm over two optimizers, default order": (_clip_default_order, ("plain", "ddp")),
    "no_step; the last micro-batch misses one optimizer": (_no_step_last_misses_sgd, ("plain",)),
    "GradScaler overflow in one of two optimizers": (_scaler_overflow_in_one, ("plain", "ddp")),
    "zero_grad(set_to_none=False), a layer used every other step": (
        _keep_zero_head_every_other, ("plain",)),
    "model.zero_grad(set_to_none=False), a layer used every other step": (
        _module_keeps_zero_head_every_other, ("plain",)),
    "param_groups edited in place": (_regroup_in_place, ("plain", "ddp")),
}


@pytest.mark.parametrize("kind", ["plain", "ddp"])
@pytest.mark.parametrize("case", list(MULTI))
def test_several_optimizers(process_group, kind, case):
    loop, kinds = MULTI[case]
    if kind not in kinds:
        pytest.skip(f"{case}: its forward bypasses the {kind} wrapper")
    if kind == "ddp" and "unfrozen" in case:
        pytest.skip("DDP fixes its parameters when wrapping")
    runs = []
    for lo in (False, True):
        model = _wrap(kind, _model())
        opts = _two(model, lo)
        ctx: dict[str, Any] = {"norms": [], "scaler": torch.amp.GradScaler("cpu", init_scale=4.0)}
        handle = layeropt.attach(model, opts) if lo else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(STEPS + 1):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + step))
                loop(model, opts, x, step, lo, ctx)
        runs.append((_local(list(model.parameters())), [_local(o.state_dict()) for o in opts],
                     ctx["norms"]))
        if handle is not None:
            handle.remove()
    assert_same(runs[1][0], runs[0][0], "params")
    assert_same(runs[1][1], runs[0][1], "optimizer states")
    assert_same(runs[1][2], runs[0][2], "norms / scales")


# -----------------------------------------------------------------------------
# Optimizers that are not torch's: the general check of what a step changes
# -----------------------------------------------------------------------------
class CountingAdam(torch.optim.Optimizer):
    """Keeps its step count on the optimizer (``self.t``), as many scripts do."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})
        self.t = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.t += 1
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                p.sub_(g["lr"] * state["m"] / (1 - 0.9**self.t))


class LazyCountingAdam(CountingAdam):
    """The same, its count made by the first step (``getattr(self, "t", 0)``)."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, lr)
        del self.t

    def step(self, closure: Any = None) -> None:
        self.t = getattr(self, "t", 0)
        super().step(closure)


@pytest.mark.parametrize("base", [CountingAdam, LazyCountingAdam], ids=["t", "lazy t"])
@pytest.mark.parametrize("kind", KINDS)
def test_state_kept_on_the_optimizer_moves_once_per_step(process_group, kind, base):
    runs = []
    for cls in (base, layeropt.in_backward(base)):
        model = _wrap(kind, _model())
        opt = cls(model.parameters())
        handle = layeropt.attach(model, opt) if layeropt.is_in_backward(opt) else None
        for step in range(STEPS):
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append((opt.t, _local(list(model.parameters()))))
        handle and handle.remove()
    assert runs[1][0] == runs[0][0] == STEPS
    assert_same(runs[1][1], runs[0][1], "params")


def test_a_step_that_is_not_torchs_is_refused_when_the_class_is_made():
    class LayerByLayer(torch.optim.Optimizer):
        def step(self, param):  # the optimizer of a layer-by-layer script
            pass

    with pytest.raises(TypeError, match=r"requires 'param'.*step\(closure=None\)"):
        layeropt.in_backward(LayerByLayer)


class _WithLr(torch.optim.Optimizer):
    """A hand-written optimizer's constructor: one hyperparameter, ``lr``."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})


class DecayEveryParameter(_WithLr):
    """Weight decay applied before the ``p.grad is None`` check: a step changes parameters
    without a gradient, so one call per layer would decay every layer once per layer."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.mul_(1 - 0.1 * g["lr"])
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


@pytest.mark.parametrize("cap", [0.0, 64.0], ids=["a bucket per layer", "one bucket"])
@pytest.mark.parametrize("groups", [1, 2])
def test_a_step_that_changes_parameters_without_a_gradient_is_refused(groups, cap):
    """Silent before (every parameter decayed once per step call), and verify blamed code
    between backward and step(): now the first probed call, one parameter, is refused."""
    m = _model()
    params = list(m.parameters())
    opt = layeropt.in_backward(DecayEveryParameter)(
        params if groups == 1 else [{"params": params[:2]}, {"params": params[2:]}])
    layeropt.attach(m, opt, bucket_cap_mb=cap)
    with pytest.raises(layeropt.BackwardStateError, match=r"DecayEveryParameter.step\(\) "
                       r"changed a parameter that had no gradient.*skip parameters without"):
        m(torch.randn(4, 6)).pow(2).mean().backward()


class NoisySGD(_WithLr):
    """Gradient noise drawn in step(): in backward, drawn in another order."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad + 0.01 * torch.randn_like(p), alpha=-g["lr"])


class SGDWithAverage(_WithLr):
    """An average of every weight kept in the state, gradient or not (SWA/EMA kept by
    the optimizer): one call per layer would average partly updated weights."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])
            for p in g["params"]:
                avg = self.state[p].setdefault("avg", p.detach().clone())
                avg.lerp_(p, 0.5)


class CountsInADict(CountingAdam):
    """The step count in a dict on the optimizer (and in ``state["step"]``)."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, lr)
        del self.t
        self.counters = {"t": 0}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.counters["t"] += 1
        self.state["step"] = self.state.get("step", 0) + 1
        self.t = self.counters["t"]
        super().step(closure)
        self.t = self.counters["t"]


# optimizer class -> the error its in-backward training raises (None: exact)
KEEPS_MORE = {
    NoisySGD: r"NoisySGD.step\(\) draws random numbers",
    SGDWithAverage: r"changed a parameter that had no gradient in the call, or its state",
    CountsInADict: None,
}


@pytest.mark.parametrize("cls", list(KEEPS_MORE), ids=[c.__name__ for c in KEEPS_MORE])
def test_optimizers_keeping_more_than_per_parameter_state(cls):
    """Each was silently different; now exact, or refused at its first probed call."""
    runs = []
    for lo in (False, True):
        m = _model()
        opt = (layeropt.in_backward(cls) if lo else cls)(m.parameters())
        if lo:
            layeropt.attach(m, opt)
        torch.manual_seed(1)
        for step in range(3):
            loss = m(torch.randn(4, 6, generator=torch.Generator().manual_seed(step)))
            if lo and KEEPS_MORE[cls] is not None:
                with pytest.raises(layeropt.BackwardStateError, match=KEEPS_MORE[cls]):
                    loss.pow(2).mean().backward()
                return
            loss.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append((list(m.parameters()), opt))
    assert_same(runs[1][0], runs[0][0], "params")
    assert runs[1][1].counters == runs[0][1].counters
    assert runs[1][1].state["step"] == runs[0][1].state["step"]


def test_a_wrapper_with_its_own_step_around_a_layeropt_optimizer_is_refused():
    """Lookahead(layeropt.AdamW(...)): attach found the inner optimizer and the wrapper's
    own step() found no gradients to sync (silently; verify passed too)."""
    class Lookahead(torch.optim.Optimizer):
        def __init__(self, optimizer: Any) -> None:
            super().__init__(optimizer.param_groups, {})
            self.optimizer = optimizer

        def step(self, closure: Any = None) -> Any:
            return self.optimizer.step(closure)

    m = _model()
    with pytest.raises(layeropt.AttachError, match="Lookahead wraps a layeropt optimizer"):
        layeropt.attach(m, Lookahead(layeropt.AdamW(m.parameters())))


class _Lookahead(torch.optim.Optimizer):
    """timm's Lookahead in short: the base optimizer's step, then every ``k``-th step the
    weights move halfway back to their slow copies (in the shared per-parameter state)."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 2) -> None:
        self.base, self.k, self.defaults = base, k, base.defaults
        self.param_groups, self.state = base.param_groups, base.state
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.base.step()
        for p in (p for g in self.param_groups for p in g["params"] if p.grad is not None):
            state = self.state[p]
            slow = state.setdefault("slow", p.detach().clone())
            state["lookahead_step"] = state.get("lookahead_step", 0) + 1
            if state["lookahead_step"] % self.k == 0:
                slow.add_(p - slow, alpha=0.5)
                p.copy_(slow)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none)


def test_in_backward_wrapper_around_a_torch_optimizer_is_exact():
    """in_backward(Lookahead)(torch.optim.AdamW(...)): the wrapper's step calls its base's
    step on the stepped bucket; the check for a second optimizer skipping freed parameters
    took that call for one and refused every bucket after the first."""
    runs = []
    for lo in (False, True):
        m = _model()
        opt = (layeropt.in_backward(_Lookahead) if lo else _Lookahead)(
            torch.optim.AdamW(m.parameters(), lr=0.1))
        if lo:
            layeropt.attach(m, opt)
        torch.manual_seed(1)
        for _ in range(5):
            m(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append((list(m.parameters()), opt.base.state_dict()))
    assert_same(runs[1], runs[0])


def test_in_backward_class_answers_as_the_class_it_wraps():
    """Tools special-case optimizers by ``str(cls)`` (the HF Trainer looks for
    "bitsandbytes" to give embeddings 32-bit state); isinstance still holds."""
    for base in (torch.optim.NAdam, torch.optim.AdamW, CountingAdam):
        cls = layeropt.in_backward(base)
        assert str(cls) == str(base) and cls.__name__ == base.__name__
        assert issubclass(cls, base) and layeropt.is_in_backward(cls([torch.zeros(1, requires_grad=True)]))


# -----------------------------------------------------------------------------
# Held gradients meeting nested backwards and per-bucket clipping
# -----------------------------------------------------------------------------
class _Reentrant(torch.nn.Module):
    """Blocks under torch's reentrant checkpoint (Hugging Face's default), no parameter
    outside them: the first gradients land in a segment's nested backward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(lambda t, b=block: torch.tanh(b(t)), x,
                                                  use_reentrant=True)
        return x


def test_grad_scaler_recipe_over_torch_reentrant_checkpoint():
    """The hold is decided in the outer backward, not in a segment's nested one."""
    runs = []
    for lo in (False, True):
        torch.manual_seed(0)
        model = _Reentrant()
        opt = (layeropt.AdamW if lo else torch.optim.AdamW)(model.parameters(), lr=0.01)
        handle = layeropt.attach(model, opt) if lo else None
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (holding: nothing saved in these steps)
            for step in range(STEPS):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                x.requires_grad_()  # (reentrant segments need an input that requires grad)
                _scaler_recipe(model, opt, x, lo, {"scaler": scaler})
        runs.append((list(model.parameters()), opt.state_dict()))
        handle and handle.remove()
    assert_same(_local(runs[1][0]), _local(runs[0][0]), "params")
    assert_same(runs[1][1], runs[0][1], "state")


@pytest.mark.parametrize("how", ["no_step then step()", "step(closure)", "unfrozen late"])
def test_bucket_max_norm_clips_each_layer_also_in_step(how):
    """attach(bucket_max_norm=) is per layer bucket wherever the update runs (also the end
    of the backward that picks up layers unfrozen since attach)."""
    runs = []
    for lo in (False, True):
        model = _model()
        model[2].requires_grad_(how != "unfrozen late")
        model[4].requires_grad_(how != "unfrozen late")
        opt = (layeropt.SGD if lo else torch.optim.SGD)(model.parameters(), lr=0.1)
        handle = layeropt.attach(model, opt, bucket_max_norm=0.01) if lo else None
        for step in range(STEPS):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))

            def closure() -> torch.Tensor:
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            if how == "unfrozen late" and step == 1:
                model[2].requires_grad_(True)
                model[4].requires_grad_(True)
            if lo and how == "unfrozen late":
                closure()
                opt.step()
            elif lo and how == "step(closure)":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # (held for the closure's caller)
                    opt.step(closure)
            elif lo:
                with opt.no_step():
                    closure()
                opt.step()
            else:
                closure()
                for layer in (model[0], model[2], model[4]):  # torch: per layer, then step
                    torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.01)
                opt.step()
            opt.zero_grad()
        runs.append(list(model.parameters()))
        handle and handle.remove()
    assert_same(runs[1], runs[0], "params")


@pytest.mark.parametrize("unscaled", [False, True])
def test_clip_value_with_a_scaled_fused_step_is_refused_or_exact(unscaled):
    """GradScaler.step gives a fused optimizer its gradients still scaled: attach's
    clip_value would clip them at the wrong scale. Refused, nothing applied; exact once
    the loop unscales first (torch: unscale_, clip_grad_value_, step)."""
    runs = []
    for lo in (False, True):
        model = _model()
        opt = (layeropt.AdamW if lo else torch.optim.AdamW)(model.parameters(), lr=0.01,
                                                            fused=True)
        handle = layeropt.attach(model, opt, clip_value=0.01) if lo else None
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (held for the scaler: said)
            scaler.scale(model(torch.ones(2, 6)).pow(2).mean()).backward()
        if unscaled or not lo:
            scaler.unscale_(opt)
        if not lo:
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        if lo and not unscaled:
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(layeropt.BackwardStateError, match=r"scaler.unscale_\(opt\)"):
                scaler.step(opt)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            handle.remove()
            return
        scaler.step(opt)
        scaler.update()
        runs.append(list(model.parameters()))
        handle and handle.remove()
    assert_same(runs[1], runs[0], "params")
