"""deploy/ -- container images, KubeRay manifests, `ray up` YAMLs -- validated without a cluster.

- Every YAML under deploy/ parses. KubeRay objects validate against the KubeRay CRD schemas shipped
  in deploy/schemas, strictly (an unknown field is an error, as with `kubectl apply
  --validate=strict`), core Kubernetes objects against the Kubernetes schemas shipped beside them,
  and both against the admission rules KubeRay itself applies (its validation.go) that matter here.
- `ray up` YAMLs go through Ray's own config preparation and schema (ray/autoscaler/ray-schema.json).
- Dockerfiles are parsed: COPY sources exist and pass the .dockerignore, pip installs are pinned by
  the lock files, nothing is fetched at run time, the final user is not root.
- Every `vitray` command line in deploy/ and in docs/deploy.md (the cluster walk-through) runs with
  --dry-run against its config (commands without a config are parsed by the CLI), exactly as written.
- Safe defaults: token auth, ClusterIP, no credentials inline, non-root pods, runs that resume.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import gzip
import hashlib
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from typer._click.exceptions import MissingParameter, NoSuchOption, UsageError

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERAY = DEPLOY / "kuberay"
RAY_UP = DEPLOY / "ray-up"
DOCKER = DEPLOY / "docker"
KUBERAY_CRDS = DEPLOY / "schemas" / "kuberay-v1.6.2"
KUBERNETES_SCHEMAS = DEPLOY / "schemas" / "kubernetes-v1.33.0"
IMAGE_WORKDIR = "/home/ray/vitray"  # where Ray starts in the images: a job's relative paths start here

# The sha256 of the CRD files as published (kuberay v1.6.2, ray-operator/config/crd/bases/), so the
# shipped copies cannot drift from the released API unnoticed.
CRD_SHA256 = {
    "ray.io_rayclusters.yaml": "1d51d8c4ce065b22c2069af0ebd72ae25f4a6968e5c5f93a3106ba6fc35bcc1d",
    "ray.io_rayjobs.yaml": "ecae45d9a5dc1be68f1074ba784c495ef9d439d295253b61e1bd51f7b08522f5",
}


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kuberay_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(KUBERAY.glob("*.yaml")) for doc in yaml_docs(path)]


def by_name(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in kuberay_objects() if doc["kind"] == kind}


def cluster_specs() -> list[tuple[str, dict[str, Any]]]:
    """(object name, RayCluster spec) of every RayCluster and every RayJob's embedded cluster."""
    specs = [(name, doc["spec"]) for name, doc in by_name("RayCluster").items()]
    return specs + [(name, doc["spec"]["rayClusterSpec"]) for name, doc in by_name("RayJob").items()]


