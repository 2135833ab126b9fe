//! The channels-last layout (`passes::layout`): which nodes it lays out and where it
//! transposes, that a laid-out graph computes what the graph did (outputs and, through
//! autodiff of the laid-out convolutions and pools, gradients), on the CPU (which runs it
//! channels first again) and on CUDA (which runs it as laid out, and lays out a session's
//! graph itself where cuDNN is found).

mod common;

use graphrun::graph::{Graph, Op};
use graphrun::passes::autodiff::{backward_with, BackwardOptions};
use graphrun::passes::layout::{channels_first, channels_last};
use graphrun::passes::{optimize, PassOptions};
use graphrun::{BackendKind, Model, Session, SessionOptions, Tensor};
use std::collections::{BTreeMap, HashMap};

fn graph(body: &str) -> Graph {
    let text = format!("graphrun: 1\nname: t\n{body}");
    Model::from_str(&text, ".")
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
        .graph
}

fn eval() -> &'static dyn graphrun::graph::HostEval {
    PassOptions::default().eval
}

fn laid_out(g: &Graph) -> (Graph, usize) {
    let (l, n) = channels_last(g, eval(), &|_| true).unwrap_or_else(|e| panic!("{e}"));
    graphrun::validate(&l).unwrap_or_else(|e| panic!("invalid result: {e}"));
    (l, n)
}

fn is_last(op: &Op) -> bool {
    matches!(
        op,
        Op::Conv { window, .. } | Op::FusedConv { window, .. } | Op::MaxPool { window, .. }
            if window.channels_last
    )
}

/// The transposes a plan would run: those whose output something reads.
fn live_transposes(g: &Graph) -> Vec<String> {
    let read: std::collections::HashSet<&String> = g
        .nodes
        .iter()
        .flat_map(|n| &n.inputs)
        .chain(&g.outputs)
        .collect();
    g.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Transpose { .. }) && read.contains(&n.outputs[0]))
        .map(|n| n.name.clone())
        .collect()
}

/// A small residual network: a stem convolution and max pool, a block of two
/// convolutions with Relus and a shortcut Add, a global average pool (ReduceMean with its
/// axes as an input) and a classifier behind a Flatten, and the features scaled by the
/// sigmoid of their pool (a squeeze-and-excite's broadcast product).
fn resnetish(dtype: &str, pads: &str) -> Graph {
    graph(&format!(
        "
inputs:
  - {{name: x, dtype: {dtype}, shape: [2, 3, 12, 12]}}
outputs: [logits, se]
initializers:
  - {{name: w0, dtype: {dtype}, shape: [8, 3, 3, 3], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 1}}}}
  - {{name: b0, dtype: {dtype}, shape: [8], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 2}}}}
  - {{name: w1, dtype: {dtype}, shape: [8, 8, 3, 3], init: {{dist: uniform, low: -0.3, high: 0.3, seed: 3}}}}
  - {{name: w2, dtype: {dtype}, shape: [8, 8, 1, 1], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 4}}}}
  - {{name: b2, dtype: {dtype}, shape: [8], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 5}}}}
  - {{name: axes, dtype: i64, shape: [2], values: [2, 3], trainable: false}}
  - {{name: fc, dtype: {dtype}, shape: [8, 5], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 6}}}}
  - {{name: two, dtype: {dtype}, shape: [], values: [2.0], trainable: false}}
