//! What a training step changes besides the gradient step: BatchNormalization's running
//! statistics (state updates), checked against PyTorch's own training run of the same
//! exported CNN, and weights read through small nodes (which must not be folded into
//! constants when the plan is made).

mod common;
use common::*;
use graphrun::graph::{Optimizer, StateUpdate, Training};
use graphrun::onnx::{ImportMode, ImportOptions};
use graphrun::{BackendKind, DType, Graph, Model, Session, SessionOptions, Tensor};
use std::collections::HashMap;
use std::path::Path;

const FIX: &str = "tests/fixtures/bn_train";

fn npy(name: &str) -> Tensor {
    Tensor::read_npy(&Path::new(FIX).join(name)).unwrap()
}

/// Step `s` of the fixture's data.
fn step_feeds(s: usize, dtype: DType) -> HashMap<String, Tensor> {
    let (x, y) = (npy("x.npy"), npy("y.npy"));
    let x = x.take_rows(&[s]).unwrap();
    let y = y.take_rows(&[s]).unwrap();
    let x = x.clone().reshaped(&x.shape()[1..]).unwrap().cast(dtype);
    let y = y.clone().reshaped(&y.shape()[1..]).unwrap();
    HashMap::from([("x".to_string(), x), ("labels".to_string(), y)])
}

fn sgd(g: &mut Graph) {
    g.training = Some(Training {
        loss: "loss".into(),
        optimizer: Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        },
    });
}

fn import(file: &str, training: bool) -> Graph {
    let opts = ImportOptions {
        mode: if training {
            ImportMode::Train
        } else {
            ImportMode::Eval
        },
    };
    Model::load_with(Path::new(FIX).join(file), &opts)
        .unwrap()
        .graph
}

/// Trains `file` for the fixture's steps on `backend` in `dtype` and compares the losses,
/// every parameter and running statistic, and the trained model's eval-mode logits with
/// PyTorch's float64 run.
fn trains_as_pytorch(name: &str, backend: BackendKind, dtype: DType, tol: f64) {
    let file = format!("{name}.onnx");
    let mut g = import(&file, true);
    assert_eq!(
        g.updates.len(),
        4,
        "two BatchNormalizations, two statistics each"
    );
    sgd(&mut g);
    let g = graphrun::exec::with_float_dtype(&g, dtype);
    let opts = SessionOptions {
        backend,
        training: true,
        ..Default::default()
    };
    let mut s = Session::new(g, opts.clone()).unwrap();
    let want = npy(&format!("{name}.losses.npy")).to_f64_vec();
    for (k, w) in want.iter().enumerate() {
        let l = s.train_step(&step_feeds(k, dtype)).unwrap();
        assert!(
            (l - w).abs() <= tol * w.abs(),
            "{name} {backend:?} {dtype}: step {k}: loss {l} vs PyTorch's {w}"
        );
    }
    let trained = s.trained_graph().unwrap().clone();
    let stats = ["b1", "b2"].map(|b| [format!("{b}.running_mean"), format!("{b}.running_var")]);
    for init in &trained.initializers {
        let file = Path::new(FIX).join(format!("{name}.final.{}.npy", init.name));
        if !file.exists() {
            continue;
        }
        // train.onnx's nodes say training_mode = 1: ONNX moves the running variance
        // towards the biased batch variance, PyTorch towards the unbiased one.
        let reference = match init.name.strip_suffix(".running_var") {
            Some(bn) if name == "train" => format!("{name}.biased.{bn}.running_var.npy"),
            _ => format!("{name}.final.{}.npy", init.name),
        };
        let e = rel_err(&init.tensor.to_f64_vec(), &npy(&reference).to_f64_vec());
        assert!(
            e <= tol,
            "{name} {backend:?} {dtype}: '{}' rel err {e:.2e}",
            init.name
        );
    }
    for s in stats.iter().flatten() {
        let init = trained.initializer(s).expect("statistic kept by its name");
        assert!(!init.trainable, "{s} is a statistic, not a weight");
    }
    // Eval mode: the inference import, with the trained values by name.
    let mut ev = import(&file, false);
    assert!(ev.updates.is_empty());
    for i in &mut ev.initializers {
        i.tensor = trained.initializer(&i.name).unwrap().tensor.clone();
    }
    let ev = graphrun::exec::with_float_dtype(&ev, dtype);
    let mut s = Session::new(ev, opts).unwrap();
    let got = s
        .run_fetch(&step_feeds(0, dtype), &["logits".into()])
        .unwrap();
    let want = npy(&format!("{name}.eval_logits.npy")).to_f64_vec();
    let e = rel_err(&got[0].to_f64_vec(), &want);
    assert!(
        e <= tol,
        "{name} {backend:?} {dtype}: eval logits rel err {e:.2e}"
    );
}

