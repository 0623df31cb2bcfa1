//! Whether a `.pt2` package can run here, before it is loaded: its device
//! and compiler against this worker, its input specs against the job.

use std::collections::HashMap;

use tch::Device;

use super::TORCH_VERSION_KEY;
use crate::aoti;
use crate::error::ProcessorResult;
use crate::model_format::InputSpec;

/// What the job feeds the model, for checking a package before the first
/// batch.
pub(super) struct JobInputs<'a> {
    /// Input columns, one model input each.
    pub(super) columns: usize,
    pub(super) input_shape: Option<&'a [i64]>,
    pub(super) padded: bool,
    pub(super) pass_lengths: bool,
    pub(super) batch_size: i64,
}

/// The package's device and compiler against this worker.
pub(super) fn check_worker(
    uri: &str,
    metadata: &HashMap<String, String>,
    device: Device,
) -> ProcessorResult<()> {
    let package_device = metadata
        .get("AOTI_DEVICE_KEY")
        .map_or("cpu", String::as_str);
    let worker_device = match device {
        Device::Cuda(_) => "cuda",
        Device::Cpu => "cpu",
        _ => "other",
    };
    if package_device != worker_device {
        return Err(format!(
            "model {uri}: the .pt2 package was compiled for {package_device}, but this worker runs it on {worker} (compile the package on and for {worker_device}, or run the job on {package_device} workers)",
            worker = device_text(device),
        )
        .into());
    }
    if let Some(compiled_by) = metadata.get(TORCH_VERSION_KEY) {
        let compiled = compiled_by.split('+').next().unwrap_or(compiled_by);
        let here = aoti::torch_version();
        if compiled != here {
            return Err(format!(
                "model {uri}: the .pt2 package was compiled by torch {compiled_by}, but this worker's libtorch is {here} (compile it with torch=={here})"
            )
            .into());
        }
    }
    if let Some(isa) = metadata.get("AOTI_CPU_ISA")
        && package_device == "cpu"
        && let Some(missing) = missing_cpu_feature(isa)
    {
        return Err(format!(
            "model {uri}: the .pt2 package was compiled for CPUs with {isa}, and this worker's CPU lacks {missing} (compile it on a machine like the workers')"
        )
        .into());
    }
    Ok(())
}

fn device_text(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Cpu => "cpu".to_string(),
        other => format!("{other:?}"),
    }
}

