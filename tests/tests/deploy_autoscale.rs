//! The autoscaling overlays (deploy/k8s/overlays/gpu-keda and gpu-hpa):
//! they scale the worker Deployment on the metric the coordinator serves,
//! remove workers no faster than their grace period and the
//! PodDisruptionBudget allow, and scripts/deploy_check.py refuses versions
//! that break any of that (or that no schema validates).

use std::process::Command;

use serde_json::Value;
use stoke_tests::deploy::RENDER_DEADLINE;
use stoke_tests::*;

/// The first render may install the tools (pip, npm) when the cache is cold.
fn check_deploy(args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new("bash");
    cmd.arg(repo_root().join("scripts/check-deploy.sh"))
        .args(args);
    output_within(cmd, RENDER_DEADLINE)
}

fn render(dir: &str) -> Vec<Value> {
    stoke_tests::deploy::render(dir).docs
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name}"))
}

/// deploy_check.py's rules on `docs` as the overlay `name`: the error
/// output when they refuse, `None` when they pass.
fn refusal(name: &str, docs: &[Value]) -> Option<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("render.yaml");
    // JSON documents are YAML documents.
    let body: Vec<String> = docs.iter().map(Value::to_string).collect();
    std::fs::write(&path, body.join("\n---\n")).expect("write render");
    let out = check_deploy(&["--policy", name, &path.display().to_string()]);
    (!out.status.success()).then(|| text(&out.stderr))
}

fn seconds(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not a number of seconds: {v}"))
}

#[test]
fn keda_scales_workers_to_zero_on_workers_wanted_and_removes_them_one_grace_at_a_time() {
    let docs = render("overlays/gpu-keda");
    let worker = find(&docs, "Deployment", "stoke-worker");
    let pod = &worker["spec"]["template"]["spec"];
    let pod_grace = seconds(&pod["terminationGracePeriodSeconds"]);
    let pdb = find(&docs, "PodDisruptionBudget", "stoke-worker");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    let so = find(&docs, "ScaledObject", "stoke-worker");
    let spec = &so["spec"];
    assert_eq!(spec["scaleTargetRef"]["name"], "stoke-worker");
    assert_eq!(spec["minReplicaCount"], 0, "scale to zero");
    let query = spec["triggers"][0]["metadata"]["query"]
        .as_str()
        .expect("a prometheus query");
    assert!(
        query.contains("stoke_workers_wanted") && query.contains("pool=\"gpu\""),
        "{query}"
    );
    // The CPU pool beside it, on its own pool's series, to zero as well.
    let cpu = find(&docs, "ScaledObject", "stoke-worker-cpu");
    assert_eq!(cpu["spec"]["scaleTargetRef"]["name"], "stoke-worker-cpu");
    assert_eq!(cpu["spec"]["minReplicaCount"], 0);
    let cpu_query = cpu["spec"]["triggers"][0]["metadata"]["query"]
        .as_str()
        .expect("a prometheus query");
    assert!(cpu_query.contains("pool=\"cpu\""), "{cpu_query}");
    find(&docs, "Deployment", "stoke-worker-cpu");
    find(&docs, "PodDisruptionBudget", "stoke-worker-cpu");
    let down =
        &spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"][0];
    assert_eq!(down["type"], "Pods");
    assert_eq!(down["value"], 1);
    assert!(seconds(&down["periodSeconds"]) >= pod_grace);
    assert_eq!(refusal("gpu-keda", &docs), None, "the overlay passes");

    // Each rule refuses what breaks it, naming why.
    let mutated = |f: &dyn Fn(&mut Value)| {
        let mut docs = docs.clone();
        for d in &mut docs {
            if d["kind"] == "ScaledObject" && d["metadata"]["name"] == "stoke-worker" {
                f(d);
            }
        }
        refusal("gpu-keda", &docs).expect("refused")
    };
    let e = mutated(&|d| d["spec"]["minReplicas"] = 0.into());
    assert!(
        e.contains("minReplicas") && e.contains("deploy/schemas/"),
        "{e}"
    );
    let e = mutated(&|d| d["spec"]["minReplicaCount"] = 1.into());
    assert!(e.contains("minReplicaCount must be 0"), "{e}");
    let e = mutated(&|d| {
        d["spec"]["triggers"][0]["metadata"]["query"] = "sum(up)".into();
    });
    assert!(e.contains("stoke_workers_wanted"), "{e}");
    // Another pool's series (or every pool's) would scale on the wrong work.
    let e = mutated(&|d| {
        d["spec"]["triggers"][0]["metadata"]["query"] =
            "max(stoke_workers_wanted{namespace=\"stoke\",pool=\"cpu\"})".into();
    });
    assert!(e.contains("must select pool=\"gpu\""), "{e}");
    let e = mutated(&|d| {
        d["spec"]["triggers"][0]["metadata"]["query"] =
            "max(stoke_workers_wanted{namespace=\"stoke\"})".into();
    });
    assert!(e.contains("must select pool=\"gpu\""), "{e}");
    let policy = "/spec/advanced/horizontalPodAutoscalerConfig/behavior/scaleDown/policies/0";
    let e = mutated(&|d| {
        if let Some(p) = d.pointer_mut(policy) {
            p["value"] = 3.into();
        }
    });
    assert!(e.contains("at most 1 pod"), "{e}");
    let e = mutated(&|d| {
        if let Some(p) = d.pointer_mut(policy) {
            p["periodSeconds"] = 10.into();
        }
    });
    assert!(e.contains("terminationGracePeriodSeconds"), "{e}");
    let e = mutated(&|d| d["spec"]["scaleTargetRef"]["name"] = "other".into());
    assert!(
        e.contains("must scale a worker Deployment (Deployment/stoke-worker, Deployment/stoke-worker-cpu), not other"),
        "{e}"
    );
    // Each pool is one Deployment serving a pool the coordinator serves.
    let mut stray = docs.clone();
    for d in &mut stray {
        if d["kind"] == "Deployment" && d["metadata"]["name"] == "stoke-worker-cpu" {
            for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
                .as_array_mut()
                .expect("env")
            {
                if e["name"] == "STOKE_POOL" {
                    e["value"] = "tpu".into();
                }
            }
        }
    }
    let e = refusal("gpu-keda", &stray).expect("refused");
    assert!(
        e.contains("serves the pool 'tpu', which the coordinator does not"),
        "{e}"
    );
    // A kind nothing validates is refused too.
    let mut extra = docs.clone();
    extra.push(serde_json::json!({
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": "w"},
    }));
    let e = refusal("gpu-keda", &extra).expect("refused");
    assert!(e.contains("no schema validates"), "{e}");
}

