#!/usr/bin/env bash
# Packs FlashInfer for the H200 machine, which cannot download. The flashinfer-python wheel (about 100 MB, more
# than one device command carries beside .gpu/) is trimmed to what its paged-attention kernels' JIT needs: its
# Python package, its headers with CUTLASS / CCCL / spdlog, and the batch / single decode and prefill sources;
# with the apache-tvm-ffi wheel it imports, built for the machine's Python (3.12). The machine has nvcc and
# ninja for the JIT. Writes .gpu/flashinfer.tar.xz (~18 MB); `bash benchmarks/h200.sh flashinfer` unpacks it.
#   bash benchmarks/flashinfer_bundle.sh        # from the project root, after ../shared/gpu/make-bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=${FLASHINFER_VERSION:-0.7.4}
python_version=${DEVICE_PYTHON:-3.12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

pip download -q --no-deps -d "$work/wheels" "flashinfer-python==$version"
pip download -q --no-deps -d "$work/wheels" --only-binary=:all: --python-version "$python_version" \
  --platform manylinux_2_28_x86_64 "apache-tvm-ffi>=0.1.11,<0.2"
for wheel in "$work"/wheels/*.whl; do
  python -m zipfile -e "$wheel" "$work/site"
done

package=$work/site/flashinfer
csrc=$package/data/csrc
# Kernel sources: the paged-attention ones and the shared headers (the rest is MoE, GEMM, communication...).
find "$csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find "$csrc" -type f ! \( -name 'batch_decode*' -o -name 'batch_prefill*' -o -name 'single_decode*' \
  -o -name 'single_prefill*' -o -name 'page*' -o -name '*.h' -o -name '*.cuh' \) -delete
# Outside data/: Python, headers and small configuration files; not the kernel sources of other features.
find "$package" -path "$package/data" -prune -o -type f ! \( -name '*.py' -o -name '*.json' -o -name '*.h' \
  -o -name '*.cuh' -o -name 'py.typed' \) -print0 | xargs -0 rm -f

mkdir -p .gpu
tar cJf .gpu/flashinfer.tar.xz -C "$work/site" .
echo "wrote .gpu/flashinfer.tar.xz ($(du -h .gpu/flashinfer.tar.xz | cut -f1)) with flashinfer-python $version"
