//! Property test of the pass pipeline on random well-typed graphs (graphrun::testing):
//! every pass leaves the graph valid, and the optimized graph computes the same outputs
//! and the same gradients as the graph as written.

use graphrun::passes::{optimize, PassOptions};
use graphrun::rng::Rng;
use graphrun::testing::random_graph;
use graphrun::validate;
use graphrun::{Session, SessionOptions, Tensor};
use std::collections::HashMap;

/// ‖a − b‖ / ‖b‖, with a floor under ‖b‖: a gradient that is zero in exact arithmetic
/// (a Softmax's input summed along its axis, say) is rounding noise in both graphs.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    let (num, den) = graphrun::testing::l2_diff_and_norm(a, b);
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
        let mut s = Session::new(g.clone(), SessionOptions::unfused()).unwrap();
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

/// The rule logged in `line` fired at a Gemm of the graph made from `bytes`.
fn gemm_node(bytes: &[u8], line: &str) -> bool {
    let (g, _) = random_graph(bytes, 24);
    g.nodes
        .iter()
        .any(|n| n.op.name() == "Gemm" && line.ends_with(&format!("at '{}'", n.name)))
}

#[test]
fn passes_keep_random_graphs_valid_and_equivalent() {
    let (mut fired, mut gemm_fused) = (0, 0);
    let mut rules: std::collections::BTreeMap<&str, usize> = Default::default();
    let mut ops: std::collections::BTreeMap<&str, usize> = Default::default();
    for seed in 0..600u64 {
        let mut r = Rng::new(seed);
        let bytes: Vec<u8> = (0..64).map(|_| r.next_u64() as u8).collect();
        let report = check(&bytes);
        let (g, _) = random_graph(&bytes, 24);
        for n in &g.nodes {
            *ops.entry(n.op.name()).or_default() += 1;
        }
        gemm_fused += report
            .log
            .iter()
            .filter(|l| l.contains("matmul_epilogue at 'n") && gemm_node(&bytes, l))
            .count();
        fired += report.total();
        for p in &report.passes {
            for (k, v) in &p.rules {
                *rules.entry(k).or_default() += v;
            }
        }
    }
    eprintln!("rules fired over 600 random graphs: {rules:?}; at a Gemm: {gemm_fused}");
    // Fusion, not only cleanup, is exercised.
    assert!(
        rules.get("matmul_epilogue").copied().unwrap_or(0) > 50,
        "{rules:?}"
    );
    // Gemm with its attributes is generated and fused too.
    assert!(gemm_fused > 20, "{gemm_fused} Gemms fused");
    // Sliding windows (convolutions and pools as the importer writes them) are among them.
    eprintln!("ops generated: {ops:?}");
    for op in ["Im2Col", "Col2Im"] {
        assert!(ops.get(op).copied().unwrap_or(0) > 10, "{op}: {ops:?}");
    }
    // The generator makes graphs the passes do rewrite.
    assert!(fired > 600, "only {fired} rewrites in 600 graphs");
}

// ------------------------------------------------------------ random attention patterns