nodes:
  - {{op: Conv, inputs: [x, w0, b0], outputs: [c0], attrs: {{pads: {pads}, strides: [1, 1]}}}}
  - {{op: Relu, inputs: [c0], outputs: [r0]}}
  - {{op: MaxPool, inputs: [r0], outputs: [p0], attrs: {{kernel_shape: [3, 3], strides: [2, 2], pads: [1, 1, 1, 1]}}}}
  - {{op: Conv, inputs: [p0, w1], outputs: [c1], attrs: {{pads: [1, 1, 1, 1]}}}}
  - {{op: Sigmoid, inputs: [c1], outputs: [s1]}}
  - {{op: Mul, inputs: [s1, two], outputs: [m1]}}
  - {{op: Conv, inputs: [m1, w2, b2], outputs: [c2]}}
  - {{op: Add, inputs: [c2, p0], outputs: [a2]}}
  - {{op: Relu, inputs: [a2], outputs: [feat]}}
  - {{op: ReduceMean, inputs: [feat, axes], outputs: [gap], attrs: {{keepdims: 1}}}}
  - {{op: Flatten, inputs: [gap], outputs: [flat]}}
  - {{op: MatMul, inputs: [flat, fc], outputs: [logits]}}
  - {{op: Sigmoid, inputs: [gap], outputs: [sg]}}
  - {{op: Mul, inputs: [feat, sg], outputs: [se]}}
"
    ))
}

/// Every convolution, the pool and everything between them is laid out; transposes run
/// only at the edges: the image in, the feature map out (a graph output), the pooled
/// features before the Flatten, and the weights (trainable: a Transpose each).
#[test]
fn lays_out_everything_between_convolutions() {
    let g = resnetish("f32", "[1, 1, 1, 1]");
    let (l, n) = laid_out(&g);
    let laid: Vec<&str> = l
        .nodes
        .iter()
        .filter(|n| is_last(&n.op))
        .map(|n| n.name.as_str())
        .collect();
    assert_eq!(laid.len(), 4, "{laid:?}");
    // 4 window ops, 2 Relus, 2 Sigmoids, 2 Muls, Add, ReduceMean.
    assert_eq!(n, 12);
    let live = live_transposes(&l);
    // x, w0, w1, w2 in; se and gap (for the Flatten) out.
    assert_eq!(live.len(), 6, "{live:?}");
    assert!(l.nodes.iter().any(|n| matches!(&n.op,
        Op::Reduce { axes: Some(a), keepdims: true, .. } if a == &[1, 2])));
}

/// It leaves a graph alone where a convolution cannot be laid out: f64 (no channels-last
/// kernels), padding that differs at the two ends of an axis, or a backend that declines.
#[test]
fn leaves_what_it_cannot_lay_out() {
    for (what, g) in [
        ("f64", resnetish("f64", "[1, 1, 1, 1]")),
        ("asymmetric pads", resnetish("f32", "[1, 1, 0, 0]")),
    ] {
        let (l, _) = laid_out(&g);
        let stem = l
            .nodes
            .iter()
            .find(|n| matches!(n.op, Op::Conv { .. }) && n.inputs[0] == "x");
        assert!(
            stem.is_some_and(|n| !is_last(&n.op)),
            "{what}: the stem was laid out"
        );
        if what == "f64" {
            assert_eq!(l, g, "{what}: the graph changed");
        }
    }
    let g = resnetish("f32", "[1, 1, 1, 1]");
    let (l, n) = channels_last(&g, eval(), &|_| false).unwrap();
    assert_eq!((n, &l), (0, &g), "a backend that declines");
}

