# One image for every role: SuperLink, SuperNode, the warm executor (`fedhet superexec`)
# and the `flwr` CLI. CPU torch for amd64 and arm64 (Raspberry Pi 4/5, Jetson CPU; for
# CUDA on a Jetson use an NVIDIA L4T base image, see docs/deployment.md "Running a client on a
# Raspberry Pi / Jetson").
#   docker build -t fedhet:0.1.0 .
#   docker build --build-arg BASE=<debian-bookworm image with python3-venv> \
#                --build-arg TORCH_INDEX=https://pypi.org/simple -t fedhet:0.1.0 .
# Behind a TLS-intercepting proxy, put its CA bundle at deploy/build-ca/ca.crt: only
# the build stage sees it; the image is assembled from the built virtualenv alone.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
# the build stage is left behind as an untagged image (GBs: torch and its wheels);
# `docker image prune --force --filter label=org.fedhet.stage=build` removes it
LABEL org.fedhet.stage=build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/fedhet
COPY deploy/build-ca /tmp/build-ca
RUN if [ -f /tmp/build-ca/ca.crt ]; then export PIP_CERT=/tmp/build-ca/ca.crt; fi \
 && /opt/fedhet/bin/pip install --index-url "$TORCH_INDEX" torch==2.14.1 torchvision==0.29.1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common common
COPY data data
COPY models models
COPY strategies strategies
COPY server_app server_app
COPY client_app client_app
COPY cli cli
RUN if [ -f /tmp/build-ca/ca.crt ]; then export PIP_CERT=/tmp/build-ca/ca.crt; fi \
 && /opt/fedhet/bin/pip install .

FROM ${BASE}
ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/fedhet/bin:$PATH \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_HOME=/flwr-home
# Fashion-MNIST from Debian (offline default dataset); curl for health checks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends dataset-fashion-mnist curl \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/fedhet /opt/fedhet
# uid/gid 49999 as in Flower's official images; every container runs as it unless told
# otherwise. docker-compose.yml runs the SuperLink as the host user with this group
# instead (so that the results it writes to the host folder are the host user's): its
# home and FLWR_HOME are group-writable for that; and the one-shot `init` as root (it
# hands each secret to the uid that reads it, in volumes it owns). /state and the cache
# folder exist here owned by this user, so a new volume mounted on them starts out its.
RUN groupadd --gid 49999 fedhet \
 && useradd --create-home --uid 49999 --gid 49999 fedhet \
 && mkdir -p /flwr-home /state /home/fedhet/.cache/fedhet /home/fedhet/fedhet-runs \
 && chown -R fedhet:fedhet /flwr-home /state /home/fedhet \
 && chmod -R g+w /flwr-home /home/fedhet
USER 49999:49999
WORKDIR /home/fedhet
EXPOSE 9092 9094
CMD ["fedhet", "--help"]