/// A random attention subgraph as exporters write it, in f64: K transposed as
/// `[B, H, S, D]` or split from `[B, S, H, D]` with perm [0, 2, 3, 1]; grouped-query K/V
/// repeated by repeat_kv, one kv head expanded or broadcast; the scale as Div, Mul either
/// order, on Q and K, or none; no mask, an additive mask, a bool keep-mask in Where, a
/// constant causal mask, the Trilu causal chain; sometimes an intermediate that is also a
/// graph output (which must block the fusion); sometimes the head merge and an
/// out-projection with bias, an activation (single op or expanded) and a residual.
fn attention_graph(r: &mut Rng) -> String {
    let mut pick = |n: usize| (r.next_u64() % n as u64) as usize;
    let (b, s, d) = (2, 5, 4);
    let hq = [2, 4][pick(2)];
    let bshd = pick(4) == 0;
    // kv heads and how they reach hq: 0 none, 1 repeat_kv, 2 Expand of one head, 3 broadcast.
    let kv = if bshd { 0 } else { pick(4) };
    let hkv = [hq, hq / 2, 1, 1][kv];
    let mut nodes: Vec<String> = vec![];
    let mut n = |s: String| nodes.push(format!("  - {s}"));
    let mut inputs = vec![format!(
        "{{name: q, dtype: f64, shape: [{b}, {hq}, {s}, {d}]}}"
    )];
    let kshape = if bshd {
        format!("[{b}, {s}, {hq}, {d}]")
    } else {
        format!("[{b}, {hkv}, {s}, {d}]")
    };
    inputs.push(format!("{{name: k0, dtype: f64, shape: {kshape}}}"));
    inputs.push(format!(
        "{{name: v0, dtype: f64, shape: [{b}, {hkv}, {s}, {d}]}}"
    ));
    let mut inits = vec![
        "{name: c, dtype: f64, shape: [], values: [0.35], trainable: false}".to_string(),
        "{name: one, dtype: f64, shape: [], values: [1.0], trainable: false}".into(),
        "{name: neg, dtype: f64, shape: [], values: [-1.0e9], trainable: false}".into(),
        format!(
            "{{name: rep, dtype: i64, shape: [5], values: [1, 1, {}, 1, 1]}}",
            hq / hkv
        ),
        format!("{{name: rep1, dtype: i64, shape: [4], values: [1, {hq}, 1, 1]}}"),
        format!("{{name: heads, dtype: i64, shape: [4], values: [{b}, {hq}, {s}, {d}]}}"),
    ];
    for x in ["k", "v"] {
        match kv {
            1 => {
                n(format!(
                    "{{op: Unsqueeze, inputs: [{x}0], outputs: [{x}u], attrs: {{axes: [2]}}}}"
                ));
                n(format!(
                    "{{op: Expand, inputs: [{x}u, rep], outputs: [{x}e]}}"
                ));
                n(format!(
                    "{{op: Reshape, inputs: [{x}e, heads], outputs: [{x}]}}"
                ));
            }
            2 => n(format!(
                "{{op: Expand, inputs: [{x}0, rep1], outputs: [{x}]}}"
            )),
            _ => n(format!("{{op: Identity, inputs: [{x}0], outputs: [{x}]}}")),
        }
    }
    let scale = pick(5);
    let (q, k) = if scale == 4 {
        n("{op: Mul, inputs: [q, c], outputs: [qs]}".into());
        n("{op: Mul, inputs: [c, k], outputs: [ks]}".into());
        ("qs", "ks")
    } else {
        ("q", "k")
    };
    let perm = if bshd { "[0, 2, 3, 1]" } else { "[0, 1, 3, 2]" };
    n(format!(
        "{{op: Transpose, inputs: [{k}], outputs: [kt], attrs: {{perm: {perm}}}}}"
    ));
    n(format!("{{op: MatMul, inputs: [{q}, kt], outputs: [s0]}}"));
    match scale {
        0 => n("{op: Div, inputs: [s0, c], outputs: [s1]}".into()),
        1 => n("{op: Mul, inputs: [s0, c], outputs: [s1]}".into()),
        2 => n("{op: Mul, inputs: [c, s0], outputs: [s1]}".into()),
        _ => n("{op: Identity, inputs: [s0], outputs: [s1]}".into()),
    }
    match pick(5) {
        0 => {
            inputs.push(format!(
                "{{name: m, dtype: f64, shape: [{b}, 1, {s}, {s}]}}"
            ));
            n("{op: Add, inputs: [s1, m], outputs: [z]}".into());
        }
        1 => {
            inputs.push(format!("{{name: m, dtype: f64, shape: [{b}, 1, 1, {s}]}}"));
            n("{op: Greater, inputs: [m, neg], outputs: [keep]}".into());
            n("{op: Where, inputs: [keep, s1, neg], outputs: [z]}".into());
        }
        2 => {
            let v: Vec<String> = (0..s * s)
                .map(|i| if i % s <= i / s { "0" } else { "-1.0e9" }.to_string())
                .collect();
            inits.push(format!(
                "{{name: cm, dtype: f64, shape: [{s}, {s}], values: [{}], trainable: false}}",
                v.join(", ")
            ));
            n("{op: Add, inputs: [cm, s1], outputs: [z]}".into());
        }
        3 => {
            n("{op: Shape, inputs: [s1], outputs: [ss], attrs: {start: -2}}".into());
            n("{op: Expand, inputs: [one, ss], outputs: [ones]}".into());
            n("{op: Trilu, inputs: [ones], outputs: [tril], attrs: {upper: 0}}".into());
            n("{op: Cast, inputs: [tril], outputs: [keep], attrs: {to: bool}}".into());
            n("{op: Where, inputs: [keep, s1, neg], outputs: [z]}".into());
        }
        _ => n("{op: Identity, inputs: [s1], outputs: [z]}".into()),
    }
    n("{op: Softmax, inputs: [z], outputs: [p], attrs: {axis: -1}}".into());
    n("{op: MatMul, inputs: [p, v], outputs: [o]}".into());
    let mut outputs = vec!["o".to_string()];
    if pick(2) == 0 {
        // Head merge and an out-projection epilogue.
        let hd = hq * d;
        inits.push(format!(
            "{{name: merged, dtype: i64, shape: [3], values: [{b}, {s}, {hd}]}}"
        ));
        inits.push(format!(
            "{{name: w, dtype: f64, shape: [{hd}, {hd}], init: {{dist: xavier_uniform, seed: 3}}}}"
        ));
        inits.push(format!("{{name: bias, dtype: f64, shape: [{hd}], init: {{dist: uniform, low: -1, high: 1, seed: 4}}}}"));
        inputs.push(format!(
            "{{name: res, dtype: f64, shape: [{b}, {s}, {hd}]}}"
        ));
        n("{op: Transpose, inputs: [o], outputs: [ot], attrs: {perm: [0, 2, 1, 3]}}".into());
        n("{op: Reshape, inputs: [ot, merged], outputs: [om]}".into());
        n("{op: MatMul, inputs: [om, w], outputs: [h0]}".into());
        n("{op: Add, inputs: [bias, h0], outputs: [h1]}".into());
        match pick(4) {
            0 => n("{op: Relu, inputs: [h1], outputs: [h2]}".into()),
            1 => {
                n("{op: Sigmoid, inputs: [h1], outputs: [sg]}".into());
                n("{op: Mul, inputs: [sg, h1], outputs: [h2]}".into());
            }
            2 => {
                inits.push(
                    "{name: half, dtype: f64, shape: [], values: [0.5], trainable: false}".into(),
                );
                inits.push("{name: sqrt2, dtype: f64, shape: [], values: [1.4142135623730951], trainable: false}".into());
                n("{op: Div, inputs: [h1, sqrt2], outputs: [e0]}".into());
                n("{op: Erf, inputs: [e0], outputs: [e1]}".into());
                n("{op: Add, inputs: [one, e1], outputs: [e2]}".into());
                n("{op: Mul, inputs: [h1, half], outputs: [e3]}".into());
                n("{op: Mul, inputs: [e3, e2], outputs: [h2]}".into());
            }
            _ => n("{op: Identity, inputs: [h1], outputs: [h2]}".into()),
        }
        n("{op: Add, inputs: [res, h2], outputs: [y]}".into());
        outputs = vec!["y".into()];
    }
    // An intermediate also needed outside: the fusion must leave it computable.
    if pick(4) == 0 {
        let all = ["s0", "s1", "z", "p", "k", "kt"];
        outputs.push(all[pick(all.len())].to_string());
    }
    format!(
        "graphrun: 1\nname: random_attention\ninputs:\n{}\ninitializers:\n{}\noutputs: [{}]\nnodes:\n{}\n",
        inputs.iter().map(|i| format!("  - {i}")).collect::<Vec<_>>().join("\n"),
        inits.iter().map(|i| format!("  - {i}")).collect::<Vec<_>>().join("\n"),
        outputs.join(", "),
        nodes.join("\n")
    )
}

