#!/usr/bin/env bash
# torch on a lent TPU machine that has JAX and libtpu but no torch and no package index with it,
# and takes at most 64 MiB of carried files a call (bench/RESULTS.md, "torchtpu on a real TPU").
#
#   bash bench/tpu_machine.sh pack [WHEEL]   here: torch's CPU wheel without its tests, binaries
#                                            and headers, as .tpu-parts/a and .tpu-parts/b
#                                            (~44 MB each) and its small dependencies as .whl-tpu
#   bash bench/tpu_machine.sh unpack         there, after one call carrying .tpu-parts/a and
#                                            .whl-tpu and a second carrying .tpu-parts/b: torch
#                                            in /tmp/site; then
#   export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD TORCHTPU_PLATFORM=tpu
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    pack)
        wheel=${2:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl)}
        work=$(mktemp -d)
        unzip -q "$wheel" -d "$work/site"
        rm -rf "$work"/site/torch/{test,bin,include,share}
        (cd "$work/site" && tar cf - . | xz -9 -T2 > "$work/torch.tar.xz")
        mkdir -p .tpu-parts/a .tpu-parts/b .whl-tpu
        split -b 44000000 -d "$work/torch.tar.xz" "$work/part."
        mv "$work/part.00" .tpu-parts/a/ && mv "$work/part.01" .tpu-parts/b/
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d .whl-tpu filelock typing_extensions \
            networkx jinja2 markupsafe fsspec tqdm flatbuffers expecttest
        grep -qx '/.tpu-parts/' .git/info/exclude 2>/dev/null || printf '/.tpu-parts/\n/.whl-tpu/\n' >> .git/info/exclude
        rm -rf "$work" ;;
    unpack)
        mkdir -p /tmp/site
        PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl
        cat .tpu-parts/a/part.00 .tpu-parts/b/part.01 | xz -dc -T0 | tar x -C /tmp/site
        # torch checks that its shared-memory manager exists at import; nothing here starts it.
        mkdir -p /tmp/site/torch/bin
        printf '#!/bin/sh\nexit 1\n' > /tmp/site/torch/bin/torch_shm_manager
        chmod +x /tmp/site/torch/bin/torch_shm_manager ;;
    *)
        echo "usage: bash bench/tpu_machine.sh pack [WHEEL] | unpack" >&2
        exit 2 ;;
esac
