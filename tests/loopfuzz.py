"""Random training loops, run with torch.optim and with layeropt attached, compared bit for bit.

Each program is drawn from ``random.Random(seed)`` (the seed alone reproduces it): an
optimizer with random options (torch.optim's but LBFGS and SparseAdam - Muon over
the 2D weights alone - now and then with a learning rate given as a tensor, or its
second param group with options of its own, fused or foreach where the first is not; the
``thirdparty`` mix: schedule-free's and bitsandbytes', ``THIRD_PARTY``, through
``layeropt.in_backward``), attach options, and a sequence of what loops do -
forward and backward (plain, keeping the graph, a second backward), ``no_step()``
micro-batches, ``layeropt.backward(max_norm=)`` against ``clip_grad_norm_``,
``step()``, ``zero_grad()`` of the optimizer or the model (either ``set_to_none``),
freezing layers, hyperparameters set by hand, schedulers (``OneCycleLR`` and
``CyclicLR`` move momentum or Adam's beta1 too), ``load_state_dict``,
``add_param_group``, ``remove()`` and a new ``attach`` (the ``average`` mix: an EMA of
the model, ``AveragedModel.update_parameters``, anywhere among them; the ``write`` mix:
the weights written in place - clamped, decayed by hand, loaded - anywhere among them) - then shuffled,
dropped, repeated: orders no hand-written test tries. Every program ends exact
(parameters, ``state_dict()`` and the average equal torch's bit for bit), refused by a
layeropt error, or in a documented undetectable case it reaches (docs/rules.md, "What
cannot be detected": a loop that never zeroes its gradients; a module's ``zero_grad()``
or an average after a ``remove()`` before ``zero_grad()``). Anything else is a bug:

* ``diff``: the results differ without an error;
* ``crash``: layeropt raised something other than a ``LayeroptError``;
* ``torch-error-only``: torch raised, layeropt went on.

``tests/test_loopfuzz.py`` runs a few hundred in CI. By hand, to run more, replay or
shrink a failing one (from the tests/ folder)::

    python loopfuzz.py --mix all --start 0 --n 5000
    python loopfuzz.py --mix clip --replay 36
    python loopfuzz.py --mix clip --minimize 36
    LAYEROPT_FUZZ_WRAP=fsdp2 python loopfuzz.py --mix all --n 500   # (or ddp: one process)
    LAYEROPT_FUZZ_WRAP=ddp python loopfuzz.py --mix clip --n 500 --ranks 2
    LAYEROPT_FUZZ_WRAP=compile python loopfuzz.py --mix chaos --n 500   # torch.compile
    LAYEROPT_FUZZ_WRAP=tp python loopfuzz.py --mix clip --n 500 --ranks 2   # parallelize_module

``LAYEROPT_FUZZ_WRAP=compile``: both sides' models through ``torch.compile`` (backend
``aot_eager``, or ``LAYEROPT_FUZZ_BACKEND=inductor``: seconds a program), compiled
afresh each program, inside ``layeropt.two_pass_compile()`` (which
``layeropt.backward(max_norm=)`` needs): each compiled region's backward is one
autograd node, so its parameters' gradients land together at its end.

``--ranks 2`` runs the block on two processes, each rank its own batches (the other
fuzzers take it too): a gradient reduced over the ranks is then neither rank's own, as
in one process it is, and the ranks must end each program the same way.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import copy
import functools
import gc
import importlib
import json
import os
import random
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

import harness
import layeropt
from layeropt.engine.boundaries import _EARLY_DISCARD
from layeropt.optim import live_optimizers

LAYERS = ["l1", "l2", "head", "branch", "extra"]
OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "Adamax", "RAdam", "Adadelta",
              "ASGD", "Rprop"] + (["Adafactor"] if hasattr(torch.optim, "Adafactor") else [])
# third-party optimizers through layeropt.in_backward (the ``thirdparty`` mix, "all"'s
# loops), each installed one: (class path, keyword choices). torchao's are left out: they
# compile their step per shape, seconds a program (tests/test_third_party.py has them)
THIRD_PARTY = [
    ("schedulefree.AdamWScheduleFree", {"warmup_steps": [0, 2], "weight_decay": [0.0, 0.01],
                                        "foreach": [True, False], "r": [0.0, 1.0]}),
    ("schedulefree.SGDScheduleFree", {"warmup_steps": [0, 2], "momentum": [0.9, 0.5],
                                      "weight_decay": [0.0, 0.01], "foreach": [True, False]}),
    ("schedulefree.RAdamScheduleFree", {"weight_decay": [0.0, 0.01], "foreach": [True, False],
                                        "silent_sgd_phase": [True, False]}),
    ("bitsandbytes.optim.Adam", {"weight_decay": [0.0, 0.01], "amsgrad": [False]}),
    ("bitsandbytes.optim.AdamW8bit", {"weight_decay": [0.0, 0.01]}),
    ("bitsandbytes.optim.Lion", {"weight_decay": [0.0, 0.01], "betas": [(0.9, 0.99)]}),
    ("bitsandbytes.optim.RMSprop", {"momentum": [0.0, 0.9]}),
]
MIXES = ["all", "clip", "clipattach", "chaos", "resume", "thirdparty", "average", "write"]
# (race: an offloaded copy not ordered after what it depends on, tests/offloadfuzz.py)
FAILURES = ("diff", "crash", "torch-error-only", "race",
            # (LAYEROPT_VERIFY silent, wrong, or alarmed on an exact loop: tests/verifyfuzz.py)
            "verify-silent", "verify-diff", "verify-false-alarm",
            # (the ranks of a run on several processes ended differently: programs_on_ranks)
            "rank-mismatch")
Op = tuple[str, dict[str, Any]]
# where the programs' models train: the CPU, or (LAYEROPT_FUZZ_DEVICE=cuda, for
# benchmarks/device_check.sh) a GPU, both sides on it
DEVICE = torch.device(os.environ.get("LAYEROPT_FUZZ_DEVICE", "cpu"))
# how the programs' models are wrapped (LAYEROPT_FUZZ_WRAP, or a program's "wrap"): not
# at all, DistributedDataParallel, FSDP2's fully_shard or tensor parallelism
# (tensor_parallel), in a process group of this process alone, or torch.compile'd - both
# sides alike
WRAP = os.environ.get("LAYEROPT_FUZZ_WRAP", "plain")
WRAPS = ("plain", "ddp", "fsdp2", "compile", "tp")
DTENSOR_WRAPS = ("fsdp2", "tp")  # (their parameters DTensors: no fused kernels, NO_DTENSOR_RULE)
# torch's fused SGD raises this on a step whose parameters mix momentum buffers and none
# (a layer's first gradient after others' steps): torch's step() too, where it reaches one
TORCH_LIMIT = "expected Tensor as element"
# DDP's reducer raises this where a loop leaves it a parameter it marked used without a
# gradient (two backwards through one forward, then a frozen layer): torch's side too,
# where its gradients were set to None; layeropt frees them after each step
DDP_LIMIT = "but still allreduced by DDP reducer"


class Net(nn.Module):
    """Three tanh layers (the third tied to the second, or not) and three heads, two of
    which a forward may skip (a parameter without gradient in some backwards)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 8, bias=False)
        if tied:
            self.l3.weight = self.l2.weight
        self.head = nn.Linear(8, 3)
        self.branch = nn.Linear(8, 3)
        self.extra = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, branch: bool = False, extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x))))))
        out = self.head(h)
        if branch:
            out = out + self.branch(h)
        if extra:
            out = out + self.extra(h)
        return out


