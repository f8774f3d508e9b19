#!/usr/bin/env bash
# The GPU runs behind the rollout and training-speed sections of docs/contributing/benchmark-details.md, in phases;
# several phases run in the order
# given (`bash benchmarks/run_rollout_report.sh linear suite rollout`). `source .gpu/setup.sh` first; results and
# logs go to $WORK, default /var/tmp/trl_fp8_rollout_report, never into the tree.
#
#   bash benchmarks/run_rollout_report.sh kernels   # the GPU kernel tests alone (a minute: do the kernels run here?)
#   bash benchmarks/run_rollout_report.sh rollout   # bench_rollout: $ROLLOUT_ENGINES (default six) x four points
#   bash benchmarks/run_rollout_report.sh capacity  # bench_rollout at matched memory: bf16 / FP8 / FP8 + FP8 KV at
#                                                   # $CAPACITY_SHARES (default 0.3) of the GPU, 256x2048 and 128x4096
#   bash benchmarks/run_rollout_report.sh concurrency # the same engines capped at $CAPACITY_SEQS sequences at once
#   bash benchmarks/run_rollout_report.sh moedecode # Qwen3-30B-A3B's experts on each of vLLM's MoE backends ($MOE_ENGINES)
#   bash benchmarks/run_rollout_report.sh decode    # where a decode step's time goes: every engine variant at 0.3,
#                                                   # 256x2048, each profiled at 256x512 ($DECODE_ENGINES)
#   bash benchmarks/run_rollout_report.sh decodeattn # bench_decode_attention: decode attention on the FP8 KV cache,
#                                                   # each kernel against its KV-read floor (128 x 256/1,024/2,048)
#   bash benchmarks/run_rollout_report.sh moeexperts # bench_moe_decode: one Qwen3-30B-A3B MoE layer's experts at decode
#                                                   # (16-512 tokens), BF16 vs block FP8 on vLLM's Triton fused MoE
#                                                   # (± trl-fp8's SiLU-and-mul kernel) and DeepGEMM, each against the
#                                                   # routed experts' weight-read floor, with its parts ($MOE_EXPERTS_ARGS)
#   bash benchmarks/run_rollout_report.sh colocate  # bench_grpo at TRL's colocate defaults (8B, 0.3, sleep mode, 8-bit
#                                                   # AdamW, 128 x 2048): $COLOCATE_RUNS, one call each, one file,
#                                                   # $COLOCATE_STEPS steps (default 3: two timed)
#                                                   # (COLOCATE_GPUS="0 1 2 3": dealt over those GPUs, at once)
#   bash benchmarks/run_rollout_report.sh bestfit   # the same, each of $BESTFIT_RUNS at growing $BESTFIT_SHARES until
#                                                   # one fails (out of memory): the largest share each flow runs at
#   bash benchmarks/run_rollout_report.sh pack      # the JIT caches (DeepGEMM, FlashInfer, vLLM, Triton, Inductor) into
#                                                   # $WORK/jit_<cache>.tgz.part*, 15 MB parts, one series each
#   bash benchmarks/run_rollout_report.sh suite     # the GPU test suite, one command ($SUITE_LANES processes a GPU)
#   bash benchmarks/run_rollout_report.sh checks    # GPU test suite, identity per kernel, the 16k-token point
#   bash benchmarks/run_rollout_report.sh linear    # bench_linear (host vs kernel profile), bench_gemm (cuBLAS vs DeepGEMM)
#   bash benchmarks/run_rollout_report.sh gemm      # bench_gemm alone
#   bash benchmarks/run_rollout_report.sh quant     # bench_quant: our quantization kernels against the HBM floor
#   bash benchmarks/run_rollout_report.sh train     # bench_host + bench_train_step: the training phase without vLLM
#   bash benchmarks/run_rollout_report.sh grpo      # bench_grpo ($GRPO_RUNS), TRL BF16 vs unified FP8, profiled
#   bash benchmarks/run_rollout_report.sh moestep   # bench_grpo on the reduced Qwen3-30B-A3B: $MOE_RUNS one after the other
#                                                   # ($MOE_STEPS steps, default 4: three timed)
#   bash benchmarks/run_rollout_report.sh moeprofile # the same, the BF16 twin and FP8's defaults, step 2's rollout profiled
#   bash benchmarks/run_rollout_report.sh hostprobe # the engine in the trainer (bench_grpo --engine_probe) and alone
#                                                   # (trainer's sampling, prefix caching on, TRL's executor): where the
#                                                   # decode step's extra host time comes from
#   bash benchmarks/run_rollout_report.sh four      # bench_grpo: the four runs of `long` at 64 x 1024 on the 8B shape
#   bash benchmarks/run_rollout_report.sh long      # bench_grpo's long regime ($LONG_RUNS): 128 x 4096 tokens, 1.7B
#   bash benchmarks/run_rollout_report.sh kvprofile # the long regime's rollout (1.7B, 128 x 4096), kernel time profiled
#   bash benchmarks/run_rollout_report.sh fp8kv     # the FP8 KV cache's cost in training: pre-train the addition model,
#                                                   # then GRPO bf16 / fp8_tis / fp8_tis_fp8kv side by side (one seed)
#   bash benchmarks/run_rollout_report.sh chain     # pre-train the long-completion model, GRPO x 5 settings x 2 seeds
#                                                   (one GPU or two: a seed per GPU)
#   bash benchmarks/run_rollout_report.sh chainbase # pre-train it alone; a BF16 copy in 15 MB parts, $WORK/chain_base.part.*
#   bash benchmarks/run_rollout_report.sh chainkv   # the FP8 KV cache at 860-1,436-token completions: pre-train, then GRPO
#                                                   # BF16 / FP8 + TIS / FP8 + TIS + FP8 KV at once (one GPU, one seed)
#   bash benchmarks/run_rollout_report.sh multi     # two GPUs: tests/gpu/test_multi_gpu.py, GRPO on 1 GPU vs 2 (FSDP2)
#   bash benchmarks/run_rollout_report.sh scaling   # 1, 2 and 4 GPUs (DDP, FSDP2): 8B TRL BF16 vs FP8 + FP8 KV per GPU
#                                                   # count, then benchmarks.collect_scaling's table ($SCALING_SPECS)
#   bash benchmarks/run_rollout_report.sh contention # one 8B run per GPU, all at once: the host's share of the
#                                                   # several-GPU slowdown, without NCCL ($CONTENTION_RUN)
#
# A later host can start `chain` from the base of an earlier one (the same model for every lease, and 6-7 minutes
# saved): bring the parts back (four files of 15 MB per call), keep them in git-ignored folders of three (.gpu/cb1 ...),
# send each in a call of its own with `mkdir -p /var/tmp/cbparts && cp .gpu/cbN/part.* /var/tmp/cbparts/`, then run
# `CHAIN_BASE_PARTS=/var/tmp/cbparts bash benchmarks/run_rollout_report.sh chain`.
#
# `grpo` trains with bitsandbytes' 8-bit AdamW (an 8B step beside its engine fits one GPU so), which the GPU kit lacks:
#   pip download bitsandbytes==0.50.2 --no-deps --only-binary :all: --python-version 3.12 \
#     --platform manylinux_2_24_x86_64 -d .gpu/bnb
# then add "$kit"/bnb to the wheel loop of .gpu/setup.sh and stage .gpu/bnb in a call of its own (41 MB).
#
# DeepGEMM's compiled kernels go to $DG_JIT_CACHE_DIR (default /var/tmp/dg_cache). The first DeepGEMM engine on a
# fresh host pays the cold compile (recorded in its row as jit_cache.state "cold"), the first FP8-KV engine FlashInfer's
# builds (its FP8 prefill, about 110 s, and XQA), every engine vLLM's compilation. `pack` writes each of these caches
# to $WORK/jit_<cache>.tgz.part* (sizes in status.txt); a later host unpacks the series found in $JIT_CACHE_PARTS (or
# DeepGEMM's alone, dg_cache.tgz.part* as `pack` once wrote it, in $DG_CACHE_PARTS) before its first phase, so its
# engines start warm. `rollout` appends to its results file: engines run in separate calls share one table.
set -uo pipefail
cd "$(dirname "$0")/.."
work=${WORK:-/var/tmp/trl_fp8_rollout_report}
mkdir -p "$work"
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/var/tmp/dg_cache} PYTHONUNBUFFERED=1
export VLLM_LOGGING_STREAM=ext://sys.stderr  # vLLM's log beside our progress lines, live in the phase's logs
jit_cache_dirs() {  # name path: the JIT caches `pack` carries to later hosts
  echo "dg $DG_JIT_CACHE_DIR"
  echo "flashinfer $HOME/.cache/flashinfer"
  echo "vllm ${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}"
  echo "triton ${TRITON_CACHE_DIR:-$HOME/.triton}"
  echo "inductor ${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}"
}
unpack_jit_cache() {  # name path part...: one cache's parts into its folder, unless none came or the folder is there
  local name=$1 path=$2
  shift 2
  [ -e "$1" ] && [ ! -d "$path" ] || return 0
  mkdir -p "$(dirname "$path")"
  cat "$@" | tar -C "$(dirname "$path")" -xzf -
  echo "jit cache $name unpacked into $path: $(find "$path" -type f | wc -l) files" | tee -a "$work/status.txt"
}
unpack_jit_cache dg "$DG_JIT_CACHE_DIR" "${DG_CACHE_PARTS:-/nonexistent}"/dg_cache.tgz.part*
if [ -n "${JIT_CACHE_PARTS:-}" ]; then
  while read -r name path; do
    unpack_jit_cache "$name" "$path" "$JIT_CACHE_PARTS"/jit_"$name".tgz.part*
  done < <(jit_cache_dirs)