#[test]
fn the_hpa_fallback_reads_the_same_signal_the_coordinator_serves() {
    let docs = render("overlays/gpu-hpa");
    let hpa = find(&docs, "HorizontalPodAutoscaler", "stoke-worker");
    assert_eq!(hpa["apiVersion"], "autoscaling/v2");
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], "stoke-worker");
    let metric = &hpa["spec"]["metrics"][0]["external"];
    assert_eq!(metric["metric"]["name"], "stoke_workers_wanted");
    assert_eq!(metric["metric"]["selector"]["matchLabels"]["pool"], "gpu");
    assert_eq!(metric["target"]["type"], "AverageValue");
    assert_eq!(refusal("gpu-hpa", &docs), None, "the overlay passes");
    let mut fast = docs.clone();
    for d in &mut fast {
        if d["kind"] == "HorizontalPodAutoscaler" {
            d["spec"]["behavior"]["scaleDown"]["policies"][0]["type"] = "Percent".into();
        }
    }
    let e = refusal("gpu-hpa", &fast).expect("refused");
    assert!(e.contains("at most 1 pod"), "{e}");

    // The metric both autoscalers read is what the coordinator serves:
    // zero with nothing to do.
    let tmp = tempfile::tempdir().expect("tempdir");
    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    let (code, body) = http_get(&coordinator.http_addr, "/metrics").expect("metrics");
    assert_eq!(code, 200);
    assert!(
        body.lines()
            .any(|l| l == "stoke_workers_wanted{pool=\"default\"} 0"),
        "{body}"
    );
}
