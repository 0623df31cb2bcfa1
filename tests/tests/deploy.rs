//! deploy/ against the code. The Kubernetes manifests are rendered with the
//! project's pinned kustomize (`scripts/check-deploy.sh --render-json`), and
//! what the pods would run is run here:
//!
//! - every container of ours starts its binary with the manifest's args and
//!   environment (ConfigMaps, Secrets and the downward API resolved as the
//!   kubelet would) and `--check-config`, which refuses unknown flags,
//!   unknown `STOKE_*` variables and bad values; ports, probe paths and
//!   grace periods agree with what the binaries do;
//! - a preempted node: a coordinator and a worker configured as in the gpu
//!   overlay, the job submitted with the submit Job's own command line, the
//!   worker SIGTERMed (what the kubelet does on eviction or spot reclaim)
//!   after its first commits; it must checkpoint and exit 0 within its
//!   configured grace, and a replacement pod's worker finishes the job with
//!   every record exactly once.
//!
//! The gpu overlay runs with tokens and TLS (components/secure): the
//! Secrets it mounts (stoke-tokens, stoke-tls) are made here, tokens and a
//! throwaway CA with a certificate for 127.0.0.1, and each file path under
//! a Secret's mount is pointed at them, as the kubelet's mount would.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;
use stoke_tests::*;

/// The first render installs the tools (pip, npm) when the cache is cold.
const RENDER_DEADLINE: Duration = Duration::from_secs(600);

/// The worker must be done this long before the kubelet's SIGKILL (the same
/// margin scripts/deploy_check.py enforces).
const GRACE_MARGIN: Duration = Duration::from_secs(5);

/// A kustomization under deploy/k8s, rendered.
struct Rendered {
    name: String,
    docs: Vec<Value>,
}

fn render(dir: &str) -> Rendered {
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
    fn named(&self, kind: &str, name: &str) -> Option<&Value> {
        self.docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
    }

    /// The object of `kind` labelled app.kubernetes.io/component=`component`.
    fn component(&self, kind: &str, component: &str) -> &Value {
        self.docs
            .iter()
            .find(|d| {
                d["kind"] == kind
                    && d["metadata"]["labels"]["app.kubernetes.io/component"] == component
            })
            .unwrap_or_else(|| panic!("{}: no {kind} for the {component}", self.name))
    }
}