fi
device=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")

# ENGINE_KWARGS='{"enable_prefix_caching": false}': vLLM arguments over the trainer's own in `moestep` and `colocate`
engine_kwargs=()
if [ -n "${ENGINE_KWARGS:-}" ]; then engine_kwargs=(--engine_kwargs "$ENGINE_KWARGS"); fi

timed() {  # name command...: run, log, record exit code and seconds
  local name=$1 start=$SECONDS
  shift
  "$@" >"$work/$name.log" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - start))" | tee -a "$work/status.txt"
}

in_lanes() {  # name "gpu ..." "item ..." out_prefix command...: item i on GPU i mod (number of GPUs), the GPUs at
  # once, each GPU's items one after the other into one file per GPU ($out_prefix<gpu>.json); the files made are left
  # in $lane_files. Each GPU's command gets its own --workdir and MASTER_PORT.
  local name=$1 prefix=$4 g i
  local -a gpus items mine
  read -r -a gpus <<<"$2"
  read -r -a items <<<"$3"
  shift 4
  for g in "${!gpus[@]}"; do
    mine=()
    for i in "${!items[@]}"; do [ $((i % ${#gpus[@]})) -eq "$g" ] && mine+=("${items[$i]}"); done
    [ "${#mine[@]}" -eq 0 ] && continue
    (for item in "${mine[@]}"; do
      CUDA_VISIBLE_DEVICES=${gpus[$g]} MASTER_PORT=$((29700 + 10 * g)) timed "${name}_${item}" "$@" "$item" \
        --workdir "$work/lane${gpus[$g]}" --append --out "$prefix${gpus[$g]}.json"
    done) &
  done
  wait
  lane_files=()
  for g in "${gpus[@]}"; do [ -f "$prefix$g.json" ] && lane_files+=("$prefix$g.json"); done
}

chain_pretrain() {  # the 101M addition-chain model, pre-trained to $CHAIN_TARGET held-out accuracy, into $work/chain-base
  # Pre-training stops at its first evaluation >= CHAIN_TARGET: the 2026-11-23 models stayed at chance, then jumped
  # between steps 500 and 600 (5.5-6.7 min), so its time limit leaves room for a later jump.
  timed chain_pretrain python -m benchmarks.convergence.pretrain --task chain --size medium --out "$work/chain-base" \
    --batch_size 64 --eval_every 50 --eval_problems 128 --target_accuracy "${CHAIN_TARGET:-0.3}" \
    --max_minutes "${CHAIN_PRETRAIN_MIN:-7.5}" --results "$work/convergence_chain/pretrain_$device.json"
}

gpu_tests() {  # name test-path: the GPU suite (or part of it) as docs/tests.md runs it, artifacts into $work
  TRL_FP8_ARTIFACTS=$work timed "$1" python -m pytest -m gpu "$2" -s -p no:cacheprovider --durations=15
}

gpu_suite() {  # the whole GPU suite in one command; $SUITE_LANES one-GPU test processes a GPU (--lanes-per-gpu)
  TRL_FP8_ARTIFACTS=$work timed gpu_suite python tests/gpu/run_suite.py --logs "$work/gpu_suite" \
    --lanes-per-gpu "${SUITE_LANES:-1}"
}

[ $# -gt 0 ] || set -- usage
for phase in "$@"; do
case "$phase" in
kernels)
  timed kernel_tests python -m pytest -m gpu tests/gpu/test_kernels_gpu.py -p no:cacheprovider
  ;;
rollout)
  engines=${ROLLOUT_ENGINES:-fp8_deepgemm_kv fp8_deepgemm_kv_inductor_quant fp8_deepgemm fp8_deepgemm_inductor_quant bf16 vllm_fp8}
  # shellcheck disable=SC2086
  timed "rollout_${engines// /+}" python -m benchmarks.bench_rollout --engines $engines \
    --points 64x1024 256x1024 1024x1024 64x4096 --append --out "$work/rollout_$device.json"
  ;;
capacity)  # matched memory: every engine gets the same share of the GPU ($CAPACITY_SHARES, one results file each)
  # CAPACITY_PROFILE=SxN: one more rollout per engine under the profiler (kernel time by category, GPU idle time).
  # CAPACITY_GPUS="0 1 2 3": the engines dealt over these GPUs, the GPUs at once (benchmarks.merge_results joins them).
  # CAPACITY_SHAPE: another bench_rollout shape than 8B (its name joins the file's).
  for share in ${CAPACITY_SHARES:-0.3}; do
    out="$work/rollout_capacity${CAPACITY_SHAPE:+_$CAPACITY_SHAPE}_mem${share}_$device.json"
    # shellcheck disable=SC2086
    capacity=(python -m benchmarks.bench_rollout --points ${CAPACITY_POINTS:-256x2048 128x4096} --prompt_len 256
      --gpu_memory_utilization "$share" ${CAPACITY_PROFILE:+--profile_point "$CAPACITY_PROFILE"}
      ${CAPACITY_SHAPE:+--shape "$CAPACITY_SHAPE"})
    engines=${CAPACITY_ENGINES:-bf16 fp8_deepgemm fp8_deepgemm_kv}
    if [ -n "${CAPACITY_GPUS:-}" ]; then
      in_lanes "capacity_mem$share" "$CAPACITY_GPUS" "$engines" "$work/capacity_mem${share}_gpu" "${capacity[@]}" --engines
      python -m benchmarks.merge_results "${lane_files[@]}" --same shape prompt_len gpu_memory_utilization max_num_seqs \
        --id_key engine --out "$out"
    else
      # shellcheck disable=SC2086
      timed "capacity_mem$share" "${capacity[@]}" --engines $engines --append --out "$out"
    fi
  done
  ;;
decode)  # the default engines and one-setting variants (bench_rollout.ENGINE_LLM_KWARGS: the activation quantizers
  # Inductor's, Triton's attention, KV pages of 64 tokens, FlashInfer's as a speed reference, prefix caching on as in
  # TRL's engines), each profiled: what wins a decode step back
  CAPACITY_POINTS=${CAPACITY_POINTS:-256x2048} CAPACITY_PROFILE=${CAPACITY_PROFILE:-256x512} \
    CAPACITY_ENGINES=${DECODE_ENGINES:-bf16 fp8_deepgemm fp8_deepgemm_kv fp8_deepgemm_kv_inductor_quant \
    fp8_deepgemm_kv_triton_attn fp8_deepgemm_kv_block64 fp8_deepgemm_inductor_quant fp8_deepgemm_kv_flashinfer \
    bf16_prefix_caching fp8_deepgemm_prefix_caching fp8_deepgemm_trl_engine} bash benchmarks/run_rollout_report.sh capacity
  ;;
hostprobe)  # why the trainer's engine decodes the reduced Qwen3-30B-A3B's 64 x 1,024 slower than the same engine alone
  # (bench_rollout, prefix caching off, no log-probs), in up to three parts ($HOSTPROBE_PARTS, default all three):
  # `grpo`: $MOE_RUNS (default the FP8 defaults) with --engine_probe (the trainer's engine after training, with the
  # trainer's sampling, without log-probs, with bench_rollout's, with the memory sampler's thread running, with the
  # garbage collector off); `alone`: that engine alone ($HOSTPROBE_ENGINES, default with prefix caching off, on, and
  # built with TRL's executor, external_launcher), each with the trainer's sampling and bench_rollout's; `grpo_no_pc`:
  # the trainer's step again with its engine's prefix caching off. Every rollout's host time per engine step by call
  # (benchmarks/host_timers.py)
  for part in ${HOSTPROBE_PARTS:-grpo alone grpo_no_pc}; do
    case $part in
    grpo)
      # shellcheck disable=SC2086
      MASTER_PORT=29650 timed hostprobe_grpo python -m benchmarks.bench_grpo --shape 30b-a3b-12l --optim adamw_bnb_8bit \
        --runs ${MOE_RUNS:-fp8_defaults} --warmup 1 --steps 2 --engine_probe --workdir "$work/moe" \
        --out "$work/grpo_moe_30b_a3b_12l_engine_probe_$device.json" ;;
    alone)
      # shellcheck disable=SC2086
      timed hostprobe_alone python -m benchmarks.bench_rollout --shape 30b-a3b-12l \
        --engines ${HOSTPROBE_ENGINES:-fp8_deepgemm fp8_deepgemm_prefix_caching fp8_deepgemm_trl_engine} \
        --points 64x1024 --prompt_len 128 --gpu_memory_utilization 0.3 --sampling trainer --compare_sampling bench \
        --workdir "$work/alone" --out "$work/rollout_alone_30b_a3b_12l_trainer_sampling_$device.json" ;;
    grpo_no_pc)  # what the engine's prefix caching costs inside the trainer
      # shellcheck disable=SC2086
      MASTER_PORT=29650 timed hostprobe_grpo_no_prefix_caching python -m benchmarks.bench_grpo --shape 30b-a3b-12l \
        --optim adamw_bnb_8bit --runs ${MOE_RUNS:-fp8_defaults} --warmup 1 --steps 2 \
        --engine_kwargs '{"enable_prefix_caching": false}' --workdir "$work/moe" \
        --out "$work/grpo_moe_30b_a3b_12l_no_prefix_caching_$device.json" ;;
    *) echo "hostprobe: no part $part (grpo, alone, grpo_no_pc)" >&2; exit 2 ;;
    esac
  done
  ;;