/// The run and the gradients of `g` as it is and laid out, on `backend`, agree with the
/// CPU's run of `g`.
fn check_same(g: &Graph, backend: BackendKind, what: &str) {
    let dims = BTreeMap::new();
    let feeds = Model { graph: g.clone() }.random_inputs(11, &dims).unwrap();
    let (l, n) = laid_out(g);
    assert!(n > 0, "{what}: nothing laid out");
    let run = |g: &Graph, b: BackendKind| {
        let opts = SessionOptions {
            backend: b,
            ..SessionOptions::unfused()
        };
        let mut s = Session::new(g.clone(), opts).unwrap_or_else(|e| panic!("{what}: {e}"));
        let out = s.run(&feeds).unwrap_or_else(|e| panic!("{what}: {e}"));
        let grads = s
            .backward(&feeds, &HashMap::new())
            .unwrap_or_else(|e| panic!("{e}"));
        (out, grads.grads)
    };
    let (want, want_grads) = run(g, BackendKind::Cpu);
    let half = g.inputs.iter().any(|i| i.dtype.size() == 2);
    let tol = match (backend, half) {
        (_, true) => 3e-2,
        (BackendKind::Cpu, _) => 1e-5,
        _ => 2e-3,
    };
    let close = |a: &Tensor, b: &Tensor, name: &str| {
        assert_eq!(a.shape(), b.shape(), "{what}: {name}");
        let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
        let err = common::rel_err(&x, &y);
        assert!(err < tol, "{what}: {name} differs by {err}");
    };
    let (got, got_grads) = run(&l, backend);
    for ((n1, a), (n2, b)) in want.iter().zip(&got) {
        assert_eq!(n1, n2);
        close(b, a, n1);
    }
    assert_eq!(want_grads.len(), got_grads.len());
    for ((n1, a), (n2, b)) in want_grads.iter().zip(&got_grads) {
        assert_eq!(n1, n2);
        close(b, a, &format!("the gradient of {n1}"));
    }
    // The backward graph of the laid-out one differentiates the laid-out nodes: its
    // convolutions' and pool's gradients are channels-last too.
    let shapes: HashMap<String, Vec<usize>> = feeds
        .iter()
        .map(|(k, v)| (k.clone(), v.shape().to_vec()))
        .collect();
    let opts = BackwardOptions {
        training: false,
        inputs: true,
        eval: eval(),
    };
    let bwd = backward_with(&l, &l.outputs, &shapes, &HashMap::new(), &opts).unwrap();
    let grads_last = bwd
        .graph
        .nodes
        .iter()
        .filter(|n| matches!(&n.op, Op::ConvGrad { window, .. } | Op::MaxPoolGrad { window, .. } if window.channels_last))
        .count();
    assert!(grads_last > 0, "{what}: no channels-last gradient");
    // That graph, undone for the CPU node by node, gives the same gradients (seeded with
    // ones, as `backward` seeds them).
    let mut all = feeds.clone();
    for (out, seed) in &bwd.seeds {
        let (_, t) = want.iter().find(|(n, _)| n == out).unwrap();
        let ones = vec![1.0; t.shape().iter().product()];
        all.insert(
            seed.clone(),
            Tensor::from_f64(t.dtype(), t.shape(), &ones).unwrap(),
        );
    }
    let names: Vec<String> = bwd.grads.iter().map(|(_, d)| d.clone()).collect();
    let mut s = Session::new(bwd.graph.clone(), SessionOptions::unfused()).unwrap();
    let got = s
        .run_fetch(&all, &names)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    for ((p, _), t) in bwd.grads.iter().zip(&got) {
        let (_, w) = want_grads.iter().find(|(n, _)| n == p).unwrap();
        close(t, w, &format!("the laid-out graph's gradient of {p}"));
    }
    // And the CPU undoes the layout node by node.
    let first = channels_first(&l, eval()).unwrap();
    assert!(!first.nodes.iter().any(|n| is_last(&n.op)), "{what}");
}

/// Exported convolutional networks (tiny configurations), after the fusion passes:
/// ResNet (convolutions fused with their activations and residuals), MobileNet v2 and v3
/// (depthwise convolutions, Clip and HardSwish), EfficientNet (squeeze-and-excite) and
/// ConvNeXt (depthwise convolutions, then a layer norm over the channels read through the
/// model's own Transpose).
fn exports() -> Vec<(&'static str, Graph)> {
    [
        "resnet_torchscript_op17",
        "mobilenet_v2_dynamo_op18",
        "mobilenet_v3_torchscript_op17",
        "efficientnet_torchscript_op17",
        "convnext_torchscript_op17",
    ]
    .into_iter()
    .map(|name| {
        let m = Model::load(format!("tests/fixtures/zoo/{name}/model.onnx")).unwrap();
        let mut g = optimize(&m.graph, &PassOptions::default()).unwrap().0;
        for s in g.symbols() {
            g.dims.entry(s).or_insert(2);
        }
        (name, g)
    })
    .collect()
}

