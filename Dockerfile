# One image for every role: SuperLink, SuperNode, and the `flwr` CLI.
# CPU torch for amd64 and arm64 (Raspberry Pi 4/5, Jetson CPU; for CUDA on a Jetson
# use an NVIDIA L4T base image instead, see README "Running a client on a Raspberry
# Pi / Jetson").
#   docker buildx build --platform linux/amd64,linux/arm64 -t fedhet:0.1.0 .
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_HOME=/flwr-home

# Fashion-MNIST from Debian (offline default dataset); curl for health checks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends dataset-fashion-mnist curl \
 && rm -rf /var/lib/apt/lists/*

RUN pip install --index-url "$TORCH_INDEX" torch==2.14.1 torchvision==0.29.1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY common common
COPY data data
COPY models models
COPY strategies strategies
COPY server_app server_app
COPY client_app client_app
COPY cli cli
RUN pip install . && useradd --create-home --uid 10001 fedhet \
 && mkdir -p /flwr-home /state /home/fedhet/.cache/fedhet \
 && chown -R fedhet /flwr-home /state /home/fedhet/.cache /app
USER fedhet
EXPOSE 9092 9094
CMD ["fedhet", "--help"]
