# GPU-host side of a kit made by tests/gpu/kit/build-kit.sh (stack @STACK@, @PARTS@ parts).
#   bash DEST/setup.sh stage    copies the parts that travelled with this transfer into /var/tmp (kept while the
#                               host lives) and says how many of the @PARTS@ are there;
#   source DEST/setup.sh        unpacks the staged stack once into /tmp/site-@STACK@ and exports PYTHONPATH (the
#                               project root first: the host has no package index, so the project is not installed)
#                               with the settings the GPU suite runs under;
#   bash DEST/setup.sh start 'COMMAND'
#                               runs COMMAND in the background, on the stack, in a copy of the project taken now
#                               (/var/tmp/run-@STACK@/tree), and returns at once: for hosts that take commands of
#                               limited length. COMMAND writes what it keeps under $RUN_OUT; the stack's versions and
#                               the GPUs are written there first;
#   bash DEST/setup.sh wait [SECONDS]
#                               waits up to SECONDS (570) for that run to end, packs $RUN_OUT into
#                               $OUT/run-out.tar.gz and copies the run's output beside it (when $OUT is set), prints
#                               the output's last lines, and exits with COMMAND's status
#                               once it ended, 0 while it goes on, 3 when nothing was started on this host (a new
#                               host: what was staged and run on the old one is gone).
kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
stage=${KIT_VAR_DIR:-/var/tmp}/stage-@STACK@
site=${KIT_TMP_DIR:-/tmp}/site-@STACK@
run=${KIT_VAR_DIR:-/var/tmp}/run-@STACK@
# Whether the started run's process lives: the one `start` launched, or the job it became should setsid have forked.
run_alive() { for f in "$run/pid" "$run/job.pid"; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && return 0; done
  return 1; }
