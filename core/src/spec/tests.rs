use super::*;

const GOOD: &str = r#"
name = "digits"
[dataset]
format = "parquet"
uri = "file:///data/digits/"
[processor]
name = "torchscript"
params = { model = "file:///m.pt", input_column = "pixels" }
[batching]
batch_size = 128
[checkpoint]
interval = 10
every = "30s"
[sharding]
records = 500
bytes = "16MiB"
"#;

fn err(text: &str) -> String {
    match JobSpec::from_toml(text) {
        Ok(spec) => panic!("spec was accepted: {spec:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn parses_a_full_spec_with_human_units() {
    let spec = JobSpec::from_toml(GOOD).expect("valid spec");
    assert_eq!(spec.batching.batch_size, 128);
    assert_eq!(spec.checkpoint.every, Some(Duration::from_secs(30)));
    assert_eq!(spec.sharding.bytes, ByteSize::mib(16));
    assert_eq!(spec.max_attempts, 3);
    assert_eq!(
        spec.processor.params.get("input_column"),
        Some(&serde_json::json!("pixels"))
    );
    // JSON round trip gives the same spec, also for sizes that have no
    // exact human form.
    assert_eq!(JobSpec::from_json(&spec.to_json()).expect("json"), spec);
    let odd = JobSpec::from_toml(&GOOD.replace("\"16MiB\"", "\"1000001B\"")).expect("spec");
    assert_eq!(JobSpec::from_json(&odd.to_json()).expect("json"), odd);
}

#[test]
fn float_params_reach_workers_unchanged() {
    // Parsed with serde_json's default (not correctly rounded) float
    // parser, 1.797693133157e308 came back one ulp off from spec.json.
    for x in [
        "1.797693133157e308",
        "2.2250738585072011e-308",
        "5e-324",
        "0.1",
        "-0.0",
        "1.7976931348623157e308",
    ] {
        let json = format!(
            r#"{{"dataset":{{"format":"range","count":1}},"processor":{{"name":"p","params":{{"x":{x}}}}}}}"#
        );
        let spec = JobSpec::from_json(&json).expect("json spec");
        let again = JobSpec::from_json(&spec.to_json()).expect("stored spec");
        assert_eq!(again, spec, "{x}");
        let toml = format!(
            "[dataset]\nformat = \"range\"\ncount = 1\n[processor]\nname = \"p\"\nparams = {{ x = {x} }}\n"
        );
        let spec = JobSpec::from_toml(&toml).expect("toml spec");
        assert_eq!(
            JobSpec::from_json(&spec.to_json()).expect("stored"),
            spec,
            "{x}"
        );
        let want: f64 = x.parse().expect("f64");
        assert_eq!(spec.processor.params["x"].as_f64(), Some(want), "{x}");
    }
}

#[test]
fn unknown_key_names_the_key_and_its_section() {
    let e = err(&GOOD.replace("batch_size = 128", "batch_sise = 128"));
    assert!(e.contains("batching"), "{e}");
    assert!(e.contains("batch_sise"), "{e}");
    assert!(e.contains("batch_size"), "should list the allowed key: {e}");
    let e = err(&format!("{GOOD}\nworkers = 3\n"));
    assert!(e.contains("workers"), "{e}");
}

#[test]
fn missing_dataset_is_refused() {
    let e = err("[processor]\nname = \"x\"\n");
    assert!(e.contains("dataset"), "{e}");
}

#[test]
fn missing_uri_names_the_field() {
    let e = err(&GOOD.replace("uri = \"file:///data/digits/\"", ""));
    assert!(e.contains("dataset.uri") && e.contains("missing"), "{e}");
}

#[test]
fn bad_uri_names_the_field_and_value() {
    let e = err(&GOOD.replace("file:///data/digits/", "ftp://host/x"));
    assert!(e.contains("dataset.uri") && e.contains("ftp"), "{e}");
    let e = err(&GOOD.replace("file:///data/digits/", "not a uri"));
    assert!(e.contains("dataset.uri"), "{e}");
}

#[test]
fn impossible_numbers_each_name_their_field() {
    for (from, to, field) in [
        ("batch_size = 128", "batch_size = 0", "batching.batch_size"),
        ("interval = 10", "interval = 0", "checkpoint.interval"),
        ("records = 500", "records = 0", "sharding.records"),
        ("bytes = \"16MiB\"", "bytes = \"10B\"", "sharding.bytes"),
        ("every = \"30s\"", "every = \"0s\"", "checkpoint.every"),
    ] {
        let e = err(&GOOD.replace(from, to));
        assert!(e.contains(field), "{field}: {e}");
    }
    let e = err(&format!("max_attempts = 0\n{GOOD}"));
    assert!(e.contains("max_attempts"), "{e}");
    let e = err(&GOOD.replace("interval = 10", "interval = -1"));
    assert!(e.contains("checkpoint.interval"), "{e}");
}

#[test]
fn bad_duration_and_size_are_refused() {
    let e = err(&GOOD.replace("\"30s\"", "\"thirty\""));
    assert!(e.contains("checkpoint.every"), "{e}");
    let e = err(&GOOD.replace("\"16MiB\"", "\"lots\""));
    assert!(e.contains("sharding.bytes"), "{e}");
}

#[test]
fn range_rules() {
    let range = "[dataset]\nformat = \"range\"\ncount = 10\n[processor]\nname = \"p\"\n";
    JobSpec::from_toml(range).expect("range spec");
    let e = err(&range.replace("count = 10", ""));
    assert!(e.contains("dataset.count"), "{e}");
    let e = err(&range.replace("count = 10", "count = 10\nuri = \"file:///x\""));
    assert!(e.contains("dataset.uri"), "{e}");
    let e = err(&GOOD.replace("format = \"parquet\"", "format = \"parquet\"\ncount = 3"));
    assert!(e.contains("dataset.count"), "{e}");
    let e = err(&range.replace("\"range\"", "\"csv\""));
    assert!(e.contains("dataset.format") && e.contains("csv"), "{e}");
}

#[test]
fn range_beyond_max_shards_and_too_many_threads_are_refused() {
    let range = |count: u64, records: u64| {
        format!(
            "[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n[sharding]\nrecords = {records}\n"
        )
    };
    JobSpec::from_toml(&range(MAX_SHARDS * 10, 10)).expect("exactly the most shards");
    let e = err(&range(MAX_SHARDS * 10 + 1, 10));
    assert!(
        e.contains("sharding.records") && e.contains("at least 11"),
        "{e}"
    );
    let e = err(&range(i64::MAX as u64, 1));
    assert!(e.contains("sharding.records"), "{e}");
    let e = err(&GOOD.replace(
        "name = \"torchscript\"",
        "name = \"t\"\nthreads = 4294967297",
    ));
    assert!(e.contains("processor.threads"), "{e}");
}

#[test]
fn bad_name_and_empty_processor() {
    let e = err(&GOOD.replace("name = \"digits\"", "name = \"a b\""));
    assert!(e.starts_with("job spec: name"), "{e}");
    let e = err(&GOOD.replace("name = \"torchscript\"", "name = \"\""));
    assert!(e.contains("processor.name"), "{e}");
}

#[test]
fn json_errors_name_the_path() {
    let e = JobSpec::from_json(
        r#"{"dataset":{"format":"range","count":"ten"},"processor":{"name":"p"}}"#,
    )
    .expect_err("bad count");
    assert!(e.to_string().contains("dataset.count"), "{e}");
}

#[test]
fn relative_paths_resolve_against_the_spec_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("job.toml");
    std::fs::write(
        &path,
        "[dataset]\nformat = \"jsonl\"\nuri = \"data/in.jsonl\"\n[processor]\nname = \"p\"\n",
    )
    .expect("write");
    let spec = JobSpec::from_file(&path).expect("spec");
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[dataset]\nformat = \"range\"\ncount = 1\nextra = 1\n[processor]\nname = \"p\"\n",
    )
    .expect("write");
    let e = JobSpec::from_file(&bad)
        .expect_err("unknown key")
        .to_string();
    assert!(e.contains("dataset") && e.contains("extra"), "{e}");
    let uri = spec.dataset.uri.expect("uri");
    assert!(uri.starts_with("file:///"), "{uri}");
    assert!(uri.ends_with("/data/in.jsonl"), "{uri}");
}

