"""Random programs with several optimizers, or with activation checkpointing, run with
torch.optim and with layeropt attached, compared bit for bit.

The companion of tests/loopfuzz.py (same outcomes, same command line) for what its one
optimizer over one model does not reach. Each program is drawn from
``random.Random(seed)`` and a mix:

* ``multi``: a trunk and two heads trained by two layeropt optimizers, by a layeropt one
  beside a plain torch.optim one, or by two layeropt ones and a plain one (or, now and
  then, torch's Muon recipe: Muon over every 2D weight, another over the rest; and an
  optimizer's second param group with options of its own); attached to the
  model one by one, to each optimizer's own submodules, as a list, or all at once
  (``attach(model)``). Backwards reach one optimizer or several (a loss on the trunk
  alone, on the heads over detached features), with ``no_step()`` of some optimizers and
  a layer frozen for one backward; ``layeropt.backward(max_norm=)`` for one optimizer,
  some or all, over the default parameters or a ``parameters=`` subset; each optimizer's
  ``step()`` and ``zero_grad()`` in random orders, or the model's ``zero_grad()``;
  hyperparameters, ``load_state_dict``, an optimizer handed over to a new one;
* ``gan``: the same, most iterations a GAN's (the head a discriminator stepped on the
  trunk's detached features, then the trunk's loss through it, with the head frozen,
  inside its ``no_step()``, or neither);
* ``handover``: the same, an optimizer often replaced by a new one of another class
  (its handle removed, or the optimizer deleted) - also between a backward and its step;
* ``heldclip``: the same, most iterations clipped, with some optimizers inside their
  ``no_step()`` around ``layeropt.backward(max_norm=)`` (by default left out of the
  clip, as ``clip_grad_norm_`` over the stepping ones; an optimizer it clips refused),
  or around a clipping ``LoopAccumulator`` over 2-3 batches;
* ``checkpoint``: one optimizer over a residual MLP whose blocks run under torch's
  checkpoint (reentrant or not), ``layeropt.checkpoint`` or
  ``layeropt.checkpoint_modules``, mixed per block, a block applied three times in one
  forward, a weight read twice (embedding and output), accumulation, clipping, frozen
  blocks;
* ``offload`` and ``ckoffload``: ``multi``'s and ``checkpoint``'s programs with every
  layeropt optimizer's state offloaded (a mode drawn per program, tests/offloadfuzz.py's;
  an optimizer handed over is offloaded again), every copy on simulated CUDA streams
  (``race``: a copy not ordered after what it depends on);
* ``verify``, ``vgan`` and ``vck``: ``multi``'s, ``gan``'s and ``checkpoint``'s programs
  alone, then with every
  layeropt optimizer attached with ``verify=`` over every step (a quarter of them: the
  first 1-3 steps, then updating in backward - where layeropt alone ends exact, so must
  that run, unrefused): tests/verifyfuzz.py's outcomes (``verify-silent``,
  ``verify-diff``, ``verify-false-alarm``), but for the cases verify is said not to
  find (``VERIFY_BLIND``).

Outcomes are loopfuzz's: ``exact``, ``refused``, ``undetectable``, ``torch-error``, or
one of ``FAILURES`` (``diff``, ``crash``, ``torch-error-only``). ``undetectable`` names
the docs/rules.md entry the program reached (``WHY``); the program runs on from there,
so that a refusal still counts as one. By hand (from the tests/ folder)::

    python multifuzz.py --mix multi --start 0 --n 3000
    python multifuzz.py --mix gan --replay 36
    python multifuzz.py --mix gan --minimize 36
    LAYEROPT_FUZZ_WRAP=ddp python multifuzz.py --mix handover --n 300   # (or fsdp2)

``LAYEROPT_FUZZ_WRAP`` (tests/loopfuzz.py) runs the programs on a wrapped model, both
sides alike, in a process group of this process alone:

* ``ddp``: in DistributedDataParallel (``find_unused_parameters=True``), every forward
  through the wrapper (the loss taken outside it). Optimizers that attach the whole model
  attach the wrapper, together (DDP takes one attachment, its communication hook: a
  second is refused); ``style="sub"`` puts plain hooks on its module's submodules, which
  DDP's first forward refuses (layeropt's watcher: ``refused``); half the programs
  reduce through a communication hook of the
  user's (fp16, or one with state), registered on torch's side and
  given to layeropt's attachments of the wrapper. Every mix runs; torch's reentrant
  checkpoint (``tr``, in the
  checkpoint mixes) raises in each backward under DDP, on both sides (``torch-error``);
* ``fsdp2``: sharded by ``fully_shard`` as one unit, every mix but the offloaded ones
  (offload refuses FSDP2's shards); torch's fused kernels dropped (no DTensor rule).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

import harness
import layeropt
from layeropt import LoopAccumulator
import offloadfuzz
import loopfuzz
from loopfuzz import _diff, cli, draw_optimizer, draw_options, drop_chunks, mutate, play_both
from streamsim import offload_in_mode

MIXES = ["multi", "gan", "handover", "checkpoint", "offload", "ckoffload", "verify", "vgan",
          "vck", "heldclip"]
OFFLOADED = {"offload": "multi", "ckoffload": "checkpoint"}  # mix -> the mix it offloads
VERIFIED = {"verify": "multi", "vgan": "gan", "vck": "checkpoint"}  # mix -> the mix verified
Op = tuple[str, dict[str, Any]]

# The documented undetectable cases these programs reach (docs/rules.md), by the entry
# that describes each.
WHY = {
    "never-zeroed": "What cannot be detected: a loop that never zeroes its gradients "
                    "(or step() twice on one backward's gradients)",
    "reads-updated": "A forward between backward and step: one through a model whose "
                     "attached backward updated it, before that optimizer's step(), where "
                     "nothing watches it (the loop's first step() not called yet, a "
                     "handover, compiled, FSDP2)",
    "step-less": "Gradient accumulation: a loop that never calls step() takes each "
                 "backward as a step (here its optimizer handed over before its first "
                 "step(), the backward's update kept)",
    "unkept": "What cannot be detected: remove() before zero_grad() - a module's "
              "zero_grad(set_to_none=False) after it finds no gradient of that step to "
              "keep as zeros (torch's next step() updates on zeros)",
    "deleted-unkept": "What cannot be detected: an optimizer deleted before zero_grad() in "
                      "a loop whose latest zero_grad() set gradients to None - a later "
                      "zero_grad(set_to_none=False) finds no gradient of its last step to "
                      "keep as zeros (torch's next step() updates on zeros)",
    "deleted": "A model another optimizer trained: an open training step is refused at "
               "attach, or the earlier optimizer deleted to train on from the parameters "
               "as they are",
}


# -- the models -------------------------------------------------------------------------
class Heads(nn.Module):
    """A trunk and two heads. A loss is ``full``, ``headonly`` (the heads on the trunk's
    detached features: a discriminator's step) or ``trunkonly`` (the trunk alone), with
    or without the ``aux`` head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, kind: str, aux: bool) -> torch.Tensor:
        h = self.trunk(x)
        if kind == "trunkonly":
            return h[:, :3] * 1.5
        if kind == "headonly":
            h = h.detach()
        out = self.head(h)
        return out + self.aux(h) if aux else out

    def loss(self, a: dict[str, Any], top: nn.Module | None = None) -> torch.Tensor:
        """The loss of ``a``'s batch, its forward through ``top`` (the model as it trains:
        its DDP wrapper, which must see the forward), else this module."""
        g = torch.Generator().manual_seed(loopfuzz.batch_seed(a["seed"]))
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
        return (((self if top is None else top)(x, a["kind"], a["aux"]) - y) ** 2).mean()

    @staticmethod
    def reads(a: dict[str, Any]) -> set[str]:
        """The submodules whose parameters this loss's forward reads."""
        if a["kind"] == "trunkonly":
            return {"trunk"}
        return {"trunk", "head"} | ({"aux"} if a["aux"] else set())

    def wire(self, layer: bool) -> None:
        """Nothing to wire (no checkpointing): see ``Blocks.wire``."""
        return None


