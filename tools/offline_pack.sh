#!/usr/bin/env bash
# Fill offline/pack/ (or PACK_DIR) with what an offline GPU node (an air-gapped cluster with a PyTorch container:
# CPython 3.12 on x86-64 Linux, a CUDA torch, numpy, accelerate) lacks, at the versions pyproject.toml pins:
# DeepSpeed's sdist and its pure-Python needs, torchao, transformers, tokenizers, Liger-Kernel (pure Python; the
# node's triton runs it), and setuptools to build DeepSpeed there. Run on a machine with PyPI, copy the tree with
# this folder to the node, and install there with python3 tools/offline_install.py. The pack is about 37 MB; above
# PACK_LIMIT_MB (default 55) torch or another package the node already has was pulled in.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${PACK_DIR:-$ROOT/offline/pack}"
PIP="${PIP:-$ROOT/.venv/bin/python -m pip}"
LIMIT_MB="${PACK_LIMIT_MB:-55}"

pin() {  # the "name==version" of one dependency in pyproject.toml
    local line
    line="$(grep -oE "\"$1==[^\"]+\"" "$ROOT/pyproject.toml" | tr -d '"')"
    if [ -z "$line" ]; then
        echo "offline_pack.sh: pyproject.toml pins no version of $1" >&2
        exit 2
    fi
    echo "$line"
}

DEEPSPEED="$(pin deepspeed)"
TORCHAO="$(pin torchao)"
TRANSFORMERS="$(pin transformers)"
TOKENIZERS="$(pin tokenizers)"
LIGER="$(pin liger-kernel)"
# DeepSpeed's requirements (requirements/requirements.txt of its sdist, and nvidia-ml-py on CUDA), less torch,
# numpy, packaging, psutil and tqdm, which torch, accelerate and transformers already brought to the node.
DEEPSPEED_NEEDS=(einops hjson msgpack ninja py-cpuinfo "pydantic>=2" nvidia-ml-py)
# On the node already (accelerate's and torch's own requirements): left out of the folder to keep it small.
EXCLUDE=(numpy torch)

WHEEL_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
             --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
             --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any)

rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp"
$PIP download --quiet --no-deps --no-binary=:all: "$DEEPSPEED" -d "$OUT.tmp"
$PIP download --quiet --no-deps "${WHEEL_FLAGS[@]}" "$TORCHAO" "$LIGER" -d "$OUT.tmp"
$PIP download --quiet "${WHEEL_FLAGS[@]}" "$TRANSFORMERS" "$TOKENIZERS" setuptools "${DEEPSPEED_NEEDS[@]}" -d "$OUT.tmp"
for name in "${EXCLUDE[@]}"; do
    rm -f "$OUT.tmp/$name"-[0-9]*.whl
done

# What offline_install.py installs, in order: the names and versions it asks pip for (the rest of the folder is their needs).
cat > "$OUT.tmp/requirements.txt" <<REQ
$TORCHAO
$TRANSFORMERS
$TOKENIZERS
$LIGER
$DEEPSPEED
REQ
# The commit packed, for a node whose copy of the tree has no .git (the GPU kit records it).
(cd "$ROOT" && echo "$(git rev-parse HEAD)$(git status --porcelain --untracked-files=no | grep -q . && echo ' (with uncommitted changes)')") \
    > "$OUT.tmp/commit.txt"
find "$OUT.tmp" -maxdepth 1 \( -name '*.whl' -o -name '*.tar.gz' \) -printf '%f\n' | sort > "$OUT.tmp/files.txt"

size_mb=$(du -sm "$OUT.tmp" | cut -f1)
tree_mb=$(cd "$ROOT" && git ls-files -z | xargs -0 du -cm 2>/dev/null | tail -1 | cut -f1)
if [ "$size_mb" -gt "$LIMIT_MB" ]; then
    echo "offline_pack.sh: $OUT.tmp holds $size_mb MB, over PACK_LIMIT_MB=$LIMIT_MB: is torch or another large package in it?" >&2
    exit 1
fi
mkdir -p "$OUT"
find "$OUT" -mindepth 1 -delete
mv "$OUT.tmp"/* "$OUT"/
rmdir "$OUT.tmp"
echo "packed $(wc -l < "$OUT/files.txt") files, $size_mb MB, into $OUT (the tracked tree adds about $tree_mb MB)"
echo "copy the tree with this folder to the node; there, from the repository root:"
echo "python3 tools/offline_install.py    (then PYTHONPATH=\$PWD/offline/site, or: python3 bench/gpu/run.py --out runs/gpu_kit)"
