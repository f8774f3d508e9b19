#!/usr/bin/env bash
# Every GPU run behind the end-to-end report (the speed and accuracy sections of benchmarks/README.md), in one go:
#
#   bash benchmarks/run_report.sh [RESULTS_DIR]      # GPU host with vLLM; then: python -m benchmarks.plot_results
#
# - speed: bench_grpo.py, Qwen3-8B shape, bitsandbytes 8-bit AdamW, 64 x 1024-token rollouts per step, four runs;
# - accuracy: pretrain.py (a 76M Qwen3 taught addition), then run_grpo.py's five settings at once, seeds 0 and 1.
# With two GPUs the speed runs have GPU 1 to themselves while the accuracy runs share GPU 0; with one GPU they run
# one after the other. Logs go to $WORK (default /var/tmp/trl_fp8_report), results to RESULTS_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
results=$(realpath -m "${1:-benchmarks/results}")
work=${WORK:-/var/tmp/trl_fp8_report}
mkdir -p "$results/convergence" "$work"
device=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
export PYTHONUNBUFFERED=1

speed() {
  # Its own rendezvous port: TRL takes the first free one of a fixed list (29500 first) for every colocated engine,
  # and two engines starting at once on one host (here, next to the accuracy runs) can both take it.
  MASTER_PORT=29610 python -m benchmarks.bench_grpo --shape 8b --optim adamw_bnb_8bit --workdir "$work/speed" \
    --runs trl_bf16 fp8_rollout unified unified_fp8kv --out "$results/grpo_speed_$device.json"
}
accuracy() {
  python -m benchmarks.convergence.pretrain --out "$work/arith-base" \
    --results "$results/convergence/pretrain_$device.json" &&
    python -m benchmarks.convergence.run_grpo --model "$work/arith-base" --setting all --parallel \
      --workdir "$work/convergence" --results_dir "$results/convergence" &&
    python -m benchmarks.convergence.run_grpo --model "$work/arith-base" --setting all --parallel --seed 1 \
      --workdir "$work/convergence_seed1" --results_dir "$results/convergence_seed1"
}

status=0
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=1 speed >"$work/speed.log" 2>&1 &
  pid=$!
  CUDA_VISIBLE_DEVICES=0 accuracy >"$work/accuracy.log" 2>&1 || status=1
  wait $pid || status=1
else
  speed >"$work/speed.log" 2>&1 || status=1
  accuracy >"$work/accuracy.log" 2>&1 || status=1
fi
echo "run_report.sh finished, status $status" | tee -a "$work/speed.log" "$work/accuracy.log"
exit $status
