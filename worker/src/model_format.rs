//! Which format a model file is in, told by its content: TorchScript files
//! (`torch.jit.save`) and AOTInductor packages (`.pt2`, from
//! `torch._inductor.aoti_compile_and_package`) are both zip archives, and
//! their entries differ. For a package, also what its compiled model
//! checks its inputs against (dtype, rank, fixed and ranged dims), read
//! from the generated wrapper source the package carries, so a job whose
//! batches do not fit is refused before its first batch.

use std::io::{Cursor, Read};

use tch::Kind;

/// A model file's format.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelFormat {
    TorchScript,
    /// An AOTInductor package; its input specs when the package carries
    /// its wrapper source (packages from `aoti_compile_and_package` do).
    Pt2 {
        inputs: Option<Vec<InputSpec>>,
    },
}

/// One dimension an input must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DimSpec {
    Fixed(i64),
    /// A dynamic dim (`torch.export.Dim`), within these bounds.
    Range {
        min: i64,
        max: Option<i64>,
    },
}

impl DimSpec {
    pub fn admits(&self, n: i64) -> bool {
        match *self {
            Self::Fixed(v) => v == n,
            Self::Range { min, max } => n >= min && max.is_none_or(|m| n <= m),
        }
    }

    /// The smallest and largest sizes it admits.
    pub fn bounds(&self) -> (i64, Option<i64>) {
        match *self {
            Self::Fixed(v) => (v, Some(v)),
            Self::Range { min, max } => (min, max),
        }
    }
}

impl std::fmt::Display for DimSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::Fixed(v) => write!(f, "{v}"),
            Self::Range {
                min,
                max: Some(max),
            } => write!(f, "{min}..={max}"),
            Self::Range { min, max: None } => write!(f, "{min}.."),
        }
    }
}

/// What one input of a compiled package must look like.
#[derive(Debug, Clone, PartialEq)]
pub struct InputSpec {
    /// The dtype, when the package names one stoke knows.
    pub kind: Option<Kind>,
    pub dims: Vec<DimSpec>,
}

impl InputSpec {
    /// `[2..=1024, 16]`-style text for errors.
    pub fn shape_text(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(ToString::to_string).collect();
        format!("[{}]", dims.join(", "))
    }
}

/// Tells the format of a model file from its bytes.
pub fn detect(bytes: &[u8]) -> Result<ModelFormat, String> {
    let mut archive = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| {
        format!("not a TorchScript file or a .pt2 package (both are zip archives): {e}")
    })?;
    let names: Vec<String> = archive.file_names().map(str::to_string).collect();
    let aoti_dir = names.iter().any(|n| n.contains("/data/aotinductor/"));
    let pt2_archive = names.iter().any(|n| n.ends_with("/archive_format"));
    if aoti_dir {
        let wrapper = names
            .iter()
            .find(|n| n.contains("/data/aotinductor/model/") && n.ends_with(".wrapper.cpp"))
            .cloned();
        let inputs = match wrapper {
            Some(name) => {
                let mut source = String::new();
                archive
                    .by_name(&name)
                    .map_err(|e| format!("reading {name} in the package: {e}"))?
                    .read_to_string(&mut source)
                    .map_err(|e| format!("reading {name} in the package: {e}"))?;
                parse_input_checks(&source)
            }
            None => None,
        };
        return Ok(ModelFormat::Pt2 { inputs });
    }
    if pt2_archive {
        return Err(
            "a .pt2 archive without an AOTInductor model (an exported program saved \
             with torch.export.save?): compile it with \
             torch._inductor.aoti_compile_and_package"
                .to_string(),
        );
    }
    if names.iter().any(|n| n.ends_with("/data.pkl")) && names.iter().any(|n| n.contains("/code/"))
    {
        return Ok(ModelFormat::TorchScript);
    }
    Err(format!(
        "a zip archive that is neither a TorchScript file nor a .pt2 package (entries: {})",
        names.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
    ))
}

/// Reads the input checks AOTInductor generates for each input
/// (`check_input_N`: dtype, each dim's fixed value or bounds, strides).
/// `None` when the source has none in a form this reads.
fn parse_input_checks(source: &str) -> Option<Vec<InputSpec>> {
    let mut inputs = Vec::new();
    for i in 0.. {
        let marker = format!("static void check_input_{i}(");
        let Some(start) = source.find(&marker) else {
            break;
        };
        let body = &source[start + marker.len()..];
        // The function ends where the next top-level item starts.
        let end = body.find("\n}\n").unwrap_or(body.len());
        inputs.push(parse_one(&body[..end])?);
    }
    (!inputs.is_empty()).then_some(inputs)
}

