#!/usr/bin/env bash
# The step benchmarks on one CUDA GPU, fp32 and bf16, plus a ~1B-parameter GPT.
#
#   bash benchmarks/gpu.sh            # results in benchmarks/results/ (or $OUT)
#
# Budget: under 8 minutes on one H100/H200-class GPU (each part is capped by
# `timeout`, so a slow part is cut short rather than the whole run). Needs
# torch with CUDA and layeropt installed (pip install -e .); lomo-optim is
# optional (its rows are skipped with a note when it does not import).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
BENCH="python benchmarks/bench_step.py --device cuda --no-progress"

python - <<'EOF' || { echo "gpu.sh: no CUDA device visible to torch" >&2; exit 1; }
import torch
assert torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  | tee "$OUT/gpu.txt"

part() {  # part NAME SECONDS ARGS...: one benchmark run, its tables saved as NAME.md
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" $BENCH "$@" 2>&1 | tee "$OUT/$name.md"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" = 124 ] && echo "== $name: TIMED OUT (partial tables above)"
}

# ~23M-parameter GPT (with and without per-block checkpointing) and the
# many-small-parameters model, every contender, in fp32 then bf16.
part gpt23m-fp32 100 --dtype fp32 --rounds 20
part gpt23m-bf16 100 --dtype bf16 --rounds 20

# ~1.07B-parameter GPT: fewer contenders so that all copies fit on one GPU
# (fp32: 4.3 GB of parameters + 8.6 GB of Adam state per copy).
BIG="--model gpt gpt-ckpt --size 1b --rounds 5 --contenders adam-fused tutorial layeropt floor"
part gpt1b-bf16 110 --dtype bf16 $BIG
part gpt1b-fp32 130 --dtype fp32 $BIG

echo "results in $OUT/"
