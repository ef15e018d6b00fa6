"""State offload on a GPU: 7B-shaped layers, step time and memory, exactness.

Llama-2-7B-shaped blocks (d=4096, MLP 11008, bf16 parameters, AdamW states in
bf16), batch 1 x 2048 tokens. Contenders: torch.optim.AdamW(fused) (if it
fits), layeropt.AdamW(fused), the same with offload_state (sync), with
overlap=True and with overlap=True + prefetch=True (in landing order). With
``--accumulate N`` each step is a window of N micro-batches (torch sums them;
layeropt holds all but the last in no_step(), the held gradients in pinned host
memory by default, and, as one more contender, on the GPU: held_grads=False).
Prints per contender the median step time, the allocator's peak, the bytes
copied per step and the PCIe rate they imply, and checks that the offloaded
runs equal layeropt without offload bit for bit. ``--unproven`` also runs the
modes ``offload_state`` refuses or does not offer until a GPU run has shown them
exact or measured them: overlap without prefetch over an accumulation window,
overlap + prefetch with copies in and out on two streams
(``StateOffload(copy_streams=2)``), and held sums added on the device
(``HostHeld.add_on_device``). With ``--accumulate`` of 3 or more a later
micro-batch's gradient is added into its held sum, on the host or, in that
last mode, on the GPU; the host's own rate for such an addition is printed
first. ``--trace PREFIX`` profiles one more whole step (every micro-batch, the
step, ``zero_grad``) of the sync, two-stream and sums-on-GPU runs after their
results are taken, into ``PREFIX-<run>.json.gz``: that step trains the model
once more. (On 2026-12-04 the trace, then one backward of the overlapped run,
was taken before its results, so that run had stepped once more than the
others: the "not equal" and the 7.04 GiB copied of that run; see
docs/results/gpu-h200.md.)

    python benchmarks/offload_bench.py --layers 4 --steps 5 [--trace trace]
    python benchmarks/offload_bench.py --layers 4 --steps 3 --accumulate 4 --unproven
    python benchmarks/offload_bench.py --device cpu --tiny   # smoke run (tests), seconds
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import layeropt
from layeropt.offload import StateOffload, offload_state
from layeropt.offload.state import _install


# the runs --trace profiles (a whole step each)
TRACED = ("offload sync", "offload overlap prefetch 2 streams", "offload sync, sums added on GPU")


class Block(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.qkvo = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.gate = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.qkvo:
            x = x + lin(x)
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _offload(opt: torch.optim.Optimizer, unproven: bool, copy_streams: int = 1,
             add_on_device: bool = False, **kw: bool) -> StateOffload:
    """``offload_state(opt, **kw)``; with ``unproven``, a mode it refuses or does not offer
    because no GPU run has shown it exact is built anyway (that run is how it gets shown)."""
    if copy_streams == 1 and not add_on_device:
        try:
            return offload_state(opt, **kw)
        except layeropt.LayeroptError:
            if not unproven:
                raise
    return _install(opt, StateOffload(opt, max_buckets=2, copy_streams=copy_streams,
                                      pooled=True, add_on_device=add_on_device, **kw))


def host_add_rate(d: int, ffn: int, pin: bool, rounds: int = 5) -> str:
    """How fast this host adds one held gradient into its sum (``acc.add_(new)``, bf16,
    pinned for a GPU, the largest layer of a block): the rate to set beside the link's."""
    acc, new = (torch.randn(ffn, d).bfloat16() for _ in range(2))
    if pin:
        acc, new = acc.pin_memory(), new.pin_memory()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        acc.add_(new)
        times.append(time.perf_counter() - t)
    rate = acc.nbytes / statistics.median(times) / 1e9
    return (f"host addition of a held gradient (bf16{', pinned' if pin else ''}, {acc.nbytes / 2**20:.0f} MiB, "
            f"{torch.get_num_threads()} threads): {rate:.1f} GB of the sum per second")


