//! The job specs the docs print are real specs. Every ```toml block in the
//! repository's Markdown (`README.md` and the other top-level `*.md`
//! files, `deploy/README.md`, `bench/*.md` and the book under `docs/`)
//! that is a job spec, that is one with a `[dataset]` or `[processor]`
//! table, must parse and validate with the real spec code, the two ways a
//! spec reaches a coordinator:
//!
//! - as `stoke submit` and `stoke run` read a spec file
//!   (`JobSpec::from_file`: relative paths resolved against the file's
//!   folder, a Python processor's relative model file checked), from a
//!   copy of the block in a folder of its own;
//! - as the coordinator's submit takes what the CLI sends
//!   (`JobSpec::from_json` of the spec's JSON).
//!
//! Unknown keys are refused (`deny_unknown_fields` on every table but
//! `[processor.params]`, the processor's own), so a misspelled key in an
//! example fails here; `a_misspelled_key_in_an_example_is_caught` shows
//! it. A TOML block that is not a whole spec (a queues file, a
//! `Cargo.toml` fragment, part of a spec) says so with the info string
//! ```toml,fragment, which mdBook highlights as TOML, and is skipped; any
//! other ```toml block fails here, so no example is skipped silently.

use std::path::{Path, PathBuf};

use stoke_core::spec::JobSpec;
use stoke_core::spec::pipeline::SpecFile;

/// A fenced code block of a Markdown file.
struct Block {
    /// The file, relative to the repository, and the line of its opening
    /// fence (from 1).
    place: String,
    /// The info string after the fence: "toml", "toml,fragment", ...
    info: String,
    text: String,
}

impl Block {
    /// The block's language and its attributes (`toml,fragment` gives
    /// "toml" and ["fragment"]).
    fn lang(&self) -> (&str, Vec<&str>) {
        let mut parts = self
            .info
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|p| !p.is_empty());
        let lang = parts.next().unwrap_or_default();
        (lang, parts.collect())
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("core/ has a parent: the repository")
        .to_path_buf()
}

/// The Markdown files whose examples are checked, sorted.
fn markdown_files(repo: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in [repo.to_path_buf(), repo.join("deploy"), repo.join("bench")] {
        let entries =
            std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
        for entry in entries {
            let path = entry
                .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
                .path();
            if path.is_file() && path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    walk_book(&repo.join("docs"), &mut files);
    files.sort();
    files
}

/// Every `*.md` under `dir`, but not in the built book (`docs/book/`).
fn walk_book(dir: &Path, files: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "book") {
                walk_book(&path, files);
            }
        } else if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
}

/// A code block whose closing fence is still to come.
struct Open {
    line: usize,
    indent: usize,
    ticks: usize,
    info: String,
    lines: Vec<String>,
}

/// The fenced code blocks of a Markdown text (``` fences, also indented
/// in list items), with their content un-indented.
fn blocks(name: &str, text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<Open> = None;
    for (n, line) in text.lines().enumerate() {
        // Spaces and tabs are one byte each, and so are backticks: `indent`
        // and `ticks` are char boundaries.
        let trimmed = line.trim_start_matches([' ', '\t']);
        let indent = line.len() - trimmed.len();
        let ticks = trimmed.chars().take_while(|&c| c == '`').count();
        let rest = &trimmed[ticks..];
        if let Some(block) = &mut open {
            if ticks < block.ticks || !rest.trim().is_empty() {
                let strip = indent.min(block.indent);
                block.lines.push(line[strip..].to_string());
                continue;
            }
        } else {
            if ticks >= 3 {
                open = Some(Open {
                    line: n + 1,
                    indent,
                    ticks,
                    info: rest.trim().to_string(),
                    lines: Vec::new(),
                });
            }
            continue;
        }
        // The open block's closing fence.
        if let Some(block) = open.take() {
            out.push(Block {
                place: format!("{name}:{}", block.line),
                info: block.info,
                text: block.lines.join("\n") + "\n",
            });
        }
    }
    if let Some(block) = open {
        panic!("{name}:{}: a code block that is never closed", block.line);
    }
    out
}

/// Whether a TOML text is a job spec: it has a `[dataset]` or
/// `[processor]` table, or `[[stage]]` tables (a pipeline's).
fn is_spec(text: &str) -> Result<bool, String> {
    let value: serde_json::Value =
        toml::from_str(text).map_err(|e| format!("not TOML: {}", e.message()))?;
    Ok(value.get("dataset").is_some()
        || value.get("processor").is_some()
        || value.get("stage").is_some())
}

