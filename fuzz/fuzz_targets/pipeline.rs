//! What every model-file target does after a file has loaded: random inputs, the passes,
//! a plan, a forward run and a backward run. Errors are fine; panics and hangs are
//! findings. Shared by `yaml_model` and `onnx` (included with `mod pipeline;`).
use graphrun::passes::{optimize, PassOptions};
use graphrun::{Graph, Model, Session, SessionOptions};
use std::collections::BTreeMap;

/// Keeps every run small: a model may ask for at most 16 MiB per tensor and plan.
pub fn cap_memory() {
    graphrun::tensor::set_max_bytes(16 << 20);
}

pub fn run_everything(graph: Graph) {
    let m = Model { graph };
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
        ..SessionOptions::unfused()
    };
    if let Ok(mut s) = Session::new(g, opts) {
        let _ = s.run(&feeds);
        let _ = s.backward(&feeds, &Default::default());
        // Inputs whose values decide shapes (a Reshape's shape, Slice's starts, a
        // window's pads, ...) are fed again with other values: the session makes a plan
        // per value, and each must hold.
        if !graphrun::graph::infer::plan_time_inputs(s.graph()).is_empty() {
            if let Ok(other) = m.random_inputs(1, &Default::default()) {
                let _ = s.run(&other);
            }
        }
    }
}
