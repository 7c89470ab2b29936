#!/usr/bin/env bash
# What a lent GPU machine lacks for the served part of benchmarks/gpu.py, packed here and
# installed there (it has no network; a call carries at most 64 MiB).
#
#   here:   bash benchmarks/gpu_bundle.sh pack       # -> .gpu/ (git-ignored through .git/info/exclude)
#   there:  bash benchmarks/gpu_bundle.sh install    # first thing in the call that carries .gpu
#
# The grammar mask's cost (gpu.py's last target) needs xgrammar, which does not fit beside the
# server in one call's 64 MiB: `pack-grammar` (-> .gpu-grammar/, ~7 MB) and `install-grammar`,
# in a call of its own (gpu.py --models "Llama-3-8B bf16" --skip-served --skip-peer).
#
# Packed: Triton 2.51's server, python backend and 3.12 stub out of the nvidia-pytriton
# 0.7.0 wheel (xz, ~30 MB), numpy 1.26.4 (the 2.51 stub garbles string inputs under numpy
# 2) and tritonclient 2.73.0 with what its gRPC client needs and the image lacks or
# holds too old (python-rapidjson, grpcio, protobuf). Installed into the image's own Python,
# which the stub embeds: it reads that environment's site-packages, not PYTHONPATH, so the
# server's files and this checkout (`pagedserve` by path) are named there by a .pth file.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD

pack() {
    grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
    mkdir -p .gpu && rm -rf .gpu/*
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$tmp" nvidia-pytriton==0.7.0 numpy==1.26.4 tritonclient==2.73.0 python-rapidjson==1.25 grpcio==1.85.1 protobuf==6.33.6
    (cd "$tmp" && unzip -q nvidia_pytriton-*.whl 'pytriton/tritonserver/bin/*' 'pytriton/tritonserver/backends/python/*' \
        'pytriton/tritonserver/python_backend_stubs/3.12/*' 'nvidia_pytriton.libs/*' \
        && tar -cJf "$here/.gpu/tritonserver.tar.xz" pytriton nvidia_pytriton.libs)
    cp "$tmp"/*.whl .gpu/ && rm .gpu/nvidia_pytriton-*.whl
    rm -rf "$tmp"
    du -sh .gpu
}

install() {
    site="${TMPDIR:-/tmp}/pagedserve-gpu-site"  # the served environment, outside the checkout
    mkdir -p "$site/pagedserve"
    tar -xJf .gpu/tritonserver.tar.xz -C "$site"
    for name in backend kernels client; do ln -sfn "$here/$name" "$site/pagedserve/$name"; done
    python3 -m pip install -q --no-index --no-deps --no-compile .gpu/*.whl
    # built on numpy 2: transformers (the peer) imports scipy where it is installed, and fails under numpy 1
    python3 -m pip uninstall -q -y scikit-learn scipy || true
    echo "$site" > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pagedserve-gpu.pth"
    python3 -c "import numpy, pagedserve.backend, tritonclient.grpc; print('served environment ready, numpy', numpy.__version__)"
}

pack_grammar() {  # xgrammar and what it needs that the image lacks: carried in a call of its own (the server's pack fills a call)
    grep -qx "/.gpu-grammar/" .git/info/exclude 2>/dev/null || echo "/.gpu-grammar/" >> .git/info/exclude
    mkdir -p .gpu-grammar && rm -rf .gpu-grammar/*
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu-grammar xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.12.5 pydantic-core==2.41.5 \
        annotated-types==0.7.0 typing-inspection==0.4.2
    du -sh .gpu-grammar
}

install_grammar() {
    python3 -m pip install -q --no-index --no-deps --no-compile .gpu-grammar/*.whl
    python3 -c "import xgrammar; print('xgrammar', xgrammar.__version__)"
}

case "${1:-}" in
    pack-grammar) pack_grammar ;;
    install-grammar) install_grammar ;;
    *) "$@" ;;
esac
