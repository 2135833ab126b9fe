//! Stands in for the CUDA backend when graphrun is built without the `cuda` feature
//! (`cargo build --no-default-features`): the entry points that ask about the device,
//! each answering that it was not built in, so that callers (the CLI, `doctor`, tests
//! that skip without a GPU) need no feature checks of their own.

/// Why there is no CUDA device: the one line every caller reports.
pub const NOT_BUILT: &str =
    "graphrun was built without the cuda feature (rebuild with `--features cuda`)";

/// Whether a CUDA device is usable: never, in this build (`NOT_BUILT`).
pub fn available() -> std::result::Result<(), String> {
    Err(NOT_BUILT.into())
}

/// The number of CUDA devices: none, in this build.
pub fn device_count() -> usize {
    0
}

/// Lines for `graphrun doctor`: the backend is not built.
pub fn doctor_lines() -> Vec<String> {
    vec![format!("not available: {NOT_BUILT}")]
}

/// Whether cuDNN's convolutions are at hand: never without the cuda feature.
pub fn cudnn_found() -> bool {
    false
}