moedecode)  # the Qwen3-30B-A3B shape's experts on each of vLLM's block-FP8 MoE backends (Triton, vLLM's choice, also with
  # trl-fp8's SiLU-and-mul quantization kernel between its two GEMMs, as the trainer's engines run it; DeepGEMM's
  # grouped GEMM with its warm-up; FlashInfer's CUTLASS; vLLM 0.26 runs no CUTLASS MoE of its own on block-FP8 experts),
  # dense layers on DeepGEMM, beside BF16, each profiled:
  # decode speed against the floor and engine start-up (warm-ups included). At 0.9 of an H100 every FP8 engine holds
  # 256 sequences of 1,280 tokens; BF16 does not (114k tokens). An engine vLLM cannot build is a row that did not start.
  CAPACITY_SHAPE=30b-a3b CAPACITY_SHARES=${MOE_SHARE:-0.9} CAPACITY_POINTS=${MOE_POINTS:-64x1024 256x1024} \
    CAPACITY_PROFILE=${MOE_PROFILE:-256x256} CAPACITY_ENGINES=${MOE_ENGINES:-fp8_deepgemm fp8_deepgemm_trl_act_quant fp8_deepgemm_moe_deepgemm \
    fp8_deepgemm_moe_flashinfer_cutlass bf16} bash benchmarks/run_rollout_report.sh capacity
  ;;
