//! The example models: each loads, plans and runs at small sizes; the MLP matches an
//! independent f64 reference; YAML round-trips; seeds are deterministic.

use graphrun::{exec, DType, Model, Session, SessionOptions, Tensor};
use std::collections::{BTreeMap, HashMap};

fn small_dims() -> BTreeMap<String, usize> {
    [("batch", 2), ("seq", 32), ("heads", 2)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn run(m: &Model, feeds: &HashMap<String, Tensor>) -> Vec<(String, Tensor)> {
    let opts = SessionOptions {
        dims: small_dims(),
        ..SessionOptions::unfused()
    };
    Session::new(m.graph.clone(), opts)
        .unwrap()
        .run(feeds)
        .unwrap()
}

#[test]
fn every_model_runs_at_small_size() {
    for name in ["mlp", "mlp_large", "gpt_block", "attention", "llama_layer"] {
        let m = Model::load(format!("models/{name}.yaml")).unwrap();
        let feeds = m.random_inputs(0, &small_dims()).unwrap();
        let outs = run(&m, &feeds);
        assert_eq!(outs.len(), m.graph.outputs.len());
        for (o, t) in &outs {
            let v = t.to_f64_vec();
            assert!(
                !v.is_empty() && v.iter().all(|x| x.is_finite()),
                "{name}.{o} not finite"
            );
            assert!(v.iter().any(|&x| x != 0.0), "{name}.{o} all zeros");
        }
    }
}

/// A session made with the default options fuses the graph as the command line does, and
/// computes what the graph as written computes; `fuse: false` runs it as given.
#[test]
fn sessions_fuse_by_default() {
    let dims = small_dims();
    for name in ["mlp", "gpt_block", "llama_layer"] {
        let m = Model::load(format!("models/{name}.yaml")).unwrap();
        let feeds = m.random_inputs(3, &dims).unwrap();
        let fused = Session::new(
            m.graph.clone(),
            SessionOptions {
                dims: dims.clone(),
                ..Default::default()
            },
        )
        .unwrap();
        let ops: Vec<&str> = fused.graph().nodes.iter().map(|n| n.op.name()).collect();
        assert!(ops.contains(&"FusedMatMul"), "{name}: {ops:?}");
        if name == "llama_layer" {
            // Both RMSNorms, both rotations and the grouped-query attention.
            let n = |op: &str| ops.iter().filter(|o| **o == op).count();
            let fused = [
                n("RMSNormalization"),
                n("Rotary"),
                n("Attention"),
                n("GatedMatMul"),
            ];
            assert_eq!(fused, [2, 2, 1, 1], "{ops:?}");
            // The rotations run on the split heads and the attention reads them unsplit:
            // no head transposes are left.
            assert_eq!(n("Transpose"), 0, "{ops:?}");
        }
        assert!(fused.graph().nodes.len() < m.graph.nodes.len(), "{name}");
        let plain = Session::new(
            m.graph.clone(),
            SessionOptions {
                dims: dims.clone(),
                ..SessionOptions::unfused()
            },
        )
        .unwrap();
        assert_eq!(plain.graph().nodes.len(), m.graph.nodes.len(), "{name}");
        let (mut fused, mut plain) = (fused, plain);
        let (a, b) = (fused.run(&feeds).unwrap(), plain.run(&feeds).unwrap());
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            let (x, y) = (x.to_f64_vec(), y.to_f64_vec());
            let err = x
                .iter()
                .zip(&y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f64::max);
            let scale = y.iter().map(|q| q.abs()).fold(1e-6, f64::max);
            assert!(err / scale < 1e-4, "{name}.{n}: {err} of {scale}");
        }
    }
}

/// The CPU f32 run against the same model evaluated in f64 by the CPU backend.
#[test]
fn models_f32_match_f64() {
    for name in ["mlp", "mlp_large", "gpt_block", "attention", "llama_layer"] {
        let m = Model::load(format!("models/{name}.yaml")).unwrap();
        let feeds = m.random_inputs(3, &small_dims()).unwrap();
        let out32 = run(&m, &feeds);
        let m64 = Model {
            graph: exec::with_float_dtype(&m.graph, DType::F64),
        };
        let feeds64 = feeds
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    if v.dtype().is_float() {
                        v.cast(DType::F64)
                    } else {
                        v.clone()
                    },
                )
            })
            .collect();
        let out64 = run(&m64, &feeds64);
        for ((o, a), (_, b)) in out32.iter().zip(&out64) {
            assert_eq!(a.dtype(), DType::F32);
            assert_eq!(b.dtype(), DType::F64);
            let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
            let num: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y) * (x - y))
                .sum::<f64>()
                .sqrt();
            let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
            assert!(num / den < 1e-5, "{name}.{o}: rel err {}", num / den);
        }
    }
}