# -- drawing a program ----------------------------------------------------------------
def draw_optimizer(r: random.Random) -> tuple[str, dict[str, Any]]:
    kind = r.choice(OPTIMIZERS)
    return kind, draw_options(r, kind)


def draw_options(r: random.Random, kind: str) -> dict[str, Any]:
    """Options of a torch.optim ``kind``: its own, and its implementation (foreach, fused)."""
    kw: dict[str, Any] = {"lr": r.choice([0.1, 0.01, 0.05])}
    impl = r.choice([None, "foreach", "forloop", "fused"])
    if kind == "SGD":
        kw["momentum"] = r.choice([0.0, 0.9])
        if kw["momentum"] and r.random() < 0.5:
            kw["nesterov"] = True
        kw["weight_decay"] = r.choice([0.0, 0.01])
        if r.random() < 0.15:
            kw["maximize"] = True
    elif kind in ("Adam", "AdamW"):
        kw["amsgrad"] = r.random() < 0.4
        kw["weight_decay"] = r.choice([0.0, 0.1]) if kind == "AdamW" else r.choice([0.0, 0.0, 0.01])
        if r.random() < 0.15:
            kw["maximize"] = True
    elif kind == "Adagrad":
        kw["lr_decay"] = r.choice([0.0, 0.01])
        kw["weight_decay"] = r.choice([0.0, 0.01])
        kw["initial_accumulator_value"] = r.choice([0.0, 0.1])
    elif kind == "RMSprop":
        kw["centered"] = r.random() < 0.5
        kw["momentum"] = r.choice([0.0, 0.9])
        kw["weight_decay"] = r.choice([0.0, 0.01])
    elif kind == "Rprop":  # (no weight decay)
        kw["etas"] = r.choice([(0.5, 1.2), (0.3, 1.5)])
        kw["step_sizes"] = r.choice([(1e-6, 50.0), (1e-3, 0.02)])
    elif kind == "ASGD":  # (t0: the step from which the average moves)
        kw.update(t0=r.choice([0.0, 2.0, 1e6]), lambd=r.choice([1e-4, 0.01]),
                  weight_decay=r.choice([0.0, 0.01]))
    elif kind == "Adafactor":
        kw.update(beta2_decay=r.choice([-0.8, -0.5]), d=r.choice([1.0, 2.0]),
                  weight_decay=r.choice([0.0, 0.01]))
    else:
        kw["weight_decay"] = r.choice([0.0, 0.01])
        if kind in ("NAdam", "RAdam") and kw["weight_decay"] and r.random() < 0.5:
            kw["decoupled_weight_decay"] = True
    if kind not in ("SGD", "Adam", "AdamW") and r.random() < 0.15:
        kw["maximize"] = True
    if impl == "foreach":
        kw["foreach"] = True
    elif impl == "forloop":
        kw["foreach"] = False
    elif impl == "fused" and kind in ("SGD", "Adam", "AdamW", "Adagrad"):
        kw["fused"] = True
    return kw


def installed_third_party() -> list[tuple[str, dict[str, list[Any]]]]:
    """The :data:`THIRD_PARTY` optimizers whose package imports here."""
    found = []
    for path, choices in THIRD_PARTY:
        try:
            importlib.import_module(path.rpartition(".")[0])
        except ImportError:
            continue
        found.append((path, choices))
    return found


def draw_third_party(r: random.Random) -> tuple[str, dict[str, Any]]:
    """A third-party optimizer (a class path) and its keywords."""
    path, choices = r.choice(installed_third_party())
    lr = r.choice([1e-3, 1e-2] if "Lion" in path else [0.01, 0.05])
    return path, {"lr": lr, **{k: r.choice(v) for k, v in sorted(choices.items())}}


def optimizer_class(kind: str, layer: bool) -> type:
    """``kind``'s class: a ``torch.optim`` name or a third-party class path; on
    layeropt's side layeropt's own class or ``in_backward`` of it."""
    module, _, name = kind.rpartition(".")
    cls = getattr(importlib.import_module(module) if module else torch.optim, name)
    if not layer:
        return cls
    return (None if module else getattr(layeropt, name, None)) or layeropt.in_backward(cls)


def draw_attach(r: random.Random, mix: str) -> dict[str, Any]:
    if mix == "clipattach":
        return r.choice([{"clip_value": 0.05}, {"bucket_max_norm": 0.1},
                         {"bucket_max_norm": 0.1, "bucket_cap_mb": 0},
                         {"clip_value": 0.05, "bucket_cap_mb": 0},
                         {"clip_value": 0.05, "bucket_max_norm": 0.1}])
    return r.choice([{}, {}, {"bucket_cap_mb": 0}, {"bucket_cap_mb": 100}])


def _backward(r: random.Random, held: bool = False, mode: str | None = None) -> Op:
    return ("fb", {"seed": r.randrange(10**6), "branch": r.random() < 0.35,
                   "extra": r.random() < 0.25, "ns": held,
                   "mode": mode or r.choice(["plain"] * 5 + ["retain", "second"])})


def _setting(r: random.Random, key: str) -> Op:
    if key == "freeze":
        return ("freeze", {"layer": r.choice(LAYERS), "flag": r.random() < 0.5})
    if key == "hp":
        return ("hp", {"g": r.randrange(2), "key": r.choice(["lr", "lr", "weight_decay"]),
                       "val": r.choice([0.0, 0.02, 0.2])})
    return ("zg", {"who": r.choice(["opt", "model"]), "stn": r.random() < 0.5})


def _iteration(r: random.Random, mix: str, reattach: bool) -> list[Op]:
    """One iteration of a training loop: settings, the backward(s), step(), zero_grad()."""
    everything = mix in ("all", "resume")
    pre: list[Op] = []
    if everything and r.random() < 0.4:
        pre.append(_setting(r, "hp"))
    if everything and r.random() < 0.4:
        pre.append(_setting(r, "freeze"))
    if everything and r.random() < 0.3:
        pre.append(("apg", {"lr": r.choice([0.01, 0.1])}))
    if reattach and r.random() < 0.3:
        pre.append(("remove", {}))
        if r.random() < 0.7:
            pre.append(("attach", {}))
    if r.random() < 0.2:
        pre.append(_setting(r, "zg"))
    r.shuffle(pre)
    ops = pre
    body = r.choice(["plain", "plain", "accum", "clip", "accumclip", "none"]
                    if mix in ("all", "clip", "resume") else ["plain", "plain", "accum", "none"])
    if body == "plain":
        ops.append(_backward(r))
    elif body == "accum":
        ops += [_backward(r, held=True) for _ in range(r.randint(1, 2))] + [_backward(r)]
    elif body in ("clip", "accumclip"):
        if body == "accumclip":
            ops.append(_backward(r, held=True, mode="plain"))
        ops.append(("clip", {"seed": r.randrange(10**6), "branch": r.random() < 0.35,
                             "extra": r.random() < 0.25, "max_norm": r.choice([0.01, 0.1, 1e9]),
                             "subset": r.random() < 0.25}))
    ops.append(("step", {}))
    if everything and r.random() < 0.4:
        ops.append(("sched", {}))
    if r.random() < 0.93:
        ops.append(_setting(r, "zg"))
    if everything and r.random() < 0.3:
        ops.append(("sd", {}))
    if mix == "resume" and r.random() < 0.5:
        ops.append(("resume", {"load_first": r.random() < 0.5, "gc": r.random() < 0.25}))
    return ops


