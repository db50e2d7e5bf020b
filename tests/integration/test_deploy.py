"""deploy/: manifests validate offline and agree with each other and with the app; the pod's
settings, run here around the fake encoder, serve the metrics the HPA scales on."""

import configparser
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from embedsvc.metrics import Metrics
from embedsvc.settings import Settings

from .. import loopback
from .servers import FAKE_EMBEDSVC, Server, running
from .test_observability import DASHBOARD, PROMETHEUS, metric_names

DEPLOY = Path(__file__).parents[2] / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.33"


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.fail(f"{name} is missing: `make test` installs it")
    return path


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(K8S)], capture_output=True,
                         text=True, check=True).stdout
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out)}


def test_the_kustomize_base_renders_every_resource(rendered):
    assert set(rendered) == {"Deployment", "Service", "HorizontalPodAutoscaler",
                             "PodDisruptionBudget", "ServiceMonitor"}
    for doc in rendered.values():
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "embedsvc"


def test_builtin_manifests_validate_against_the_kubernetes_schemas(rendered):
    for kind, doc in rendered.items():
        if kind == "ServiceMonitor":  # a CRD, checked below
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "config.yaml").read_text())
    kubernetes_validate.validate(adapter, K8S_VERSION, strict=True)


def container(rendered) -> dict:
    return rendered["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c["env"]}


def test_deployment_agrees_with_the_app_settings(rendered):
    c = container(rendered)
    settings = Settings.from_env(env_of(c))  # every variable is a real, valid setting
    assert settings.host == "0.0.0.0" and settings.device == "cpu"
    assert c["image"].endswith("-cpu")  # the image without PyTorch (Dockerfile's default)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": settings.port, "probes": settings.health_port}
    assert settings.health_port != settings.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # on HEALTH_PORT, answered while the main port is flooded
        assert c[probe]["httpGet"] == {"path": "/health", "port": "probes"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # model load
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > settings.drain_timeout_s
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + settings.drain_timeout_s + 5
    assert "nvidia.com/gpu" not in {**c["resources"]["limits"], **c["resources"]["requests"]}
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user
    # several HTTP processes in front of one engine process: one per CPU the pod requests
    assert settings.workers > 1 and settings.workers == int(c["resources"]["requests"]["cpu"])


def test_the_gpu_overlay_runs_the_cuda_image_one_replica_per_gpu(rendered):
    out = subprocess.run([tool("kubectl"), "kustomize", str(DEPLOY / "k8s-gpu")],
                         capture_output=True, text=True, check=True).stdout
    gpu = {doc["kind"]: doc for doc in yaml.safe_load_all(out)}
    assert set(gpu) == set(rendered)
    kubernetes_validate.validate(gpu["Deployment"], K8S_VERSION, strict=True)
    c = container(gpu)
    assert c["image"].endswith("-cuda") and Settings.from_env(env_of(c)).device == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    # one model copy on the GPU (the engine's) whatever the HTTP processes, one per CPU
    workers = Settings.from_env(env_of(c)).workers
    assert workers > 1 and workers == int(c["resources"]["requests"]["cpu"])
    base = container(rendered)  # everything else as the base has it
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        assert c[key] == base[key], key


def test_service_monitor_pdb_and_selectors_match_the_pods(rendered):
    labels = rendered["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selectors = [rendered["Deployment"]["spec"]["selector"]["matchLabels"],
                 rendered["Service"]["spec"]["selector"],
                 rendered["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]]
    for selector in selectors:
        assert selector.items() <= labels.items()
    service_labels = rendered["Service"]["metadata"]["labels"]
    monitor = rendered["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service_labels.items()
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics"
    targets = {p["name"]: p["targetPort"] for p in rendered["Service"]["spec"]["ports"]}
    assert targets == {"http": "http", "metrics": "probes"}
    assert targets[endpoint["port"]] == "probes"  # scraped on HEALTH_PORT, like the probes


def test_the_hpa_scales_on_a_metric_the_adapter_serves_and_the_app_exports(rendered):
    metric = rendered["HorizontalPodAutoscaler"]["spec"]["metrics"][0]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "config.yaml").read_text())
    rule = yaml.safe_load(adapter["data"]["config.yaml"])["rules"][0]
    assert rule["name"]["as"] == name
    assert rule["seriesQuery"].startswith(name + "{")
    exported = {m.name for m in Metrics().registry.collect()}
    assert name in exported
    target = rendered["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "embedsvc")


def test_dockerfile_passes_hadolint_and_serves_as_a_non_root_user():
    dockerfile = DEPLOY / "docker" / "Dockerfile"
    result = subprocess.run([tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = dockerfile.read_text()
    assert "USER 10001:10001" in text and "useradd" in text
    assert 'ENTRYPOINT ["embedsvc", "serve"]' in text
    assert "EMBEDSVC_HOST=0.0.0.0" in text and "HEALTHCHECK" in text and "/health" in text
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S))
    assert list(stages) == ["export", "cuda", "cpu"]  # the last, CPU, is the default target
    assert "download.pytorch.org/whl/cpu" in stages["export"]
    assert '"/src[torch]"' in stages["export"] and "embedsvc export --device cpu" in stages[
        "export"] and "--cache-dir /opt/records" in stages["export"]
    assert '"/src[torch]"' in stages["cuda"] and "ARG CUDA_BASE=nvidia/cuda:" in text
    # the CPU image: the install without extras and the record alone, where servers look
    cpu = stages["cpu"]
    assert "torch" not in cpu.lower()
    assert "pip install --python /opt/embedsvc/bin/python /src" in cpu
    assert "COPY --from=export /opt/records /opt/embedsvc/cache" in cpu
    assert "EMBEDSVC_CACHE_DIR=/opt/embedsvc/cache" in cpu
    for stage in ("cuda", "cpu"):
        assert "USER 10001:10001" in stages[stage] and "HEALTHCHECK" in stages[stage]
        assert 'ENTRYPOINT ["embedsvc", "serve"]' in stages[stage]


def test_systemd_unit_drains_within_its_stop_timeout():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "systemd" / "embedsvc.service")
    service = unit["Service"]
    assert service["ExecStart"].endswith("embedsvc serve")
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert service["EnvironmentFile"].lstrip("-") == "/etc/embedsvc/embedsvc.env"
    env = dict(line.split("=", 1) for line in
               (DEPLOY / "systemd" / "embedsvc.env").read_text().splitlines()
               if line and not line.startswith("#"))
    settings = Settings.from_env(env)
    assert int(service["TimeoutStopSec"]) > settings.drain_timeout_s
    # SIGTERM to the main process alone, which drains its HTTP processes, then the engine: a
    # signal to every process of the unit would reach each HTTP process twice
    assert settings.workers > 1 and service["KillMode"] == "mixed"
    # ProtectSystem=strict leaves only the CacheDirectory writable for the ONNX graph
    assert service["ProtectSystem"] == "strict"
    assert f"EMBEDSVC_CACHE_DIR=/var/cache/{service['CacheDirectory']}" in service["Environment"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"


# -- the pod's settings, served ------------------------------------------------------------


@pytest.fixture(scope="module")
def pod(rendered, tmp_path_factory) -> Iterator[Server]:
    """The Deployment's container as a process here: its EMBEDSVC_* settings (WORKERS HTTP
    processes in front of one engine process, JSON logs, the probe port) on loopback port 0,
    around the fake encoder."""
    env = {**env_of(container(rendered)), "EMBEDSVC_HOST": "127.0.0.1", "EMBEDSVC_PORT": "0",
           "EMBEDSVC_HEALTH_PORT": "0"}
    log = tmp_path_factory.mktemp("pod") / "pod.log"
    with running([*FAKE_EMBEDSVC, "serve"], log, env=env) as server:
        yield server


def every_front_ready(probes: str, workers: int, timeout: float = 60) -> dict:
    """/info once the engine has heard from ``workers`` HTTP processes and holds the
    metrics of each (a front is listed from its hello on, and its metrics reach the engine
    with its first snapshot, at its first tick after the engine's card)."""
    deadline = time.monotonic() + timeout
    while True:
        about = loopback.get(probes + "/info", timeout=10).json()
        if len(about["front_pids"]) >= workers:
            pids = {s.labels["pid"] for s in scrape(probes)["process_resident_memory_bytes"]}
            if {str(about["engine_pid"]), *map(str, about["front_pids"])} <= pids:
                return about
        if time.monotonic() > deadline:
            return about
        time.sleep(0.2)


def scrape(url: str) -> dict[str, list]:
    text = loopback.get(url + "/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_hpa_metric_is_the_engines_from_any_of_the_pods_http_processes(rendered, pod):
    """What the ServiceMonitor scrapes (the probe port's /metrics), whichever HTTP process
    answers: the HPA's queue depth and every metric the alerts and the dashboard name, the
    engine's among them, one series per pod (no per-process label that would split it)."""
    workers = Settings.from_env(env_of(container(rendered))).workers
    probes = pod.probe_url()
    about = every_front_ready(probes, workers)
    assert about["engine_pid"] not in about["front_pids"]
    hpa = rendered["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    named = metric_names("\n".join(exprs)) | metric_names((PROMETHEUS / "alerts.yml").read_text())
    processes = {str(about["engine_pid"]), *map(str, about["front_pids"])}
    for _ in range(3 * workers):  # a new connection each: the kernel picks the process
        live = scrape(probes)
        assert [(s.name, s.labels) for s in live[hpa]] == [(hpa, {})]
        assert named <= set(live), sorted(named - set(live))
        # the engine's own: only it runs a batcher and holds the admission limit
        assert live["embedsvc_batcher_alive"][0].value == 1
        assert live["embedsvc_admission_limit_inputs"][0].value > 0
        pids = {s.labels["pid"] for s in live["process_resident_memory_bytes"]}
        assert pids == processes
