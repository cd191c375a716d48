#!/usr/bin/env bash
# Fills .gpu/ (ignored by git) with what a GPU machine without network needs for scripts/gpu_check.sh, beside its
# preinstalled torch, torchvision, lightning, torchmetrics, tensorboard, opencv, numpy, pandas, matplotlib, scipy,
# pytest (Python 3.12, x86-64):
#   .gpu/wheels/     yolo5l's dependencies that such a machine lacks (Python 3.12 manylinux wheels; versions: those in
#                    .venv, so the check runs what the CPU tests run), and setuptools<81 (yolo5l's build backend,
#                    and pkg_resources for v7.0)
#   .gpu/v7wheels/   what ultralytics/yolov5 v7.0's train.py imports beyond that: GitPython (gitdb, smmap), IPython
#                    (and its dependencies)
#   .gpu/yolov5-v7.0.tar.gz   `git archive v7.0` of ultralytics/yolov5 (AGPL-3.0: only ever in this ignored folder)
# Usage: bash scripts/gpu_wheels.sh   (V7_GIT=<a clone or mirror of ultralytics/yolov5> where GitHub is out of reach)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.gpu
V7_COMMIT=915bbf294bb74c859f0b41f1c23bc395014ea679  # tag v7.0
mkdir -p "$DEST"
rm -rf "$DEST/wheels" "$DEST/v7wheels"
mkdir -p "$DEST/wheels" "$DEST/v7wheels"

# NAME==VERSION for each distribution: the version in .venv, else the fallback given.
pins() {
    "$PY" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for arg in sys.argv[1:]:
    name, _, fallback = arg.partition("=")
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(f"{name}=={fallback}")
EOF
}

download() {  # download FOLDER SPEC...: Python 3.12 x86-64 wheels, no dependencies (each is listed)
    local dir=$1
    shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$dir" "$@"
}

# yolo5l's core dependencies missing there (pyproject.toml), theirs, and the tests' pycocotools.
mapfile -t CORE < <(pins hydra-core=1.3.2 omegaconf=2.3.0 albumentations=2.0.8 albucore=0.0.24 pydantic=2.12.5 \
    pydantic-core=2.41.5 annotated-types=0.7.0 typing-inspection=0.4.2 typing-extensions=4.15.0 stringzilla=4.2.1 \
    simsimd=6.5.3 simplejpeg=1.9.0 faster-coco-eval=1.6.8 pycocotools=2.0.10)
download "$DEST/wheels" "${CORE[@]}" 'setuptools>=77,<81'
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) has no wheel on PyPI: build it (pure Python).
"$PY" -m pip wheel -q --no-deps -w "$DEST/wheels" antlr4-python3-runtime==4.9.3

mapfile -t V7 < <(pins gitpython=3.1.45 gitdb=4.0.12 smmap=5.0.2 ipython=9.7.0 ipython-pygments-lexers=1.1.1 \
    jedi=0.19.2 parso=0.8.5 matplotlib-inline=0.2.1 traitlets=5.14.3 pexpect=4.9.0 ptyprocess=0.7.0 \
    prompt-toolkit=3.0.52 wcwidth=0.2.14 stack-data=0.6.3 executing=2.2.1 asttokens=3.0.1 pure-eval=0.2.3)
download "$DEST/v7wheels" "${V7[@]}"

# ultralytics/yolov5 at v7.0, from V7_GIT, else from GitHub.
tarball=$DEST/yolov5-v7.0.tar.gz
if [ ! -s "$tarball" ]; then
    git_dir=${V7_GIT:-}
    clone=$(mktemp -d)
    trap 'rm -rf "$clone"' EXIT
    if [ -z "$git_dir" ] && git clone -q --bare --filter=blob:none https://github.com/ultralytics/yolov5 "$clone/y5"
    then
        git_dir=$clone/y5
    fi
    if [ -n "$git_dir" ] && [ "$(git --git-dir="$git_dir" rev-parse 'v7.0^{commit}' 2>/dev/null)" = "$V7_COMMIT" ]; then
        git --git-dir="$git_dir" archive --format=tar.gz --prefix=yolov5/ -o "$tarball" v7.0
    else
        echo "gpu_wheels: no ultralytics/yolov5 v7.0 (set V7_GIT=<a clone or mirror>): the check skips v7.0" >&2
    fi
fi

echo "wheels: $(ls "$DEST/wheels" | wc -l) in $DEST/wheels, $(ls "$DEST/v7wheels" | wc -l) in $DEST/v7wheels"
du -sh "$DEST/wheels" "$DEST/v7wheels" "$DEST"/*.tar.gz 2>/dev/null || true
echo "total to carry: $(du -sh "$DEST" | cut -f1) (.gpu)"