def _any_op(r: random.Random, reattach: bool) -> Op:
    k = r.choice(["freeze", "hp", "zg", "step", "sched", "sd", "apg", "remove", "attach",
                  "fbns", "fb"])
    if k in ("freeze", "hp", "zg"):
        return _setting(r, k)
    if k in ("remove", "attach") and not reattach:
        return ("step", {})
    if k in ("fbns", "fb"):
        return _backward(r, held=k == "fbns")
    return (k, {"lr": 0.05} if k == "apg" else {})


def mutate(r: random.Random, ops: list[Any], times: int, cuts: tuple[float, float],
           insert: Callable[[random.Random], Any] | None = None) -> list[Any]:
    """``times`` mutations of ``ops``, in place: two neighbours swapped (below
    ``cuts[0]``), one dropped (below ``cuts[1]``), one repeated - or, with ``insert``,
    from 0.85 on, ``insert(r)`` put anywhere."""
    for _ in range(times):
        if len(ops) < 2:
            break
        m, i = r.random(), r.randrange(len(ops) - 1)
        if m < cuts[0]:
            ops[i], ops[i + 1] = ops[i + 1], ops[i]
        elif m < cuts[1]:
            del ops[i]
        elif insert is None or m < 0.85:
            ops.insert(i, copy.deepcopy(ops[i]))
        else:
            ops.insert(r.randrange(len(ops) + 1), insert(r))
    return ops


def draw_program(seed: int, mix: str) -> dict[str, Any]:
    """A loop of 2-4 iterations, then 0-6 mutations (swap, drop, repeat, insert); ``chaos``
    draws from everything and mutates most."""
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r}: one of {MIXES}")
    r = random.Random(seed)
    kind, okw = draw_third_party(r) if mix == "thirdparty" else draw_optimizer(r)
    akw = draw_attach(r, mix)
    gen = "all" if mix in ("chaos", "thirdparty", "average", "write") else mix
    reattach = gen in ("all", "resume") and not akw
    ops: list[Op] = []
    for _ in range(r.randint(2, 4)):
        ops += _iteration(r, gen, reattach)
    times = r.randint(2, 6) if mix == "chaos" else r.choice([0, 0, 1, 1, 2, 3])
    mutate(r, ops, times, (0.4, 0.7),
           (lambda r: _any_op(r, reattach)) if mix == "chaos" else None)
    prog = {"seed": seed, "mix": mix, "tied": r.random() < 0.7, "opt": kind, "okw": okw,
            "akw": akw, "sched": r.choice(["exp", "step", "lambda"]), "ops": ops[:15]}
    # (drawn last: the draws before stay those of a program without them) torch's Muon
    # over the 2D weights alone, and a learning rate given as a tensor
    if mix in ("all", "chaos", "resume") and hasattr(torch.optim, "Muon") and r.random() < 0.1:
        prog["opt"], prog["okw"] = "Muon", draw_muon(r)
    if mix != "thirdparty" and r.random() < 0.1 and not (  # (torch refuses this one)
            prog["opt"] in ("Adam", "AdamW") and prog["okw"].get("foreach")):
        prog["tensor_lr"] = True
    if mix != "thirdparty" and r.random() < 0.25:  # (schedulers that move momentum too)
        prog["sched"] = r.choice(["onecycle", "cyclic"])
    if mix != "thirdparty" and prog["opt"] != "Muon" and r.random() < 0.2:
        prog["gkw"] = draw_group_options(r, prog)
    # on a DDP model, now and then a communication hook of the user's (harness.comm_hook:
    # torch's registers it, layeropt's attach takes it); from a generator of its own, so
    # that the programs drawn before it stay the same
    comm = random.Random(seed + 3 * 10**7).choice([None, None, "fp16", "feedback"])
    if comm:
        prog["comm"] = comm
    if mix == "average":  # "all"'s loops with an EMA of the model updated anywhere in them
        for _ in range(r.randint(1, 3)):
            prog["ops"].insert(r.randint(0, len(prog["ops"])), ("avg", {}))
    if mix == "write":  # "all"'s loops with the weights written in place anywhere in them
        for _ in range(r.randint(1, 3)):
            prog["ops"].insert(r.randint(0, len(prog["ops"])),
                               ("write", {"how": r.choice(["clamp", "decay", "load"])}))
    return prog


def draw_group_options(r: random.Random, prog: dict[str, Any]) -> dict[str, Any]:
    """The second param group's own options, drawn as the optimizer's (its implementation
    too: one group fused or foreach, the other not); torch refuses a tensor learning rate
    with Adam's foreach."""
    kw = draw_options(r, prog["opt"])
    if prog.get("tensor_lr") and prog["opt"] in ("Adam", "AdamW") and kw.get("foreach"):
        del kw["foreach"]
    return kw


def draw_muon(r: random.Random) -> dict[str, Any]:
    """torch's Muon's options (it has no foreach or fused)."""
    return {"lr": r.choice([0.01, 0.05]), "momentum": r.choice([0.95, 0.5]),
            "nesterov": r.random() < 0.6, "weight_decay": r.choice([0.0, 0.1]),
            "ns_steps": r.choice([5, 2]),
            "adjust_lr_fn": r.choice([None, "original", "match_rms_adamw"])}


def trained(prog: dict[str, Any], named: Iterable[tuple[str, nn.Parameter]]
            ) -> list[nn.Parameter]:
    """The parameters of ``named`` that ``prog``'s optimizer takes: all of them, or the
    2D weights alone for Muon (the biases train with no one, on both sides)."""
    return [p for _, p in named if prog["opt"] != "Muon" or p.ndim == 2]