def pods(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(group, pod template) of the head and every worker group of a RayCluster spec."""
    return [("head", spec["headGroupSpec"]["template"])] + [
        (group["groupName"], group["template"]) for group in spec["workerGroupSpecs"]
    ]


def lock_versions(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.strip()
    return pins


# ---------------------------------------------------------------------------------------------
# schemas
# ---------------------------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """An OpenAPI schema in which objects with declared properties allow no others -- what the API
    server's strict field validation does (structural CRD schemas otherwise drop unknown fields)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def kubernetes_schema(filename: str) -> dict[str, Any]:
    return json.loads((KUBERNETES_SCHEMAS / filename).read_text())


@functools.cache
def crd(plural: str) -> dict[str, Any]:
    data = gzip.decompress((KUBERAY_CRDS / f"ray.io_{plural}.yaml.gz").read_bytes())
    assert hashlib.sha256(data).hexdigest() == CRD_SHA256[f"ray.io_{plural}.yaml"]
    return yaml.load(data, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    if api_version == "ray.io/v1" and kind in ("RayCluster", "RayJob"):
        definition = crd({"RayCluster": "rayclusters", "RayJob": "rayjobs"}[kind])
        assert definition["spec"]["group"] == "ray.io" and definition["spec"]["names"]["kind"] == kind
        (version,) = [v for v in definition["spec"]["versions"] if v["name"] == "v1"]
        schema = strict(version["schema"]["openAPIV3Schema"])
        # The CRD leaves the object's own metadata open: check it as Kubernetes' ObjectMeta.
        meta = kubernetes_schema("networkpolicy-networking-v1.json")
        schema["properties"]["metadata"] = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
        schema["$defs"] = meta["$defs"]
        schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
        return jsonschema.Draft202012Validator(schema)
    if (api_version, kind) == ("networking.k8s.io/v1", "NetworkPolicy"):
        return jsonschema.Draft202012Validator(kubernetes_schema("networkpolicy-networking-v1.json"))
    raise AssertionError(f"no schema shipped for {api_version} {kind}: add it under deploy/schemas")


def schema_errors(doc: dict[str, Any]) -> list[str]:
    found = validator(doc.get("apiVersion"), doc.get("kind")).iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:300]}" for e in found]


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def kuberay_admission_problems(doc: dict[str, Any]) -> list[str]:
    """The checks of KubeRay v1.6.2's ray-operator/controllers/ray/utils/validation.go that apply
    to these manifests (what the operator rejects after the schema has accepted an object)."""
    problems, name = [], doc["metadata"]["name"]
    limit = {"RayCluster": 53, "RayJob": 47}[doc["kind"]]
    if len(name) > limit or not _DNS1035.match(name):
        problems.append(f"name {name!r}: a DNS-1035 label of at most {limit} characters")
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"].get("rayClusterSpec")
    if doc["kind"] == "RayJob":
        job = doc["spec"]
        if not job.get("rayClusterSpec") and not job.get("clusterSelector"):
            problems.append("one of rayClusterSpec or clusterSelector must be set")
        if not job.get("shutdownAfterJobFinishes") and job.get("ttlSecondsAfterFinished"):
            problems.append("ttlSecondsAfterFinished needs shutdownAfterJobFinishes")
        if job.get("backoffLimit", 0) < 0 or job.get("ttlSecondsAfterFinished", 0) < 0:
            problems.append("backoffLimit and ttlSecondsAfterFinished must not be negative")
        if job.get("clusterSelector") and job.get("backoffLimit"):
            problems.append("backoffLimit is incompatible with clusterSelector")
        try:
            yaml.safe_load(job.get("runtimeEnvYAML") or "")
        except yaml.YAMLError as err:
            problems.append(f"runtimeEnvYAML is not YAML: {err}")
    if spec is None:
        return problems
    autoscaling = spec.get("enableInTreeAutoscaling", False)
    for group, template in pods(spec):
        if not template["spec"].get("containers"):
            problems.append(f"{group}: at least one container")
    for group in spec["workerGroupSpecs"]:
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            problems.append(f"{group['groupName']}: minReplicas and maxReplicas without autoscaling")
        if low is not None and high is not None and not 0 <= low <= high:
            problems.append(f"{group['groupName']}: 0 <= minReplicas <= maxReplicas")
        if low is not None and high is not None and not low <= group.get("replicas", low) <= high:
            problems.append(f"{group['groupName']}: replicas within [minReplicas, maxReplicas]")
    auth = spec.get("authOptions") or {}
    if auth.get("mode", "token" if auth else "disabled") == "token":
        version = tuple(int(part) for part in spec.get("rayVersion", "0").split("."))
        if version < (2, 52, 0):
            problems.append("authOptions.mode token needs rayVersion >= 2.52.0")
    return problems


def test_every_yaml_under_deploy_parses():
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert {f.parent.name for f in files} >= {"kuberay", "ray-up"}
    for path in files:
        docs = yaml_docs(path)
        assert docs and all(isinstance(doc, dict) for doc in docs), path


def test_shipped_kuberay_schemas_are_the_released_ones():
    for plural in ("rayclusters", "rayjobs"):
        assert crd(plural)["kind"] == "CustomResourceDefinition"


@pytest.mark.parametrize("name, doc", kuberay_objects(), ids=lambda v: v if isinstance(v, str) else v.get("kind"))
def test_kubernetes_manifests_validate_against_their_schemas(name, doc):
    assert not schema_errors(doc), f"{name}:\n" + "\n".join(schema_errors(doc))
    if doc["kind"] in ("RayCluster", "RayJob"):
        assert not kuberay_admission_problems(doc), f"{name}: {kuberay_admission_problems(doc)}"


