#!/usr/bin/env python3
"""Checks of deploy/ that a schema cannot make; run by scripts/check-deploy.sh
with the deploy venv's Python (PyYAML comes with yamllint).

  deploy_check.py policy NAME RENDERED.yaml   rules every rendered kustomization keeps
  deploy_check.py same A.yaml B.yaml           two renders hold the same objects
  deploy_check.py json RENDERED.yaml           the documents as one JSON array
  deploy_check.py dockerfiles DIR              rules the Dockerfiles in DIR keep

The rules are the ones a reader of docs/src/operations/deploy.md relies on: one
coordinator replicated once with Recreate, probes on the HTTP port's health
paths, a Service in front of the ports the binary listens on, a worker grace
period that ends before Kubernetes kills the pod, GPU workers one per node,
non-root containers with resources, no Service-link environment (it would
add STOKE_* variables the binaries do not know), every referenced
ConfigMap or Secret present. Whether the binaries accept every flag and
variable is checked by running them (tests/tests/deploy.rs).
"""

import json
import re
import sys
from pathlib import Path

import yaml

# The worker must be done (or give up) this long before the pod's
# terminationGracePeriodSeconds ends and the kubelet sends SIGKILL.
GRACE_MARGIN_S = 5
HEALTH_PATHS = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
# Secrets the user creates (docs/src/operations/deploy.md): the store credentials may be
# absent (workload identity), so references to them are optional; tokens
# and TLS must be there, so references to them are not.
EXTERNAL_SECRETS = {"stoke-store-credentials": True, "stoke-tokens": False, "stoke-tls": False}
# Overlays that may run without tokens and TLS: their name says so.
INSECURE_NAMES = ("insecure", "dev")
# Kinds kubernetes-validate has schemas for (it only warns on others), and
# custom kinds with a schema vendored under deploy/schemas/: any other kind
# in a render fails, since nothing would validate it.
BUILTIN_KINDS = {
    "Namespace", "ServiceAccount", "ConfigMap", "Secret", "Service", "Deployment",
    "PodDisruptionBudget", "Job", "HorizontalPodAutoscaler",
}
SCHEMAS = Path(__file__).resolve().parent.parent / "deploy" / "schemas"
VENDORED = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
    ("cert-manager.io/v1", "Certificate"): "cert-manager.io_v1_certificate.json",
}
# What autoscalers of the workers must read: the coordinator's signal.
WANTED_METRIC = "stoke_workers_wanted"


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def duration_s(text):
    """Seconds in a humantime-style duration ("50s", "1m30s", "90")."""
    text = str(text).strip()
    if re.fullmatch(r"\d+", text):
        return float(text)
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total, pos = 0.0, 0
    for m in re.finditer(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)", text):
        if m.start() != pos or m.group(2) not in units:
            raise ValueError(f"not a duration: {text!r}")
        total += float(m.group(1)) * units[m.group(2)]
        pos = m.end()
    if pos != len(text) or pos == 0:
        raise ValueError(f"not a duration: {text!r}")
    return total


class Render:
    def __init__(self, name, docs):
        self.name = name
        self.docs = docs
        self.errors = []

    def fail(self, what):
        self.errors.append(what)

    def of_kind(self, kind):
        return [d for d in self.docs if d.get("kind") == kind]

    def named(self, kind, name):
        for d in self.of_kind(kind):
            if d["metadata"]["name"] == name:
                return d
        return None

    def workloads(self):
        """(object, pod spec) for everything that runs pods."""
        for d in self.docs:
            kind = d.get("kind")
            if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                yield d, d["spec"]["template"]["spec"]
            elif kind == "CronJob":
                yield d, d["spec"]["jobTemplate"]["spec"]["template"]["spec"]

    def worker_deployments(self):
        """Every worker Deployment: the GPU workers (component "worker")
        and other pools' ("worker-cpu", ...)."""
        return [d for d in self.of_kind("Deployment")
                if d["metadata"].get("labels", {}).get("app.kubernetes.io/component", "").startswith("worker")]

    def component(self, kind, component):
        for d in self.of_kind(kind):
            labels = d["metadata"].get("labels", {})
            if labels.get("app.kubernetes.io/component") == component:
                return d
        return None


def ident(d):
    return f"{d['kind']}/{d['metadata']['name']}"