fn str_list(v: &Value) -> Vec<String> {
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
fn user_secrets() -> &'static Path {
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
        let ca = stoke_tests::tls::TestCa::new(&dir, "deploy");
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
const POD_NAME: &str = "stoke-worker-5d8f7c9b6-x2x7k";
const NODE_NAME: &str = "gpu-node-1";

/// What one container would run: its command line and environment, as the
/// kubelet builds them (envFrom first, then env, which wins).
#[derive(Debug, Clone)]
struct Launch {
    command: Vec<String>,
    args: Vec<String>,
    env: BTreeMap<String, String>,
}

impl Launch {
    fn of(r: &Rendered, workload: &Value, container: &str, pod_name: &str) -> Self {
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

    fn var(&self, name: &str) -> &str {
        self.env
            .get(name)
            .unwrap_or_else(|| panic!("the manifest sets no {name}: {:?}", self.env))
    }

    /// The value of `--flag=value` or `--flag value` in the command line.
    fn flag(&self, flag: &str) -> Option<String> {
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
    fn args_without(&self, flags: &[&str]) -> Vec<String> {
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
    fn command_for(&self, binary: &str, args: &[String]) -> Command {
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
fn config_data(r: &Rendered, kind: &str, reference: &Value) -> BTreeMap<String, String> {
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

fn key_of(r: &Rendered, kind: &str, reference: &Value) -> String {
    let key = reference["key"].as_str().expect("ref key");
    config_data(r, kind, reference)
        .remove(key)
        .unwrap_or_else(|| panic!("{}: {kind} {} has no {key}", r.name, reference["name"]))
}

/// Secret data is base64 (standard alphabet, padded).
fn base64_decode(s: &str) -> String {
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
fn check_config(launch: &Launch, binary: &str, extra_env: &[(&str, &str)]) -> Output {
    let mut args = launch.args.clone();
    args.push("--check-config".to_string());
    let mut cmd = launch.command_for(binary, &args);
    cmd.envs(extra_env.iter().copied());
    output_within(cmd, DEADLINE)
}

fn accepted(launch: &Launch, binary: &str, what: &str) -> Value {
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
fn strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(o) => o.values().for_each(|x| strings(x, out)),
        _ => {}
    }
}

fn mentions(resolved: &Value, pred: impl Fn(&str) -> bool) -> bool {
    let mut all = Vec::new();
    strings(resolved, &mut all);
    all.iter().any(|s| pred(s))
}

/// A container port by name.
fn container_port(container: &Value, name: &str) -> u16 {
    container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {name}")) as u16
}

fn first_container(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]["containers"][0]
}

fn duration(text: &str) -> Duration {
    humantime::parse_duration(text).unwrap_or_else(|e| panic!("{text:?}: {e}"))
}

/// The coordinator's Deployment and Service agree with what the binary
/// does; returns how it is launched.
fn check_coordinator(r: &Rendered) -> Launch {
    let dep = r.component("Deployment", "coordinator");
    assert_eq!(dep["spec"]["replicas"], 1, "{}: one coordinator", r.name);
    assert_eq!(dep["spec"]["strategy"]["type"], "Recreate", "{}", r.name);
    let launch = Launch::of(r, dep, "coordinator", "stoke-coordinator-7c9d8-abcde");
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

/// The workers' Deployment: accepted configuration, grace periods, the
/// coordinator's address; returns how a worker is launched.
fn check_worker(r: &Rendered) -> (Launch, Duration, Duration) {
    let dep = r.component("Deployment", "worker");
    let launch = Launch::of(r, dep, "worker", POD_NAME);
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
fn check_submit(r: &Rendered) -> (Launch, String) {
    let job = r.component("Job", "submit");
    let launch = Launch::of(r, job, "submit", "stoke-submit-digits-q8x2d");
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

#[test]
fn the_manifests_configure_the_binaries_with_flags_and_variables_they_accept() {
    for overlay in ["overlays/gpu", "overlays/cpu-dev"] {
        let r = render(overlay);
        let coordinator = check_coordinator(&r);
        let (worker, _, _) = check_worker(&r);
        println!(
            "{overlay}: coordinator {:?} {:?}; worker {:?}",
            coordinator.args, coordinator.env, worker.env
        );

        // --check-config is not a rubber stamp: a misspelt variable and a
        // bad value are refused, naming the variable or its flag.
        for (launch, binary, var, value, flag) in [
            (&worker, "stoke-worker", "STOKE_GRACE_PERIDO", "50s", "-"),
            (
                &worker,
                "stoke-worker",
                "STOKE_GRACE_PERIOD",
                "soon",
                "--grace-period",
            ),
            (
                &coordinator,
                "stoke-coordinator",
                "STOKE_LEASE_TIMOUT",
                "60s",
                "-",
            ),
            (
                &coordinator,
                "stoke-coordinator",
                "STOKE_LEASE_TIMEOUT",
                "soon",
                "--lease-timeout",
            ),
        ] {
            let out = check_config(launch, binary, &[(var, value)]);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{binary} --check-config accepted {var}={value}: {}{}",
                text(&out.stdout),
                text(&out.stderr)
            );
            let err = text(&out.stderr);
            assert!(
                err.contains(var) || err.contains(flag),
                "{binary}: the error names neither {var} nor {flag}: {err}"
            );
        }
    }
    let gpu = render("overlays/gpu/submit");
    let dev = render("overlays/cpu-dev/submit");
    let (a, _) = check_submit(&gpu);
    let (b, _) = check_submit(&dev);
    // The same way, over https with the client token in gpu (secure),
    // plain in cpu-dev (a dev overlay).
    assert_eq!(
        a.args_without(&["--coordinator"]),
        b.args_without(&["--coordinator"]),
        "both overlays submit the same way"
    );
    assert!(a.env.contains_key("STOKE_CLIENT_TOKEN_FILE"), "{:?}", a.env);
    assert!(
        !b.env.contains_key("STOKE_CLIENT_TOKEN_FILE"),
        "{:?}",
        b.env
    );
}

/// Whether a plain-text GET to a TLS address gets no HTTP answer.
fn plain_refused(https_addr: &str) -> bool {
    let addr = https_addr
        .strip_prefix("https://")
        .unwrap_or_else(|| panic!("{https_addr} is not https"));
    assert!(addr.parse::<std::net::SocketAddr>().is_ok(), "{addr}");
    http_status(addr, "/healthz").is_none()
}

/// GET over plain HTTP/1.1; the status code, if anything answered.
fn http_status(addr: &str, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    text(&buf).split_whitespace().nth(1)?.parse().ok()
}

/// One shard of 3,000 single-record batches, a checkpoint every 7: long
/// enough to preempt in the middle (as tests/tests/preemption.rs).
fn long_shard_spec() -> String {
    fixture_spec_in("parquet", "long", "")
        .replace("batch_size = 50", "batch_size = 1")
        .replace("interval = 3", "interval = 7")
        .replace("records = 400", "records = 3000")
}

/// The `next_batch` of every lease of shard s00000 in a worker's log.
fn lease_next_batch(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("lease taken") && l.contains("shard=s00000"))
        .filter_map(|l| {
            l.split("next_batch=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// A worker pod of the gpu overlay on this machine: the manifest's args and
/// environment; only what points outside the pod is replaced (the
/// coordinator's address, and the pod's /scratch and /tmp).
fn worker_pod(launch: &Launch, coordinator: &str, pod: &str, dir: &Path) -> Proc {
    let mut pod_launch = launch.clone();
    let env = &mut pod_launch.env;
    env.insert("STOKE_COORDINATOR".into(), coordinator.to_string());
    env.insert("STOKE_WORKER_ID".into(), pod.to_string());
    let scratch = dir.join(format!("{pod}-scratch"));
    let home = dir.join(format!("{pod}-tmp"));
    std::fs::create_dir_all(&scratch).expect("scratch");
    std::fs::create_dir_all(&home).expect("home");
    assert_eq!(
        env.get("STOKE_SCRATCH_DIR").map(String::as_str),
        Some("/scratch")
    );
    env.insert("STOKE_SCRATCH_DIR".into(), scratch.display().to_string());
    env.insert("HOME".into(), home.display().to_string());
    let cmd = pod_launch.command_for("stoke-worker", &pod_launch.args);
    Proc::spawn(pod, cmd, dir)
}

#[test]
fn an_evicted_worker_checkpoints_within_its_grace_and_a_replacement_finishes_the_job() {
    let gpu = render("overlays/gpu");
    let submit = render("overlays/gpu/submit");
    let coordinator_launch = check_coordinator(&gpu);
    let (worker_launch, grace, pod_grace) = check_worker(&gpu);
    let (submit_launch, spec_arg) = check_submit(&submit);

    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");

    // The coordinator with the manifest's configuration; it listens on
    // loopback instead of 0.0.0.0, its state under a file:// root.
    // (The harness adds --listen, --http-listen, --root and the address
    // files; the manifest's listen flags give way to them.)
    let extra = coordinator_launch.args_without(&["--listen", "--http-listen"]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let env: Vec<(&str, &str)> = coordinator_launch
        .env
        .iter()
        .filter(|(k, _)| k.as_str() != "STOKE_ROOT")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    // What this test's own calls (the CLI, /readyz) need with tokens and
    // TLS on: the client token and the CA, as the submit Job has them.
    let client_env: Vec<(String, String)> = ["STOKE_CLIENT_TOKEN_FILE", "STOKE_TLS_CA"]
        .iter()
        .filter_map(|k| Some((k.to_string(), submit_launch.env.get(*k)?.clone())))
        .collect();
    assert_eq!(
        client_env.len(),
        2,
        "the gpu overlay runs with a client token and TLS"
    );
    let mut coordinator = Coordinator::start_on(
        &root.display().to_string(),
        tmp.path(),
        &extra,
        &env,
        client_env.clone(),
    );
    assert!(
        coordinator.addr.starts_with("https://"),
        "{}",
        coordinator.addr
    );

    // The probes the kubelet would send: no token, no certificate check
    // (the CA here only lets this client speak TLS).
    let ca = PathBuf::from(&client_env[1].1);
    let probe = |path: &str, auth: Option<&str>| {
        stoke_tests::tls::http_request(
            &coordinator.http_addr,
            path,
            auth,
            Some(&ca),
            Duration::from_secs(5),
        )
        .map(|(code, _)| code)
    };
    wait_until("/healthz to answer 200", DEADLINE, || {
        (probe("/healthz", None) == Some(200)).then_some(())
    });
    wait_until("/readyz to answer 200 without a token", DEADLINE, || {
        (probe("/readyz", None) == Some(200)).then_some(())
    });
    assert_eq!(probe("/metrics", None), Some(401), "metrics need the token");
    let token = std::fs::read_to_string(&client_env[0].1).expect("client token");
    let bearer = format!("Bearer {}", token.trim());
    assert_eq!(probe("/metrics", Some(&bearer)), Some(200));
    assert!(
        plain_refused(&coordinator.http_addr),
        "the HTTP port must not answer plain text"
    );

    // The submit Job's command line, with this test's spec and address.
    let spec = tmp.path().join("job.toml");
    std::fs::write(&spec, long_shard_spec()).expect("write spec");
    let args: Vec<String> = submit_launch
        .args
        .iter()
        .map(|a| {
            if *a == spec_arg {
                spec.display().to_string()
            } else if a.starts_with("--coordinator=") {
                format!("--coordinator={}", coordinator.addr)
            } else {
                a.clone()
            }
        })
        .collect();
    let mut submitter = Proc::spawn(
        "submit",
        submit_launch.command_for("stoke", &args),
        tmp.path(),
    );
    let job_id = wait_until("the job to be submitted", DEADLINE, || {
        let log = submitter.log_text();
        let line = log.lines().find(|l| l.starts_with("submitted job "))?;
        Some(
            line.split_whitespace()
                .nth(2)?
                .trim_end_matches(':')
                .to_string(),
        )
    });
    assert_eq!(
        Some(job_id.clone()),
        submit_launch.flag("--job-id"),
        "the job keeps the Job's --job-id"
    );

    // A worker pod takes the shard and commits.
    let mut first = worker_pod(&worker_launch, &coordinator.addr, POD_NAME, tmp.path());
    wait_until("the first commits", DEADLINE, || {
        progress(&root, &job_id, "s00000").filter(|p| p.next_batch >= 14)
    });

    // Eviction: SIGTERM, and SIGKILL after terminationGracePeriodSeconds.
    signal(first.pid(), libc::SIGTERM);
    let sent = Instant::now();
    let status = first.wait_exit(pod_grace);
    let took = sent.elapsed();
    println!("SIGTERM to exit: {took:?} (worker grace {grace:?}, pod grace {pod_grace:?})");
    assert!(
        status.success(),
        "exit status {status}: {}",
        first.log_text()
    );
    assert!(
        took < grace,
        "the worker took {took:?}, past its grace period {grace:?}"
    );
    let log = first.log_text();
    assert!(log.contains("checkpointed; releasing lease"), "{log}");
    let stopped_at = progress(&root, &job_id, "s00000").expect("progress");
    assert!(!stopped_at.done, "the shard finished before the SIGTERM");
    assert_eq!(coordinator.status(&job_id)["shards_leased"], 0);

    // The replacement pod (a new name, so a new session) finishes the job
    // from the checkpoint; the submit Job completes.
    let mut second = worker_pod(
        &worker_launch,
        &coordinator.addr,
        "stoke-worker-5d8f7c9b6-q4m9z",
        tmp.path(),
    );
    let done = coordinator.wait_job(&job_id);
    assert_eq!(done["state"], "succeeded", "{done}");
    let exit = submitter.wait_exit(DEADLINE);
    assert!(
        exit.success(),
        "stoke submit --wait: {exit}: {}",
        submitter.log_text()
    );
    assert_eq!(
        lease_next_batch(&second.log_text()),
        vec![stopped_at.next_batch],
        "the replacement continues from the checkpoint"
    );
    assert_matches_reference(&committed_rows(&manifest(&root, &job_id)));

    // Scaling down: an idle worker leaves at once, and so does the
    // coordinator (its pod's grace is the default 30s).
    signal(second.pid(), libc::SIGTERM);
    assert!(second.wait_exit(grace).success(), "{}", second.log_text());
    signal(coordinator.proc.pid(), libc::SIGTERM);
    let exit = coordinator.proc.wait_exit(Duration::from_secs(30));
    assert!(
        exit.success(),
        "coordinator: {exit}: {}",
        coordinator.proc.log_text()
    );
}
