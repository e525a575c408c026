# slack-agent as a container image: `docker build -t slack-agent .` (README, *Deploying*).
#
# Two stages on one Python base. The build stage installs uv and then exactly the versions
# uv.lock pins (`uv sync --locked --no-dev`: nothing resolved at build time, no test tools),
# into a virtual environment that holds the project as an installed wheel (no source tree).
# The final stage is the same base with that environment copied in: no compiler, no uv, no
# pip cache, and a user of its own (uid 10001) so `runAsNonRoot` holds. No secret is baked in:
# every setting comes from the environment at run time (.env.example lists them).
#
# PYTHON_IMAGE must provide python3 (3.11 or newer) with venv, and ca-certificates: the
# official python:3.1x-slim images do, and so does the Debian base the image test builds
# offline (tests/test_image.py).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG UV_VERSION=0.13.9
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    UV_PYTHON_DOWNLOADS=never \
    UV_PYTHON=python3 \
    UV_PROJECT_ENVIRONMENT=/app/venv \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install "uv==${UV_VERSION}"
WORKDIR /src
# The dependencies first, in a layer of their own: a change to the code rebuilds only the last.
COPY pyproject.toml uv.lock ./
RUN /opt/uv/bin/uv sync --locked --no-dev --no-install-project
# The packages the wheel is built from, and README.md (its description): .dockerignore lets
# nothing else into the build context.
COPY . .
RUN /opt/uv/bin/uv sync --locked --no-dev --no-editable

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 slack-agent \
    && useradd --system --uid 10001 --gid 10001 --home-dir /data --no-create-home slack-agent \
    && mkdir /data \
    && chown 10001:10001 /data
COPY --from=build /app/venv /app/venv
ENV PATH=/app/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOST=0.0.0.0 \
    PORT=3000
# The working directory is where the default SQLite file would go (one replica only; point
# DATABASE_URL at PostgreSQL for several), and a mounted .env would be read.
WORKDIR /data
USER 10001:10001
EXPOSE 3000
# Liveness only (the process and its loops answer; never the database): a stopping replica
# still passes it while it drains. Readiness (/readyz) is the orchestrator's to ask.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/livez' % (os.environ.get('METRICS_PORT') or os.environ.get('PORT') or '3000'), timeout=4)"]
STOPSIGNAL SIGTERM
CMD ["slack-agent", "serve"]
