# The kvpager image: the `kvpager` command with every service; compose.yaml runs one per container.
#   CPU (default):  docker build -t kvpager:cpu .
#   CUDA:           docker build -t kvpager:cuda --build-arg DEVICE=cuda .
# The CUDA variant installs PyPI's CUDA build of torch (it bundles the CUDA libraries: the host
# needs only the NVIDIA driver and container toolkit). Both install a C compiler: Triton builds
# its kernel launchers with it, and the CPU executor its decode-attention kernel
# (kernels/cpu_decode.py; without one it falls back to the slower torch path).
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVPAGER_CACHE_DIR=/cache

# torch first, in its own layer: the largest download, and the only one that depends on DEVICE
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*; \
    case "$DEVICE" in \
      cpu) pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu ;; \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      *) echo "DEVICE must be cpu or cuda, not $DEVICE" >&2; exit 1 ;; \
    esac

WORKDIR /opt/kvpager
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY schemas ./schemas
COPY services ./services
RUN pip install . \
    && useradd --create-home --uid 10001 kvpager \
    && mkdir -p /cache \
    && chown kvpager /cache

# Models are downloaded and converted into /cache (compose mounts a volume there).
USER kvpager
VOLUME ["/cache"]
CMD ["kvpager", "--help"]
