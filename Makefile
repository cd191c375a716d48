# Two commands do everything on a fresh machine: `make train` and `make test`.
# `make train` creates .venv (pip install -e ".[dev]") when it is missing or older than pyproject.toml; `make test`
# adds the optional extras the tests exercise (export formats, MLflow, Optuna; see pyproject.toml) on top.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: venv train test test-all lint bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# The tflite stack (litert-torch, litert-converter, ai-edge-quantizer) goes in last, with --no-deps, so that pip neither
# installs nor reports what it declares and the conversion never imports: litert-converter's xdsl==0.28 (whose
# typing-extensions<4.13 pin conflicts with recent pydantic and coremltools) and lark, and the LLM-export tools
# (transformers, kagglehub, sentencepiece, litert-lm-builder, jaxtyping, fire, multipledispatch); `pip check` lists
# them. What the conversion does import (TFLITE_NEEDS, at the versions litert-torch 0.10 pins) is resolved with the
# rest, in one pip call.
TFLITE := "litert-torch==0.10.*" "litert-converter==0.5.*" "ai-edge-quantizer==0.10.*"
TFLITE_NEEDS := "ai-edge-litert==2.3.*" "torchao>=0.17" jax immutabledict absl-py rich

$(BIN)/.installed-extras: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[dev,export,mlflow,optuna,openvino,ncnn,coreml]" $(TFLITE_NEEDS)
	$(BIN)/python -m pip install -q --no-deps $(TFLITE)
	touch $@

venv: $(BIN)/.installed-extras

train: $(BIN)/.installed
	$(BIN)/python -m yolo5l.train experiment=quickstart $(ARGS)

test: venv
	$(BIN)/python -m pytest -q $(ARGS)

test-all: venv
	$(BIN)/python -m pytest -q -m "" $(ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check .

bench: $(BIN)/.installed
	$(BIN)/python scripts/bench_kernels.py
	$(BIN)/python scripts/bench_data.py
	$(BIN)/python scripts/bench_train.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .test-scratch
