#!/usr/bin/env bash
# Build the kit that installs one tested stack on a GPU host that has no package index (torch's CUDA libraries
# come from the host's image). Usage, in the project root:
#   tests/gpu/kit/build-kit.sh vllm-0.31 [DEST]     (DEST defaults to .gpu-vllm-0.31; keep it git-ignored)
# `wheels-STACK.txt` beside this script lists the wheels (python 3.12, x86-64). They are installed here into one
# site folder, slimmed of what Hopper never loads, packed into one zstd stream and split into parts `DEST/pNN`, each
# small enough to travel with the project on its own. On the host, `bash DEST/setup.sh stage` after each part, then
# `source DEST/setup.sh`, or `start` and `wait` for a long run (see docs/contributing/test-record.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
stacks=$(cd "$here" && ls wheels-*.txt | sed 's/wheels-//; s/.txt//' | tr '\n' ' ')
stack=${1:?usage: build-kit.sh STACK [DEST], STACK one of: $stacks}
dest=${2:-.gpu-$stack}
list=$here/wheels-$stack.txt
[ -f "$list" ] || { echo "build-kit.sh: no $list" >&2; exit 2; }
part_mib=${PART_MIB:-36}   # the project's tree (~20 MiB) + one part must stay under the 64 MiB a transfer carries
plat=(--python-version 3.12 --implementation cp --only-binary=:all: --platform any --platform manylinux2014_x86_64)
for n in 39 35 34 31 28 27 26 24 18 17 12 5; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "installing $(grep -c '==' "$list") wheels of $list into a python 3.12 site"
if ! python3 -m pip install -q --no-deps --no-compile --target "$tmp/site" "${plat[@]}" -r <(grep -v '^#' "$list") \
     >"$tmp/pip.log" 2>&1 ||
   ! python3 -m pip download -q --no-deps -d "$tmp/zstd" "${plat[@]}" zstandard==0.25.0 >>"$tmp/pip.log" 2>&1; then
  grep -v -i warning "$tmp/pip.log" >&2
  echo "build-kit.sh: pip could not fetch the wheels above; $dest is left as it was" >&2
  exit 1
fi
# Slim: Hopper runs FlashAttention-3, never vLLM's FlashAttention-2 or sm100 kernels; DeepGEMM only for python 3.12;
# Triton's static profiling libraries and test plug-ins are never loaded; console scripts point at this machine.
s=$tmp/site
rm -f "$s"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$s"/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
rm -rf "$s"/vllm/third_party/fmha_sm100 "$s"/bin "$s"/triton/instrumentation
rm -f "$s"/triton/backends/nvidia/lib/cupti/*_static.a
echo "site: $(du -sh "$s" | cut -f1) unpacked; packing"
(cd "$s" && tar -cf - .) | zstd -T0 -9 -q -o "$tmp/site.tar.zst"
rm -rf "$dest"; mkdir -p "$dest"
split -b "${part_mib}M" -d -a 2 "$tmp/site.tar.zst" "$tmp/part"
n=0; for f in "$tmp"/part*; do mkdir "$dest/p${f##*part}"; mv "$f" "$dest/p${f##*part}/"; n=$((n + 1)); done
# The unpacker's wheel rides with the last part where it fits, else in a folder of its own.
last=$dest/p$(printf %02d $((n - 1)))
if [ "$(du -sm "$last" | cut -f1)" -le $((part_mib - 6)) ]; then cp "$tmp"/zstd/*.whl "$last/"
else mkdir "$dest/p$(printf %02d "$n")" && cp "$tmp"/zstd/*.whl "$dest/p$(printf %02d "$n")/"; fi
sed -e "s/@STACK@/$stack/g" -e "s/@PARTS@/$n/g" "$here/setup.sh" > "$dest/setup.sh"
folders=$(ls -d "$dest"/p[0-9][0-9] | wc -l)
echo "kit: $folders folders ($n parts) in $dest ($(du -sh "$dest" | cut -f1)); on the GPU host, one transfer each:"
echo "  carry [\"$dest/pNN\", \"$dest/setup.sh\"], command: bash $dest/setup.sh stage"
echo "  then: source $dest/setup.sh && <command>"
echo "  or, for a run longer than one command may last: bash $dest/setup.sh start '<command>' with the last part,"
echo "  then bash $dest/setup.sh wait until it ends (the same calls, back to back)"
