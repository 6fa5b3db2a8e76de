#!/usr/bin/env bash
# On THIS machine (not the GPU one), from the repo root: an older commit, unpacked into
# .cache/oldtree/ with its own CUTLASS library, for an old-against-new engine run on ONE device
# machine (STAGE=oldnew in candidates_check.sh). Why: a change that removes a form (session 27's
# two-GEMM SwiGLU) leaves no variant that runs the old default in the new tree, and H100 hosts
# differ by more than most changes (session 25: 4.5% at (c)), so the old default must run on the
# same machine, within minutes of the new one.
#   bash ops/device/old_tree.sh REV      # then carry .cache/oldtree and .cache/cutlass
# The old tree's library goes under .cache/cutlass/<its digest>/ beside the new one's: the
# device run points the old tree at it (PRISM_CUTLASS_LIB), since without it the old engine would
# quietly run Triton's GEMMs only (the digest names the header by its absolute path, so a tree in
# another folder never finds the new tree's libraries by itself; STAGE=oldnew checks the log).
set -euo pipefail
REV=${1:?usage: bash ops/device/old_tree.sh REV}
OLD=.cache/oldtree
rm -rf "$OLD" && mkdir -p "$OLD"
git archive "$REV" | tar -xf - -C "$OLD" --exclude='*.gguf' --exclude='ops/bench/data'
git rev-parse "$REV" > "$OLD/REV"
# the old tree's library, by the old tree's own builder (its digest names its own header): the
# libraries and the toolchain here are lent to it first, so a library already built is found, not
# rebuilt, and nothing is downloaded again
ROOT=$PWD
mkdir -p "$OLD/.cache"
unpack=--toolchain  # the old tree's own wheels, unless this tree's toolchain is lent (never upgraded)
if [ -d .cache/cutlass-toolchain ]; then
    ln -s "$ROOT/.cache/cutlass-toolchain" "$OLD/.cache/cutlass-toolchain"
    unpack=
fi
if [ -d .cache/cutlass ]; then cp -r .cache/cutlass "$OLD/.cache/cutlass"; fi
# compiled units, named by their source, header and command (`cutlass_gemm._unit_key`): shared, so
# the old tree compiles only the units its headers changed (trees from session 34 on use them)
mkdir -p .cache/cutlass-objects && ln -s "$ROOT/.cache/cutlass-objects" "$OLD/.cache/cutlass-objects"
lib=$(cd "$OLD" && PYTHONPATH=$PWD "$ROOT/.venv/bin/python" ops/build_cutlass.py $unpack | tail -1)
digest=$(basename "$(dirname "$lib")")
mkdir -p ".cache/cutlass/$digest"
cp "$lib" ".cache/cutlass/$digest/"
rm -rf "$OLD/.cache"
echo "$digest" > "$OLD/CUTLASS_DIGEST"
echo "old tree $(cat "$OLD/REV") in $OLD, its CUTLASS library .cache/cutlass/$digest/ ($(du -sh "$OLD" | cut -f1))"