#[test]
fn a_python_processor_is_module_colon_class_and_excludes_name() {
    let spec = |processor: &str| {
        format!("[dataset]\nformat = \"range\"\ncount = 1\n[processor]\n{processor}\n")
    };
    let ok = JobSpec::from_toml(&spec(
        "python = \"pkg.my_processor:InferenceProcessor\"\npython_path = [\"/code\"]",
    ))
    .expect("python spec");
    assert_eq!(
        ok.processor.python_target(),
        Some(("pkg.my_processor", "InferenceProcessor"))
    );
    assert_eq!(
        ok.processor.label(),
        "python:pkg.my_processor:InferenceProcessor"
    );
    // Round trip through the JSON workers get.
    assert_eq!(JobSpec::from_json(&ok.to_json()).expect("json"), ok);

    let both = err(&spec("name = \"pytorch\"\npython = \"m:C\""));
    assert!(
        both.contains("`name`") && both.contains("`python`"),
        "{both}"
    );
    assert!(both.contains("mutually exclusive"), "{both}");
    for bad in ["m", "m:", ":C", "m:C:D", "1m:C", "m-x:C", "m:C.x"] {
        let e = err(&spec(&format!("python = \"{bad}\"")));
        assert!(
            e.contains("processor.python") && e.contains("module:Class"),
            "{bad}: {e}"
        );
    }
    let neither = err(&spec("threads = 1"));
    assert!(
        neither.contains("processor.name") && neither.contains("python"),
        "{neither}"
    );
    let path_only = err(&spec("name = \"pytorch\"\npython_path = [\".\"]"));
    assert!(path_only.contains("processor.python_path"), "{path_only}");
}

