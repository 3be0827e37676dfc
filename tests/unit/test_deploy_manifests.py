"""deploy/k8s, offline: every overlay renders with ``kubectl kustomize``; every document
validates (built-in kinds with kubernetes-validate, custom resources against the CRDs'
openAPIV3Schema in ../shared/data/crds, both rejecting unknown fields); the ``kvmesh`` command
lines parse with kvmesh's own CLI parser and open the ports the manifests name."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
from importlib.metadata import version as dist_version
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CRDS = ROOT.parent / "shared" / "data" / "crds"
OVERLAYS = ["gpu", "dev"]
# the oldest Kubernetes the manifests promise to work with (deploy/README.md)
K8S_VERSION = "1.30.0"
# Secrets the manifests reference; deploy/README.md creates each of them
SECRETS = {"kvmesh-redis", "kvmesh-cluster-secret", "kvmesh-client-tokens"}


# ---------------------------------------------------------------- rendering and validation


def render(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/k8s (kubectl kustomize)"
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def _strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused, as ``kubectl apply`` (strict field
    validation) does: every object that lists its properties and does not preserve unknown
    fields gets ``additionalProperties: false``. Walks schema keywords only (a field may be
    called ``properties``)."""
    out = dict(schema)
    if str(schema.get("pattern", "")).startswith("^(?i)"):  # Go's regexp allows it, Python's not
        out["pattern"] = "(?i)^" + schema["pattern"][5:]
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = _strict(schema["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            out[key] = [_strict(s) for s in schema[key]]
    return out


def _load_crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict schema, for every served version of every CRD."""
    schemas = {}
    paths = sorted(CRDS.glob("*.yaml"))
    assert len(paths) >= 6, f"expected KubeRay and Prometheus Operator CRDs in {CRDS}"
    for path in paths:
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            if v.get("served", True):
                schemas[(f"{group}/{v['name']}", kind)] = _strict(v["schema"]["openAPIV3Schema"])
    return schemas


CRD_SCHEMAS = _load_crd_schemas()


@functools.cache
def _crd_validator(key: tuple[str, str]) -> jsonschema.Draft7Validator:
    jsonschema.Draft7Validator.check_schema(CRD_SCHEMAS[key])
    return jsonschema.Draft7Validator(CRD_SCHEMAS[key])


def validate(doc: dict) -> None:
    """Raise if ``doc`` is not a valid object of its kind (unknown fields included)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        meta = doc.get("metadata") or {}
        if not meta.get("name"):
            raise jsonschema.ValidationError(f"{key}: metadata.name is missing")
        _crd_validator(key).validate(doc)
    else:
        # a kind that is neither built in nor one of the CRDs raises SchemaNotFoundError
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def where(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_document_validates(rendered, overlay):
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "Deployment", "Service", "NetworkPolicy"} <= kinds
    assert "PodDisruptionBudget" in kinds
    for doc in docs:
        try:
            validate(doc)
        except jsonschema.ValidationError as e:
            at = "/".join(map(str, e.absolute_path))
            pytest.fail(f"overlay {overlay}: {where(doc)} at {at}: {e.message[:300]}")


def test_gpu_overlay_has_monitoring(rendered):
    docs = rendered["gpu"]
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"kvmesh-router", "kvmesh-workers"}
    assert [d["kind"] for d in docs].count("PrometheusRule") == 1


@pytest.mark.parametrize(
    "kind,mutate",
    [
        # a misspelled field deep in the RayCluster's pod template
        (
            "RayCluster",
            lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][
                0
            ].__setitem__("imagePullPolicyy", "Always"),
        ),
        # a misspelled field of KubeRay's own
        ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0].__setitem__("maxReplica", 3)),
        # a wrong type
        ("RayCluster", lambda d: d["spec"].__setitem__("enableInTreeAutoscaling", "yes")),
        ("Deployment", lambda d: d["spec"].__setitem__("replica", 1)),
        (
            "Deployment",
            lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("portz", []),
        ),
        ("PodMonitor", lambda d: d["spec"]["podMetricsEndpoints"][0].__setitem__("prot", "x")),
        ("NetworkPolicy", lambda d: d["spec"].__setitem__("ingres", [])),
    ],
)
def test_a_broken_manifest_fails_the_check(rendered, kind, mutate):
    """The negative control: the same check refuses a misspelled field or a wrong type."""
    doc = copy.deepcopy(next(d for d in rendered["gpu"] if d["kind"] == kind))
    validate(doc)  # as rendered: valid
    mutate(doc)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(doc)


