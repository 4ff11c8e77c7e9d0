# The GPU worker: `sluiceway worker`, configured through SLUICEWAY_* variables (see docker-compose.yml).
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    SLUICEWAY_METRICS_PORT=9400 \
    SLUICEWAY_LOG_FORMAT=json

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine engine
COPY sluiceway_kernels sluiceway_kernels
COPY producers producers
COPY worker worker
COPY bench bench
COPY sluiceway sluiceway
# The image's torch stays; the rest of the worker extra (transformers, triton, celery, redis, ...) is added.
RUN pip install --no-cache-dir ".[worker]" && python -c "import worker.loop, engine.llm_engine, sluiceway.cli"

EXPOSE 9400
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 CMD ["python", "-m", "worker.healthcheck"]
# Exec form: the worker is the process that receives SIGTERM and drains (compose adds an init for reaping).
ENTRYPOINT ["sluiceway", "worker"]
