//! Real architectures as PyTorch exports them (tests/fixtures/zoo/, made by
//! scripts/make_zoo.py: tiny `transformers`/`torchvision` models with random weights, each
//! exported by the dynamo exporter at opsets 18 and 23 and by the TorchScript exporter at
//! opset 17). tests/fixtures/zoo/STATUS.tsv (written by scripts/zoo_status.py, the
//! measurement behind docs/MODELS.md) says which exports graphrun runs:
//!
//! - `runs`: every output must match ONNX Runtime's (relative error ≤ 1e-4; where ONNX
//!   Runtime fails on an export, onnx.reference's, stored as ref_<i>.npy) on every
//!   available backend, as imported and after the default passes, and where the backward column is `ok`, every gradient must match
//!   PyTorch's float64 one of Σ seed·(first output);
//! - anything else carries its reason, and must still fail: an export that starts to run
//!   makes this test fail until STATUS.tsv (and docs/MODELS.md) are regenerated, so the
//!   table never claims less than graphrun does, and a model listed as running never
//!   quietly stops.
//!
//! Every vendored export folder must be listed, so nothing is skipped without a line.

mod common;

use graphrun::passes::{self, PassOptions};
use graphrun::{BackendKind, DType, Model, Session, SessionOptions, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const ZOO: &str = "tests/fixtures/zoo";
const TOL: f64 = 1e-4;

struct Status {
    case: String,
    forward: String,
    backward: String,
    detail: String,
}

fn statuses() -> Vec<Status> {
    let text = std::fs::read_to_string(Path::new(ZOO).join("STATUS.tsv")).unwrap();
    text.lines()
        .skip(1)
        .map(|l| {
            let [case, forward, backward, detail] = l.split('\t').collect::<Vec<_>>()[..] else {
                panic!("STATUS.tsv: bad line {l:?}")
            };
            Status {
                case: case.into(),
                forward: forward.into(),
                backward: backward.into(),
                detail: detail.into(),
            }
        })
        .collect()
}

/// One export's MANIFEST: `kind<TAB>value<TAB>file`, the file relative to the folder.
fn manifest(case: &str) -> Vec<(String, String, PathBuf)> {
    let dir = Path::new(ZOO).join(case);
    let text = std::fs::read_to_string(dir.join("MANIFEST"))
        .unwrap_or_else(|e| panic!("{case}: MANIFEST: {e}"));
    text.lines()
        .map(|l| {
            let [k, v, f] = l.split('\t').collect::<Vec<_>>()[..] else {
                panic!("{case}: bad MANIFEST line {l:?}")
            };
            (k.to_string(), v.to_string(), dir.join(f))
        })
        .collect()
}

fn npy(p: &Path) -> Tensor {
    Tensor::read_npy(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn rel(got: &[f64], want: &[f64]) -> f64 {
    if got.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    common::rel_err(got, want)
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Some gradients are zero in exact arithmetic (a key projection's bias shifts every score
/// of a softmax row equally): PyTorch's float64 gives ~1e-15 there and float32 ~1e-6, so
/// each gradient's error is measured against at least this fraction of the largest
/// gradient norm of the same export (as scripts/zoo_status.py does).
const GRAD_FLOOR: f64 = 1e-2;

fn transpose2(t: &Tensor) -> (Vec<usize>, Vec<f64>) {
    let s = t.shape();
    assert_eq!(s.len(), 2, "a transposed initializer is 2-D");
    let v = t.to_f64_vec();
    let (r, c) = (s[0], s[1]);
    let out = (0..c * r).map(|i| v[(i % r) * c + i / r]).collect();
    (vec![c, r], out)
}

struct Case {
    model: Model,
    /// How it was imported.
    import: graphrun::onnx::ImportOptions,
    inputs: HashMap<String, Tensor>,
    outputs: Vec<(String, Tensor)>,
    seeds: HashMap<String, Tensor>,
    /// (initializers, each with whether it holds the transpose) whose gradients summed
    /// are the file's: one entry for a plain gradient.
    grads: Vec<(Vec<(String, bool)>, Tensor)>,
}

fn load(case: &str) -> graphrun::Result<Case> {
    let rows = manifest(case);
    // The shapes it will be fed, as the command line gives them to the import (a
    // recurrence over a dynamic sequence axis is unrolled for them).
    let input_shapes = rows
        .iter()
        .filter(|(k, _, _)| k == "input")
        .map(|(_, v, f)| (v.clone(), npy(f).shape().to_vec()))
        .collect();
    let import = graphrun::onnx::ImportOptions {
        input_shapes,
        ..Default::default()
    };
    let model = Model::load_with(Path::new(ZOO).join(case).join("model.onnx"), &import)?;
    let mut c = Case {
        import,
        model,
        inputs: HashMap::new(),
        outputs: vec![],
        seeds: HashMap::new(),
        grads: vec![],
    };
    for (k, v, f) in rows {
        match k.as_str() {
            "input" => drop(c.inputs.insert(v, npy(&f))),
            "output" => c.outputs.push((v, npy(&f))),
            "seed" => drop(c.seeds.insert(v, npy(&f))),
            // PyTorch stores no gradient for a parameter the differentiated output does
            // not depend on (BERT's pooler under the first output): it is zero.
            "grad" if !f.exists() => {
                let init = c.model.graph.initializers.iter().find(|i| i.name == v);
                let shape = init
                    .unwrap_or_else(|| panic!("{case}: no initializer {v}"))
                    .tensor
                    .shape();
                let zeros = Tensor::zeros(graphrun::DType::F64, shape);
                c.grads.push((vec![(v, false)], zeros))
            }
            "grad" => c.grads.push((vec![(v, false)], npy(&f))),
            "grad_t" => c.grads.push((vec![(v, true)], npy(&f))),
            "grad_sum" => {
                let parts = v
                    .split(',')
                    .map(|p| match p.strip_prefix("T:") {
                        Some(n) => (n.to_string(), true),
                        None => (p.to_string(), false),
                    })
                    .collect();
                c.grads.push((parts, npy(&f)))
            }
            _ => panic!("{case}: unknown MANIFEST kind {k}"),
        }
    }
    // Only the first output is differentiated: the others are seeded with zeros.
    for (name, t) in c.outputs.iter().skip(1) {
        c.seeds
            .insert(name.clone(), Tensor::zeros(t.dtype(), t.shape()));
    }
    Ok(c)
}

/// Runs the export on `backend`, as imported or after the default passes (as the CLI
/// runs it); Err says the first thing that differs from the reference.
fn check(c: &Case, backend: BackendKind, fused: bool, grads: bool) -> Result<(f64, f64), String> {
    let opts = SessionOptions {
        backend,
        ..SessionOptions::unfused()
    };
    let graph = if fused {
        passes::optimize(&c.model.graph, &PassOptions::default())
            .map_err(|e| format!("passes: {e}"))?
            .0
    } else {
        c.model.graph.clone()
    };
    let mut s = Session::new(graph, opts).map_err(|e| e.to_string())?;
    let out = s.run(&c.inputs).map_err(|e| e.to_string())?;
    if out.len() != c.outputs.len() {
        return Err(format!(
            "{} outputs, ONNX Runtime gave {}",
            out.len(),
            c.outputs.len()
        ));
    }
    let mut worst = (0f64, 0f64);
    for ((n, got), (m, want)) in out.iter().zip(&c.outputs) {
        if n != m || got.shape() != want.shape() {
            return Err(format!(
                "output {n}{:?}, ONNX Runtime's {m}{:?}",
                got.shape(),
                want.shape()
            ));
        }
        let e = rel(&got.to_f64_vec(), &want.to_f64_vec());
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must fail too
        if !(e <= TOL) {
            return Err(format!("output {n}: relative error {e:.1e} > {TOL:.0e}"));
        }
        worst.0 = worst.0.max(e);
    }
    if !grads {
        return Ok(worst);
    }
    let g = s
        .backward(&c.inputs, &c.seeds)
        .map_err(|e| format!("backward: {e}"))?;
    let got: HashMap<&str, &Tensor> = g.grads.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let floor = GRAD_FLOOR
        * c.grads
            .iter()
            .map(|(_, w)| norm(&w.to_f64_vec()))
            .fold(0.0, f64::max);
    for (parts, want) in &c.grads {
        let mut sum = vec![0f64; want.numel()];
        for (name, transposed) in parts {
            let Some(t) = got.get(name.as_str()) else {
                return Err(format!("no gradient for '{name}'"));
            };
            let (shape, v) = if *transposed {
                transpose2(t)
            } else {
                (t.shape().to_vec(), t.to_f64_vec())
            };
            if shape != want.shape() {
                return Err(format!(
                    "gradient of '{name}' is {shape:?}, PyTorch's {:?}",
                    want.shape()
                ));
            }
            sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
        }
        let want = want.to_f64_vec();
        let diff: Vec<f64> = sum.iter().zip(&want).map(|(a, b)| a - b).collect();
        let e = if sum.iter().all(|x| x.is_finite()) {
            norm(&diff) / norm(&want).max(floor).max(1e-30)
        } else {
            f64::INFINITY
        };
        #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must fail too
        if !(e <= TOL) {
            let names: Vec<&str> = parts.iter().map(|p| p.0.as_str()).collect();
            return Err(format!(
                "gradient of {names:?}: relative error {e:.1e} > {TOL:.0e}"
            ));
        }
        worst.1 = worst.1.max(e);
    }
    Ok(worst)
}

/// The float dtype of the export's outputs is f32 (checked so a tolerance meant for f32
/// is not silently applied to anything else).
fn f32_outputs(c: &Case) -> bool {
    c.outputs.iter().all(|(_, t)| t.dtype() == DType::F32)
}

#[test]
fn exports_listed_as_running_match_onnx_runtime_and_pytorch() {
    let all = statuses();
    let running: Vec<&Status> = all.iter().filter(|s| s.forward == "runs").collect();
    assert!(!running.is_empty(), "STATUS.tsv lists no running export");
    for st in running {
        let c = load(&st.case).unwrap_or_else(|e| panic!("{} is listed as running: {e}", st.case));
        assert!(f32_outputs(&c), "{}: outputs are not f32", st.case);
        let grads = st.backward == "ok";
        for backend in common::backends() {
            for fused in [false, true] {
                let how = format!(
                    "{} ({})",
                    backend.name(),
                    if fused { "fused" } else { "unfused" }
                );
                match check(&c, backend, fused, grads) {
                    Ok((e, ge)) => eprintln!(
                        "{} on {how}: outputs {e:.1e}{}",
                        st.case,
                        if grads {
                            format!(", gradients {ge:.1e}")
                        } else {
                            String::new()
                        }
                    ),
                    Err(e) => panic!("{} on {how} is listed as running: {e}", st.case),
                }
            }
        }
    }
}

#[test]
fn exports_listed_as_failing_still_fail_for_a_stated_reason() {
    for st in statuses() {
        assert!(
            !st.detail.is_empty() || st.forward == "runs",
            "{}: no reason",
            st.case
        );
        match st.forward.as_str() {
            "runs" => {}
            // The exporter failed (its message is the reason): nothing was vendored.
            "no-export" => assert!(
                !Path::new(ZOO).join(&st.case).exists(),
                "{}: listed as not exported but its folder exists",
                st.case
            ),
            "no-reference" => assert!(
                !Path::new(ZOO).join(&st.case).join("MANIFEST").exists(),
                "{}: listed without a reference but has a MANIFEST",
                st.case
            ),
            "fails" | "mismatch" => {
                let still_fails = match load(&st.case) {
                    Err(_) => true,
                    Ok(c) => check(&c, BackendKind::Cpu, true, false).is_err(),
                };
                assert!(
                    still_fails,
                    "{} now runs and matches ONNX Runtime (it was listed as: {}): run \
                     scripts/zoo_status.py to update STATUS.tsv and docs/MODELS.md",
                    st.case, st.detail
                );
            }
            other => panic!("{}: unknown status {other}", st.case),
        }
        if st.forward == "runs" && st.backward != "ok" {
            // Same rule for gradients: a listed backward failure must still fail.
            let c = load(&st.case).unwrap();
            assert!(
                check(&c, BackendKind::Cpu, true, true).is_err(),
                "{}: gradients now match PyTorch's (listed as: {}): run scripts/zoo_status.py",
                st.case,
                st.detail
            );
        }
    }
}

#[test]
fn every_vendored_export_is_listed() {
    let listed: Vec<String> = statuses().into_iter().map(|s| s.case).collect();
    let mut on_disk: Vec<String> = std::fs::read_dir(ZOO)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| Path::new(ZOO).join(n).join("model.onnx").exists())
        .collect();
    on_disk.sort();
    for n in &on_disk {
        assert!(listed.contains(n), "{n} is vendored but not in STATUS.tsv");
    }
    // And the exporter's own record: every line of MANIFEST.tsv has a status.
    let text = std::fs::read_to_string(Path::new(ZOO).join("MANIFEST.tsv")).unwrap();
    for l in text.lines().skip(1) {
        let case = l.split('\t').next().unwrap();
        assert!(
            listed.iter().any(|c| c == case),
            "{case} is in MANIFEST.tsv but not STATUS.tsv"
        );
    }
}

/// One export of each architecture (the first listed as running with gradients) trains:
/// the cross-entropy graphrun appends to its first output (classes along the last axis,
/// axis 1 of a 4-D output; seeded random labels, one a whole image there), 30 Adam steps at learning rate 0.01 on
/// the reference's inputs as one batch, on every available backend, end under half the
/// first step's loss (docs/MODELS.md's "trains" column measures every export so).
#[test]
fn one_export_of_each_architecture_trains() {
    use graphrun::graph::{Optimizer, Training};
    use graphrun::onnx::{ImportMode, ImportOptions};
    let mut seen = std::collections::HashSet::new();
    let mut trained = 0;
    for st in statuses() {
        let arch = st.case.split("_dynamo").next().unwrap();
        let arch = arch.split("_torchscript").next().unwrap().to_string();
        if st.backward != "ok" || !seen.insert(arch) {
            continue;
        }
        let c = load(&st.case).unwrap();
        let (out, scores) = &c.outputs[0];
        let rank = scores.shape().len();
        let axis = if rank == 4 { 1 } else { rank - 1 };
        let opts = ImportOptions {
            mode: ImportMode::Train,
            ..c.import.clone()
        };
        let path = Path::new(ZOO).join(&st.case).join("model.onnx");
        let mut g = Model::load_with(path, &opts).unwrap().graph;
        let ev = &graphrun::backends::cpu::HOST_EVAL;
        let loss =
            graphrun::graph::loss::append_cross_entropy_on(&mut g, out, axis as i64, "labels", ev)
                .unwrap_or_else(|e| panic!("{}: {e}", st.case));
        g.training = Some(Training {
            loss,
            optimizer: Optimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        });
        let mut shape = scores.shape().to_vec();
        let classes = shape.remove(axis);
        let n: usize = shape.iter().product();
        // One class a whole image for a 4-D output: pixels labelled at random are noise
        // that a few steps cannot fit.
        let per = if rank == 4 { n / shape[0] } else { 1 };
        let mut rng = graphrun::rng::Rng::new(7);
        let picks: Vec<i64> = (0..n / per)
            .map(|_| (rng.next_u64() % classes as u64) as i64)
            .collect();
        let labels: Vec<i64> = (0..n).map(|i| picks[i / per]).collect();
        let mut feeds = c.inputs.clone();
        feeds.insert("labels".into(), Tensor::from_vec(&shape, labels).unwrap());
        for backend in common::backends() {
            let opts = SessionOptions {
                backend,
                training: true,
                ..Default::default()
            };
            let mut s = Session::new(g.clone(), opts).unwrap();
            let first = s.train_step(&feeds).unwrap();
            let mut last = first;
            for _ in 1..30 {
                last = s.train_step(&feeds).unwrap();
            }
            eprintln!(
                "{} on {}: loss {first:.4} -> {last:.4}",
                st.case,
                backend.name()
            );
            assert!(
                last < 0.5 * first,
                "{} on {}: loss {first} -> {last} in 30 steps",
                st.case,
                backend.name()
            );
        }
        trained += 1;
    }
    assert!(trained >= 20, "only {trained} architectures trained");
}
