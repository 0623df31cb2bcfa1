//! Loading a `.pt2` (AOTInductor) package: checked against the worker and
//! the job first (`compat.rs`), then loaded on the job's device; and
//! checking each batch against the package's input specs.

use std::io::Write;

use tch::{Device, Tensor};

use super::compat::{JobInputs, check_job, check_worker};
use crate::aoti::{self, AotiModel};
use crate::error::ProcessorResult;
use crate::model_format::{self, InputSpec};

/// A loaded `.pt2` package and what it takes.
#[derive(Debug)]
pub(super) struct Pt2Model {
    pub(super) model: AotiModel,
    /// Input specs read from the package (None: it carries none stoke can
    /// read, and the package's own checks are all there is).
    pub(super) inputs: Option<Vec<InputSpec>>,
    /// The smallest batch the package takes: a smaller batch (a shard's
    /// last) is filled up with copies of its last record, whose outputs
    /// are dropped.
    pub(super) min_batch: i64,
}

/// Checks a package against the worker and the job, and loads it.
pub(super) fn load_pt2(
    uri: &str,
    bytes: &[u8],
    inputs: Option<Vec<InputSpec>>,
    job: &JobInputs<'_>,
    device: Device,
) -> ProcessorResult<(Pt2Model, Vec<String>)> {
    // The loader takes a path: the package goes to a temporary file, which
    // may go once the loader has unpacked it.
    let mut file = tempfile::Builder::new()
        .prefix("stoke-model-")
        .suffix(".pt2")
        .tempfile()
        .map_err(|e| format!("loading model {uri}: creating a temporary file: {e}"))?;
    file.write_all(bytes)
        .and_then(|()| file.flush())
        .map_err(|e| format!("loading model {uri}: writing a temporary file: {e}"))?;
    let metadata = aoti::package_metadata(file.path())
        .map_err(|e| format!("loading model {uri}: not a readable .pt2 package: {e}"))?;
    check_worker(uri, &metadata, device)?;
    if let Some(specs) = &inputs {
        check_job(uri, specs, job)?;
    } else {
        tracing::warn!(model = %uri, "the package carries no input checks stoke can read; inputs are not checked before they reach the model");
    }
    let model =
        AotiModel::load(file.path(), device).map_err(|e| format!("loading model {uri}: {e}"))?;
    let (_, out_spec) = model
        .call_spec()
        .map_err(|e| format!("loading model {uri}: {e}"))?;
    let names = model_format::output_names(&out_spec);
    let min_batch = inputs
        .as_ref()
        .and_then(|specs| specs.first())
        .and_then(|s| s.dims.first())
        .map_or(1, |d| d.bounds().0.max(1));
    tracing::info!(model = %uri, device = ?device, outputs = ?names, "loaded .pt2 package");
    Ok((
        Pt2Model {
            model,
            inputs,
            min_batch,
        },
        names,
    ))
}

impl Pt2Model {
    /// A batch's inputs against the package's specs (all but the batch
    /// size, which [`fill_rows`] takes care of).
    pub(super) fn check_batch(&self, uri: &str, inputs: &[Tensor]) -> ProcessorResult<()> {
        let Some(specs) = &self.inputs else {
            return Ok(());
        };
        for (i, (t, spec)) in inputs.iter().zip(specs).enumerate() {
            let size = t.size();
            let fits = size.len() == spec.dims.len()
                && size
                    .iter()
                    .zip(&spec.dims)
                    .skip(1)
                    .all(|(n, d)| d.admits(*n));
            let batch_fits = spec.dims[0].bounds().1.is_none_or(|m| size[0] <= m);
            if !fits || !batch_fits {
                return Err(format!(
                    "model {uri}: the .pt2 package takes input {i} as {}, the batch gives {size:?}",
                    spec.shape_text()
                )
                .into());
            }
        }
        Ok(())
    }
}

/// `t` with its last row repeated up to `rows` rows.
pub(super) fn fill_rows(t: &Tensor, rows: i64) -> Result<Tensor, tch::TchError> {
    let have = t.size().first().copied().unwrap_or(0);
    let last = t.f_narrow(0, have - 1, 1)?;
    let mut shape = t.size();
    shape[0] = rows - have;
    let extra = last.f_expand(shape.as_slice(), false)?;
    Tensor::f_cat(&[t.shallow_clone(), extra], 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_batches_are_filled_with_their_last_row() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).reshape([2, 2]);
        let filled = fill_rows(&t, 4).expect("filled");
        assert_eq!(filled.size(), vec![4, 2]);
        let v = Vec::<f32>::try_from(&filled.flatten(0, -1)).expect("values");
        assert_eq!(v, vec![1.0, 2.0, 3.0, 4.0, 3.0, 4.0, 3.0, 4.0]);
    }
}
