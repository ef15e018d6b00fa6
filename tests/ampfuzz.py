"""Random AMP loops - GradScaler, clipping, LoopAccumulator - with torch.optim and with
layeropt attached, compared bit for bit after every iteration.

The companion of tests/loopfuzz.py (whose network, optimizer draw, attach-clip emulation,
comparison and statuses it reuses), for what that one leaves out: each program, drawn
from ``random.Random(seed)``, is 2-5 iterations on tied or untied layers, fp32, bf16 or
mixed bf16/fp32 parameters, a ``GradScaler`` with a random scale (powers of two and
not: 1000, 0.7, 12345.678) and growth interval, attach options (none, ``clip_value``,
``bucket_max_norm``), each iteration one of:

* ``amp``: ``layeropt.backward(scaler.scale(loss), scaler=, max_norm=, norm_type=)``
  against ``scale(loss).backward(); [unscale_; clip_grad_norm_]; step; update``
  (docs/clipping-and-amp.md: ``unscale_`` only when clipping);
* ``ampacc``: the same after 1-2 micro-batches in ``no_step()``;
* ``amphold``: torch's own recipe on both sides (layeropt holds the gradients);
* ``clip``: ``layeropt.backward(loss, max_norm=, norm_type=, error_if_nonfinite=)``
  against ``clip_grad_norm_``, no scaler;
* ``resume`` (its own mix, between the others): model, optimizer and ``GradScaler``
  saved and loaded into new ones, the old dropped without ``remove()``;
* ``loop``: ``LoopAccumulator(n, reduction=, max_norm=, scaler=)``, its ``step()`` or
  ``with`` form, micro-batches of loops in an outer ``no_step()``, a layer only the
  first iteration reaches, against docs/loops.md's hand-written torch loop;

(the ``offload`` mix: ``all``'s bodies with the optimizer state offloaded in a mode drawn
per program, every copy on simulated CUDA streams, tests/offloadfuzz.py's; ``race`` a
failure too; ``verify``: ``all``'s attached with ``verify=`` over every step - a quarter
of them the first 1-3, then in backward - where a ``VerifyError`` is a false alarm) with injected inf/NaN (the loss, or one input element: NaN in some layers only),
bf16/fp16 autocast, ``zero_grad`` keeping zeros or not. Compared: parameters,
``opt.state_dict()``, ``scaler.state_dict()`` (NaN equal to NaN), the returned norm
against ``clip_grad_norm_``'s, and ``opt.last_grad_norm is`` that norm. Statuses:

* ``exact``; ``refused`` (a ``LayeroptError``); ``torch-error`` (torch raised, or
  reached a limit of its own: ``loopfuzz.TORCH_LIMIT``, or its fused SGD with momentum
  read uninitialised momentum buffers made on a step the scaler skipped);
* ``loopfuzz.FAILURES``: ``diff``, ``crash``, ``torch-error-only``.

Fused SGD with momentum gets fp32 parameters only: on bf16 ones torch's own kernel
leaves garbage in the momentum buffers, with or without a scaler.

``tests/test_ampfuzz.py`` runs about a thousand in CI. By hand (from the tests/ folder)::

    python ampfuzz.py --mix all --start 0 --n 3000
    python ampfuzz.py --mix loop --replay 36
    python ampfuzz.py --mix loop --minimize 36
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

import layeropt
from layeropt.loop import LoopAccumulator

import loopfuzz
import offloadfuzz
from loopfuzz import TORCH_LIMIT, _diff, cli, detach
from streamsim import offload_in_mode

BODIES = {
    "all": ["amp", "amp", "ampacc", "amphold", "clip", "loop", "loop"],
    "amp": ["amp", "ampacc"],
    "hold": ["amphold"],
    "clip": ["clip"],
    "loop": ["loop"],
    # all's bodies (and resume) with the optimizer state offloaded (a mode drawn per
    # program, tests/offloadfuzz.py's), every copy on simulated CUDA streams
    "offload": ["amp", "amp", "ampacc", "amphold", "clip", "loop", "loop", "resume"],
    # all's (and resume) attached with verify= over every step: exact, or a false alarm
    "verify": ["amp", "amp", "ampacc", "amphold", "clip", "loop", "loop", "resume"],
    # and resumed: model, optimizer and GradScaler saved, loaded into new ones
    "resume": ["amp", "ampacc", "amphold", "loop", "resume", "resume"],
}
MIXES = list(BODIES)
SCALES = [65536.0, 1024.0, 1000.0, 3.0, 0.7, 0.125, 12345.678, 2.0**20]
ATTACH = [{}, {}, {}, {"bucket_cap_mb": 0}, {"clip_value": 0.05},
          {"bucket_max_norm": 0.1, "bucket_cap_mb": 0},
          {"clip_value": 0.05, "bucket_max_norm": 0.1, "bucket_cap_mb": 0}]
FUSABLE = ("SGD", "Adam", "AdamW", "Adagrad")
INJECT = [None, None, None, "lossinf", "lossnan", "xinf", "xnan"]
Iteration = dict[str, Any]


class Net(loopfuzz.Net):
    """loopfuzz's network with each layer fed in its own dtype (bf16 or mixed-dtype
    parameters); its ``extra`` head is never used (owned by the optimizer, never reached)."""

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        h = x
        for layer in (self.l1, self.l2, self.l3):
            h = torch.tanh(layer(h.to(layer.weight.dtype)))
        out = self.head(h.to(self.head.weight.dtype)).float()
        if branch:
            out = out + self.branch(h.to(self.branch.weight.dtype)).float()
        return out


# -- drawing a program ----------------------------------------------------------------
def draw_optimizer(r: random.Random) -> tuple[str, dict[str, Any]]:
    """loopfuzz's optimizer, fused more often: fused kernels unscale on their own and
    step even when the scaler skips."""
    kind, kw = loopfuzz.draw_optimizer(r)
    if kind in FUSABLE and r.random() < 0.3:
        kw.pop("foreach", None)
        kw["fused"] = True
    return kind, kw


def draw_iteration(r: random.Random, body: str) -> Iteration:
    """One iteration of ``body`` (the module's docstring) with its data, injection,
    autocast, clipping and ``zero_grad`` drawn."""
    a = {"body": body, "seed": r.randrange(10**6), "branch": r.random() < 0.3,
         "max_norm": r.choice([None, None, 0.01, 1.0, 1e9, math.inf]),
         "norm_type": r.choice([2.0, 2.0, 2.0, 1.0, math.inf]), "inject": r.choice(INJECT),
         "autocast": r.choice([None, None, None, None, "bf16", "fp16"]),
         "stn": r.random() < 0.7}
    if body == "clip":
        a.update(max_norm=r.choice([0.01, 1.0, 1e9, math.inf]), einf=r.random() < 0.3)
    elif body == "ampacc":
        a["k"] = r.randint(1, 2)
        a["inj_at"] = r.randint(0, a["k"])
    elif body == "loop":
        a.update(n=r.randint(1, 5), m=r.choice([1, 1, 2]), reduction=r.choice(["mean", "sum"]),
                 scaler=r.random() < 0.6, form=r.choice(["step", "with"]),
                 early_branch=r.random() < 0.3)
        a["inj_at"] = r.randrange(a["n"] * a["m"])
        if not a["scaler"] and r.random() < 0.7:
            a["inject"] = None  # (an unscaled inf/NaN ruins both runs: draw fewer)
    return a


def draw_program(seed: int, mix: str) -> dict[str, Any]:
    """2-5 iterations of the mix's bodies and the setup they share: optimizer, attach
    options, parameter dtypes, scaler."""
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r}: one of {MIXES}")
    r = random.Random(seed)
    kind, okw = draw_optimizer(r)
    akw = r.choice(ATTACH)
    iters = [draw_iteration(r, r.choice(BODIES[mix])) for _ in range(r.randint(2, 5))]
    dtype = r.choice(["fp32"] * 4 + ["bf16", "mixed"])
    if kind == "SGD" and okw.get("fused") and okw.get("momentum"):
        dtype = "fp32"  # torch's own: on bf16 its fused SGD leaves garbage in momentum buffers
    mode = offloadfuzz.draw_mode(random.Random(seed + 10**7)) if mix == "offload" else None
    v = random.Random(seed + 7 * 10**6)  # (a quarter verify 1-3 steps, then in backward)
    steps = v.randint(1, 3) if mix == "verify" and v.random() < 0.25 else None
    return {"seed": seed, "mix": mix, "tied": r.random() < 0.5, "opt": kind, "okw": okw,
            "akw": akw, "dtype": dtype, "init_scale": r.choice(SCALES),
            "growth_interval": r.choice([1, 1, 2]), "iters": iters, "mode": mode,
            "verify": mix == "verify", **({"verify_steps": steps} if steps else {})}


# -- running it -----------------------------------------------------------------------
class Side:
    """One side of the comparison, torch's or layeropt's: model, optimizer, scaler; the
    torch side also notes what the status ``torch-error`` (uninitialised state) depends
    on."""

    # torch's equivalent of attach(clip_value=, bucket_max_norm=), loopfuzz's
    _owned = loopfuzz.Side._owned
    _attach_clips = loopfuzz.Side._attach_clips

    def __init__(self, prog: dict[str, Any], layer: bool, init: dict[str, torch.Tensor]) -> None:
        self.prog = prog
        self.model = m = Net(prog["tied"])
        m.load_state_dict(init)
        if prog["dtype"] == "bf16":
            m.to(torch.bfloat16)
        elif prog["dtype"] == "mixed":
            m.l2.to(torch.bfloat16)
            m.head.to(torch.bfloat16)
        self.layer = layer
        self.net, self.model = m, loopfuzz.wrap(m, loopfuzz.wrap_of(prog))
        cls = getattr(torch.optim, prog["opt"])
        if layer:
            cls = getattr(layeropt, prog["opt"], None) or layeropt.in_backward(cls)
        params = list(m.parameters())
        self.opt = cls([{"params": params[:2]}, {"params": params[2:]}],
                       **loopfuzz.wrapped_kwargs(prog["okw"], prog))
        self.params = [p for g in self.opt.param_groups for p in g["params"]]  # state_dict keys
        self.akw = prog["akw"]
        verify = {"verify": prog.get("verify_steps", 1000)} if prog.get("verify") else {}
        self.handle = (layeropt.attach(self.model, self.opt, **self.akw, **verify) if layer
                       else None)
        mode = prog.get("mode")
        self.offload = offload_in_mode(self.opt, mode) if layer and mode else None
        self.scaler = torch.amp.GradScaler("cpu", init_scale=prog["init_scale"],
                                           growth_interval=prog["growth_interval"])
        self.fused = prog["opt"] if prog["okw"].get("fused") else None
        self.uninitialised = False  # torch's fused SGD made momentum buffers on a skip

    def loss(self, a: Iteration, inject: str | None, salt: int = 0,
             branch: bool | None = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(loopfuzz.batch_seed(a["seed"] * 31 + salt, self.prog))
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
        if inject in ("xinf", "xnan"):
            x[0, 1] = math.inf if inject == "xinf" else math.nan
        branch = a["branch"] if branch is None else branch
        if a["autocast"]:
            dtype = torch.float16 if a["autocast"] == "fp16" else torch.bfloat16
            with torch.autocast("cpu", dtype=dtype):
                out = self.model(x, branch).float()
        else:
            out = self.model(x, branch)
        loss = ((out - y) ** 2).mean()
        return loss * {"lossinf": math.inf, "lossnan": math.nan}.get(inject, 1.0)

    def run(self, a: Iteration) -> Any:
        """One iteration; returns its norm (None, a tensor, or ``"raised"`` where
        ``error_if_nonfinite`` raised, the loop catching it and zeroing)."""
        return getattr(self, "_" + a["body"])(a)

    # the end of torch's recipe -----------------------------------------------------
    def _finish(self, a: Iteration, scaled: bool, set_to_none: bool) -> torch.Tensor | None:
        """``[scaler.unscale_]; [clip_grad_norm_]; [attach clips]; step; [update];
        zero_grad``: ``unscale_`` only to clip (docs/clipping-and-amp.md)."""
        max_norm, norm = a["max_norm"], None
        clips = max_norm is not None or "clip_value" in self.akw or "bucket_max_norm" in self.akw
        if scaled and clips:
            self.scaler.unscale_(self.opt)
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm,
                                                  norm_type=a["norm_type"],
                                                  error_if_nonfinite=a.get("einf", False))
        if not self.layer:
            self._attach_clips()
        if scaled:
            self._scaler_step()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=set_to_none)
        return norm

    def _scaler_step(self) -> None:
        """``scaler.step; scaler.update``, noting momentum a skipped fused SGD step made."""
        before, scale = set(self.opt.state), self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        made = {i for i, p in enumerate(self.params) if p in self.opt.state and p not in before}
        if made and self.scaler.get_scale() < scale and self.fused == "SGD":  # (skipped)
            self.uninitialised = True

    # the bodies -----------------------------------------------------------------------
    def _resume(self, a: Iteration) -> None:
        """A checkpoint - model, optimizer, GradScaler - loaded into new ones (attached,
        offloaded as before), the old dropped without ``remove()``, as a resumed run."""
        ck = copy.deepcopy({"model": self.net.state_dict(), "opt": self.opt.state_dict(),
                            "scaler": self.scaler.state_dict()})
        new = Side(self.prog, self.layer, loopfuzz.full(ck["model"]))
        new.opt.load_state_dict(ck["opt"])
        new.scaler.load_state_dict(ck["scaler"])
        new.uninitialised = self.uninitialised
        self.__dict__.update(new.__dict__)

    def _amp(self, a: Iteration) -> torch.Tensor | None:
        return self._scaled_step(a, self.loss(a, a["inject"]))

    def _ampacc(self, a: Iteration) -> torch.Tensor | None:
        for j in range(a["k"]):
            loss = self.loss(a, a["inject"] if a["inj_at"] == j else None, salt=j + 1)
            with self.opt.no_step() if self.layer else contextlib.nullcontext():
                self.scaler.scale(loss).backward()
        return self._scaled_step(a, self.loss(a, a["inject"] if a["inj_at"] == a["k"] else None))

    def _scaled_step(self, a: Iteration, loss: torch.Tensor) -> torch.Tensor | None:
        if not self.layer:
            self.scaler.scale(loss).backward()
            return self._finish(a, scaled=True, set_to_none=a["stn"])
        norm = layeropt.backward(self.scaler.scale(loss), scaler=self.scaler,
                                 max_norm=a["max_norm"], norm_type=a["norm_type"])
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=a["stn"])
        return norm

    def _amphold(self, a: Iteration) -> torch.Tensor | None:
        self.scaler.scale(self.loss(a, a["inject"])).backward()
        return self._finish(a, scaled=True, set_to_none=a["stn"])

    def _clip(self, a: Iteration) -> torch.Tensor | str | None:
        loss = self.loss(a, a["inject"])
        try:
            if not self.layer:
                loss.backward()
                return self._finish(a, scaled=False, set_to_none=a["stn"])
            norm = layeropt.backward(loss, max_norm=a["max_norm"], norm_type=a["norm_type"],
                                     error_if_nonfinite=a["einf"])
        except RuntimeError as e:  # error_if_nonfinite: torch's own error, on both sides
            if not (a["einf"] and "non-finite" in str(e)):
                raise
            self.opt.zero_grad()
            return "raised"
        self.opt.step()
        self.opt.zero_grad(set_to_none=a["stn"])
        return norm

    def _loop(self, a: Iteration) -> torch.Tensor | None:
        scaler = self.scaler if a["scaler"] else None
        if not self.layer:  # docs/loops.md's loop: acc.step() zeroes with set_to_none=True
            def backward(loss: torch.Tensor) -> None:
                loss = loss / a["n"] if a["reduction"] == "mean" else loss
                (loss if scaler is None else scaler.scale(loss)).backward()

            for mb in range(a["m"]):
                self._loop_losses(a, mb, backward)
            return self._finish(a, scaled=scaler is not None,
                                set_to_none=a["stn"] if a["form"] == "with" else True)
        for mb in range(a["m"]):  # the micro-batches before the last in an outer no_step()
            last = mb == a["m"] - 1
            with contextlib.nullcontext() if last else self.opt.no_step():
                norm = self._accumulator(a, mb, scaler, last)
        if a["form"] == "with":
            if scaler is None:
                self.opt.step()
            else:
                scaler.step(self.opt)
                scaler.update()
            self.opt.zero_grad(set_to_none=a["stn"])
        return norm

    def _accumulator(self, a: Iteration, mb: int, scaler: torch.amp.GradScaler | None,
                     last: bool) -> torch.Tensor | None:
        """Micro-batch ``mb`` through a ``LoopAccumulator``: its ``with`` form, or its
        ``step()`` (``reset()`` before the last); returns ``acc.grad_norm``."""
        acc = LoopAccumulator(a["n"], self.opt if a["form"] == "step" else None,
                              reduction=a["reduction"], max_norm=a["max_norm"],
                              norm_type=a["norm_type"], scaler=scaler)
        if a["form"] == "with":
            with acc:
                self._loop_losses(a, mb, acc.backward)
            return acc.grad_norm
        self._loop_losses(a, mb, acc.backward)
        if last:
            acc.step()
        else:
            acc.reset()
        return acc.grad_norm

    def _loop_losses(self, a: Iteration, mb: int,
                     backward: Callable[[torch.Tensor], None]) -> None:
        """Micro-batch ``mb``'s n iterations, each loss to ``backward``."""
        for i in range(a["n"]):
            at = mb * a["n"] + i
            backward(self.loss(a, a["inject"] if a["inj_at"] == at else None, salt=at,
                               branch=i == 0 if a["early_branch"] else None))

    def snapshot(self) -> dict[str, Any]:
        """Parameters, optimizer and scaler state (views: compare before the next step)."""
        return {"param": {n: loopfuzz.full(p.detach()) for n, p in self.net.named_parameters()},
                "state_dict": loopfuzz.full(self.opt.state_dict()),
                "scaler": self.scaler.state_dict()}


def _nan_marked(x: Any) -> Any:
    """``x`` with each floating tensor as (NaN mask, NaN set to 0): NaN compares equal
    to NaN under ``loopfuzz._diff`` (an injected NaN ruins both runs alike)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.isnan(), x.nan_to_num(0.0, math.inf, -math.inf)
    if isinstance(x, dict):
        return {k: _nan_marked(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_marked(v) for v in x]
    return x


def _differences(t: Side, lo: Side) -> list[str]:
    """What differs: parameters, state (a skipped fused Adam(W) step's zero state too),
    the scaler's state, NaN equal to NaN."""
    return _diff(_nan_marked(t.snapshot()), _nan_marked(lo.snapshot()))


def _norm_differences(a: Iteration, tn: Any, ln: Any, lo: Side) -> list[str]:
    """The returned norms (NaN equal to NaN), and ``opt.last_grad_norm`` is layeropt's."""
    found = _diff(_nan_marked(tn), _nan_marked(ln), "norm")
    called = a["body"] in ("amp", "ampacc", "clip") and ln != "raised"  # layeropt.backward
    if called and lo.opt.last_grad_norm is not ln:
        found.append("opt.last_grad_norm is not the norm layeropt.backward returned")
    return found


def _both(t: Side, lo: Side, a: Iteration) -> tuple[list[Any], list[Exception | None]]:
    """Iteration ``a`` on torch's side, then layeropt's: the norms and the exceptions."""
    results: list[Any] = []
    errors: list[Exception | None] = []
    for side in (t, lo):
        try:
            results.append(side.run(a))
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - classified by the caller
            results.append(None)
            errors.append(e)
    return results, errors


def _error_status(terr: Exception | None, lerr: Exception | None) -> dict[str, Any] | None:
    """An iteration's outcome from the sides' exceptions (loopfuzz's classification)."""
    if terr is not None:
        status = ("torch-error" if lerr is not None or TORCH_LIMIT in str(terr)
                  else "torch-error-only")
        return {"status": status, "error": repr(terr)[:200]}
    if lerr is None:
        return None
    if TORCH_LIMIT in str(lerr):
        return {"status": "torch-error", "error": repr(lerr)[:200]}
    if isinstance(lerr, layeropt.VerifyError):  # (these loops are exact: a false alarm)
        return {"status": "verify-false-alarm", "error": f"{lerr}"[:300]}
    if isinstance(lerr, layeropt.LayeroptError):
        return {"status": "refused", "error": f"{type(lerr).__name__}: {lerr}"[:300]}
    return {"status": "crash", "error": f"{type(lerr).__name__}: {lerr}"[:300],
            "traceback": traceback.format_exception(lerr)[-4:]}


def run_program(prog: dict[str, Any]) -> dict[str, Any]:
    """Both sides iteration by iteration, compared after each; the outcome is one of the
    statuses of the module's docstring (offloaded: ``race`` too, offloadfuzz's)."""
    if not prog.get("mode"):
        return _run(prog)
    return offloadfuzz.simulated(_run, prog)


def _run(prog: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(prog["seed"])
    init = Net(prog["tied"]).state_dict()
    out: dict[str, Any] = {"seed": prog["seed"], "mix": prog["mix"], "status": "exact"}
    t = Side(prog, False, init)
    try:
        lo = Side(prog, True, init)
    except layeropt.LayeroptError as e:
        return loopfuzz.refused_at_attach(out, e)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, a in enumerate(prog["iters"]):
                (tn, ln), (terr, lerr) = _both(t, lo, a)
                ended = _error_status(terr, lerr)
                if ended is not None and ended["status"] == "verify-false-alarm" and \
                        t.uninitialised:  # (verify compared them: torch's own garbage)
                    ended = {"status": "torch-error", "error": ended["error"]}
                if ended is not None:
                    return {**out, **ended, "at": i, "body": a["body"]}
                if t.uninitialised:
                    return {**out, "status": "torch-error", "at": i,
                            "error": "torch's fused SGD made uninitialised momentum buffers "
                                     "on a step the scaler skipped"}
                found = _differences(t, lo)
                found += _norm_differences(a, tn, ln, lo)
                if found:
                    return {**out, "status": "diff", "at": i, "body": a["body"],
                            "differences": found[:6]}
            return out
    finally:
        if lo.offload is not None:
            lo.offload.remove()
        detach(lo.handle)


def run_block(mix: str, start: int, n: int, wrap: str | None = None) -> list[dict[str, Any]]:
    """``wrap``: DDP or FSDP2 (not the ``offload`` mix under FSDP2: its shards are refused)."""
    return loopfuzz.programs(run_program, draw_program, mix, start, n, wrap)


# -- by hand: more programs, one program, a smaller program -----------------------------
SIMPLER = {"inject": None, "autocast": None, "branch": False, "stn": True, "max_norm": None,
           "norm_type": 2.0, "einf": False, "early_branch": False, "m": 1, "k": 1, "n": 1,
           "inj_at": 0}


def minimize(prog: dict[str, Any], status: str) -> dict[str, Any]:
    """The shortest, simplest program still ending in ``status``: drop iterations, then
    simplify each iteration's arguments (``SIMPLER``), then the setup."""
    still = loopfuzz.ends_in(run_program, status)

    i = 0
    while i < len(prog["iters"]) and len(prog["iters"]) > 1:
        cand = {**prog, "iters": prog["iters"][:i] + prog["iters"][i + 1:]}
        if still(cand):
            prog = cand
        else:
            i += 1
    for i, a in enumerate(prog["iters"]):
        for k, v in SIMPLER.items():
            if k in a and a[k] != v:
                cand = copy.deepcopy(prog)
                cand["iters"][i][k] = v
                if still(cand):
                    prog = cand
    setup = [("tied", False), ("akw", {}), ("dtype", "fp32"), ("init_scale", 65536.0),
             ("growth_interval", 1)]
    setup += [("okw", {k: v for k, v in prog["okw"].items() if k != key})
              for key in prog["okw"] if key != "lr"]
    for k, v in setup:
        cand = {**prog, k: v}
        if prog[k] != v and still(cand):
            prog = cand
    return prog


if __name__ == "__main__":
    cli(__doc__, MIXES, draw_program, run_program, minimize, "iters")
