//! Models a real exporter wrote (tests/fixtures/onnx/, made by
//! scripts/export_onnx_fixtures.py with PyTorch's default dynamo exporter and with the
//! TorchScript exporter, `dynamo=False`, at its default opset and at opset 17): graphrun's
//! outputs and gradients against PyTorch's float64 references, unfused and fused, on every
//! available backend; and what the fusion passes make of each exported pattern.
//!
//! Each fixture folder has `model.onnx` and a MANIFEST of `kind<TAB>value<TAB>file.npy`
//! lines: `input` (fed), `output` (PyTorch's float64 result), `seed` (the gradient of
//! the differentiated scalar with respect to an output) and `grad` (PyTorch's float64
//! gradient of Σ seed·output with respect to a float input or an initializer).

mod common;

use graphrun::passes::{self, PassOptions};
use graphrun::{BackendKind, Model, Session, SessionOptions, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

const FIXTURES: &str = "tests/fixtures/onnx";

struct Fixture {
    model: Model,
    inputs: HashMap<String, Tensor>,
    outputs: Vec<(String, Tensor)>,
    seeds: HashMap<String, Tensor>,
    grads: Vec<(String, Tensor)>,
}

fn fixture(name: &str) -> Fixture {
    let dir = Path::new(FIXTURES).join(name);
    let manifest = std::fs::read_to_string(dir.join("MANIFEST")).unwrap();
    let model = Model::load(dir.join("model.onnx")).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut f = Fixture {
        model,
        inputs: HashMap::new(),
        outputs: vec![],
        seeds: HashMap::new(),
        grads: vec![],
    };
    for line in manifest.lines() {
        let [kind, value, file] = line.split('\t').collect::<Vec<_>>()[..] else {
            panic!("{name}: bad MANIFEST line {line:?}")
        };
        let t = Tensor::read_npy(&dir.join(file)).unwrap();
        let v = value.to_string();
        match kind {
            "input" => drop(f.inputs.insert(v, t)),
            "output" => f.outputs.push((v, t)),
            "seed" => drop(f.seeds.insert(v, t)),
            "grad" => f.grads.push((v, t)),
            _ => panic!("{name}: unknown MANIFEST kind {kind}"),
        }
    }
    f
}

fn all_fixtures() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(FIXTURES)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| Path::new(FIXTURES).join(n).join("model.onnx").exists())
        .collect();
    v.sort();
    v
}

/// SPEC §8: f32 within 1e-5 of the float64 reference on the CPU; 1e-3 where a GPU
/// backend may use TF32.
fn tol(backend: BackendKind) -> f64 {
    match backend {
        BackendKind::Cpu => 1e-5,
        _ => 1e-3,
    }
}

/// Checks `got` against `want`; returns the relative error.
fn close(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> f64 {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let e = common::rel_err(&got.to_f64_vec(), &want.to_f64_vec());
    assert!(e <= tol, "{what}: relative error {e:.2e} > {tol:.0e}");
    e
}

/// The graph as imported, or as the default passes make it.
fn graph(f: &Fixture, fused: bool) -> graphrun::Graph {
    if fused {
        passes::optimize(&f.model.graph, &PassOptions::default())
            .unwrap()
            .0
    } else {
        f.model.graph.clone()
    }
}

fn session(g: graphrun::Graph, backend: BackendKind) -> Session {
    let opts = SessionOptions {
        backend,
        ..SessionOptions::unfused()
    };
    Session::new(g, opts).unwrap()
}

#[test]
fn outputs_and_gradients_match_pytorch() {
    let names = all_fixtures();
    assert_eq!(names.len(), 12, "fixtures: {names:?}");
    for name in &names {
        let f = fixture(name);
        let (mut worst_out, mut worst_grad) = (0f64, 0f64);
        for backend in common::backends() {
            for fused in [false, true] {
                let what = format!(
                    "{name} on {} ({})",
                    backend.name(),
                    if fused { "fused" } else { "unfused" }
                );
                let mut s = session(graph(&f, fused), backend);
                let out = s.run(&f.inputs).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(out.len(), f.outputs.len(), "{what}: outputs");
                for ((n, got), (m, want)) in out.iter().zip(&f.outputs) {
                    assert_eq!(n, m, "{what}: output order");
                    let e = close(&format!("{what}: output {n}"), got, want, tol(backend));
                    worst_out = worst_out.max(e);
                }
                let g = s
                    .backward(&f.inputs, &f.seeds)
                    .unwrap_or_else(|e| panic!("{what}: backward: {e}"));
                let got: BTreeMap<&str, &Tensor> =
                    g.grads.iter().map(|(n, t)| (n.as_str(), t)).collect();
                for (v, want) in &f.grads {
                    let Some(t) = got.get(v.as_str()) else {
                        panic!("{what}: no gradient for '{v}' (got {:?})", got.keys());
                    };
                    let e = close(&format!("{what}: gradient of {v}"), t, want, tol(backend));
                    worst_grad = worst_grad.max(e);
                }
            }
        }
        eprintln!(
            "{name}: largest relative error {worst_out:.1e} (outputs), {worst_grad:.1e} ({} gradients)",
            f.grads.len()
        );
    }
}

/// What the default passes make of each exported pattern: the GPT blocks become one causal
/// Attention and four FusedMatMuls (qkv, output projection + residual, fc + GELU,
/// projection + residual), whichever exporter and attention form wrote them.
#[test]
fn exported_patterns_fuse() {
    for name in all_fixtures() {
        let f = fixture(&name);
        let fused = graph(&f, true);
        let counts = fused.op_counts();
        let count = |op: &str| counts.get(op).copied().unwrap_or(0);
        let want: &[(&str, usize)] = if name.starts_with("gpt_block") {
            &[("Attention", 1), ("FusedMatMul", 4)]
        } else if name.starts_with("mlp_gelu") {
            &[("FusedMatMul", 2)]
        } else {
            &[("FusedMatMul", 1)]
        };
        for (op, n) in want {
            assert_eq!(count(op), *n, "{name}: {op} after passes: {counts:?}");
        }
        // Nothing the fusions should have taken is left.
        for op in ["MatMul", "Gemm", "Softmax", "Gelu", "Erf", "Where", "Trilu"] {
            assert_eq!(count(op), 0, "{name}: {op} left after passes: {counts:?}");
        }
        for n in &fused.nodes {
            if let graphrun::Op::Attention { is_causal, .. } = n.op {
                assert!(is_causal && n.inputs.len() == 3, "{name}: {n:?}");
            }
        }
    }
}
