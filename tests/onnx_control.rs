//! If, Loop and Scan (src/onnx/nodes/control.rs): small models whose bodies read values
//! of the graph around them, on every backend in f32 and f64 against float64 references
//! written here from the ONNX definitions, with gradients against central finite
//! differences; the decisions made when the model is loaded (a known condition, a
//! computed trip count, a loop that stops early) and the refusals, by name.

mod common;
#[path = "common/onnx_case.rs"]
mod onnx_case;
#[path = "common/onnx_model.rs"]
mod onnx_model;

use common::*;
use graphrun::onnx::proto::{AttributeProto, GraphProto, NodeProto, ValueInfoProto};
use graphrun::{DType, Session, SessionOptions, Tensor};
use onnx_case::{assert_outputs, grads_match_fd, Fed};
use onnx_model::*;
use std::collections::HashMap;

/// A graph attribute.
fn graph_attr(name: &str, g: GraphProto) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: 5,
        g: Some(Box::new(g)),
        ..Default::default()
    }
}

/// A body graph: its nodes, typed inputs and outputs.
fn body(nodes: Vec<NodeProto>, inputs: Vec<ValueInfoProto>, outputs: &[&str]) -> GraphProto {
    GraphProto {
        name: "body".into(),
        node: nodes,
        input: inputs,
        output: outputs
            .iter()
            .map(|o| ValueInfoProto {
                name: o.to_string(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn n(op: &str, ins: &[&str], outs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
    let mut x = node(op, "", ins, outs, attrs);
    x.name = outs[0].to_string();
    x
}

fn constant(out: &str, t: &Tensor) -> NodeProto {
    let mut value = initializer("", t);
    value.name.clear();
    n(
        "Constant",
        &[],
        &[out],
        vec![AttributeProto {
            name: "value".into(),
            r#type: 4,
            t: Some(value),
            ..Default::default()
        }],
    )
}

/// A model of `nodes` over fed inputs (floating ones in the run's dtype).
struct Flow {
    nodes: Vec<NodeProto>,
    opset: i64,
    inputs: Vec<(&'static str, Tensor)>,
    outputs: Vec<&'static str>,
}

impl Flow {
    fn args(&self, dt: DType) -> Vec<Tensor> {
        self.inputs
            .iter()
            .map(|(_, t)| {
                if t.dtype().is_float() {
                    t.cast(dt)
                } else {
                    t.clone()
                }
            })
            .collect()
    }
    fn graph(&self, dt: DType) -> graphrun::Result<graphrun::Graph> {
        let infos = self
            .inputs
            .iter()
            .zip(self.args(dt))
            .map(|((name, _), t)| input_like(name, &t))
            .collect();
        let bytes = model_bytes(self.nodes.clone(), self.opset, infos, vec![], &self.outputs);
        graphrun::onnx::from_bytes(&bytes, "flow", std::path::Path::new("."))
    }
    fn feeds(&self, args: &[Tensor]) -> HashMap<String, Tensor> {
        self.inputs
            .iter()
            .zip(args)
            .map(|((n, _), t)| (n.to_string(), t.clone()))
            .collect()
    }
}

/// Runs `f` on every backend in f32 and f64 against `reference`, and checks the f64
/// gradients of Σ dy·(output 0) with respect to inputs `wrt` on the CPU against finite
/// differences of it.
fn check_flow(what: &str, f: &Flow, wrt: &[usize], reference: impl Fn(&[Vec<f64>]) -> Expected) {
    for dt in [DType::F32, DType::F64] {
        let args = f.args(dt);
        let vals: Vec<Vec<f64>> = args.iter().map(Tensor::to_f64_vec).collect();
        let want = reference(&vals);
        let g = f
            .graph(dt)
            .unwrap_or_else(|e| panic!("{what}: import: {e}"));
        for backend in backends() {
            if !computes(backend, dt) {
                continue;
            }
            for fused in [false, true] {
                let opts = SessionOptions {
                    backend,
                    ..if fused {
                        SessionOptions::default()
                    } else {
                        SessionOptions::unfused()
                    }
                };
                let mut s = Session::new(g.clone(), opts).unwrap();
                let got = s
                    .run(&f.feeds(&args))
                    .unwrap_or_else(|e| panic!("{what} {dt} on {backend:?}: {e}"));
                let at = format!("{what} {dt} on {backend:?}");
                assert_outputs(&at, &got, &want, dt, 2e-6);
            }
        }
    }
    if wrt.is_empty() {
        return;
    }
    let args = f.args(DType::F64);
    let names: Vec<&str> = f.inputs.iter().map(|(n, _)| *n).collect();
    let fed = Fed {
        names: &names,
        feeds: f.feeds(&args),
        vals: args.iter().map(Tensor::to_f64_vec).collect(),
    };
    // Output 0 alone: a backward pass seeds every output it is not given with ones.
    let first = Flow {
        nodes: f.nodes.clone(),
        opset: f.opset,
        inputs: f.inputs.clone(),
        outputs: f.outputs[..1].to_vec(),
    };
    let g = first.graph(DType::F64).unwrap();
    grads_match_fd(what, g, f.outputs[0], &fed, wrt, 99, reference);
}

fn typed(name: &str, dims: &[usize]) -> ValueInfoProto {
    let dims: Vec<Option<usize>> = dims.iter().map(|&d| Some(d)).collect();
    input(name, DType::F32, &dims)
}

/// s·W for s [r, 3] and W [3, 3] (row-major).
fn matmul3(s: &[f64], w: &[f64]) -> Vec<f64> {
    let rows = s.len() / 3;
    let mut out = vec![0.0; rows * 3];
    for r in 0..rows {
        for j in 0..3 {
            out[r * 3 + j] = (0..3).map(|k| s[r * 3 + k] * w[k * 3 + j]).sum();
        }
    }
    out
}

/// Scan (opset 16): a recurrence s ← tanh(s·W + x_t ⊙ u_t) over x [2, 5, 3] along axis 1
/// read backwards and u [5, 3] along axis 0 forwards, W read from the graph around the
/// body; the scan output 2·s stacked on the last axis in reverse order.
#[test]
fn scan_on_every_backend_with_gradients() {
    let sb = body(
        vec![
            n("MatMul", &["s", "W"], &["sw"], vec![]),
            n("Mul", &["xt", "ut"], &["xu"], vec![]),
            n("Add", &["sw", "xu"], &["pre"], vec![]),
            n("Tanh", &["pre"], &["s_out"], vec![]),
            n("Add", &["s_out", "s_out"], &["y_t"], vec![]),
        ],
        vec![typed("s", &[2, 3]), typed("xt", &[2, 3]), typed("ut", &[3])],
        &["s_out", "y_t"],
    );
    let f = Flow {
        nodes: vec![n(
            "Scan",
            &["s0", "x", "u"],
            &["s_final", "ys"],
            vec![
                graph_attr("body", sb),
                int_attr("num_scan_inputs", 2),
                ints_attr("scan_input_axes", &[1, 0]),
                ints_attr("scan_input_directions", &[1, 0]),
                ints_attr("scan_output_axes", &[-1]),
                ints_attr("scan_output_directions", &[1]),
            ],
        )],
        opset: 16,
        inputs: vec![
            ("s0", rand(&[2, 3], 1, -1.0, 1.0)),
            ("x", rand(&[2, 5, 3], 2, -1.0, 1.0)),
            ("u", rand(&[5, 3], 3, -1.0, 1.0)),
            ("W", rand(&[3, 3], 4, -0.8, 0.8)),
        ],
        outputs: vec!["ys", "s_final"],
    };
    let reference = |v: &[Vec<f64>]| -> Expected {
        let (mut s, x, u, w) = (v[0].clone(), &v[1], &v[2], &v[3]);
        let mut steps = vec![];
        for t in 0..5 {
            let xt = 4 - t;
            let sw = matmul3(&s, w);
            s = (0..6)
                .map(|i| {
                    let (r, j) = (i / 3, i % 3);
                    (sw[i] + x[r * 15 + xt * 3 + j] * u[t * 3 + j]).tanh()
                })
                .collect();
            steps.push(s.iter().map(|a| 2.0 * a).collect::<Vec<f64>>());
        }
        steps.reverse();
        // ys [2, 3, 5]: step t on the last axis.
        let mut ys = vec![0.0; 30];
        for (t, st) in steps.iter().enumerate() {
            for i in 0..6 {
                ys[i * 5 + t] = st[i];
            }
        }
        vec![(vec![2, 3, 5], ys), (vec![2, 3], s)]
    };
    check_flow("Scan", &f, &[0, 1, 2, 3], reference);
}

/// Scan at opset 8: a batch axis in front of each scan input's time axis, each batch
/// entry scanned on its own (ONNX's test_scan_sum, with a nonlinear step).
#[test]
fn scan_opset8_batches() {
    let sb = body(
        vec![
            n("Add", &["s", "xt"], &["pre"], vec![]),
            n("Tanh", &["pre"], &["s_out"], vec![]),
            n("Identity", &["s_out"], &["y_t"], vec![]),
        ],
        vec![typed("s", &[2]), typed("xt", &[2])],
        &["s_out", "y_t"],
    );
    let f = Flow {
        nodes: vec![n(
            "Scan",
            &["", "s0", "x"],
            &["s_final", "ys"],
            vec![
                graph_attr("body", sb),
                int_attr("num_scan_inputs", 1),
                ints_attr("directions", &[1]),
            ],
        )],
        opset: 8,
        inputs: vec![
            ("s0", rand(&[3, 2], 5, -1.0, 1.0)),
            ("x", rand(&[3, 4, 2], 6, -1.0, 1.0)),
        ],
        outputs: vec!["ys", "s_final"],
    };
    let reference = |v: &[Vec<f64>]| -> Expected {
        let mut ys = vec![0.0; 24];
        let mut fin = vec![0.0; 6];
        for b in 0..3 {
            let mut s = [v[0][b * 2], v[0][b * 2 + 1]];
            for t in 0..4 {
                let xt = 3 - t;
                for j in 0..2 {
                    s[j] = (s[j] + v[1][b * 8 + xt * 2 + j]).tanh();
                    ys[b * 8 + t * 2 + j] = s[j];
                }
            }
            fin[b * 2..b * 2 + 2].copy_from_slice(&s);
        }
        vec![(vec![3, 4, 2], ys), (vec![3, 2], fin)]
    };
    check_flow("Scan-8", &f, &[0, 1], reference);
}

/// The body of a Loop computing y ← y·a + x[i] (x read from the graph around it, row i
/// sliced by the iteration number), with the scan output y·y, and a condition that
/// is `cond_in` passed through unless `stop_below` gives a bound on Σy.
fn loop_body(stop_below: Option<f32>) -> GraphProto {
    let mut nodes = vec![
        constant("one", &Tensor::scalar(1i64)),
        n("Add", &["i", "one"], &["end"], vec![]),
        n("Unsqueeze", &["i", "zero_axis"], &["start1"], vec![]),
        n("Unsqueeze", &["end", "zero_axis"], &["end1"], vec![]),
        constant("zero_axis", &Tensor::from_vec(&[1], vec![0i64]).unwrap()),
        n("Slice", &["x", "start1", "end1"], &["row"], vec![]),
        n("Mul", &["y", "a"], &["ya"], vec![]),
        n("Add", &["ya", "row"], &["y_out"], vec![]),
        n("Mul", &["y_out", "y_out"], &["sq"], vec![]),
    ];
    // Constants may come after their readers in a body as written; move them first.
    nodes.sort_by_key(|x| x.op_type != "Constant");
    match stop_below {
        None => nodes.push(n("Identity", &["c"], &["c_out"], vec![])),
        Some(b) => {
            nodes.push(n(
                "ReduceSum",
                &["y_out"],
                &["total"],
                vec![int_attr("keepdims", 0)],
            ));
            nodes.push(constant("bound32", &Tensor::scalar(b)));
            nodes.push(n("CastLike", &["bound32", "total"], &["bound"], vec![]));
            nodes.push(n("Less", &["total", "bound"], &["c_out"], vec![]));
        }
    }
    body(
        nodes,
        vec![
            input("i", DType::I64, &[]),
            input("c", DType::Bool, &[]),
            typed("y", &[1, 3]),
        ],
        &if stop_below.is_some() {
            vec!["c_out", "y_out"]
        } else {
            vec!["c_out", "y_out", "sq"]
        },
    )
}

/// Loop with a trip count the model computes from a shape (x's rows) and the scan output
/// stacked per iteration; gradients flow through every iteration.
#[test]
fn counted_loop_on_every_backend_with_gradients() {
    let f = Flow {
        nodes: vec![
            n("Shape", &["x"], &["xs"], vec![int_attr("end", 1)]),
            n("Squeeze", &["xs"], &["m"], vec![]),
            n(
                "Loop",
                &["m", "", "y0"],
                &["y_final", "sqs"],
                vec![graph_attr("body", loop_body(None))],
            ),
        ],
        opset: 13,
        inputs: vec![
            ("y0", rand(&[1, 3], 7, -1.0, 1.0)),
            ("x", rand(&[4, 3], 8, -1.0, 1.0)),
            ("a", rand(&[1, 3], 9, 0.5, 1.0)),
        ],
        outputs: vec!["sqs", "y_final"],
    };
    let reference = |v: &[Vec<f64>]| -> Expected {
        let mut y = v[0].clone();
        let mut sqs = vec![];
        for i in 0..4 {
            for j in 0..3 {
                y[j] = y[j] * v[2][j] + v[1][i * 3 + j];
            }
            sqs.extend(y.iter().map(|a| a * a));
        }
        vec![(vec![4, 1, 3], sqs), (vec![1, 3], y)]
    };
    check_flow("Loop", &f, &[0, 1, 2], reference);
}

/// A Loop whose condition its body computes (Σy < bound): its known trip count is run,
/// and the loop-carried value stops changing once the condition fails, as ONNX's loop
/// stops; a condition fed at run time decides whether it runs at all.
#[test]
fn loop_that_stops_early_keeps_its_last_value() {
    for (bound, go) in [
        (1.5f32, true),
        (100.0, true),
        (-100.0, true),
        (100.0, false),
    ] {
        let f = Flow {
            nodes: vec![
                constant("m", &Tensor::scalar(6i64)),
                n(
                    "Loop",
                    &["m", "go", "y0"],
                    &["y_final"],
                    vec![graph_attr("body", loop_body(Some(bound)))],
                ),
            ],
            opset: 13,
            inputs: vec![
                ("y0", rand(&[1, 3], 10, 0.0, 0.5)),
                ("x", rand(&[6, 3], 11, 0.0, 0.5)),
                ("a", rand(&[1, 3], 12, 0.9, 1.1)),
                ("go", Tensor::scalar(graphrun::tensor::Bool::from(go))),
            ],
            outputs: vec!["y_final"],
        };
        let reference = |v: &[Vec<f64>]| -> Expected {
            let mut y = v[0].clone();
            let mut running = v[3][0] != 0.0;
            for i in 0..6 {
                if !running {
                    break;
                }
                for j in 0..3 {
                    y[j] = y[j] * v[2][j] + v[1][i * 3 + j];
                }
                running = y.iter().sum::<f64>() < bound as f64;
            }
            vec![(vec![1, 3], y)]
        };
        check_flow(
            &format!("Loop bound {bound} go {go}"),
            &f,
            &[0, 1, 2],
            reference,
        );
    }
}

/// If with a condition the model fixes (one branch written) and one fed at run time (both
/// written, one selected), each branch reading values of the graph around it; an If
/// nested in a Loop's body, its condition the iteration number's parity.
#[test]
fn if_known_fed_and_nested() {
    let branches = || {
        (
            body(vec![n("Mul", &["p", "q"], &["t"], vec![])], vec![], &["t"]),
            body(vec![n("Sub", &["p", "q"], &["e"], vec![])], vec![], &["e"]),
        )
    };
    let want = |v: &[Vec<f64>], c: bool| -> Expected {
        let y = v[0]
            .iter()
            .zip(&v[1])
            .map(|(p, q)| if c { p * q } else { p - q })
            .collect();
        vec![(vec![2, 3], y)]
    };
    for known in [Some(true), Some(false), None] {
        for fed in [true, false] {
            if known.is_some() && !fed {
                continue;
            }
            let (t, e) = branches();
            let mut nodes = vec![];
            let mut inputs = vec![
                ("p", rand(&[2, 3], 13, -1.0, 1.0)),
                ("q", rand(&[2, 3], 14, -1.0, 1.0)),
            ];
            let c = match known {
                Some(c) => {
                    nodes.push(constant(
                        "c",
                        &Tensor::from_vec(&[1], vec![graphrun::tensor::Bool::from(c)]).unwrap(),
                    ));
                    c
                }
                None => {
                    inputs.push(("c", Tensor::scalar(graphrun::tensor::Bool::from(fed))));
                    fed
                }
            };
            nodes.push(n(
                "If",
                &["c"],
                &["y"],
                vec![graph_attr("then_branch", t), graph_attr("else_branch", e)],
            ));
            let f = Flow {
                nodes,
                opset: 16,
                inputs,
                outputs: vec!["y"],
            };
            check_flow(&format!("If {known:?} fed {fed}"), &f, &[0, 1], |v| {
                want(v, c)
            });
        }
    }
    // Nested: y ← y·p where i is even, y ← y − q where it is odd.
    let (t, e) = (
        body(vec![n("Mul", &["y", "p"], &["t"], vec![])], vec![], &["t"]),
        body(vec![n("Sub", &["y", "q"], &["e"], vec![])], vec![], &["e"]),
    );
    let lb = body(
        vec![
            constant("two", &Tensor::scalar(2i64)),
            constant("zero", &Tensor::scalar(0i64)),
            n("Mod", &["i", "two"], &["parity"], vec![]),
            n("Equal", &["parity", "zero"], &["even"], vec![]),
            n(
                "If",
                &["even"],
                &["y_out"],
                vec![graph_attr("then_branch", t), graph_attr("else_branch", e)],
            ),
            n("Identity", &["c"], &["c_out"], vec![]),
        ],
        vec![
            input("i", DType::I64, &[]),
            input("c", DType::Bool, &[]),
            typed("y", &[2, 3]),
        ],
        &["c_out", "y_out"],
    );
    let f = Flow {
        nodes: vec![
            constant("m", &Tensor::scalar(5i64)),
            n(
                "Loop",
                &["m", "", "y0"],
                &["y"],
                vec![graph_attr("body", lb)],
            ),
        ],
        opset: 16,
        inputs: vec![
            ("y0", rand(&[2, 3], 15, -1.0, 1.0)),
            ("p", rand(&[2, 3], 16, -1.0, 1.0)),
            ("q", rand(&[2, 3], 17, -1.0, 1.0)),
        ],
        outputs: vec!["y"],
    };
    check_flow("If in Loop", &f, &[0, 1, 2], |v| {
        let mut y = v[0].clone();
        for i in 0..5 {
            for j in 0..6 {
                y[j] = if i % 2 == 0 {
                    y[j] * v[1][j]
                } else {
                    y[j] - v[2][j]
                };
            }
        }
        vec![(vec![2, 3], y)]
    });
}

/// What cannot be written out is refused naming the node and the value: a trip count fed
/// at run time, scan outputs of a loop that may stop early, an op graphrun lacks inside a
/// body (reported with the model's), a body of the wrong arity.
#[test]
fn control_flow_refusals_name_the_node() {
    let import = |nodes: Vec<NodeProto>, inputs: Vec<(&str, Tensor)>| -> String {
        let infos = inputs.iter().map(|(n, t)| input_like(n, t)).collect();
        let bytes = model_bytes(nodes, 16, infos, vec![], &["y"]);
        match graphrun::onnx::from_bytes(&bytes, "bad", std::path::Path::new(".")) {
            Ok(_) => panic!("imported"),
            Err(e) => e.to_string(),
        }
    };
    let lx = || {
        vec![
            ("m", Tensor::scalar(3i64)),
            ("y0", rand(&[1, 3], 1, -1.0, 1.0)),
            ("x", rand(&[4, 3], 2, -1.0, 1.0)),
            ("a", rand(&[1, 3], 3, -1.0, 1.0)),
        ]
    };
    let e = import(
        vec![n(
            "Loop",
            &["m", "", "y0"],
            &["y", "s"],
            vec![graph_attr("body", loop_body(None))],
        )],
        lx(),
    );
    assert!(e.contains("'y'") && e.contains("trip count 'm'"), "{e}");
    let mut stop = loop_body(Some(1.0));
    stop.output.push(ValueInfoProto {
        name: "sq".into(),
        ..Default::default()
    });
    let mut ins = lx();
    ins.remove(0);
    let e = import(
        vec![
            constant("m", &Tensor::scalar(3i64)),
            n(
                "Loop",
                &["m", "", "y0"],
                &["y", "s"],
                vec![graph_attr("body", stop)],
            ),
        ],
        ins,
    );
    assert!(e.contains("'y' (Loop)") && e.contains("scan output"), "{e}");
    let weird = body(vec![n("NoSuchOp", &["p"], &["t"], vec![])], vec![], &["t"]);
    let e = import(
        vec![
            n("Frobnicate", &["p"], &["c"], vec![]),
            n(
                "If",
                &["c"],
                &["y"],
                vec![
                    graph_attr("then_branch", weird.clone()),
                    graph_attr("else_branch", weird),
                ],
            ),
        ],
        vec![("p", rand(&[2], 1, -1.0, 1.0))],
    );
    assert!(
        e.contains("Frobnicate") && e.contains("NoSuchOp (2 nodes: 'y/t', 'y/t')"),
        "{e}"
    );
    let e = import(
        vec![n(
            "Scan",
            &["y0", "x"],
            &["y"],
            vec![
                graph_attr("body", loop_body(None)),
                int_attr("num_scan_inputs", 1),
            ],
        )],
        vec![
            ("y0", rand(&[1, 3], 1, -1.0, 1.0)),
            ("x", rand(&[4, 3], 2, -1.0, 1.0)),
        ],
    );
    assert!(e.contains("'y' (Scan)") && e.contains("outputs"), "{e}");
}

/// A loop nested in a loop multiplies their copies: past the cap the import stops with an
/// error naming the node rather than writing the graph out.
#[test]
fn nested_loops_past_the_cap_are_refused() {
    let inner = body(
        vec![
            n("Add", &["y", "y"], &["y2"], vec![]),
            n("Identity", &["c"], &["c_out"], vec![]),
        ],
        vec![
            input("i", DType::I64, &[]),
            input("c", DType::Bool, &[]),
            typed("y", &[1]),
        ],
        &["c_out", "y2"],
    );
    let outer = body(
        vec![
            constant("m_in", &Tensor::scalar(16_000i64)),
            n(
                "Loop",
                &["m_in", "", "y"],
                &["y_out"],
                vec![graph_attr("body", inner)],
            ),
            n("Identity", &["c"], &["c_out"], vec![]),
        ],
        vec![
            input("i", DType::I64, &[]),
            input("c", DType::Bool, &[]),
            typed("y", &[1]),
        ],
        &["c_out", "y_out"],
    );
    let nodes = vec![
        constant("m", &Tensor::scalar(16_000i64)),
        n(
            "Loop",
            &["m", "", "y0"],
            &["y"],
            vec![graph_attr("body", outer)],
        ),
    ];
    let bytes = model_bytes(nodes, 16, vec![typed("y0", &[1])], vec![], &["y"]);
    let e = graphrun::onnx::from_bytes(&bytes, "bomb", std::path::Path::new("."))
        .expect_err("refused")
        .to_string();
    assert!(e.contains("(Loop)") && e.contains("1000000 values"), "{e}");
}

/// An If whose branches give different shapes, its condition computed from the data (as
/// torchvision's detection exports test whether any box is left): the session runs the
/// condition first, in a stage of its own, then the branch it picks.
#[test]
fn if_with_branches_of_different_shapes_on_a_computed_condition() {
    let then = body(vec![n("Identity", &["x"], &["t"], vec![])], vec![], &["t"]);
    let empty = Tensor::from_vec(&[0], Vec::<f32>::new()).unwrap();
    let other = body(vec![constant("e", &empty)], vec![], &["e"]);
    let nodes = vec![
        constant("half", &Tensor::scalar(0.5f32)),
        n("Greater", &["x", "half"], &["hot"], vec![]),
        n("Cast", &["hot"], &["hotf"], vec![int_attr("to", 1)]),
        n(
            "ReduceSum",
            &["hotf"],
            &["count"],
            vec![int_attr("keepdims", 0)],
        ),
        constant("zero", &Tensor::scalar(0f32)),
        n("Greater", &["count", "zero"], &["any"], vec![]),
        n(
            "If",
            &["any"],
            &["y"],
            vec![
                graph_attr("then_branch", then),
                graph_attr("else_branch", other),
            ],
        ),
    ];
    let bytes = model_bytes(
        nodes,
        13,
        vec![input("x", DType::F32, &[Some(50)])],
        vec![],
        &["y"],
    );
    let g = graphrun::onnx::from_bytes(&bytes, "if_shapes", std::path::Path::new(".")).unwrap();
    for (lo, hi) in [(0.0, 1.0), (0.0, 0.5)] {
        let x = rand(&[50], 31, lo, hi).cast(DType::F32);
        let any = x.to_f64_vec().iter().any(|&v| v > 0.5);
        let want = if any { x.to_f64_vec() } else { vec![] };
        for backend in backends() {
            let opts = SessionOptions {
                backend,
                ..SessionOptions::unfused()
            };
            let got = Session::new(g.clone(), opts)
                .and_then(|mut s| s.run(&HashMap::from([("x".to_string(), x.clone())])))
                .unwrap_or_else(|e| panic!("x in [{lo}, {hi}) on {backend:?}: {e}"));
            assert_eq!(
                got[0].1.shape(),
                &[want.len()],
                "x in [{lo}, {hi}) on {backend:?}"
            );
            assert_eq!(
                got[0].1.to_f64_vec(),
                want,
                "x in [{lo}, {hi}) on {backend:?}"
            );
        }
    }
}

/// FlexAttention's definition in float64: Q `[b, hq, l, e]`, K `[b, hkv, s, e]`, V `[b,
/// hkv, s, ev]` (query head h reads key/value head h / (hq / hkv)); the scores times
/// `scale`, then `score_mod`'s soft cap and bias when given, the softmax over the keys,
/// times `prob_mod`'s factor when given, times V.
#[allow(clippy::too_many_arguments)]
fn flex_reference(
    [q, k, v]: [&[f64]; 3],
    [b, hq, hkv, l, s, e, ev]: [usize; 7],
    scale: f64,
    cap_bias: Option<(f64, &[f64])>,
    prob_factor: Option<f64>,
) -> Vec<f64> {
    let mut out = vec![0.0; b * hq * l * ev];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / (hq / hkv);
            for i in 0..l {
                let qrow = &q[((bi * hq + h) * l + i) * e..][..e];
                let mut sc: Vec<f64> = (0..s)
                    .map(|j| {
                        let krow = &k[((bi * hkv + kh) * s + j) * e..][..e];
                        let d: f64 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum();
                        let x = d * scale;
                        match cap_bias {
                            Some((cap, bias)) => cap * (x / cap).tanh() + bias[i * s + j],
                            None => x,
                        }
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                for x in &mut sc {
                    *x = (*x - m).exp() / z * prob_factor.unwrap_or(1.0);
                }
                for c in 0..ev {
                    out[((bi * hq + h) * l + i) * ev + c] = (0..s)
                        .map(|j| sc[j] * v[((bi * hkv + kh) * s + j) * ev + c])
                        .sum();
                }
            }
        }
    }
    out
}

fn flex_node(ins: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
    let mut x = node("FlexAttention", "ai.onnx.preview", ins, &["y"], attrs);
    x.name = "flex".into();
    x
}

/// A FlexAttention model: its node over inputs fed in the run's dtype, the preview domain
/// imported.
fn flex_graph(
    nodes: Vec<NodeProto>,
    inputs: &[(&str, Tensor)],
    dt: DType,
) -> graphrun::Result<graphrun::Graph> {
    use graphrun::onnx::proto::{GraphProto as G, ModelProto, OperatorSetIdProto};
    use prost::Message;
    let g = G {
        node: nodes,
        input: inputs
            .iter()
            .map(|(n, t)| input_like(n, &t.cast(dt)))
            .collect(),
        output: vec![ValueInfoProto {
            name: "y".into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    let m = ModelProto {
        ir_version: 10,
        opset_import: ["", "ai.onnx.preview"]
            .iter()
            .zip([23, 1])
            .map(|(d, version)| OperatorSetIdProto {
                domain: d.to_string(),
                version,
            })
            .collect(),
        graph: Some(g),
        ..Default::default()
    };
    graphrun::onnx::from_bytes(&m.encode_to_vec(), "flex", std::path::Path::new("."))
}

/// ai.onnx.preview's FlexAttention on every backend in f32 and f64 (fused and not), with
/// gradients against finite differences: multi-head with the default scale 1/√8, and
/// grouped-query (4 query heads on 2 key/value heads) with scale 0.3, a `score_mod` that
/// soft-caps the scores at 3 and adds a bias read from the graph around it, and a
/// `prob_mod` that halves the probabilities.
#[test]
fn flex_attention_on_every_backend_with_gradients() {
    let (b, l, s, e, ev) = (2, 5, 7, 8, 6);
    for (hq, hkv, mods) in [(3, 3, false), (4, 2, true)] {
        let q = randn(&[b, hq, l, e], 11);
        let k = randn(&[b, hkv, s, e], 12);
        let v = randn(&[b, hkv, s, ev], 13);
        let bias = rand(&[l, s], 14, -1.0, 1.0);
        let mut attrs = vec![];
        if mods {
            let untyped = |name: &str| ValueInfoProto {
                name: name.into(),
                ..Default::default()
            };
            let score = body(
                vec![
                    constant("cap", &Tensor::scalar(3.0f32)),
                    n("CastLike", &["cap", "sc"], &["capc"], vec![]),
                    n("Div", &["sc", "capc"], &["d"], vec![]),
                    n("Tanh", &["d"], &["t"], vec![]),
                    n("Mul", &["t", "capc"], &["capped"], vec![]),
                    n("Add", &["capped", "bias"], &["sc_out"], vec![]),
                ],
                vec![untyped("sc")],
                &["sc_out"],
            );
            let prob = body(
                vec![
                    constant("half", &Tensor::scalar(0.5f32)),
                    n("CastLike", &["half", "p"], &["halfc"], vec![]),
                    n("Mul", &["p", "halfc"], &["p_out"], vec![]),
                ],
                vec![untyped("p")],
                &["p_out"],
            );
            attrs = vec![
                float_attr("scale", 0.3),
                graph_attr("score_mod", score),
                graph_attr("prob_mod", prob),
            ];
        }
        // √scale is taken in f32 and applied to Q and K (onnx.reference), so even in f64
        // the scores are scaled by that root squared.
        let scale = if mods { 0.3 } else { 1.0 / (e as f64).sqrt() };
        let root = (scale as f32).sqrt() as f64;
        let scale = root * root;
        let mut inputs = vec![("q", q), ("k", k), ("v", v)];
        if mods {
            inputs.push(("bias", bias));
        }
        let what = format!(
            "FlexAttention {hq}/{hkv} heads{}",
            if mods { ", mods" } else { "" }
        );
        let reference = |x: &[Vec<f64>]| {
            let cap_bias = mods.then(|| (3.0, x[3].as_slice()));
            let y = flex_reference(
                [&x[0], &x[1], &x[2]],
                [b, hq, hkv, l, s, e, ev],
                scale,
                cap_bias,
                mods.then_some(0.5),
            );
            vec![(vec![b, hq, l, ev], y)]
        };
        let nodes = vec![flex_node(&["q", "k", "v"], attrs)];
        for dt in [DType::F32, DType::F64] {
            let args: Vec<Tensor> = inputs.iter().map(|(_, t)| t.cast(dt)).collect();
            let vals: Vec<Vec<f64>> = args.iter().map(Tensor::to_f64_vec).collect();
            let want = reference(&vals);
            let g = flex_graph(nodes.clone(), &inputs, dt)
                .unwrap_or_else(|e| panic!("{what}: import: {e}"));
            let feeds: HashMap<String, Tensor> = inputs
                .iter()
                .zip(&args)
                .map(|((n, _), t)| (n.to_string(), t.clone()))
                .collect();
            for backend in backends() {
                if !computes(backend, dt) {
                    continue;
                }
                for opts in [SessionOptions::default(), SessionOptions::unfused()] {
                    let opts = SessionOptions { backend, ..opts };
                    let at = format!("{what} {dt} on {backend:?}");
                    let got = Session::new(g.clone(), opts)
                        .and_then(|mut s| s.run(&feeds))
                        .unwrap_or_else(|e| panic!("{at}: {e}"));
                    assert_outputs(&at, &got, &want, dt, 2e-6);
                }
            }
            if dt == DType::F64 {
                let names: Vec<&str> = inputs.iter().map(|(n, _)| *n).collect();
                let fed = Fed {
                    names: &names,
                    feeds,
                    vals,
                };
                let wrt: Vec<usize> = (0..inputs.len()).collect();
                grads_match_fd(&what, g, "y", &fed, &wrt, 7, reference);
            }
        }
    }
}

/// FlexAttention's refusals name the node and what is wrong.
#[test]
fn flex_attention_refusals() {
    let q = randn(&[1, 2, 3, 4], 1);
    let ins = [("q", q.clone()), ("k", q.clone()), ("v", q.clone())];
    let err = |nodes: Vec<NodeProto>, ins: &[(&str, Tensor)]| {
        flex_graph(nodes, ins, DType::F32).unwrap_err().to_string()
    };
    let flat = randn(&[2, 3, 4], 2);
    let e = err(
        vec![flex_node(&["q", "k", "v"], vec![])],
        &[("q", flat.clone()), ("k", flat.clone()), ("v", flat)],
    );
    assert!(e.contains("flex") && e.contains("rank of 4"), "{e}");
    let e = err(
        vec![flex_node(
            &["q", "k", "v"],
            vec![int_attr("softmax_precision", 7)],
        )],
        &ins,
    );
    assert!(
        e.contains("softmax_precision") && e.contains("got 7"),
        "{e}"
    );
    let two = body(
        vec![
            n("Identity", &["sc"], &["a"], vec![]),
            n("Identity", &["sc"], &["b"], vec![]),
        ],
        vec![ValueInfoProto {
            name: "sc".into(),
            ..Default::default()
        }],
        &["a", "b"],
    );
    let e = err(
        vec![flex_node(
            &["q", "k", "v"],
            vec![graph_attr("score_mod", two)],
        )],
        &ins,
    );
    assert!(e.contains("score_mod") && e.contains("2 outputs"), "{e}");
    let k3 = randn(&[1, 3, 3, 4], 3);
    let e = err(
        vec![flex_node(&["q", "k", "v"], vec![])],
        &[("q", q), ("k", k3.clone()), ("v", k3)],
    );
    assert!(e.contains("not a multiple of 3"), "{e}");
}

/// A Loop body's inputs: the iteration count, the condition `cond` and an untyped
/// loop-carried sequence `s_in`.
fn sequence_loop_inputs(cond: &str) -> Vec<ValueInfoProto> {
    vec![
        input("i", DType::I64, &[]),
        input(cond, DType::Bool, &[]),
        ValueInfoProto {
            name: "s_in".into(),
            ..Default::default()
        },
    ]
}

/// A sequence through a Loop of known trip count (built up by SequenceInsert, the body
/// also reading an element of a sequence of the graph around it, as SequenceMap's
/// function body does) and through an If whose condition is fed (both branches give a
/// sequence of two, selected element by element); gradients through both.
#[test]
fn sequences_through_loop_and_if_on_every_backend_with_gradients() {
    let loop_body = body(
        vec![
            n("Identity", &["c"], &["c_out"], vec![]),
            n("SequenceAt", &["outer", "i"], &["elem"], vec![]),
            n("Mul", &["elem", "b"], &["prod"], vec![]),
            n("CastLike", &["i", "prod"], &["i_f"], vec![]),
            n("Add", &["prod", "i_f"], &["t"], vec![]),
            n("SequenceInsert", &["s_in", "t"], &["s_out"], vec![]),
        ],
        sequence_loop_inputs("c"),
        &["c_out", "s_out"],
    );
    let then = body(
        vec![
            n("Add", &["a", "b"], &["sum"], vec![]),
            n("Mul", &["a", "b"], &["prod2"], vec![]),
            n(
                "SequenceConstruct",
                &["sum", "prod2"],
                &["then_seq"],
                vec![],
            ),
        ],
        vec![],
        &["then_seq"],
    );
    let other = body(
        vec![
            n("Sub", &["a", "b"], &["diff"], vec![]),
            n("SequenceConstruct", &["diff", "a"], &["else_seq"], vec![]),
        ],
        vec![],
        &["else_seq"],
    );
    let nodes = vec![
        n("SequenceConstruct", &["a"], &["s0"], vec![]),
        n("SequenceConstruct", &["a", "b", "a"], &["outer"], vec![]),
        constant("trips", &Tensor::scalar(3i64)),
        n(
            "Loop",
            &["trips", "", "s0"],
            &["s3"],
            vec![graph_attr("body", loop_body)],
        ),
        n(
            "ConcatFromSequence",
            &["s3"],
            &["y"],
            vec![int_attr("axis", 0)],
        ),
        n(
            "If",
            &["c"],
            &["chosen"],
            vec![
                graph_attr("then_branch", then),
                graph_attr("else_branch", other),
            ],
        ),
        n(
            "ConcatFromSequence",
            &["chosen"],
            &["z"],
            vec![int_attr("axis", 0)],
        ),
    ];
    for c in [true, false] {
        let f = Flow {
            nodes: nodes.clone(),
            opset: 17,
            inputs: vec![
                ("a", rand(&[2, 3], 21, -1.0, 1.0)),
                ("b", rand(&[2, 3], 22, -1.0, 1.0)),
                (
                    "c",
                    Tensor::from_vec(&[], vec![graphrun::tensor::Bool::from(c)]).unwrap(),
                ),
            ],
            outputs: vec!["y", "z"],
        };
        let reference = |v: &[Vec<f64>]| -> Expected {
            let (a, b) = (&v[0], &v[1]);
            let mut y = a.clone();
            for i in 0..3 {
                let elem = if i == 1 { b } else { a };
                y.extend(elem.iter().zip(b).map(|(e, b)| e * b + i as f64));
            }
            let z: Vec<f64> = if c {
                let s = a.iter().zip(b).map(|(a, b)| a + b);
                s.chain(a.iter().zip(b).map(|(a, b)| a * b)).collect()
            } else {
                a.iter()
                    .zip(b)
                    .map(|(a, b)| a - b)
                    .chain(a.iter().copied())
                    .collect()
            };
            vec![(vec![8, 3], y), (vec![4, 3], z)]
        };
        check_flow(&format!("sequences, cond {c}"), &f, &[0, 1], reference);
    }
}

#[test]
fn sequences_through_control_flow_refusals() {
    let import = |nodes: Vec<NodeProto>, outputs: &[&str]| {
        let a = rand(&[2, 3], 1, -1.0, 1.0).cast(DType::F32);
        let bytes = model_bytes(
            nodes,
            17,
            vec![input_like("a", &a), input("c", DType::Bool, &[])],
            vec![],
            outputs,
        );
        graphrun::onnx::from_bytes(&bytes, "flow", std::path::Path::new("."))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    // An If whose condition is fed, giving sequences of different lengths.
    let then = body(
        vec![n("SequenceConstruct", &["a", "a"], &["t"], vec![])],
        vec![],
        &["t"],
    );
    let other = body(
        vec![n("SequenceConstruct", &["a"], &["e"], vec![])],
        vec![],
        &["e"],
    );
    let e = import(
        vec![
            n(
                "If",
                &["c"],
                &["s"],
                vec![
                    graph_attr("then_branch", then),
                    graph_attr("else_branch", other),
                ],
            ),
            n(
                "ConcatFromSequence",
                &["s"],
                &["y"],
                vec![int_attr("axis", 0)],
            ),
        ],
        &["y"],
    );
    assert!(e.contains("'s'") || e.contains("(If)"), "{e}");
    assert!(
        e.contains("a sequence of 2") && e.contains("a sequence of 1"),
        "{e}"
    );
    // A Loop whose fed condition may stop it early, carrying a sequence.
    let b = body(
        vec![
            n("Identity", &["cond"], &["cond_out"], vec![]),
            n("SequenceInsert", &["s_in", "a"], &["s_out"], vec![]),
        ],
        sequence_loop_inputs("cond"),
        &["cond_out", "s_out"],
    );
    let e = import(
        vec![
            n("SequenceConstruct", &["a"], &["s0"], vec![]),
            constant("m", &Tensor::scalar(2i64)),
            n(
                "Loop",
                &["m", "c", "s0"],
                &["s2"],
                vec![graph_attr("body", b)],
            ),
            n(
                "ConcatFromSequence",
                &["s2"],
                &["y"],
                vec![int_attr("axis", 0)],
            ),
        ],
        &["y"],
    );
    assert!(
        e.contains("(Loop)") && e.contains("is a sequence") && e.contains("stop it early"),
        "{e}"
    );
}