#[test]
fn python_path_entries_resolve_against_the_spec_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("job.toml");
    std::fs::write(
        &path,
        "[dataset]\nformat = \"range\"\ncount = 1\n[processor]\npython = \"m:C\"\n\
             python_path = [\".\", \"lib\", \"/abs\"]\n",
    )
    .expect("write");
    let spec = JobSpec::from_file(&path).expect("spec");
    let abs = |p: &str| {
        std::path::absolute(dir.path().join(p))
            .expect("absolute")
            .display()
            .to_string()
    };
    assert_eq!(
        spec.processor.python_path,
        vec![abs("."), abs("lib"), "/abs".to_string()]
    );
}

#[test]
fn a_python_processors_file_params_resolve_against_the_spec_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("models")).expect("mkdir");
    std::fs::write(dir.path().join("models/m.pt"), b"weights").expect("write");
    let write = |params: &str| {
        let path = dir.path().join("job.toml");
        std::fs::write(
            &path,
            format!(
                "[dataset]\nformat = \"range\"\ncount = 1\n[processor]\npython = \"m:C\"\n\
                 [processor.params]\n{params}\n"
            ),
        )
        .expect("write");
        JobSpec::from_file(&path)
    };
    let spec = write(
        "model = \"models/m.pt\"\nmode = \"fast\"\nremote = \"s3://b/m.pt\"\nabs = \"/x/y.pt\"\nk = 3",
    )
    .expect("spec");
    let abs = std::path::absolute(dir.path().join("models/m.pt")).expect("absolute");
    let params = &spec.processor.params;
    assert_eq!(params["model"], abs.display().to_string());
    assert_eq!(params["mode"], "fast");
    assert_eq!(params["remote"], "s3://b/m.pt");
    assert_eq!(params["abs"], "/x/y.pt");
    assert_eq!(params["k"], 3);
    // A relative file that is not there is refused at submit.
    let e = write("model = \"models/missing.pt\"")
        .expect_err("missing file")
        .to_string();
    assert!(
        e.contains("processor.params.model") && e.contains("no such file \"models/missing.pt\""),
        "{e}"
    );
    assert!(e.contains("relative to the spec's folder"), "{e}");
}

#[test]
fn the_built_in_runners_model_path_resolves_against_the_spec_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().canonicalize().expect("canonical");
    let job = |processor: &str, model: &str| {
        let path = base.join(format!("{processor}.toml"));
        std::fs::write(
            &path,
            format!(
                "[dataset]\nformat = \"range\"\ncount = 1\n[processor]\nname = \"{processor}\"\n\
                     [processor.params]\nmodel = \"{model}\"\ninput_column = \"x\"\n"
            ),
        )
        .expect("write");
        JobSpec::from_file(&path).expect("spec")
    };
    for name in BUILTIN_RUNNER_NAMES {
        let spec = job(name, "models/m.pt");
        let model = spec.processor.params["model"].as_str().expect("model");
        assert_eq!(
            model,
            StoreUri::from_local_path(&base.join("models/m.pt"))
                .expect("uri")
                .as_str(),
            "{name}"
        );
        assert_eq!(spec.uri_params(), vec![("model", model)]);
        // Other params are left alone.
        assert_eq!(spec.processor.params["input_column"], "x");
        // URIs stay as they are.
        let spec = job(name, "s3://bucket/m.pt");
        assert_eq!(spec.processor.params["model"], "s3://bucket/m.pt");
    }
    // A processor of the user's: its params are its own.
    let spec = job("my-model", "models/m.pt");
    assert_eq!(spec.processor.params["model"], "models/m.pt");
    assert!(spec.uri_params().is_empty());
}

