#!/usr/bin/env bash
# The 8B GRPO step at TRL's colocate defaults on two software stacks side by side, one flow per GPU (four GPUs):
#
#   bash benchmarks/compare_stacks.sh KIT_A KIT_B RESULTS_DIR
#
# KIT_A, KIT_B: kit folders made by tests/gpu/kit/build-kit.sh and staged on this host (e.g. .gpu-vllm-0.26 and
# .gpu-vllm-0.31). GPUs 0 and 1 run KIT_A's `fp8_defaults` and `trl_bf16`, GPUs 2 and 3 KIT_B's, all four at once
# (bench_grpo's colocate-defaults shape: vLLM at 0.3 of the GPU in sleep mode, 8-bit AdamW, 128 x 2048 a step).
# Writes RESULTS_DIR/grpo_stacks_8b_<stack>_<run>.json; logs go to $WORK (default /var/tmp/trl_fp8_stacks).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 3 ] || { echo "usage: $0 KIT_A KIT_B RESULTS_DIR" >&2; exit 2; }
results=$(realpath -m "$3")
work=${WORK:-/var/tmp/trl_fp8_stacks}
mkdir -p "$results" "$work"
shape=(--shape 8b --optim adamw_bnb_8bit --sleep_mode --vllm_memory 0.3 --completion_len 2048 --generation_batch 128
       --steps 3 --warmup 1)
gpu=0
pids=()
for kit in "$1" "$2"; do
  stack=$(basename "$kit")
  stack=${stack#.gpu-}
  for run in fp8_defaults trl_bf16; do
    # Each flow in its own shell with its kit's site on PYTHONPATH, and its own rendezvous port.
    (source "$kit/setup.sh" >/dev/null && CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29610 + gpu)) PYTHONUNBUFFERED=1 \
      python -m benchmarks.bench_grpo "${shape[@]}" --runs "$run" --workdir "$work/$stack-$run" \
      --out "$results/grpo_stacks_8b_${stack}_${run}.json") >"$work/$stack-$run.log" 2>&1 &
    pids+=($!)
    gpu=$((gpu + 1))
  done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
echo "compare_stacks.sh finished, status $status"
exit $status