/// mlp.yaml against a hand-written f64 forward pass.
#[test]
fn mlp_matches_independent_reference() {
    let m = Model::load("models/mlp.yaml").unwrap();
    let dims: BTreeMap<String, usize> = [("batch".to_string(), 5)].into_iter().collect();
    let feeds = m.random_inputs(7, &dims).unwrap();
    let outs = Session::new(
        m.graph.clone(),
        SessionOptions {
            dims: dims.clone(),
            ..SessionOptions::unfused()
        },
    )
    .unwrap()
    .run(&feeds)
    .unwrap();
    let w = |n: &str| m.graph.initializer(n).unwrap().tensor.to_f64_vec();
    let x = feeds["x"].to_f64_vec();
    let labels = feeds["labels"].to_i64_vec();
    let dense = |x: &[f64], rows: usize, k: usize, n: usize, w: &[f64], b: &[f64], relu: bool| {
        let mut y = vec![0.0; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let mut s = b[j];
                for i in 0..k {
                    s += x[r * k + i] * w[i * n + j];
                }
                y[r * n + j] = if relu { s.max(0.0) } else { s };
            }
        }
        y
    };
    let a1 = dense(&x, 5, 784, 512, &w("w1"), &w("b1"), true);
    let a2 = dense(&a1, 5, 512, 512, &w("w2"), &w("b2"), true);
    let logits = dense(&a2, 5, 512, 10, &w("w3"), &w("b3"), false);
    let mut loss = 0.0;
    for r in 0..5 {
        let row = &logits[r * 10..r * 10 + 10];
        let mx = row.iter().cloned().fold(f64::MIN, f64::max);
        let lse = mx + row.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
        loss += lse - row[labels[r] as usize];
    }
    loss /= 5.0;
    let got = outs[0].1.to_f64_vec();
    let err: f64 = got
        .iter()
        .zip(&logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(err < 1e-4, "logits max err {err}");
    assert!((outs[1].1.to_f64_vec()[0] - loss).abs() < 1e-5 * loss.abs().max(1.0));
    assert!(
        labels.iter().all(|&l| (0..10).contains(&l)),
        "labels honour range [0, 10)"
    );
}