#[test]
fn a_python_dataset_needs_a_factory_a_count_and_a_python_processor() {
    let good = "[dataset]\nformat = \"python\"\nfactory = \"my_data:make_dataset\"\ncount = 100\n\
                [processor]\npython = \"m:C\"\n";
    let spec = JobSpec::from_toml(good).expect("python dataset");
    assert_eq!(spec.dataset.format, DatasetFormat::Python);
    assert_eq!(
        spec.dataset.factory.as_deref(),
        Some("my_data:make_dataset")
    );
    for (from, to, field) in [
        (
            "factory = \"my_data:make_dataset\"\n",
            "",
            "dataset.factory",
        ),
        ("my_data:make_dataset", "my_data", "dataset.factory"),
        ("my_data:make_dataset", "my-data:f", "dataset.factory"),
        ("count = 100\n", "", "dataset.count"),
        ("count = 100\n", "count = 0\n", "dataset.count"),
        (
            "count = 100\n",
            "count = 100\nuri = \"file:///x\"\n",
            "dataset.uri",
        ),
        (
            "count = 100\n",
            "count = 100\nid_column = \"id\"\n",
            "dataset.id_column",
        ),
        ("python = \"m:C\"", "name = \"pytorch\"", "processor.python"),
    ] {
        let e = err(&good.replace(from, to));
        assert!(e.contains(field), "{from:?} -> {to:?}: {e}");
    }
    // A factory is only for format "python".
    let e = err(
        "[dataset]\nformat = \"range\"\ncount = 1\nfactory = \"m:f\"\n[processor]\npython = \"m:C\"\n",
    );
    assert!(e.contains("dataset.factory"), "{e}");
}

#[test]
fn a_python_datasets_path_resolves_against_the_spec_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("job.toml");
    std::fs::write(
        &path,
        "[dataset]\nformat = \"python\"\nfactory = \"d:make\"\ncount = 3\npython_path = [\"lib\"]\n\
         [processor]\npython = \"m:C\"\n",
    )
    .expect("write");
    let spec = JobSpec::from_file(&path).expect("spec");
    let lib = std::path::absolute(dir.path().join("lib")).expect("absolute");
    assert_eq!(spec.dataset.python_path, vec![lib.display().to_string()]);
}

#[test]
fn loading_workers_is_bounded_and_defaults_to_the_cores() {
    let base = "[dataset]\nformat = \"range\"\ncount = 1\n[processor]\npython = \"m:C\"\n";
    let spec = JobSpec::from_toml(base).expect("spec");
    assert_eq!(spec.loading.workers_on(2), 2);
    assert_eq!(spec.loading.workers_on(64), 8);
    let zero = JobSpec::from_toml(&format!("{base}[loading]\nworkers = 0\n")).expect("spec");
    assert_eq!(zero.loading.workers_on(2), 0);
    let e = err(&format!("{base}[loading]\nworkers = 1000\n"));
    assert!(e.contains("loading.workers"), "{e}");
    let e = err(&format!("{base}[loading]\nthreads = 2\n"));
    assert!(e.contains("threads"), "{e}");
}

#[test]
fn a_delta_output_defaults_to_one_commit_at_the_end_and_commit_is_delta_only() {
    let delta = |output: &str| format!("{GOOD}[output]\nuri = \"s3://b/t\"\n{output}\n");
    let spec = JobSpec::from_toml(&delta("format = \"delta\"")).expect("delta spec");
    assert_eq!(spec.output.format, OutputFormat::Delta);
    assert_eq!(spec.output.delta(), Some(DeltaCommit::End));
    assert_eq!(spec.output.format.extension(), "parquet");
    let live = JobSpec::from_toml(&delta("format = \"delta\"\ncommit = \"checkpoint\""))
        .expect("checkpoint spec");
    assert_eq!(live.output.delta(), Some(DeltaCommit::Checkpoint));
    assert_eq!(JobSpec::from_json(&live.to_json()).expect("json"), live);
    assert_eq!(JobSpec::from_toml(GOOD).expect("spec").output.delta(), None);
    let e = err(&delta("commit = \"checkpoint\""));
    assert!(
        e.contains("output.commit") && e.contains("only for format \"delta\" or \"iceberg\""),
        "{e}"
    );
    let e = err(&delta("format = \"delta\"\ncommit = \"sometimes\""));
    assert!(e.contains("sometimes"), "{e}");
}