/// Inference-form BatchNormalization (an export of an eval() model, whose fresh
/// statistics the exporter shares with the BN weights through Identity nodes) trains as
/// PyTorch's train() mode runs it.
#[test]
fn batch_norm_in_inference_form_trains_as_pytorch() {
    // Not 1e-12: the file's momentum is the f32 nearest 0.9.
    trains_as_pytorch("preserve", BackendKind::Cpu, DType::F64, 1e-6);
    for backend in backends() {
        trains_as_pytorch("preserve", backend, DType::F32, 2e-4);
    }
}

/// training_mode = 1 BatchNormalization (an export in training mode): the same losses and
/// weights; the running statistics as ONNX defines them.
#[test]
fn batch_norm_in_training_mode_trains_as_pytorch() {
    trains_as_pytorch("train", BackendKind::Cpu, DType::F64, 1e-6);
    for backend in backends() {
        trains_as_pytorch("train", backend, DType::F32, 2e-4);
    }
}

/// The training import gives a statistic shared with another BN's its own initializer,
/// named after what the node reads; a plain import leaves the model as written.
#[test]
fn shared_statistics_get_their_own_initializers() {
    let plain = Model::load(Path::new(FIX).join("preserve.onnx"))
        .unwrap()
        .graph;
    assert!(plain.initializer("b2.running_var").is_none());
    assert!(plain.updates.is_empty());
    let g = import("preserve.onnx", true);
    for s in [
        "b1.running_mean",
        "b1.running_var",
        "b2.running_mean",
        "b2.running_var",
    ] {
        let i = g.initializer(s).unwrap_or_else(|| panic!("{s}"));
        assert!(!i.trainable);
        assert!(g.updates.iter().any(|u| u.target == s), "{s} is updated");
    }
    // b2's statistics were b1's, through Identity nodes: the Identity nodes went.
    assert!(plain.nodes.iter().any(|n| n.op == graphrun::Op::Identity));
    assert!(!g.nodes.iter().any(|n| n.op == graphrun::Op::Identity));
    assert!(g.initializer("b1.weight").unwrap().trainable);
}

/// A weight read through a small node (Unsqueeze, a product) is no constant: the step
/// after an update sees the new value. SGD on L = Σ(x + b²) over two rows gives
/// dL/db = 4b, so each step scales b by 1 - 0.4.
#[test]
fn weights_read_through_small_nodes_are_not_folded() {
    let text = r#"
graphrun: 1
name: fold
inputs:
  - {name: x, dtype: f32, shape: [2, 4]}
outputs: [loss]
initializers:
  - {name: b, dtype: f32, shape: [4], values: [0.5, -1.0, 1.5, 0.25]}
  - {name: ax, dtype: i64, shape: [1], values: [0]}
nodes:
  - {op: Unsqueeze, inputs: [b, ax], outputs: [bb]}
  - {op: Mul, inputs: [bb, bb], outputs: [sq]}
  - {op: Add, inputs: [x, sq], outputs: [y]}
  - {op: ReduceSum, inputs: [y], outputs: [loss], attrs: {keepdims: 0}}
training:
  loss: loss
  optimizer: {sgd: {lr: 0.1}}
"#;
    let g = Model::from_str(text, ".").unwrap().graph;
    let x = randn(&[2, 4], 1).cast(DType::F32);
    let sx: f64 = x.to_f64_vec().iter().sum();
    let b2: f64 = [0.5f64, -1.0, 1.5, 0.25].iter().map(|v| v * v).sum();
    for backend in backends() {
        for fuse in [false, true] {
            let opts = SessionOptions {
                backend,
                ..if fuse {
                    SessionOptions::default()
                } else {
                    SessionOptions::unfused()
                }
            };
            let mut s = Session::new(g.clone(), opts).unwrap();
            let feeds = HashMap::from([("x".to_string(), x.clone())]);
            for k in 0..3 {
                let l = s.train_step(&feeds).unwrap();
                let want = sx + 2.0 * b2 * 0.36f64.powi(k);
                assert!(
                    (l - want).abs() <= 1e-5 * want.abs(),
                    "{backend:?} fused {fuse}: step {k}: loss {l}, want {want}"
                );
            }
        }
    }
}