def run(name: str, base: nn.Module, x: torch.Tensor, steps: int, trace: str | None,
        accumulate: int = 1, unproven: bool = False) -> dict:
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = copy.deepcopy(base)
    in_backward = name != "torch fused"
    opt = (layeropt.AdamW if in_backward else torch.optim.AdamW)(model.parameters(), lr=1e-5,
                                                                   fused=True)
    if in_backward:
        layeropt.attach(model, opt)
    handle = None
    if name.startswith("offload"):
        handle = _offload(opt, unproven, 2 if "2 streams" in name else 1,
                          "sums added on GPU" in name,  # (HostHeld.add_on_device)
                          overlap="overlap" in name, prefetch="prefetch" in name,
                          held_grads="held on GPU" not in name)

    def one_step() -> None:  # a window of micro-batches, the step, zero_grad
        for k in range(accumulate):
            loss = model(x).float().square().mean() / accumulate
            if in_backward and k < accumulate - 1:
                with opt.no_step():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()

    times = []
    for _ in range(steps):
        _sync(x.device)
        t = time.perf_counter()
        one_step()
        _sync(x.device)
        times.append(time.perf_counter() - t)
    copied = 0
    if handle:
        handle.synchronize()
        held = handle.held  # (None with held_grads=False; an empty store is falsy)
        copied = (handle.copied_bytes + (held.down_bytes + held.up_bytes
                                         if held is not None else 0)) / steps
    params = [p.detach().clone().cpu() for p in model.parameters()]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    if trace and cuda and name in TRACED:  # after the results are taken: it steps once more
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one_step()
            torch.cuda.synchronize()
        slug = name.removeprefix("offload ").replace(",", "").replace(" ", "-")
        prof.export_chrome_trace(f"{trace}-{slug}.json.gz")
    return dict(name=name, ms=statistics.median(times[1:] or times) * 1e3,
                peak=peak, copied=copied, params=params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--trace", default=None, metavar="PREFIX",
                    help="chrome traces of one more whole step of the runs in TRACED")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small blocks: a smoke run")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--unproven", action="store_true",
                    help="also run the offload modes refused until a GPU run shows them exact")
    args = ap.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: this benchmark times a GPU's copies; "
                 "--device cpu --tiny is its smoke run on the CPU")
    torch.manual_seed(0)
    d, ffn, seq = (64, 172, 16) if args.tiny else (4096, 11008, args.seq)
    device = torch.device(args.device)
    base = nn.Sequential(*(Block(d, ffn) for _ in range(args.layers))).to(device).bfloat16()
    x = torch.randn(1, seq, d, device=device, dtype=torch.bfloat16)
    n = sum(p.numel() for p in base.parameters())
    where = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
    print(f"{args.layers} {'tiny' if args.tiny else 'Llama-2-7B-shaped'} blocks: {n / 1e9:.2f}B "
          f"parameters, bf16, {where}, torch {torch.__version__}, "
          f"{args.accumulate} micro-batch(es) per step")
    if args.accumulate > 2:
        print(host_add_rate(d, ffn, pin=device.type == "cuda"))
    results = []
    names = ["torch fused", "layeropt fused", "offload sync"]
    if args.accumulate > 1:
        names.append("offload sync, held on GPU")
    if device.type == "cuda":
        names += ["offload overlap", "offload overlap prefetch"]  # (a CUDA side stream)
        if args.unproven:  # copies in and out on streams of their own
            names.append("offload overlap prefetch 2 streams")
    if args.unproven and args.accumulate > 1:  # a later micro-batch's sum added on the device
        names.append("offload sync, sums added on GPU")
    for name in names:
        try:
            results.append(run(name, base, x, args.steps, args.trace, args.accumulate,
                               args.unproven))
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory")
        except layeropt.LayeroptError as exc:  # a mode refused for this configuration
            print(f"{name}: refused ({str(exc).split(':')[0]})")
    ref = next((r for r in results if r["name"] == "layeropt fused"), None)
    for r in results:
        same = "" if ref is None or r is ref else (
            "  equal to layeropt: " + str(all(torch.equal(a, b)
                                              for a, b in zip(ref["params"], r["params"]))))
        rate = ""
        if r["copied"] and ref is not None:
            extra = (r["ms"] - ref["ms"]) / 1e3
            rate = f"  {r['copied'] / 2**30:.2f} GiB copied/step ({r['copied'] / max(extra, 1e-9) / 1e9:.1f} GB/s over layeropt's time)"
        print(f"{r['name']:>34}: {r['ms']:8.1f} ms/step  peak {r['peak'] / 2**30:6.2f} GiB{rate}{same}")


if __name__ == "__main__":
    main()
