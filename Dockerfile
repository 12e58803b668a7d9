# kvtierd daemon image: `kvtierd serve --config /etc/kvtierd/kvtierd.toml` as a non-root user.
# Linted by hadolint (scripts/install-hadolint, tests/deploy/test_helm_chart.py); packaged by helm/kvtierd.
#
#   docker build -t kvtierd:0.1.0 .
#   docker build -t kvtierd:0.1.0-cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       --build-arg EXTRAS=cuda .          # CUDA torch and CuPy, for pool.device = "cuda"
#
# torch is installed first, from the CPU wheel index by default: the project's loose torch>=2.5
# would otherwise resolve a CUDA build of several GB (see README).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler for the optional C extensions (kernels/hash_chain.c, kernels/copy_spans.c); the runtime stage needs none.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kvtierd
ENV PATH=/opt/kvtierd/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# Only what the wheel is built from (.dockerignore keeps the rest out); build_py compiles the protos.
COPY pyproject.toml setup.py README.md ./
COPY proto/ proto/
COPY kvtierd/ kvtierd/
COPY kernels/ kernels/
COPY connectors/ connectors/
RUN pip install --no-cache-dir "/src${EXTRAS:+[$EXTRAS]}" \
    && kvtierd --help >/dev/null \
    && python -c "from kvtierd.hash_chain_native import native_chain; assert native_chain('xxh3_128')" \
    && python -c "from kvtierd.movers.span_copy import native_available; assert native_available()"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvtierd" \
      org.opencontainers.image.description="Per-node KV-cache tiering daemon for LLM inference" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kvtierd /opt/kvtierd
ENV PATH=/opt/kvtierd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# A fixed non-root uid/gid: the chart's securityContext and the runners sharing the socket use it.
RUN groupadd --system --gid 10001 kvtierd \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/kvtierd --no-create-home \
       --shell /usr/sbin/nologin kvtierd \
    && mkdir -p /run/kvtierd /var/lib/kvtierd /etc/kvtierd \
    && chown 10001:10001 /run/kvtierd /var/lib/kvtierd
USER 10001:10001
WORKDIR /var/lib/kvtierd
# 7070: gRPC over TCP (TLS); 8081: plaintext grpc.health.v1 (server.health_tcp); 9464: metrics.
EXPOSE 7070 8081 9464
# SIGTERM stops the daemon cleanly (exit 0) within server.grace_s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvtierd", "serve"]
CMD ["--config", "/etc/kvtierd/kvtierd.toml"]
