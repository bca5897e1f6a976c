# kvgate gateway image: `docker build -t kvgate:0.1.0 .`
# Two stages: wheels are built with pip's full toolchain, the runtime stage only
# installs them: the runtime dependencies, plus the extras named in EXTRAS (e.g.
# `--build-arg EXTRAS=k8s` for Kubernetes pod discovery, `k8s,otel` with OpenTelemetry
# traces too); never bench or test.

ARG EXTRAS=""

FROM python:3.11-slim AS build
ARG EXTRAS
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY routing ./routing
COPY kvindex ./kvindex
COPY bench ./bench
COPY cli ./cli
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".${EXTRAS:+[$EXTRAS]}"

FROM python:3.11-slim
ARG EXTRAS
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf
RUN useradd --create-home --uid 10001 --user-group kvgate
COPY --from=build /wheels /wheels
# The kvgate wheel by its path (pinned by the build), its extras' wheels beside it.
RUN pip install --no-cache-dir --no-index --find-links /wheels \
        "$(echo /wheels/kvgate-*.whl)${EXTRAS:+[$EXTRAS]}" \
    && rm -rf /wheels
USER 10001:10001
WORKDIR /home/kvgate
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["kvgate", "serve"]
