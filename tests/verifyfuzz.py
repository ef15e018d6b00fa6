"""Random training loops under ``LAYEROPT_VERIFY``: never silent, never a false alarm.

tests/loopfuzz.py's programs run three ways: torch.optim; layeropt attached (loopfuzz's
outcome); layeropt attached with ``verify=`` covering every step of the program (a
quarter of them: the first 1-3 steps, then updating in backward - where layeropt alone
ends exact, so must that run, with no refusal). While
it verifies, layeropt runs the loop with torch's semantics for real and checks at each
``step()`` that the update in backward would have been the same (docs/rules.md, "How to
check your loop"). So the verified run must end with torch's parameters and state bit
for bit, or raise; and:

* ``verify-silent`` (a failure): layeropt alone ends different from torch (run on
  past any documented undetectable case), the verified run raised nothing, and the
  case is not one of those verify is said not to find (``BLIND``: ``remove()`` inside a
  training step, a module's ``zero_grad()`` after ``remove()``, a checkpoint saved there,
  a gradient applied again after ``remove()``, zeros applied again - taken for a
  gradient zeroed in place);
* ``verify-false-alarm`` (a failure): layeropt alone ends exact without reaching a
  documented undetectable case (a loop that never zeroes can end exact by chance - at
  lr 0, say - and verify names its bug), and the verified run raised ``VerifyError``,
  or refused what layeropt alone ran (a tensor ``lr`` taken for one set after backward);
* ``verify-diff`` (a failure): the verified run differs from torch without an error,
  unless it reached one of ``BLIND`` and was equal up to it (verifyfuzz all seed 560,576:
  a module's ``zero_grad()`` after ``remove()``).

Otherwise the outcome is the verified run's (``exact``, ``refused``: ``VerifyError`` or
another refusal, ``torch-error``), with ``plain``: loopfuzz's outcome.

    python verifyfuzz.py --mix all --start 0 --n 500
    python verifyfuzz.py --mix chaos --minimize 17
"""

from __future__ import annotations

import random
from typing import Any

import loopfuzz
from loopfuzz import Side, cli

MIXES = ["all", "clip", "clipattach", "chaos", "thirdparty", "average", "write"]
STEPS = 1000  # verify= for every program: more steps than any program makes
# loopfuzz's undetectable cases verify does not find either (docs/rules.md, "What cannot
# be detected": the last five; and verify watches while attached - "How to check your
# loop" - so a step() again after remove() is torch's there)
# (a no_step() backward onto a gradient never zeroed - "held-onto" - is found at the
# next step(), or there is nothing to find: a zero_grad(set_to_none=False) between leaves
# torch's zeros, which layeropt keeps too)
BLIND = ("remove-discard", "remove-unkept", "remove-dropped", "saved-ahead", "detached",
         "zeros-again")


class VerifySide(Side):
    """loopfuzz's side; layeropt's attached with ``verify=`` the program's
    ``verify_steps``, else ``STEPS``."""

    def attach(self) -> Any:
        if not self.layer:
            return None
        import layeropt

        steps = self.prog.get("verify_steps", STEPS)
        return layeropt.attach(self.model, self.opt, verify=steps, **self.akw, **self.comm)


def draw_program(seed: int, mix: str) -> dict[str, Any]:
    """loopfuzz's program; a quarter of them verify 1-3 steps only (``verify_steps``): the
    loop goes on updating in backward after that, as a user's run does."""
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r}: one of {MIXES}")
    prog = loopfuzz.draw_program(seed, mix)
    r = random.Random(seed + 7 * 10**6)  # (the program's own draws unchanged)
    if r.random() < 0.25:
        prog["verify_steps"] = r.randint(1, 3)
    return prog


def run_program(prog: dict[str, Any]) -> dict[str, Any]:
    """The outcome (module docstring); ``plain``: layeropt's alone, run on past the
    undetectable cases; ``why``: the first undetectable case it reached, if one."""
    first = loopfuzz.run_program(prog)
    if first["status"] == "diff":  # (layeropt alone, before the undetectable case it reached)
        return first
    why = first.get("why")
    if why in ("never-zeroed", "zeros-again", "held-onto") and (
            _detached(prog, first["at"]) or _unzeroed_while_detached(prog)):
        why = "detached"  # (the first such case, or a later one: verify watches neither)
    elif why == "held-onto" and _removed_before_step(prog, first["at"]):
        why = "detached"  # (found at the next step(), which came after remove())
    plain = loopfuzz.run_program(prog, classify=False)["status"]
    verified = loopfuzz.run_program(prog, VerifySide, classify=False)
    out = {**verified, "plain": plain, **({"why": why} if why else {})}
    if why and verified["status"] == "torch-error-only" and verified["at"] >= first["at"]:
        return {**out, "status": "undetectable"}  # (torch's own step at or past that case
    # raised - a step() again on gradients it applied, RMSprop's momentum raised since by
    # a scheduler: verifyfuzz chaos seed 580,488 - where layeropt's had nothing to step)
    if prog.get("verify_steps") and plain != "exact":  # (verify may have ended before
        return {**out, "status": "undetectable" if verified["status"] == "diff"  # what
                else verified["status"], "why": why or "verify-ended"}  # differs came)
    if verified["status"] == "diff":  # (equal up to a case verify cannot see: that case)
        if why in BLIND and loopfuzz.run_program(prog, VerifySide)["status"] == "undetectable":
            return {**out, "status": "undetectable"}
        return {**out, "status": "verify-diff"}
    said = verified["status"] == "refused"  # (VerifyError, or another refusal)
    if plain == "diff" and verified["status"] == "exact":
        return {**out, "status": "undetectable" if why in BLIND else "verify-silent"}
    if plain == "exact" and said and not why:  # (a loop that reached a case layeropt
        return {**out, "status": "verify-false-alarm"}  # cannot see - never zeroed - and
    return out  # ended exact by chance, at lr 0 say, may be said: it is the loop's bug)


def _detached(prog: dict[str, Any], at: int) -> bool:
    """Whether the attachment was removed (not attached again) before op ``at``."""
    detached = False
    for name, _ in prog["ops"][:at]:
        detached = name == "remove" or (detached and name != "attach")
    return detached


def _unzeroed_while_detached(prog: dict[str, Any]) -> bool:
    """Whether a backward after ``remove()`` (not attached again) adds onto gradients no
    ``zero_grad()`` cleared since a ``step()``: torch's kept gradient, which layeropt had
    freed - a never-zeroed loop verify, detached, does not watch."""
    detached = unzeroed = False
    for name, _ in prog["ops"]:
        if name in ("fb", "clip") and detached and unzeroed:
            return True
        detached = name == "remove" or (detached and name != "attach")
        unzeroed = name == "step" or (unzeroed and name != "zg")
    return False


def _removed_before_step(prog: dict[str, Any], at: int) -> bool:
    """Whether ``remove()`` comes after op ``at`` and before the next ``step()``."""
    for name, _ in prog["ops"][at + 1:]:
        if name in ("step", "remove"):
            return name == "remove"
    return False


def run_block(mix: str, start: int, n: int, wrap: str | None = None) -> list[dict[str, Any]]:
    return loopfuzz.programs(run_program, draw_program, mix, start, n, wrap)


def minimize(prog: dict[str, Any], status: str) -> dict[str, Any]:
    still = loopfuzz.ends_in(run_program, status)

    return loopfuzz.drop_chunks(prog, "ops", still)


if __name__ == "__main__":
    cli(__doc__, MIXES, draw_program, run_program, minimize, tally="plain")