const LLM: &str = r#"
[dataset]
format = "jsonl"
uri = "file:///data/prompts/"
id_column = "id"
[processor]
name = "llm"
[processor.params]
model = "file:///models/tiny/"
task = "generate"
prompt_column = "prompt"
max_tokens = 64
temperature = 0.0
seed = 7
[llm]
python = "/opt/vllm/bin/python"
engine_args = { max_model_len = 4096, gpu_memory_utilization = 0.9 }
in_flight = 512
group_by_prefix = true
"#;

#[test]
fn an_llm_spec_parses_with_its_engine_table() {
    let spec = JobSpec::from_toml(LLM).expect("valid spec");
    let llm = spec.llm.clone().expect("[llm]");
    assert_eq!(llm.in_flight, 512);
    assert!(llm.group_by_prefix);
    assert_eq!(
        llm.engine_args.get("max_model_len"),
        Some(&serde_json::json!(4096))
    );
    let params = llm::LlmParams::from_params(&spec.processor.params).expect("params");
    assert_eq!(params.task, llm::LlmTask::Generate);
    assert_eq!(params.max_tokens, 64);
    assert_eq!(params.input_column(), "prompt");
    // Through the JSON a coordinator stores and sends to workers.
    assert_eq!(JobSpec::from_json(&spec.to_json()).expect("json"), spec);
}

#[test]
fn llm_mistakes_are_refused_naming_the_key() {
    let cases = [
        (
            LLM.replace("task = \"generate\"", "task = \"chat\""),
            "processor.params.task: unknown variant `chat`",
        ),
        (
            LLM.replace("max_tokens = 64", "max_tokens = \"many\""),
            "processor.params.max_tokens: invalid type",
        ),
        (
            LLM.replace("max_tokens = 64", "max_token = 64"),
            "processor.params.max_token: unknown field `max_token`",
        ),
        (
            LLM.replace("prompt_column = \"prompt\"\n", ""),
            "processor.params.prompt_column: missing",
        ),
        (
            LLM.replace(
                "prompt_column = \"prompt\"",
                "prompt_column = \"prompt\"\nmessages_column = \"m\"",
            ),
            "processor.params.messages_column: give either",
        ),
        (
            LLM.replace("in_flight = 512", "in_flight = 0"),
            "llm.in_flight: must be between 1",
        ),
        (
            LLM.replace("in_flight = 512", "inflight = 512"),
            "llm.inflight: unknown field `inflight`",
        ),
        (
            LLM.replace("temperature = 0.0", "temperature = -1.0"),
            "processor.params.temperature: must be 0",
        ),
        (
            LLM.replace("gpu_memory_utilization = 0.9", "model = \"x\""),
            "llm.engine_args.model: is set by stoke",
        ),
        (
            LLM.replace(
                "id_column = \"id\"",
                "id_column = \"id\"\ncolumns = [\"id\", \"text\"]",
            ),
            "processor.params.prompt_column: \"prompt\" is not among dataset.columns",
        ),
        (
            LLM.replace("task = \"generate\"", "task = \"embed\"")
                .replace("prompt_column", "messages_column"),
            "processor.params.messages_column: task \"embed\" takes plain text",
        ),
        (
            GOOD.to_string() + "[llm]\nin_flight = 4\n",
            "llm: only for the LLM processor",
        ),
    ];
    for (text, want) in cases {
        let got = err(&text);
        assert!(got.contains(want), "{got:?} should contain {want:?}");
    }
}

