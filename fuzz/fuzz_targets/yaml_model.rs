//! Any text through the YAML loader, validation, shape inference, the passes, a plan,
//! a forward run and a backward run: errors are fine, panics and hangs are findings.
#![no_main]
use graphrun::Model;
use libfuzzer_sys::fuzz_target;

mod pipeline;

fuzz_target!(|data: &[u8]| {
    pipeline::cap_memory();
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(m) = Model::from_str(text, "/nonexistent") {
        pipeline::run_everything(m.graph);
    }
});
