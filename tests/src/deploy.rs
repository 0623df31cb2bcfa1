//! Rendering deploy/k8s with the project's pinned kustomize and running
//! what the pods would run: each container's command line and environment
//! as the kubelet builds them (ConfigMaps, Secrets and the downward API
//! resolved), and the checks the deploy tests make of them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

use crate::{DEADLINE, bin, output_within, repo_root, text};

/// The first render installs the tools (pip, npm) when the cache is cold.
pub const RENDER_DEADLINE: Duration = Duration::from_secs(600);

/// The worker must be done this long before the kubelet's SIGKILL (the same
/// margin scripts/deploy_check.py enforces).
pub const GRACE_MARGIN: Duration = Duration::from_secs(5);

/// A kustomization under deploy/k8s, rendered.
pub struct Rendered {
    pub name: String,
    pub docs: Vec<Value>,
}

pub fn render(dir: &str) -> Rendered {
    let mut cmd = Command::new("bash");
    cmd.arg(repo_root().join("scripts/check-deploy.sh"))
        .arg("--render-json")
        .arg(format!("deploy/k8s/{dir}"));
    let out = output_within(cmd, RENDER_DEADLINE);
    assert!(
        out.status.success(),
        "rendering deploy/k8s/{dir}: {}",
        text(&out.stderr)
    );
    let docs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("rendered JSON");
    assert!(!docs.is_empty(), "deploy/k8s/{dir} renders nothing");
    Rendered {
        name: dir.to_string(),
        docs,
    }
}

impl Rendered {
    pub fn named(&self, kind: &str, name: &str) -> Option<&Value> {
        self.docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
    }

    /// The object of `kind` labelled app.kubernetes.io/component=`component`.
    pub fn component(&self, kind: &str, component: &str) -> &Value {
        self.docs
            .iter()
            .find(|d| {
                d["kind"] == kind
                    && d["metadata"]["labels"]["app.kubernetes.io/component"] == component
            })
            .unwrap_or_else(|| panic!("{}: no {kind} for the {component}", self.name))
    }
}

pub fn str_list(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().expect("a string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The Secrets the user creates for the secure overlays, as files: one
/// folder per Secret, one file per key (what a mount of it holds).
pub fn user_secrets() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("stoke-deploy-secrets-")
            .tempdir()
            .expect("tempdir")
            .keep();
        let tokens = dir.join("stoke-tokens");
        let tls = dir.join("stoke-tls");
        std::fs::create_dir_all(&tokens).expect("tokens dir");
        std::fs::create_dir_all(&tls).expect("tls dir");
        std::fs::write(
            tokens.join("client.token"),
            "deploy-test-client-token-5f1c9a\n",
        )
        .expect("client token");
        std::fs::write(
            tokens.join("worker.token"),
            "deploy-test-worker-token-8e2b4d\n",
        )
        .expect("worker token");
        let ca = crate::tls::TestCa::new(&dir, "deploy");
        let server = ca.server();
        for (from, to) in [
            (&server.cert, "tls.crt"),
            (&server.key, "tls.key"),
            (&ca.cert, "ca.crt"),
        ] {
            std::fs::copy(from, tls.join(to)).expect("copying TLS material");
        }
        dir
    })
}

/// The pod name the downward API gives a worker (metadata.name).
pub const POD_NAME: &str = "stoke-worker-5d8f7c9b6-x2x7k";
pub const NODE_NAME: &str = "gpu-node-1";

/// What one container would run: its command line and environment, as the
/// kubelet builds them (envFrom first, then env, which wins).
#[derive(Debug, Clone)]
pub struct PodLaunch {
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
}

