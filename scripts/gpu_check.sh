#!/usr/bin/env bash
# The whole GPU check in one command, on a GPU machine without network whose python3 has torch, torchvision,
# lightning, torchmetrics, tensorboard, opencv, pandas, matplotlib, scipy and pytest (Python 3.12), from the
# repository root, after `bash scripts/gpu_wheels.sh` filled .gpu/ on a machine with network:
#
#     bash scripts/gpu_check.sh            # about 6 minutes; logs and summary.txt in $OUT (default: the work folder)
#
# Stages, most important first, each under `timeout` within one budget (GPU_CHECK_BUDGET seconds, 500 by default;
# a stage is skipped when less than its minimum is left):
#   setup        install .gpu/wheels into a --target folder put first on PYTHONPATH, then yolo5l (-e, offline);
#                nvidia-smi -L, versions, an import check
#   pytest_gpu   pytest -m gpu
#   data         2048 training and 256 validation JPEGs of synthetic shapes, long side 480-800 px
#                (yolo5l.data.synthetic, one process per core), and the 320 of bench_input.py
#   v7_train     ultralytics/yolov5 v7.0 train.py (.gpu/yolov5-v7.0.tar.gz): YOLOv5s from scratch, 640 px, batch 64,
#                5 epochs, 8 workers, no cache, --noval (it validates at the end)
#   yolo5l_train python -m yolo5l.train, the same settings, validation after the last epoch only (data.pipeline=auto:
#                the device input path on CUDA)
#   yolo5l_host  yolo5l_train again with data.pipeline=host (the workers make the pixels)
#   bench_input  scripts/bench_input.py --device cuda --workers 8 (the input paths alone; no v7.0 row)
# After each stage, summary.txt in $OUT says what the finished stages gave (wall times, v7.0 / yolo5l, data wait per
# epoch, the start-up block's pipeline and cache lines, pytest's result); the end prints it.
#
# GPU_CHECK_DRY=1: the same stages on the CPU at tiny sizes (32 images, 128 px, batch 8, 2 epochs) with .venv's
# python (and .refvenv's for v7.0 when present); the wheels are installed for Python 3.12 into a folder that is not
# used, only to see that they install, and every process refuses to import a package that neither the GPU machine
# (its list below) nor .gpu/ provides.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
DRY=${GPU_CHECK_DRY:-0}
T=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check}
OUT=${OUT:-$T/out}
BUDGET=${GPU_CHECK_BUDGET:-500}
WHEELS=$REPO/.gpu/wheels V7WHEELS=$REPO/.gpu/v7wheels V7TAR=$REPO/.gpu/yolov5-v7.0.tar.gz
if [ "$DRY" = 1 ]; then
    PY=${PY:-$REPO/.venv/bin/python}
    V7PY=${V7PY:-$REPO/.refvenv/bin/python}
    [ -x "$V7PY" ] || V7PY=$PY
    N_TRAIN=32 N_VAL=8 IMG=128 BATCH=8 EPOCHS=2 WORKERS=2 DEVICE=cpu V7DEVICE=cpu BENCH_TRAIN=16
    BENCH_ARGS=(--imgsz 128 --batch 4 --device-batch 2 --workers 1 --batches 1 --rounds 1)
    BUDGET=${GPU_CHECK_BUDGET:-1500}
else
    PY=${PY:-python3}
    V7PY=${V7PY:-$PY}
    N_TRAIN=2048 N_VAL=256 IMG=640 BATCH=64 EPOCHS=5 WORKERS=${GPU_CHECK_WORKERS:-8} DEVICE=cuda V7DEVICE=0
    BENCH_TRAIN=320 BENCH_ARGS=(--workers "$WORKERS")
fi
DATA=$T/data-$N_TRAIN BENCH_DATA=$T/coco-size-$BENCH_TRAIN
if [ "$DRY" = 1 ]; then  # the dry run's python has yolo5l's packages: a guard refuses what the GPU machine lacks
    Y5PATH=$T/devsim V7PATH=$T/v7cust:$T/v7site
    export GPU_CHECK_ALLOWED=$T/allowed.txt
