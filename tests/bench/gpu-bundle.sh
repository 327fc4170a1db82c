#!/bin/sh
# Packs what tests/bench/gpu-first-run.sh needs into one directory, for a
# GPU machine that has the NVIDIA driver and CUDA's libraries but not
# Debian's packages (libuv, libsodium, oneDNN, Criterion, ...) nor the data:
#
#   tests/bench/gpu-bundle.sh BUILD_DIR OUT_DIR
#
# BUILD_DIR: a CUDA build made here with the tests, for the GPU's
# architecture (e.g. -DCMAKE_BUILD_TYPE=Release
# -DCMAKE_CUDA_ARCHITECTURES=90-real for an H100/H200). OUT_DIR gets
# payload.tar.xz (the rumor binary, the GPU test binaries, the shared
# libraries they load that a plain Ubuntu or Debian lacks, the KJV text),
# fmnist.tar (Debian's Fashion-MNIST files, which test_peer_gossip's GPU
# cases read) and run.sh. On the GPU machine, from a copy of this source
# tree at the same path as here (the tests have it compiled in) with
# OUT_DIR inside it:
#
#   OUT_DIR/run.sh [REPORT_DIR]     (STEPS, LIMIT: gpu-first-run.sh's steps
#                                    and a time limit, default 520 s)
#
# unpacks both, links the data where the tests look for it and runs
# gpu-first-run.sh with LD_LIBRARY_PATH set, its report and logs in
# REPORT_DIR (default OUT_DIR). Used for the first GPU run (2026-11-28,
# docs/benchmarks.md): about 44 MB in all.
set -eu
[ $# -eq 2 ] || { echo "usage: $0 BUILD_DIR OUT_DIR" >&2; exit 2; }
build=$(cd "$1" && pwd)
out=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
case $build in "$root"/*) ;; *) echo "$0: $build is not inside $root (run.sh finds it there)" >&2; exit 2 ;; esac
rel=${build#"$root"/}
tests=$("$root/tests/bench/gpu-first-run.sh" --binaries)
for f in peer/rumor tests/bench/bench_fma_peak; do
  [ -x "$build/$f" ] || { echo "$0: $build/$f is missing: build with -DRUMOR_CUDA=ON -DRUMOR_TESTS=ON" >&2; exit 2; }
done
kjv=/usr/local/share/rumor/kjv.txt fmnist=/usr/share/datasets/fashion-mnist
if [ ! -s "$kjv" ] || [ ! -d "$fmnist" ]; then
  echo "$0: run deploy/install-deps.sh first (the data: $kjv, $fmnist)" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/$rel/peer" "$stage/$rel/tests/bench" "$stage/gpu-lib" "$stage/data/fashion-mnist"
cp "$build/peer/rumor" "$stage/$rel/peer/"
cp "$build/CMakeCache.txt" "$stage/$rel/"
cp "$build/tests/bench/bench_fma_peak" "$stage/$rel/tests/bench/"
for t in $tests; do cp "$build/tests/$t" "$stage/$rel/tests/"; done
# The shared libraries, but the C library's and the compiler's own, which
# every such machine has (newer).
for f in "$stage/$rel/peer/rumor" "$stage/$rel/tests/"*; do [ -f "$f" ] && ldd "$f"; done |
  awk '$3 ~ /^\// {print $1, $3}' | sort -u |
  grep -v -E '^(libc|libm|libgcc_s|libstdc\+\+|libresolv|libdl|libpthread|librt|ld-linux)[.-]' |
  while read -r name path; do cp -L "$path" "$stage/gpu-lib/$name"; done
cp "$kjv" "$stage/data/kjv.txt"
cp "$fmnist"/* "$stage/data/fashion-mnist/"
(cd "$stage" && tar -cf - "$rel" gpu-lib data/kjv.txt | xz -T0 -6 >"$out/payload.tar.xz")
(cd "$stage" && tar -cf "$out/fmnist.tar" data/fashion-mnist)
cat >"$out/run.sh" <<EOF
#!/bin/bash
# Made by tests/bench/gpu-bundle.sh: runs gpu-first-run.sh on a GPU machine.
set -u
here=\$(cd "\$(dirname "\$0")" && pwd)
root=$root
reports=\${1:-\$here}
cd "\$root" || exit 2
echo "\$(nvidia-smi -L | head -1); \$(uname -r)"
if ! tar -xJf "\$here/payload.tar.xz" -C "\$root" || ! tar -xf "\$here/fmnist.tar" -C "\$root"; then
  echo "unpack failed"
  exit 2
fi
mkdir -p /usr/share/datasets /usr/local/share/rumor
[ -e $fmnist ] || ln -s "\$root/data/fashion-mnist" $fmnist
[ -s $kjv ] || cp "\$root/data/kjv.txt" $kjv
cub=\$(ldconfig -p | awk '/libcublas\\.so\\.[0-9]+ / {print \$NF; exit}')
[ -z "\$cub" ] && cub=\$(timeout 30 find /usr/local /opt /usr/lib -name 'libcublas.so.[0-9]*' 2>/dev/null | head -1)
echo "cuBLAS: \${cub:-none found}"
export LD_LIBRARY_PATH=\$root/gpu-lib\${cub:+:\$(dirname "\$cub")}
ldd "\$root/$rel/peer/rumor" | grep "not found"
export GPU_PY=\${GPU_PY:-python3} LOGS=\$reports/logs.tar.gz REPORT=\$reports/report.txt
timeout "\${LIMIT:-520}" "\$root/tests/bench/gpu-first-run.sh" "\$root/$rel"
echo "gpu-first-run exit \$?"
EOF
chmod +x "$out/run.sh"
echo "$out: $(du -sh "$out" | cut -f1) (payload.tar.xz, fmnist.tar, run.sh)"