concurrency)  # matched concurrency: the same share, and every engine capped at $CAPACITY_SEQS sequences at once
  share=${CAPACITY_SHARES:-0.3}
  # shellcheck disable=SC2086
  timed "concurrency_seqs${CAPACITY_SEQS:-22}" python -m benchmarks.bench_rollout \
    --engines ${CAPACITY_ENGINES:-bf16 fp8_deepgemm fp8_deepgemm_kv} --points 256x2048 128x4096 --prompt_len 256 \
    --gpu_memory_utilization "$share" --max_num_seqs "${CAPACITY_SEQS:-22}" --append \
    --out "$work/rollout_capacity_mem${share}_seqs${CAPACITY_SEQS:-22}_$device.json"
  ;;
decodeattn)  # every decode-attention kernel the engine could run, inside CUDA graphs, against its KV-read floor
  timed decode_attention python -m benchmarks.bench_decode_attention --out "$work/decode_attention_$device.json"
  ;;
moeexperts)  # one MoE layer's experts at decode token counts as vLLM runs them, BF16 vs block FP8, inside CUDA graphs,
  # against the floor of the routed experts' weights, and the FP8 path's parts (quantizers, alignment, GEMMs)
  # MOE_EXPERTS_ARGS="--skip_slow": without DeepGEMM (its nvcc JIT compiles on a cold $DG_JIT_CACHE_DIR)
  # shellcheck disable=SC2086
  timed moe_experts python -m benchmarks.bench_moe_decode ${MOE_EXPERTS_ARGS:-} --out "$work/moe_decode_$device.json"
  ;;
colocate)  # TRL's colocate defaults on one GPU; each run in a child of its own, rows appended to one file. By default
  # TRL BF16 with and without Liger's kernels against FP8GRPOTrainer left to its defaults (Liger, the FP8 KV cache and
  # the weight cache as it chooses them), its BF16 twin (the same trainer with fp8_recipe=None: FP8's own share) and the
  # defaults with Liger's kernels inside compiled decoder layers.
  # COLOCATE_PROFILE_ROLLOUT=N: step N's rollout profiled (the kernels of $COLOCATE_PROFILE_ENGINE_STEPS engine steps,
  # default 256, around its middle; the host thread over all of it), the medians before it (COLOCATE_STEPS=3
  # COLOCATE_PROFILE_ROLLOUT=2: step 1 timed, step 2 profiled).
  # COLOCATE_GPUS="0 1 2 3": the runs dealt over these GPUs, the GPUs at once (the same host load on every flow; one
  # file by benchmarks.merge_results).
  # COLOCATE_ENGINE_PROBE=1: after the timed steps, each run's engine probed (bench_grpo --engine_probe, six rollouts)
  runs=${COLOCATE_RUNS:-trl_bf16 trl_bf16_liger bf16_defaults fp8_defaults unified_fp8kv_compiled_liger}
  profile_args=()
  if [ -n "${COLOCATE_PROFILE_ROLLOUT:-}" ]; then
    profile_args=(--profile_rollout_step "$COLOCATE_PROFILE_ROLLOUT"
      --profile_engine_steps "${COLOCATE_PROFILE_ENGINE_STEPS:-256}")
  fi
  if [ -n "${COLOCATE_ENGINE_PROBE:-}" ]; then
    profile_args+=(--engine_probe)
  fi
  colocate=(python -m benchmarks.bench_grpo --shape 8b --optim adamw_bnb_8bit --sleep_mode
    --vllm_memory "${COLOCATE_SHARE:-0.3}" --completion_len 2048 --generation_batch 128 --steps "${COLOCATE_STEPS:-3}"
    --warmup 1 "${profile_args[@]}" "${engine_kwargs[@]}")
  if [ -n "${COLOCATE_GPUS:-}" ]; then
    in_lanes colocate "$COLOCATE_GPUS" "$runs" "$work/colocate_gpu" "${colocate[@]}" --runs
    python -m benchmarks.merge_results "${lane_files[@]}" --same settings --out "$work/grpo_colocate_8b_$device.json"
  else
    for run in $runs; do
      MASTER_PORT=29650 timed "colocate_$run" "${colocate[@]}" --runs "$run" --append \
        --out "$work/grpo_colocate_8b_$device.json"
    done
  fi
  # each FP8 run against TRL BF16, TRL BF16 + Liger and its BF16 twin (bf16_defaults), where those ran
  python -m benchmarks.collect_twins "$work/grpo_colocate_8b_$device.json" | tee "$work/colocate_ratios.md"
  ;;
