"""Quick GPU check: GPT-like LM, torch.optim.Adam(fused) vs layeropt.Adam(fused).

Prints peak memory (allocator) and step time (median of interleaved pairs),
fp32 and bf16 autocast. Used for the numbers in docs/benchmarks.md (GPU rows).
"""

import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F

import layeropt
from layeropt.memory import PeakMemory
from layeropt.models import TinyGPT


def main() -> None:
    if os.environ.get("DETERMINISTIC"):
        torch.use_deterministic_algorithms(True)  # needs CUBLAS_WORKSPACE_CONFIG=:4096:8
    torch.manual_seed(0)
    dev = "cuda"
    base = TinyGPT(vocab=32768, d=1024, layers=8, heads=16, seq=512).to(dev)
    tokens = torch.randint(0, 32768, (8, 513), device=dev)
    n = sum(p.numel() for p in base.parameters())
    print(f"TinyGPT {n / 1e6:.0f}M params, batch 8x512, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for dtype in (torch.float32, torch.bfloat16):
        ref = copy.deepcopy(base)
        model = copy.deepcopy(base)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-4, fused=True)
        opt = layeropt.Adam(model.parameters(), lr=1e-4, fused=True)
        layeropt.attach(model, opt)

        def step(m, o):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
                logits = m(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            o.step()
            o.zero_grad()

        for _ in range(2):
            step(ref, ref_opt)
            step(model, opt)
        peaks = {}
        for name, (m, o) in {"torch": (ref, ref_opt), "layeropt": (model, opt)}.items():
            with PeakMemory(dev) as mem:
                step(m, o)
            peaks[name] = mem.peak
        ratios = []
        for _ in range(10):
            t = []
            for m, o in ((ref, ref_opt), (model, opt)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(m, o)
                torch.cuda.synchronize()
                t.append(time.perf_counter() - t0)
            ratios.append(t[1] / t[0])
        diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters()))
        print(
            f"{str(dtype):15s} peak torch {peaks['torch'] / 2**20:8.1f} MiB  layeropt "
            f"{peaks['layeropt'] / 2**20:8.1f} MiB ({peaks['layeropt'] / peaks['torch']:.2f}x)  "
            f"step time layeropt/torch {statistics.median(ratios):.3f}  max|dparam| {diff:.2e}"
        )


if __name__ == "__main__":
    main()
