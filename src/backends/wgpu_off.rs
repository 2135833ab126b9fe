//! Stands in for the WebGPU backend when graphrun is built without the `wgpu` feature
//! (`cargo build --no-default-features`): the entry points that ask about the adapter,
//! each answering that it was not built in, so that callers (the CLI, `doctor`, tests
//! that skip without an adapter) need no feature checks of their own.

use crate::error::Result;
use crate::tensor::DType;

/// Why there is no WebGPU adapter: the one line every caller reports.
pub const NOT_BUILT: &str =
    "graphrun was built without the wgpu feature (rebuild with `--features wgpu`)";

/// Whether a wgpu adapter is present: never, in this build (`NOT_BUILT`).
pub fn available() -> Result<()> {
    crate::bail!(Runtime, "{NOT_BUILT}")
}

/// Lines for `graphrun doctor`: the backend is not built.
pub fn doctor_lines() -> Vec<String> {
    vec![format!("not available: {NOT_BUILT}")]
}

/// Whether float kernels run in `dt`: in no dtype, in this build.
pub fn supports_float(_dt: DType) -> bool {
    false
}
