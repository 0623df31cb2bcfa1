//! The `stoke` Python package's own tests (python/tests, pytest): the
//! Client against a real coordinator and worker, and
//! `stoke.torch_batch_process` against `stoke run --embedded`. Run here so
//! `cargo test` (and so CI) runs them; the package must be installed in the
//! venv first (scripts/python-package.sh, which scripts/test.sh runs).

use std::process::Command;
use std::time::Duration;

use stoke_tests::*;

#[test]
fn the_python_packages_tests_pass() {
    let check = Command::new(python())
        .args(["-c", "import stoke, stoke._native, pytest"])
        .output()
        .expect("python");
    assert!(
        check.status.success(),
        "the stoke package (or pytest) is not installed in the venv: run scripts/python-package.sh\n{}",
        text(&check.stderr)
    );
    let bin_dir = bin("stoke-worker").parent().expect("bin dir").to_path_buf();
    let mut cmd = Command::new(python());
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(repo_root().join("python/tests"))
        .env("STOKE_BIN_DIR", &bin_dir)
        .env("STOKE_TEST_FIXTURE", fixture())
        .current_dir(repo_root().join("python/tests"));
    let out = output_within(cmd, Duration::from_secs(600));
    let stdout = text(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "pytest failed:\n{stdout}\n{}",
        text(&out.stderr)
    );
}