impl PodLaunch {
    pub fn of(r: &Rendered, workload: &Value, container: &str, pod_name: &str) -> Self {
        let pod = &workload["spec"]["template"]["spec"];
        let c = pod["containers"]
            .as_array()
            .expect("containers")
            .iter()
            .find(|c| c["name"] == container)
            .unwrap_or_else(|| panic!("{}: no container {container}", r.name));
        let mut env = BTreeMap::new();
        for src in c["envFrom"].as_array().into_iter().flatten() {
            if let Some(reference) = src.get("configMapRef") {
                env.extend(config_data(r, "ConfigMap", reference));
            }
            if let Some(reference) = src.get("secretRef") {
                env.extend(config_data(r, "Secret", reference));
            }
        }
        for e in c["env"].as_array().into_iter().flatten() {
            let name = e["name"].as_str().expect("env name").to_string();
            let value = if let Some(v) = e["value"].as_str() {
                v.to_string()
            } else if let Some(field) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                match field {
                    "metadata.name" => pod_name.to_string(),
                    "spec.nodeName" => NODE_NAME.to_string(),
                    "metadata.namespace" => "stoke".to_string(),
                    other => panic!("{}: {name} from fieldRef {other} is not simulated", r.name),
                }
            } else if let Some(reference) = e["valueFrom"].get("configMapKeyRef") {
                key_of(r, "ConfigMap", reference)
            } else if let Some(reference) = e["valueFrom"].get("secretKeyRef") {
                key_of(r, "Secret", reference)
            } else {
                panic!("{}: env {name}: {e} is not simulated", r.name)
            };
            env.insert(name, value);
        }
        // A file under a Secret's mount is that Secret's key, made here.
        let volumes = pod["volumes"].as_array().cloned().unwrap_or_default();
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let Some(secret) = volumes
                .iter()
                .find(|v| v["name"] == m["name"])
                .and_then(|v| v["secret"]["secretName"].as_str())
            else {
                continue;
            };
            let mount = format!("{}/", m["mountPath"].as_str().expect("mountPath"));
            let local = user_secrets().join(secret);
            for value in env.values_mut() {
                if let Some(file) = value.strip_prefix(&mount) {
                    *value = local.join(file).display().to_string();
                }
            }
        }
        let command = str_list(&c["command"]);
        let args = str_list(&c["args"]);
        for a in command.iter().chain(&args) {
            assert!(
                !a.contains("$("),
                "{}: {a}: $(VAR) expansion is not simulated",
                r.name
            );
        }
        Self { command, args, env }
    }

    pub fn var(&self, name: &str) -> &str {
        self.env
            .get(name)
            .unwrap_or_else(|| panic!("the manifest sets no {name}: {:?}", self.env))
    }

    /// The value of `--flag=value` or `--flag value` in the command line.
    pub fn flag(&self, flag: &str) -> Option<String> {
        let all: Vec<&String> = self.command.iter().chain(&self.args).collect();
        let prefix = format!("{flag}=");
        for (i, a) in all.iter().enumerate() {
            if let Some(v) = a.strip_prefix(&prefix) {
                return Some(v.to_string());
            }
            if a.as_str() == flag {
                return all.get(i + 1).map(|s| s.to_string());
            }
        }
        None
    }

    /// The args without `--flag=value` / `--flag value`.
    pub fn args_without(&self, flags: &[&str]) -> Vec<String> {
        let mut out = Vec::new();
        let mut skip = false;
        for a in &self.args {
            if skip {
                skip = false;
                continue;
            }
            if flags.iter().any(|f| a.starts_with(&format!("{f}="))) {
                continue;
            }
            if flags.contains(&a.as_str()) {
                skip = true;
                continue;
            }
            out.push(a.clone());
        }
        out
    }

    /// A command for `binary` (from the target folder) with exactly this
    /// environment (plus PATH), as in the container.
    pub fn command_for(&self, binary: &str, args: &[String]) -> Command {
        let mut cmd = Command::new(bin(binary));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(&self.env)
            .args(args);
        cmd
    }
}

/// Every key of a ConfigMap or Secret an envFrom names. A Secret the user
/// creates (not in the render) must be referenced as optional.
pub fn config_data(r: &Rendered, kind: &str, reference: &Value) -> BTreeMap<String, String> {
    let name = reference["name"].as_str().expect("ref name");
    let Some(obj) = r.named(kind, name) else {
        assert_eq!(
            reference["optional"], true,
            "{}: {kind} {name} is neither rendered nor optional",
            r.name
        );
        return BTreeMap::new();
    };
    obj["data"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            let v = v.as_str().expect("a string value");
            let v = if kind == "Secret" {
                base64_decode(v)
            } else {
                v.to_string()
            };
            (k.clone(), v)
        })
        .collect()
}