def check_pods(r):
    for obj, pod in r.workloads():
        where = ident(obj)
        if pod.get("enableServiceLinks") is not False:
            r.fail(f"{where}: enableServiceLinks must be false (Service links add STOKE_*_SERVICE_HOST & co)")
        if pod.get("automountServiceAccountToken") is not False:
            r.fail(f"{where}: automountServiceAccountToken must be false (nothing here calls the API)")
        psc = pod.get("securityContext", {})
        if psc.get("runAsNonRoot") is not True or not psc.get("runAsUser"):
            r.fail(f"{where}: the pod must set runAsNonRoot and a non-zero runAsUser")
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            cw = f"{where} container {c['name']}"
            image = c.get("image", "")
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            if "@sha256:" not in image and tag in ("", "latest"):
                r.fail(f"{cw}: image {image!r} needs a fixed tag or digest")
            res = c.get("resources", {})
            for key in ("cpu", "memory"):
                if key not in res.get("requests", {}):
                    r.fail(f"{cw}: no {key} request")
            if "memory" not in res.get("limits", {}):
                r.fail(f"{cw}: no memory limit")
            sc = c.get("securityContext", {})
            if sc.get("allowPrivilegeEscalation") is not False:
                r.fail(f"{cw}: allowPrivilegeEscalation must be false")
            if sc.get("readOnlyRootFilesystem") is not True:
                r.fail(f"{cw}: readOnlyRootFilesystem must be true")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                r.fail(f"{cw}: capabilities must drop ALL")
            check_refs(r, cw, c, pod)


def check_refs(r, where, c, pod):
    """Every ConfigMap and Secret a container reads is in the render (or is
    a Secret the user creates, referenced as optional)."""
    refs = []
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            refs.append(("ConfigMap", src["configMapRef"]))
        if "secretRef" in src:
            refs.append(("Secret", src["secretRef"]))
    for e in c.get("env", []):
        vf = e.get("valueFrom", {})
        if "configMapKeyRef" in vf:
            refs.append(("ConfigMap", vf["configMapKeyRef"]))
        if "secretKeyRef" in vf:
            refs.append(("Secret", vf["secretKeyRef"]))
    mounted = {m["name"] for m in c.get("volumeMounts", [])}
    for v in pod.get("volumes", []):
        if v["name"] in mounted and "configMap" in v:
            refs.append(("ConfigMap", v["configMap"]))
        if v["name"] in mounted and "secret" in v:
            refs.append(("Secret", {"name": v["secret"]["secretName"], **v["secret"]}))
    for kind, ref in refs:
        name = ref["name"]
        obj = r.named(kind, name)
        if obj is None:
            if kind == "Secret" and name in EXTERNAL_SECRETS:
                if (ref.get("optional") is True) == EXTERNAL_SECRETS[name]:
                    continue
                r.fail(f"{where}: the Secret {name} must be referenced with optional: "
                       f"{str(EXTERNAL_SECRETS[name]).lower()}")
                continue
            r.fail(f"{where}: {kind} {name} is not in this render")
            continue
        key = ref.get("key")
        if key is not None and key not in obj.get("data", {}) and key not in obj.get("stringData", {}):
            r.fail(f"{where}: {kind} {name} has no key {key}")


def container_env(r, c):
    """The container's environment as far as the render tells it."""
    env = {}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            cm = r.named("ConfigMap", src["configMapRef"]["name"])
            env.update((cm or {}).get("data", {}))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "valueFrom" in e:
            env[e["name"]] = None
    return env


