//! Any text through the YAML loader, validation, shape inference, the passes, a plan,
//! a forward run and a backward run: errors are fine, panics and hangs are findings.
#![no_main]
use graphrun::passes::{optimize, PassOptions};
use graphrun::{Model, Session, SessionOptions};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

fuzz_target!(|data: &[u8]| {
    // Keep every run small: a model may ask for at most 16 MiB per tensor and plan.
    graphrun::tensor::set_max_bytes(16 << 20);
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(m) = Model::from_str(text, "/nonexistent") else {
        return;
    };
    // Symbols the model leaves open are bound small.
    let dims: BTreeMap<String, usize> = m.graph.symbols().into_iter().map(|s| (s, 2)).collect();
    let Ok(feeds) = m.random_inputs(0, &dims) else {
        return;
    };
    let Ok((g, _)) = optimize(&m.graph, &PassOptions::default()) else {
        return;
    };
    let opts = SessionOptions {
        dims,
        ..Default::default()
    };
    if let Ok(mut s) = Session::new(g, opts) {
        let _ = s.run(&feeds);
        let _ = s.backward(&feeds, &Default::default());
    }
});
