//! Worker configuration.

use std::path::PathBuf;
use std::time::Duration;

use tch::Device;

use crate::error::WorkerError;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Names this worker in the coordinator's logs and status.
    pub worker_id: String,
    /// The pool it serves (`--pool`): it is leased only shards of jobs
    /// whose `[scheduling] pool` names it.
    pub pool: String,
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
    /// This is a worker process of its own (not embedded in a user's
    /// process): a batch that makes it unusable (a fatal signal, a batch
    /// past `batch_timeout`, a sticky device error) ends it after it said
    /// why, so it restarts clean (see `fatal.rs`).
    pub crash_exits: bool,
}

impl WorkerConfig {
    pub fn new(worker_id: impl Into<String>) -> Self {
        Self {
            worker_id: worker_id.into(),
            pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
            devices: vec![Device::Cpu],
            intra_op_threads: None,
            exit_when_idle: false,
            scratch_dir: None,
            prefetch_batches: 2,
            idle_poll: Duration::from_secs(1),
            crash_exits: false,
        }
    }
}

/// Parses a device list: `all` (every CUDA device, or the cpu when there
/// is none), or a comma-separated list of `auto`, `cpu`, `cuda`, `cuda:N`.
pub fn parse_devices(text: &str) -> Result<Vec<Device>, WorkerError> {
    if text == "all" {
        crate::cuda::load();
        let n = tch::Cuda::device_count();
        return Ok(if n > 0 {
            (0..n as usize).map(Device::Cuda).collect()
        } else {
            tracing::warn!("--device all: this host has no CUDA device; running on the cpu");
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
    let device = match text {
        "cpu" => return Ok(Device::Cpu),
        "auto" => return Ok(auto_device()),
        "cuda" => Device::Cuda(0),
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(Device::Cuda)
            .ok_or_else(|| {
                WorkerError::Config(format!("device {other:?}: use auto, cpu, cuda or cuda:N"))
            })?,
    };
    // A CUDA device: libtorch_cuda loads now, before anything can ask
    // torch about CUDA (torch answers "none" for good if asked first).
    crate::cuda::load();
    Ok(device)
}

/// `auto`: the first CUDA device when torch sees one, else the cpu
/// (libtorch_cuda loaded first, where the host has a driver).
pub fn auto_device() -> Device {
    crate::cuda::load();
    Device::cuda_if_available()
}

/// Checks that this host can run on every device given, before anything
/// loads: `cuda:3` on a host where torch sees fewer CUDA devices fails at
/// once with one line, instead of every model load failing (and being
/// retried) deep inside libtorch.
pub fn check_devices(devices: &[Device]) -> Result<(), WorkerError> {
    if !devices.iter().any(|d| matches!(d, Device::Cuda(_))) {
        return Ok(());
    }
    // Why torch may see fewer devices than asked: no driver (whether or not
    // libtorch_cuda is in), or libtorch_cuda not loading.
    let libs = crate::cuda::load();
    let why = if !crate::cuda::driver_present() {
        Some(crate::cuda::NO_DRIVER.to_string())
    } else if let crate::cuda::CudaLibs::Absent(why) = libs {
        Some(why.clone())
    } else {
        None
    };
    check_devices_against(devices, tch::Cuda::device_count().max(0) as usize).map_err(|e| {
        match (e, why) {
            (WorkerError::Device(msg), Some(why)) => WorkerError::Device(format!("{msg}: {why}")),
            (e, _) => e,
        }
    })
}

/// [`check_devices`] for a host where torch sees `visible` CUDA devices.
pub fn check_devices_against(devices: &[Device], visible: usize) -> Result<(), WorkerError> {
    for device in devices {
        let Device::Cuda(n) = *device else {
            continue;
        };
        if n >= visible {
            let name = device_name(*device);
            return Err(WorkerError::Device(match visible {
                0 => format!("{name} requested but no CUDA device is visible (torch sees 0)"),
                1 => format!("{name} requested but torch sees only 1 CUDA device (cuda:0)"),
                k => format!(
                    "{name} requested but torch sees only {k} CUDA devices (cuda:0 to cuda:{})",
                    k - 1
                ),
            }));
        }
    }
    Ok(())
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

    #[test]
    fn a_cuda_device_the_host_lacks_is_refused_in_one_line() {
        let e = check_devices_against(&[Device::Cpu, Device::Cuda(3)], 0).expect_err("no cuda");
        assert_eq!(
            e.to_string(),
            "cuda:3 requested but no CUDA device is visible (torch sees 0)"
        );
        let e = check_devices_against(&[Device::Cuda(2)], 2).expect_err("two devices");
        assert_eq!(
            e.to_string(),
            "cuda:2 requested but torch sees only 2 CUDA devices (cuda:0 to cuda:1)"
        );
        check_devices_against(&[Device::Cuda(0), Device::Cuda(1), Device::Cpu], 2).expect("fits");
        check_devices_against(&[Device::Cpu], 0).expect("cpu always");
        // On this host: what torch sees decides, never a panic.
        let visible = tch::Cuda::device_count() as usize;
        assert!(
            check_devices(&[Device::Cuda(visible)]).is_err(),
            "cuda:{visible} is one past the last device"
        );
    }
}