def flag_value(args, flag):
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def port_of(c, port):
    """A probe's or Service's port (a name or number) as a container port number."""
    for p in c.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def check_coordinator(r):
    dep = r.component("Deployment", "coordinator")
    if dep is None:
        return
    where = ident(dep)
    spec = dep["spec"]
    if spec.get("replicas") != 1:
        r.fail(f"{where}: replicas must be 1 (one process owns the state root)")
    if spec.get("strategy", {}).get("type") != "Recreate":
        r.fail(f"{where}: strategy must be Recreate (never two coordinators at once)")
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    env = container_env(r, c)
    args = c.get("args", [])
    grpc, http = port_of(c, "grpc"), port_of(c, "http")
    if grpc is None or http is None:
        r.fail(f"{where}: the container needs ports named grpc and http")
        return
    for flag, var, port in (("--listen", "STOKE_LISTEN", grpc), ("--http-listen", "STOKE_HTTP_LISTEN", http)):
        listen = flag_value(args, flag) or env.get(var)
        if listen is None:
            r.fail(f"{where}: set {flag} (or {var}) so the port is not left to the binary's default")
        elif not listen.endswith(f":{port}"):
            r.fail(f"{where}: {flag} {listen} does not listen on container port {port}")
    for probe, path in HEALTH_PATHS.items():
        get = c.get(probe, {}).get("httpGet")
        if get is None:
            r.fail(f"{where}: no HTTP {probe}")
            continue
        if get.get("path") != path:
            r.fail(f"{where}: {probe} must GET {path}, not {get.get('path')}")
        if port_of(c, get.get("port")) != http:
            r.fail(f"{where}: {probe} must use the http port {http}")
    svc = r.named("Service", dep["metadata"]["name"])
    if svc is None:
        r.fail(f"{where}: no Service of the same name")
        return
    labels = spec["template"]["metadata"]["labels"]
    if not svc["spec"]["selector"].items() <= labels.items():
        r.fail(f"{ident(svc)}: its selector does not match the coordinator's pods")
    targets = {port_of(c, p.get("targetPort", p["port"])) for p in svc["spec"]["ports"]}
    if {grpc, http} - targets:
        r.fail(f"{ident(svc)}: must expose the grpc ({grpc}) and http ({http}) ports")


def worker_pool(r, dep):
    """The pool a worker Deployment serves (STOKE_POOL or --pool)."""
    c = dep["spec"]["template"]["spec"]["containers"][0]
    return flag_value(c.get("args", []), "--pool") or container_env(r, c).get("STOKE_POOL") or "default"


def check_pools(r):
    """Each worker Deployment serves a pool the coordinator serves, and no
    two serve the same one (each pool is one Deployment, scaled on its
    own series)."""
    deps = r.worker_deployments()
    coord = r.component("Deployment", "coordinator")
    pools, default = None, "default"
    if coord is not None:
        c = coord["spec"]["template"]["spec"]["containers"][0]
        env = container_env(r, c)
        named = flag_value(c.get("args", []), "--pool") or env.get("STOKE_POOLS")
        default = flag_value(c.get("args", []), "--default-pool") or env.get("STOKE_DEFAULT_POOL") or "default"
        if named:
            pools = {p.strip() for p in named.split(",") if p.strip()} | {default}
    seen = {}
    for dep in deps:
        pool = worker_pool(r, dep)
        if pools is not None and pool not in pools:
            r.fail(f"{ident(dep)}: serves the pool {pool!r}, which the coordinator does not "
                   f"(STOKE_POOLS: {', '.join(sorted(pools))})")
        if pool in seen:
            r.fail(f"{ident(dep)}: serves the pool {pool!r}, as {ident(seen[pool])} does")
        seen[pool] = dep
    if len(deps) > 1 and pools is None:
        r.fail("several worker Deployments but the coordinator names no pools (STOKE_POOLS)")
    if deps and default not in seen:
        r.fail(f"no worker Deployment serves the default pool {default!r}: jobs that name no pool would wait")


def check_worker(r, overlay):
    for dep in r.worker_deployments():
        check_one_worker(r, overlay, dep)


