//! What a training step changes besides the gradient step: BatchNormalization's running
//! statistics (state updates), checked against PyTorch's own training run of the same
//! exported CNN, and weights read through small nodes (which must not be folded into
//! constants when the plan is made).

mod common;
#[path = "common/onnx_model.rs"]
mod onnx_model;
use common::*;
use graphrun::graph::{Optimizer, StateUpdate, Training};
use graphrun::onnx::{ImportMode, ImportOptions};
use graphrun::{BackendKind, DType, Graph, Model, Session, SessionOptions, Tensor};
use onnx_model::*;
use std::collections::HashMap;
use std::path::Path;

const FIX: &str = "tests/fixtures/bn_train";

fn npy(name: &str) -> Tensor {
    Tensor::read_npy(&Path::new(FIX).join(name)).unwrap()
}

/// Row `s` of a tensor stacked by step (`[steps, ...]`), without the step axis.
fn step_of(t: &Tensor, s: usize) -> Tensor {
    let r = t.take_rows(&[s]).unwrap();
    r.clone().reshaped(&r.shape()[1..]).unwrap()
}

/// Step `s` of the fixture's data.
fn step_feeds(s: usize, dtype: DType) -> HashMap<String, Tensor> {
    let (x, y) = (npy("x.npy"), npy("y.npy"));
    HashMap::from([
        ("x".to_string(), step_of(&x, s).cast(dtype)),
        ("labels".to_string(), step_of(&y, s)),
    ])
}

const LM: &str = "tests/fixtures/lm_train";