#[test]
fn a_laid_out_graph_computes_the_same_on_the_cpu() {
    check_same(
        &resnetish("f32", "[1, 1, 1, 1]"),
        BackendKind::Cpu,
        "resnetish",
    );
    for (name, g) in exports() {
        check_same(&g, BackendKind::Cpu, name);
    }
    // Frozen for a forward-only run: the weights are constants, stored laid out.
    let frozen =
        graphrun::passes::freeze(&resnetish("f32", "[1, 1, 1, 1]"), &PassOptions::default())
            .unwrap()
            .0;
    let (l, _) = laid_out(&frozen);
    assert!(l.initializers.iter().any(|i| i.name.ends_with(".nhwc")));
    check_same(&frozen, BackendKind::Cpu, "frozen");
}

#[test]
fn a_laid_out_graph_computes_the_same_on_cuda() {
    if !common::cuda_present() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    for dt in ["f32", "bf16", "f16"] {
        let g = resnetish(dt, "[1, 1, 1, 1]");
        check_same(&g, BackendKind::Cuda, &format!("resnetish {dt}"));
    }
    for (name, g) in exports() {
        check_same(&g, BackendKind::Cuda, name);
    }
    // A CUDA session lays its graph out itself where cuDNN is found.
    let (_, g) = exports().swap_remove(0);
    if graphrun::backends::cuda::cudnn_found() {
        let opts = SessionOptions {
            backend: BackendKind::Cuda,
            ..SessionOptions::unfused()
        };
        let s = Session::new(g, opts).unwrap();
        assert!(s.graph().nodes.iter().any(|n| is_last(&n.op)));
    }
}

/// A convolution then a max pool of each geometry (odd channel counts, so that the
/// channels-last gradient's runs of channels end short; dilations, ceil_mode, padding).
fn pools() -> Vec<(String, Graph)> {
    let cases = [
        // channels, kernel, strides, pads, dilations, ceil_mode
        (5, [3, 3], [2, 2], [1, 1, 1, 1], [1, 1], 0),
        (6, [2, 3], [1, 2], [0, 1, 0, 1], [1, 1], 1),
        (3, [3, 2], [2, 1], [1, 0, 1, 0], [2, 1], 0),
        (9, [2, 2], [3, 3], [0, 0, 1, 1], [1, 2], 1),
    ];
    cases
        .iter()
        .map(|(c, k, s, p, d, ceil)| {
            let body = format!(
                "
inputs:
  - {{name: x, dtype: f32, shape: [2, 4, 11, 10]}}
outputs: [y]
initializers:
  - {{name: w, dtype: f32, shape: [{c}, 4, 3, 3], init: {{dist: uniform, low: -0.5, high: 0.5, seed: 1}}}}
nodes:
  - {{op: Conv, inputs: [x, w], outputs: [h], attrs: {{pads: [1, 1, 1, 1]}}}}
  - {{op: MaxPool, inputs: [h], outputs: [y], attrs: {{kernel_shape: {k:?}, strides: {s:?}, pads: {p:?}, dilations: {d:?}, ceil_mode: {ceil}}}}}
"
            );
            (format!("pool c{c} k{k:?} s{s:?} p{p:?} d{d:?} ceil {ceil}"), graph(&body))
        })
        .collect()
}

#[test]
fn laid_out_max_pools_compute_the_same() {
    for (what, g) in pools() {
        check_same(&g, BackendKind::Cpu, &what);
        if common::cuda_present() {
            check_same(&g, BackendKind::Cuda, &what);
        }
    }
}