#[test]
fn random_attention_patterns_fuse_to_the_same_outputs_and_gradients() {
    let (mut attention, mut repeats_gone) = (0, 0);
    for seed in 0..200u64 {
        let text = attention_graph(&mut Rng::new(seed));
        let g = graphrun::Model::from_str(&text, ".")
            .unwrap_or_else(|e| panic!("{e}\n{text}"))
            .graph;
        let feeds = graphrun::Model { graph: g.clone() }
            .random_inputs(seed, &Default::default())
            .unwrap();
        let (opt, report) = optimize(&g, &PassOptions::default())
            .unwrap_or_else(|e| panic!("passes failed: {e}\n{text}"));
        validate(&opt).unwrap();
        let run = |g: &graphrun::Graph| {
            let mut s = Session::new(g.clone(), SessionOptions::unfused()).unwrap();
            let b = s.backward(&feeds, &HashMap::new()).unwrap();
            (b.outputs, b.grads)
        };
        let ((o1, g1), (o2, g2)) = (run(&g), run(&opt));
        // Attention's `scale` is an f32 attribute, as in ONNX: an f64 graph's scale rounds
        // to f32 (relative 6e-8), hence 1e-7 and not the 1e-9 of the other f64 checks.
        let tol = 1e-7;
        for ((name, a), (_, b)) in o1.iter().zip(&o2) {
            let e = rel(b, a);
            assert!(
                e <= tol,
                "seed {seed}: output '{name}' differs by {e} ({report})\n{text}"
            );
        }
        for ((name, a), (_, b)) in g1.iter().zip(&g2) {
            let e = rel(b, a);
            assert!(
                e <= tol,
                "seed {seed}: gradient of '{name}' differs by {e} ({report})\n{text}"
            );
        }
        let counts = opt.op_counts();
        attention += counts.contains_key("Attention") as usize;
        repeats_gone +=
            (text.contains("Expand, inputs: [k") && !counts.contains_key("Expand")) as usize;
    }
    eprintln!(
        "Attention in {attention} of 200 random graphs; repeats read through in {repeats_gone}"
    );
    assert!(attention > 100, "{attention}");
    assert!(repeats_gone > 20, "{repeats_gone}");
}