class Blocks(nn.Module):
    """An embedding, three residual blocks (block 0 applied three times in one forward
    when ``share``), a LayerNorm and an output that reads the embedding's weight again
    when ``tied``. ``ck`` says how each block application runs: plain, torch's
    checkpoint (``tnr``, reentrant ``tr``), ``layeropt.checkpoint`` (``lo``, ``lor``),
    one per application (a list), or ``modules``: the blocks under
    ``layeropt.checkpoint_modules`` (torch: the same blocks under torch's checkpoint)."""

    def __init__(self, ck: str | list[str], tied: bool, share: bool) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3)])
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)
        self.ck, self.tied, self.share = ck, tied, share

    def _block(self, i: int, j: int, h: torch.Tensor) -> torch.Tensor:
        def f(t: torch.Tensor) -> torch.Tensor:
            return t + torch.tanh(self.blocks[j](t))

        ck = self.ck[i % len(self.ck)] if isinstance(self.ck, list) else self.ck
        if ck in ("tnr", "tr"):
            return tuc.checkpoint(f, h, use_reentrant=ck == "tr")
        if ck in ("lo", "lor"):
            return layeropt.checkpoint(f, h, use_reentrant=ck == "lor")
        return f(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, j in enumerate([0, 1, 0, 2, 0] if self.share else [0, 1, 2]):
            h = self._block(i, j, h)
        h = self.norm(h)
        return h @ self.emb.weight if self.tied else self.out(h)

    def loss(self, a: dict[str, Any], top: nn.Module | None = None) -> torch.Tensor:
        """As ``Heads.loss``."""
        g = torch.Generator().manual_seed(loopfuzz.batch_seed(a["seed"]))
        x = torch.randn(5, 4, generator=g)
        return (((self if top is None else top)(x) - x) ** 2).mean()

    @staticmethod
    def reads(a: dict[str, Any]) -> set[str]:
        return {""}

    def wire(self, layer: bool) -> Any:
        """``ck="modules"``: layeropt's side under ``checkpoint_modules`` (its handle),
        torch's with each block's ``forward`` under torch's non-reentrant checkpoint."""
        if self.ck != "modules":
            return None
        self.ck = "none"
        if layer:
            return layeropt.checkpoint_modules(self, names="blocks.*")
        for b in self.blocks:
            b.forward = functools.partial(tuc.checkpoint, b.forward, use_reentrant=False)
        return None


def make_net(prog: dict[str, Any]) -> Heads | Blocks:
    return Blocks(**prog["blocks"]) if "blocks" in prog else Heads()


# -- drawing a program ------------------------------------------------------------------
BODIES = {"multi": ["plain", "plain", "accum", "clip", "clipsub", "gan"],
          "gan": ["gan", "gan", "gan", "plain", "accum", "clip"],
          "handover": ["plain", "plain", "accum", "clip", "clipsub", "gan"],
          # clipped backwards with some optimizers inside their no_step() (a GAN's D
          # held while G's step is clipped)
          "heldclip": ["clip", "clip", "clipsub", "accum", "gan", "plain"]}
HANDOVER = {"multi": 0.15, "gan": 0.05, "handover": 0.5, "heldclip": 0.1}
# a layer frozen for one backward: one the loss does not need alone (the programs train)
FREEZABLE = {"full": ["head", "trunk"], "headonly": ["trunk"], "trunkonly": ["head"]}


def _fb(r: random.Random, ns: list[str], kind: str | None = None,
        freeze: str | None = None) -> Op:
    kind = kind or r.choice(["full"] * 4 + ["headonly", "trunkonly"])
    if freeze is None and r.random() < 0.3:
        freeze = r.choice(FREEZABLE[kind])
    return ("fb", {"seed": r.randrange(10**6), "kind": kind, "aux": r.random() < 0.4,
                   "ns": ns, "freeze": freeze})


def _steps(r: random.Random, names: list[str]) -> list[Op]:
    """Each optimizer's step(), in a random order, then most often each one's zero_grad()
    (in a random order) or the model's."""
    ops: list[Op] = [("step", {"o": n}) for n in names]
    r.shuffle(ops)
    if r.random() < 0.3:
        return ops + [("mzg", {"stn": r.random() < 0.7})]
    if r.random() < 0.9:
        zs: list[Op] = [("zg", {"o": n, "stn": r.random() < 0.7}) for n in names]
        r.shuffle(zs)
        ops += zs
    return ops


def _gan(r: random.Random) -> list[Op]:
    """D (o2's head) steps on detached features; G's loss (o1's trunk) goes through D,
    which is frozen, inside ``no_step()``, or neither (refused at D's zero_grad())."""
    fix = r.choice(["freeze", "nostep", "none"])
    g_loss = _fb(r, ["o2"] if fix == "nostep" else [], "full",
                 "head" if fix == "freeze" else None)
    return [("zg", {"o": "o2", "stn": True}), _fb(r, [], "headonly"), ("step", {"o": "o2"}),
            g_loss, ("step", {"o": "o1"}), ("zg", {"o": "o1", "stn": True}),
            ("zg", {"o": "o2", "stn": True})]


def _heads_iteration(r: random.Random, mix: str, names: list[str],
                     lo: list[str]) -> list[Op]:
    """Settings (between iterations, or between a backward and its step once mutated),
    then a body: a backward, accumulation, a clipped backward or a GAN's two."""
    pre: list[Op] = []
    if r.random() < 0.25:
        pre.append(("hp", {"o": r.choice(names), "val": r.choice([0.0, 0.02, 0.2])}))
    if r.random() < 0.2:  # (only aux: a loss always reaches a trainable layer)
        pre.append(("freeze", {"m": "aux", "flag": r.random() < 0.5}))
    if r.random() < HANDOVER[mix]:
        pre.append(("handover", {"o": r.choice(lo), "new": draw_optimizer(r),
                                 "how": r.choice(["remove", "remove", "del"])}))
    if r.random() < 0.15:
        pre.append(("sd", {"o": r.choice(names)}))
    r.shuffle(pre)
    body = r.choice(BODIES[mix])
    if body == "gan":
        return pre + _gan(r)
    ops = pre
    if body == "accum":
        ops += [_fb(r, [n for n in lo if r.random() < 0.85]) for _ in range(r.randint(1, 2))]
        ops.append(_fb(r, []))
    elif body in ("clip", "clipsub"):
        if r.random() < 0.3:
            ops.append(_fb(r, list(lo), "full"))
        ops.append(("clip", {"seed": r.randrange(10**6), "kind": r.choice(["full", "full", "headonly"]),
                             "aux": r.random() < 0.4, "max_norm": r.choice([0.01, 0.1, 1e9]),
                             "sub": ["trunk", "head"] if body == "clipsub" else None,
                             "opt": r.choice([None, None, "o1", "o2", "both"]),
                             # (held ones: by default left out, else refused)
                             **({"ns": [n for n in lo if r.random() < 0.4]}
                                if mix == "heldclip" and r.random() < 0.7 else {}),
                             # (a LoopAccumulator's clip over 2-3 batches)
                             **({"n": r.choice([2, 3])}
                                if mix == "heldclip" and r.random() < 0.35 else {})}))
    else:
        ops.append(_fb(r, []))
    return ops + _steps(r, names)


def _draw_heads(r: random.Random, mix: str) -> dict[str, Any]:
    setup = r.choice(["two", "two", "mixed", "three"])
    names = ["o1", "o2", "o3"] if setup == "three" else ["o1", "o2"]
    layer = {"o1": True, "o2": setup != "mixed", "o3": False}
    owned = {"o1": ["trunk"], "o2": ["head"] if setup == "three" else ["head", "aux"],
             "o3": ["aux"]}
    lo = [n for n in names if layer[n]]
    ops: list[Op] = []
    for _ in range(r.randint(2, 4)):
        ops += _heads_iteration(r, mix, names, lo)
    return {"opts": {n: draw_optimizer(r) for n in names}, "layer": layer,
            "owned": {n: owned[n] for n in names},
            "style": r.choice(["model", "sub", "list", "none"]),
            "akw": r.choice([{}, {}, {"bucket_cap_mb": 0}]), "ops": ops}


def _draw_blocks(r: random.Random) -> dict[str, Any]:
    ck: str | list[str] = r.choice(["tnr", "tr", "lo", "lor", "mix", "modules"])
    if ck == "mix":
        ck = [r.choice(["tnr", "tr", "lo", "lor", "none"]) for _ in range(5)]
    ops: list[Op] = []
    for _ in range(r.randint(2, 3)):
        body = r.choice(["plain", "accum", "clip", "accumclip"])
        if body in ("accum", "accumclip"):
            ops += [("fb", {"seed": r.randrange(10**6), "ns": ["o1"], "freeze": None})
                    for _ in range(r.randint(1, 2))]
        if body in ("clip", "accumclip"):
            ops.append(("clip", {"seed": r.randrange(10**6), "max_norm": r.choice([0.05, 1e9]),
                                 "sub": None, "opt": None}))
        else:
            ops.append(("fb", {"seed": r.randrange(10**6), "ns": [], "freeze": None}))
        if r.random() < 0.15:
            ops.append(("freeze", {"m": f"blocks.{r.randrange(3)}", "flag": r.random() < 0.5}))
        ops += [("step", {"o": "o1"}), ("zg", {"o": "o1", "stn": r.random() < 0.8})]
    return {"opts": {"o1": draw_optimizer(r)}, "layer": {"o1": True}, "owned": {"o1": [""]},
            "style": "model", "akw": r.choice([{}, {"bucket_cap_mb": 0}]),
            "blocks": {"ck": ck, "tied": r.random() < 0.4, "share": r.random() < 0.6},
            "ops": ops}


def _muon_recipe(r: random.Random) -> dict[str, Any]:
    """torch's Muon recipe over the whole model: ``o1`` Muon over every 2D weight, ``o2``
    another optimizer (layeropt's or, now and then, a plain one) over the biases - two
    optimizers in every module, each attached to the whole model or to each module."""
    mods = ["trunk", "head", "aux"]
    return {"opts": {"o1": ("Muon", loopfuzz.draw_muon(r)), "o2": draw_optimizer(r)},
            "layer": {"o1": True, "o2": r.random() < 0.75}, "owned": {"o1": mods, "o2": mods},
            "dims": {"o1": 2, "o2": 1}}


def draw_program(seed: int, mix: str) -> dict[str, Any]:
    """A loop of 2-4 iterations (``checkpoint``: 2-3), then 0-3 mutations."""
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r}: one of {MIXES}")
    r = random.Random(seed)
    base = OFFLOADED.get(mix) or VERIFIED.get(mix, mix)
    prog = _draw_blocks(r) if base == "checkpoint" else _draw_heads(r, base)
    mode = offloadfuzz.draw_mode(random.Random(seed + 10**7)) if mix in OFFLOADED else None
    ops = mutate(r, prog["ops"], r.choice([0, 0, 1, 1, 2, 3]), (0.45, 0.75))
    # (drawn last: the draws before stay those of a program without it) learning rates
    # given as tensors (loopfuzz.wrapped_kwargs), where torch takes them
    made = [*prog["opts"].values(), *(a["new"] for _, a in ops if "new" in a)]
    tensor_lr = r.random() < 0.1 and not any(
        k in ("Adam", "AdamW") and kw.get("foreach") for k, kw in made)
    if base != "checkpoint" and list(prog["opts"]) == ["o1", "o2"] and hasattr(
            torch.optim, "Muon") and r.random() < 0.15:
        prog.update(_muon_recipe(r))
        kind, kw = prog["opts"]["o2"]  # (drawn after tensor_lr: torch refuses it with
        if tensor_lr and kind in ("Adam", "AdamW"):  # Adam's foreach)
            kw.pop("foreach", None)
    # each optimizer's second param group with options of its own, now and then (its
    # implementation too), for the class it was drawn with (not one handed over to)
    gkw = {n: (kind, draw_options(r, kind)) for n, (kind, _) in prog["opts"].items()
           if kind != "Muon" and r.random() < 0.15}
    if gkw and not tensor_lr:
        prog["gkw"] = gkw
    # (a separate draw, as verifyfuzz's) a quarter of the verified programs verify 1-3
    # steps only, then update in backward, as a user's run does after LAYEROPT_VERIFY=N
    v = random.Random(seed + 7 * 10**6)
    if mix in VERIFIED and v.random() < 0.25:
        prog["verify_steps"] = v.randint(1, 3)
    # on a DDP model, now and then a communication hook of the user's (one that keeps
    # state less often than loopfuzz draws it, and not in GAN loops: they leave a step's
    # gradients unzeroed until the next backward, refused with it)
    comm = random.Random(seed + 3 * 10**7).choice(
        [None, None, "fp16"] if base == "gan" else [None, None, None, "fp16", "fp16",
                                                    "feedback"])
    if comm:
        prog["comm"] = comm
    return {"seed": seed, "mix": mix, **prog, "ops": ops[:22],
            "mode": mode, "verify": mix in VERIFIED, **({"tensor_lr": True} if tensor_lr else {})}


