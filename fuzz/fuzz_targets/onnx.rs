//! Any bytes as an .onnx file: protobuf decoding, the importer (opset rewrites,
//! initializers, Constant nodes, attribute reading), validation, shape inference, then the
//! same passes, plan, forward and backward run as `yaml_model`. Errors are fine; panics
//! and hangs are findings. External data resolves against a folder that does not exist,
//! so a file naming some is an error (never a read outside the fuzzer's control).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

mod pipeline;

fuzz_target!(|data: &[u8]| {
    pipeline::cap_memory();
    if let Ok(g) = graphrun::onnx::from_bytes(data, "fuzz", Path::new("/nonexistent")) {
        pipeline::run_everything(g);
    }
});
