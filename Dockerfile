# syntax=docker/dockerfile:1
# Example image for xlaserve. UNTESTED: it was written where docker is not installed and has
# never been built or run. Change the build args below for your accelerator.
#
# One image serves both roles (the entrypoint is `xlaserve`):
#   gateway: docker run IMAGE serve --host 0.0.0.0 --engines grpcs://engine-0:50051,grpcs://engine-1:50051 \
#              --grpc-ca-file ca.pem --grpc-client-cert gateway.pem --grpc-client-key gateway.key --grpc-token-file token
#   replica: docker run IMAGE engine --grpc-port 50051 --host 0.0.0.0 --model gemma-3-270m \
#              --grpc-tls-cert engine.pem --grpc-tls-key engine.key --grpc-client-ca ca.pem --grpc-token-file token
#     (an engine on 0.0.0.0 refuses to start with neither a token nor a client CA; see
#     docs/operator/deployment.md for the files and docs/operator/replicas.md for the flags)
#   both in one process (the default CMD): docker run -p 8000:8000 IMAGE
#     (a non-loopback --host refuses to start until an API key exists, or with
#     --allow-unauthenticated: `docker run -v DATA:/data IMAGE keys create --tenant NAME --rpm N`)
#
# Variants (the same python:3.11-slim base: jax's CUDA and TPU wheels bring their own runtime
# libraries from PyPI; a GPU host needs only the NVIDIA driver and container toolkit):
#   CPU: docker build -t xlaserve:cpu .
#   GPU: docker build --build-arg JAX_EXTRA=cuda12 -t xlaserve:cuda12 .   # run with --gpus ...
#   TPU: docker build --build-arg JAX_EXTRA=tpu -t xlaserve:tpu .         # libtpu from PyPI
# JAX_EXTRA installs jax[JAX_EXTRA] at the version `pip install .` chose (pyproject.toml pins
# jax); check that this jax version still has the extra (cuda12 may have become cuda13).
#
# Model data (dequantized weights, tokenizer, compiled programs; ~1.1 GB for the default
# Gemma 3 270M) is cached under XLASERVE_DATA_DIR=/data: mount a volume there so restarts
# skip the dequantizing and most compiling. Hugging Face Hub downloads go to /data/huggingface.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG JAX_EXTRA=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# README.md: pyproject.toml names it as the package's readme. benchmarks: `xlaserve bench`.
# CMakeLists.txt and kernels_cpu: the CPU kernels, compiled by `pip install` with the g++ below
# (without a compiler the install still succeeds and the server uses XLA's dots).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md CMakeLists.txt ./
COPY model ./model
COPY kernels_pallas ./kernels_pallas
COPY kernels_cpu ./kernels_cpu
COPY serving ./serving
COPY sharding ./sharding
COPY configs ./configs
COPY benchmarks ./benchmarks
# `.` with the `postgres` extra (psycopg, for a PostgreSQL --database-url).
RUN pip install ".[postgres]" \
 && if [ -n "$JAX_EXTRA" ]; then \
      pip install "jax[${JAX_EXTRA}]==$(python -c 'from importlib.metadata import version; print(version("jax"))')"; \
    fi

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/venv /opt/venv
# A non-root user; /data is its to write (a named docker volume takes this ownership; in
# Kubernetes set securityContext.fsGroup: 1000). Its home is writable too: the default
# model's package assembles its GGUF under ~/.cache (a ~250 MB copy at first load).
RUN useradd --create-home --uid 1000 --user-group xlaserve \
 && mkdir -p /data && chown xlaserve:xlaserve /data
ENV PATH=/opt/venv/bin:$PATH \
    XLASERVE_DATA_DIR=/data \
    HF_HOME=/data/huggingface \
    PYTHONUNBUFFERED=1
USER xlaserve
WORKDIR /home/xlaserve
VOLUME ["/data"]
# 8000: the HTTP gateway (serve); 50051: an engine replica's gRPC port (engine --grpc-port).
EXPOSE 8000 50051
ENTRYPOINT ["xlaserve"]
CMD ["serve", "--host", "0.0.0.0"]