def check_one_worker(r, overlay, dep):
    where = ident(dep)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = container_env(r, c)
    pod_grace = pod.get("terminationGracePeriodSeconds", 30)
    grace = flag_value(c.get("args", []), "--grace-period") or env.get("STOKE_GRACE_PERIOD")
    if grace is None:
        r.fail(f"{where}: set STOKE_GRACE_PERIOD (the default, 25s, is not tied to the pod's grace)")
    else:
        try:
            g = duration_s(grace)
            if g + GRACE_MARGIN_S > pod_grace:
                r.fail(
                    f"{where}: STOKE_GRACE_PERIOD {grace} must end at least {GRACE_MARGIN_S}s before "
                    f"terminationGracePeriodSeconds {pod_grace}"
                )
        except ValueError as e:
            r.fail(f"{where}: STOKE_GRACE_PERIOD: {e}")
    wid = next((e for e in c.get("env", []) if e["name"] == "STOKE_WORKER_ID"), None)
    field = ((wid or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
    if field not in ("metadata.name", "spec.nodeName"):
        r.fail(f"{where}: STOKE_WORKER_ID must come from the pod's name (downward API)")
    coord = r.component("Service", "coordinator")
    url = env.get("STOKE_COORDINATOR")
    if coord is not None:
        grpc = next(p["port"] for p in coord["spec"]["ports"] if p["name"] == "grpc")
        scheme = "https" if env.get("STOKE_TLS_CA") else "http"
        want = f"{scheme}://{coord['metadata']['name']}:{grpc}"
        if url != want:
            r.fail(f"{where}: STOKE_COORDINATOR is {url!r}, the Service is at {want}")
    pdb = [p for p in r.of_kind("PodDisruptionBudget")
           if p["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()]
    if not pdb:
        r.fail(f"{where}: no PodDisruptionBudget covers the workers")
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    gpu_workers = dep["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"
    if overlay == "gpu" and gpu_workers and not gpus:
        r.fail(f"{where}: the gpu overlay's workers must ask for nvidia.com/gpu")
    if gpus:
        check_gpu_worker(r, where, dep, pod, c)


def check_gpu_worker(r, where, dep, pod, c):
    req = c["resources"].get("requests", {}).get("nvidia.com/gpu")
    if req is not None and str(req) != str(c["resources"]["limits"]["nvidia.com/gpu"]):
        r.fail(f"{where}: nvidia.com/gpu requests and limits differ")
    if not pod.get("nodeSelector") and not pod.get("affinity", {}).get("nodeAffinity"):
        r.fail(f"{where}: GPU workers need a nodeSelector or node affinity for the GPU pool")
    if not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])):
        r.fail(f"{where}: GPU workers need to tolerate the nvidia.com/gpu taint")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    terms = pod.get("affinity", {}).get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
    if not any(t.get("topologyKey") == "kubernetes.io/hostname"
               and t.get("labelSelector", {}).get("matchLabels", {}).items() <= labels.items()
               for t in terms):
        r.fail(f"{where}: GPU workers need a required anti-affinity on kubernetes.io/hostname (one per node)")


def check_submit(r):
    for job in r.of_kind("Job"):
        c = job["spec"]["template"]["spec"]["containers"][0]
        cmd = c.get("command", []) + c.get("args", [])
        if not cmd or Path(cmd[0]).name != "stoke" or "submit" not in cmd:
            continue
        url = flag_value(cmd, "--coordinator") or container_env(r, c).get("STOKE_COORDINATOR")
        if not url or not re.fullmatch(r"https?://stoke-coordinator:7070", url):
            r.fail(f"{ident(job)}: submits to {url!r}, not the coordinator's Service stoke-coordinator:7070")
        if not flag_value(cmd, "--job-id"):
            r.fail(f"{ident(job)}: pass --job-id so a retried pod resubmits the same job")


def check_kinds(r):
    """Every object has a schema: built in, or vendored and checked here."""
    import jsonschema

    for d in r.docs:
        key = (d.get("apiVersion"), d.get("kind"))
        if key in VENDORED:
            schema = json.loads((SCHEMAS / VENDORED[key]).read_text())
            errors = sorted(
                jsonschema.Draft202012Validator(schema).iter_errors(d), key=lambda e: list(e.path)
            )
            for e in errors:
                path = ".".join(str(p) for p in e.path)
                r.fail(f"{ident(d)}: {path}: {e.message} (schema deploy/schemas/{VENDORED[key]})")
        elif d.get("kind") not in BUILTIN_KINDS:
            r.fail(f"{ident(d)}: no schema validates {key[0]} {key[1]}; vendor one in deploy/schemas/")


def check_autoscaling(r):
    """Each ScaledObject or HPA scales a worker Deployment on its own pool's
    wanted workers, and removes pods no faster than the PDB lets drains do,
    each given its whole grace period."""
    scalers = r.of_kind("ScaledObject") + r.of_kind("HorizontalPodAutoscaler")
    if not scalers:
        return
    deps = {d["metadata"]["name"]: d for d in r.worker_deployments()}
    if not deps:
        r.fail("an autoscaler but no worker Deployment")
        return
    for s in scalers:
        where = ident(s)
        spec = s["spec"]
        target = spec["scaleTargetRef"].get("name")
        dep = deps.get(target)
        if dep is None:
            names = ", ".join(f"Deployment/{n}" for n in sorted(deps))
            r.fail(f"{where}: must scale a worker Deployment ({names}), not {target}")
            continue
        pool = worker_pool(r, dep)
        pod = dep["spec"]["template"]["spec"]
        pod_grace = pod.get("terminationGracePeriodSeconds", 30)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        pdbs = [p for p in r.of_kind("PodDisruptionBudget")
                if p["spec"]["selector"].get("matchLabels", {}).items() <= labels.items()]
        max_unavailable = min((p["spec"].get("maxUnavailable", 1) for p in pdbs), default=1)
        if s["kind"] == "ScaledObject":
            behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
            queries = [t["metadata"].get("query", "") for t in spec["triggers"] if t["type"] == "prometheus"]
            if not any(WANTED_METRIC in q for q in queries):
                r.fail(f"{where}: needs a prometheus trigger on {WANTED_METRIC}")
            elif not any(WANTED_METRIC in q and re.search(rf'pool\s*=\s*"{re.escape(pool)}"', q) for q in queries):
                r.fail(f'{where}: its query must select pool="{pool}", the pool {ident(dep)} serves '
                       f"({WANTED_METRIC} has one series per pool)")
            if spec.get("minReplicaCount", 0) != 0:
                r.fail(f"{where}: minReplicaCount must be 0 (no workers while nothing is pending)")
        else:
            behavior = spec.get("behavior", {})
            metrics = [m["external"]["metric"] for m in spec.get("metrics", []) if m["type"] == "External"]
            wanted = [m for m in metrics if m.get("name") == WANTED_METRIC]
            if not wanted:
                r.fail(f"{where}: needs an External metric {WANTED_METRIC}")
            elif not any(m.get("selector", {}).get("matchLabels", {}).get("pool") == pool for m in wanted):
                r.fail(f"{where}: its {WANTED_METRIC} metric must select pool: {pool}, the pool {ident(dep)} serves")
        policies = behavior.get("scaleDown", {}).get("policies", [])
        if not policies:
            r.fail(f"{where}: set a scaleDown policy (the default removes many busy workers at once)")
        for p in policies:
            if p["type"] != "Pods" or p["value"] > max_unavailable:
                r.fail(f"{where}: scaleDown may remove at most {max_unavailable} pod(s) per period "
                       f"(the PodDisruptionBudget's maxUnavailable), got {p['type']} {p['value']}")
            if p["periodSeconds"] < pod_grace:
                r.fail(f"{where}: scaleDown periodSeconds {p['periodSeconds']} is shorter than the "
                       f"workers' terminationGracePeriodSeconds {pod_grace}: a removed worker may not "
                       f"have checkpointed before the next goes")


def secret_file(pod, c, path):
    """Whether `path` is a file of a Secret mounted in the container."""
    if not path:
        return False
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/") + "/"
        secret = volumes.get(m["name"], {}).get("secret")
        if secret is None or not path.startswith(root):
            continue
        rel = path[len(root):]
        items = secret.get("items")
        return items is None or any(i["path"] == rel for i in items)
    return False


def check_certificates(r):
    """A cert-manager Certificate must write the Secret the coordinator
    mounts for TLS, for names the workers use (the Service's)."""
    svc = r.component("Service", "coordinator")
    for cert in r.of_kind("Certificate"):
        if cert["spec"]["secretName"] != "stoke-tls":
            r.fail(f"{ident(cert)}: secretName must be stoke-tls (what the coordinator mounts)")
        if svc is not None and svc["metadata"]["name"] not in cert["spec"].get("dnsNames", []):
            r.fail(f"{ident(cert)}: dnsNames must hold the Service name {svc['metadata']['name']} "
                   f"(workers reach https://{svc['metadata']['name']}:7070)")


def check_security(r, overlay):
    """Tokens and TLS on, from Secrets mounted as files, unless the
    overlay's name says it is insecure or for development."""
    if any(word in overlay for word in INSECURE_NAMES):
        return
    for obj, pod in r.workloads():
        for c in pod.get("containers", []):
            for e in c.get("env", []):
                if e["name"] in ("STOKE_CLIENT_TOKEN", "STOKE_WORKER_TOKEN") and "value" in e:
                    r.fail(f"{ident(obj)}: {e['name']} as a literal puts the token in the manifest; "
                           f"use {e['name']}_FILE and a Secret")
    want = {
        "coordinator": ("STOKE_CLIENT_TOKEN_FILE", "STOKE_WORKER_TOKEN_FILE", "STOKE_TLS_CERT", "STOKE_TLS_KEY"),
        "worker": ("STOKE_WORKER_TOKEN_FILE", "STOKE_TLS_CA"),
        "submit": ("STOKE_CLIENT_TOKEN_FILE", "STOKE_TLS_CA"),
    }
    for component, variables in want.items():
        kind = "Job" if component == "submit" else "Deployment"
        for obj in r.of_kind(kind):
            if obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") != component:
                continue
            pod = obj["spec"]["template"]["spec"]
            c = pod["containers"][0]
            env = container_env(r, c)
            for var in variables:
                if not secret_file(pod, c, env.get(var)):
                    r.fail(f"{ident(obj)}: {var} must name a file of a mounted Secret "
                           f"(tokens and TLS are on unless the overlay is named insecure or dev)")
            if component == "worker" and env.get("STOKE_CLIENT_TOKEN_FILE"):
                r.fail(f"{ident(obj)}: workers must not hold the client token")
            if component == "coordinator":
                for probe in HEALTH_PATHS:
                    if c.get(probe, {}).get("httpGet", {}).get("scheme") != "HTTPS":
                        r.fail(f"{ident(obj)}: {probe} must use scheme HTTPS (the HTTP port is TLS)")
            if component == "submit":
                cmd = c.get("command", []) + c.get("args", [])
                url = flag_value(cmd, "--coordinator") or env.get("STOKE_COORDINATOR") or ""
                if not url.startswith("https://"):
                    r.fail(f"{ident(obj)}: submits over {url!r}, not https")


def policy(name, path):
    r = Render(name, load(path))
    overlay = name.split("/")[0]
    check_pods(r)
    check_coordinator(r)
    check_worker(r, overlay.split("-")[0])
    check_pools(r)
    check_submit(r)
    check_kinds(r)
    check_autoscaling(r)
    check_security(r, overlay)
    check_certificates(r)
    for e in r.errors:
        print(f"deploy: {name}: {e}", file=sys.stderr)
    return 1 if r.errors else 0


def same(a, b):
    def key(d):
        return (d.get("kind"), d["metadata"].get("namespace", ""), d["metadata"]["name"])

    da = {key(d): d for d in load(a)}
    db = {key(d): d for d in load(b)}
    bad = 0
    for k in sorted(set(da) | set(db), key=str):
        if da.get(k) != db.get(k):
            print(f"deploy: {'/'.join(k)} differs between {a} and {b}", file=sys.stderr)
            bad = 1
    return bad


def dockerfile_instructions(path):
    """(instruction, arguments) per logical line: comments dropped,
    continuations joined, heredocs left alone (none are used here)."""
    out, buf = [], ""
    for line in Path(path).read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfiles(folder):
    bad = 0

    def fail(msg):
        nonlocal bad
        print(f"deploy: {msg}", file=sys.stderr)
        bad = 1

    files = sorted(Path(folder).glob("*.Dockerfile"))
    if not files:
        fail(f"no *.Dockerfile in {folder}")
    for f in files:
        ins = dockerfile_instructions(f)
        args = {}
        stages, user, final_from = [], None, None
        for word, rest in ins:
            if word == "ARG" and not stages:
                k, _, v = rest.partition("=")
                args[k] = v
            elif word == "FROM":
                parts = rest.split()
                image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), parts[0])
                if len(parts) >= 3 and parts[1].upper() == "AS":
                    stages.append(parts[2])
                if image not in stages:
                    tag = image.rsplit("/", 1)[-1].partition(":")[2]
                    if "@sha256:" not in image and tag in ("", "latest"):
                        fail(f"{f.name}: base image {image} needs a fixed tag")
                final_from, user = image, None
            elif word == "USER":
                user = rest
            elif word == "COPY":
                m = re.search(r"--from=(\S+)", rest)
                if m and m.group(1) not in stages:
                    fail(f"{f.name}: COPY --from={m.group(1)} names no earlier stage")
        if len(stages) < 2:
            fail(f"{f.name}: expected a multi-stage build")
        if user is None or user.split(":")[0] in ("root", "0"):
            fail(f"{f.name}: the final stage ({final_from}) must set a non-root USER")
        if not any(w == "ENTRYPOINT" for w, _ in ins):
            fail(f"{f.name}: no ENTRYPOINT")
        ignore = f.with_name(f.name + ".dockerignore")
        if not ignore.exists():
            fail(f"{f.name}: no {ignore.name} (the build context is the whole repository)")
    return bad


def main(argv):
    if len(argv) == 4 and argv[1] == "policy":
        return policy(argv[2], argv[3])
    if len(argv) == 4 and argv[1] == "same":
        return same(argv[2], argv[3])
    if len(argv) == 3 and argv[1] == "json":
        json.dump(load(argv[2]), sys.stdout)
        sys.stdout.write("\n")
        return 0
    if len(argv) == 3 and argv[1] == "dockerfiles":
        return dockerfiles(argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