mkdir -p "$stage"
for d in "$kit"/p[0-9][0-9]; do [ -d "$d" ] && cp -n "$d"/* "$stage/" 2>/dev/null; done
have=$(ls "$stage"/part* 2>/dev/null | wc -l)
if [ "${1:-}" = "stage" ]; then
  echo "stack @STACK@: $have of @PARTS@ parts staged"
  return 0 2>/dev/null || exit 0
fi
if [ "${1:-}" = "start" ]; then
  if [ -z "${2:-}" ] || [ "$have" -ne @PARTS@ ]; then
    echo "setup.sh: start needs a command, and the @PARTS@ parts staged ($have are); nothing started" >&2
    return 1 2>/dev/null || exit 1
  fi
  if [ ! -f "$run/end" ] && run_alive; then
    echo "setup.sh: a run is going on ($(cat "$run/command")); wait for it (bash $kit/setup.sh wait)" >&2
    return 1 2>/dev/null || exit 1
  fi
  rm -rf "$run" && mkdir -p "$run/tree" "$run/out"
  tar -c --exclude='./.gpu-*' --exclude=./.git . | tar -x -C "$run/tree"
  mkdir -p "$run/tree/${kit##*/}" && cp "$kit/setup.sh" "$run/tree/${kit##*/}/"
  printf '%s\n' "$2" > "$run/command"
  cat > "$run/job.sh" <<'JOB'
run=$1; kit_dir=$2
echo $$ > "$run/job.pid"
cd "$run/tree" || exit 1
export RUN_OUT=$run/out HF_HUB_OFFLINE=1
t0=$(date +%s)
set --  # setup.sh reads its first argument
if source "$kit_dir/setup.sh"; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$RUN_OUT/gpu.txt" 2>&1
  python3 -m trl_fp8 --version > "$RUN_OUT/versions.txt" 2>&1  # the versions a bug report names
  bash "$run/command"
  rc=$?
else
  rc=1
fi
echo "rc=$rc s=$(( $(date +%s) - t0 ))" > "$run/end"
JOB
  setsid nohup bash "$run/job.sh" "$run" "${kit##*/}" > "$run/out.log" 2>&1 < /dev/null &
  echo $! > "$run/pid"
  echo "setup.sh: started in $run/tree: $2"
  return 0 2>/dev/null || exit 0
fi
if [ "${1:-}" = "wait" ]; then
  if [ ! -f "$run/pid" ]; then
    echo "setup.sh: nothing was started on this host: a new one, without what was staged and started before;" \
      "stage the parts and start again" >&2
    return 3 2>/dev/null || exit 3
  fi
  t0=$(date +%s)
  while [ ! -f "$run/end" ] && [ $(( $(date +%s) - t0 )) -lt "${2:-570}" ] && run_alive; do sleep 5; done
  # $RUN_OUT comes back as one archive: the device tool returns a few files only and drops the rest.
  if [ -n "${OUT:-}" ]; then tar -czf "$OUT/run-out.tar.gz" -C "$run/out" .
    cp "$run/out.log" "$run/command" "$OUT/"; [ -f "$run/end" ] && cp "$run/end" "$OUT/"; fi
  tail -n "${TAIL_LINES:-15}" "$run/out.log"
  if [ -f "$run/end" ]; then
    echo "setup.sh: the run ended, $(cat "$run/end"): $(cat "$run/command")"
    rc=$(sed 's/^rc=\([0-9]*\).*/\1/' "$run/end")
  elif run_alive; then
    echo "setup.sh: the run goes on, $(( $(date +%s) - $(stat -c %Y "$run/command") )) s since its start"
    rc=0
  else
    echo "setup.sh: the run's process is gone and left no end mark (killed?): $(cat "$run/command")" >&2
    rc=1
  fi
  return "$rc" 2>/dev/null || exit "$rc"
fi
if [ ! -f "$site/.complete" ]; then
  if [ "$have" -ne @PARTS@ ] || ! ls "$stage"/zstandard-*.whl >/dev/null 2>&1; then
    echo "setup.sh: $have of @PARTS@ parts of @STACK@ are staged (and the folder with zstandard's wheel?); send the" \
      "missing ones (bash $kit/setup.sh stage)" >&2
    return 1 2>/dev/null || exit 1
  fi
  t0=$(date +%s)
  # torch's CUDA libraries: those the kit carries (site/nvidia/<lib>), else the image's, linked in beside them, where
  # torch's libraries look (`$ORIGIN/../../nvidia/<lib>/lib`).
  image_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  rm -rf "$site" /tmp/zstd-@STACK@ && mkdir -p "$site"
  python3 -m pip install -q --no-index --no-deps --target /tmp/zstd-@STACK@ "$stage"/zstandard-*.whl 2>&1 \
    | grep -v -i warning
  cat "$stage"/part* | PYTHONPATH=/tmp/zstd-@STACK@ python3 -c \
    "import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)" \
    | tar -x -C "$site" && mkdir -p "$site/nvidia" \
    && for lib in "$image_site"/nvidia/*; do [ -e "$site/nvidia/${lib##*/}" ] || ln -s "$lib" "$site/nvidia/"; done \
    && touch "$site/.complete"
  echo "setup.sh: @STACK@ unpacked into $site in $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH}
# The project's entry points (its vLLM plugin, which a `trl vllm-serve` process finds only through installed metadata),
# written as a dist-info beside the stack, from this checkout's pyproject.toml.
python3 - "$site" <<'PY'
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"trl_fp8-{project['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: trl-fp8\nVersion: {project['version']}\n")
groups = project.get("entry-points", {})
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items()) + "\n"
    for group, entries in groups.items()))
PY
export VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer's sampler JIT needs packages the image lacks
export VLLM_USE_DEEP_GEMM=0  # a safe default (Cutlass block-FP8 GEMM); code that picks a backend assigns it itself
# Multi-GPU hosts: NVLink multicast must stay off (it can take the shared host's GPUs out of service). Keep these set,
# also in the environment of any subprocess you start; vLLM's symmetric-memory all-reduce and FlashInfer's (on by
# default from vLLM 0.31; its workspace is multicast memory first) are turned off with them.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
export VLLM_ALLREDUCE_USE_FLASHINFER=0