/// Step `s` of the language-model fixture's token batches (ids and next-token labels).
fn lm_feeds(s: usize) -> HashMap<String, Tensor> {
    let read = |f: &str| Tensor::read_npy(&Path::new(LM).join(f)).unwrap();
    HashMap::from([
        ("input_ids".to_string(), step_of(&read("ids.npy"), s)),
        ("labels".to_string(), step_of(&read("labels.npy"), s)),
    ])
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
        ..Default::default()
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

/// Tiny GPT-2 and LLaMA exports (`transformers`, logits as the only output;
/// tests/fixtures/lm_train, made by scripts/export_lm_training.py) fine-tuned with the
/// cross-entropy graphrun appends: the first 20 Adam steps' losses follow PyTorch's run
/// from the same weights (float64 on the CPU, f32 on every backend).
#[test]
fn exported_language_models_fine_tune_as_pytorch() {
    let dir = Path::new(LM);
    let read = |f: &str| Tensor::read_npy(&dir.join(f)).unwrap();
    for arch in ["gpt2", "llama"] {
        let want = read(&format!("{arch}.losses.npy")).to_f64_vec();
        let opts = ImportOptions {
            mode: ImportMode::Train,
            ..Default::default()
        };
        let mut g = Model::load_with(dir.join(format!("{arch}.onnx")), &opts)
            .unwrap()
            .graph;
        let loss = graphrun::graph::loss::append_cross_entropy(
            &mut g,
            "logits",
            "labels",
            &graphrun::backends::cpu::HOST_EVAL,
        )
        .unwrap();
        g.training = Some(Training {
            loss,
            optimizer: Optimizer::Adam {
                lr: 0.003,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        });
        // Not tighter in f64: the exports bake f32 constants (LLaMA's rotary tables),
        // whose rounding Adam's normalized steps carry on.
        let mut runs = vec![(BackendKind::Cpu, DType::F64, 1e-5)];
        runs.extend(backends().into_iter().map(|b| (b, DType::F32, 2e-3)));
        for (backend, dtype, tol) in runs {
            let opts = SessionOptions {
                backend,
                training: true,
                ..Default::default()
            };
            let mut s = Session::new(graphrun::exec::with_float_dtype(&g, dtype), opts).unwrap();
            for (k, w) in want.iter().enumerate() {
                let l = s.train_step(&lm_feeds(k)).unwrap();
                assert!(
                    (l - w).abs() <= tol * w,
                    "{arch} {backend:?} {dtype}: step {k}: loss {l} vs PyTorch's {w}"
                );
            }
        }
    }
}

/// The appended loss refuses what it cannot train, saying why.
#[test]
fn cross_entropy_refusals_say_why() {
    let dir = Path::new(LM);
    let g = Model::load(dir.join("gpt2.onnx")).unwrap().graph;
    let ev = &graphrun::backends::cpu::HOST_EVAL;
    let e = graphrun::graph::loss::append_cross_entropy(&mut g.clone(), "nope", "labels", ev)
        .unwrap_err()
        .to_string();
    assert!(e.contains("'nope' is not an output"), "{e}");
    let e = graphrun::graph::loss::append_cross_entropy(&mut g.clone(), "logits", "input_ids", ev)
        .unwrap_err()
        .to_string();
    assert!(e.contains("already has a value named 'input_ids'"), "{e}");
    let mut ok = g.clone();
    graphrun::graph::loss::append_cross_entropy(&mut ok, "logits", "labels", ev).unwrap();
    let labels = ok.input("labels").unwrap();
    assert_eq!(labels.dtype, DType::I64);
    assert_eq!(
        labels.shape,
        g.input("input_ids").unwrap().shape,
        "[batch, seq]"
    );
}

/// GPT-2 ties its output projection to the token embedding; the exporter writes the
/// projection as a second initializer, the embedding's transpose folded. The training
/// import ties it back (a Transpose of the embedding), so that one parameter trains; a
/// plain import leaves the file as written.
#[test]
fn training_import_ties_an_exported_copy_back() {
    let file = &Path::new(LM).join("gpt2.onnx");
    let copies = |g: &Graph| {
        g.initializers
            .iter()
            .filter(|i| i.tensor.shape() == [32, 100])
            .count()
    };
    let plain = Model::load(file).unwrap().graph;
    assert_eq!(copies(&plain), 1, "the exporter's transposed copy");
    let opts = ImportOptions {
        mode: ImportMode::Train,
        ..Default::default()
    };
    let g = Model::load_with(file, &opts).unwrap().graph;
    assert_eq!(copies(&g), 0);
    let tie = g
        .nodes
        .iter()
        .find(|n| n.name.ends_with("/tied"))
        .expect("a tying node");
    assert!(matches!(tie.op, graphrun::Op::Transpose { .. }), "{tie:?}");
    assert_eq!(tie.inputs, ["m.lm_head.weight"]);
    // Constant-valued weights (fresh zeros) are not taken for copies of each other; a
    // random one and its transpose are, and its exact duplicate too.
    let w = randn(&[3, 2], 5).cast(DType::F32);
    let wt = Tensor::from_vec(&[2, 3], {
        let v = w.to_f64_vec();
        (0..6)
            .map(|k| v[(k % 3) * 2 + k / 3] as f32)
            .collect::<Vec<f32>>()
    })
    .unwrap();
    let zeros = Tensor::zeros(DType::F32, &[3, 3]);
    let x = Tensor::zeros(DType::F32, &[1, 3]);
    let mm = |x: &str, w: &str, y: &str| {
        let mut n = node("MatMul", "", &[x, w], &[y], vec![]);
        n.name = y.to_string();
        n
    };
    let nodes = vec![
        mm("x", "z1", "a"),
        mm("a", "z2", "b"),
        mm("b", "w", "c"),
        mm("c", "val_t", "d"),
        mm("b", "w_again", "e"),
    ];
    let inits = vec![
        initializer("z1", &zeros),
        initializer("z2", &zeros),
        initializer("w", &w),
        initializer("val_t", &wt),
        initializer("w_again", &w),
    ];
    let bytes = model_bytes(nodes, 17, vec![input_like("x", &x)], inits, &["d", "e"]);
    let import = |mode| {
        let opts = ImportOptions {
            mode,
            ..Default::default()
        };
        graphrun::onnx::from_bytes_with(&bytes, "m", Path::new("."), &opts).unwrap()
    };
    let names =
        |g: &Graph| -> Vec<String> { g.initializers.iter().map(|i| i.name.clone()).collect() };
    assert_eq!(
        names(&import(ImportMode::AsWritten)),
        ["z1", "z2", "w", "val_t", "w_again"]
    );
    let g = import(ImportMode::Train);
    assert_eq!(names(&g), ["z1", "z2", "w"]);
    let tied: Vec<(&str, &str)> = g
        .nodes
        .iter()
        .filter(|n| n.name.ends_with("/tied"))
        .map(|n| (n.op.name(), n.inputs[0].as_str()))
        .collect();
    assert_eq!(tied, [("Transpose", "w"), ("Identity", "w")]);
}

/// Trained weights written back into the ONNX file (`onnx::with_weights`, what `convert
/// --weights` does) give a model that runs as the trained session does: GPT-2's exported
/// copy of its tied projection is derived from the trained embedding, and a
/// BatchNormalization statistic an Identity gave becomes an initializer.
#[test]
fn trained_weights_write_back_into_the_onnx_file() {
    let train = |file: &Path,
                 loss: Option<&str>,
                 steps: usize,
                 feeds: &dyn Fn(usize) -> HashMap<String, Tensor>| {
        let opts = ImportOptions {
            mode: ImportMode::Train,
            ..Default::default()
        };
        let mut g = Model::load_with(file, &opts).unwrap().graph;
        let loss = match loss {
            Some(l) => l.to_string(),
            None => graphrun::graph::loss::append_cross_entropy(
                &mut g,
                "logits",
                "labels",
                &graphrun::backends::cpu::HOST_EVAL,
            )
            .unwrap(),
        };
        g.training = Some(Training {
            loss,
            optimizer: Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            },
        });
        let mut s = Session::new(g.clone(), SessionOptions::default()).unwrap();
        for k in 0..steps {
            s.train_step(&feeds(k)).unwrap();
        }
        let t = s.trained_graph().unwrap();
        let weights: Vec<(String, Tensor)> = g
            .initializers
            .iter()
            .filter_map(|i| Some((i.name.clone(), t.initializer(&i.name)?.tensor.clone())))
            .collect();
        let bytes = std::fs::read(file).unwrap();
        let (out, written) =
            graphrun::onnx::with_weights(&bytes, Path::new("."), &weights).unwrap();
        let back = graphrun::onnx::from_bytes(&out, "back", Path::new(".")).unwrap();
        (s, back, written)
    };
    // GPT-2: the written file's logits are the trained session's.
    let (mut s, back, written) = train(&Path::new(LM).join("gpt2.onnx"), None, 5, &lm_feeds);
    assert_eq!(written.derived, ["val_374"], "{written:?}");
    assert!(written.left_out.is_empty(), "{written:?}");
    let want = s.run_fetch(&lm_feeds(0), &["logits".into()]).unwrap();
    let mut b = Session::new(back, SessionOptions::default()).unwrap();
    let mut only_ids = lm_feeds(0);
    only_ids.remove("labels");
    let got = b.run_fetch(&only_ids, &["logits".into()]).unwrap();
    let e = rel_err(&got[0].to_f64_vec(), &want[0].to_f64_vec());
    assert!(e <= 1e-6, "gpt2: written model's logits rel err {e:.2e}");
    // The BN model exported from eval(): the file, with its trained weights and running
    // statistics, gives PyTorch's eval-mode logits.
    let (_, back, written) = train(
        &Path::new(FIX).join("preserve.onnx"),
        Some("loss"),
        5,
        &|k| step_feeds(k, DType::F32),
    );
    let mut d = written.derived.clone();
    d.sort();
    assert_eq!(d, ["b2.running_mean", "b2.running_var"], "{written:?}");
    let mut b = Session::new(back, SessionOptions::default()).unwrap();
    let got = b
        .run_fetch(&step_feeds(0, DType::F32), &["logits".into()])
        .unwrap();
    let want = npy("preserve.eval_logits.npy").to_f64_vec();
    let e = rel_err(&got[0].to_f64_vec(), &want);
    assert!(
        e <= 2e-4,
        "preserve: written model's eval logits rel err {e:.2e}"
    );
}

/// Weights that do not fit the file are refused with the names and types; weights the
/// file has no place for are named, not written.
#[test]
fn weights_that_do_not_fit_are_refused() {
    let bytes = std::fs::read(Path::new(FIX).join("train.onnx")).unwrap();
    let wrong = vec![(
        "c1.weight".to_string(),
        Tensor::zeros(DType::F32, &[8, 3, 3]),
    )];
    let e = graphrun::onnx::with_weights(&bytes, Path::new("."), &wrong)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("'c1.weight' is f32[8, 3, 3], but the model's initializer is f32[8, 3, 3, 3]"),
        "{e}"
    );
    let wrong = vec![("c1.bias".to_string(), Tensor::zeros(DType::F64, &[8]))];
    let e = graphrun::onnx::with_weights(&bytes, Path::new("."), &wrong)
        .unwrap_err()
        .to_string();
    assert!(e.contains("'c1.bias' is f64[8]"), "{e}");
    let extra = vec![("nowhere".to_string(), Tensor::zeros(DType::F32, &[2]))];
    let (_, w) = graphrun::onnx::with_weights(&bytes, Path::new("."), &extra).unwrap();
    assert_eq!(w.left_out, ["nowhere"]);
    assert_eq!(w.replaced, 0);
}

