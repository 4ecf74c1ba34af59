//! What the integration tests share: a test that needs the environment the
//! allocator reads once at start-up re-runs itself in a child process with
//! it set; and the one pseudo-random generator.

#![allow(dead_code, unused_imports)]

use std::process::Command;

#[path = "../../src/rng.rs"]
pub mod rng;
pub use rng::Rng;

/// Whether this process is a test's child, re-run by [`rerun`].
pub fn in_child() -> bool {
    std::env::var_os("NUMAWEAVE_TEST_CHILD").is_some()
}

/// Runs the test `test` of this binary again in a child process with
/// `env` set (a `None` value removes the variable); prints what it printed
/// and asserts that it passed and said `expect`. Returns its output.
pub fn rerun(test: &str, env: &[(&str, Option<&str>)], expect: &str) -> String {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads=1"]).env("NUMAWEAVE_TEST_CHILD", "1");
    for &(k, v) in env {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    print!("{text}");
    assert!(out.status.success(), "{test} failed in its child, with {env:?}");
    assert!(text.contains(expect), "{test}: the child did not say {expect:?}");
    text
}

/// A test cannot run here (a tool, a kernel feature missing): said on the
/// terminal, past the test harness's capture, and a failure where
/// `NUMAWEAVE_TEST_STRICT` is set (CI sets it: there nothing may be
/// skipped).
pub fn cannot_run(why: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
    assert!(std::env::var_os("NUMAWEAVE_TEST_STRICT").is_none(), "{why}, and NUMAWEAVE_TEST_STRICT is set");
}
