//! Scratch folders for the tests that write files (included with `#[path]`, so that a test
//! file needs nothing else of the harness).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A fresh, empty folder for one test: `graphrun_<binary>_<tag>_<pid>` in the temp dir.
pub fn tmpdir(tag: &str) -> PathBuf {
    let exe = std::env::current_exe().ok();
    let bin = exe
        .as_ref()
        .and_then(|p| p.file_stem())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let bin = bin.split('-').next().unwrap_or("test");
    let d = std::env::temp_dir().join(format!("graphrun_{bin}_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The names in folder `d`, sorted (empty when it does not exist).
pub fn files_in(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .map(|r| {
            r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