def test_schema_validation_catches_mistakes():
    cluster = by_name("RayCluster")["vitray-gpu"]
    mistakes = {  # what -> (the mistake, the error it must give)
        "unknown field (typo)": (
            lambda c: c["spec"]["workerGroupSpecs"][0].update(minReplica=0),
            "spec.workerGroupSpecs.0: Additional properties are not allowed ('minReplica' was unexpected)",
        ),
        "wrong type": (
            lambda c: c["spec"]["workerGroupSpecs"][0].update(maxReplicas="four"),
            "spec.workerGroupSpecs.0.maxReplicas: 'four' is not of type 'integer'",
        ),
        "bad enum": (
            lambda c: c["spec"]["authOptions"].update(mode="open"),
            "spec.authOptions.mode: 'open' is not one of ['disabled', 'token']",
        ),
        "misplaced pod field": (
            lambda c: c["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(nodeSelector={"a": "b"}),
            "spec.headGroupSpec.template.spec.containers.0: Additional properties are not allowed ('nodeSelector' was unexpected)",
        ),
        "bad metadata": (
            lambda c: c["metadata"].update(labels={"part-of": 3}),
            "metadata.labels.part-of: 3 is not of type 'string', 'null'",
        ),
    }
    for what, (mutate, error) in mistakes.items():
        broken = copy.deepcopy(cluster)
        mutate(broken)
        assert schema_errors(broken) == [error], what
    policy = copy.deepcopy(yaml_docs(KUBERAY / "networkpolicy.yaml")[0])
    policy["spec"]["ingress"][0]["form"] = policy["spec"]["ingress"][0].pop("from")
    assert schema_errors(policy) == ["spec.ingress.0: Additional properties are not allowed ('form' was unexpected)"]
    job = copy.deepcopy(by_name("RayJob")["vitray-pretrain-b16"])
    job["spec"]["rayClusterSpec"]["rayVersion"] = "2.49.0"
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["minReplicas"] = 9
    problems = kuberay_admission_problems(job)
    assert any("2.52.0" in p for p in problems) and any("minReplicas <= maxReplicas" in p for p in problems)


def test_rayjobs_bring_the_same_cluster_as_the_long_lived_one():
    clusters = by_name("RayCluster")
    expected = {
        "vitray-pretrain-b16": "vitray-gpu",
        "vitray-evaluate-b16": "vitray-gpu",
        "vitray-pretrain-b16-tpu": "vitray-tpu",
    }
    jobs = by_name("RayJob")
    assert set(jobs) == set(expected)
    for job, cluster in expected.items():
        assert jobs[job]["spec"]["rayClusterSpec"] == clusters[cluster]["spec"], f"{job} drifted from {cluster}"


# ---------------------------------------------------------------------------------------------
# safe defaults in the manifests
# ---------------------------------------------------------------------------------------------

_CREDENTIAL_NAME = re.compile(r"(SECRET|TOKEN|PASSWORD|CREDENTIAL|ACCESS_KEY|API_KEY)", re.I)


def test_no_credentials_or_secrets_are_written_in_deploy():
    for path in sorted(DEPLOY.rglob("*")):
        if not path.is_file() or path.suffix == ".gz" or path.parent.name.startswith("kubernetes-v"):
            continue
        text = path.read_text()
        assert "kind: Secret" not in text, f"{path}: Secrets are created with kubectl, never shipped"
        assert not re.search(r"AKIA[0-9A-Z]{16}", text), f"{path}: an AWS access key id"
        # A value after a credential's name, other than a path or a variable: written in.
        assert not re.search(r"(aws_secret_access_key|auth_token)\s*[:=]\s*(?![~/.$\"'{])\S{8,}", text, re.I), path
    for name, spec in cluster_specs():
        for group, template in pods(spec):
            for container in template["spec"]["containers"]:
                for env in container.get("env", []):
                    assert not (_CREDENTIAL_NAME.search(env["name"]) and "value" in env), (
                        f"{name}/{group}: {env['name']} is written inline; use a Secret (envFrom, secretKeyRef)"
                    )


def test_ray_token_auth_stays_on_and_the_job_server_stays_inside():
    kinds = {doc["kind"] for _, doc in kuberay_objects()}
    assert not kinds & {"Ingress", "Service", "Route", "Gateway"}, kinds
    for name, spec in cluster_specs():
        assert spec["authOptions"] == {"mode": "token", "secretName": "vitray-ray-token"}, name
        head = spec["headGroupSpec"]
        assert head["serviceType"] == "ClusterIP" and head["enableIngress"] is False, name
        assert "headService" not in head and not spec.get("headServiceAnnotations"), name


def test_pods_run_unprivileged_and_workers_hold_no_api_token():
    templates = [(f"{name}/{group}", t) for name, spec in cluster_specs() for group, t in pods(spec)]
    templates += [(f"{name}/submitter", job["spec"]["submitterPodTemplate"]) for name, job in by_name("RayJob").items()]
    for where, template in templates:
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not pod.get("hostNetwork") and not pod.get("hostPID"), where
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}, where
            assert not context.get("privileged"), where
        if not where.endswith("/head"):
            assert pod["automountServiceAccountToken"] is False, where  # only the head's autoscaler talks to the API
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "vitray", where


