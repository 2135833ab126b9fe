//! The pass pipeline on valid-but-random graphs (graphrun::testing::random_graph): the
//! optimized graph must validate and compute the same outputs and gradients (f64).
#![no_main]
use graphrun::passes::{optimize, PassOptions};
use graphrun::{Session, SessionOptions, Tensor};
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

/// Relative difference; 0 where the reference overflowed (inf − inf is no finding).
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    if b.to_f64_vec().iter().any(|v| !v.is_finite()) {
        return 0.0;
    }
    let (num, den) = graphrun::testing::l2_diff_and_norm(a, b);
    num / den.max(1e-6)
}

fuzz_target!(|data: &[u8]| {
    let (g, feeds) = graphrun::testing::random_graph(data, 32);
    graphrun::validate(&g).expect("the generator makes valid graphs");
    let (opt, _) = optimize(&g, &PassOptions::default()).expect("passes succeed on valid graphs");
    graphrun::validate(&opt).expect("passes leave the graph valid");
    let run = |g: &graphrun::Graph| {
        let mut s = Session::new(g.clone(), SessionOptions::unfused()).unwrap();
        let b = s.backward(&feeds, &HashMap::new()).unwrap();
        (b.outputs, b.grads)
    };
    let (o1, g1) = run(&g);
    let (o2, g2) = run(&opt);
    for ((n, a), (_, b)) in o1.iter().zip(&o2) {
        let e = rel(b, a);
        assert!(e <= 1e-9, "output {n}: {e}");
    }
    let og: HashMap<&str, &Tensor> = g2.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for (n, a) in &g1 {
        match og.get(n.as_str()) {
            Some(b) => {
                let e = rel(b, a);
                assert!(e <= 1e-9, "gradient of {n}: {e}");
            }
            None => assert!(
                a.to_f64_vec().iter().all(|&v| v == 0.0),
                "{n} removed but has a gradient"
            ),
        }
    }
});