pub fn key_of(r: &Rendered, kind: &str, reference: &Value) -> String {
    let key = reference["key"].as_str().expect("ref key");
    config_data(r, kind, reference)
        .remove(key)
        .unwrap_or_else(|| panic!("{}: {kind} {} has no {key}", r.name, reference["name"]))
}

/// Secret data is base64 (standard alphabet, padded).
pub fn base64_decode(s: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes().filter(|&c| c != b'=') {
        let v = ALPHABET
            .iter()
            .position(|&a| a == c)
            .unwrap_or_else(|| panic!("not base64: {s}")) as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    String::from_utf8(out).expect("utf-8 secret")
}

/// Runs a binary with `--check-config`; the resolved configuration (JSON)
/// or the refusal.
pub fn check_config(launch: &PodLaunch, binary: &str, extra_env: &[(&str, &str)]) -> Output {
    let mut args = launch.args.clone();
    args.push("--check-config".to_string());
    let mut cmd = launch.command_for(binary, &args);
    cmd.envs(extra_env.iter().copied());
    output_within(cmd, DEADLINE)
}

pub fn accepted(launch: &PodLaunch, binary: &str, what: &str) -> Value {
    let out = check_config(launch, binary, &[]);
    assert!(
        out.status.success(),
        "{what}: {binary} --check-config refused the manifest's configuration \
         (exit {:?})\nargs: {:?}\nenv: {:?}\n{}{}",
        out.status.code(),
        launch.args,
        launch.env,
        text(&out.stdout),
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{what}: {binary} --check-config printed no JSON ({e}): {}",
            text(&out.stdout)
        )
    })
}

/// Every string in a JSON value.
pub fn strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(o) => o.values().for_each(|x| strings(x, out)),
        _ => {}
    }
}

pub fn mentions(resolved: &Value, pred: impl Fn(&str) -> bool) -> bool {
    let mut all = Vec::new();
    strings(resolved, &mut all);
    all.iter().any(|s| pred(s))
}

/// A container port by name.
pub fn container_port(container: &Value, name: &str) -> u16 {
    container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {name}")) as u16
}

pub fn first_container(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]["containers"][0]
}

pub fn duration(text: &str) -> Duration {
    humantime::parse_duration(text).unwrap_or_else(|e| panic!("{text:?}: {e}"))
}

/// The coordinator's Deployment and Service agree with what the binary
/// does; returns how it is launched.
pub fn check_coordinator(r: &Rendered) -> PodLaunch {
    let dep = r.component("Deployment", "coordinator");
    assert_eq!(dep["spec"]["replicas"], 1, "{}: one coordinator", r.name);
    assert_eq!(dep["spec"]["strategy"]["type"], "Recreate", "{}", r.name);
    let launch = PodLaunch::of(r, dep, "coordinator", "stoke-coordinator-7c9d8-abcde");
    let c = first_container(dep);
    let grpc = container_port(c, "grpc");
    let http = container_port(c, "http");
    let resolved = accepted(&launch, "stoke-coordinator", &r.name);
    for (port, what) in [(grpc, "gRPC"), (http, "HTTP")] {
        assert!(
            mentions(&resolved, |s| s.ends_with(&format!(":{port}"))),
            "{}: the coordinator's resolved configuration does not listen for {what} on container port {port}: {resolved}",
            r.name
        );
    }
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], path, "{}: {probe}", r.name);
        assert!(
            get["port"] == "http" || get["port"] == http,
            "{}: {probe} is not on the HTTP port",
            r.name
        );
    }
    let svc = r
        .named("Service", "stoke-coordinator")
        .unwrap_or_else(|| panic!("{}: no Service stoke-coordinator", r.name));
    let ports: Vec<(u64, Value)> = svc["spec"]["ports"]
        .as_array()
        .expect("service ports")
        .iter()
        .map(|p| (p["port"].as_u64().expect("port"), p["targetPort"].clone()))
        .collect();
    for (name, number) in [("grpc", grpc), ("http", http)] {
        assert!(
            ports
                .iter()
                .any(|(_, t)| *t == name || *t == u64::from(number)),
            "{}: the Service does not forward to the {name} port: {ports:?}",
            r.name
        );
    }
    launch
}

