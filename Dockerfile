# syntax=docker/dockerfile:1
# kvcache-exporter image: the exporter (`kvcache-exporter`, the default command) and the engine
# simulator (`kvcache-sim`, used by the compose demo profile). Runs as a non-root user and
# writes nothing outside /tmp, so it works with a read-only root filesystem.

# Build stage: install the package into a virtualenv that the runtime stage copies whole,
# so no compiler, pip cache or source tree reaches the final image. The full (not slim) image
# has the C compiler that builds the compiled page reader and fold (exporter/sources/cparser.pyx,
# exporter/adapters/cfold.pyx).
FROM python:3.13.11-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
# The folders the one import package (kvcache_exporter) is laid out over, as the wheel is built from them.
COPY exporter ./exporter
COPY simulator ./simulator
COPY dashboards ./dashboards
COPY alerts ./alerts
RUN python -m venv /opt/kvcache \
    && /opt/kvcache/bin/pip install --no-cache-dir /src

FROM python:3.13.11-slim-bookworm
LABEL org.opencontainers.image.title="kvcache-exporter" \
      org.opencontainers.image.description="KV-cache observability for LLM serving fleets (vLLM, SGLang, TensorRT-LLM and more)" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric uid/gid so that file permissions on mounted configs and secrets are predictable.
RUN groupadd --system --gid 10490 kvcache \
    && useradd --system --uid 10490 --gid kvcache --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kvcache
COPY --from=build /opt/kvcache /opt/kvcache
# MALLOC_ARENA_MAX: glibc gives threads (a scrape's, the resolver's) malloc arenas of their own,
# up to 8 per core; two keep the resident memory flat whatever the host (docs/robustness.md).
ENV PATH=/opt/kvcache/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2
USER 10490:10490
WORKDIR /tmp
EXPOSE 10490
# /ready answers 200 once the exporter has completed a poll cycle. The port follows
# KVCACHE_EXPORTER_LISTEN (default 0.0.0.0:10490) so that a changed listen address keeps the check honest.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('KVCACHE_EXPORTER_LISTEN', ':10490').rsplit(':', 1)[1]; urllib.request.urlopen(f'http://127.0.0.1:{port}/ready', timeout=4)"]
ENTRYPOINT ["kvcache-exporter"]