def test_an_unknown_kind_fails_the_check():
    doc = {"apiVersion": "ray.io/v1", "kind": "RayClustr", "metadata": {"name": "x"}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(doc)


def test_a_broken_overlay_on_disk_fails(tmp_path):
    """A kustomization with a misspelled field in a patch renders, then fails validation."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / "dev", tmp_path)],
                "patches": [
                    {
                        "target": {"kind": "RayCluster"},
                        "patch": "- op: add\n  path: /spec/headGroupSpec/rayStartParam\n"
                        "  value: {}\n",
                    }
                ],
            }
        )
    )
    docs = render(tmp_path)
    ray = next(d for d in docs if d["kind"] == "RayCluster")
    with pytest.raises(jsonschema.ValidationError, match="rayStartParam"):
        validate(ray)


# ---------------------------------------------------------------- the kvmesh command line


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args, with placeholder values."""

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not in the container's env"
        return "placeholder"

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def _parse_serve(head: dict, tmp_path: Path):
    """The head container's kvmesh command through kvmesh's parser and ``config_from_args``
    (which validates the ClusterConfig and reads the secret files: each must lie in a mounted
    Secret volume; a placeholder of a valid shape stands in for it)."""
    from kvmesh.cluster.cli import build_parser
    from kvmesh.cluster.serve import cmd_serve, config_from_args

    assert head["command"] == ["kvmesh-ray-entrypoint"], head["command"]
    args = head["args"]
    assert args[:2] == ["kvmesh", "serve"], args[:2]
    env = {e["name"]: e for e in head.get("env", [])}
    argv = [_expand(a, env) for a in args[1:]]
    a = build_parser().parse_args(argv)  # SystemExit on a renamed or unknown flag
    assert a.func is cmd_serve
    mounts = {m["mountPath"].rstrip("/") + "/": m["name"] for m in head.get("volumeMounts", [])}
    contents = {"cluster_secret_file": "s" * 32, "token_file": "t" * 32 + "\n"}
    for attr, text in contents.items():
        path = getattr(a, attr)
        if path is None:
            continue
        assert any(path.startswith(m) for m in mounts), f"--{attr} {path} is not in a mount"
        fake = tmp_path / attr
        fake.write_text(text)
        setattr(a, attr, str(fake))
    assert a.tls_cert is None and a.tls_key is None  # TLS: deploy/README.md, not in these
    return a, config_from_args(a), mounts


def _head_and_workers(docs: list[dict]) -> tuple[dict, dict, list[dict]]:
    rc = _one(docs, "RayCluster", "kvmesh")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return rc, head, rc["spec"]["workerGroupSpecs"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kvmesh_command_line_parses_and_ports_match(rendered, overlay, tmp_path):
    from kvmesh.worker.config import parse_size

    docs = rendered[overlay]
    rc, head, groups = _head_and_workers(docs)
    a, cfg, mounts = _parse_serve(head, tmp_path)
    assert a.address == "auto"  # joins the Ray cluster KubeRay started in this pod
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"

    # the head offers Ray nothing: no engine is ever placed beside the router
    params = rc["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["num-cpus"] == "0" and params["num-gpus"] == "0"
    assert rc["spec"]["enableInTreeAutoscaling"] is True and rc["spec"]["autoscalerOptions"]

    # every port the command line opens is a named container port, and back
    ports = _ports(head)
    assert ports["grpc"] == cfg.port
    assert ports["http"] == cfg.http_port
    assert ports["metrics"] == cfg.metrics_port
    assert head["readinessProbe"]["grpc"]["port"] == cfg.port  # grpc.health.v1
    assert head["livenessProbe"]["tcpSocket"]["port"] == cfg.port
    assert head["startupProbe"]["tcpSocket"]["port"] == cfg.port

    svc = _one(docs, "Service", "kvmesh-router")
    assert svc["spec"]["selector"] == {"ray.io/cluster": "kvmesh", "ray.io/node-type": "head"}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in ports, f"Service port {p['name']} names no container port"
    assert {ports[p["targetPort"]] for p in svc["spec"]["ports"]} == {
        cfg.port,
        cfg.http_port,
        cfg.metrics_port,
    }

    # workers: one group; its pods give each worker actor what it asks for
    assert len(groups) == 1
    (group,) = groups
    worker = group["template"]["spec"]["containers"][0]
    assert worker["command"] == ["kvmesh-ray-entrypoint"] and not worker.get("args")
    limits = worker["resources"]["limits"]
    pod_gpus = int(limits.get("nvidia.com/gpu", 0))
    assert cfg.worker_gpus == pod_gpus, "--worker-gpus must say what each worker pod has"
    if pod_gpus:
        assert pod_gpus == 1, "one kvmesh worker per GPU: one GPU per worker pod"
        assert int(worker["resources"]["requests"]["nvidia.com/gpu"]) == 1
    assert cfg.worker_cpus <= float(limits["cpu"]), "a worker actor fits in one pod's CPUs"
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # kvmesh's autoscaler (docs/autoscaling.md) asks Ray for a node per worker it adds: its
    # bounds are the worker group's, so every worker it wants has a pod to land on
    assert cfg.autoscale is not None, "the head runs kvmesh's autoscaler (--min/--max-workers)"
    assert cfg.autoscale.min_workers == group["minReplicas"]
    assert cfg.autoscale.max_workers == group["maxReplicas"]
    # the engine's memory fits the pod (host tier + engine; device pool too on CPU)
    mem = parse_size(limits["memory"].replace("Gi", "GiB").replace("Mi", "MiB"))
    host = parse_size(cfg.engine_args["host_cache_memory"] or 0)
    pool = 0 if pod_gpus else parse_size(cfg.engine_args["kv_cache_memory"])
    assert host + pool + 2**30 <= mem, f"host tier {host} + pool {pool} + 1 GiB > pod {mem}"

    # the worker actor's /metrics port is fixed by the env and named on the pod
    wenv = {e["name"]: e.get("value") for e in worker.get("env", [])}
    assert int(wenv["KVMESH_WORKER_METRICS_PORT"]) == _ports(worker)["metrics"]

    # Redis: the URL names the Service and its port; maxmemory fits the container
    url = urlparse(cfg.engine_args["redis_url"])
    rsvc = _one(docs, "Service", "kvmesh-redis")
    assert url.hostname == "kvmesh-redis" and url.port == rsvc["spec"]["ports"][0]["port"]
    redis = _one(docs, "Deployment", "kvmesh-redis")["spec"]["template"]["spec"]
    rc_ = redis["containers"][0]
    assert _ports(rc_)[rsvc["spec"]["ports"][0]["targetPort"]] == url.port
    rargs = rc_["args"]
    flags = dict(zip(rargs[::2], rargs[1::2]))
    assert flags["--maxmemory-policy"] == "allkeys-lru"
    assert flags["--save"] == "" and flags["--appendonly"] == "no"  # a cache: no persistence
    assert flags["--requirepass"] == "$(REDIS_PASSWORD)"
    rmax = parse_size(flags["--maxmemory"].replace("gb", "GiB").replace("mb", "MiB"))
    rlim = parse_size(rc_["resources"]["limits"]["memory"].replace("Mi", "MiB"))
    assert rmax < rlim

    # NetworkPolicy: the head's client ports open, its metrics to monitoring; workers' metrics
    pols = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    head_open = {
        p["port"] for r in pols["kvmesh-head"]["spec"]["ingress"] for p in r.get("ports", [])
    }
    assert {cfg.port, cfg.http_port, cfg.metrics_port} <= head_open
    worker_open = {
        p["port"] for r in pols["kvmesh-workers"]["spec"]["ingress"] for p in r.get("ports", [])
    }
    assert worker_open == {_ports(worker)["metrics"]}
    redis_rules = pols["kvmesh-redis"]["spec"]["ingress"]
    assert all(r.get("from") for r in redis_rules), "Redis is open to kvmesh pods only"

    # every secret file flag names a Secret volume
    vols = {v["name"]: v for v in rc["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    given = {f: v for f, v in zip(head["args"], head["args"][1:]) if f.endswith("-file")}
    assert "--cluster-secret-file" in given
    for flag, path in given.items():
        (volume,) = [n for m, n in mounts.items() if path.startswith(m)]
        assert "secret" in vols[volume], f"{flag} {path} is not in a Secret volume"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_never_inlined(rendered, overlay):
    docs = rendered[overlay]
    assert not [d for d in docs if d["kind"] == "Secret"], "a Secret is inlined"
    text = json.dumps(docs)
    names = set(re.findall(r'"secretName": "([^"]+)"', text))
    names |= {m for m in re.findall(r'"secretKeyRef": \{[^}]*"name": "([^"]+)"', text)}
    assert names <= SECRETS, f"secrets not documented: {names - SECRETS}"
    assert {"kvmesh-redis", "kvmesh-cluster-secret"} <= names
    readme = (DEPLOY / "README.md").read_text()
    for name in names:
        assert f"kubectl create secret generic {name}" in readme or (
            f"secret generic {name}" in readme
        ), f"deploy/README.md does not say how to create Secret {name}"


def test_the_worker_pods_metrics_are_scraped(rendered):
    docs = rendered["gpu"]
    _, head, (group,) = _head_and_workers(docs)
    pods = {
        "router": (head, {"ray.io/cluster": "kvmesh", "app.kubernetes.io/component": "router"}),
        "worker": (
            group["template"]["spec"]["containers"][0],
            {"ray.io/cluster": "kvmesh", "app.kubernetes.io/component": "worker"},
        ),
    }
    rc = _one(docs, "RayCluster")
    labels = {
        "router": rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"],
        "worker": group["template"]["metadata"]["labels"],
    }
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    for role, (container, _) in pods.items():
        mine = []
        for m in monitors:
            sel = m["spec"]["selector"]["matchLabels"]
            # KubeRay adds ray.io/cluster to every pod it creates
            pod_labels = {**labels[role], "ray.io/cluster": "kvmesh"}
            if all(pod_labels.get(k) == v for k, v in sel.items()):
                mine.append(m)
        assert len(mine) == 1, f"{role} pods: {len(mine)} PodMonitors"
        (ep,) = mine[0]["spec"]["podMetricsEndpoints"]
        assert ep["port"] in _ports(container)
        assert {"targetLabel": "kvmesh_role", "replacement": role} in ep["relabelings"]


def test_prometheus_rule_is_the_alert_file(rendered):
    rule = _one(rendered["gpu"], "PrometheusRule")
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "kvmesh-alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_dashboards_are_sidecar_configmaps(rendered):
    maps = [
        d
        for d in rendered["gpu"]
        if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard")
    ]
    files = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
    got = {k: v for m in maps for k, v in m["data"].items()}
    assert set(got) == {f.name for f in files}
    for f in files:
        assert json.loads(got[f.name]) == json.loads(f.read_text())
        assert len(got[f.name]) < 256 * 1024  # kubectl apply's annotation limit


def test_image_ray_version_matches(rendered):
    """The image, the RayClusters and the Ray kvmesh is developed against agree."""
    docker = (DEPLOY / "docker" / "Dockerfile").read_text()
    m = re.search(r"^ARG RAY_VERSION=(\S+)$", docker, re.M)
    assert m, "deploy/docker/Dockerfile has no ARG RAY_VERSION"
    assert m.group(1) == dist_version("ray")
    for overlay, docs in rendered.items():
        assert _one(docs, "RayCluster")["spec"]["rayVersion"] == m.group(1), overlay
        for d in docs:
            for c in _containers(d):
                if c["name"].startswith("ray-"):
                    assert c["image"].split("/")[-1].startswith("kvmesh:"), c["image"]


def _containers(doc: dict) -> list[dict]:
    if doc["kind"] == "RayCluster":
        specs = [doc["spec"]["headGroupSpec"]] + doc["spec"]["workerGroupSpecs"]
        return [c for s in specs for c in s["template"]["spec"]["containers"]]
    if doc["kind"] == "Deployment":
        return doc["spec"]["template"]["spec"]["containers"]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(rendered, overlay):
    for doc in rendered[overlay]:
        for c in _containers(doc):
            res = c.get("resources", {})
            for key in ("cpu", "memory"):
                assert key in res.get("requests", {}), f"{where(doc)} {c['name']}: requests"
                assert key in res.get("limits", {}), f"{where(doc)} {c['name']}: limits"


# ---------------------------------------------------------------- the entrypoint


ENTRYPOINT = DEPLOY / "docker" / "kvmesh-ray-entrypoint"


def _entry(args: list[str], gen: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KUBERAY_GEN_RAY_START_CMD"}
    if gen is not None:
        env["KUBERAY_GEN_RAY_START_CMD"] = gen
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=30
    )


def test_entrypoint_starts_ray_then_the_command():
    # the head: Ray's start without --block (it returns), then the command
    r = _entry(["echo", "serving"], "printf '[%s]' ray start --head --block --x='a b'")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[ray][start][--head][--x=a b]serving\n"
    # a worker: Ray's start blocking in the foreground
    r = _entry([], "printf '[%s]' ray start --address=h:6379")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[ray][start][--address=h:6379][--block]"
    # a failed ray start stops the pod before kvmesh runs
    r = _entry(["echo", "serving"], "false")
    assert r.returncode != 0 and "serving" not in r.stdout
    # without the annotation's variable: a clear error
    r = _entry(["echo", "serving"], None)
    assert r.returncode == 2 and "overwrite-container-cmd" in r.stderr


def test_worker_metrics_port_env(monkeypatch):
    """KVMESH_WORKER_METRICS_PORT (the worker pods' fixed /metrics port): unset is any free
    port; a bad value is an error naming the variable."""
    from kvmesh.worker import envs

    monkeypatch.delenv("KVMESH_WORKER_METRICS_PORT", raising=False)
    assert envs.worker_metrics_port() == 0
    monkeypatch.setenv("KVMESH_WORKER_METRICS_PORT", "9401")
    assert envs.worker_metrics_port() == 9401
    for bad in ("70000", "metrics"):
        monkeypatch.setenv("KVMESH_WORKER_METRICS_PORT", bad)
        with pytest.raises(ValueError, match="KVMESH_WORKER_METRICS_PORT"):
            envs.worker_metrics_port()
