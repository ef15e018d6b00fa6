"""Does stepping torch's optimizers a bucket at a time give one ``step()``'s numbers, here?

layeropt steps each bucket of parameters during backward with torch's own ``step``
(``layeropt/engine/subset.py``). That is exact where torch's update of a parameter does
not depend on which other parameters the same call gets. This script checks it on a
device, for every torch optimizer with a for-loop, foreach and fused implementation, in
float32, bf16 and fp16: three parameters stepped four times by one ``step()`` each time,
and again as two buckets (the first two, then the third), compared bit for bit (NaN
too). Three ways the whole list can matter:

* ``late``: the third parameter gets its first gradient at the third step (torch's
  foreach SGD with momentum then updates every buffer one tensor at a time);
* ``strided``: the third parameter is a non-dense view, so its gradient's strides differ
  from its own (CUDA's foreach kernels take their fast route only for a list whose
  tensors all match: the other two are then stepped on the slow route too);
* ``ways``: the for-loop against foreach over the whole list (what a param group that
  leaves foreach to torch and mixes CUDA parameters with others takes, by which of
  them have a gradient; layeropt holds such steps: ``engine/wholestep.py``).

A row where buckets differ says whether layeropt's engine holds that step to the end of
backward (``whole_step``): ``held`` (exact, nothing saved that step) or ``SILENT`` (a
silent difference layeropt does not know of: an issue to file). Run by
``benchmarks/device_check.sh`` on a GPU; on the CPU (torch 2.13, 2026-12-06) every row
but foreach SGD with momentum, ``late``, in fp16 / bf16 (held) is exact.

    python benchmarks/subset_ways.py [--device cuda]
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

from layeropt.engine.wholestep import whole_step

# (optimizer, options): torch's classes with a foreach implementation
OPTIMIZERS: list[tuple[str, dict[str, Any]]] = [
    ("SGD", dict(momentum=0.9)), ("SGD", dict(momentum=0.9, nesterov=True)), ("SGD", {}),
    ("Adam", {}), ("Adam", dict(amsgrad=True, weight_decay=0.1)), ("AdamW", {}),
    ("Adagrad", {}), ("RMSprop", dict(momentum=0.9, centered=True)), ("RMSprop", {}),
    ("NAdam", {}), ("NAdam", dict(decoupled_weight_decay=True, weight_decay=0.1)),
    ("Adamax", {}), ("RAdam", {}), ("Adadelta", {}), ("ASGD", {}), ("Rprop", {}),
] + ([("Adafactor", {})] if hasattr(torch.optim, "Adafactor") else [])
FUSED = ("SGD", "Adam", "AdamW", "Adagrad")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits, so that NaN equals NaN and -0.0 differs from 0.0."""
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                                8: torch.int64}[t.element_size()])


def _params(device: str, dtype: torch.dtype, strided: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ps = [torch.randn(6, 5, device=device).to(dtype) for _ in range(2)]
    third = torch.randn(6, 10, device=device).to(dtype)
    ps.append(third[:, ::2] if strided else third[:, :5].contiguous())
    return [p.detach().requires_grad_() for p in ps]


def _run(name: str, kw: dict[str, Any], impl: dict[str, Any], dtype: torch.dtype,
         device: str, buckets: bool, late: bool, strided: bool) -> tuple[list, bool]:
    """The parameters after four steps, and whether layeropt's engine would hold any."""
    ps = _params(device, dtype, strided)
    opt = getattr(torch.optim, name)(ps, lr=0.01, **kw, **impl)
    gen = torch.Generator().manual_seed(1)
    held = False
    for step in range(4):
        grads = [torch.randn(6, 5, generator=gen).to(device, dtype) for _ in ps]
        have = [i for i in range(3) if not (late and step < 2 and i == 2)]
        for i, p in enumerate(ps):
            p.grad = grads[i] if i in have else None
        held = held or whole_step(opt) is not None
        for chunk in ([i for i in have if i < 2], [2] if 2 in have else []) if buckets \
                else (have,):
            for i, p in enumerate(ps):
                p.grad = grads[i] if i in chunk else None
            if chunk:
                opt.step()
    return [_bits(p.detach()) for p in ps], held


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    print(f"{'optimizer':<44} {'impl':<8} {'dtype':<9} {'late':<7} {'strided':<8} ways")
    rows = differ = silent = 0
    errors: dict[str, list[str]] = {}  # torch's error -> the rows where its step raised
    for (name, kw), dtype in itertools.product(OPTIMIZERS, DTYPES):
        impls = ["for-loop", "foreach"] + (["fused"] if name in FUSED else [])
        label = f"{name}({', '.join(f'{k}={v}' for k, v in kw.items())})"
        for impl in impls:
            ikw = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
                   "fused": dict(fused=True)}[impl]
            cells = []
            for late, strided in ((True, False), (False, True)):
                try:
                    whole, _ = _run(name, kw, ikw, dtype, args.device, False, late, strided)
                    parts, held = _run(name, kw, ikw, dtype, args.device, True, late, strided)
                except (RuntimeError, TypeError) as e:  # torch's own step raised
                    errors.setdefault(f"{type(e).__name__}: {e}"[:100], []).append(
                        f"{label} {impl} {str(dtype)[6:]} {'late' if late else 'strided'}")
                    cells.append("error")
                    continue
                rows += 1
                if _same(whole, parts):
                    cells.append("exact")
                else:
                    differ += 1
                    silent += not held
                    cells.append("held" if held else "SILENT")
            ways = ""
            if impl == "foreach":
                try:
                    loop, _ = _run(name, kw, dict(foreach=False), dtype, args.device,
                                   False, False, False)
                    each, _ = _run(name, kw, ikw, dtype, args.device, False, False, False)
                    ways = "same" if _same(loop, each) else "differ"
                except (RuntimeError, TypeError):
                    ways = "error"
            print(f"{label:<44} {impl:<8} {str(dtype)[6:]:<9} {cells[0]:<7} {cells[1]:<8} {ways}")
    for message, where in errors.items():
        print(f"error: torch's step raised {message} ({len(where)} rows, e.g. {where[0]})")
    print(f"buckets against one step(): {rows - differ} of {rows} exact, {differ - silent} "
          f"held by layeropt, {silent} SILENT")
    return 1 if silent else 0


if __name__ == "__main__":
    raise SystemExit(main())