/// A YAML model says what a step writes back under `updates:`; it is checked when the
/// model loads, written back by `save`, and applied after each step (an exponential
/// average of the batch mean here).
#[test]
fn yaml_updates_are_checked_written_and_applied() {
    let model = |updates: &str, extra: &str| {
        format!(
            r#"
graphrun: 1
name: ema
inputs:
  - {{name: x, dtype: f32, shape: [4, 3]}}
outputs: [loss, m_next]
initializers:
  - {{name: w, dtype: f32, shape: [3], values: [1.0, 2.0, 3.0]}}
  - {{name: m, dtype: f32, shape: [3], values: [0.0, 0.0, 0.0], trainable: false}}
  - {{name: half, dtype: f32, shape: [], values: 0.5, trainable: false}}
  - {{name: ax, dtype: i64, shape: [1], values: [0]}}
{extra}nodes:
  - {{op: Mul, inputs: [x, w], outputs: [xw]}}
  - {{op: ReduceSum, inputs: [xw], outputs: [loss], attrs: {{keepdims: 0}}}}
  - {{op: ReduceMean, inputs: [x, ax], outputs: [mean], attrs: {{keepdims: 0}}}}
  - {{op: Add, inputs: [m, mean], outputs: [sum]}}
  - {{op: Mul, inputs: [sum, half], outputs: [m_next]}}
training:
  loss: loss
  optimizer: {{sgd: {{lr: 0.01}}}}
{updates}"#
        )
    };
    let ok = model("updates: {m: m_next}\n", "");
    let g = Model::from_str(&ok, ".").unwrap().graph;
    assert_eq!(
        g.updates,
        vec![StateUpdate {
            target: "m".into(),
            value: "m_next".into()
        }]
    );
    // Written back as it was read.
    let text = graphrun::graph::yaml::emit(&g, "side.safetensors").0;
    assert!(text.contains("updates:\n  m: m_next\n"), "{text}");
    assert_eq!(
        Model::from_str(&text, ".").unwrap().graph.updates,
        g.updates
    );
    // Refused, with the reason.
    for (updates, extra, says) in [
        (
            "updates: {nope: m_next}\n",
            "",
            "'nope' is not an initializer",
        ),
        ("updates: {w: m_next}\n", "", "'w' is trainable"),
        (
            "updates: {m: mean}\n",
            "",
            "'mean' given for 'm' is not a graph output",
        ),
        (
            "updates: {m2: m_next}\n",
            "  - {name: m2, dtype: f32, shape: [4], values: [0, 0, 0, 0], trainable: false}\n",
            "'m2' is f32[4] but its update 'm_next' is f32[3]",
        ),
    ] {
        let text = model(updates, "");
        let text = if extra.is_empty() {
            text
        } else {
            text.replace("nodes:\n", &format!("{extra}nodes:\n"))
        };
        let e = Model::from_str(&text, ".").unwrap_err().to_string();
        assert!(e.contains(says), "{updates}: {e}");
    }
    // Applied after each step: m ← (m + mean(x)) / 2, on every backend.
    let x = randn(&[4, 3], 7).cast(DType::F32);
    let xv = x.to_f64_vec();
    let mean: Vec<f64> = (0..3)
        .map(|j| (0..4).map(|i| xv[i * 3 + j]).sum::<f64>() / 4.0)
        .collect();
    for backend in backends() {
        let opts = SessionOptions {
            backend,
            ..Default::default()
        };
        let mut s = Session::new(g.clone(), opts).unwrap();
        let feeds = HashMap::from([("x".to_string(), x.clone())]);
        let mut want = vec![0.0; 3];
        for _ in 0..3 {
            s.train_step(&feeds).unwrap();
            for j in 0..3 {
                want[j] = (want[j] + mean[j]) / 2.0;
            }
        }
        let got = s
            .trained_graph()
            .unwrap()
            .initializer("m")
            .unwrap()
            .tensor
            .to_f64_vec();
        let e = rel_err(&got, &want);
        assert!(e <= 1e-6, "{backend:?}: m = {got:?}, want {want:?}");
        // A plain run reads the state and writes nothing back.
        let before = got.clone();
        s.run(&feeds).unwrap();
        let after = s
            .trained_graph()
            .unwrap()
            .initializer("m")
            .unwrap()
            .tensor
            .to_f64_vec();
        assert_eq!(before, after, "{backend:?}: a forward run moved the state");
    }
}

