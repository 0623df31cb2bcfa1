//! In-process tests (the layer between state-machine tests and process
//! tests): the real coordinator (`stoke_coordinator::run` on a port-0
//! listener) and real workers (`stoke_worker::run` over gRPC) in this one
//! test process, a job submitted with the real client. They cover the gRPC
//! services, the worker's gRPC link and the pipeline with a plain
//! `cargo test`, in seconds.

use std::collections::BTreeMap;
use std::time::Duration;

use stoke::tch::Kind;
use stoke::{
    Batch, Client, JobSpec, JobState, Manifest, ProcessorContext, ProcessorResult, Registry,
    StoreUri, Stores, TorchBatchProcessor,
};
use stoke_coordinator::CoordinatorConfig;
use stoke_core::layout::RootLayout;
use stoke_core::security::ClientSecurity;
use stoke_worker::{GrpcLink, WorkerConfig, WorkerExit};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Every record's id doubled, computed with libtorch.
struct Double;

impl TorchBatchProcessor for Double {
    fn new(_ctx: &mut ProcessorContext) -> ProcessorResult<Self> {
        Ok(Self)
    }

    fn process_batch(
        &mut self,
        batch: Batch,
        _batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        let x = batch.tensor("id")?.to_kind(Kind::Int64);
        let doubled = &x * 2;
        ctx.write_columns(&batch, [("doubled", &doubled)])?;
        Ok(())
    }
}

const RECORDS: u64 = 1_000;

fn spec() -> JobSpec {
    JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = {RECORDS}\n\
         [processor]\nname = \"double\"\n\
         [batching]\nbatch_size = 50\n\
         [sharding]\nrecords = 100\n\
         [checkpoint]\ninterval = 1\n"
    ))
    .expect("spec")
}

/// Reads every output object the manifest lists: id -> doubled.
async fn outputs(stores: &Stores, manifest: &Manifest) -> BTreeMap<String, i64> {
    use stoke::arrow_array::cast::AsArray;
    use stoke::arrow_array::types::Int64Type;
    let mut rows = BTreeMap::new();
    for entry in &manifest.outputs {
        let uri = StoreUri::parse(&entry.object.uri).expect("output uri");
        let bytes = stores.get(&uri).await.expect("read output");
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes)
            .expect("parquet")
            .build()
            .expect("reader");
        for batch in reader {
            let batch = batch.expect("batch");
            let ids = batch.column_by_name("id").expect("id").as_string::<i32>();
            let doubled = batch
                .column_by_name("doubled")
                .expect("doubled")
                .as_primitive::<Int64Type>();
            for (id, d) in ids.iter().zip(doubled.iter()) {
                let (id, d) = (id.expect("id").to_string(), d.expect("doubled"));
                assert!(rows.insert(id.clone(), d).is_none(), "record {id} twice");
            }
        }
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_runs_through_grpc_with_the_coordinator_and_two_workers_in_process() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = StoreUri::parse(&format!("file://{}", dir.path().display())).expect("root");
    let stores = Stores::new();
    let shutdown = CancellationToken::new();

    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = format!("http://{}", listener.local_addr().expect("addr"));
    let coordinator = tokio::spawn(stoke_coordinator::run(
        listener,
        CoordinatorConfig::new(root.clone()),
        stores.clone(),
        shutdown.clone(),
    ));
    // Calls made before the coordinator serves wait in the listener's
    // backlog, so the client can connect at once.
    let client = Client::connect(&addr).await.expect("connect");
    let job = client.submit(&spec(), None).await.expect("submit");

    let mut workers = Vec::new();
    for name in ["w1", "w2"] {
        let mut registry = Registry::new();
        registry.register::<Double>("double");
        let mut config = WorkerConfig::new(name);
        config.exit_when_idle = true;
        config.idle_poll = Duration::from_millis(50);
        let link = GrpcLink::new(&addr, &ClientSecurity::default()).expect("link");
        workers.push(tokio::spawn(stoke_worker::run(
            link,
            config,
            registry,
            stores.clone(),
            shutdown.child_token(),
        )));
    }
    let done = tokio::time::timeout(
        Duration::from_secs(120),
        client.wait(&job.job_id, Duration::from_millis(50), |_| {}),
    )
    .await
    .expect("the job ends within 2 minutes")
    .expect("wait");
    assert_eq!(done.state, JobState::Succeeded, "{:?}", done.reason);
    for worker in workers {
        let exit = tokio::time::timeout(Duration::from_secs(60), worker)
            .await
            .expect("the workers leave once idle")
            .expect("worker task")
            .expect("worker");
        assert_eq!(exit, WorkerExit::Idle);
    }

    let manifest_uri = RootLayout::new(root).job(&job.job_id).manifest();
    let manifest: Manifest = stores
        .get_json(&manifest_uri)
        .await
        .expect("read manifest")
        .expect("a manifest");
    assert_eq!(manifest.records_in, RECORDS);
    let rows = outputs(&stores, &manifest).await;
    assert_eq!(rows.len() as u64, RECORDS);
    for (id, doubled) in rows {
        assert_eq!(doubled, 2 * id.parse::<i64>().expect("numeric id"));
    }

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), coordinator)
        .await
        .expect("the coordinator stops")
        .expect("coordinator task")
        .expect("coordinator");
}