# -- running it -----------------------------------------------------------------------
class Side:
    """One side of the comparison: the program's model and optimizer, torch's or layeropt's."""

    def __init__(self, prog: dict[str, Any], layer: bool, init: dict[str, torch.Tensor]) -> None:
        self.prog, self.layer, self.akw = prog, layer, prog["akw"]
        self.sched_kind = prog["sched"]
        self.sched: Any = None
        self.average: Any = None  # (the "average" mix: an EMA of the model, AveragedModel)
        self.added = False
        self.model, self.opt = self._new(init)
        self.first = copy.deepcopy(self.net.state_dict())  # (the "write" mix's load)
        self.handle = self.attach()

    def _new(self, init: dict[str, torch.Tensor]) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The program's model (from ``init``, wrapped as the program says) and a new
        optimizer for it; ``self.net``: the ``Net`` itself."""
        m = Net(self.prog["tied"])
        m.load_state_dict(init)
        m.to(DEVICE)
        self.net, model = m, wrap(m, wrap_of(self.prog))
        self.comm: dict[str, Any] = {}  # (DDP: the program's comm hook, a fresh state)
        if self.prog.get("comm") and wrap_of(self.prog) == "ddp":
            hook, state = harness.comm_hook(self.prog["comm"])
            if self.layer:
                self.comm = {"comm_hook": hook, "comm_state": state}
            else:
                model.register_comm_hook(state, hook)
        cls = optimizer_class(self.prog["opt"], self.layer)
        params = trained(self.prog, [(n, p) for n, p in m.named_parameters()
                                     if not n.startswith("extra.")])
        gkw = self.prog.get("gkw")  # (the second group's own options)
        opt = cls([{"params": params[:2]},
                   {"params": params[2:], **(wrapped_kwargs(gkw, self.prog) if gkw else {})}],
                  **wrapped_kwargs(self.prog["okw"], self.prog))
        if hasattr(opt, "train"):
            opt.train()  # (schedule-free: its training mode)
        if self.added:
            opt.add_param_group({"params": trained(self.prog, m.extra.named_parameters())})
        return model, opt

    def attach(self) -> Any:
        return layeropt.attach(self.model, self.opt, **self.akw, **self.comm) \
            if self.layer else None

    def close(self) -> None:
        """The end of the program: the attachment removed (see :func:`detach`)."""
        detach(self.handle)

    def resume(self, a: dict[str, Any]) -> None:
        """A checkpoint of the model, optimizer and scheduler saved, then loaded into new
        ones, as a resumed run does; the old ones dropped without ``remove()`` (``gc``:
        collected at once; otherwise whenever Python does)."""
        ck = copy.deepcopy({"model": self.net.state_dict(), "opt": self.opt.state_dict(),
                            "sched": self.sched and self.sched.state_dict()})
        self.model, self.opt = self._new(full(ck["model"]))
        self.handle = None
        if a["gc"] and self.layer:  # (torch's side needs none: 0.1 s a collection)
            gc.collect()
        if not a["load_first"]:
            self.handle = self.attach()
        self.opt.load_state_dict(ck["opt"])
        if a["load_first"]:
            self.handle = self.attach()
        if ck["sched"] is not None:
            self.sched = None
            self.do("sched-new", {})
            self.sched.load_state_dict(ck["sched"])

    @property
    def attached(self) -> bool:
        return self.handle is not None

    def loss(self, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(batch_seed(a["seed"], self.prog))
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
        out = self.model(x.to(DEVICE), a["branch"], a["extra"])
        y = y.to(DEVICE)
        return ((out - y) ** 2).mean(), out

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has a gradient this side keeps (in ``.grad``)."""
        return p.grad is not None

    def _owned(self) -> list[torch.Tensor]:
        ids = {id(p) for g in self.opt.param_groups for p in g["params"]}
        return [p for p in self.model.parameters() if id(p) in ids]

    def _attach_clips(self) -> None:
        """torch's equivalent of attach(clip_value=, bucket_max_norm=), before step():
        the value clip, then a norm clip per module over its own parameters."""
        value, norm = self.akw.get("clip_value"), self.akw.get("bucket_max_norm")
        if value is not None:
            ps = [p for p in self._owned() if p.grad is not None]
            if ps:
                torch.nn.utils.clip_grad_value_(ps, value)
        if norm is None:
            return
        owned, seen = {id(p) for p in self._owned()}, set()
        for _, mod in self.model.named_modules(remove_duplicate=False):
            own = []
            for p in mod.parameters(recurse=False):
                if id(p) not in seen and p.requires_grad and id(p) in owned:
                    seen.add(id(p))
                    own.append(p)
            own = [p for p in own if p.grad is not None]
            if own:
                torch.nn.utils.clip_grad_norm_(own, norm)

    def do(self, name: str, a: dict[str, Any]) -> None:
        m, opt = self.model, self.opt
        if name == "fb":
            loss, out = self.loss(a)
            with opt.no_step() if self.layer and a["ns"] else contextlib.nullcontext():
                loss.backward(retain_graph=a["mode"] != "plain")
                if a["mode"] == "second":
                    out.abs().mean().backward()
        elif name == "clip":
            loss, _ = self.loss(a)
            net = self.net

            def subset() -> list[torch.Tensor]:  # (under FSDP2, after the forward: the
                return [*net.l1.parameters(), *net.head.parameters()]  # unsharded ones)
            if self.layer:
                kw = {"parameters": subset()} if a["subset"] else {}
                layeropt.backward(loss, max_norm=a["max_norm"], **kw)
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(subset() if a["subset"] else m.parameters(),
                                               a["max_norm"])
        elif name == "step":
            if not self.layer and self.akw:
                self._attach_clips()
            opt.step()
        elif name == "zg":
            (opt if a["who"] == "opt" else m).zero_grad(set_to_none=a["stn"])
        elif name == "freeze":
            getattr(self.net, a["layer"]).requires_grad_(a["flag"])
        elif name == "hp":
            if a["g"] < len(opt.param_groups):
                opt.param_groups[a["g"]][a["key"]] = a["val"]
        elif name in ("sched", "sched-new"):
            if self.sched is None:
                S = torch.optim.lr_scheduler
                momentum = "momentum" in opt.defaults or "betas" in opt.defaults
                self.sched = {"exp": lambda: S.ExponentialLR(opt, 0.5),
                              "step": lambda: S.StepLR(opt, 1, 0.5),
                              "lambda": lambda: S.LambdaLR(opt, lambda e: 1 / (e + 1)),
                              # (momentum or Adam's beta1 cycled, where the optimizer has one)
                              "onecycle": lambda: S.OneCycleLR(
                                  opt, 0.1, total_steps=50, cycle_momentum=momentum),
                              "cyclic": lambda: S.CyclicLR(
                                  opt, 0.01, 0.1, step_size_up=2, cycle_momentum=momentum),
                              }[self.sched_kind]()
            if name == "sched":
                self.sched.step()
        elif name == "apg":
            if not self.added:
                self.added = True
                opt.add_param_group({"params": trained(self.prog, self.net.extra.named_parameters()),
                                     "lr": a["lr"]})
        elif name == "sd":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        elif name == "remove":
            if self.layer and self.attached:
                self.handle.remove()
                self.handle = None
        elif name == "attach":
            self.handle = self.attach() if self.layer else None
        elif name == "resume":
            self.resume(a)
        elif name == "avg":
            if self.average is None:
                swa = torch.optim.swa_utils
                self.average = swa.AveragedModel(self.net,
                                                 multi_avg_fn=swa.get_ema_multi_avg_fn(0.75))
            self.average.update_parameters(self.net)
        elif name == "write":  # in place, as a weight clamp, a decay by hand, a reset do
            with torch.no_grad():
                if a["how"] == "load":
                    self.net.load_state_dict(self.first)
                for p in self.net.parameters() if a["how"] != "load" else ():
                    p.clamp_(-0.3, 0.3) if a["how"] == "clamp" else p.mul_(0.95)
        else:
            raise ValueError(f"unknown op {name!r}")

    def snapshot(self) -> dict[str, Any]:
        return {"params": [full(p.detach()).clone() for p in self.model.parameters()],
                "state": full(copy.deepcopy(self.opt.state_dict())),
                "average": [full(p.detach()).clone() for p in
                            (self.average.parameters() if self.average is not None else ())]}


def wrap_of(prog: dict[str, Any]) -> str:
    """How ``prog``'s models are wrapped: its ``"wrap"``, else ``LAYEROPT_FUZZ_WRAP``."""
    return prog.get("wrap", WRAP)