bestfit)  # per run, shares in increasing order until one fails: a careful user's tuning (2 steps: one timed)
  for run in ${BESTFIT_RUNS:-trl_bf16 unified_fp8kv}; do
    for share in ${BESTFIT_SHARES:-0.35 0.4 0.45 0.5}; do
      MASTER_PORT=29660 timed "bestfit_${run}_$share" python -m benchmarks.bench_grpo --shape 8b \
        --optim adamw_bnb_8bit --sleep_mode --vllm_memory "$share" --completion_len 2048 --generation_batch 128 \
        --steps 2 --warmup 1 --runs "$run" --out "$work/grpo_bestfit_${run}_mem${share}_$device.json"
      grep -q "bestfit_${run}_$share rc=0" "$work/status.txt" || break
    done
  done
  python -m benchmarks.collect_bestfit "$work" --out "$work/grpo_bestfit_8b_$device.json"  # failures included
  ;;
pack)  # each cache that exists, as its own series of parts (carry those worth their transfer calls)
  while read -r name path; do
    [ -d "$path" ] || continue
    tar -C "$(dirname "$path")" -czf - "$(basename "$path")" | split -b 15M - "$work/jit_$name.tgz.part"
    echo "jit cache $name ($path): files=$(find "$path" -type f | wc -l) bytes=$(du -sb "$path" | cut -f1)" \
      "packed=$(cat "$work"/jit_"$name".tgz.part* | wc -c) parts=$(ls "$work"/jit_"$name".tgz.part* | wc -l)" \
      | tee -a "$work/status.txt"
  done < <(jit_cache_dirs)
  ;;
suite)
  gpu_suite
  ;;
checks)
  gpu_suite
  timed identity python -m benchmarks.bench_identity --settings bf16 fp8 --backends deepgemm cutlass \
    --out "$work/identity_kernels_$device.json"
  timed rollout_long python -m benchmarks.bench_rollout --engines fp8_deepgemm_kv bf16 --points 16x16384 \
    --out "$work/rollout_long_$device.json"
  ;;
linear)
  timed linear python -m benchmarks.bench_linear --profile "$work/profile" --out "$work/linear_$device.json"
  ;&  # and on into gemm
gemm)
  timed gemm python -m benchmarks.bench_gemm --out "$work/gemm_$device.json"
  ;;
train)  # the training phase alone (no vLLM, minutes): host cost per piece, then every flow at 1.7B and 12 layers of 8B
  timed host python -m benchmarks.bench_host --out "$work/host_$device.json"
  timed train_step_1.7b python -m benchmarks.bench_train_step --shape 1.7b --profile "$work/train_profile" \
    --out "$work/train_step_1.7b_$device.json"
  timed train_step_8b python -m benchmarks.bench_train_step --shape 8b --layers 12 --out "$work/train_step_8b_$device.json"
  ;;
quant)
  timed quant python -m benchmarks.bench_quant --num_warps 2 4 8 16 --out "$work/quant_$device.json"
  ;;
grpo)
  MASTER_PORT=29610 timed grpo python -m benchmarks.bench_grpo --shape 8b --optim adamw_bnb_8bit \
    --runs ${GRPO_RUNS:-trl_bf16 unified unified_deepgemm unified_nocache} --steps 6 --warmup 1 --profile_step 5 \
    --out "$work/grpo_speed_$device.json"
  ;;
moestep)  # the reduced Qwen3-30B-A3B GRPO step (12 of 48 layers, 64 x 1024, 8-bit AdamW, vLLM at 0.3): $MOE_RUNS one
  # after the other in one call (default TRL BF16, the BF16 twin, FP8's defaults), medians of steps 1-3
  # shellcheck disable=SC2086
  MASTER_PORT=29650 timed grpo_moe python -m benchmarks.bench_grpo --shape 30b-a3b-12l --optim adamw_bnb_8bit \
    --runs ${MOE_RUNS:-trl_bf16 bf16_defaults fp8_defaults} --warmup 1 --steps "${MOE_STEPS:-4}" --workdir "$work/moe" \
    "${engine_kwargs[@]}" --out "$work/grpo_moe_30b_a3b_12l_$device.json"
  ;;
moeprofile)  # where the reduced Qwen3-30B-A3B step's rollout goes: $MOE_RUNS (default the BF16 twin, then FP8's
  # defaults) one after the other, step 2's rollout under the profiler (the engine's kernel time by category and the
  # time the GPU waited), the medians from step 1
  # shellcheck disable=SC2086
  MASTER_PORT=29650 timed grpo_moe_profile python -m benchmarks.bench_grpo --shape 30b-a3b-12l --optim adamw_bnb_8bit \
    --runs ${MOE_RUNS:-bf16_defaults fp8_defaults} --warmup 1 --steps 3 --profile_rollout_step 2 --workdir "$work/moe" \
    --out "$work/grpo_moe_30b_a3b_12l_rollout_profile_$device.json"
  ;;
