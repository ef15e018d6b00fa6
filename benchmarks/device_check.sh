#!/usr/bin/env bash
# Everything to run on one CUDA GPU, in one go, in under 9 minutes:
#
#   bash benchmarks/device_check.sh      # logs in $OUT (default: benchmarks/results/device)
#
# In this order:
# 1. tests/test_cuda.py (the CPU guarantees on CUDA);
# 2. optimizer state offload: tests/test_cuda_offload.py (sync and overlap bit for bit,
#    held gradients in pinned host memory and prefetch in landing order over
#    accumulation windows, the refused overlap-alone mode built anyway, and FSDP2's
#    CPUOffloadPolicy over NCCL: exact, or refused where torch races);
#    benchmarks/offload_bench.py --unproven: 7B-shaped layers, four micro-batches a step
#    (two of them added into held sums: on the host, or on the GPU in the sums-on-GPU
#    run; the host's own addition rate printed first), torch fused AdamW vs layeropt,
#    offload sync / held on GPU / overlap (refused, built anyway) / overlap + prefetch /
#    the same on two copy streams / sums added on the GPU, and profiler traces of one
#    more whole step of the sync, two-stream and sums-on-GPU runs, taken after the
#    results (offload-trace-*.json.gz);
# 3. plan's margin calibration (benchmarks/plan_calibrate.py);
# 4. the whole Llama-2-7B-shaped model with its state offloaded (benchmarks/offload_7b.py:
#    HF LlamaForCausalLM, bf16, checkpointing, 2 micro-batches, 3 steps; torch fused AdamW
#    uncapped, then offload sync, overlap + prefetch, the same on two copy streams
#    (not offered by offload_state yet), and sync keeping 6 GiB of the held gradients
#    on the GPU (held_device_bytes; `layeropt plan llama-2-7b --gpu-memory 24GiB
#    --accumulate 8` recommends 7.7 GiB with flash attention, 2026-12-05, and this run's
#    eager attention peaked 1.7 GiB above that plan on 2026-12-04), capped at 24 GiB;
#    step times, peak allocated / reserved, bytes copied, parameters and optimizer state
#    bit-identical to torch): ~225 s by the 2026-12-04 numbers (steps 3.4 s torch, 45 s
#    sync, 37 s overlap + prefetch and as much again for two streams, 45 s for the
#    budget, the rest building and copying 13 GiB of weights and 25 GiB of state to and
#    from the host); the sync mode's second step with the allocator's trace on, and what
#    was alive at its peak by where it was allocated (benchmarks/memory_peak.py: the GiB
#    the plan's replay does not see), in the log and offload-7b-peak.txt;
# 5. random loop programs with the state offloaded in every mode on the GPU's real copy
#    streams (tests/offloadfuzz.py, LAYEROPT_FUZZ_DEVICE=cuda: torch.optim and layeropt
#    on the GPU, bit for bit, or refused; the CPU checks their order on simulated
#    streams; never run on a GPU yet, ~40 s by the CPU's pace);
# 5b. plan's calibration again for llama-3.2-1b with eager attention and clipping
#    (--attention eager --max-norm 1: the 7B run's two settings the plan models since
#    2026-12-07; its replay still fell 1.06 GiB short of that run's reserved memory);
# 6. torch's optimizers stepped a bucket at a time against one step() on the GPU
#    (benchmarks/subset_ways.py: every implementation and dtype, a parameter's first
#    gradient late, a non-dense parameter; a SILENT row is a difference layeropt does
#    not hold; ~4 s on the CPU);
# 7. DDP and FSDP2 over NCCL in one process (examples/ddp_train.py: replicas and
#    torch.optim bit for bit), DDP with overlap on and off;
# 8. the 135M GPT, fp32 and bf16, vs fused Adam (benchmarks/gpu_quick.py), the step
#    tables of gpu.sh in bf16 (~1B GPT; 23M GPT, many-small), and where a bf16 step's
#    time goes (benchmarks/gpu_profile.py).
# On 2026-12-04 every part but the 7B one ran in 209 s together: ~435 s in all, and up to
# 60 s more for part 5b (added 2026-12-07, not yet run; the parts after it are the ones
# a GPU has run before, cut first if time runs short).
# Each part is capped by `timeout` and by what is left of DEADLINE (default 540 s, under
# the device tool's 600 s a command): a slow part is cut short, not the rest, and a part
# with under 15 s left is skipped, saying so. The parts run in the order of what waits
# for a GPU most (issue 38's offload parts first, after the CUDA tests).
# What comes back: the device tool returns at most 8 files from $OUT, so every part's
# output goes to one log, $OUT/device-check.log, as it runs (it survives a cut), and
# the per-part logs and the traces are packed into $OUT/parts.tar.gz at the end.
# Copy the logs into docs/results/ with the date and the GPU's name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/device}
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT"
PARTS=$(mktemp -d)
LOG="$OUT/device-check.log"
: > "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's layeropt, installed or not
export PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...: run one part, its output saved as NAME.txt
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "== $name: skipped, ${left}s of the ${DEADLINE}s left" | tee -a "$LOG"
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$PARTS/$name.txt" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$PARTS/$name.txt" "$LOG"
}

python -c "import torch, layeropt; assert torch.cuda.is_available(); \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), layeropt.__version__)" \
  2>&1 | tee -a "$LOG" || { echo "device_check.sh: no CUDA device" >&2; exit 1; }
git log -1 --format='commit %h %cd' 2>/dev/null | tee -a "$LOG"

part cuda-tests 50 python -m pytest tests/test_cuda.py -q -p no:cacheprovider
part offload-tests 60 python -m pytest tests/test_cuda_offload.py -q -p no:cacheprovider
part offload-bench 90 python benchmarks/offload_bench.py --layers 4 --steps 3 --accumulate 4 --unproven --trace "$PARTS/offload-trace"
part plan-calibrate 50 python benchmarks/plan_calibrate.py
part offload-7b 300 python benchmarks/offload_7b.py --modes torch sync overlap-prefetch two-streams budget --budget-gib 6 --micro 2 --steps 3 --memory-trace "$PARTS/offload-7b-peak.txt"
part offload-fuzz 40 env LAYEROPT_FUZZ_DEVICE=cuda python tests/offloadfuzz.py --mix all --n 150
part plan-calibrate-eager-clip 60 python benchmarks/plan_calibrate.py --models llama-3.2-1b --attention eager --max-norm 1
part subset-ways 20 python benchmarks/subset_ways.py --device cuda
part ddp-nccl 30 python examples/ddp_train.py --device cuda --nproc 1 --tiny
part ddp-nccl-no-overlap 30 python examples/ddp_train.py --device cuda --nproc 1 --tiny --no-overlap
part fsdp2-nccl 30 python examples/ddp_train.py --device cuda --nproc 1 --tiny --fsdp
part gpu-quick 60 python benchmarks/gpu_quick.py
BENCH="python benchmarks/bench_step.py --device cuda --no-progress --dtype bf16"
part gpt1b-bf16 70 $BENCH --model gpt --size 1b --rounds 3 --contenders adam-fused layeropt floor
part gpt23m-bf16 70 $BENCH --rounds 10
part bf16-profile 60 python benchmarks/gpu_profile.py
tar -czf "$OUT/parts.tar.gz" -C "$PARTS" . && echo "logs in $LOG and $OUT/parts.tar.gz" | tee -a "$LOG"
