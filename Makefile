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

# The tflite extra goes in without litert-converter's xdsl pin (typing-extensions<4.13, which pydantic and coremltools
# outgrew; the conversion does not import xdsl): its packages with --no-deps, then their own needs.
$(BIN)/.installed-extras: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[dev,export,mlflow,optuna,openvino,ncnn,coreml]"
	$(BIN)/python -m pip install -q --no-deps "litert-torch>=0.10" "litert-converter>=0.5" "ai-edge-quantizer>=0.10"
	$(BIN)/python -m pip install -q "ai-edge-litert>=2.3" jax torchao immutabledict
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
	rm -rf $(VENV) *.egg-info .pytest_cache