/// `--class-axis 1`: a segmentation model's `[N, C, H, W]` scores against `[N, H, W]`
/// labels, the loss as PyTorch's `cross_entropy(scores, labels)` computes it (f64, in the
/// test), one label ignored; an axis the scores lack is refused.
#[test]
fn cross_entropy_on_the_class_axis_of_image_scores() {
    let yaml = "graphrun: 1\nname: seg\ninputs:\n  - {name: x, dtype: f64, shape: [N, 3, 4, 5]}\n\
                outputs: [scores]\ninitializers:\n  - {name: w, dtype: f64, shape: [1, 3, 1, 1], values: [0.5, -1.0, 2.0]}\n\
                nodes:\n  - {op: Mul, inputs: [x, w], outputs: [scores]}\n";
    let ev = &graphrun::backends::cpu::HOST_EVAL;
    let g = Model::from_str(yaml, ".").unwrap().graph;
    let e =
        graphrun::graph::loss::append_cross_entropy_on(&mut g.clone(), "scores", 4, "labels", ev)
            .unwrap_err()
            .to_string();
    assert!(e.contains("class axis 4 is not an axis"), "{e}");
    let mut g = g;
    let loss =
        graphrun::graph::loss::append_cross_entropy_on(&mut g, "scores", 1, "labels", ev).unwrap();
    let shape: Vec<_> = g
        .input("labels")
        .unwrap()
        .shape
        .iter()
        .map(|d| d.to_string())
        .collect();
    assert_eq!(shape, ["N", "4", "5"]);
    let x = randn(&[2, 3, 4, 5], 90);
    let mut labels: Vec<i64> = (0..40).map(|i| (i * 7 % 3) as i64).collect();
    labels[5] = -100;
    let feeds = HashMap::from([
        ("x".to_string(), x.clone()),
        (
            "labels".to_string(),
            Tensor::from_vec(&[2, 4, 5], labels.clone()).unwrap(),
        ),
    ]);
    let mut s = Session::new(g, SessionOptions::default()).unwrap();
    let out = s.run(&feeds).unwrap();
    let got = out.iter().find(|(n, _)| *n == loss).unwrap().1.to_f64_vec()[0];
    let (xv, w) = (x.to_f64_vec(), [0.5, -1.0, 2.0]);
    let (mut sum, mut count) = (0.0, 0.0);
    for n in 0..2 {
        for p in 0..20 {
            let l = labels[n * 20 + p];
            if l < 0 {
                continue;
            }
            let z: Vec<f64> = (0..3).map(|c| xv[(n * 3 + c) * 20 + p] * w[c]).collect();
            let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
            sum += lse - z[l as usize];
            count += 1.0;
        }
    }
    let want = sum / count;
    assert!(
        (got - want).abs() <= 1e-12 * want.abs(),
        "loss {got}, want {want}"
    );
}