else
    Y5PATH=$T/site V7PATH=$T/v7cust:$T/v7site:$T/site  # v7.0 takes pkg_resources from the carried setuptools<81
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

# stage NAME MAX_S MIN_S COMMAND...: run COMMAND under timeout, its output in $OUT/NAME.log (appended), record its
# exit code and wall seconds in stages.tsv, then rewrite the summary.
stage() {
    local name=$1 max=$2 min=$3 left t rc t0 t1 secs
    shift 3
    left=$((BUDGET - (SECONDS - START)))
    t=$((max < left ? max : left))
    if ((t < min)); then
        echo "[$name] skipped: ${left} s of the ${BUDGET} s budget left (needs ${min})"
        printf '%s\tskipped\t0\n' "$name" >>"$T/stages.tsv"
        return 0
    fi
    echo "[$name] $(date +%T) timeout ${t} s: $*"
    t0=$(date +%s.%N)
    # The function runs in a fresh `bash gpu_check.sh --stage`: timeout needs a command, and ends its process group.
    timeout -k 15 "$t" bash "$REPO/scripts/gpu_check.sh" --stage "$@" >>"$OUT/$name.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    secs=$(awk "BEGIN {printf \"%.1f\", $t1 - $t0}")
    printf '%s\t%s\t%s\n' "$name" "$rc" "$secs" >>"$T/stages.tsv"
    echo "[$name] exit code $rc after $secs s"
    summary
}

# ------------------------------------------------------------------------------------------------ setup
# What the GPU machine's image holds (its Python packages, as listed for it in 2026-11), for the dry run's guard.
DEVICE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp"

# sitecustomize.py text: with GPU_CHECK_ALLOWED (a file of distribution names) set, imports of top-level modules
# whose distributions are all outside it fail as if not installed.
GUARD='
import os as _os
if _os.environ.get("GPU_CHECK_ALLOWED"):
    import re as _re
    import sys as _sys
    from importlib.metadata import packages_distributions as _pd

    _norm = lambda n: _re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    _allowed = {_norm(n) for n in open(_os.environ["GPU_CHECK_ALLOWED"]).read().split()}
    _dists = _pd()

    class _NotOnTheGPUMachine:
        def find_spec(self, name, path=None, target=None):
            dists = _dists.get(name)
            if "." not in name and dists and not any(_norm(d) in _allowed for d in dists):
                raise ModuleNotFoundError(f"No module named {name!r} (dry run: {dists[0]} is not there)", name=name)
            return None

    _sys.meta_path.insert(0, _NotOnTheGPUMachine())
'