#[test]
fn emit_yaml_round_trips() {
    let dir = std::env::temp_dir().join(format!("graphrun_rt_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["mlp", "gpt_block", "attention"] {
        let m = Model::load(format!("models/{name}.yaml")).unwrap();
        let p = dir.join(format!("{name}_copy.yaml"));
        m.save(&p).unwrap();
        let m2 = Model::load(&p).unwrap();
        let (a, b) = (&m.graph, &m2.graph);
        assert_eq!(
            a.inputs
                .iter()
                .map(|i| (&i.name, i.dtype, &i.shape, i.range))
                .collect::<Vec<_>>(),
            b.inputs
                .iter()
                .map(|i| (&i.name, i.dtype, &i.shape, i.range))
                .collect::<Vec<_>>()
        );
        assert_eq!(a.outputs, b.outputs);
        assert_eq!(a.dims, b.dims);
        assert_eq!(a.training, b.training);
        let strip = |g: &graphrun::Graph| {
            g.nodes
                .iter()
                .map(|n| {
                    (
                        n.name.clone(),
                        n.op.clone(),
                        n.inputs.clone(),
                        n.outputs.clone(),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(a), strip(b), "{name}: nodes differ");
        for (x, y) in a.initializers.iter().zip(&b.initializers) {
            assert_eq!(
                (&x.name, &x.tensor, x.trainable),
                (&y.name, &y.tensor, y.trainable),
                "{name}: initializer differs"
            );
        }
        // Writing the copy again gives the same text: load → write is a fixed point.
        let p2 = dir.join(format!("{name}_copy2.yaml"));
        m2.save(&p2).unwrap();
        let t1 = std::fs::read_to_string(&p).unwrap();
        let t2 = std::fs::read_to_string(&p2).unwrap().replace(
            &format!("{name}_copy2.safetensors"),
            &format!("{name}_copy.safetensors"),
        );
        assert_eq!(t1, t2);
    }
    // Data initializers (as after --dtype or folding) go to a side file and come back exact.
    let m = Model::load("models/mlp.yaml").unwrap();
    let m16 = Model {
        graph: exec::with_float_dtype(&m.graph, DType::BF16),
    };
    let p = dir.join("mlp_bf16.yaml");
    m16.save(&p).unwrap();
    assert!(dir.join("mlp_bf16.safetensors").exists());
    let back = Model::load(&p).unwrap();
    for (x, y) in m16.graph.initializers.iter().zip(&back.graph.initializers) {
        assert_eq!(x.tensor, y.tensor);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn seeded_init_is_deterministic_and_distinct() {
    let a = Model::load("models/mlp.yaml").unwrap();
    let b = Model::load("models/mlp.yaml").unwrap();
    assert_eq!(a.graph.initializers, b.graph.initializers);
    let w1 = &a.graph.initializer("w1").unwrap().tensor;
    let w2 = &a.graph.initializer("w2").unwrap().tensor;
    assert_ne!(w1.to_f64_vec()[..512], w2.to_f64_vec()[..512]);
    // xavier_uniform bound sqrt(6/(784+512)) and a spread that fills it.
    let bound = (6.0f64 / (784.0 + 512.0)).sqrt();
    let v = w1.to_f64_vec();
    assert!(v.iter().all(|x| x.abs() <= bound));
    assert!(v.iter().cloned().fold(0.0, f64::max) > 0.95 * bound);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    assert!(mean.abs() < 0.01 * bound * 10.0);
}

#[test]
fn every_init_kind_has_its_statistics() {
    let y = "graphrun: 1\noutputs: [a]\ninitializers:\n\
  - {name: a, dtype: f32, shape: [200, 100], init: {dist: normal, mean: 2.0, std: 0.5, seed: 1}}\n\
  - {name: b, dtype: f64, shape: [200, 100], init: {dist: uniform, low: -3, high: -1, seed: 2}}\n\
  - {name: c, dtype: f32, shape: [200, 100], init: {dist: xavier_normal, seed: 3}}\n\
  - {name: d, dtype: bf16, shape: [200, 100], init: {dist: kaiming_uniform, seed: 4}}\n\
  - {name: e, dtype: f16, shape: [200, 100], init: {dist: kaiming_normal, seed: 5}}\n\
  - {name: f, dtype: i64, shape: [3], init: {constant: 7}}\n\
  - {name: g, dtype: bool, shape: [2], values: [true, false]}\n\
  - {name: h, dtype: f32, shape: [2], init: ones}\n";
    let m = Model::from_str(y, ".").unwrap();
    let stats = |n: &str| {
        let v = m.graph.initializer(n).unwrap().tensor.to_f64_vec();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let std = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64).sqrt();
        (mean, std, v)
    };
    let (mean, std, _) = stats("a");
    assert!(
        (mean - 2.0).abs() < 0.02 && (std - 0.5).abs() < 0.02,
        "{mean} {std}"
    );
    let (mean, _, v) = stats("b");
    assert!((mean + 2.0).abs() < 0.02 && v.iter().all(|&x| (-3.0..-1.0).contains(&x)));
    let (_, std, _) = stats("c");
    assert!((std - (2.0f64 / 300.0).sqrt()).abs() < 0.005, "{std}");
    let (_, _, v) = stats("d");
    let bound = (6.0f64 / 200.0).sqrt();
    assert!(v.iter().all(|x| x.abs() <= bound * 1.01));
    let (_, std, _) = stats("e");
    assert!((std - (2.0f64 / 200.0).sqrt()).abs() < 0.005, "{std}");
    assert_eq!(stats("f").2, vec![7.0; 3]);
    assert_eq!(stats("g").2, vec![1.0, 0.0]);
    assert!(!m.graph.initializer("f").unwrap().trainable);
    assert!(m.graph.initializer("h").unwrap().trainable);
}

#[test]
fn symbolic_dims_bind_from_feeds_flags_and_defaults() {
    let m = Model::load("models/mlp.yaml").unwrap();
    // Default from dims: batch 64.
    let feeds = m.random_inputs(0, &BTreeMap::new()).unwrap();
    assert_eq!(feeds["x"].shape(), &[64, 784]);
    let outs = Session::new(m.graph.clone(), SessionOptions::unfused())
        .unwrap()
        .run(&feeds)
        .unwrap();
    assert_eq!(outs[0].1.shape(), &[64, 10]);
    // Bound by the fed input, overriding the default.
    let x = Tensor::from_vec(&[3, 784], vec![0.5f32; 3 * 784]).unwrap();
    let labels = Tensor::from_vec(&[3], vec![1i64, 2, 3]).unwrap();
    let feeds: HashMap<String, Tensor> = [("x".to_string(), x), ("labels".to_string(), labels)]
        .into_iter()
        .collect();
    let outs = Session::new(m.graph.clone(), SessionOptions::unfused())
        .unwrap()
        .run(&feeds)
        .unwrap();
    assert_eq!(outs[0].1.shape(), &[3, 10]);
    // A --dim that disagrees with a fed input names both.
    let opts = SessionOptions {
        dims: [("batch".to_string(), 4)].into_iter().collect(),
        ..SessionOptions::unfused()
    };
    let e = Session::new(m.graph.clone(), opts)
        .unwrap()
        .run(&feeds)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--dim batch=4") && e.contains("input 'x'"),
        "{e}"
    );
}

#[test]
fn plan_reuses_buffers() {
    let m = Model::load("models/gpt_block.yaml").unwrap();
    let dims: BTreeMap<String, usize> = [("batch".to_string(), 2), ("seq".to_string(), 64)]
        .into_iter()
        .collect();
    let feeds = m.random_inputs(0, &dims).unwrap();
    let s = Session::new(
        m.graph.clone(),
        SessionOptions {
            dims,
            ..SessionOptions::unfused()
        },
    )
    .unwrap();
    let plan = s.plan_for(&feeds).unwrap();
    assert!(
        plan.peak_bytes() * 3 < plan.naive_bytes,
        "peak {} naive {}",
        plan.peak_bytes(),
        plan.naive_bytes
    );
    // The causal-mask arithmetic on Shape is folded at plan time, not scheduled.
    assert!(plan.steps.len() < m.graph.nodes.len());
}

/// A view of a graph input is no step, also where the inputs are kept to the end (static
/// feeds, as `bench` runs): the rotated heads' Unsqueezed cos and sin of a LLaMA layer
/// share the input's slot.
#[test]
fn views_of_kept_inputs_are_not_copies() {
    let m = Model::load("models/llama_layer.yaml").unwrap();
    let dims: BTreeMap<String, usize> = [("batch".to_string(), 1), ("seq".to_string(), 16)]
        .into_iter()
        .collect();
    let s = Session::new(
        m.graph.clone(),
        SessionOptions {
            dims,
            ..Default::default()
        },
    )
    .unwrap();
    let g = s.graph();
    let views: Vec<&str> = g
        .nodes
        .iter()
        .filter(|n| n.op.name() == "Unsqueeze" && n.inputs[0] == "cos")
        .map(|n| n.outputs[0].as_str())
        .collect();
    assert_eq!(views.len(), 1, "{:?}", g.nodes);
    let keep: std::collections::HashSet<String> = g.inputs.iter().map(|i| i.name.clone()).collect();
    let shapes: HashMap<String, Vec<usize>> = [
        ("x", vec![1, 16, 2048]),
        ("cos", vec![16, 64]),
        ("sin", vec![16, 64]),
        ("target", vec![1, 16, 2048]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for keep in [Default::default(), keep] {
        let plan = graphrun::Plan::keeping(g, &shapes, &keep).unwrap();
        assert_eq!(
            plan.places.get("cos"),
            plan.places.get(views[0]),
            "kept: {}",
            !keep.is_empty()
        );
        assert!(plan
            .steps
            .iter()
            .all(|st| g.nodes[st.node].op.name() != "Unsqueeze"));
    }
}

/// Checks a plan's slot sharing against lifetimes computed here from its steps: two values
/// in one slot (other than a view and what it views) never live at the same step, and a
/// step's outputs never share a slot with its inputs. Returns (sum of the slots, largest
/// set of bytes alive at one step).
fn check_slots(g: &graphrun::Graph, plan: &graphrun::Plan) -> (usize, usize) {
    use graphrun::exec::plan::Place;
    let n = plan.steps.len();
    let slot = |v: &str| match plan.places.get(v) {
        Some(Place::Slot(s)) => Some(*s),
        _ => None,
    };
    // A view's value is its input's bytes: lifetimes are per root value.
    let producer: HashMap<&str, usize> = g
        .nodes
        .iter()
        .enumerate()
        .flat_map(|(k, nd)| nd.outputs.iter().map(move |o| (o.as_str(), k)))
        .collect();
    let ran: std::collections::HashSet<usize> = plan.steps.iter().map(|st| st.node).collect();
    let root = |v: &str| {
        let mut v = v.to_string();
        while let Some(&p) = producer.get(v.as_str()) {
            let x = &g.nodes[p].inputs[0];
            if ran.contains(&p) || slot(x) != slot(&v) {
                break;
            }
            v = x.clone();
        }
        v
    };
    // Each root value's slot, first and last step, and bytes.
    struct Life {
        slot: usize,
        first: usize,
        last: usize,
        bytes: usize,
    }
    let mut live: BTreeMap<String, Life> = BTreeMap::new();
    for i in &g.inputs {
        if let Some(s) = slot(&i.name) {
            let bytes = plan.types[&i.name].bytes();
            let (first, last) = (0, 0);
            live.insert(
                i.name.clone(),
                Life {
                    slot: s,
                    first,
                    last,
                    bytes,
                },
            );
        }
    }
    for (k, st) in plan.steps.iter().enumerate() {
        let nd = &g.nodes[st.node];
        for ((o, &s), t) in nd.outputs.iter().zip(&st.outs).zip(&st.out_types) {
            let name = if o.is_empty() {
                format!("#{k}")
            } else {
                o.clone()
            };
            let (first, last, bytes) = (k, k, t.bytes());
            live.insert(
                name,
                Life {
                    slot: s,
                    first,
                    last,
                    bytes,
                },
            );
        }
        for i in nd.inputs.iter().filter(|i| slot(i).is_some()) {
            let e = live
                .get_mut(&root(i))
                .unwrap_or_else(|| panic!("{i} read before written"));
            e.last = e.last.max(k);
            e.bytes = e.bytes.max(plan.types[i.as_str()].bytes());
        }
    }
    for o in &g.outputs {
        if slot(o).is_some() {
            live.get_mut(&root(o)).unwrap().last = n;
        }
    }
    let vals: Vec<(&String, &Life)> = live.iter().collect();
    for (k, (i, a)) in vals.iter().enumerate() {
        for (j, b) in &vals[k + 1..] {
            assert!(
                a.slot != b.slot || a.last < b.first || b.last < a.first,
                "'{i}' (steps {}..{}) and '{j}' (steps {}..{}) share slot {}",
                a.first,
                a.last,
                b.first,
                b.last,
                a.slot
            );
        }
    }
    let most = (0..=n)
        .map(|k| {
            vals.iter()
                .filter(|(_, v)| v.first <= k && k <= v.last)
                .map(|(_, v)| v.bytes)
                .sum::<usize>()
        })
        .max()
        .unwrap_or(0);
    (plan.peak_bytes(), most)
}

#[test]
fn plan_slots_hold_one_live_value_each_and_pack_tightly() {
    // mlp is mlp_small of ../shared/bench.
    for name in ["mlp", "mlp_large", "gpt_block", "attention"] {
        let m = Model::load(format!("models/{name}.yaml")).unwrap();
        // The benchmark's sizes (plans only: nothing runs).
        let dims = BTreeMap::new();
        let feeds = m.random_inputs(1, &dims).unwrap();
        let train = m.graph.training.is_some();
        let popts = graphrun::passes::PassOptions {
            disabled: vec![],
            training: train,
            ..Default::default()
        };
        let (fused, _) = graphrun::passes::optimize(&m.graph, &popts).unwrap();
        let mut s = Session::new(
            fused.clone(),
            SessionOptions {
                dims,
                training: train,
                passes: popts,
                ..SessionOptions::unfused()
            },
        )
        .unwrap();
        s.set_static_feeds(true);
        let plan = s.plan_for(&feeds).unwrap();
        check_slots(&fused, &plan);
        let (bwd, plan) = s.backward_graph(&feeds).unwrap();
        let (g, plan) = (bwd.graph.clone(), plan.clone());
        check_slots(&g, &plan);
        if train {
            let (bwd, plan) = s.train_graph(&feeds).unwrap();
            let (sum, most) = check_slots(&bwd.graph, plan);
            // Slots are separate buffers, so their sum can exceed the most bytes alive at
            // once, but not by much: placing the largest values first fills the gaps.
            assert!(
                sum * 10 <= most * 11,
                "{name}: slots {sum} bytes, at most {most} alive at once"
            );
        }
    }
}

#[test]
fn k_major_weights_leave_the_outputs_unchanged() {
    use graphrun::passes::{optimize, weight_layout::k_major_weights, PassOptions};
    for (name, flipped) in [("mlp_large", 2), ("gpt_block", 4)] {
        let mut m = Model::load(format!("models/{name}.yaml")).unwrap();
        m.graph.outputs.retain(|o| o != "loss");
        m.graph.training = None;
        let (fused, _) = optimize(&m.graph, &PassOptions::default()).unwrap();
        let (k, n) = k_major_weights(&fused);
        assert_eq!(n, flipped, "{name}: the products' weights");
        for (a, b) in fused.initializers.iter().zip(&k.initializers) {
            let (sa, sb) = (a.tensor.shape(), b.tensor.shape());
            if sa != sb {
                assert_eq!((sa[0], sa[1]), (sb[1], sb[0]), "{}", a.name);
            }
        }
        let feeds = m.random_inputs(3, &small_dims()).unwrap();
        let opts = SessionOptions {
            dims: small_dims(),
            ..SessionOptions::unfused()
        };
        let want = Session::new(fused, opts.clone())
            .unwrap()
            .run(&feeds)
            .unwrap();
        let got = Session::new(k, opts).unwrap().run(&feeds).unwrap();
        for ((o, w), (_, g)) in want.iter().zip(&got) {
            let (w, g) = (w.to_f64_vec(), g.to_f64_vec());
            let scale = w.iter().fold(0f64, |s, x| s.max(x.abs()));
            let err = w
                .iter()
                .zip(&g)
                .fold(0f64, |s, (a, b)| s.max((a - b).abs()));
            assert!(
                err <= 1e-5 * scale,
                "{name}.{o}: max error {err} of {scale}"
            );
        }
    }
}