/// Gradient accumulation (`Session::train_step_accumulated`, `train --accumulate`): a
/// step over K equal micro-batches takes the step of the batch they make together (a
/// mean loss), with SGD with momentum and with AdamW, on every backend and dtype; the
/// step's loss is the micro-batches' mean. A step that only kept the last micro-batch's
/// gradient, or summed instead of averaging, moves the weights elsewhere (checked).
#[test]
fn accumulated_micro_batches_step_as_the_whole_batch() {
    let model = Model::load("models/mlp.yaml").unwrap();
    let d = std::collections::BTreeMap::from([("batch".to_string(), 8usize)]);
    let batches: Vec<HashMap<String, Tensor>> = (0..3)
        .map(|s| model.random_inputs(40 + s, &d).unwrap())
        .collect();
    let adamw = Optimizer::AdamW {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let momentum = Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    for backend in backends() {
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            if !computes(backend, dtype) || backend == BackendKind::Cpu && dtype == DType::BF16 {
                continue;
            }
            // bf16 rounds each micro-batch's sum to 8 bits, as PyTorch's .grad does.
            let base = match dtype {
                DType::F64 => 1e-12,
                DType::F32 => 2e-5,
                _ => 3e-2,
            };
            for opt in [&momentum, &adamw] {
                // AdamW divides by the gradients' size, magnifying the rounding of the
                // other summation order where a gradient is near zero.
                let tol = match (opt, dtype) {
                    (Optimizer::AdamW { .. }, DType::F32) => 10.0 * base,
                    // bf16's 8-bit sums, so magnified, flip the sign of near-zero steps:
                    // bf16 is held to SGD's, whose steps are linear in the gradients.
                    (Optimizer::AdamW { .. }, DType::BF16) => continue,
                    _ => base,
                };
                let mut g = model.graph.clone();
                g.training.as_mut().unwrap().optimizer = opt.clone();
                let g = graphrun::exec::with_float_dtype(&g, dtype);
                let opts = SessionOptions {
                    backend,
                    ..Default::default()
                };
                let what = format!("{backend:?} {dtype} {opt:?}");
                let cast = |f: &HashMap<String, Tensor>| -> HashMap<String, Tensor> {
                    f.iter()
                        .map(|(k, t)| {
                            let t = if t.dtype().is_float() {
                                t.cast(dtype)
                            } else {
                                t.clone()
                            };
                            (k.clone(), t)
                        })
                        .collect()
                };
                let mut whole = Session::new(g.clone(), opts.clone()).unwrap();
                let mut micro = Session::new(g.clone(), opts.clone()).unwrap();
                let mut last_only = Session::new(g.clone(), opts).unwrap();
                for (s, b) in batches.iter().enumerate() {
                    let b = cast(b);
                    let parts = graphrun::exec::split_feeds(&b, 4, "micro-batches").unwrap();
                    let lw = whole.train_step(&b).unwrap();
                    let lm = micro.train_step_accumulated(&parts).unwrap();
                    last_only.train_step(&parts[3]).unwrap();
                    assert!(
                        (lw - lm).abs() <= tol * lw.abs(),
                        "{what}: step {s}: loss {lw} whole, {lm} in micro-batches"
                    );
                }
                assert_eq!(micro.steps(), 3);
                let (gw, gm, gl) = (
                    whole.trained_graph().unwrap().clone(),
                    micro.trained_graph().unwrap().clone(),
                    last_only.trained_graph().unwrap().clone(),
                );
                let mut apart = 0.0f64;
                for ((iw, im), il) in gw
                    .initializers
                    .iter()
                    .zip(&gm.initializers)
                    .zip(&gl.initializers)
                {
                    let w = iw.tensor.to_f64_vec();
                    let e = rel_err(&im.tensor.to_f64_vec(), &w);
                    assert!(e <= tol, "{what}: '{}' rel err {e:.2e}", iw.name);
                    apart = apart.max(rel_err(&il.tensor.to_f64_vec(), &w));
                }
                // (bf16's rounding is too coarse for this check; f32 and f64 make it.)
                assert!(
                    dtype == DType::BF16 || apart > 10.0 * tol,
                    "{what}: the test cannot tell ({apart:.2e})"
                );
            }
        }
    }
}

/// `train --accumulate`: the run's losses equal the plain run's; a batch that does not
/// split is refused with a one-line usage error.
#[test]
fn cli_accumulate_trains_as_the_whole_batch() {
    let run = |extra: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_graphrun"))
            .args([
                "train",
                "models/mlp.yaml",
                "-q",
                "--steps",
                "4",
                "--batch-size",
                "16",
            ])
            .args(extra.split_whitespace())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let final_loss = |text: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with("epoch 1: loss"))
            .unwrap_or_else(|| panic!("no epoch line in {text}"));
        line["epoch 1: loss ".len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (code, plain, err) = run("");
    assert_eq!(code, Some(0), "{plain}{err}");
    let (code, acc, err) = run("--accumulate 4");
    assert_eq!(code, Some(0), "{acc}{err}");
    assert!(acc.contains("batch 16 in 4 micro-batches"), "{acc}");
    let (a, b) = (final_loss(&plain), final_loss(&acc));
    assert!(
        (a - b).abs() <= 1e-3 * a.abs(),
        "{a} vs {b}\n{plain}\n{acc}"
    );
    let (code, _, err) = run("--accumulate 3");
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--accumulate 3") && err.contains("micro-batches"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
