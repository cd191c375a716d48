# Two commands do everything on a fresh machine: `make train` and `make test`.
# `make train` creates .venv (pip install -e ".[dev]") when it is missing or older than pyproject.toml; `make test`
# adds the optional extras the tests exercise (export formats, MLflow, Comet, Optuna; see pyproject.toml) on top.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=
# pytest's processes (pytest-xdist): one per core, at most 4. Most tests start a command (a Python that imports torch
# and Lightning, then trains a few batches on one thread), so on 2 cores two at a time take about 0.6 of the time.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
# setuptools warns at every editable install of a package mapped from another folder (kernels/ -> yolo5l_kernels)
# that a folder of the package's name may shadow it; the install is right, so the warning is left out of the log.
QUIET_BUILD := PYTHONWARNINGS=ignore::UserWarning

.PHONY: venv refvenv train test test-ci test-all lint bench clean

define NEW_VENV
test -x $(BIN)/python || $(PY) -m venv $(VENV)
$(BIN)/python -m pip install -q --upgrade pip
endef
# pip byte-compiles what it installs on one core (about 50 s for the ~20,000 modules of .venv); compileall does it
# on every core after pip. The .pyc files matter: where PYTHONDONTWRITEBYTECODE is set, a module without one is
# compiled again at each import (about 9 s more for each command that imports torch and Lightning). Two files in the
# wheels are not Python 3.11 (pip skips them alike): compile_dir's False for them is no failure; a failed write raises.
PIP := $(BIN)/python -m pip install -q --no-compile
COMPILE := $(BIN)/python -c "import compileall, sysconfig; \
	compileall.compile_dir(sysconfig.get_path('purelib'), quiet=2, workers=0)"

$(BIN)/.installed: pyproject.toml
	$(NEW_VENV)
	$(QUIET_BUILD) $(PIP) -e ".[dev]"
	$(COMPILE)
	touch $@

# The tflite stack (litert-torch, litert-converter, ai-edge-quantizer) goes in last, with --no-deps, so that pip neither
# installs nor reports what it declares and the conversion never imports: litert-converter's xdsl==0.28 (whose
# typing-extensions<4.13 pin conflicts with recent pydantic and coremltools) and lark, and the LLM-export tools
# (transformers, kagglehub, sentencepiece, litert-lm-builder, jaxtyping, fire, multipledispatch); `pip check` lists
# them. What the conversion does import (TFLITE_NEEDS, at the versions litert-torch 0.10 pins) is resolved with the
# rest, in one pip call.
TFLITE := "litert-torch==0.10.*" "litert-converter==0.5.*" "ai-edge-quantizer==0.10.*"
TFLITE_NEEDS := "ai-edge-litert==2.3.*" "torchao>=0.17" jax immutabledict absl-py rich

# On a fresh machine (or after pyproject.toml changed) the core install and the extras are one resolver pass, which
# also marks the core install done (`make train` needs nothing more); after a `make train` it adds the extras.
$(BIN)/.installed-extras: pyproject.toml
	$(NEW_VENV)
	$(QUIET_BUILD) $(PIP) -e ".[dev,export,mlflow,comet,optuna,openvino,ncnn,coreml]" $(TFLITE_NEEDS)
	$(PIP) --no-deps $(TFLITE)
	$(COMPILE)
	touch $(BIN)/.installed $@

venv: $(BIN)/.installed-extras

# The ultralytics/yolov5 v7.0 reference (PyPI yolov5==7.0.14) that the `reference` tests run yolo5l against, in
# .refvenv: it sees .venv's packages through a .pth file (the same torch, onnxruntime and LiteRT, no second copy of
# torch) and adds v7.0's own requirements on top, with the pins v7.0 needs (pkg_resources from setuptools<81,
# np.trapz from numpy<2.4, openvino.runtime from openvino<2026). pip's resolver notes about .venv's own packages,
# which it sees but does not manage, go to .refvenv/pip.log.
REF := .refvenv
$(REF)/.installed: $(BIN)/.installed-extras
	test -x $(REF)/bin/python || $(PY) -m venv $(REF)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> $$($(REF)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_yolo5l_venv.pth
	$(REF)/bin/python -m pip install -q "yolov5==7.0.14" "setuptools<81" "numpy<2.4" "openvino<2026" 2> $(REF)/pip.log \
		|| (cat $(REF)/pip.log; exit 1)
	touch $@

refvenv: $(REF)/.installed

train: $(BIN)/.installed
	$(BIN)/python -m yolo5l.train experiment=quickstart $(ARGS)

test: venv
	$(BIN)/python -m pytest -q -n $(JOBS) $(ARGS)

# What CI runs after `make test`: the tests behind the `heavy` marker (every export format end to end, the trackers),
# and the `reference` tests against v7.0 in .refvenv, where a skip counts as a failure. The reference tests run in one
# process: they share module-wide models and exports that each of several processes would make again.
test-ci: venv refvenv
	$(BIN)/python -m pytest -q -n $(JOBS) -m heavy $(ARGS)
	YOLO5L_REQUIRE_REFERENCE=1 $(BIN)/python -m pytest -q -m reference $(ARGS)

# In one process: the benchmarks among them measure, and would measure each other.
test-all: venv
	$(BIN)/python -m pytest -q -m "" $(ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check .

bench: $(BIN)/.installed
	$(BIN)/python scripts/bench_kernels.py
	$(BIN)/python scripts/bench_data.py
	$(BIN)/python scripts/bench_train.py

clean:
	rm -rf $(VENV) $(REF) *.egg-info .pytest_cache .test-scratch
