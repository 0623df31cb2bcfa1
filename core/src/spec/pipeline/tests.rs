use super::*;

fn parse(text: &str) -> Result<PipelineSpec, SpecError> {
    let value: serde_json::Value = toml::from_str(text).expect("toml");
    PipelineSpec::from_value(value, FsPath::new("/specs"), "toml")
}

const TWO_STAGES: &str = r#"
name = "images"

[[stage]]
name = "decode"
[stage.scheduling]
pool = "cpu"
[stage.dataset]
format = "files"
uri = "data/images/"
[stage.processor]
python = "prep:Decode"
python_path = ["."]

[[stage]]
name = "classify"
[stage.scheduling]
pool = "gpu"
[stage.processor]
name = "pytorch"
params = { model = "model.pt2", input_column = "pixels", outputs = ["argmax"] }

[pipeline]
max_pending = 8
"#;

#[test]
fn a_pipeline_expands_into_one_job_per_stage_linked_in_order() {
    let p = parse(TWO_STAGES).expect("a valid pipeline");
    assert_eq!(p.name, "images");
    assert_eq!(p.max_pending, 8);
    let jobs = p.stage_jobs("images-1f3c9a2e");
    let ids: Vec<&str> = jobs.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["images-1f3c9a2e-decode", "images-1f3c9a2e-classify"]);
    let (_, decode) = &jobs[0];
    let (_, classify) = &jobs[1];
    // Relative paths are the spec file's, as in a job spec.
    assert_eq!(
        decode.dataset.uri.as_deref(),
        Some("file:///specs/data/images/")
    );
    assert_eq!(decode.processor.python_path, ["/specs"]);
    assert_eq!(decode.pool_name(), "cpu");
    assert_eq!(classify.pool_name(), "gpu");
    assert_eq!(classify.dataset.format, DatasetFormat::Stage);
    assert_eq!(classify.dataset.id_column.as_deref(), Some("id"));
    let up = decode.stage_of.as_ref().expect("stage_of");
    assert_eq!(
        (
            up.index,
            up.stages,
            up.upstream.as_deref(),
            up.downstream.as_deref()
        ),
        (0, 2, None, Some("images-1f3c9a2e-classify"))
    );
    assert_eq!(up.display_name(), "images-1f3c9a2e/decode");
    let down = classify.stage_of.as_ref().expect("stage_of");
    assert_eq!(
        (
            down.index,
            down.upstream.as_deref(),
            down.downstream.as_deref()
        ),
        (1, Some("images-1f3c9a2e-decode"), None)
    );
    assert_eq!(down.max_pending, 8);
    // Each stage's spec is a valid job spec, and round-trips as stored.
    for (_, spec) in &jobs {
        spec.validate().expect("valid stage");
        assert_eq!(&JobSpec::from_json(&spec.to_json()).expect("stored"), spec);
    }
}

#[test]
fn a_plain_job_spec_is_not_a_pipeline_and_a_stage_input_cannot_be_written_by_hand() {
    let plain: serde_json::Value =
        toml::from_str("[dataset]\nformat = \"range\"\ncount = 3\n[processor]\nname = \"p\"")
            .expect("toml");
    assert!(!PipelineSpec::is_pipeline(&plain));
    let e = JobSpec::from_toml("[dataset]\nformat = \"stage\"\n[processor]\nname = \"p\"")
        .expect_err("a stage input by hand");
    assert!(e.to_string().contains("written by a pipeline spec"), "{e}");
}

#[test]
fn a_malformed_pipeline_is_refused_naming_what_is_wrong() {
    let cases: Vec<(String, &str)> = vec![
        (
            TWO_STAGES.replace(
                "[stage.processor]\nname = \"pytorch\"",
                "[stage.dataset]\nformat = \"range\"\ncount = 3\n[stage.processor]\nname = \"pytorch\"",
            ),
            "stage \"classify\": dataset: only the first stage has a [stage.dataset]",
        ),
        (
            TWO_STAGES.replace(
                "python_path = [\".\"]",
                "python_path = [\".\"]\n[stage.output]\nformat = \"delta\"\nuri = \"file:///t\"",
            ),
            "stage \"decode\": output.format: an intermediate stage writes Parquet",
        ),
        (
            TWO_STAGES.replace(
                "python_path = [\".\"]",
                "python_path = [\".\"]\n[stage.output]\nuri = \"file:///elsewhere\"",
            ),
            "stage \"decode\": output.uri: an intermediate stage's outputs live under the pipeline's root",
        ),
        (
            TWO_STAGES.replace("name = \"classify\"", "name = \"decode\""),
            "stage[1].name: \"decode\" names two stages",
        ),
        (
            TWO_STAGES.replace("max_pending = 8", "max_pending = 0"),
            "pipeline.max_pending: must be at least 1",
        ),
        (
            TWO_STAGES.replace("pool = \"gpu\"", "pool = \"g p u\""),
            "stage \"classify\": scheduling.pool",
        ),
        (
            TWO_STAGES.replace("name = \"images\"", "name = \"images\"\npriority = 3"),
            "priority: not a pipeline key",
        ),
        (
            TWO_STAGES.replace("name = \"images\"\n", ""),
            "name: missing",
        ),
    ];
    for (text, want) in cases {
        let e = parse(&text).expect_err(want).to_string();
        assert!(e.contains(want), "wanted {want:?} in {e:?}");
    }
}

#[test]
fn a_downstream_input_column_the_upstream_does_not_write_is_refused() {
    let text = r#"
name = "two"
[[stage]]
name = "score"
[stage.dataset]
format = "parquet"
uri = "file:///data/"
[stage.processor]
name = "pytorch"
params = { model = "a.pt", input_column = "x", outputs = ["argmax", "embedding"] }
[[stage]]
name = "rank"
[stage.processor]
name = "pytorch"
params = { model = "b.pt", input_column = "embeddings" }
"#;
    let e = parse(text).expect_err("a column the upstream does not write");
    assert!(
        e.to_string().contains(
            "stage \"rank\": processor.params.input_column: \"embeddings\" is not a column the stage \"score\" writes (id, prediction, embedding)"
        ),
        "{e}"
    );
    parse(&text.replace("\"embeddings\"", "\"embedding\"")).expect("a column it writes");
}