# -- running it -------------------------------------------------------------------------
class Side:
    """One side of the comparison: the model, its optimizers by name (``o1``...) and,
    on layeropt's side, their attachments. ``model``: the ``Heads`` or ``Blocks`` module
    (its submodules, parameters, ``zero_grad()``); ``top``: the model as it trains, the
    one each forward goes through and attachments of the whole model take - its
    DistributedDataParallel wrapper under DDP, else the module itself (under FSDP2
    sharded as one unit in place, the tied weight shared in it)."""

    def __init__(self, prog: dict[str, Any], layer: bool, init: dict[str, torch.Tensor]) -> None:
        self.prog, self.layer = prog, layer
        self.model = make_net(prog)
        self.model.load_state_dict(init)
        self.ckpt = self.model.wire(layer)
        self.top: nn.Module = loopfuzz.wrap(self.model, loopfuzz.wrap_of(prog))
        # DDP: the program's communication hook (a fresh state), given to layeropt's
        # attachments of the wrapper (not with style="sub": plain hooks on its submodules,
        # refused at DDP's first forward)
        self.comm: dict[str, Any] = {}
        if prog.get("comm") and loopfuzz.wrap_of(prog) == "ddp" and prog["style"] != "sub":
            hook, state = harness.comm_hook(prog["comm"])
            if layer and any(prog["layer"].values()):
                self.comm = {"comm_hook": hook, "comm_state": state}
            else:
                self.top.register_comm_hook(state, hook)
        self.opts = {n: self._make(n, *prog["opts"][n]) for n in prog["opts"]}
        self.handles: dict[str, list[Any]] = {}
        self.offloads: dict[str, Any] = {}  # name -> its offload handle (mode drawn)
        if layer:
            self._attach_all()
            for n in self.opts:
                self._offload(n)

    def _offload(self, n: str) -> None:
        if self.prog.get("mode") and self.is_lo(n):
            self.offloads[n] = offload_in_mode(self.opts[n], self.prog["mode"])

    def is_lo(self, n: str) -> bool:
        """Whether optimizer ``n`` is a layeropt one on this side."""
        return self.layer and self.prog["layer"][n]

    def modules(self, n: str) -> list[nn.Module]:
        return [self.model.get_submodule(m) for m in self.prog["owned"][n]]

    def params(self, n: str) -> list[torch.Tensor]:
        """Optimizer ``n``'s parameters: its modules', those of its ``dims`` alone (Muon's)."""
        ps = {id(p): p for m in self.modules(n) for p in m.parameters()}.values()
        dims = self.prog.get("dims", {}).get(n)
        return [p for p in ps if dims is None or (p.ndim == 2) == (dims == 2)]

    def _make(self, n: str, kind: str, kw: dict[str, Any]) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, kind)
        if self.is_lo(n):
            cls = getattr(layeropt, kind, None) or layeropt.in_backward(cls)
        ps = self.params(n)
        own = self.prog.get("gkw", {}).get(n)  # (the second group's own options)
        second = loopfuzz.wrapped_kwargs(own[1], self.prog) if own and own[0] == kind else {}
        return cls([{"params": ps[:1]}, {"params": ps[1:], **second}],
                   **loopfuzz.wrapped_kwargs(kw, self.prog))

    def _attach_all(self) -> None:
        names = [n for n in self.opts if self.is_lo(n)]
        style = self.prog["style"]
        if style == "none" or (style == "list" and len(names) > 1):
            h = layeropt.attach(self.top, None if style == "none" else
                                [self.opts[n] for n in names], **self._akw(self.top))
            self.handles = {n: [h] for n in names}
        else:
            self._attach_each(names)

    def _attach_each(self, names: list[str]) -> None:
        """Each optimizer attached on its own - but a DDP wrapper as a whole takes one
        attachment (its communication hook; a second is refused): there, the optimizers
        together, as ``style="list"``."""
        if self.top is not self.model and self.prog["style"] != "sub" and len(names) > 1:
            h = layeropt.attach(self.top, [self.opts[n] for n in names], **self._akw(self.top))
            self.handles.update({n: [h] for n in names})
            return
        for n in names:
            self._attach(n)

    def _attach(self, n: str) -> None:
        mods = self.modules(n) if self.prog["style"] == "sub" else [self.top]
        self.handles[n] = [layeropt.attach(m, self.opts[n], **self._akw(m)) for m in mods]

    def _akw(self, model: nn.Module) -> dict[str, Any]:
        """attach's arguments for ``model``: the program's, ``verify=`` over every step
        (verified) or over its ``verify_steps``, and the DDP wrapper's comm hook."""
        steps = self.prog.get("verify_steps", 1000)
        return {**self.prog["akw"], **({"verify": steps} if self.prog.get("verify") else {}),
                **(self.comm if model is self.top else {})}

    def _attached_params(self) -> list[torch.Tensor]:
        """What ``layeropt.backward`` measures by default: the attached models'
        parameters, then the layeropt optimizers' others."""
        lo = [n for n in self.opts if self.prog["layer"][n]]
        mods = [m for n in lo for m in self.modules(n)] if self.prog["style"] == "sub" \
            else [self.model]
        ps = [p for m in mods for p in m.parameters()] + [p for n in lo for p in self.params(n)]
        return list({id(p): p for p in ps}.values())

    def _torch_clipped(self, sel: str | None, held: list[str] = ()) -> list[torch.Tensor]:
        """torch's ``clip_grad_norm_`` set for ``layeropt.backward(loss, opt)``: the default
        set, less the parameters of layeropt optimizers other than ``sel`` if one - by
        default (``sel`` None), of those ``held`` inside their ``no_step()`` where another
        is not."""
        ps = self._attached_params()
        lo = [n for n in self.opts if self.prog["layer"][n]]
        if sel is None and held and any(n not in held for n in lo):
            out = {id(p) for n in held for p in self.params(n)}
            return [p for p in ps if id(p) not in out]
        if sel is None or sel == "both" or not self.prog["layer"][sel]:
            return ps
        others = {id(p) for n in self.opts if n != sel and self.prog["layer"][n]
                  for p in self.params(n)}
        return [p for p in ps if id(p) not in others]

    def _selected(self, sel: str | None) -> Any:
        if sel == "both":
            return [self.opts[n] for n in self.opts if self.is_lo(n)]
        return self.opts[sel] if sel is not None and self.is_lo(sel) else None

    @contextlib.contextmanager
    def _frozen(self, name: str | None) -> Iterator[None]:
        mod = self.model.get_submodule(name) if name else None
        if mod is not None:
            mod.requires_grad_(False)
        try:
            yield
        finally:
            if mod is not None:
                mod.requires_grad_(True)

    def _clip(self, a: dict[str, Any]) -> None:
        held = [n for n in a.get("ns", ()) if self.prog["layer"][n]]  # (in their no_step())
        if a.get("n"):
            return self._accumulated(a, held)
        loss = self.model.loss(a, self.top)

        def subset() -> list[torch.Tensor]:  # (FSDP2, after the forward: the unsharded)
            return [p for m in a["sub"] for p in self.model.get_submodule(m).parameters()]
        if self.layer:
            kw = {} if a["sub"] is None else {"parameters": subset()}
            with contextlib.ExitStack() as stack:
                for n in held:
                    stack.enter_context(self.opts[n].no_step())
                layeropt.backward(loss, self._selected(a["opt"]), max_norm=a["max_norm"], **kw)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(
                self._torch_clipped(a["opt"], held) if a["sub"] is None else subset(),
                a["max_norm"])

    def _accumulated(self, a: dict[str, Any], held: list[str]) -> None:
        """``a``'s clip as a ``LoopAccumulator(n, opt, max_norm=)`` over ``n`` batches (its
        own or every attached optimizer but those ``held`` clipped at its last backward);
        torch's: ``n`` backwards of ``loss / n`` and ``clip_grad_norm_``, none where the
        accumulator defers its clip to an outer accumulation (its optimizer held, or all)."""
        n, sel = a["n"], a["opt"]
        losses = [{**a, "seed": a["seed"] + i} for i in range(n)]
        if self.layer:
            with contextlib.ExitStack() as stack:
                for h in held:
                    stack.enter_context(self.opts[h].no_step())
                with LoopAccumulator(n, self._selected(sel), max_norm=a["max_norm"]) as acc:
                    for b in losses:
                        acc.backward(self.model.loss(b, self.top))
            return
        for b in losses:
            (self.model.loss(b, self.top) / n).backward()
        lo = [k for k in self.opts if self.prog["layer"][k]]
        chosen = lo if sel == "both" else [sel] if sel in lo else []
        if not held or not (all(k in held for k in lo) or any(k in held for k in chosen)):
            torch.nn.utils.clip_grad_norm_(self._torch_clipped(None, held), a["max_norm"])

    def _handover(self, n: str, new: list[Any], how: str) -> None:
        """``n`` replaced by a new optimizer of class ``new``: its attachment removed (the
        old one still referenced while the new one attaches), or left to the deleted
        optimizer; the others sharing its handle attached again."""
        joint: list[str] = []
        if self.layer:
            hs = self.handles.pop(n, [])
            joint = [k for k, v in self.handles.items() if any(h in v for h in hs)]
            if how == "remove":
                if n in self.offloads:  # (its state back first, as the docs' handover)
                    self.offloads.pop(n).remove()
                for h in hs:
                    h.remove()
            self.offloads.pop(n, None)  # (deleted: the optimizer's pool goes with it)
            for k in joint:
                del self.handles[k]
            del hs
        kept = [self.opts.pop(n)] if how == "remove" else []
        self.opts.pop(n, None)  # (deleted: nothing else refers to it)
        self.opts[n] = self._make(n, *new)
        if self.layer:
            self._attach_each([*joint, n])
            self._offload(n)
        kept.clear()

    def do(self, name: str, a: dict[str, Any]) -> None:
        if name == "fb":
            with self._frozen(a["freeze"]), contextlib.ExitStack() as stack:
                loss = self.model.loss(a, self.top)
                for n in a["ns"]:
                    if self.is_lo(n):
                        stack.enter_context(self.opts[n].no_step())
                loss.backward()
        elif name == "clip":
            self._clip(a)
        elif name == "step":
            self.opts[a["o"]].step()
        elif name == "zg":
            self.opts[a["o"]].zero_grad(set_to_none=a["stn"])
        elif name == "mzg":
            self.model.zero_grad(set_to_none=a["stn"])
        elif name == "hp":
            self.opts[a["o"]].param_groups[-1]["lr"] = a["val"]
        elif name == "freeze":
            self.model.get_submodule(a["m"]).requires_grad_(a["flag"])
        elif name == "sd":
            o = self.opts[a["o"]]
            o.load_state_dict(copy.deepcopy(o.state_dict()))
        elif name == "handover":
            self._handover(a["o"], a["new"], a["how"])
        else:
            raise ValueError(f"unknown op {name!r}")

    def snapshot(self) -> dict[str, Any]:
        return {"param": {n: loopfuzz.full(p.detach()).clone()
                          for n, p in self.model.named_parameters()},
                "state_dict": {n: loopfuzz.full(copy.deepcopy(o.state_dict()))
                               for n, o in self.opts.items()}}

    def close(self) -> None:
        for handle in self.offloads.values():
            handle.remove()
        for h in {id(h): h for hs in self.handles.values() for h in hs}.values():
            h.remove()
        if self.ckpt is not None:
            self.ckpt.remove()