/// The (GPU) workers' Deployment: accepted configuration, grace periods,
/// the coordinator's address; returns how a worker is launched.
pub fn check_worker(r: &Rendered) -> (PodLaunch, Duration, Duration) {
    check_worker_of(r, "worker")
}

/// [`check_worker`] for the worker Deployment of `component` (`worker`,
/// `worker-cpu`).
pub fn check_worker_of(r: &Rendered, component: &str) -> (PodLaunch, Duration, Duration) {
    let dep = r.component("Deployment", component);
    let launch = PodLaunch::of(r, dep, "worker", POD_NAME);
    assert!(
        launch.command.is_empty(),
        "{}: the worker runs the image's entrypoint (stoke-worker)",
        r.name
    );
    let resolved = accepted(&launch, "stoke-worker", &r.name);
    assert!(
        mentions(&resolved, |s| s == POD_NAME),
        "{}: the worker id is not the pod's name: {resolved}",
        r.name
    );
    let pod_grace = Duration::from_secs(
        dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap_or(30),
    );
    let grace = duration(
        &launch
            .flag("--grace-period")
            .unwrap_or_else(|| launch.var("STOKE_GRACE_PERIOD").to_string()),
    );
    assert!(
        grace + GRACE_MARGIN <= pod_grace,
        "{}: STOKE_GRACE_PERIOD {grace:?} must end {GRACE_MARGIN:?} before terminationGracePeriodSeconds {pod_grace:?}",
        r.name
    );
    let svc = r
        .named("Service", "stoke-coordinator")
        .expect("coordinator Service");
    let grpc = svc["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "grpc")
        .and_then(|p| p["port"].as_u64())
        .expect("grpc port");
    // https when the overlay turns TLS on (the worker trusts a CA).
    let scheme = if launch.env.contains_key("STOKE_TLS_CA") {
        "https"
    } else {
        "http"
    };
    assert_eq!(
        launch.var("STOKE_COORDINATOR"),
        format!("{scheme}://stoke-coordinator:{grpc}"),
        "{}: workers must reach the coordinator's Service",
        r.name
    );
    (launch, grace, pod_grace)
}

/// The submit Job: its spec parses, it runs `stoke submit` at the Service.
pub fn check_submit(r: &Rendered) -> (PodLaunch, String) {
    let job = r.component("Job", "submit");
    let launch = PodLaunch::of(r, job, "submit", "stoke-submit-digits-q8x2d");
    assert_eq!(launch.command, ["stoke"], "{}", r.name);
    assert_eq!(launch.args.iter().filter(|a| *a == "submit").count(), 1);
    let scheme = if launch.env.contains_key("STOKE_TLS_CA") {
        "https"
    } else {
        "http"
    };
    assert_eq!(
        launch.flag("--coordinator"),
        Some(format!("{scheme}://stoke-coordinator:7070")),
        "{}",
        r.name
    );
    assert!(
        launch.flag("--job-id").is_some(),
        "{}: a fixed job id",
        r.name
    );
    // The spec file is in a mounted ConfigMap; it must be a valid spec.
    let pod = &job["spec"]["template"]["spec"];
    let mount = &first_container(job)["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["name"] == "spec")
        .expect("the spec volume")["mountPath"];
    let mount = mount.as_str().expect("mountPath");
    let spec_arg = launch
        .args
        .iter()
        .find(|a| a.starts_with(mount))
        .unwrap_or_else(|| panic!("{}: no spec file under {mount} in the args", r.name))
        .clone();
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "spec")
        .expect("spec volume");
    let cm = r
        .named(
            "ConfigMap",
            volume["configMap"]["name"].as_str().expect("configMap"),
        )
        .expect("the spec ConfigMap is rendered");
    let file = spec_arg
        .trim_start_matches(mount)
        .trim_start_matches('/')
        .to_string();
    let toml = cm["data"][&file]
        .as_str()
        .unwrap_or_else(|| panic!("{}: the ConfigMap has no {file}", r.name));
    stoke::JobSpec::from_toml(toml)
        .unwrap_or_else(|e| panic!("{}: the example spec {file} is refused: {e}", r.name));
    (launch, spec_arg)
}