/// The first instruction set a package's `AOTI_CPU_ISA` names that this
/// CPU lacks (the package's kernels use it unconditionally).
fn missing_cpu_feature(isa: &str) -> Option<String> {
    #[cfg(target_arch = "x86_64")]
    {
        for name in isa.split_whitespace() {
            let present = match name {
                "AVX512" => std::arch::is_x86_feature_detected!("avx512f"),
                "AVX512_VNNI" => std::arch::is_x86_feature_detected!("avx512vnni"),
                "AVX2" => std::arch::is_x86_feature_detected!("avx2"),
                _ => true,
            };
            if !present {
                return Some(name.to_string());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    None
}

/// The package's inputs against what the job will feed it.
pub(super) fn check_job(
    uri: &str,
    specs: &[InputSpec],
    job: &JobInputs<'_>,
) -> ProcessorResult<()> {
    let given = job.columns + usize::from(job.pass_lengths);
    if specs.len() != given {
        let what = if job.pass_lengths {
            "2 (the input column and its lengths, with `pass_lengths`)".to_string()
        } else if job.columns == 1 {
            "1 (the input column)".to_string()
        } else {
            format!("{} (the input columns)", job.columns)
        };
        return Err(format!(
            "model {uri}: the .pt2 package takes {} inputs, the job gives {what}",
            specs.len()
        )
        .into());
    }
    let x = &specs[0];
    let job_shape = match job.input_shape {
        Some(shape) => {
            let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
            format!("[batch, {}] (input_shape)", dims.join(", "))
        }
        None if job.padded => "[batch, length] (padded lists)".to_string(),
        None => "[batch, width] (a list column without input_shape)".to_string(),
    };
    let job_rank = job.input_shape.map_or(2, |s| s.len() + 1);
    if x.dims.len() != job_rank {
        return Err(format!(
            "model {uri}: the .pt2 package takes a rank-{} input {}, the job gives rank {job_rank}: {job_shape}",
            x.dims.len(),
            x.shape_text()
        )
        .into());
    }
    if let Some(shape) = job.input_shape
        && let Some((d, (spec, n))) = x.dims[1..]
            .iter()
            .zip(shape)
            .enumerate()
            .find(|(_, (spec, n))| !spec.admits(**n))
    {
        return Err(format!(
            "model {uri}: the .pt2 package takes input {}, the job gives {job_shape}: dim {} is {n}, the package takes {spec}",
            x.shape_text(),
            d + 1
        )
        .into());
    }
    let (_, max) = x.dims[0].bounds();
    if let Some(max) = max
        && job.batch_size > max
    {
        return Err(format!(
            "model {uri}: the .pt2 package takes batches of {} records, the job's batching.batch_size is {} (lower it, or export with a larger Dim max)",
            x.dims[0], job.batch_size
        )
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use tch::Kind;

    use super::*;
    use crate::model_format::DimSpec;

    fn mlp_spec() -> Vec<InputSpec> {
        vec![InputSpec {
            kind: Some(Kind::Float),
            dims: vec![
                DimSpec::Range {
                    min: 2,
                    max: Some(256),
                },
                DimSpec::Fixed(64),
            ],
        }]
    }

    fn job(input_shape: Option<&[i64]>, batch_size: i64) -> JobInputs<'_> {
        JobInputs {
            columns: 1,
            input_shape,
            padded: false,
            pass_lengths: false,
            batch_size,
        }
    }

    #[test]
    fn a_batch_size_past_the_exported_range_is_refused_naming_both() {
        let e = check_job("file:///m.pt2", &mlp_spec(), &job(None, 512))
            .expect_err("too big")
            .to_string();
        assert!(e.contains("file:///m.pt2"), "{e}");
        assert!(e.contains("2..=256"), "{e}");
        assert!(e.contains("batch_size is 512"), "{e}");
        check_job("file:///m.pt2", &mlp_spec(), &job(None, 256)).expect("fits");
    }

    #[test]
    fn a_wrong_rank_is_refused_naming_both_shapes() {
        let e = check_job("m.pt2", &mlp_spec(), &job(Some(&[1, 8, 8]), 64))
            .expect_err("rank 4 vs 2")
            .to_string();
        assert!(e.contains("rank-2 input [2..=256, 64]"), "{e}");
        assert!(e.contains("rank 4: [batch, 1, 8, 8]"), "{e}");
    }

    #[test]
    fn a_fixed_dim_that_differs_is_refused() {
        let e = check_job("m.pt2", &mlp_spec(), &job(Some(&[32]), 64))
            .expect_err("32 vs 64")
            .to_string();
        assert!(e.contains("dim 1 is 32, the package takes 64"), "{e}");
    }

    #[test]
    fn a_cuda_package_on_a_cpu_worker_is_refused() {
        let metadata = HashMap::from([("AOTI_DEVICE_KEY".to_string(), "cuda".to_string())]);
        let e = check_worker("m.pt2", &metadata, Device::Cpu)
            .expect_err("cuda on cpu")
            .to_string();
        assert!(e.contains("compiled for cuda"), "{e}");
        assert!(e.contains("runs it on cpu"), "{e}");
    }

    #[test]
    fn another_torch_version_is_refused() {
        let metadata = HashMap::from([
            ("AOTI_DEVICE_KEY".to_string(), "cpu".to_string()),
            (TORCH_VERSION_KEY.to_string(), "1.0.0+cpu".to_string()),
        ]);
        let e = check_worker("m.pt2", &metadata, Device::Cpu)
            .expect_err("old torch")
            .to_string();
        assert!(e.contains("compiled by torch 1.0.0+cpu"), "{e}");
        assert!(e.contains(&aoti::torch_version()), "{e}");
    }
}