class Watch:
    """Follows what the program has done to tell when it reaches one of ``WHY``, and
    which optimizers hold gradients a ``step()`` should end the loop with. Read on
    torch's side, with layeropt's ``.grad`` to see what an attached backward applied."""

    def __init__(self, t: Side, lo: Side) -> None:
        self.t, self.lo = t, lo
        self.pairs = list(zip(t.model.parameters(), lo.model.parameters()))
        self.applied: set[int] = set()  # layeropt-owned, applied by step(), not zeroed
        self.open: set[str] = set()  # updated by an attached backward, no step()/zero_grad()
        self.updated: set[str] = set()  # updated by an attached backward, ever
        self.removed = False  # an attachment was removed (a handover)
        self.stepped: set[str] = set()  # called step() (this optimizer, not one before it)
        self.pending: dict[str, None] = {}  # a backward gave it gradients since its step()
        self.grads: list[torch.Tensor | None] = []
        self.held: set[int] = set()  # layeropt held a gradient of them before the backward
        # torch holds their gradient, layeropt freed it, and the optimizer that applied it
        # was deleted in a loop whose latest zero_grad set gradients to None
        self.left: set[int] = set()

    def _read_refused(self, hit: list[str]) -> bool:
        """Whether layeropt refuses the forward that reads ``hit``'s updated layers
        (checking/forwards.py): one of them has called ``step()`` in this loop (its
        ``step()`` is known to come), nothing was handed over, neither compiled nor
        under FSDP2 (whose root group it does not see); on every rank alike (one
        program, the same path)."""
        return (any(n in self.stepped and self.t.prog["layer"][n] for n in hit)
                and not self.removed
                and loopfuzz.wrap_of(self.t.prog) not in ("compile", "fsdp2"))

    def _lo_ids(self, n: str) -> set[int]:
        return {id(p) for p in self.t.params(n)} if self.t.prog["layer"][n] else set()

    def before(self, name: str, a: dict[str, Any]) -> str | None:
        """The ``WHY`` key this operation reaches, if one: a ``step()`` applying gradients
        a ``step()`` applied (and not zeroed since) again, or a clip measuring them; a
        forward through an open optimizer's layers; an optimizer handed over before its
        first ``step()`` after a backward updated its layers, or deleted open."""
        t = self.t
        if name == "step":
            if any(id(p) in self.applied and p.grad is not None for p in t.params(a["o"])):
                return "never-zeroed"
        elif name in ("fb", "clip"):
            self.grads = [None if p.grad is None else p.grad.clone() for p, _ in self.pairs]
            self.held = {id(p) for p, q in self.pairs if not self._applied(q)}
            if name == "clip" and any(id(p) in self.applied and p.grad is not None
                                      and bool(p.grad.any()) for p, _ in self.pairs):
                return "never-zeroed"  # (torch's clip measures them; a backward onto
                # them matters only at a step() applying them again, or a clip)
            read = t.model.reads(a)
            hit = [n for n in self.open if read & set(t.prog["owned"][n])]
            if hit and not self._read_refused(hit):
                return "reads-updated"
        elif name == "mzg" and not a["stn"] and self.removed and any(
                p.grad is not None and self._applied(q) for p, q in self.pairs):
            return "unkept"
        elif name in ("zg", "mzg") and not a["stn"] and any(
                id(p) in self.left and p.grad is not None
                for p in (t.model.parameters() if name == "mzg" else t.params(a["o"]))):
            return "deleted-unkept"
        elif name == "handover":
            self.removed = True
            n = a["o"]
            if a["how"] == "del" and self.t.prog["layer"][n] and (
                    self.lo.opts[n]._lo_engine.kept_grads is None):
                mine = {id(p) for p in t.params(n)}
                self.left |= {id(p) for p, q in self.pairs if id(p) in mine
                              and p.grad is not None and self._applied(q)}
            if n in self.open and a["how"] == "del":
                return "deleted"
            if n in self.updated and n not in self.stepped:
                return "step-less"
        return None

    def after(self, name: str, a: dict[str, Any]) -> None:
        if name in ("fb", "clip"):
            self._backward()
        elif name in ("step", "zg", "handover"):
            n = a["o"]
            self.open.discard(n)
            self.pending.pop(n, None)
            if name == "step":
                self.stepped.add(n)
                self.applied |= {id(p) for p in self.t.params(n) if p.grad is not None} \
                    & self._lo_ids(n)
            elif name == "zg":
                self.applied -= {id(p) for p in self.t.params(n)}
                self.left -= {id(p) for p in self.t.params(n)}
            else:
                self.stepped.discard(n)
                self.updated.discard(n)
        elif name == "mzg":
            self.applied.clear()
            self.left.clear()
            self.open.clear()
            self.pending.clear()

    def settled(self) -> bool:
        """Whether both sides' parameters and states should be equal now: no attached
        backward's update waits for its ``step()``, and none was left without one (a
        ``zero_grad()`` or a handover first: ``step-less``, found at the handover)."""
        return not self.open and self.updated <= self.stepped

    def _applied(self, q: torch.Tensor) -> bool:
        """Whether layeropt's ``q`` (a backward reached it) was stepped and freed: no
        ``.grad``, and not held in host memory by an offloaded optimizer either."""
        return q.grad is None and not any(offloadfuzz.held_in_host(h, q)
                                          for h in self.lo.offloads.values())

    def _backward(self) -> None:
        """Optimizers the backward gave gradients to are pending; layeropt ones whose
        gradients it applied (freed on layeropt's side) are open - also those whose held
        gradients it applied without reaching them (a stepping backward ends the window of
        ``no_step()`` ones: multifuzz heldclip seed 704,498, a later forward read them)."""
        reached = {id(p): q for (p, q), g in zip(self.pairs, self.grads)
                   if p.grad is not None and (g is None or not torch.equal(g, p.grad))}
        qs = {id(p): q for p, q in self.pairs}
        for n in self.t.opts:
            mine = {id(p) for p in self.t.params(n)} & reached.keys()
            if mine:
                self.pending[n] = None
            was_held = self.held & self._lo_ids(n)
            if any(self._applied(qs[i]) for i in (mine & self._lo_ids(n)) | was_held):
                self.open.add(n)
                self.updated.add(n)