/// A parameter the loss does not read (gradient zero) and one whose gradient is a
/// constant (the passes fold both into initializers of the training graph) still take
/// their optimizer step: SGD with lr 0.1 lowers L = Σ x·w + Σ c by 0.1 per element of c
/// and leaves the unread v as it was.
#[test]
fn constant_and_absent_gradients_take_their_step() {
    let text = r#"
graphrun: 1
name: unread
inputs:
  - {name: x, dtype: f32, shape: [4, 3]}
outputs: [loss, other]
initializers:
  - {name: w, dtype: f32, shape: [3], values: [1.0, 2.0, 3.0]}
  - {name: c, dtype: f32, shape: [5], values: [1.0, 1.0, 1.0, 1.0, 1.0]}
  - {name: v, dtype: f32, shape: [3], values: [1.0, 2.0, 3.0]}
nodes:
  - {op: Mul, inputs: [x, w], outputs: [xw]}
  - {op: ReduceSum, inputs: [xw], outputs: [a], attrs: {keepdims: 0}}
  - {op: ReduceSum, inputs: [c], outputs: [b], attrs: {keepdims: 0}}
  - {op: Add, inputs: [a, b], outputs: [loss]}
  - {op: Mul, inputs: [x, v], outputs: [other]}
training:
  loss: loss
  optimizer: {sgd: {lr: 0.1}}
"#;
    let g = Model::from_str(text, ".").unwrap().graph;
    let x = randn(&[4, 3], 2).cast(DType::F32);
    let xs: Vec<f64> = x.to_f64_vec();
    let col: Vec<f64> = (0..3)
        .map(|j| (0..4).map(|i| xs[i * 3 + j]).sum())
        .collect();
    for backend in backends() {
        let opts = SessionOptions {
            backend,
            ..Default::default()
        };
        let mut s = Session::new(g.clone(), opts).unwrap();
        let feeds = HashMap::from([("x".to_string(), x.clone())]);
        let mut w = [1.0f64, 2.0, 3.0];
        for k in 0..3 {
            let l = s.train_step(&feeds).unwrap();
            let want: f64 =
                (0..3).map(|j| col[j] * w[j]).sum::<f64>() + 5.0 * (1.0 - 0.1 * k as f64);
            assert!(
                (l - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{backend:?}: step {k}: loss {l}, want {want}"
            );
            for j in 0..3 {
                w[j] -= 0.1 * col[j];
            }
        }
        let t = s.trained_graph().unwrap();
        assert_eq!(
            t.initializer("v").unwrap().tensor.to_f64_vec(),
            vec![1.0, 2.0, 3.0]
        );
    }
}
