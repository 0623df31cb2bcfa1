//! Reading jobs over the client API, synchronously, for tests that poll.

use std::time::Duration;

use stoke_client::Client;
use stoke_core::records::JobInfo;

/// Reads a job's status over gRPC (cheaper than the CLI, so it can be
/// polled). Reconnects after a failure; `None` while the coordinator is
/// unreachable (down, restarting).
#[derive(Debug)]
pub struct JobWatch {
    rt: tokio::runtime::Runtime,
    addr: String,
    client: Option<Client>,
}

impl JobWatch {
    pub fn new(addr: &str) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        Self {
            rt,
            addr: addr.to_string(),
            client: None,
        }
    }

    pub fn info(&mut self, job_id: &str) -> Option<JobInfo> {
        let limit = Duration::from_secs(2);
        if self.client.is_none() {
            let addr = self.addr.clone();
            let connected = self
                .rt
                .block_on(async move { tokio::time::timeout(limit, Client::connect(&addr)).await });
            self.client = connected.ok()?.ok();
        }
        let client = self.client.clone()?;
        let got = self
            .rt
            .block_on(async move { tokio::time::timeout(limit, client.get_job(job_id)).await });
        match got {
            Ok(Ok(info)) => Some(info),
            _ => {
                self.client = None;
                None
            }
        }
    }
}