four)  # report v2's first regime: the four runs of `long` (with FP8 rollouts and the FP8 KV cache) at the grpo phase's
  # 8B shape and 64 x 1024 tokens, with today's defaults. DeepGEMM's warm-up is skipped as in `long`: the first FP8
  # run's untimed step 0 compiles its kernels; medians of steps 1-3.
  # shellcheck disable=SC2086
  VLLM_DEEP_GEMM_WARMUP=${VLLM_DEEP_GEMM_WARMUP:-skip} MASTER_PORT=29640 timed grpo_four python -m benchmarks.bench_grpo \
    --shape 8b --optim adamw_bnb_8bit --runs ${FOUR_RUNS:-trl_bf16 fp8_rollout unified unified_fp8kv} \
    --steps "${FOUR_STEPS:-4}" --warmup 1 --out "$work/grpo_speed_four_$device.json"
  ;;
long)  # the long regime: 128 completions of 4096 tokens per step on the Qwen3-1.7B shape: a step of 80-90 s on an H200
  # (0.5M tokens to generate and to train on). LONG_STEPS=3 (default) times step 1 and profiles step 2's training;
  # LONG_STEPS=2 times step 1 alone (a run then takes ~4.5 min with its start-up). DeepGEMM's warm-up is skipped
  # (VLLM_DEEP_GEMM_WARMUP=skip, recorded per row): the 'full' one compiled cold for 4.4 min per fresh host, while with
  # 'skip' the untimed step 0 of unified took as long as step 1 (79.7 s, 79.6 s). Rows append: runs of separate
  # calls (another lease) share the file, each row saying how it was measured.
  steps=${LONG_STEPS:-3} long_out="$work/grpo_speed_long_$device.json"
  [ -f "$long_out" ] || cp "benchmarks/results/$(basename "$long_out")" "$long_out" 2>/dev/null  # the committed rows
  # shellcheck disable=SC2046,SC2086
  VLLM_DEEP_GEMM_WARMUP=${VLLM_DEEP_GEMM_WARMUP:-skip} MASTER_PORT=29630 timed grpo_long python -m benchmarks.bench_grpo \
    --shape 1.7b --runs ${LONG_RUNS:-trl_bf16 fp8_rollout unified unified_fp8kv} --completion_len 4096 \
    --generation_batch 128 --micro_batch 4 --vllm_memory 0.55 --steps "$steps" --warmup 1 \
    $([ "$steps" -ge 3 ] && echo --profile_step 2) --append --out "$long_out"
  ;;
kvprofile)  # the long regime's rollouts alone: BF16 and FP8 weights, BF16 and FP8 KV cache, each with a profiled
  # 128 x 1024 rollout: how far FP8-KV attention (FlashAttention-3, Q/K/V in FP8) sits from its byte floor. Cutlass
  # kernels: no DeepGEMM cold compile on a fresh host.
  timed rollout_kvprofile python -m benchmarks.bench_rollout --shape 1.7b --engines bf16 fp8_cutlass fp8_cutlass_kv \
    --points 128x4096 --prompt_len 128 --profile_point 128x1024 --gpu_memory_utilization 0.55 \
    --workdir "$work/rollout" --out "$work/rollout_long_$device.json"
  ;;
fp8kv)  # the FP8 KV cache's cost on the addition task, the settings side by side on one GPU (as `run_report.sh`'s
  # accuracy study, one seed): held-out accuracy, trainer-vs-rollout KL and the TIS clipping rate, FP8 weights with
  # the BF16 KV cache against the same with the FP8 one (the trainer's KV scales), BF16 beside them. Cutlass rollouts
  # (no cold DeepGEMM compile for the small model's shapes); training bounded by FP8KV_MINUTES.
  timed fp8kv_pretrain python -m benchmarks.convergence.pretrain --out "$work/arith-base" \
    --results "$work/convergence_fp8kv/pretrain_$device.json"
  timed fp8kv_grpo python -m benchmarks.convergence.run_grpo --model "$work/arith-base" \
    --setting bf16 fp8_tis fp8_tis_fp8kv --parallel --vllm_fp8_backend cutlass --max_minutes "${FP8KV_MINUTES:-6}" \
    --workdir "$work/fp8kv_runs" --results_dir "$work/convergence_fp8kv"
  ;;
chain)  # the long-completion study: pre-train the 101M addition-chain model, then GRPO in the five settings x 2 seeds
  # at once, each part bounded in time so the whole fits one lease (25 min); results are written after every
  # logged step and evaluation. Batch 64: 128 rows of ~1k words ran out of the H200's memory. Cutlass rollouts:
  # DeepGEMM's cold JIT compile of a new shape's kernels took 4.4 min per engine start-up here, and start-ups take
  # turns (~50 s each on one GPU). On two GPUs each seed gets one (five runs per GPU, start-ups in two queues), so GRPO gets more minutes.
  # Greedy evaluation in batches of 64 (one GPU) or 128 (two): ten runs evaluating 256 problems at once ran an H200
  # out of memory.
  # CHAIN_SEEDS (default "0 1") picks the seeds: one seed per lease on one GPU gives each run twice the GPU share, and
  # with the base carried in (CHAIN_BASE_PARTS) every lease trains from the same model. On 2026-11-24, a seed per
  # H200 lease with CHAIN_PHASE_MIN=26: five start-ups took 3.7-5.0 min, then BF16 runs took 6.6-7.0 s a step (step
  # 100 reached) and unified FP8 7.5-8.5 s (79-100 steps); the lease, staging included, took 27-28 min of its 30.
  # Training ends by a wall-clock time: CHAIN_PHASE_MIN (default 25) after the phase began, less 2.5 min for the
  # final evaluation, however long pre-training and the start-ups took (the 2026-11-23 lease ran out mid-start-up).
  phase_end=$(($(date +%s) + ${CHAIN_PHASE_MIN:-25} * 60 - 150))
  gpus=$(python -c "import torch; print(' '.join(map(str, range(min(2, torch.cuda.device_count())))))")
  [ "$gpus" = "0" ] && eval_batch=64 || eval_batch=128
  base="$work/chain-base"
  if ls "${CHAIN_BASE_PARTS:-/nonexistent}"/part.* >/dev/null 2>&1; then  # an earlier host's base (`chainbase`)
    cat "$CHAIN_BASE_PARTS"/part.* | tar -C "$work" -xzf - || exit 1
    base="$work/chain-base-bf16"
    echo "chain base from $CHAIN_BASE_PARTS: $(grep -o '"steps": [0-9]*' "$work"/convergence_chain/pretrain_*.json)" \
      | tee -a "$work/status.txt"
  else
    chain_pretrain
  fi
  # shellcheck disable=SC2086
  timed chain_grpo python -m benchmarks.convergence.run_grpo --task chain --model "$base" --setting all \
    --parallel --seeds ${CHAIN_SEEDS:-0 1} --gpus $gpus --steps "${CHAIN_STEPS:-100}" --stop_at "$phase_end" \
    --lr 5e-5 --batch_size 64 --micro_batch 8 --gradient_checkpointing --eval_every 20 --eval_problems 128 \
    --eval_batch "$eval_batch" --vllm_memory 0.05 --vllm_fp8_backend cutlass --results_dir "$work/convergence_chain" \
    --workdir "$work/chain_grpo"  # seed 1: *_seed1
  ;;
