#!/usr/bin/env bash
# SGLang (its offline Engine, for bench/sglang_chip.py) on a lent TPU machine, beside torch
# (bench/tpu_machine.sh): the machine has JAX, libtpu and its own package index
# (file:///opt/pypi/simple) but no SGLang, and takes at most 64 MiB a call.
#
#   bash bench/tpu_sglang.sh pack [VENV]   here: from the SGLang venv (CI's: pip install -e
#                                          '.[sglang]' && python -m torchtpu.integrations.sglang.install;
#                                          default /work/venvs/sglang) the installed files of
#                                          what sglang.Engine and the bench script open (CARRIED,
#                                          less CUT), xz, split in .tpu-sglang/a (the call
#                                          carrying torch's part a) and .tpu-sglang/b (the rest
#                                          and the manifest: the call carrying torch's part b)
#   bash bench/tpu_sglang.sh unpack        there, after bench/tpu_machine.sh unpack, with both
#                                          parts in place: INDEX_FIRST from the machine's index,
#                                          CARRIED, all in /tmp/site-sglang; then
#   export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site-sglang:$PWD TORCHTPU_PLATFORM=tpu \
#       TORCHTPU_SGLANG=1
#
# What travels was measured (bench/RESULTS.md, sglang1): bench/sglang_chip.py (make, HF's
# greedy, the engine at 1 and 8 requests) under strace in the SGLang venv, every file it opened
# under site-packages, by distribution; then the unpack rehearsed in a plain venv holding only
# what the chip has. Cut (CUT): SGLang's Rust extensions (srt/rust_extensions' four builds, 41 MB:
# the HTTP server, gRPC, bench and multimodal front ends; the radix cache imports its loader), its diffusion package (multimodal_gen, 52 MB),
# its tests and benchmarks; torchvision's compiled ops and its bundled CUDA libraries (a CUDA
# build that does not load beside the CPU torch: install.py guards its registrations, and a
# text model runs none of them); mistral_common's tokenizer data (36 MB) and pycountry's
# translations (22 MB), which SGLang's imports of them never open. None of them is opened by the
# engine on tpu.
set -euo pipefail
cd "$(dirname "$0")/.."
# installed from the machine's own index, each at the SGLang venv's version as this workplace's
# copy of that index holds it (/opt/pypi/simple); pack checks each against that copy
INDEX_FIRST="Pygments aiohappyeyeballs aiosignal annotated-types attrs cffi dill distro einops
  frozenlist gguf h11 httpcore huggingface_hub jsonschema-specifications loguru propcache psutil
  referencing requests rich safetensors sniffio tiktoken tokenizers traitlets urllib3 uvloop yarl
  zstandard"
# carried at the venv's versions: absent from the index, or there at another version
CARRIED="sglang torchvision transformers PyYAML aiohttp annotated-doc anyio apache-tvm-ffi certifi
  charset-normalizer click compressed-tensors fastapi httpx idna ipython jsonschema lxml
  mistral_common msgspec multidict openai openai-harmony orjson packaging partial-json-parser
  pillow pybase64 pycountry pydantic pydantic-extra-types pydantic_core python-multipart pyzmq
  regex rpds-py sentencepiece setproctitle soundfile starlette typing-inspection uvicorn
  watchfiles xgrammar llguidance"
# SGLang imports triton at its top (sglang/srt/utils/common.py) and decorates kernels with it,
# though a tpu platform runs none: the machine's index holds 3.8.0 (the venv's 3.9.0 is not there;
# 3.8.0 imports and serves those decorators), ~500 MB installed, so it is not carried; FastAPI
# (SGLang's imports of its server types) imports opentelemetry's API: the index's 1.45.0 (the
# venv's 1.45.2)
INDEX_OTHER="triton==3.8.0 opentelemetry-api==1.45.0"
CUT="sglang/srt/rust_extensions/_server.* sglang/srt/rust_extensions/_bench.*
  sglang/srt/rust_extensions/_grpc.* sglang/srt/rust_extensions/_multimodal.* sglang/multimodal_gen sglang/test sglang/benchmark
  torchvision/_C.so torchvision/image.so torchvision/video_reader.so torchvision.libs
  mistral_common/data pycountry/locales pycountry/tests"
# the first call carries torch's part a (44 MB) and .whl-tpu (2.9 MB): 64 MiB a call
CALL1_BYTES=${CALL1_BYTES:-18000000}
VENV=${2:-/work/venvs/sglang}
case "${1:-}" in
    pack)
        site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        out=$PWD/.tpu-sglang
        rm -rf "$out" && mkdir -p "$out/a" "$out/b"
        # each distribution's top-level files and folders, from its RECORD; an INDEX_FIRST
        # name whose version the index copy lacks is refused here, not found missing there
        "$VENV/bin/python" bench/pack_manifest.py --check-index $INDEX_FIRST -- $CARRIED \
            > "$out/b/manifest"
        carried=$(awk '$1 == "carried" { for (i = 3; i <= NF; i++) print $i }' "$out/b/manifest")
        excludes=(--exclude=__pycache__)
        for path in $CUT; do excludes+=("--exclude=$path"); done
        (cd "$site" && tar cf - "${excludes[@]}" $carried | xz -6 -T2 > "$out/core.tar.xz")
        # the first CALL1_BYTES travel with torch's part a, the rest with its part b
        split -b "$CALL1_BYTES" -d "$out/core.tar.xz" "$out/core."
        mv "$out/core.00" "$out/a/" && mv "$out"/core.0[1-9] "$out/b/" && rm "$out/core.tar.xz"
        exclude=$(git rev-parse --git-path info/exclude)  # a worktree's too
        grep -qx '/.tpu-sglang/' "$exclude" 2>/dev/null || printf '/.tpu-sglang/\n' >> "$exclude"
        ls -l "$out/a" "$out/b" ;;
    unpack)
        dest=/tmp/site-sglang
        mkdir -p "$dest"
        manifest=.tpu-sglang/b/manifest
        index="$(awk '$1 == "index" { printf "%s ", $2 }' $manifest)$INDEX_OTHER"
        if ! PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --upgrade \
                --only-binary=:all: --no-compile --no-cache-dir \
                --index-url file:///opt/pypi/simple --target "$dest" $index >/dev/null 2>&1; then
            echo "the machine's index lacks one of: $index" >&2
            exit 1
        fi
        echo "from the index: $index"
        # after pip, which replaces a top-level folder it installs; tar merges into it
        cat .tpu-sglang/a/core.* .tpu-sglang/b/core.* | xz -dc -T0 | tar x -C "$dest"
        # SGLang finds its platform plugins by entry point; torchtpu is not installed there
        mkdir -p "$dest/torchtpu-0.0.0.dist-info"
        printf 'Metadata-Version: 2.1\nName: torchtpu\nVersion: 0.0.0\n' \
            > "$dest/torchtpu-0.0.0.dist-info/METADATA"
        printf '[sglang.srt.platforms]\ntorchtpu = torchtpu.integrations.sglang:activate\n' \
            > "$dest/torchtpu-0.0.0.dist-info/entry_points.txt" ;;
    *)
        echo "usage: bash bench/tpu_sglang.sh pack [VENV] | unpack" >&2
        exit 2 ;;
esac