fn parse_one(body: &str) -> Option<InputSpec> {
    let kind = body
        .split("_expected_dtype = aoti_torch_dtype_")
        .nth(1)
        .and_then(|rest| rest.split('(').next())
        .and_then(kind_of);
    let mut fixed: Vec<(usize, i64)> = Vec::new();
    let mut mins: Vec<(usize, i64)> = Vec::new();
    let mut maxs: Vec<(usize, i64)> = Vec::new();
    let mut rank = 0usize;
    for line in body.lines() {
        let line = line.trim();
        let Some(cond) = line
            .strip_prefix("if (")
            .and_then(|c| c.strip_suffix(") {"))
        else {
            continue;
        };
        let parts: Vec<&str> = cond.split_whitespace().collect();
        let [a, op, b] = parts.as_slice() else {
            continue;
        };
        // `N != x_size[d]` (fixed), `x_size[d] < N` (min), `x_size[d] > N`
        // (max); strides only tell the rank.
        let (index, is_size, number) = match (dim_index(a), dim_index(b)) {
            (None, Some((d, s))) => (d, s, a.parse::<i64>().ok()),
            (Some((d, s)), None) => (d, s, b.parse::<i64>().ok()),
            _ => continue,
        };
        rank = rank.max(index + 1);
        let (true, Some(value)) = (is_size, number) else {
            continue;
        };
        match (*op, dim_index(b).is_some()) {
            ("!=", _) => fixed.push((index, value)),
            ("<", false) => mins.push((index, value)),
            (">", false) => maxs.push((index, value)),
            _ => {}
        }
    }
    if rank == 0 {
        return None;
    }
    let dims = (0..rank)
        .map(|d| match fixed.iter().find(|(i, _)| *i == d) {
            Some((_, v)) => DimSpec::Fixed(*v),
            None => DimSpec::Range {
                min: mins.iter().find(|(i, _)| *i == d).map_or(0, |(_, v)| *v),
                max: maxs.iter().find(|(i, _)| *i == d).map(|(_, v)| *v),
            },
        })
        .collect();
    Some(InputSpec { kind, dims })
}

/// `x_size[3]` -> (3, true); `x_stride[1]` -> (1, false).
fn dim_index(token: &str) -> Option<(usize, bool)> {
    let (is_size, rest) = if let Some(pos) = token.find("_size[") {
        (true, &token[pos + 6..])
    } else if let Some(pos) = token.find("_stride[") {
        (false, &token[pos + 8..])
    } else {
        return None;
    };
    let index = rest.strip_suffix(']')?.parse().ok()?;
    Some((index, is_size))
}

fn kind_of(name: &str) -> Option<Kind> {
    Some(match name {
        "float32" => Kind::Float,
        "float64" => Kind::Double,
        "float16" => Kind::Half,
        "bfloat16" => Kind::BFloat16,
        "int64" => Kind::Int64,
        "int32" => Kind::Int,
        "int16" => Kind::Int16,
        "int8" => Kind::Int8,
        "uint8" => Kind::Uint8,
        "bool" => Kind::Bool,
        _ => return None,
    })
}

/// Names for a package's flattened outputs: the keys of a flat dict
/// output, else `output0`, `output1`, ... (`out_spec` is the package's
/// serialized pytree spec, `[version, spec]`).
pub fn output_names(out_spec: &str) -> Vec<String> {
    let Ok(spec) = serde_json::from_str::<serde_json::Value>(out_spec) else {
        return vec!["output0".to_string()];
    };
    let root = &spec[1];
    let count = leaves(root);
    let fallback = || (0..count).map(|i| format!("output{i}")).collect();
    if root["type"].as_str() != Some("builtins.dict") {
        return fallback();
    }
    let keys: Option<Vec<String>> = root["context"]
        .as_str()
        .and_then(|c| serde_json::from_str::<Vec<serde_json::Value>>(c).ok())
        .map(|keys| {
            keys.iter()
                .map(|k| k.as_str().map_or_else(|| k.to_string(), str::to_string))
                .collect()
        });
    match keys {
        // Only a flat dict of tensors names every output one to one.
        Some(keys) if keys.len() == count => keys,
        _ => fallback(),
    }
}

