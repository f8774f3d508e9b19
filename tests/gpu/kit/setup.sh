# GPU-host side of a kit made by tests/gpu/kit/build-kit.sh (stack @STACK@, @PARTS@ parts).
#   bash DEST/setup.sh stage    copies the parts that travelled with this transfer into /var/tmp (kept while the
#                               host lives) and says how many of the @PARTS@ are there;
#   source DEST/setup.sh        unpacks the staged stack once into /tmp/site-@STACK@ and exports PYTHONPATH (the
#                               project root first: the host has no package index, so the project is not installed)
#                               with the settings the GPU suite runs under.
kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
stage=/var/tmp/stage-@STACK@
site=/tmp/site-@STACK@
mkdir -p "$stage"
for d in "$kit"/p[0-9][0-9]; do [ -d "$d" ] && cp -n "$d"/* "$stage/" 2>/dev/null; done
have=$(ls "$stage"/part* 2>/dev/null | wc -l)
if [ "${1:-}" = "stage" ]; then
  echo "stack @STACK@: $have of @PARTS@ parts staged"
  return 0 2>/dev/null || exit 0
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