def _ops(prog: dict[str, Any], watch: Watch) -> Iterator[Op]:
    """The program, then ``step()`` of each optimizer a backward left gradients to (a
    loop ends with its step) or that never called it (a loop that never calls ``step()``
    gets one: before it, each backward is a step - docs/rules.md)."""
    yield from prog["ops"]
    for n in dict.fromkeys([*watch.pending, *(n for n in prog["opts"] if n not in watch.stepped)]):
        yield ("step", {"o": n})


def run_program(prog: dict[str, Any]) -> dict[str, Any]:
    """Both sides op by op; the outcome (module docstring)."""
    if prog.get("verify"):
        return _verified(prog)
    if not prog.get("mode"):
        return _run(prog)
    return offloadfuzz.simulated(_run, prog)


# WHY keys verify does not find either (docs/rules.md: a forward reading parameters
# between backward and step() - verified, it reads torch's; remove() inside a step; an
# optimizer handed over or deleted open, whose verifier goes with it, and a gradient it
# applied stepped again by the new one)
VERIFY_BLIND = ("reads-updated", "unkept", "step-less", "deleted", "handed-over",
                "deleted-unkept")
# a step() after verification ended at a forward warns that the steps since were not
# verified (docs/rules.md): a difference there is said, not found
ENDED_AT_FORWARD = "step() after verification ended at a forward"


