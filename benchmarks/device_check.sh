#!/usr/bin/env bash
# Everything to run on one CUDA GPU, in one go, in under 8 minutes:
#
#   bash benchmarks/device_check.sh      # logs in $OUT (default: benchmarks/results/device)
#
# 1. tests/test_cuda.py (the CPU guarantees on CUDA);
# 2. DDP and FSDP2 over NCCL in one process (examples/ddp_train.py: replicas and
#    torch.optim bit for bit), DDP with overlap on and off;
# 3. the 135M GPT, fp32 and bf16, vs fused Adam (benchmarks/gpu_quick.py), and where a
#    bf16 step's time goes (benchmarks/gpu_profile.py);
# 4. the step tables of gpu.sh, bf16 (23M GPT, many-small; ~1B GPT);
# 5. plan's margin calibration (benchmarks/plan_calibrate.py);
# 6. optimizer state offload (tests/test_cuda_offload.py: sync and overlap bit for bit,
#    held gradients in pinned host memory and prefetch in landing order over
#    accumulation windows, the refused overlap-alone mode built anyway, and FSDP2's
#    CPUOffloadPolicy over NCCL: exact, or refused where torch races;
#    benchmarks/offload_bench.py --unproven: 7B-shaped layers, two micro-batches a step,
#    torch fused AdamW vs layeropt, offload sync / held on GPU / overlap (refused,
#    built anyway) / overlap + prefetch / the same on two copy streams, and a profiler
#    trace of one more overlapped backward, taken after the results,
#    offload-trace.json, to see copies beside the steps);
# 7. the whole Llama-2-7B-shaped model with its state offloaded (benchmarks/offload_7b.py:
#    HF LlamaForCausalLM, bf16, checkpointing, 2 micro-batches, 3 steps; torch fused AdamW
#    uncapped, then offload sync, overlap + prefetch, the same on two copy streams
#    (not offered by offload_state yet), and sync keeping 6 GiB of the held gradients
#    on the GPU (held_device_bytes; `layeropt plan llama-2-7b --gpu-memory 24GiB
#    --accumulate 8` recommends 7.7 GiB with flash attention, 2026-12-05, and this run's
#    eager attention peaked 1.7 GiB above that plan on 2026-12-04), capped at 24 GiB;
#    step times, peak
#    allocated / reserved, bytes copied, parameters and optimizer state bit-identical to
#    torch): ~180 s by the 2026-12-04 numbers (steps 3.4 s torch, 45 s sync, 37 s
#    overlap + prefetch and as much again for two streams, the rest building and copying
#    13 GiB of weights and 25 GiB of state to and from the host; the budget mode about
#    45 s more), so ~435 s for the whole script (the other parts: 209 s; its 300 s limit
#    keeps even a slow run near 8 minutes).
# Each part is capped by `timeout`, so a slow part is cut short, not the rest.
# Copy the logs into docs/results/ with the date and the GPU's name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's layeropt, installed or not

part() {  # part NAME SECONDS COMMAND...: run one part, its output saved as NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$OUT/$name.txt"
}

python -c "import torch, layeropt; assert torch.cuda.is_available(); \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), layeropt.__version__)" \
  | tee "$OUT/gpu.txt" || { echo "device_check.sh: no CUDA device" >&2; exit 1; }

part cuda-tests 50 python -m pytest tests/test_cuda.py -q -p no:cacheprovider
part ddp-nccl 30 python examples/ddp_train.py --device cuda --nproc 1 --tiny
part ddp-nccl-no-overlap 30 python examples/ddp_train.py --device cuda --nproc 1 --tiny --no-overlap
part fsdp2-nccl 30 python examples/ddp_train.py --device cuda --nproc 1 --tiny --fsdp
part gpu-quick 60 python benchmarks/gpu_quick.py
part bf16-profile 60 python benchmarks/gpu_profile.py
BENCH="python benchmarks/bench_step.py --device cuda --no-progress --dtype bf16"
part gpt23m-bf16 70 $BENCH --rounds 10
part gpt1b-bf16 70 $BENCH --model gpt --size 1b --rounds 3 --contenders adam-fused layeropt floor
part plan-calibrate 50 python benchmarks/plan_calibrate.py
part offload-tests 60 python -m pytest tests/test_cuda_offload.py -q -p no:cacheprovider
part offload-bench 90 python benchmarks/offload_bench.py --layers 4 --steps 3 --accumulate 2 --unproven --trace "$OUT/offload-trace.json"
part offload-7b 300 python benchmarks/offload_7b.py --modes torch sync overlap-prefetch two-streams budget --budget-gib 6 --micro 2 --steps 3
echo "logs in $OUT/"