def test_the_network_policy_covers_every_vitray_pod():
    (policy,) = yaml_docs(KUBERAY / "networkpolicy.yaml")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"podSelector": {}} in peers  # this namespace only, plus the operator
    assert all("ipBlock" not in peer for peer in peers)
    for name, spec in cluster_specs():
        for group, template in pods(spec):
            assert selector.items() <= template["metadata"]["labels"].items(), f"{name}/{group} is not covered"


def test_credentials_reach_the_pods_from_the_secret():
    for name, spec in cluster_specs():
        for group, template in pods(spec):
            (container,) = template["spec"]["containers"]
            assert {"secretRef": {"name": "vitray-s3"}} in container["envFrom"], f"{name}/{group}"


def test_no_job_record_carries_credentials():
    """What a RayJob submits -- its entrypoint and runtime env -- is stored in Ray's job record,
    which anyone who can list jobs reads (`ray job list`, the dashboard): no credential goes there,
    and the submitter pod, which only submits, holds no S3 credentials either."""
    for name, job in by_name("RayJob").items():
        spec = job["spec"]
        runtime = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
        for env_name in runtime.get("env_vars") or {}:
            assert not _CREDENTIAL_NAME.search(env_name), f"{name}: runtimeEnvYAML sets {env_name}"
        assert not _CREDENTIAL_NAME.search(spec["entrypoint"]), f"{name}: the entrypoint names a credential"
        assert "--env" not in spec["entrypoint"].split(), name
        for container in spec["submitterPodTemplate"]["spec"]["containers"]:
            assert not container.get("envFrom"), f"{name}/submitter: it needs the Ray token only"
            assert not any(_CREDENTIAL_NAME.search(env["name"]) for env in container.get("env", [])), name