def _verified(prog: dict[str, Any]) -> dict[str, Any]:
    """tests/verifyfuzz.py's outcomes: the program alone, then verified over every step
    (or its first ``verify_steps``, then in backward)."""
    plain = _run({**prog, "verify": False})
    if plain.get("why") == "never-zeroed" and any(
            name == "handover" for name, _ in prog["ops"][:plain["at"]]):
        plain["why"] = "handed-over"  # (a gradient the old optimizer's step() applied)
    out = {**_run(prog), "plain": plain["status"]}
    ended = out["status"] not in ("exact", "undetectable", "diff")  # (raised)
    if prog.get("verify_steps") and (plain["status"] != "exact" or plain.get("differs")):
        if out.get("differs") and not ended:  # (verify may have ended before what differs
            return {**out, "status": "undetectable", "why": plain.get("why") or "verify-ended"}
        return out  # came; where layeropt alone ends exact, so must this run, unrefused)
    if out.get("verify_ended") and out.get("differs") and not ended:  # (said so)
        return {**out, "status": "undetectable", "why": "verify-ended-at-forward"}
    blind = plain.get("why") in VERIFY_BLIND
    if out.get("differs") and not ended:  # (blind: verify takes the loop as one without
        return ({**out, "status": "undetectable", "why": plain["why"]} if blind  # step()
                else {**out, "status": "verify-diff"})  # at the forward, as layeropt
        # alone does, and says so)
    said = out["status"] == "refused"  # (VerifyError, or a refusal it alone made)
    if plain.get("differs") and plain["status"] in ("exact", "undetectable") and not ended:
        return {**out, "status": "undetectable", "why": plain["why"]} if blind else {
            **out, "status": "verify-silent"}
    if plain["status"] == "exact" and said:
        return {**out, "status": "verify-false-alarm"}
    return out