/// Parses and validates a printed spec as `stoke submit` reads a spec file
/// (from a copy in a folder of its own), then as the coordinator takes the
/// JSON the CLI sends. The first error, as the user would see it.
fn check_spec(text: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temporary folder: {e}"))?;
    let path = dir.path().join("job.toml");
    std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    match SpecFile::read(&path).map_err(|e| format!("stoke submit: {e}"))? {
        SpecFile::Job(spec) => {
            JobSpec::from_json(&spec.to_json()).map_err(|e| format!("the coordinator: {e}"))?;
        }
        // Each stage as the coordinator takes it.
        SpecFile::Pipeline(pipeline) => {
            for (job_id, spec) in pipeline.stage_jobs("doc-00000000") {
                JobSpec::from_json(&spec.to_json())
                    .map_err(|e| format!("the coordinator, stage job {job_id}: {e}"))?;
            }
        }
    }
    Ok(())
}

/// What the test says of one ```toml block: `Ok(true)` a spec that passed,
/// `Ok(false)` a fragment, `Err` what is wrong with it.
fn check_block(block: &Block) -> Result<bool, String> {
    let (_, attrs) = block.lang();
    if attrs.contains(&"fragment") {
        return Ok(false);
    }
    if !is_spec(&block.text)? {
        return Err(
            "a ```toml block that is not a job spec (no [dataset] or [processor] table): \
             mark it ```toml,fragment"
                .to_string(),
        );
    }
    check_spec(&block.text)?;
    Ok(true)
}

fn toml_blocks(repo: &Path) -> Vec<Block> {
    let mut out = Vec::new();
    for file in markdown_files(repo) {
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let name = file
            .strip_prefix(repo)
            .unwrap_or(&file)
            .display()
            .to_string();
        out.extend(
            blocks(&name, &text)
                .into_iter()
                .filter(|b| b.lang().0 == "toml"),
        );
    }
    out
}

#[test]
fn every_job_spec_in_the_docs_parses_and_validates() {
    let repo = repo();
    let blocks = toml_blocks(&repo);
    let mut specs = Vec::new();
    let mut failures = Vec::new();
    for block in &blocks {
        match check_block(block) {
            Ok(true) => specs.push(block.place.clone()),
            Ok(false) => {}
            Err(e) => failures.push(format!("{}: {e}", block.place)),
        }
    }
    assert!(
        failures.is_empty(),
        "job specs in the docs that stoke would refuse:\n{}",
        failures.join("\n")
    );
    // The extraction found what the docs hold: the README's example, the
    // first job, the Python users' spec and the reference at least.
    for page in [
        "README.md",
        "docs/src/getting-started/first-job.md",
        "docs/src/getting-started/python.md",
        "docs/src/guide/spec.md",
    ] {
        assert!(
            specs.iter().any(|s| s.starts_with(&format!("{page}:"))),
            "no job spec checked in {page}; checked: {specs:?}"
        );
    }
}

#[test]
fn a_misspelled_key_in_an_example_is_caught() {
    let repo = repo();
    let blocks = toml_blocks(&repo);
    let example = blocks
        .iter()
        .find(|b| b.place.starts_with("README.md:") && check_block(b) == Ok(true))
        .expect("the README has a job spec that passes");
    // A key misspelled in a table of the spec, and at its top level.
    for (from, to, named) in [
        ("format = ", "fromat = ", "fromat"),
        (
            "[checkpoint]\ninterval",
            "[checkpoint]\nintervall",
            "intervall",
        ),
        ("[dataset]", "nmae = \"x\"\n[dataset]", "nmae"),
    ] {
        assert!(
            example.text.contains(from),
            "{}: the example no longer holds {from:?}",
            example.place
        );
        let broken = Block {
            place: example.place.clone(),
            info: example.info.clone(),
            text: example.text.replacen(from, to, 1),
        };
        match check_block(&broken) {
            Err(e) => assert!(e.contains(named), "{named}: {e}"),
            Ok(_) => panic!("{named} was accepted:\n{}", broken.text),
        }
    }
    // A block that is not a spec must say it is a fragment.
    let queues = Block {
        place: "test".to_string(),
        info: "toml".to_string(),
        text: "[queues]\nteam-a = 8\n".to_string(),
    };
    assert!(check_block(&queues).is_err());
    let fragment = Block {
        info: "toml,fragment".to_string(),
        ..queues
    };
    assert_eq!(check_block(&fragment), Ok(false));
}

#[test]
fn fences_in_list_items_are_found_and_unindented() {
    let text =
        "- a step:\n\n  ```toml\n  [dataset]\n  format = \"range\"\n  ```\n\n```sh\nls\n```\n";
    let found = blocks("x.md", text);
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].place, "x.md:3");
    assert_eq!(found[0].lang(), ("toml", vec![]));
    assert_eq!(found[0].text, "[dataset]\nformat = \"range\"\n");
    assert_eq!(found[1].lang().0, "sh");
}
