//! Files graphrun writes: every output goes through `write_atomic`, which lives here,
//! below the IR, so that the loaders and the executor share it without depending on each
//! other.

use crate::error::{Error, Result};
use std::path::Path;

/// Writes a file whole or not at all: into a temporary beside it, then renamed.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp{}", std::process::id()));
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}