#[test]
fn an_openai_batch_job_names_its_records_by_custom_id_and_needs_the_llm_processor() {
    let openai = LLM
        .replace("format = \"jsonl\"", "format = \"openai-batch\"")
        .replace("id_column = \"id\"\n", "")
        .replace("prompt_column = \"prompt\"\n", "")
        + "[output]\nformat = \"openai-batch\"\n";
    let spec = JobSpec::from_toml(&openai).expect("valid spec");
    assert_eq!(spec.dataset.format, DatasetFormat::OpenaiBatch);
    assert_eq!(spec.dataset.id_column.as_deref(), Some("custom_id"));
    assert_eq!(spec.output.format, OutputFormat::OpenaiBatch);
    assert_eq!(spec.output.format.extension(), "jsonl");
    assert_eq!(JobSpec::from_json(&spec.to_json()).expect("json"), spec);
    let cases = [
        (
            openai.replace("[dataset]\n", "[dataset]\nid_column = \"id\"\n"),
            "dataset.id_column: an \"openai-batch\" dataset's records are named by \"custom_id\"",
        ),
        (
            openai.replace("model = ", "prompt_column = \"prompt\"\nmodel = "),
            "processor.params.prompt_column: not with dataset format \"openai-batch\"",
        ),
        (
            GOOD.replace("format = \"parquet\"", "format = \"openai-batch\""),
            "dataset.format: \"openai-batch\" is for the LLM processor",
        ),
        (
            GOOD.to_string() + "[output]\nformat = \"openai-batch\"\n",
            "output.format: \"openai-batch\" is for the LLM processor",
        ),
    ];
    for (text, want) in cases {
        let got = err(&text);
        assert!(got.contains(want), "{got:?} should contain {want:?}");
    }
}

#[test]
fn an_llm_model_path_is_relative_to_the_spec_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = LLM.replace(
        "model = \"file:///models/tiny/\"",
        "model = \"models/tiny\"",
    );
    let path = dir.path().join("job.toml");
    std::fs::write(&path, text).expect("write");
    let spec = JobSpec::from_file(&path).expect("spec");
    let model = spec.processor.params["model"].as_str().expect("model");
    assert!(
        model.starts_with("file://") && model.ends_with("/models/tiny"),
        "{model}"
    );
}

#[test]
fn non_finite_numbers_in_a_spec_file_are_refused_by_key_not_dropped() {
    let base = std::path::Path::new("/");
    for (line, words) in [
        (
            "[limits]\nmax_cost = nan",
            "limits.max_cost: must be a positive number, got NaN",
        ),
        (
            "[limits]\nmax_cost = inf",
            "limits.max_cost: must be a positive number, got inf",
        ),
        (
            "[batching.extra]\nscale = [1.0, -inf]",
            "batching.extra.scale[1]: must be a finite number, got -inf",
        ),
    ] {
        let text = format!("{GOOD}{line}\n");
        let e = JobSpec::from_toml_in(&text, base)
            .expect_err(line)
            .to_string();
        assert!(e.contains(words), "{line}: {e}");
        // The straight reading refuses the cap with the same words.
        if line.contains("max_cost") {
            assert!(err(&text).contains(words), "{line}");
        }
    }
    let weight = format!("weight = nan\n{GOOD}");
    let e = JobSpec::from_toml_in(&weight, base)
        .expect_err("nan weight")
        .to_string();
    assert!(e.contains("weight: must be a positive number"), "{e}");
    // A finite cap reads the same both ways.
    let text = format!("{GOOD}[limits]\nmax_cost = 2.5\n");
    let spec = JobSpec::from_toml_in(&text, base).expect("valid");
    assert_eq!(spec.limits.max_cost, Some(2.5));
}

