//! Property test of the pass pipeline on random well-typed graphs (graphrun::testing):
//! every pass leaves the graph valid, and the optimized graph computes the same outputs
//! and the same gradients as the graph as written.

use graphrun::graph::validate::validate;
use graphrun::passes::{optimize, PassOptions};
use graphrun::rng::Rng;
use graphrun::testing::random_graph;
use graphrun::{Session, SessionOptions, Tensor};
use std::collections::HashMap;

/// ‖a − b‖ / ‖b‖, with a floor under ‖b‖: a gradient that is zero in exact arithmetic
/// (a Softmax's input summed along its axis, say) is rounding noise in both graphs.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    let num: f64 = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q) * (p - q))
        .sum::<f64>()
        .sqrt();
    let den: f64 = y.iter().map(|q| q * q).sum::<f64>().sqrt();
    if x.iter().chain(&y).any(|v| v.is_nan()) {
        return f64::NAN;
    }
    num / den.max(1e-6)
}

/// Checks one random graph; returns what the passes did.
pub fn check(bytes: &[u8]) -> graphrun::passes::Report {
    let (g, feeds) = random_graph(bytes, 24);
    // A failing graph is also written out, to replay with the CLI (--disable-pass ...).
    let _ =
        graphrun::graph::yaml::save(&g, &std::env::temp_dir().join("graphrun_random_last.yaml"));
    validate(&g).unwrap_or_else(|e| panic!("generator made an invalid graph: {e}\n{g:#?}"));
    let (opt, report) = optimize(&g, &PassOptions::default())
        .unwrap_or_else(|e| panic!("passes failed: {e}\n{g:#?}"));
    validate(&opt).unwrap();
    let run = |g: &graphrun::Graph| {
        let mut s = Session::new(g.clone(), SessionOptions::default()).unwrap();
        let b = s.backward(&feeds, &HashMap::new()).unwrap();
        (b.outputs, b.grads)
    };
    let (o1, g1) = run(&g);
    let (o2, g2) = run(&opt);
    let opt_grads: HashMap<&str, &Tensor> = g2.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for ((name, a), (_, b)) in o1.iter().zip(&o2) {
        let e = rel(b, a);
        // NaN never passes; the graphs compute in f64.
        assert!(
            e <= 1e-9,
            "output '{name}' differs by {e} after the passes ({report})\n{g:#?}"
        );
    }
    for (name, a) in &g1 {
        match opt_grads.get(name.as_str()) {
            Some(b) => {
                let e = rel(b, a);
                assert!(
                    e <= 1e-9,
                    "gradient of '{name}' differs by {e} after the passes ({report})\n{g:#?}"
                );
            }
            // Dead-node elimination dropped a weight no output reads: its gradient is 0.
            None => assert!(
                a.to_f64_vec().iter().all(|&v| v == 0.0),
                "'{name}' was removed by the passes but has a gradient\n{g:#?}"
            ),
        }
    }
    report
}

#[test]
fn passes_keep_random_graphs_valid_and_equivalent() {
    let mut fired = 0;
    let mut rules: std::collections::BTreeMap<&str, usize> = Default::default();
    for seed in 0..600u64 {
        let mut r = Rng::new(seed);
        let bytes: Vec<u8> = (0..64).map(|_| r.next_u64() as u8).collect();
        let report = check(&bytes);
        fired += report.total();
        for p in &report.passes {
            for (k, v) in &p.rules {
                *rules.entry(k).or_default() += v;
            }
        }
    }
    eprintln!("rules fired over 600 random graphs: {rules:?}");
    // Fusion, not only cleanup, is exercised.
    assert!(
        rules.get("matmul_epilogue").copied().unwrap_or(0) > 50,
        "{rules:?}"
    );
    // The generator makes graphs the passes do rewrite.
    assert!(fired > 600, "only {fired} rewrites in 600 graphs");
}
