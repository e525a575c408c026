"""The container image, built from the Dockerfile and run for real.

No image can be pulled on the machines this runs on, so the image's base is built here from
Debian's own packages (``mmdebstrap``, then ``docker import``): python3 with venv and the CA
certificates, which is what the Dockerfile asks of its ``PYTHON_IMAGE``. The base is tagged by
a digest of what went into it, so a second run reuses it (minutes saved); the product's image
is then built on it as a user builds it on ``python:3.12-slim`` (the Dockerfile unchanged).

Two containers of the image share one PostgreSQL (this machine's, reached over the host's
network, as the stand-ins for Slack and the model in this test process are) and answer signed
Slack requests; ``docker stop`` of the one with a turn still running lets the turn go on for
``SHUTDOWN_GRACE_SECONDS``, keeps the partial answer, and exits 0 before Docker's SIGKILL;
the message that reached it while it stopped is answered by the other. In front of the two,
compose's proxy (deploy/compose.yaml's nginx configuration, run by Debian's nginx) hands a
request that meets the stopping replica's 503 to the other one.

Where no docker daemon answers (``.ci/run`` starts one), or mmdebstrap or nginx is missing
(``.ci/run`` installs them), the test fails and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from core.records import StoredMessage
from core.storage.engine import create_database
from core.storage.sessions import SessionStore
from standins.openai import GatedModel
from standins.processes import free_port
from standins.slack import BOT_USER, SIGNING_SECRET, SlackClient, SlackStandIn
from tests.conftest import fresh_database_url
from tests.helpers import ROOT
from tests.test_delivery import transcript

pytestmark = pytest.mark.slow

# What the base holds: Debian 12's python3 (3.11) with venv, and the CA certificates. The
# machine's own CA bundle replaces Debian's, so the build stage reaches the package index
# exactly as this machine does (through its TLS-inspecting proxy, where there is one).
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# Documentation, manuals and translations are left out of the base (about 50 MB).
EXCLUDED = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
BASE_ENV = (
    f"SSL_CERT_FILE={HOST_CA}",
    f"PIP_CERT={HOST_CA}",
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
)
IMAGE = "slack-agent:test"


def docker(*args: str, timeout: float = 600, check: bool = True, stderr: bool = False) -> str:
    env = dict(os.environ)
    if subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"  # Debian's docker.io has no buildx: the classic builder
    result = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])} …: {result.stdout}{result.stderr}")
    return result.stdout + (result.stderr if stderr else "")


def require_docker() -> None:
    """The daemon answers, and mmdebstrap is here; or the test fails saying what is missing."""
    if shutil.which("docker") is None:
        pytest.fail("docker is not installed (apt-get install docker.io; .ci/run does)")
    found = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if found.returncode != 0:
        pytest.fail(f"no docker daemon answers (start dockerd; .ci/run does): {found.stderr}")


def base_image() -> str:
    """The Debian base, built once per recipe: its tag is a digest of the recipe and of the
    CA bundle it carries."""
    recipe = hashlib.sha256()
    for part in (SUITE, *PACKAGES, *EXCLUDED, *BASE_ENV):
        recipe.update(part.encode() + b"\0")
    recipe.update(HOST_CA.read_bytes())
    tag = f"slack-agent-test-base:{recipe.hexdigest()[:16]}"
    if docker("image", "ls", "-q", tag).strip():
        return tag
    if shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is not installed (apt-get install mmdebstrap; .ci/run does)")
    with tempfile.TemporaryDirectory(prefix="slack-agent-base-") as tmp:
        tarball = Path(tmp) / "base.tar"
        command = [
            "mmdebstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            *(f"--dpkgopt=path-exclude={path}" for path in EXCLUDED),
            f"--customize-hook=upload {HOST_CA} {HOST_CA}",
            "--customize-hook=rm -rf $1/var/lib/apt/lists/* $1/var/cache/apt/*",
            SUITE,
            str(tarball),
        ]
        made = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        assert made.returncode == 0, f"mmdebstrap failed: {made.stderr[-2000:]}"
        changes = [arg for env in BASE_ENV for arg in ("--change", f"ENV {env}")]
        docker("import", *changes, str(tarball), tag)
    return tag


@pytest.fixture(scope="module")
def image() -> str:
    """Built once per worker; workers of one run take turns (a file lock), so the second finds
    the base made and Docker's layers cached instead of building everything a second time."""
    require_docker()
    with open(Path(tempfile.gettempdir()) / "slack-agent-image-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        base = base_image()
        build = ("build", "--network", "host", "--build-arg", f"PYTHON_IMAGE={base}")
        docker(*build, "-t", IMAGE, str(ROOT))
    return IMAGE


@pytest.fixture
def pg_url(tmp_path: Path, pg_template: str | None, sqlite_template: Path) -> Iterator[str]:
    yield from fresh_database_url("postgresql", tmp_path, pg_template, sqlite_template)


class Container:
    """One ``slack-agent serve`` container on the host's network, on its own port."""

    def __init__(self, image: str, env: dict[str, str]) -> None:
        self.name = f"slack-agent-test-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = {**env, "HOST": "127.0.0.1", "PORT": str(self.port)}
        variables = [arg for k, v in settings.items() for arg in ("-e", f"{k}={v}")]
        docker("run", "-d", "--name", self.name, "--network", "host", *variables, image)

    def logs(self) -> str:
        return docker("logs", self.name, check=False, timeout=30, stderr=True)

    def state(self) -> tuple[str, int]:
        out = docker("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", self.name)
        status, code = out.split()
        return status, int(code)

    def remove(self) -> None:
        docker("rm", "-f", self.name, check=False, timeout=60)


@contextlib.contextmanager
def compose_proxy(tmp: Path, *replicas: Container) -> Iterator[tuple[str, Path]]:
    """deploy/compose.yaml's proxy (its nginx configuration, as the file holds it) in front of
    the containers, on a port of its own: Debian's nginx here, the nginx image under compose.
    Gives its URL, and its access log: each request's status and its upstreams' statuses."""
    if shutil.which("nginx") is None:
        pytest.fail("nginx is not installed (apt-get install nginx-light; .ci/run does)")
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    site = compose["configs"]["proxy"]["content"].replace("$$", "$")
    servers = "".join(f"server 127.0.0.1:{c.port} max_fails=0;\n" for c in replicas)
    assert "server serve:3000 max_fails=0;\n" in site
    site = site.replace("server serve:3000 max_fails=0;\n", servers)
    port = free_port()
    site = site.replace("listen 3000;", f"listen 127.0.0.1:{port};")
    temp = " ".join(
        f"{kind}_temp_path {tmp}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = tmp / "nginx.conf"
    conf.write_text(
        f"worker_processes 1; pid {tmp}/nginx.pid; error_log {tmp}/error.log;\n"
        f"events {{}}\nhttp {{ {temp}\n"
        "log_format upstreams '$request_method $uri $status $upstream_status';\n"
        f"access_log {tmp}/access.log upstreams;\n{site}\n}}\n"
    )
    proc = subprocess.Popen(
        ["nginx", "-e", str(tmp / "error.log"), "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # its errors go to error.log (-e)
    )
    try:
        yield f"http://127.0.0.1:{port}", tmp / "access.log"
    except BaseException:
        print((tmp / "error.log").read_text() if (tmp / "error.log").exists() else "")
        raise
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return response.status, await response.text()


async def until(condition: Callable[[], object], what: str, within: float = 60.0) -> None:
    """Poll ``condition`` (blocking calls run off the loop, which serves the stand-ins)."""
    deadline = asyncio.get_running_loop().time() + within
    while not await asyncio.to_thread(condition):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.2)


async def until_ready(container: Container, within: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        try:
            if await get(container.url + "/readyz") == (200, "ok"):
                return
        except aiohttp.ClientError:
            pass
        if container.state()[0] == "exited":
            break
        await asyncio.sleep(0.2)
    raise AssertionError(f"{container.name} did not become ready:\n{container.logs()}")


@pytest.fixture
async def containers(
    image: str, pg_url: str, slack: SlackStandIn
) -> AsyncIterator[tuple[GatedModel, list[Container]]]:
    async with GatedModel(early="the first half, ") as model:
        env = {
            "DATABASE_URL": pg_url,
            "SLACK_BOT_TOKEN": "xoxb-test",
            "SLACK_SIGNING_SECRET": SIGNING_SECRET,
            "SLACK_API_URL": slack.api_url,
            "MODEL_PROVIDER": "openai",
            "OPENAI_API_KEY": "sk-test",
            "OPENAI_BASE_URL": model.base_url,
            "SWEEPER_INTERVAL_SECONDS": "0",
        }
        # The one-shot migration first, as compose's `migrate` and the chart's Job run it.
        variables = [arg for k, v in env.items() for arg in ("-e", f"{k}={v}")]
        migrated = docker(
            "run", "--rm", "--network", "host", *variables, image, "slack-agent", "migrate"
        )
        assert migrated.startswith("database at revision"), migrated
        started: list[Container] = []
        try:
            started = [Container(image, env), Container(image, env)]
            for container in started:
                await until_ready(container)
            yield model, started
        finally:
            model.release()
            for container in started:
                container.remove()


def test_image__non_root_no_compiler_and_the_command_is_serve(image: str) -> None:
    config = docker("image", "inspect", "-f", "{{.Config.User}} {{json .Config.Cmd}}", image)
    assert config.strip() == '10001:10001 ["slack-agent","serve"]'
    found = docker(
        "run",
        "--rm",
        image,
        "sh",
        "-c",
        "id -u; for c in gcc cc c++ make uv pip; do command -v $c || true; done",
    )
    assert found.split() == ["10001"], found
    healthcheck = docker("image", "inspect", "-f", "{{json .Config.Healthcheck.Test}}", image)
    assert "/livez" in healthcheck


async def test_two_containers_answer_and_docker_stop_drains_within_the_grace(
    containers: tuple[GatedModel, list[Container]],
    pg_url: str,
    slack: SlackStandIn,
    tmp_path: Path,
) -> None:
    model, (a, b) = containers
    database = create_database(pg_url)
    store = SessionStore(database, staleness_seconds=60)
    try:
        with compose_proxy(tmp_path, a, b) as (proxy_url, proxy_log):
            await until_proxied(proxy_url)
            await _drain(model, a, b, store, proxy_url, proxy_log)
    finally:
        await database.dispose()


async def until_proxied(url: str, within: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        try:
            async with aiohttp.ClientSession() as http, http.get(url + "/readyz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            if asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.1)


async def _drain(
    model: GatedModel,
    a: Container,
    b: Container,
    store: SessionStore,
    proxy_url: str,
    proxy_log: Path,
) -> None:
    async with SlackClient(a.url) as to_a, SlackClient(b.url) as to_b:
        first = await to_a.message("held past the grace", mention=True)
        second = await to_b.message("answered by the other", mention=True)
        await until(lambda: len(model.requests) >= 2, "both turns reached the model")

        # docker stop: SIGTERM, then SIGKILL after its 10 s; the grace is 8 s by default.
        began = time.monotonic()
        stopping = asyncio.create_task(asyncio.to_thread(docker, "stop", a.name))
        await until(lambda: "stopping:" in a.logs(), "the container logged its stop")
        assert await get(a.url + "/readyz") == (503, "stopping")
        assert await get(a.url + "/livez") == (200, "ok")
        # Through compose's proxy, messages are taken while a replica stops: it hands requests
        # to the two in turn, so one of two meets the stopping one, whose 503 it tries on the
        # other (``message`` asserts the 200 Slack would see).
        async with SlackClient(proxy_url) as through_proxy:
            proxied = [
                await through_proxy.message(f"through the proxy {n}", mention=True)
                for n in range(2)
            ]
        # A message that reaches the stopping replica itself is refused (Slack sends it again)…
        ts = to_a.new_ts()
        late = {"type": "app_mention", "user": "U1", "text": f"<@{BOT_USER}> late", "ts": ts}
        late.update(channel="C1", event_ts=late["ts"])
        assert await to_a.event(late, event_id="EvLate") == 503
        # …and its retry, to the other replica, is taken.
        assert await to_b.event(late, event_id="EvLate", retry=1) == 200
        # The proxy's log: one request met the stopping replica's 503 and went on to the other.
        logged = await asyncio.to_thread(proxy_log.read_text)
        assert "POST /slack/events 200 503, 200" in logged, logged
        await stopping
        print(f"docker stop took {time.monotonic() - began:.2f} s")  # README, *Deploying*
        assert a.state() == ("exited", 0), a.logs()  # 137 had it been killed
        model.release()

        held = await transcript(store, first)
        assert [m.role for m in held] == ["user", "assistant"], a.logs()
        assert held[1].message["metadata"]["interrupted_by"] == "shutdown"
        assert "the first half" in str(held[1].message["parts"])
        for root in (second, late["ts"], *proxied):
            answered = await _answered(store, root)
            assert [m.role for m in answered] == ["user", "assistant"], b.logs()


async def _answered(store: SessionStore, root: str, within: float = 60.0) -> list[StoredMessage]:
    """The thread's transcript once it holds an answer (or what it holds after ``within``)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        try:
            found = await transcript(store, root)
        except AssertionError:
            found = []
        if len(found) >= 2 or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.2)
