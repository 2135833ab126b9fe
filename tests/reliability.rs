//! Reliability (issue 8): graph algorithms without recursion on huge graphs, bit-identical
//! results on repeated runs, and no memory growth over many training steps.

use graphrun::passes::{optimize, PassOptions};
use graphrun::{Model, Session, SessionOptions, Tensor};
use std::collections::{BTreeMap, HashMap};

/// A chain of `n` nodes (Identity, Neg and Relu in turn) on a [4] input.
fn chain(n: usize) -> String {
    let mut y = String::from(
        "graphrun: 1\ninputs: [{name: x0, dtype: f32, shape: [4]}]\noutputs: [y]\nnodes:\n",
    );
    for i in 0..n {
        let op = ["Identity", "Neg", "Relu"][i % 3];
        let out = if i + 1 == n {
            "y".to_string()
        } else {
            format!("x{}", i + 1)
        };
        y.push_str(&format!(
            "  - {{op: {op}, inputs: [x{i}], outputs: [{out}]}}\n"
        ));
    }
    y
}

#[test]
fn a_100k_node_chain_loads_passes_and_runs_on_a_small_stack() {
    // A small stack: any recursion over the graph's depth would overflow it.
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(|| {
            let n = 100_000;
            let m = Model::from_str(&chain(n), ".").unwrap();
            let (g, report) = optimize(&m.graph, &PassOptions::default()).unwrap();
            // Every Identity is gone; the Neg/Relu pairs stay.
            assert!(g.nodes.len() < n * 3 / 4, "{} nodes left", g.nodes.len());
            assert!(report.total() >= n / 3, "{report}");
            let x = Tensor::from_vec(&[4], vec![-2f32, -0.5, 0.5, 2.0]).unwrap();
            let feeds: HashMap<String, Tensor> = [("x0".to_string(), x)].into();
            let mut s = Session::new(g, SessionOptions::unfused()).unwrap();
            let y = s.run(&feeds).unwrap().remove(0).1.to_f64_vec();
            // 33 334 Neg/Relu pairs: relu(-v) then relu(v) of that... both signs end at 0
            // after the first Neg+Relu+Neg+Relu round trip.
            assert!(y.iter().all(|&v| v == 0.0), "{y:?}");
        })
        .unwrap()
        .join()
        .unwrap();
}

fn gpt_small() -> (Model, HashMap<String, Tensor>, BTreeMap<String, usize>) {
    let m = Model::load("models/gpt_block.yaml").unwrap();
    let dims: BTreeMap<String, usize> = [("batch".into(), 1), ("seq".into(), 8)].into();
    let feeds = m.random_inputs(3, &dims).unwrap();
    (m, feeds, dims)
}

fn fused(m: &Model, training: bool) -> graphrun::Graph {
    let opts = PassOptions {
        training,
        ..Default::default()
    };
    optimize(&m.graph, &opts).unwrap().0
}

#[test]
fn same_model_seed_and_backend_give_bit_identical_results() {
    let (m, feeds, dims) = gpt_small();
    let opts = SessionOptions {
        dims,
        ..SessionOptions::unfused()
    };
    let run = || {
        let mut s = Session::new(fused(&m, false), opts.clone()).unwrap();
        let g = s.backward(&feeds, &HashMap::new()).unwrap();
        g.outputs
            .into_iter()
            .chain(g.grads)
            .map(|(n, t)| (n, t.bytes().to_vec()))
            .collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run(), "forward+backward differs between two sessions");
    // Training: the same steps give the same weights, bit for bit.
    let train = || {
        let mut s = Session::new(fused(&m, true), opts.clone()).unwrap();
        let losses: Vec<u64> = (0..3)
            .map(|_| s.train_step(&feeds).unwrap().to_bits())
            .collect();
        let w: Vec<Vec<u8>> = s
            .trained_graph()
            .unwrap()
            .initializers
            .iter()
            .map(|i| i.tensor.bytes().to_vec())
            .collect();
        (losses, w)
    };
    assert_eq!(train(), train(), "training differs between two sessions");
}

/// Resident memory of this process in bytes.
fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// models/gpt_block.yaml's graph, unchanged, at hidden size 64 (4 heads of 16): the same
/// ops and fusions, small enough for 10 000 steps in CI.
fn gpt_tiny() -> (Model, HashMap<String, Tensor>, BTreeMap<String, usize>) {
    let text = std::fs::read_to_string("models/gpt_block.yaml")
        .unwrap()
        .replace("4096", "256")
        .replace("3072", "192")
        .replace("1024", "64")
        .replace("values: [0, 0, 16, 64]", "values: [0, 0, 4, 16]")
        .replace("values: [8.0]", "values: [4.0]");
    let m = Model::from_str(&text, ".").unwrap();
    let dims: BTreeMap<String, usize> = [("batch".into(), 2), ("seq".into(), 16)].into();
    let feeds = m.random_inputs(3, &dims).unwrap();
    (m, feeds, dims)
}

#[test]
fn ten_thousand_training_steps_do_not_grow_memory() {
    let (m, feeds, dims) = gpt_tiny();
    let opts = SessionOptions {
        dims,
        ..SessionOptions::unfused()
    };
    let g = fused(&m, true);
    assert_eq!(
        g.op_counts().get("Attention"),
        Some(&1),
        "the tiny block fuses like the real one"
    );
    let mut s = Session::new(g, opts).unwrap();
    // Warm up: plans, slot buffers and optimizer state are made on the first steps.
    for _ in 0..20 {
        s.train_step(&feeds).unwrap();
    }
    let before = rss();
    let steps: usize = std::env::var("GRAPHRUN_SOAK_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    for _ in 0..steps {
        let l = s.train_step(&feeds).unwrap();
        assert!(l.is_finite());
    }
    let after = rss();
    if before > 0 {
        let grown = after.saturating_sub(before);
        assert!(
            grown < 16 << 20,
            "resident memory grew by {grown} bytes over {steps} steps ({before} -> {after})"
        );
    }
}
