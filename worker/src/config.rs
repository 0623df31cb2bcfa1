//! Worker configuration.

use std::path::PathBuf;
use std::time::Duration;

use tch::Device;

use crate::error::WorkerError;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Names this worker in the coordinator's logs and status.
    pub worker_id: String,
    /// One processor (and lease stream) per device.
    pub devices: Vec<Device>,
    /// libtorch intra-op threads; `None` leaves libtorch's default.
    pub intra_op_threads: Option<usize>,
    /// Exit once the coordinator has no running job (for `run --local` and
    /// one-shot batch jobs); otherwise wait for new jobs.
    pub exit_when_idle: bool,
    /// Local folder for `upload_path` files; a temporary one when `None`.
    pub scratch_dir: Option<PathBuf>,
    /// Batches read ahead of the processor.
    pub prefetch_batches: usize,
    /// How long to wait between asks when there is no job at all.
    pub idle_poll: Duration,
}

impl WorkerConfig {
    pub fn new(worker_id: impl Into<String>) -> Self {
        Self {
            worker_id: worker_id.into(),
            devices: vec![Device::Cpu],
            intra_op_threads: None,
            exit_when_idle: false,
            scratch_dir: None,
            prefetch_batches: 2,
            idle_poll: Duration::from_secs(1),
        }
    }
}

/// Parses a device list: `all` (every CUDA device, or the cpu when there
/// is none), or a comma-separated list of `auto`, `cpu`, `cuda`, `cuda:N`.
pub fn parse_devices(text: &str) -> Result<Vec<Device>, WorkerError> {
    if text == "all" {
        let n = tch::Cuda::device_count();
        return Ok(if n > 0 {
            (0..n as usize).map(Device::Cuda).collect()
        } else {
            vec![Device::Cpu]
        });
    }
    let devices = text
        .split(',')
        .map(|d| parse_device(d.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    if devices.is_empty() {
        return Err(WorkerError::Config("no device given".to_string()));
    }
    Ok(devices)
}

/// Parses `auto`, `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(text: &str) -> Result<Device, WorkerError> {
    match text {
        "auto" => Ok(Device::cuda_if_available()),
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(Device::Cuda)
            .ok_or_else(|| {
                WorkerError::Config(format!("device {other:?}: use auto, cpu, cuda or cuda:N"))
            }),
    }
}

/// A device's name as the coordinator sees it.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices() {
        assert_eq!(parse_device("cpu").expect("cpu"), Device::Cpu);
        assert_eq!(parse_device("cuda:1").expect("cuda"), Device::Cuda(1));
        assert!(parse_device("gpu").is_err());
        assert_eq!(
            parse_devices("cpu, cuda:1").expect("list"),
            vec![Device::Cpu, Device::Cuda(1)]
        );
        assert!(!parse_devices("all").expect("all").is_empty());
        assert_eq!(device_name(Device::Cuda(2)), "cuda:2");
    }
}
