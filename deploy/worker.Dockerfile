# The memra-obs image: `memra-obs demo` (a simulated worker) or `memra-obs agent` (the per-host
# publisher), chosen by the container command. Built from the repository root:
#   docker build -f deploy/worker.Dockerfile -t memra-obs-worker:0.1.0 .
# (deploy/worker.Dockerfile.dockerignore keeps .git, .venv and caches out of the context.)
FROM python:3.12.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY memra_obs ./memra_obs
# The base install only: spans go out over OTLP/HTTP with the stdlib, metrics are served by
# prometheus-client; no gRPC and no GPU libraries in a demo image.
RUN pip install . && rm -rf /src

# A fixed uid so the shared ring volume can be owned by it (compose: tmpfs uid=10001;
# Kubernetes: fsGroup 10001).
RUN useradd --system --uid 10001 --no-create-home memra
USER 10001
WORKDIR /tmp

EXPOSE 9464
ENTRYPOINT ["memra-obs"]
CMD ["demo"]