#[test]
fn an_iceberg_output_names_its_table_and_catalog_and_refuses_what_is_wrong() {
    let iceberg = |output: &str| format!("{GOOD}[output]\nformat = \"iceberg\"\n{output}\n");
    let sql = "catalog = { type = \"sql\", uri = \"sqlite:///var/lib/stoke/catalog.db\", warehouse = \"s3://lake/warehouse\" }";
    let spec = JobSpec::from_toml(&iceberg(&format!(
        "table = \"analytics.predictions\"\n{sql}\ncommit = \"checkpoint\""
    )))
    .expect("iceberg spec");
    assert_eq!(spec.output.format.extension(), "parquet");
    assert_eq!(spec.output.table_commit(), Some(DeltaCommit::Checkpoint));
    assert_eq!(spec.output.delta(), None);
    let (table, catalog) = spec.output.iceberg().expect("an iceberg output");
    assert_eq!(table, "analytics.predictions");
    assert_eq!((catalog.kind(), catalog.name()), ("sql", "default"));
    assert_eq!(JobSpec::from_json(&spec.to_json()).expect("json"), spec);
    assert_eq!(
        output::split_table_name("a.b.t").expect("nested"),
        (vec!["a".to_string(), "b".to_string()], "t".to_string())
    );
    let rest = "catalog = { type = \"rest\", uri = \"https://catalog.example/api/catalog\", warehouse = \"prod\", token_env = \"ICEBERG_TOKEN\" }";
    let abfss = "catalog = { type = \"sql\", uri = \"sqlite:///c.db\", warehouse = \"abfss://lake@acct.dfs.core.windows.net/w\" }";
    JobSpec::from_toml(&iceberg(&format!("table = \"a.t\"\n{abfss}"))).expect("abfss");
    let spec = JobSpec::from_toml(&iceberg(&format!("table = \"a.t\"\n{rest}"))).expect("rest");
    assert_eq!(spec.output.table_commit(), Some(DeltaCommit::End));
    let prefixed = "catalog = { type = \"rest\", uri = \"http://127.0.0.1:8181\", properties = { prefix = \"dev\" } }";
    let spec =
        JobSpec::from_toml(&iceberg(&format!("table = \"a.t\"\n{prefixed}"))).expect("properties");
    assert_eq!(JobSpec::from_json(&spec.to_json()).expect("json"), spec);
    for (output, wants) in [
        (sql.to_string(), "output.table: format \"iceberg\" needs the table"),
        ("table = \"a.t\"".to_string(), "output.catalog: format \"iceberg\" needs the catalog"),
        (format!("table = \"predictions\"\n{sql}"), "\"predictions\" has no namespace"),
        (format!("table = \"a..t\"\n{sql}"), "has an empty part"),
        (
            "table = \"a.t\"\ncatalog = { type = \"sql\", uri = \"postgresql://h/db\", warehouse = \"s3://l/w\" }".to_string(),
            "output.catalog.uri: a SQL catalog is an SQLite database",
        ),
        (
            "table = \"a.t\"\ncatalog = { type = \"sql\", uri = \"sqlite:///c.db\", warehouse = \"nowhere\" }".to_string(),
            "output.catalog.warehouse",
        ),
        (
            "table = \"a.t\"\ncatalog = { type = \"sql\", uri = \"sqlite:///c.db\", warehouse = \"az://lake/w\" }".to_string(),
            "output.catalog.warehouse: az://lake/w is stoke's own spelling, which Iceberg readers (Spark, Trino, pyiceberg) do not resolve; write it as abfss://lake@ACCOUNT.dfs.core.windows.net/w",
        ),
        (
            format!("table = \"a.t\"\n{sql}\nuri = \"az://lake/data\""),
            "output.uri: az://lake/data is stoke's own spelling",
        ),
        (
            "table = \"a.t\"\ncatalog = { type = \"hive\", uri = \"thrift://h\" }".to_string(),
            "hive",
        ),
        (
            "table = \"a.t\"\ncatalog = { type = \"sql\", uri = \"sqlite:///c.db\", warehouse = \"s3://l/w\", token = \"x\" }".to_string(),
            "token",
        ),
        (
            "table = \"a.t\"\ncatalog = { type = \"rest\", uri = \"catalog.example\" }".to_string(),
            "output.catalog.uri: must be an http:// or https:// URI",
        ),
        (
            "table = \"a.t\"\ncatalog = { type = \"rest\", uri = \"https://c\", token_env = \"abc-secret-value\" }".to_string(),
            "output.catalog.token_env: names an environment variable",
        ),
        (
            "table = \"a.t\"\ncatalog = { type = \"rest\", uri = \"https://c\", token_env = \"T\", credential_env = \"C\" }".to_string(),
            "give one",
        ),
        (
            "table = \"a.t\"\ncatalog = { type = \"rest\", uri = \"https://c\", properties = { token = \"s3cr3t\" } }".to_string(),
            "output.catalog.properties.token: a secret never goes in a spec",
        ),
    ] {
        let e = err(&iceberg(&output));
        assert!(e.contains(wants), "{output}: {e}");
    }
    let e = err(&format!(
        "{GOOD}[output]\nformat = \"delta\"\nuri = \"s3://b/t\"\ntable = \"a.t\"\n"
    ));
    assert!(
        e.contains("output.table: only for format \"iceberg\", not \"delta\""),
        "{e}"
    );
}
