//! Embedded mode through the library API: `torch_batch_process::<P>` runs
//! a job in this process (same state machine and pipeline, no gRPC).

use stoke::{EmbeddedOptions, JobSpec, StoreUri, TorchScriptProcessor};
use stoke_tests::*;

#[test]
fn torch_batch_process_in_one_process_matches_the_model() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = JobSpec::from_toml(&fixture_spec("parquet", "")).expect("spec");
    let root = tmp.path().join("root");
    let mut options = EmbeddedOptions::new(StoreUri::from_local_path(&root).expect("uri"));
    options.device = stoke::tch::Device::Cpu;
    options.threads = Some(1);
    options.job_id = Some("embedded-1".to_string());
    let report = stoke::torch_batch_process::<TorchScriptProcessor>(spec.clone(), options.clone())
        .expect("job");
    assert_eq!(report.job.state, stoke::JobState::Succeeded);
    assert_eq!(report.manifest.records_in, 3000);
    assert_matches_reference(&committed_rows(&report.manifest));

    // Running the same job id again finds it finished: same manifest, no rework.
    let again = stoke::torch_batch_process::<TorchScriptProcessor>(spec, options).expect("job");
    assert_eq!(again.manifest.outputs, report.manifest.outputs);
}