setup() {
    local pip=(-m pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check)
    mkdir -p "$T/v7cust" "$T/devsim" "$T/v7cfg"
    if [ "$DRY" = 1 ]; then
        echo "dry run: .gpu/wheels installed for CPython 3.12 into $T/site312 (not used), the runs use $PY"
        "$PY" "${pip[@]}" --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --target "$T/site312" "$WHEELS"/*.whl || return 1
        printf '%s\n' "$GUARD" >"$T/devsim/sitecustomize.py"
        { echo "$DEVICE_PACKAGES yolo5l"; ls "$WHEELS" "$V7WHEELS" | sed 's/-.*//'; } >"$T/allowed.txt"
    else
        "$PY" "${pip[@]}" --target "$T/site" "$WHEELS"/*.whl || return 1
        # yolo5l into python3's environment (an editable install: the repository's files), built by the
        # carried setuptools.
        PYTHONPATH=$T/site "$PY" "${pip[@]}" --no-build-isolation -e . || return 1
    fi
    "$V7PY" "${pip[@]}" --target "$T/v7site" "$V7WHEELS"/*.whl || return 1
    # v7.0 under numpy >= 2.4 (np.trapz is gone); its Arial.ttf, which check_dataset would download.
    printf '%s\nimport numpy\nif not hasattr(numpy, "trapz"):\n    numpy.trapz = numpy.trapezoid\n' "$GUARD" \
        >"$T/v7cust/sitecustomize.py"
    "$V7PY" -c "import matplotlib, shutil; shutil.copy(matplotlib.get_data_path() + '/fonts/ttf/DejaVuSans.ttf', \
'$T/v7cfg/Arial.ttf')"
    if [ -s "$V7TAR" ]; then tar -xzf "$V7TAR" -C "$T"; else echo "no $V7TAR: v7.0 is skipped"; fi
    nvidia-smi -L 2>&1 || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    echo "CPUs $(nproc), memory $(free -g | awk '/Mem:/ {print $2}') GiB"
    PYTHONPATH=$Y5PATH "$PY" - <<'EOF'
import importlib.metadata as m
import sys

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
names = ["torchvision", "lightning", "torchmetrics", "triton", "numpy", "opencv-python-headless", "hydra-core",
         "omegaconf", "albumentations", "pydantic", "simplejpeg", "faster-coco-eval", "setuptools", "yolo5l"]
found = []
for n in names:
    try:
        found.append(f"{n} {m.version(n)}")
    except m.PackageNotFoundError:
        found.append(f"{n} missing")
print("versions:", ", ".join(found))
import albumentations, cv2, faster_coco_eval, hydra, simplejpeg, yolo5l.train, yolo5l_kernels  # noqa: E401,F401

print("import check: ok (yolo5l.train, yolo5l_kernels, albumentations, hydra, simplejpeg, faster_coco_eval); cv2",
      cv2.__version__)
EOF
}

# ------------------------------------------------------------------------------------------------ data
make_data() {
    PYTHONPATH=$Y5PATH "$PY" - "$DATA" "$N_TRAIN" "$N_VAL" "$BENCH_DATA" "$BENCH_TRAIN" "$T/v7data" <<'EOF'
import functools
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

from yolo5l.data import synthetic as syn

data, n_train, n_val, bench, bench_train, v7 = sys.argv[1:]
pool = ProcessPoolExecutor(os.cpu_count(), mp_context=mp.get_context("fork"))


def write_split(root, split, n, params):  # ensure_synthetic's, one process per core: the same files
    (root / syn.IMAGES_DIR / split).mkdir(parents=True, exist_ok=True)
    (root / syn.LABELS_DIR / split).mkdir(parents=True, exist_ok=True)
    list(pool.map(functools.partial(syn._write_image, root, split, params=params), range(n), chunksize=16))


if hasattr(syn, "_write_image") and hasattr(syn, "_write_split"):
    syn._write_split = write_split
else:
    print("yolo5l.data.synthetic changed: generating with its own threads")
t = time.perf_counter()
src = syn.ensure_synthetic(data, num_train=int(n_train), num_val=int(n_val), min_side=480, max_side=800)
# bench_input.py's set (its defaults: 4 validation images, sides 480-800), so that it finds it made.
syn.ensure_synthetic(bench, num_train=int(bench_train), num_val=4, min_side=480, max_side=800)
print(f"{n_train} + {n_val} JPEGs at {Path(data)}, {bench_train} at {Path(bench)}: "
      f"{time.perf_counter() - t:.1f} s on {os.cpu_count()} processes")
# v7.0 sees the set through a link per file (its label caches, labels/*.cache, would overwrite yolo5l's of the
# same name; it resolves linked folders).
cfg = yaml.safe_load(Path(src).read_text())
for kind in ("images", "labels"):
    for split in ("train", "val"):
        (Path(v7) / kind / split).mkdir(parents=True, exist_ok=True)
        for f in (Path(data) / kind / split).iterdir():
            (Path(v7) / kind / split / f.name).symlink_to(f)
names = cfg["names"] if isinstance(cfg["names"], dict) else dict(enumerate(cfg["names"]))
(Path(v7) / "data.yaml").write_text(yaml.safe_dump({"path": v7, "train": "images/train", "val": "images/val",
                                                     "names": names}))
EOF
}

# ------------------------------------------------------------------------------------------------ runs
v7_train() {
    [ -d "$T/yolov5" ] || { echo "no v7.0 source tree (.gpu/yolov5-v7.0.tar.gz)"; return 3; }
    cd "$T/yolov5" || return 1
    PYTHONPATH=$V7PATH YOLOv5_AUTOINSTALL=False \
        GIT_PYTHON_REFRESH=quiet TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 YOLOV5_CONFIG_DIR="$T/v7cfg" \
        WANDB_MODE=disabled COMET_MODE=disabled \
        "$V7PY" train.py --data "$T/v7data/data.yaml" --cfg yolov5s.yaml --weights '' --img "$IMG" \
        --batch-size "$BATCH" --epochs "$EPOCHS" --workers "$WORKERS" --device "$V7DEVICE" --noval --noplots \
        --project "$T/runs" --name v7 --exist-ok
}

yolo5l_train() {  # yolo5l_train RUN_NAME [OVERRIDE...]; Triton's kernel cache starts empty, as on a fresh machine
    local name=$1
    shift
    PYTHONPATH=$Y5PATH TRITON_CACHE_DIR=$T/triton-$name "$PY" -m yolo5l.train data.file="$DATA/data.yaml" \
        data.num_workers="$WORKERS" trainer.max_epochs="$EPOCHS" data.batch_size="$BATCH" data.imgsz="$IMG" \
        data.cache=none callbacks.val_interval.n="$EPOCHS" plots=false '~callbacks.batch_plotter' \
        hydra.run.dir="$T/runs/$name" "$@"
}

bench_input() {
    PYTHONPATH=$Y5PATH "$PY" scripts/bench_input.py --device "$DEVICE" --root "$BENCH_DATA" \
        --num-train "$BENCH_TRAIN" --no-reference "${BENCH_ARGS[@]}"
}

pytest_gpu() {  # 100 s a test at most where pytest-timeout is there
    local per_test=()
    PYTHONPATH=$Y5PATH "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 100)
    PYTHONPATH=$Y5PATH TRITON_CACHE_DIR=$T/triton-pytest "$PY" -m pytest -m gpu -q -p no:cacheprovider \
        "${per_test[@]}" tests
}

# ------------------------------------------------------------------------------------------------ summary
summary() {  # $OUT/summary.txt from stages.tsv and the logs
    "$PY" - "$T/stages.tsv" "$OUT" "$N_TRAIN" "$N_VAL" "$IMG" "$BATCH" "$EPOCHS" "$WORKERS" "$BUDGET" \
        >"$OUT/summary.txt" <<'EOF'
import re
import sys
from pathlib import Path

stages_file, out, n_train, n_val, img, batch, epochs, workers, budget = sys.argv[1:]
out = Path(out)
stages = {}
if Path(stages_file).exists():
    for line in Path(stages_file).read_text().splitlines():
        name, rc, secs = line.split("\t")
        stages[name] = (rc, float(secs))


def log(name):
    p = out / f"{name}.log"
    text = re.sub(r"\x1b\[[0-9;]*m", "", p.read_text(errors="replace")) if p.exists() else ""  # no colours
    return re.split(r"[\r\n]", text)


def status(name):
    if name not in stages:
        return "not run"
    rc, secs = stages[name]
    what = {"0": "ok", "124": "TIMED OUT", "137": "KILLED", "skipped": "SKIPPED (budget)"}.get(rc, f"exit code {rc}")
    return what if rc == "skipped" else f"{what}, {secs:.1f} s"


def yolo5l_epochs(lines):
    pat = re.compile(r"^epoch (\d+)/\d+ .*?([\d.]+) images/s\s+data wait (\d+)%\s+([\d.]+) s\s*$")
    return [(float(m[4]), int(m[3]), float(m[2])) for m in map(pat.match, lines) if m]


def v7_epochs(lines):
    # tqdm's last state of each epoch's bar: "      0/4    3.2G   0.1   0.04   0.03   171   640: 100%|...| 32/32 00:14"
    pat = re.compile(r"^\s*(\d+)/\d+\s+\S+\s.*100%\|[^|]*\|\s*\d+/\d+\s+(?:(\d+):)?(\d+):(\d+)")
    last = {}
    for m in map(pat.match, lines):
        if m:
            last[int(m[1])] = int(m[2] or 0) * 3600 + int(m[3]) * 60 + int(m[4])
    return [last[k] for k in sorted(last)]


def wall(name):
    rc, secs = stages.get(name, ("", 0.0))
    return secs if rc == "0" else None


p = []
setup = log("setup")
gpu = [s for s in setup if s.startswith("GPU ")] or ["GPU: none seen"]
p.append(f"GPU check: {'; '.join(gpu)}")
p += [s for s in setup if s.startswith(("python ", "versions:", "import check", "CPUs ", "dry run"))]
p.append("")
p.append(f"stages (budget {budget} s):")
for name in ("setup", "pytest_gpu", "data", "v7_train", "yolo5l_train", "yolo5l_host", "bench_input"):
    p.append(f"  {name:<13} {status(name)}")
p.append("")
py = log("pytest_gpu")
res = [s for s in py if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", s)]
p.append(f"pytest -m gpu: {res[-1].strip('= ') if res else status('pytest_gpu')}")
p += [f"  {s}" for s in py if s.startswith(("FAILED", "ERROR"))]
p += [f"  {s}" for s in log("data") if "JPEGs at" in s]
p.append("")
p.append(f"{epochs} epochs of YOLOv5s from scratch, {img} px, batch {batch}, {workers} workers, no cache, "
         f"{n_train} + {n_val} JPEGs (480-800 px); wall: command to exit")
v7 = log("v7_train")
v7w = wall("v7_train")
ep = v7_epochs(v7)
amp = [s.strip() for s in v7 if "AMP: " in s or "epochs completed in" in s]
line = f"  v7.0 train.py: {status('v7_train')}" if v7w is None else f"  v7.0 train.py: {v7w:.1f} s"
if ep:
    line += f"; epochs {', '.join(f'{e} s' for e in ep)} (tqdm)"
p.append(line + "".join(f"; {s}" for s in amp))
for name, label in (("yolo5l_train", "yolo5l"), ("yolo5l_host", "yolo5l pipeline=host")):
    lines = log(name)
    w = wall(name)
    eps = yolo5l_epochs(lines)
    line = f"  {label}: {status(name)}" if w is None else f"  {label}: {w:.1f} s"
    if eps:
        line += (f"; epochs {', '.join(f'{e[0]:.1f}' for e in eps)} s (first {eps[0][0]:.1f} s); data wait "
                 f"{', '.join(f'{e[1]}%' for e in eps)}; {', '.join(f'{e[2]:.0f}' for e in eps)} images/s")
    if w is not None and v7w is not None:
        line += f"; v7.0 / {label}: {v7w / w:.2f}x"
    p.append(line)
    for s in lines:
        start_up = re.match(r"^\s+(pipeline|cache|precision|workers|devices):", s)
        if start_up or s.startswith(("device cache", "Training done")):
            p.append(f"      {s.strip()}")
bench = log("bench_input")
if bench:
    p.append("")
    p.append(f"bench_input.py: {status('bench_input')}")
    p += [f"  {s}" for s in bench if s.startswith(("|", "device workers'", "imgsz "))]
print("\n".join(p))
EOF
}

# ------------------------------------------------------------------------------------------------ main
if [ "${1:-}" = --stage ]; then  # one stage's function, as stage() runs it
    shift
    "$@"
    exit
fi
rm -rf "$T"/site "$T"/site312 "$T"/v7site "$T"/v7cust "$T"/devsim "$T"/yolov5 "$T"/runs "$T"/v7data "$T"/triton-* \
    "$T"/stages.tsv
mkdir -p "$T/runs" "$OUT" || exit 1
for name in summary.txt setup.log pytest_gpu.log data.log v7_train.log yolo5l_train.log bench_input.log \
    yolo5l_host.log; do rm -f "${OUT:?}/$name"; done  # (at most 8 files come back from $OUT)
START=$SECONDS
echo "gpu_check: work folder $T, logs in $OUT, budget $BUDGET s$([ "$DRY" = 1 ] && echo ', dry run on the CPU')"
stage setup 180 30 setup
stage pytest_gpu 150 30 pytest_gpu
stage data 90 20 make_data
stage v7_train 170 60 v7_train
stage yolo5l_train 170 60 yolo5l_train yolo5l
stage yolo5l_host 170 60 yolo5l_train yolo5l_host data.pipeline=host
stage bench_input 120 40 bench_input
cat "$OUT/summary.txt"
echo "gpu_check: done in $((SECONDS - START)) s"