# optimizers whose update has no DTensor sharding rule (torch's in-place ops that change
# placements, bitsandbytes' kernels): torch's step() raises on FSDP2's shards too
NO_DTENSOR_RULE = ("Rprop", "Adafactor", "bitsandbytes.")


def no_dtensor_rule(kinds: list[str]) -> str | None:
    """Why a program with these optimizers cannot run under FSDP2, or None."""
    bad = next((k for k in kinds if k.startswith(NO_DTENSOR_RULE)), None)
    return None if bad is None else f"{bad}: no DTensor sharding rule for its update"


def wrapped_kwargs(kw: dict[str, Any], prog: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's options for ``prog``'s wrap: under FSDP2 without ``fused`` (torch's
    fused kernels have no DTensor rule: plain kernels on both sides)."""
    kw = {k: v for k, v in kw.items() if k != "fused"} if wrap_of(prog) in DTENSOR_WRAPS else kw
    # (a program's "tensor_lr": its learning rate a tensor, each side its own)
    return {**kw, "lr": torch.tensor(kw["lr"])} if prog.get("tensor_lr") else kw


def refused_at_attach(out: dict[str, Any], e: Exception) -> dict[str, Any]:
    """The outcome of a program whose layeropt side ``attach`` refused (``bucket_max_norm=``
    on a DDP model)."""
    return {**out, "status": "refused", "error": f"{type(e).__name__}: {e}"[:300], "at": -1}


def programs(run: Callable[[dict[str, Any]], dict[str, Any]],
             draw: Callable[[int, str], dict[str, Any]], mix: str, start: int, n: int,
             wrap: str | None = None) -> list[dict[str, Any]]:
    """A fuzzer's block: programs ``start`` to ``start + n`` of ``mix`` drawn by ``draw``,
    run by ``run``; ``wrap``: their models so wrapped (``WRAPS``; default
    ``LAYEROPT_FUZZ_WRAP``, else none)."""
    how = {} if wrap is None else {"wrap": wrap}
    gc.collect()  # (an earlier test's optimizers left in a reference cycle: collected, so
    # that no layeropt.backward of the block takes them for attached ones of its own)
    try:
        return [_alone(run, {**draw(s, mix), **how}) for s in range(start, start + n)]
    finally:
        end_compiling()


def _alone(run: Callable[[dict[str, Any]], dict[str, Any]],
           prog: dict[str, Any]) -> dict[str, Any]:
    """One program's outcome; an optimizer of it left attached (kept alive by a reference
    cycle) is collected, so that no later program's ``layeropt.backward`` takes it for one
    of its own (its kept zeros changed a clipping norm's rounding: multifuzz seed 340,051
    after 340,050, whose handover was refused)."""
    out = run(prog)
    if any(o.attached for o in live_optimizers()):
        gc.collect()
    return out


def end_compiling() -> None:
    """Leave the ``two_pass_compile()`` :func:`wrap` entered, if it did (the compiler's
    settings as the next test expects them), and drop the compiled graphs."""
    while _COMPILING:
        _COMPILING.pop().__exit__(None, None, None)
        torch._dynamo.reset()


def wrap(net: nn.Module, how: str) -> nn.Module:
    """``net`` as it trains: itself, in DistributedDataParallel (``find_unused_parameters``:
    a forward may skip the branches), or sharded by FSDP2 as one unit (the tied weight
    shared in it), in a process group of this process alone (started here if none), or
    compiled (the module docstring)."""
    if how == "plain":
        return net
    if how == "compile":
        if not _COMPILING:  # (entered for the process's life: both sides, every program)
            _COMPILING.append(layeropt.two_pass_compile())
            _COMPILING[-1].__enter__()
        torch._dynamo.reset()  # (each program compiles afresh: no recompile limit reached)
        return torch.compile(net, backend=os.environ.get("LAYEROPT_FUZZ_BACKEND", "aot_eager"))
    import torch.distributed as dist

    if not dist.is_initialized():
        _GROUP.append(harness.one_process_group("gloo"))
        next(_GROUP[-1])
        atexit.register(_end_group, _GROUP[-1])  # (while torch.distributed is loaded)
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(net)
    if how == "tp":
        return tensor_parallel(net)
    raise ValueError(f"wrap={how!r}: one of {WRAPS}")


def tensor_parallel(net: nn.Module) -> nn.Module:
    """A :class:`Net` in tensor parallelism over the process group, every parameter a
    DTensor (torch's foreach kernels refuse a mix of DTensors and tensors): ``l1`` column-
    and ``l2`` row-parallel, ``l3`` and the heads column-parallel, their outputs gathered.
    Where ``l3`` is tied to ``l2``, ``l1``'s output is gathered as a DTensor and the tied
    layer replicated, still tied. Every rank sees the same batch (:func:`batch_seed`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
    plan = {name: ColwiseParallel(output_layouts=Replicate())
            for name in ("l3", "head", "branch", "extra")}
    if net.l3.weight is not net.l2.weight:
        return parallelize_module(net, mesh, {**plan, "l1": ColwiseParallel(),
                                              "l2": RowwiseParallel()})
    del plan["l3"]
    plan["l1"] = ColwiseParallel(output_layouts=Replicate(), use_local_output=False)
    for name, p in net.l2.named_parameters():
        setattr(net.l2, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    net.l3.weight = net.l2.weight
    return parallelize_module(net, mesh, plan)


_GROUP: list[Any] = []  # the process group wrap() started, kept for the process's life
_COMPILING: list[Any] = []  # layeropt.two_pass_compile(), entered by wrap()


def _end_group(group: Any) -> None:
    """At exit: the DDP / FSDP2 modules freed while the process group exists (their
    reducers' gloo work; tests/test_distributed.py does the same), then the group."""
    gc.collect()
    group.close()


def close_wrap_group() -> None:
    """Close the process group :func:`wrap` started, if open (wrap() starts another where
    one is needed next): before forking ranks, which start their own."""
    while _GROUP:
        _end_group(_GROUP.pop())
    gc.collect()


def full(x: Any) -> Any:
    """Tensors as plain ones (a DTensor of a one-process mesh: its full tensor)."""
    if isinstance(x, torch.Tensor):
        return x.full_tensor() if hasattr(x, "full_tensor") else x
    if isinstance(x, dict):
        return {k: full(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(full(v) for v in x)
    return x


def batch_seed(seed: int, prog: dict[str, Any] | None = None) -> int:
    """A batch's seed on this process: ``seed`` itself, but for the ranks after the first
    of a group of several processes (:func:`programs_on_ranks`), each its own batches, as
    under torchrun - where a gradient reduced over the ranks differs from each one's;
    under tensor parallelism (``prog``'s wrap ``tp``) every rank sees the same batch."""
    import torch.distributed as dist

    shared = prog is not None and wrap_of(prog) == "tp"
    return seed + 7919 * dist.get_rank() if dist.is_initialized() and not shared else seed


def fork_can_backward() -> bool:
    """Whether a process forked from this one can run a backward. Not after a backward
    on a CUDA build of torch that started autograd's device threads (a fake-tensor
    backward of ``layeropt plan`` does, GPU or not): the child's first backward raises
    "Unable to handle autograd's threading in combination with fork-based
    multiprocessing", and nothing in torch tells beforehand. A forked probe does."""
    if not hasattr(os, "fork"):
        return False
    pid = os.fork()
    if pid == 0:  # (the child: one tiny backward, then out without cleanup)
        try:
            torch.ones(1, requires_grad=True).sum().backward()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - any failure means no
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def start_method() -> str:
    """How to start ranks from this process: forked (torch imported once) where a fork
    can backward, else spawned (each rank imports afresh; the job must pickle)."""
    return "fork" if fork_can_backward() else "spawn"


def _rank(rank: int, job: Callable[[int], Any], world: int, out: str) -> None:
    """One rank of :func:`on_ranks`."""
    import datetime

    import torch.distributed as dist

    # Nothing of the parent's process group may be touched here: its gloo threads are
    # not copied by a fork, and whatever waits on them waits for good (seen: a DDP
    # model's reducer collected as garbage, the group destroyed). The parent closes
    # wrap()'s group and collects before forking; what is left is frozen.
    gc.freeze()
    torch.set_num_threads(1)  # the ranks share the cores, as under torchrun
    warnings.simplefilter("ignore")  # (DDP's find_unused_parameters notes, verify's)
    if dist.is_initialized():
        raise RuntimeError("on_ranks: a process group is open in the parent; "
                           "destroy it before (wrap()'s own is closed here)")
    # (a file for the rendezvous, not a port picked free beforehand: another test's
    # processes may take that port before the ranks bind it)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    result = job(rank)
    torch.save(result, f"{out}/rank{rank}.pt")
    gc.collect()  # (DDP / FSDP2 modules freed while the group exists)
    dist.barrier()
    dist.destroy_process_group()


def on_ranks(job: Callable[[int], Any], world: int = 2, timeout_s: float = 300.0) -> list[Any]:
    """``job(rank)`` in ``world`` processes forked from this one (torch imported once, as
    tests/test_distributed.py does; spawned where a fork cannot backward,
    :func:`start_method`, and then ``job`` must pickle), in one gloo process group; what
    each returned, by rank. A job that raises, or a run past ``timeout_s`` (ranks
    waiting on one another for good), raises here."""
    import tempfile
    import time

    import torch.multiprocessing as mp

    close_wrap_group()  # (see _rank)
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_rank, args=(job, world, out), nprocs=world, join=False,
                                 start_method=start_method())
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the {world} ranks did not finish in {timeout_s} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(world)]


def programs_on_ranks(run: Callable[[dict[str, Any]], dict[str, Any]],
                      draw: Callable[[int, str], dict[str, Any]], mix: str, start: int, n: int,
                      wrap: str, world: int = 2) -> list[dict[str, Any]]:
    """:func:`programs` on ``world`` processes (each rank its own batches, ``wrap`` over
    them all): each program's outcome, rank 0's where every rank's status is the same (a
    failure on any rank is rank 0's), else ``rank-mismatch`` with each rank's."""
    job = functools.partial(_programs_on_rank, run, draw, mix, start, n, wrap)  # (pickles)
    return [merged(outs) for outs in zip(*on_ranks(job, world))]


def _programs_on_rank(run: Callable[[dict[str, Any]], dict[str, Any]],
                      draw: Callable[[int, str], dict[str, Any]], mix: str, start: int, n: int,
                      wrap: str, rank: int) -> list[dict[str, Any]]:
    return programs(run, draw, mix, start, n, wrap)


def merged(outs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """One program's outcome from its ranks' (:func:`programs_on_ranks`)."""
    if len({o["status"] for o in outs}) > 1:
        return {**outs[0], "status": "rank-mismatch", "ranks": list(outs)}
    return next((o for o in outs if o["status"] in FAILURES), outs[0])


class NeverZeroed:
    """Flags the torch program once it reaches docs/rules.md's undetectable "loop that
    never zeroes its gradients": a gradient a ``step()`` applied is still in ``.grad`` at
    a later ``step()`` (or, nonzero, at a backward), so torch applies it again."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.applied: dict[int, torch.Tensor] = {}  # id(param) -> the gradient step() applied

    def reached(self, name: str, a: dict[str, Any] | None = None) -> str | None:
        """A backward adds to a nonzero one; a ``step()`` applies one again - zeros too
        (rules.md's "``step()`` twice on one backward's gradients": Adam moves on zeros).
        ``zeros-again`` where the gradients applied again unchanged are all zeros: verify
        takes those for gradients zeroed in place (``p.grad.zero_()``); ``held-onto``: a
        backward that holds - in ``no_step()``, or keeping its graph alone (``retain``) -
        adds to them (verify finds it at the ``step()``, or not where ``remove()`` comes
        first: verifyfuzz chaos seed 546,138; where a ``zero_grad(set_to_none=False)``
        comes first, layeropt keeps torch's zeros)."""
        if name not in ("step", "fb", "clip"):
            return None
        stale = [(p.grad, self.applied[id(p)]) for p in self.side.model.parameters()
                 if id(p) in self.applied and p.grad is not None]
        if name != "step":
            if not any(bool(g.any()) for g, _ in stale):
                return None
            holds = a is not None and (a.get("ns") or a.get("mode") == "retain")
            return "held-onto" if holds else "never-zeroed"
        same = [g for g, was in stale if g.shape == was.shape and torch.equal(g, was)]
        if not stale:
            return None
        return "zeros-again" if same and not any(bool(g.any()) for g in same) else "never-zeroed"

    def after(self, name: str, a: dict[str, Any]) -> None:
        s = self.side
        if name == "step":
            self.applied.update({id(p): p.grad.clone() for p in s._owned() if p.grad is not None})
        elif name == "zg":
            ps = s.model.parameters() if a["who"] == "model" else s._owned()
            for p in ps:
                self.applied.pop(id(p), None)
        elif name == "resume":  # (a new model: its gradients all None)
            self.applied.clear()


def _unwatched_discard(lo: Side, name: str, a: dict[str, Any]) -> bool:
    """docs/rules.md's undetectable "module's zero_grad() after remove()": ``remove()``
    came inside a training step (an attached backward updated parameters, no ``step()``
    or ``zero_grad()`` since: it warns where the loop has called either), and the
    model's ``zero_grad()`` drops what torch still held of that backward."""
    return (name == "zg" and a["who"] == "model" and not lo.attached
            and lo.opt._lo_engine.stepped_since_boundary)


def _averaged_after_remove(lo: Side, name: str) -> bool:
    """docs/rules.md's undetectable "``remove()`` inside a training step": an EMA of the
    model (``AveragedModel``) updated after it, before the optimizer's ``step()``,
    averages what the backward already updated, with nothing watching."""
    return name == "avg" and not lo.attached and lo.opt._lo_engine.stepped_since_boundary


def _saved_ahead(lo: Side, name: str) -> bool:
    """docs/rules.md's "a checkpoint saved ahead of torch's" (``state_dict()`` warns): saved
    after an attached backward updated parameters, before ``step()`` or ``zero_grad()``;
    or before the loop's first ``step()``, after a ``zero_grad()`` dropped what a backward
    applied. It holds that update, torch's does not, and the new optimizer cannot know."""
    engine = lo.opt._lo_engine
    return name == "resume" and (engine.stepped_since_boundary or _EARLY_DISCARD in engine.calls)


def _unkept_after_remove(t: Side, lo: Side, name: str, a: dict[str, Any]) -> bool:
    """docs/rules.md's undetectable "``zero_grad(set_to_none=False)`` of a module after
    ``remove()``" before ``zero_grad()``: torch zeroes gradients it still holds (its next
    step updates those parameters on zeros), which layeropt had freed before the
    attachment left."""
    return (name == "zg" and a["who"] == "model" and not a["stn"] and not lo.attached
            and any(p.grad is not None and not lo.holds(q)
                    for p, q in zip(t.model.parameters(), lo.model.parameters())))


def _unwatched_dropped(t: Side, lo: Side, name: str, a: dict[str, Any]) -> bool:
    """docs/rules.md's undetectable "module's ``zero_grad()`` after ``remove()``" before
    ``zero_grad()``, seen at the optimizer's ``zero_grad(set_to_none=False)`` that
    follows: torch's gradients of the last step are gone (the module's ``zero_grad()``
    set them to None, unwatched), layeropt still takes them as torch's and gives them
    zeros (loopfuzz chaos seed 111,322)."""
    if name != "zg" or a["who"] != "opt" or a["stn"] or lo.attached:
        return False
    held = {id(q) for q in lo.opt._lo_engine._held_now([])}
    return any(p.grad is None and id(q) in held
               for p, q in zip(t.model.parameters(), lo.model.parameters()))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, a NaN where the other has one (a run that diverged the
    same way on both sides: trainerfuzz lightning seed 582,528 was called a diff)."""
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0))


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = a.detach().cpu(), b.detach().cpu()  # (offloaded state: in host memory)
        if a.shape != b.shape or a.dtype != b.dtype or not _same_values(a, b):
            d = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
            return [f"{path}: max difference {d}"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only on {'torch' if k in a else 'layeropt'}")
            else:
                out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
    return [] if same else [f"{path}: {a!r} vs {b!r}"]


def _differences(t: Side, lo: Side) -> list[str]:
    names = [n for n, _ in t.model.named_parameters()]
    ts, ls = t.snapshot(), lo.snapshot()
    return (_diff(dict(zip(names, ts["params"])), dict(zip(names, ls["params"])), "param")
            + _diff(ts["state"], ls["state"], "state_dict")
            + _diff(ts["average"], ls["average"], "average"))


def play_both(t: Any, lo: Any, name: str, a: dict[str, Any],
              torch_steps: Callable[[], None] | None = None) -> dict[str, Any] | None:
    """One operation on both sides (torch's, then layeropt's: anything with ``do``); the
    outcome if either raised: torch's error, a refusal, or a crash. Where layeropt's
    backward raised something torch's did not, ``torch_steps`` (torch's side taking the
    step() the backward's updates stand for) tells whether torch's own step() raises the
    same there: torch's limit (its RMSprop after a scheduler set momentum, say)."""
    errors: list[Exception | None] = []
    for side in (t, lo):
        try:
            side.do(name, a)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - classified below
            errors.append(e)
    try:
        return _outcome(*errors, name, torch_steps)
    finally:  # (each error's traceback holds this frame: no reference cycle keeps a
        errors.clear()  # program's optimizers, still attached, alive for the next one)


def _outcome(terr: Exception | None, lerr: Exception | None, name: str,
             torch_steps: Callable[[], None] | None) -> dict[str, Any] | None:
    """:func:`play_both`'s outcome from each side's error (``None``: none)."""
    if terr is not None:
        status = "torch-error" if lerr is not None or TORCH_LIMIT in str(terr) else "torch-error-only"
        return {"status": status, "error": repr(terr)[:200]}
    if lerr is None:
        return None
    if TORCH_LIMIT in str(lerr) or DDP_LIMIT in str(lerr):
        return {"status": "torch-error", "error": repr(lerr)[:200]}
    ok = isinstance(lerr, layeropt.LayeroptError)
    if not ok and name in ("fb", "clip") and torch_steps is not None:
        try:
            torch_steps()
        except Exception as e:  # noqa: BLE001 - compared below
            if type(e) is type(lerr) and str(e) == str(lerr):
                return {"status": "torch-error", "error": f"at torch's step(): {e!r}"[:200]}
    return {"status": "refused" if ok else "crash", "error": f"{type(lerr).__name__}: {lerr}"[:300],
            **({} if ok else {"traceback": traceback.format_exception(lerr)[-4:]})}


def detach(handle: Any) -> None:
    """The program's attachment removed at its end, its warnings (a remove() inside a
    training step) not shown: the outcome is already decided."""
    if handle is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle.remove()


def run_program(prog: dict[str, Any], side: type[Side] = Side, classify: bool = True
                ) -> dict[str, Any]:
    """Both sides (``side``'s) op by op, then a closing ``step()`` if a backward is
    pending; the outcome: ``exact``, ``refused``, ``undetectable`` (not with ``classify``
    off: the program runs on), ``torch-error`` (torch raised, or layeropt reached
    ``TORCH_LIMIT`` before a refusal, or its backward raised what torch's own step() then
    raises: :func:`play_both`), or one of ``FAILURES``."""
    torch.manual_seed(prog["seed"])
    init = Net(prog["tied"]).state_dict()
    out: dict[str, Any] = {"seed": prog["seed"], "mix": prog["mix"], "status": "exact"}
    if wrap_of(prog) in DTENSOR_WRAPS and no_dtensor_rule([prog["opt"]]):
        return {**out, "status": "torch-error", "error": no_dtensor_rule([prog["opt"]]),
                "unrunnable": True}
    t = side(prog, False, init)
    try:
        lo = side(prog, True, init)
    except layeropt.LayeroptError as e:
        return refused_at_attach(out, e)
    never_zeroed = NeverZeroed(t)
    pending = stepped = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, (name, a) in enumerate([*prog["ops"], ("end", {})]):
                if name == "end":  # (a loop that never called step() gets one: before
                    if not pending and stepped:  # it, each backward is a step - rules.md)
                        break
                    name = "step"
                why = classify and (
                    never_zeroed.reached(name, a)
                    or _unwatched_discard(lo, name, a) and "remove-discard"
                    or _unkept_after_remove(t, lo, name, a) and "remove-unkept"
                    or _unwatched_dropped(t, lo, name, a) and "remove-dropped"
                    or _saved_ahead(lo, name) and "saved-ahead"
                    or _averaged_after_remove(lo, name) and "remove-average")
                if why:  # (what ran before it, between steps, is compared)
                    found = [] if pending else _differences(t, lo)
                    return ({**out, "status": "diff", "at": i, "before": why,
                             "differences": found[:6]} if found else
                            {**out, "status": "undetectable", "at": i, "why": why})
                ended = play_both(t, lo, name, a, lambda: t.do("step", {}))
                if ended is not None:
                    return {**out, **ended, "at": i, "op": name}
                never_zeroed.after(name, a)
                pending = name in ("fb", "clip") or (pending and name != "step")
                stepped = stepped or name == "step"
            found = _differences(t, lo)
            return {**out, "status": "diff", "differences": found[:6]} if found else out
    finally:
        lo.close()


def run_block(mix: str, start: int, n: int, wrap: str | None = None) -> list[dict[str, Any]]:
    return programs(run_program, draw_program, mix, start, n, wrap)


def assert_block(outcomes: list[dict[str, Any]], script: str, mix: str, exact_share: float
                 ) -> collections.Counter[str]:
    """A CI block of a fuzzer (``script``): no program failed - the first failure named with
    the command that shrinks it - and at least ``exact_share`` of them exact (the programs
    train: a mix that only refused would pass; of those torch can run at all - not the
    ``unrunnable`` ones, see :func:`no_dtensor_rule`, nor a tool's ``tool-error``: both
    runs raised, as a Trainer resuming past its last checkpoint, an optimizer of a
    package not installed, transformers' ``torch.load`` before torch 2.6). Returns the
    outcome counts."""
    failed = [o for o in outcomes if o["status"] in FAILURES]
    assert not failed, (f"{len(failed)} of {len(outcomes)} programs failed; the first: {failed[0]}"
                        f" (python tests/{script} --mix {mix} --minimize {failed[0]['seed']})")
    counts = collections.Counter(o["status"] for o in outcomes)
    runnable = sum(not o.get("unrunnable") and o["status"] != "tool-error" for o in outcomes)
    assert counts["tool-error"] <= len(outcomes) // 2, counts  # (the tool itself fails here)
    assert counts["exact"] >= runnable * exact_share, counts
    return counts


def assert_wrapped_block(block: Callable[..., list[dict[str, Any]]], script: str, mix: str,
                         n: int, wrap: str, exact_share: float) -> collections.Counter[str]:
    """:func:`assert_block` of a fuzzer's ``block`` (its ``run_block``) on a ``wrap``ped
    model in one process, one thread, warnings not shown (DDP's find_unused_parameters
    notes, verify's end-of-program notes)."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcomes = block(mix, 0, n, wrap)
    return assert_block(outcomes, f"{script} (LAYEROPT_FUZZ_WRAP={wrap})", mix, exact_share)


# -- by hand: more programs, one program, a smaller program -----------------------------
def ends_in(run: Callable[[dict[str, Any]], dict[str, Any]], status: str
            ) -> Callable[[dict[str, Any]], bool]:
    """The shrinkers' test: whether a candidate program still ends in ``status``. One that
    cannot start (an option dropped that another needs: ``nesterov`` without
    ``momentum``) does not."""
    def still(p: dict[str, Any]) -> bool:
        try:
            return run(p)["status"] == status
        except (ValueError, TypeError):  # (torch's optimizer refused the options)
            return False
    return still


def drop_chunks(prog: dict[str, Any], key: str, still: Callable[[dict[str, Any]], bool]
                ) -> dict[str, Any]:
    """Delta debugging over ``prog[key]`` (a list of steps): drop chunks of it, halving
    them down to single steps, while ``still(program)`` holds."""
    n = 2
    while prog[key]:
        steps, chunk = prog[key], max(1, len(prog[key]) // n)
        for i in range(0, len(steps), chunk):
            cand = {**prog, key: steps[:i] + steps[i + chunk:]}
            if still(cand):
                prog, n = cand, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(len(steps), n * 2)
    return prog


def minimize(prog: dict[str, Any], status: str) -> dict[str, Any]:
    """The shortest program still ending in ``status``: drop chunks of ops, then simplify
    each op's arguments and the setup (delta debugging)."""
    still = ends_in(run_program, status)

    prog = drop_chunks(prog, "ops", still)
    for i in range(len(prog["ops"])):
        for k, v in [("branch", False), ("extra", False), ("mode", "plain"), ("subset", False),
                     ("stn", True)]:
            cand = copy.deepcopy(prog)
            if cand["ops"][i][1].get(k, v) != v:
                cand["ops"][i][1][k] = v
                if still(cand):
                    prog = cand
    for k, v in [("tied", False), ("akw", {})] + [("okw", {kk: vv for kk, vv in prog["okw"].items()
                                                          if kk != key}) for key in prog["okw"]
                                                   if key != "lr"]:
        cand = {**prog, k: v}
        if prog[k] != v and still(cand):
            prog = cand
    cand = {k: v for k, v in prog.items() if k != "gkw"}  # (the groups' options alike)
    if cand != prog and still(cand):
        prog = cand
    return prog


def cli(doc: str, mixes: list[str], draw: Callable[[int, str], dict[str, Any]],
        run: Callable[[dict[str, Any]], dict[str, Any]],
        shrink: Callable[..., dict[str, Any]], steps: str = "ops",
        tally: str | None = None,
        ranked: Callable[[list[dict[str, Any]], int], list[dict[str, Any]]] | None = None
        ) -> None:
    """The fuzzers' command line: a block of programs (the failing ones printed, then the
    outcome counts and, with ``tally``, the counts of that field), or one program
    replayed or shrunk (``steps``: its list of steps). ``--ranks N`` runs them by
    ``ranked(programs, N)`` where given (shrinking too: ``shrink(prog, status, run)``),
    else by :func:`programs_on_ranks` on a ``LAYEROPT_FUZZ_WRAP``ped model."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--mix", default=mixes[0], choices=mixes)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--replay", type=int, help="print one program and its outcome")
    ap.add_argument("--minimize", type=int, help="shrink one program keeping its outcome")
    ap.add_argument("--ranks", type=int, default=1,
                    help="run on this many processes, each its own batches (a block or "
                         "--replay; loopfuzz and the like: with LAYEROPT_FUZZ_WRAP=ddp or "
                         "fsdp2; trainerfuzz: under torchrun)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gc.collect()  # (what the imports made, out of the programs' collections: conftest.py)
    gc.freeze()
    one = args.replay if args.replay is not None else args.minimize
    if args.ranks > 1:
        if ranked is None and (WRAP == "plain" or args.minimize is not None):
            ap.error("--ranks: with LAYEROPT_FUZZ_WRAP=ddp or fsdp2, and not with --minimize")
        first, n = (one, 1) if one is not None else (args.start, args.n)
        progs = [draw(s, args.mix) for s in range(first, first + n)]
        block = (ranked(progs, args.ranks) if ranked is not None
                 else programs_on_ranks(run, draw, args.mix, first, n, WRAP, args.ranks))

        def run(prog: dict[str, Any]) -> dict[str, Any]:  # (run on the ranks)
            if prog == progs[prog["seed"] - first]:  # (already)
                return block[prog["seed"] - first]
            return ranked([prog], args.ranks)[0]  # (a shrunk one)
    if one is not None:
        prog = draw(one, args.mix)
        if args.minimize is not None:
            status = run(prog)["status"]
            prog = shrink(prog, status, run) if args.ranks > 1 else shrink(prog, status)
        print(json.dumps({k: v for k, v in prog.items() if k != steps}))
        for step in prog[steps]:
            print("  ", step)
        print(json.dumps(run(prog), indent=1))
        return
    counts: collections.Counter[str] = collections.Counter()
    tallied: collections.Counter[str] = collections.Counter()
    for seed in range(args.start, args.start + args.n):
        res = run(draw(seed, args.mix))
        counts[res["status"]] += 1
        if tally is not None and tally in res:
            tallied[res[tally]] += 1
        if res["status"] in FAILURES:
            print(json.dumps(res))
    print(dict(counts))
    if tally is not None:
        print(dict(tallied))


if __name__ == "__main__":
    cli(__doc__, MIXES, draw_program, run_program, minimize)