def _run(prog: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(prog["seed"])
    init = make_net(prog).state_dict()
    out: dict[str, Any] = {"seed": prog["seed"], "mix": prog["mix"], "status": "exact"}
    kinds = [kind for kind, _ in prog["opts"].values()] + [
        a["new"][0] for name, a in prog["ops"] if name == "handover"]
    why = loopfuzz.wrap_of(prog) == "fsdp2" and loopfuzz.no_dtensor_rule(kinds)
    if why:  # (torch's step() raises on FSDP2's shards too)
        return {**out, "status": "torch-error", "error": why, "unrunnable": True}
    t = Side(prog, False, init)
    try:
        lo = Side(prog, True, init)
    except layeropt.LayeroptError as e:  # (an attach refused before any operation)
        return loopfuzz.refused_at_attach(out, e)
    watch = Watch(t, lo)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for i, (name, a) in enumerate(_ops(prog, watch)):
                why = watch.before(name, a)
                if (why is not None and out["status"] == "exact" and not prog.get("verify")
                        and watch.settled()):  # (verified: what verify holds, Watch misses)
                    found = _diff(t.snapshot(), lo.snapshot())  # (what ran before it)
                    if found:
                        return {**out, "status": "diff", "at": i, "before": why,
                                "differences": found[:6]}
                ended = play_both(t, lo, name, a,
                                  lambda: [t.do("step", {"o": n}) for n in t.opts])
                if ended is not None:
                    return {**out, **ended, "at": i, "op": name}
                watch.after(name, a)
                if why is not None and out["status"] == "exact":
                    out.update(status="undetectable", why=why, at=i)
            found = _diff(t.snapshot(), lo.snapshot())
            out["differs"] = bool(found)  # (what verify must have found, if not refused)
            if any(ENDED_AT_FORWARD in str(w.message) for w in said):
                out["verify_ended"] = True  # (a step() said verification had ended)
            if found and out["status"] == "exact":
                return {**out, "status": "diff", "differences": found[:6]}
            return out
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lo.close()


def run_block(mix: str, start: int, n: int, wrap: str | None = None) -> list[dict[str, Any]]:
    """``wrap``: ``"ddp"`` (every mix) or ``"fsdp2"`` (not ``offload``/``ckoffload``:
    offload refuses FSDP2's shards); default ``LAYEROPT_FUZZ_WRAP`` (module docstring)."""
    return loopfuzz.programs(run_program, draw_program, mix, start, n, wrap)


# -- by hand: more programs, one program, a smaller program -------------------------------
SIMPLER = [("aux", False), ("freeze", None), ("ns", []), ("sub", None), ("opt", None),
           ("stn", True), ("kind", "full")]


def minimize(prog: dict[str, Any], status: str) -> dict[str, Any]:
    """The shortest program still ending in ``status``: drop chunks of ops, then simplify
    each op's arguments and the attach settings (delta debugging)."""
    still = loopfuzz.ends_in(run_program, status)

    prog = drop_chunks(prog, "ops", still)
    for i in range(len(prog["ops"])):
        for k, v in SIMPLER:
            cand = copy.deepcopy(prog)
            if k in cand["ops"][i][1] and cand["ops"][i][1][k] != v:
                cand["ops"][i][1][k] = v
                if still(cand):
                    prog = cand
    for k, v in [("akw", {}), ("style", "model")]:
        if prog[k] != v and still({**prog, k: v}):
            prog = {**prog, k: v}
    cand = {k: v for k, v in prog.items() if k != "gkw"}  # (the groups' options alike)
    if cand != prog and still(cand):
        prog = cand
    return prog


if __name__ == "__main__":
    cli(__doc__, MIXES, draw_program, run_program, minimize, tally="why")