chainkv)  # the FP8 KV cache's fidelity at over a thousand tokens a completion (addition_chain_long): pre-train the
  # 101M model on 16-160-term chains, then GRPO in BF16, unified FP8 + token TIS and the same with the FP8 KV cache, the
  # three at once on one GPU, one seed; training ends CHAINKV_PHASE_MIN (default 27) after the phase began, less 2.5 min
  # for the final evaluation. vLLM gets 0.08 of the GPU each: 64 sequences of up to 1,761 tokens in BF16 need 1.9 GB.
  # CHAINKV_GPU: the GPU it all runs on (default: the first visible), so other phases can use the others meanwhile.
  phase_end=$(($(date +%s) + ${CHAINKV_PHASE_MIN:-27} * 60 - 150))
  (if [ -n "${CHAINKV_GPU:-}" ]; then export CUDA_VISIBLE_DEVICES=$CHAINKV_GPU; fi
  # batches of 64 sequences of up to 1,761 tokens in slices of 16: the whole batch at once needs more than an H100's 80 GB
  timed chainkv_pretrain python -m benchmarks.convergence.pretrain --task chain_long --size medium \
    --out "$work/chain-long-base" --batch_size 64 --micro_batch 16 --eval_every 50 --eval_problems 128 \
    --target_accuracy "${CHAIN_TARGET:-0.3}" --max_minutes "${CHAINKV_PRETRAIN_MIN:-10}" \
    --results "$work/convergence_chain_long/pretrain_$device.json")
  timed chainkv_grpo python -m benchmarks.convergence.run_grpo --task chain_long --model "$work/chain-long-base" \
    --setting bf16 fp8_tis fp8_tis_fp8kv --parallel --seeds 0 --gpus "${CHAINKV_GPU:-0}" --steps "${CHAIN_STEPS:-100}" \
    --stop_at "$phase_end" --lr 5e-5 --batch_size 64 --micro_batch 8 --gradient_checkpointing --eval_every 20 \
    --eval_problems 128 --eval_batch 64 --vllm_memory 0.08 --vllm_fp8_backend cutlass \
    --results_dir "$work/convergence_chain_long" --workdir "$work/chain_long_grpo"
  ;;
chainbase)  # the chain's base for later hosts: GRPO trains in BF16 on CUDA, so a BF16 copy loses nothing it uses
  chain_pretrain
  python -c "import sys, torch; from transformers import AutoModelForCausalLM as M
M.from_pretrained(sys.argv[1], dtype=torch.bfloat16).save_pretrained(sys.argv[2])" "$work/chain-base" "$work/chain-base-bf16" \
    && cp "$work"/chain-base/tokenizer{,_config}.json "$work/chain-base-bf16/" \
    && tar -C "$work" -czf - chain-base-bf16 convergence_chain chain_pretrain.log | split -b 15M - "$work/chain_base.part." \
    && echo "chain base: $(ls "$work"/chain_base.part.* | wc -l) parts" | tee -a "$work/status.txt"
  ;;