/// The tensors a pytree spec flattens to (a node without children and
/// without a type is a leaf).
fn leaves(node: &serde_json::Value) -> usize {
    match node["children_spec"].as_array() {
        Some(children) if !children.is_empty() => children.iter().map(leaves).sum(),
        _ if node["type"].is_null() => 1,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHECK: &str = r#"
AOTI_NOINLINE static void check_input_0(
    AtenTensorHandle* input_handles
) {
    ConstantHandle arg2_1 = ConstantHandle(input_handles[0]);
    int32_t arg2_1_expected_dtype = aoti_torch_dtype_float32();
    auto arg2_1_size = arg2_1.sizes();

    if (arg2_1_size[0] < 2) {
        ss << "input_handles[0]: dim value is too small at 0, "
    }

    if (arg2_1_size[0] > 1024) {
    }

    if (4 != arg2_1_size[1]) {
    }
    auto arg2_1_stride = arg2_1.strides();

    if (4 != arg2_1_stride[0]) {
    }

    if (1 != arg2_1_stride[1]) {
    }
}

static bool _check_aoti_runtime_check_inputs_env() {
"#;

    #[test]
    fn input_checks_give_dtype_rank_and_bounds() {
        let inputs = parse_input_checks(CHECK).expect("parsed");
        assert_eq!(inputs.len(), 1);
        assert_eq!(inputs[0].kind, Some(Kind::Float));
        assert_eq!(
            inputs[0].dims,
            vec![
                DimSpec::Range {
                    min: 2,
                    max: Some(1024)
                },
                DimSpec::Fixed(4)
            ]
        );
        assert_eq!(inputs[0].shape_text(), "[2..=1024, 4]");
        assert!(parse_input_checks("int main() {}").is_none());
    }

    #[test]
    fn dims_admit_their_sizes() {
        let d = DimSpec::Range {
            min: 2,
            max: Some(8),
        };
        assert!(d.admits(2) && d.admits(8) && !d.admits(1) && !d.admits(9));
        assert!(DimSpec::Fixed(4).admits(4) && !DimSpec::Fixed(4).admits(5));
    }

    #[test]
    fn output_names_come_from_a_dict_spec() {
        let spec = r#"[1, {"type": "builtins.dict", "context": "[\"logits\", \"embedding\"]", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]"#;
        assert_eq!(output_names(spec), vec!["logits", "embedding"]);
        let tuple = r#"[1, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]"#;
        assert_eq!(output_names(tuple), vec!["output0", "output1"]);
        let single = r#"[1, {"type": null, "context": null, "children_spec": []}]"#;
        assert_eq!(output_names(single), vec!["output0"]);
    }

    /// A zip archive with these entries, as torch writes its files.
    fn archive(entries: &[(&str, &str)]) -> Vec<u8> {
        use std::io::Write;
        let mut out = zip::ZipWriter::new(Cursor::new(Vec::new()));
        for (name, text) in entries {
            let options = zip::write::FileOptions::default()
                .compression_method(zip::CompressionMethod::Stored);
            out.start_file(*name, options).expect("entry");
            out.write_all(text.as_bytes()).expect("write");
        }
        out.finish().expect("zip").into_inner()
    }

    #[test]
    fn formats_are_told_apart_by_their_entries_not_their_names() {
        let script = archive(&[
            ("model/data.pkl", "."),
            ("model/code/__torch__.py", "def forward(self, x): ..."),
            ("model/version", "3"),
        ]);
        assert_eq!(detect(&script), Ok(ModelFormat::TorchScript));

        let package = archive(&[
            ("model/archive_format", "pt2"),
            ("model/data/aotinductor/model/abc.wrapper.cpp", CHECK),
            ("model/data/aotinductor/model/abc.wrapper.so", "\x7fELF"),
        ]);
        let ModelFormat::Pt2 {
            inputs: Some(inputs),
        } = detect(&package).expect("pt2")
        else {
            panic!("no input specs read");
        };
        assert_eq!(inputs[0].shape_text(), "[2..=1024, 4]");

        // A package without its wrapper source still loads, unchecked.
        let bare = archive(&[
            ("model/archive_format", "pt2"),
            ("model/data/aotinductor/model/abc.wrapper.so", "\x7fELF"),
        ]);
        assert_eq!(detect(&bare), Ok(ModelFormat::Pt2 { inputs: None }));

        let exported = archive(&[
            ("model/archive_format", "pt2"),
            ("model/models/model.json", "{}"),
        ]);
        let e = detect(&exported).expect_err("no AOTInductor model");
        assert!(e.contains("aoti_compile_and_package"), "{e}");

        let other = archive(&[("readme.txt", "hello")]);
        let e = detect(&other).expect_err("neither");
        assert!(
            e.contains("neither a TorchScript file nor a .pt2 package"),
            "{e}"
        );
        assert!(e.contains("readme.txt"), "{e}");
    }

    #[test]
    fn non_zip_bytes_are_named_as_such() {
        let e = detect(b"definitely not a model").expect_err("not a zip");
        assert!(
            e.contains("not a TorchScript file or a .pt2 package"),
            "{e}"
        );
    }
}
