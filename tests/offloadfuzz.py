"""Random training loops with the optimizer state offloaded, on simulated CUDA streams.

tests/loopfuzz.py's programs (every operation a loop makes, shuffled and cut) run again
with layeropt's side offloaded (``layeropt.offload``) in a mode drawn for the program:
overlap or not, fetched ahead or not, one or two copy streams, up to three buckets in
flight, held gradients in host memory, on the device, half and half, or summed on the
device - the modes ``offload_state`` refuses or does not offer yet too. The program may
also stop offloading and start again (``offload``), and resume from a checkpoint into a
new model and optimizer, offloaded again (``resume``).

Every copy runs asynchronously on ``tests/streamsim.py``'s simulated streams, which report
each read or write not ordered after what it depends on. A program passes as loopfuzz's
do (exact, refused, a documented undetectable case); a program that ends exact or
refused with a race is a failure (``race``) as much as a difference is.

    python offloadfuzz.py --mix all --start 0 --n 500
    python offloadfuzz.py --mix toggle --minimize 17

On a GPU, ``LAYEROPT_FUZZ_DEVICE=cuda python tests/offloadfuzz.py --mix all`` runs the
same programs on CUDA with offload's real copy streams (benchmarks/device_check.sh;
not run on a GPU yet).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import pytest

import loopfuzz
from loopfuzz import FAILURES, Side, cli, detach, drop_chunks
from streamsim import offload_in_mode, simulate

MIXES = ["all", "clip", "clipattach", "chaos", "toggle", "thirdparty", "write"]


def draw_mode(r: random.Random) -> dict[str, Any]:
    """An offload mode: ``StateOffload``'s arguments (``held_device_bytes=-2``: half)."""
    held = r.choice(["host", "host", "device", "half", "add"])
    mode = {"overlap": r.random() < 0.5, "prefetch": r.random() < 0.5,
            "copy_streams": r.choice([1, 2]), "max_buckets": r.choice([1, 2, 3]),
            "held_grads": held != "device", "add_on_device": held == "add"}
    if held == "half":
        mode["held_device_bytes"] = -2
    return mode


def draw_program(seed: int, mix: str) -> dict[str, Any]:
    """loopfuzz's program for the mix (``toggle``: ``resume``'s, with offload stopped and
    started at random points), and an offload mode."""
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r}: one of {MIXES}")
    prog = loopfuzz.draw_program(seed, "resume" if mix == "toggle" else mix)
    r = random.Random(seed + 10**7)
    ops = prog["ops"]
    if mix == "toggle":
        for _ in range(r.randint(1, 3)):
            ops.insert(r.randrange(len(ops) + 1), ("offload", {"on": r.random() < 0.5}))
    return {**prog, "mix": mix, "mode": draw_mode(r), "ops": ops}


class OffloadSide(Side):
    """loopfuzz's side; layeropt's with its optimizer state offloaded in the program's mode."""

    def __init__(self, prog: dict[str, Any], layer: bool, init: dict[str, Any]) -> None:
        super().__init__(prog, layer, init)
        self.offload: Any = offload_in_mode(self.opt, prog["mode"]) if layer else None

    def holds(self, p: Any) -> bool:
        """In ``.grad``, or held in host memory (``.grad`` is ``None`` meanwhile)."""
        return super().holds(p) or held_in_host(self.offload, p)

    def do(self, name: str, a: dict[str, Any]) -> None:
        if name == "offload":
            if self.layer and a["on"] and self.offload is None:
                self.offload = offload_in_mode(self.opt, self.prog["mode"])
            elif self.layer and not a["on"] and self.offload is not None:
                self.offload, handle = None, self.offload
                handle.remove()
            return
        super().do(name, a)
        if name == "resume" and self.layer and self.offload is not None:
            self.offload = offload_in_mode(self.opt, self.prog["mode"])  # (the new optimizer)

    def close(self) -> None:
        if self.offload is not None:
            self.offload.remove()
        detach(self.handle)


def held_in_host(handle: Any, p: Any) -> bool:
    """Whether ``p``'s held gradient waits in host memory under the offload ``handle``."""
    return handle is not None and handle.held is not None and p in handle.held


def simulated(run: Callable[[dict[str, Any]], dict[str, Any]], prog: dict[str, Any]
              ) -> dict[str, Any]:
    """``run(prog)``'s outcome with every offload copy on simulated streams; ``race`` if
    it was not a failure already but a copy was not ordered (the first in ``races``)."""
    with pytest.MonkeyPatch.context() as monkeypatch, simulate(monkeypatch) as sim:
        out = run(prog)
    if sim.races and out["status"] not in FAILURES:
        out = {**out, "status": "race", "races": sim.races[:3]}
    return out


def run_program(prog: dict[str, Any]) -> dict[str, Any]:
    """loopfuzz's outcome for the program offloaded, on simulated streams (on a GPU,
    ``LAYEROPT_FUZZ_DEVICE=cuda``: on its own streams, the values the only check)."""
    if loopfuzz.DEVICE.type == "cuda":
        return loopfuzz.run_program(prog, OffloadSide)
    return simulated(lambda p: loopfuzz.run_program(p, OffloadSide), prog)


def run_block(mix: str, start: int, n: int, wrap: str | None = None) -> list[dict[str, Any]]:
    """``wrap``: ``"ddp"`` (offload refuses FSDP2's shards)."""
    return loopfuzz.programs(run_program, draw_program, mix, start, n, wrap)


def minimize(prog: dict[str, Any], status: str) -> dict[str, Any]:
    """loopfuzz's shrinking (ops, their arguments, the setup), then the mode's options
    set to the plainest that still ends in ``status``."""
    still = loopfuzz.ends_in(run_program, status)

    prog = drop_chunks(prog, "ops", still)
    plain = {"overlap": False, "prefetch": False, "copy_streams": 1, "max_buckets": 2,
             "held_grads": True, "add_on_device": False}
    for k, v in plain.items():
        cand = copy.deepcopy(prog)
        if cand["mode"].get(k) != v:
            cand["mode"][k] = v
            if still(cand):
                prog = cand
    cand = copy.deepcopy(prog)
    if cand["mode"].pop("held_device_bytes", None) is not None and still(cand):
        prog = cand
    return prog


if __name__ == "__main__":
    cli(__doc__, MIXES, draw_program, run_program, minimize)