scaling)  # 8B at TRL's colocate defaults per GPU: TRL BF16 vs unified FP8 + FP8 KV, side by side at each GPU count
  # and launch of $SCALING_SPECS (GPUs x accelerate config); 8-bit AdamW, fused AdamW under FSDP2 (bitsandbytes'
  # optimizers do not take its shards); then one table with the weak-scaling efficiency. SCALING_SHAPE=14b (or 32b)
  # with SCALING_SPECS=4xfsdp2: a model whose BF16 training does not fit one GPU beside its engine. SCALING_RUNS and
  # SCALING_MICRO_BATCH change the flows and the micro-batch (`trl-fp8 plan` fits a BF16 DDP rank at 8B with 4).
  # SCALING_AT_ONCE=1: where the machine has the GPUs, the flows of a GPU count run at the same time, each on GPUs
  # of its own (TRL BF16 on 0-1, FP8 on 2-3 of four), into files collect_scaling takes as one side-by-side file.
  # SCALING_PROFILE_STEP=N: profile step N's training phase (kernels by category, NCCL exposed, GPU idle; the
  # medians then take the steps before it: SCALING_STEPS=3 SCALING_PROFILE_STEP=2 times step 1 and profiles step 2);
  # SCALING_PROFILE_MICRO_BATCHES=N: only N of its micro-batches, after its first (a trace read in seconds);
  # SCALING_PROFILE_SCORING=1 with it: from the step's start, the scoring and the first micro-batch too.
  # SCALING_SHARE: vLLM's share (TRL's 0.3 by default; at 14B the BF16 weights alone exceed 0.3 of an 80 GB GPU, and
  # `trl-fp8 plan` fits both flows at 0.4). SCALING_COMPLETION_LEN: tokens per completion (TRL's colocate default
  # here, 2,048; at 14B and 0.4 TRL BF16's engine holds 7 such sequences at once, so its rollout alone takes minutes).
  # SCALING_SYNC_EACH_BATCH=1: accelerate's sync_each_batch (gradients reduced at every micro-batch; under FSDP2 they
  # then stay sharded: without it each GPU holds the whole model's gradients in BF16, which 14B on 4 GPUs cannot).
  # SCALING_VLLM_TP=2: each colocated engine spans 2 GPUs (TRL's vllm_tensor_parallel_size), half its weights a GPU.
  # SCALING_CPU_AFFINITY=1: accelerate's --enable_cpu_affinity (each rank on its GPU's NUMA node's cores).
  shape=${SCALING_SHAPE:-8b} share=${SCALING_SHARE:-0.3}
  read -r -a runs <<<"${SCALING_RUNS:-trl_bf16 unified_fp8kv}"
  machine_gpus=$(nvidia-smi -L | grep -c '^GPU ')
  inputs=()
  for spec in ${SCALING_SPECS:-1xmulti_gpu 2xmulti_gpu 4xmulti_gpu 2xfsdp2 4xfsdp2}; do
    n=${spec%%x*}; cfg=${spec#*x}
    optim=adamw_bnb_8bit; [ "$cfg" = fsdp2 ] && [ "$n" -gt 1 ] && optim=adamw_torch_fused
    bench=(python -m benchmarks.bench_grpo --shape "$shape" --optim "$optim" --sleep_mode --vllm_memory "$share"
      --completion_len "${SCALING_COMPLETION_LEN:-2048}" --generation_batch 128 --micro_batch "${SCALING_MICRO_BATCH:-8}"
      --steps "${SCALING_STEPS:-3}" --warmup 1 --num_processes "$n" --launch_config "$cfg"
      ${SCALING_PROFILE_STEP:+--profile_step "$SCALING_PROFILE_STEP"}
      ${SCALING_PROFILE_MICRO_BATCHES:+--profile_micro_batches "$SCALING_PROFILE_MICRO_BATCHES"}
      ${SCALING_PROFILE_SCORING:+--profile_scoring} ${SCALING_SYNC_EACH_BATCH:+--sync_each_batch}
      ${SCALING_VLLM_TP:+--vllm_tensor_parallel_size "$SCALING_VLLM_TP"} ${SCALING_CPU_AFFINITY:+--cpu_affinity})
    if [ -n "${SCALING_AT_ONCE:-}" ] && [ $((n * ${#runs[@]})) -le "$machine_gpus" ]; then
      files=()
      for i in "${!runs[@]}"; do  # a workdir each: the random model is written once per workdir
        out="$work/grpo_scaling_${shape}_${spec}_${runs[$i]}_$device.json"
        CUDA_VISIBLE_DEVICES=$(seq -s, $((i * n)) $((i * n + n - 1))) MASTER_PORT=$((29670 + 10 * i)) \
          timed "scaling_${shape}_${spec}_${runs[$i]}" "${bench[@]}" --runs "${runs[$i]}" \
          --workdir "$work/bench_${runs[$i]}" --out "$out" &
        files+=("$out")
      done
      wait
      inputs+=("$(IFS=+; echo "${files[*]}")")
    else
      out="$work/grpo_scaling_${shape}_${spec}_$device.json"
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) MASTER_PORT=29670 timed "scaling_${shape}_${spec}" "${bench[@]}" \
        --runs "${runs[@]}" --out "$out"
      inputs+=("$out")
    fi
  done
  python -m benchmarks.collect_scaling "${inputs[@]}" --out "$work/grpo_scaling_${shape}_$device.json" \
    --plot "$work/grpo_scaling_${shape}_$device.png"
  ;;
contention)  # the same one-GPU run on every GPU of the machine at once, with nothing shared but the host: does a busy
  # host slow each FP8 engine as four DDP or FSDP2 ranks were slowed? ($CONTENTION_RUN, TRL's colocate defaults at 8B)
  run=${CONTENTION_RUN:-unified_fp8kv_liger}
  # every GPU's SM clock, power and temperature each second: a slowdown shared by all GPUs may be power or heat, not
  # the host
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -l 1 >"$work/contention_gpu_clocks.csv" 2>&1 &
  clocks=$!
  files=() runs_pids=()
  for i in $(seq 0 $(($(nvidia-smi -L | grep -c '^GPU ') - 1))); do  # a workdir each: the model is written once per workdir
    out="$work/grpo_contention_${run}_gpu${i}_$device.json"
    CUDA_VISIBLE_DEVICES=$i MASTER_PORT=$((29700 + 10 * i)) timed "contention_${run}_gpu$i" python -m benchmarks.bench_grpo \
      --shape 8b --optim adamw_bnb_8bit --sleep_mode --vllm_memory 0.3 --completion_len 2048 --generation_batch 128 \
      --micro_batch 4 --steps 2 --warmup 1 --runs "$run" --workdir "$work/bench_contention_$i" --out "$out" &
    files+=("$out") runs_pids+=($!)
  done
  wait "${runs_pids[@]}"  # the runs only: the clock logger runs until killed
  kill "$clocks" 2>/dev/null
  # one file: each copy's row (an engine slowed by the host shows in its rollout) and every GPU's clocks
  python -m benchmarks.collect_contention "${files[@]}" --clocks "$work/contention_gpu_clocks.csv" \
    --out "$work/grpo_contention_8b_$device.json"
  ;;
multi)  # a 4B shape with stock fused AdamW: one step fits one GPU beside its engine, so 1 and 2 GPUs compare
  gpu_tests multi_gpu_tests tests/gpu/test_multi_gpu.py
  for runs in "1 multi_gpu" "2 fsdp2" "2 multi_gpu"; do
    read -r n cfg <<<"$runs"
    CUDA_VISIBLE_DEVICES=$( [ "$n" = 1 ] && echo 0 || echo 0,1 ) MASTER_PORT=29620 timed "grpo_${n}x$cfg" \
      python -m benchmarks.bench_grpo --shape 4b --runs trl_bf16 unified --num_processes "$n" --launch_config "$cfg" \
      --out "$work/grpo_speed_${device}_${n}x$cfg.json"
  done
  ;;
*)
  echo "usage: $0 PHASE... (kernels rollout capacity concurrency colocate bestfit pack suite checks linear gemm quant" \
    "train grpo moestep moeprofile four long kvprofile fp8kv moedecode decode decodeattn moeexperts" \
    "chain chainbase chainkv multi scaling contention)" >&2
  exit 2
  ;;
esac
done