def test_ray_up_nodes_get_s3_access_without_credentials_in_commands():
    """`ray up` clusters: instance profiles (AWS) or a credentials file mounted from the user's
    machine (GCP), never keys passed to `docker run` or set in a start command."""
    for path in sorted(RAY_UP.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        commands = [*config.get("docker", {}).get("run_options", [])]
        for key in (
            "initialization_commands",
            "setup_commands",
            "head_setup_commands",
            "worker_setup_commands",
            "head_start_ray_commands",
            "worker_start_ray_commands",
        ):
            commands += config.get(key) or []
        for command in commands:
            assert not re.search(r"AWS_(SECRET_ACCESS_KEY|ACCESS_KEY_ID|SESSION_TOKEN)", command), (
                f"{path.name}: {command}"
            )
        if config["provider"]["type"] == "aws":
            for node_type, node in config["available_node_types"].items():
                if node_type != config["head_node_type"]:  # the head gets Ray's default profile (S3 access)
                    assert "IamInstanceProfile" in node["node_config"], f"{path.name}: {node_type}"
        else:
            mounted = config.get("file_mounts", {})
            assert "~/.aws/credentials" in mounted, f"{path.name}: S3 credentials reach the nodes as a mounted file"


# ---------------------------------------------------------------------------------------------
# images, versions and the runs the manifests start
# ---------------------------------------------------------------------------------------------


def documented_build(dockerfile: Path) -> list[str]:
    (line,) = [line for line in dockerfile.read_text().splitlines() if line.startswith("#   docker build ")]
    return shlex.split(line.lstrip("# "))


def image_tag(kind: str) -> str:
    build = documented_build(DOCKER / f"Dockerfile.{kind}")
    return build[build.index("-t") + 1]


def test_manifests_run_the_images_the_dockerfiles_build_with_the_ray_they_pin():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    ray_pinned = lock_versions(REPO / "requirements.lock")["ray"]  # both images install this lock
    for kind in ("gpu", "tpu"):
        assert image_tag(kind).endswith(f"/vitray:{version}-{kind}")
    for name, spec in cluster_specs():
        kind = "tpu" if "tpu" in name else "gpu"
        assert spec["rayVersion"] == ray_pinned, name
        images = {c["image"] for _, t in pods(spec) for c in t["spec"]["containers"]}
        assert images == {image_tag(kind)}, name
    for name, job in by_name("RayJob").items():
        (submitter,) = job["spec"]["submitterPodTemplate"]["spec"]["containers"]
        assert submitter["image"] == image_tag("tpu" if "tpu" in name else "gpu")
    for path in RAY_UP.glob("*.yaml"):
        assert yaml_docs(path)[0]["docker"]["image"] == image_tag("tpu" if "tpu" in path.name else "gpu"), path


def entrypoint(job: dict[str, Any]) -> list[str]:
    return shlex.split(job["spec"]["entrypoint"])


def overrides(args: list[str]) -> dict[str, Any]:
    pairs = [args[i + 1].partition("=") for i, arg in enumerate(args) if arg == "--set"]
    return {key: yaml.safe_load(value) for key, _, value in pairs}


def test_jobs_name_their_runs_so_that_a_restarted_job_resumes():
    for name, job in by_name("RayJob").items():
        args, sets = entrypoint(job), overrides(entrypoint(job))
        assert args[0] == "vitray" and sets["cluster.address"] == "auto", name  # join this cluster
        assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["backoffLimit"] > 0, name
        if args[1] == "pretrain":
            assert sets["run.name"] and str(sets["run.storage"]).startswith("s3://"), name
            assert str(sets["data.train"]).startswith("s3://"), name
        else:
            assert args[1] == "evaluate" and args[2].startswith("s3://") and str(sets["output"]).startswith("s3://")
    runs = [overrides(entrypoint(j)).get("run.name") for j in by_name("RayJob").values()]
    assert len({r for r in runs if r}) == len([r for r in runs if r])  # no two jobs share a run


def test_runs_fit_the_worker_groups_that_carry_them():
    from vitray.cluster.torch_trainer import scaling_config
    from vitray.common.config import load_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.driver_checks.tpu_slices import tpu_slice

    clusters = by_name("RayCluster")
    for name, job in by_name("RayJob").items():
        args = entrypoint(job)
        if args[1] != "pretrain":
            continue
        sets = overrides(args)
        cfg = load_config(
            TrainingConfig, REPO / args[args.index("-c") + 1], [f"{k}={json.dumps(v)}" for k, v in sets.items()]
        )
        (group,) = clusters["vitray-tpu" if "tpu" in name else "vitray-gpu"]["spec"]["workerGroupSpecs"]
        (container,) = group["template"]["spec"]["containers"]
        per_pod = {k: float(str(v).removesuffix("Gi")) for k, v in container["resources"]["limits"].items()}
        pods_at_most = group["maxReplicas"] * group.get("numOfHosts", 1)
        workers = cfg.cluster.num_workers
        if "tpu" in name:
            chips = per_pod["google.com/tpu"]
            topology = group["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
            hosts = functools.reduce(lambda a, b: a * b, map(int, topology.split("x"))) / chips
            assert group["numOfHosts"] == hosts and workers == pods_at_most, "one Ray worker per TPU host"
            assert cfg.train.backend == "xla"
            accelerator = group["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"]
            tpu = tpu_slice(cfg.cluster.tpu, cfg.cluster.tpu_topology)
            assert tpu.accelerator_type == "TPU-" + accelerator.removeprefix("tpu-").removesuffix("-slice").upper()
            assert (tpu.topology, tpu.hosts, tpu.chips_per_host) == (topology, hosts, chips), (
                "the run's slice is the pod's"
            )
            resources = scaling_config(cfg).resources_per_worker
            assert resources["TPU"] == chips, "each worker asks for its host's chips"
            assert cfg.cluster.cpus_per_worker <= per_pod["cpu"]
        else:
            per_node = per_pod["nvidia.com/gpu"] // cfg.cluster.gpus_per_worker
            assert workers <= pods_at_most * per_node, f"{name}: {workers} workers, room for {pods_at_most * per_node}"
            assert per_node * cfg.cluster.cpus_per_worker <= per_pod["cpu"], name


# ---------------------------------------------------------------------------------------------
# `ray up` cluster-launcher YAMLs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(RAY_UP.glob("*.yaml")), ids=lambda p: p.name)
def test_ray_up_yamls_pass_rays_own_preparation_and_schema(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml_docs(path)[0]
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)  # Ray's ray-schema.json, plus its own consistency checks
    # Nothing is installed or downloaded when a node starts: the launcher's defaults are replaced.
    for key in ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands"):
        assert prepared[key] == [], f"{path.name}: {key} {prepared[key]}"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in prepared[key] if "ray start" in c]
        assert "RAY_AUTH_MODE=token ray start" in start, f"{path.name}: {key} must keep token auth"
    (head_start,) = [c for c in prepared["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in head_start  # reached through `ray dashboard`'s SSH tunnel
    assert prepared["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    if prepared["provider"]["type"] == "aws":
        assert prepared["provider"]["cache_stopped_nodes"] is False  # idle nodes go, with their disks
    with pytest.raises(jsonschema.ValidationError, match=r"\('max_worker' was unexpected\)"):
        validate_config({**prepared, "max_worker": 3})  # a typo'd key is an error, so the check is real


def test_tpu_node_types_match_their_slices():
    from ray._private.accelerators import TPUAcceleratorManager, tpu

    config = yaml_docs(RAY_UP / "gcp-tpu.yaml")[0]
    tpu_types = {n: t for n, t in config["available_node_types"].items() if "acceleratorType" in t["node_config"]}
    assert tpu_types
    for node_type in tpu_types.values():
        accelerator = node_type["node_config"]["acceleratorType"]
        assert TPUAcceleratorManager.is_valid_tpu_accelerator_type(accelerator)
        assert "machineType" not in node_type["node_config"] and node_type["node_config"]["runtimeVersion"]
        assert node_type["resources"]["TPU"] == tpu.get_num_tpu_visible_chips_per_host(accelerator)
        assert node_type["min_workers"] == node_type["max_workers"] == 1, "a slice is kept whole"
    assert config["head_node_type"] not in tpu_types
    aws = yaml_docs(RAY_UP / "aws-gpu.yaml")[0]
    for name, node_type in aws["available_node_types"].items():
        if name != aws["head_node_type"]:
            assert node_type["node_config"]["IamInstanceProfile"], "workers reach S3 through an instance role"


# ---------------------------------------------------------------------------------------------
# Dockerfiles
# ---------------------------------------------------------------------------------------------


def instructions(dockerfile: Path) -> list[tuple[int, str, str]]:
    """(stage number, INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, stage, pending = [], -1, ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        pending += " " + line.rstrip("\\").strip()
        if line.endswith("\\"):
            continue
        keyword, _, args = pending.strip().partition(" ")
        if keyword.upper() == "FROM":
            stage += 1
        out.append((stage, keyword.upper(), args.strip()))
        pending = ""
    return out


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        bare = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(c, bare) for c in candidates) or fnmatch.fnmatchcase(path, bare):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_dockerfiles_install_pinned_from_the_repository_and_run_unprivileged(kind):
    dockerfile = DOCKER / f"Dockerfile.{kind}"
    steps = instructions(dockerfile)
    ignore = [
        line.strip()
        for line in (DOCKER / f"Dockerfile.{kind}.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert dockerignore_excludes(ignore, ".venv") and dockerignore_excludes(ignore, ".git")
    copied = set()
    for _, keyword, args in steps:
        assert keyword != "ADD", "ADD can fetch URLs; COPY only copies"
        if keyword == "COPY" and "--from=" not in args:
            *sources, _dest = shlex.split(args)
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                assert not dockerignore_excludes(ignore, source), f"COPY {source}: excluded by the .dockerignore"
                copied.add(Path(source).name)
    installs = [args for _, keyword, args in steps if keyword == "RUN" and "pip install" in args]
    assert installs and all(s == 0 for s, k, a in steps if k == "RUN" and "pip install" in a), "pip only at build"
    expected_locks = {"gpu": ["requirements.lock"], "tpu": ["requirements.lock", "requirements-tpu-host.lock"]}[kind]
    pins = {}
    for lock in expected_locks:
        assert lock in copied, f"{lock} is not copied into the build"
        pins.update(lock_versions(REPO / lock if (REPO / lock).exists() else DOCKER / lock))
    for command in " ".join(installs).split("&&"):
        words = shlex.split(command)
        if "install" not in words or words[words.index("install") - 1] != "pip":
            continue
        constraints = [words[i + 1] for i, w in enumerate(words) if w in ("--constraint", "-c")]
        packages = [w for w in words[words.index("install") + 1 :] if not w.startswith("-") and w not in constraints]
        if packages == ["pip==26.3"]:
            continue
        assert sorted(constraints) == sorted(expected_locks), command
        for package in packages:  # the project itself, or a name every lock pins
            name = re.split(r"[\[=<>]", package)[0]
            assert name in (".",) or re.sub(r"[-_.]+", "-", name.lower()) in pins, f"{package} is not pinned"
    runtime = [(k, a) for s, k, a in steps if s == max(s for s, _, _ in steps)]
    for keyword, args in runtime:
        assert not re.search(r"\b(curl|wget|git clone|pip install)\b", args), f"{keyword} {args}: fetches"
    users = [a for k, a in runtime if k == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) != 0, "non-root numeric USER"
    workdirs = [a for k, a in runtime if k == "WORKDIR"]
    assert workdirs[-1] == IMAGE_WORKDIR and ("COPY", "configs/ configs/") in runtime
    build = documented_build(dockerfile)
    assert build[:4] == ["docker", "build", "-f", f"deploy/docker/Dockerfile.{kind}"] and build[-1] == "."


# ---------------------------------------------------------------------------------------------
# every command line, as written, against its config
# ---------------------------------------------------------------------------------------------


WALK_THROUGH = REPO / "docs" / "deploy.md"  # the cluster walk-through: submit, credentials, KubeRay, ray up, TPUs


def walk_through() -> str:
    return WALK_THROUGH.read_text()


def shell_lines(markdown: str) -> list[str]:
    """The command lines of the ```bash blocks, continuations joined."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                lines.append(line.strip())
    return lines


def words_of(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    return words[:-1] if words and words[-1] == "&" else words


def vitray_args(words: list[str]) -> list[str] | None:
    """The vitray arguments a command line runs: `vitray ARGS`, or ARGS after `-- vitray` (ray job
    submit); None for other commands."""
    if words[:1] == ["vitray"]:
        return words[1:]
    if "--" in words and words[words.index("--") + 1 : words.index("--") + 2] == ["vitray"]:
        return words[words.index("--") + 2 :]
    return None


_COMMENTED_COMMAND = re.compile(
    r"^\s*#\s*vitray\s+(pretrain|evaluate|finetune|fewshot|submit|runs|export|data|demo|inspect)\b"
)


def command_lines() -> list[tuple[str, list[str]]]:
    found = []
    for name, doc in kuberay_objects():
        if doc["kind"] == "RayJob":
            found.append((f"{name}: entrypoint", entrypoint(doc)[1:]))
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and path.suffix != ".gz" and "schemas" not in path.parts:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if _COMMENTED_COMMAND.match(line):  # a command shown in a comment
                    found.append((f"{path.relative_to(REPO)}:{number}", words_of(line.lstrip(" #"))[1:]))
    for line in shell_lines(walk_through()):
        args = vitray_args(words_of(line))
        if args is not None:
            found.append((f"docs/deploy.md: {line}", args))
    return found


def parse_with_the_cli(args: list[str]) -> None:
    """What the CLI does with `args` up to running the command: an unknown command or option, a
    missing argument or a badly typed value raises the CLI's UsageError (Typer's click)."""
    import typer

    from vitray.cli.main import app

    command, name, rest, parent = typer.main.get_command(app), "vitray", list(args), None
    while hasattr(command, "get_command"):  # a group (`vitray`, `vitray data`): pick its command
        parent = command.context_class(command, info_name=name, parent=parent)
        assert rest, f"{name} needs a command"
        name, command, rest = command.resolve_command(parent, rest)  # UsageError if there is none
    command.make_context(name, rest, parent=parent)


@pytest.mark.parametrize(
    ("line", "error", "message"),
    [
        (["runs"], MissingParameter, "Missing parameter: storage"),
        (["pretrain", "--sett", "a=1"], NoSuchOption, "No such option: --sett"),
        (["nosuch"], UsageError, "No such command 'nosuch'"),
        (["data", "prepare", "builtin:digits"], MissingParameter, "Missing parameter: dest"),
    ],
)
def test_the_cli_parse_check_rejects_bad_lines(line, error, message):
    parse_with_the_cli(["submit", "--address", "http://h:8265", "--", "runs", "s3://b/runs"])
    with pytest.raises(error, match=message) as raised:
        parse_with_the_cli(line)
    assert type(raised.value) is error


def test_the_readme_and_deploy_hold_command_lines():
    lines = command_lines()
    rayjobs = {path.name for path in KUBERAY.glob("*.yaml") if any(d["kind"] == "RayJob" for d in yaml_docs(path))}
    assert {w.removesuffix(": entrypoint") for w, _ in lines if w.endswith(": entrypoint")} == rayjobs
    # The cluster walk-through: prepare the data, submit the jobs, list the runs.
    assert {"data", "submit", "runs"} <= {args[0] for w, args in lines if w.startswith("docs/deploy.md")}


@pytest.mark.parametrize("where, args", command_lines(), ids=[w for w, _ in command_lines()])
def test_every_command_line_runs_as_written(where, args):
    from typer.testing import CliRunner

    from vitray.cli.main import app

    parse_with_the_cli(args)
    if args[0] == "submit":
        args = args[args.index("--") + 1 :]
        parse_with_the_cli(args)
    if args[0] not in ("pretrain", "evaluate", "finetune"):
        return  # no config to resolve (runs, export, data prepare): parsed above
    config = args[args.index("-c") + 1] if "-c" in args else None
    assert config is None or (REPO / config).is_file(), f"{where}: {config} is not in the repository"
    result = CliRunner().invoke(app, [*args, "--dry-run"])
    assert result.exit_code == 0, f"{where}\n{result.output}"
    resolved = yaml.safe_load(result.output)
    for key, value in overrides(args).items():  # what the line sets is what the run gets
        node = resolved
        for part in key.split("."):
            node = node[part]
        assert node == value, f"{where}: {key}"


def test_the_walk_through_uses_every_deploy_file_and_build():
    section = walk_through()
    for path in sorted(KUBERAY.glob("*.yaml")) + sorted(RAY_UP.glob("*.yaml")):
        assert str(path.relative_to(REPO)) in section, f"docs/deploy.md does not use {path.relative_to(REPO)}"
    lines = shell_lines(section)
    for kind in ("gpu", "tpu"):
        assert shlex.join(documented_build(DOCKER / f"Dockerfile.{kind}")) in lines, f"{kind} build command"
    for line in lines:
        for word in words_of(line):
            if word.startswith("deploy/"):
                assert (REPO / word).exists(), f"docs/deploy.md: {word} does not exist"
    steps = " ".join(lines)
    for needed in (
        "kubectl create secret generic vitray-s3",
        "kubectl create secret generic vitray-ray-token",
        "ray get-auth-token",
        "vitray runs",
        "ray up",
        "kubectl port-forward",
    ):
        assert needed in steps, f"docs/deploy.md misses the step {needed!r}"
