//! RNN, GRU and LSTM (src/onnx/nodes/recurrent.rs), and ReverseSequence: each one-node
//! model on every backend, in f32 and (where the backend computes it) f64, against a
//! float64 reference written here step by step from the ONNX definitions, over the
//! directions, layouts, optional inputs, `sequence_lens`, clip, peepholes, input_forget,
//! linear_before_reset and the activation functions; gradients against central finite
//! differences of the reference; and the sequence length that only the fed shapes decide.

mod common;
#[path = "common/onnx_case.rs"]
mod onnx_case;
#[path = "common/onnx_model.rs"]
mod onnx_model;

use common::*;
use graphrun::onnx::proto::AttributeProto;
use graphrun::{DType, Session, SessionOptions, Tensor};
use onnx_case::*;
use onnx_model::*;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Cell {
    Rnn,
    Gru,
    Lstm,
}

impl Cell {
    fn op(self) -> &'static str {
        match self {
            Cell::Rnn => "RNN",
            Cell::Gru => "GRU",
            Cell::Lstm => "LSTM",
        }
    }
    fn gates(self) -> usize {
        match self {
            Cell::Rnn => 1,
            Cell::Gru => 3,
            Cell::Lstm => 4,
        }
    }
}

/// One setting of a recurrent node.
#[derive(Clone, Debug)]
struct Rec {
    cell: Cell,
    /// seq, batch, input, hidden
    dims: [usize; 4],
    direction: &'static str,
    layout: i64,
    bias: bool,
    lens: Option<Vec<i32>>,
    initial: bool,
    peepholes: bool,
    clip: Option<f32>,
    input_forget: bool,
    linear_before_reset: bool,
    /// activations with their alphas and betas (attribute lists)
    acts: Option<(Vec<&'static str>, Vec<f32>, Vec<f32>)>,
}

fn rec(cell: Cell, direction: &'static str) -> Rec {
    Rec {
        cell,
        dims: [4, 3, 5, 4],
        direction,
        layout: 0,
        bias: true,
        lens: None,
        initial: true,
        peepholes: false,
        clip: None,
        input_forget: false,
        linear_before_reset: false,
        acts: None,
    }
}

/// An activation of the recurrent ops in f64, its alpha and beta taken from the lists as
/// far as it uses them (else its defaults).
fn act_fn(name: &str, al: &mut Vec<f32>, be: &mut Vec<f32>) -> Box<dyn Fn(f64) -> f64> {
    let take = |v: &mut Vec<f32>, d: f64| {
        if v.is_empty() {
            d
        } else {
            v.remove(0) as f64
        }
    };
    match name {
        "Sigmoid" => Box::new(|x: f64| 1.0 / (1.0 + (-x).exp())),
        "Tanh" => Box::new(f64::tanh),
        "Relu" => Box::new(|x: f64| x.max(0.0)),
        "Softsign" => Box::new(|x: f64| x / (1.0 + x.abs())),
        "Softplus" => Box::new(|x: f64| (1.0 + x.exp()).ln()),
        "LeakyRelu" => {
            let a = take(al, 0.01);
            Box::new(move |x| if x < 0.0 { a * x } else { x })
        }
        "Elu" => {
            let a = take(al, 1.0);
            Box::new(move |x| if x < 0.0 { a * (x.exp() - 1.0) } else { x })
        }
        "ThresholdedRelu" => {
            let a = take(al, 1.0);
            Box::new(move |x| if x > a { x } else { 0.0 })
        }
        "HardSigmoid" => {
            let (a, b) = (take(al, 0.2), take(be, 0.5));
            Box::new(move |x| (a * x + b).clamp(0.0, 1.0))
        }
        "Affine" => {
            let (a, b) = (take(al, 1.0), take(be, 0.0));
            Box::new(move |x| a * x + b)
        }
        "ScaledTanh" => {
            let (a, b) = (take(al, 1.0), take(be, 1.0));
            Box::new(move |x| a * (b * x).tanh())
        }
        other => panic!("no activation {other}"),
    }
}

impl Rec {
    fn dirs(&self) -> usize {
        if self.direction == "bidirectional" {
            2
        } else {
            1
        }
    }
    fn what(&self) -> String {
        format!("{self:?}")
    }
    fn case(&self, seed: u64) -> Case {
        let [s, b, i, h] = self.dims;
        let (d, g) = (self.dirs(), self.cell.gates());
        let x_shape = if self.layout == 0 {
            [s, b, i]
        } else {
            [b, s, i]
        };
        let st_shape = if self.layout == 0 {
            [d, b, h]
        } else {
            [b, d, h]
        };
        let mut inputs: Vec<(&'static str, Option<Tensor>)> = vec![
            ("x", Some(randn(&x_shape, seed))),
            ("w", Some(rand(&[d, g * h, i], seed + 1, -0.6, 0.6))),
            ("r", Some(rand(&[d, g * h, h], seed + 2, -0.6, 0.6))),
            (
                "b",
                self.bias
                    .then(|| rand(&[d, 2 * g * h], seed + 3, -0.5, 0.5)),
            ),
            (
                "lens",
                self.lens
                    .as_ref()
                    .map(|l| Tensor::from_vec(&[b], l.clone()).unwrap()),
            ),
            ("h0", self.initial.then(|| randn(&st_shape, seed + 4))),
        ];
        let mut outputs = vec!["y", "y_h"];
        if self.cell == Cell::Lstm {
            inputs.push(("c0", self.initial.then(|| randn(&st_shape, seed + 5))));
            inputs.push((
                "p",
                self.peepholes
                    .then(|| rand(&[d, 3 * h], seed + 6, -0.5, 0.5)),
            ));
            outputs.push("y_c");
        }
        while inputs.last().is_some_and(|(_, t)| t.is_none()) {
            inputs.pop();
        }
        let inputs = inputs
            .into_iter()
            .map(|(n, t)| (if t.is_some() { n } else { "" }, t))
            .collect();
        let mut attrs = vec![
            str_attr("direction", self.direction),
            int_attr("hidden_size", h as i64),
        ];
        if self.layout != 0 {
            attrs.push(int_attr("layout", self.layout));
        }
        if let Some(c) = self.clip {
            attrs.push(float_attr("clip", c));
        }
        if self.input_forget {
            attrs.push(int_attr("input_forget", 1));
        }
        if self.linear_before_reset {
            attrs.push(int_attr("linear_before_reset", 1));
        }
        if let Some((names, al, be)) = &self.acts {
            attrs.push(strs_attr("activations", names));
            if !al.is_empty() {
                attrs.push(floats_attr("activation_alpha", al));
            }
            if !be.is_empty() {
                attrs.push(floats_attr("activation_beta", be));
            }
        }
        let mut c = Case::new(
            self.cell.op(),
            if self.layout != 0 { 14 } else { 7 },
            inputs,
        )
        .with(attrs);
        c.outputs = outputs;
        c
    }

    /// Y, Y_h (and Y_c) from the inputs in Case order (empty where omitted).
    fn reference(&self, v: &[Vec<f64>]) -> Expected {
        let [s, bn, ni, h] = self.dims;
        let (nd, g) = (self.dirs(), self.cell.gates());
        let get = |k: usize| v.get(k).filter(|t| !t.is_empty());
        let (x, w, r) = (&v[0], &v[1], &v[2]);
        let bias = get(3);
        let lens = get(4);
        let (h0, c0, p) = (get(5), get(6), get(7));
        let k_acts = match self.cell {
            Cell::Rnn => 1,
            Cell::Gru => 2,
            Cell::Lstm => 3,
        };
        let default: &[&str] = match self.cell {
            Cell::Rnn => &["Tanh"],
            Cell::Gru => &["Sigmoid", "Tanh"],
            Cell::Lstm => &["Sigmoid", "Tanh", "Tanh"],
        };
        let (names, mut al, mut be) = match &self.acts {
            Some((n, a, b)) => (n.clone(), a.clone(), b.clone()),
            None => (default.repeat(nd), vec![], vec![]),
        };
        let acts: Vec<Box<dyn Fn(f64) -> f64>> =
            names.iter().map(|n| act_fn(n, &mut al, &mut be)).collect();
        let clip = |z: f64| match self.clip {
            Some(c) => z.clamp(-c as f64, c as f64),
            None => z,
        };
        let xat = |t: usize, b: usize, i: usize| match self.layout {
            0 => x[(t * bn + b) * ni + i],
            _ => x[(b * s + t) * ni + i],
        };
        let st = |d: usize, b: usize, j: usize| match self.layout {
            0 => (d * bn + b) * h + j,
            _ => (b * nd + d) * h + j,
        };
        let yat = |t: usize, d: usize, b: usize, j: usize| match self.layout {
            0 => ((t * nd + d) * bn + b) * h + j,
            _ => ((b * s + t) * nd + d) * h + j,
        };
        let mut y = vec![0.0; s * nd * bn * h];
        let mut yh = vec![0.0; nd * bn * h];
        let mut yc = vec![0.0; nd * bn * h];
        for d in 0..nd {
            let back = self.direction == "reverse" || d == 1;
            let f = &acts[d * k_acts];
            let wd = |row: usize, i: usize| w[(d * g * h + row) * ni + i];
            let rd = |row: usize, k: usize| r[(d * g * h + row) * h + k];
            let wb = |row: usize| bias.map_or(0.0, |b| b[d * 2 * g * h + row]);
            let rb = |row: usize| bias.map_or(0.0, |b| b[d * 2 * g * h + g * h + row]);
            for b in 0..bn {
                let len = lens.map_or(s, |l| l[b] as usize);
                let mut hv: Vec<f64> = (0..h).map(|j| h0.map_or(0.0, |t| t[st(d, b, j)])).collect();
                let mut cv: Vec<f64> = (0..h).map(|j| c0.map_or(0.0, |t| t[st(d, b, j)])).collect();
                let order: Vec<usize> = if back {
                    (0..len).rev().collect()
                } else {
                    (0..len).collect()
                };
                for t in order {
                    let gx: Vec<f64> = (0..g * h)
                        .map(|row| {
                            (0..ni).map(|i| wd(row, i) * xat(t, b, i)).sum::<f64>() + wb(row)
                        })
                        .collect();
                    let gh: Vec<f64> = (0..g * h)
                        .map(|row| (0..h).map(|k| rd(row, k) * hv[k]).sum::<f64>() + rb(row))
                        .collect();
                    let hn: Vec<f64> = match self.cell {
                        Cell::Rnn => (0..h).map(|j| f(clip(gx[j] + gh[j]))).collect(),
                        Cell::Gru => {
                            let gg = &acts[d * k_acts + 1];
                            let z: Vec<f64> = (0..h).map(|j| f(clip(gx[j] + gh[j]))).collect();
                            let rr: Vec<f64> =
                                (0..h).map(|j| f(clip(gx[h + j] + gh[h + j]))).collect();
                            let cand: Vec<f64> = (0..h)
                                .map(|j| {
                                    let inner = if self.linear_before_reset {
                                        rr[j] * gh[2 * h + j]
                                    } else {
                                        (0..h)
                                            .map(|k| rd(2 * h + j, k) * rr[k] * hv[k])
                                            .sum::<f64>()
                                            + rb(2 * h + j)
                                    };
                                    gg(clip(gx[2 * h + j] + inner))
                                })
                                .collect();
                            (0..h)
                                .map(|j| (1.0 - z[j]) * cand[j] + z[j] * hv[j])
                                .collect()
                        }
                        Cell::Lstm => {
                            let (ga, ha) = (&acts[d * k_acts + 1], &acts[d * k_acts + 2]);
                            let pp =
                                |k: usize, j: usize| p.map_or(0.0, |p| p[d * 3 * h + k * h + j]);
                            let mut hn = vec![0.0; h];
                            for j in 0..h {
                                let i_g = f(clip(gx[j] + gh[j] + pp(0, j) * cv[j]));
                                let f_g = if self.input_forget {
                                    1.0 - i_g
                                } else {
                                    f(clip(gx[2 * h + j] + gh[2 * h + j] + pp(2, j) * cv[j]))
                                };
                                let c_g = ga(clip(gx[3 * h + j] + gh[3 * h + j]));
                                let c = f_g * cv[j] + i_g * c_g;
                                let o_g = f(clip(gx[h + j] + gh[h + j] + pp(1, j) * c));
                                hn[j] = o_g * ha(c);
                                cv[j] = c;
                            }
                            hn
                        }
                    };
                    hv = hn;
                    for j in 0..h {
                        y[yat(t, d, b, j)] = hv[j];
                    }
                }
                for j in 0..h {
                    yh[(d * bn + b) * h + j] = hv[j];
                    yc[(d * bn + b) * h + j] = cv[j];
                }
            }
        }
        // Y_h and Y_c are [D, B, H], [B, D, H] with layout 1.
        let state = |v: Vec<f64>| -> (Vec<usize>, Vec<f64>) {
            match self.layout {
                0 => (vec![nd, bn, h], v),
                _ => {
                    let mut o = vec![0.0; v.len()];
                    for d in 0..nd {
                        for b in 0..bn {
                            for j in 0..h {
                                o[(b * nd + d) * h + j] = v[(d * bn + b) * h + j];
                            }
                        }
                    }
                    (vec![bn, nd, h], o)
                }
            }
        };
        let y_shape = match self.layout {
            0 => vec![s, nd, bn, h],
            _ => vec![bn, s, nd, h],
        };
        let mut out = vec![(y_shape, y), state(yh)];
        if self.cell == Cell::Lstm {
            out.push(state(yc));
        }
        out
    }
}

fn settings() -> Vec<Rec> {
    let mut out = vec![];
    for cell in [Cell::Rnn, Cell::Gru, Cell::Lstm] {
        for direction in ["forward", "reverse", "bidirectional"] {
            out.push(rec(cell, direction));
            // Batch-major, no bias, no initial state, ragged lengths.
            out.push(Rec {
                layout: 1,
                bias: false,
                initial: false,
                lens: Some(vec![4, 1, 3]),
                ..rec(cell, direction)
            });
            out.push(Rec {
                lens: Some(vec![2, 4, 3]),
                clip: Some(0.8),
                ..rec(cell, direction)
            });
        }
        let acts: (Vec<&str>, Vec<f32>, Vec<f32>) = match cell {
            Cell::Rnn => (vec!["Relu", "LeakyRelu"], vec![0.3], vec![]),
            Cell::Gru => (
                vec!["HardSigmoid", "Elu", "Affine", "ScaledTanh"],
                vec![0.3, 0.7, 0.9, 1.1],
                vec![0.4, 0.2, 0.8],
            ),
            Cell::Lstm => (
                vec![
                    "HardSigmoid",
                    "Softsign",
                    "Softplus",
                    "Sigmoid",
                    "Tanh",
                    "ThresholdedRelu",
                ],
                vec![0.25, 0.1],
                vec![0.45],
            ),
        };
        out.push(Rec {
            acts: Some(acts),
            ..rec(cell, "bidirectional")
        });
    }
    out.push(Rec {
        linear_before_reset: true,
        ..rec(Cell::Gru, "forward")
    });
    out.push(Rec {
        linear_before_reset: true,
        lens: Some(vec![3, 4, 1]),
        ..rec(Cell::Gru, "bidirectional")
    });
    out.push(Rec {
        peepholes: true,
        ..rec(Cell::Lstm, "forward")
    });
    out.push(Rec {
        peepholes: true,
        clip: Some(0.6),
        lens: Some(vec![4, 2, 3]),
        ..rec(Cell::Lstm, "bidirectional")
    });
    out.push(Rec {
        input_forget: true,
        ..rec(Cell::Lstm, "reverse")
    });
    // One step, and lengths all at the full sequence (no masks written).
    out.push(Rec {
        dims: [1, 2, 3, 5],
        ..rec(Cell::Lstm, "bidirectional")
    });
    out.push(Rec {
        lens: Some(vec![4, 4, 4]),
        ..rec(Cell::Gru, "reverse")
    });
    out
}

#[test]
fn recurrences_on_every_backend() {
    for (k, r) in settings().into_iter().enumerate() {
        let case = r.case(700 + 10 * k as u64);
        check_case(&r.what(), &case, &BOTH, 1e-5, |v| r.reference(v));
    }
}

#[test]
fn recurrences_have_gradients() {
    let picks = [
        rec(Cell::Rnn, "bidirectional"),
        Rec {
            lens: Some(vec![3, 1, 2]),
            ..rec(Cell::Gru, "reverse")
        },
        Rec {
            linear_before_reset: true,
            layout: 1,
            ..rec(Cell::Gru, "forward")
        },
        Rec {
            peepholes: true,
            lens: Some(vec![2, 3, 1]),
            ..rec(Cell::Lstm, "bidirectional")
        },
    ];
    for (k, r) in picks.into_iter().enumerate() {
        let r = Rec {
            dims: [3, 3, 2, 3],
            ..r
        };
        // Y alone differentiated (the state outputs are Y's last steps).
        let mut case = r.case(900 + 10 * k as u64);
        case.outputs.truncate(1);
        // X, W, R, B, initial h (and c, P): every floating input.
        let wrt: Vec<usize> = case
            .inputs
            .iter()
            .enumerate()
            .filter(|(_, (n, t))| !n.is_empty() && t.as_ref().is_some_and(|t| t.dtype().is_float()))
            .map(|(i, _)| i)
            .collect();
        check_grads(&r.what(), &case, &wrt, k as u64, |v| r.reference(v));
    }
}

/// A sequence length only the fed shapes decide: refused by name without them, unrolled
/// for them when they are given at import, and the importer's bound sizes are the
/// model's dims from then on.
#[test]
fn sequence_length_from_the_fed_shapes() {
    let r = rec(Cell::Lstm, "forward");
    let [s, b, i, h] = r.dims;
    let case = r.case(31);
    let args = case.args(DType::F32);
    let n = node(
        "LSTM",
        "",
        &["x", "w", "r", "b", "", "h0", "c0"],
        &["y", "y_h", "y_c"],
        case.attrs.clone(),
    );
    let mut infos = vec![input("x", DType::F32, &[None, None, Some(i)])];
    for (name, t) in case.inputs.iter().zip(&args).skip(1) {
        if let (n, Some(t)) = (name.0, t) {
            infos.push(input_like(n, t));
        }
    }
    let bytes = model_bytes(vec![n], 14, infos, vec![], &["y", "y_h", "y_c"]);
    let e = graphrun::onnx::from_bytes(&bytes, "m", std::path::Path::new("."))
        .expect_err("a symbolic sequence length")
        .to_string();
    assert!(
        e.contains("LSTM_node")
            && e.contains("sequence length")
            && e.contains("'x'")
            && e.contains("--input"),
        "{e}"
    );
    let opts = graphrun::onnx::ImportOptions {
        input_shapes: [("x".to_string(), vec![s, b, i])].into(),
        ..Default::default()
    };
    let g = graphrun::onnx::from_bytes_with(&bytes, "m", std::path::Path::new("."), &opts).unwrap();
    assert_eq!(
        g.dims.get("x_d0"),
        Some(&s),
        "the bound sizes stay the dims' defaults"
    );
    let vals: Vec<Vec<f64>> = args
        .iter()
        .map(|t| t.as_ref().map(Tensor::to_f64_vec).unwrap_or_default())
        .collect();
    let want = r.reference(&vals);
    let mut sess = Session::new(g, SessionOptions::default()).unwrap();
    let got = sess.run(&case.feeds(&args)).unwrap();
    for ((name, t), (shape, w)) in got.iter().zip(&want) {
        assert_eq!(t.shape(), &shape[..], "{name}");
        assert!(rel_err(&t.to_f64_vec(), w) < 1e-5, "{name}");
    }
    // Sized by symbol instead (`--dim`), another length.
    let opts = graphrun::onnx::ImportOptions {
        dims: [("x_d0".to_string(), 2)].into(),
        ..Default::default()
    };
    let g = graphrun::onnx::from_bytes_with(&bytes, "m", std::path::Path::new("."), &opts).unwrap();
    let x = randn(&[2, b, i], 3).cast(DType::F32);
    let h0 = randn(&[1, b, h], 4).cast(DType::F32);
    let mut feeds = case.feeds(&args);
    feeds.insert("x".into(), x);
    feeds.insert("h0".into(), h0.clone());
    feeds.insert("c0".into(), h0);
    let got = Session::new(g, SessionOptions::default())
        .unwrap()
        .run(&feeds)
        .unwrap();
    assert_eq!(got[0].1.shape(), &[2, 1, b, h]);
}

/// Each batch entry's first `len` steps reversed along the time axis.
fn reverse_ref(x: &[f64], shape: &[usize], lens: &[i64], ba: usize) -> Expected {
    let inner: usize = shape[2..].iter().product();
    let mut y = vec![0.0; x.len()];
    for a0 in 0..shape[0] {
        for a1 in 0..shape[1] {
            let (b, t) = if ba == 0 { (a0, a1) } else { (a1, a0) };
            let len = lens[b] as usize;
            let src_t = if t < len { len - 1 - t } else { t };
            let (s0, s1) = if ba == 0 { (b, src_t) } else { (src_t, b) };
            for k in 0..inner {
                y[(a0 * shape[1] + a1) * inner + k] = x[(s0 * shape[1] + s1) * inner + k];
            }
        }
    }
    vec![(shape.to_vec(), y)]
}

#[test]
fn reverse_sequence_on_every_backend_with_gradients() {
    for (k, (shape, ba, lens)) in [
        (vec![4usize, 3, 2], 1usize, vec![4i64, 1, 3]),
        (vec![3, 5], 0, vec![5, 0, 2]),
        (vec![2, 4, 2, 3], 0, vec![3, 4]),
    ]
    .into_iter()
    .enumerate()
    {
        let ta = 1 - ba;
        let nb = shape[ba];
        let case = Case::new(
            "ReverseSequence",
            10,
            vec![
                ("x", Some(randn(&shape, 50 + k as u64))),
                ("lens", Some(Tensor::from_vec(&[nb], lens.clone()).unwrap())),
            ],
        )
        .with(vec![
            int_attr("batch_axis", ba as i64),
            int_attr("time_axis", ta as i64),
        ]);
        let what = format!("ReverseSequence {shape:?} batch_axis {ba} lens {lens:?}");
        let reference = |v: &[Vec<f64>]| reverse_ref(&v[0], &shape, &lens, ba);
        check_case(&what, &case, &BOTH, 0.0, reference);
        check_grads(&what, &case, &[0], k as u64, reference);
    }
}

/// Attributes and inputs the ONNX definitions rule out are refused, naming the node.
#[test]
fn bad_recurrences_are_refused_by_name() {
    let r = rec(Cell::Gru, "forward");
    let base = r.case(5);
    let bad: Vec<(Vec<AttributeProto>, &str)> = vec![
        (vec![str_attr("direction", "sideways")], "direction"),
        (vec![int_attr("layout", 2)], "layout"),
        (vec![strs_attr("activations", &["Sigmoid", "Cube"])], "Cube"),
        (
            vec![strs_attr("activations", &["Sigmoid", "Tanh", "Tanh"])],
            "activations",
        ),
        (vec![int_attr("hidden_size", 7)], "hidden_size"),
    ];
    // A length no one unrolls (a hostile file's declared shape).
    let n = node(
        "GRU",
        "",
        &["x", "w", "r"],
        &["y"],
        vec![int_attr("hidden_size", 4)],
    );
    let infos = vec![
        input("x", DType::F32, &[Some(1 << 40), Some(1), Some(5)]),
        input("w", DType::F32, &[Some(1), Some(12), Some(5)]),
        input("r", DType::F32, &[Some(1), Some(12), Some(4)]),
    ];
    let e = import_one_node(n, 14, infos, vec![])
        .expect_err("too long")
        .to_string();
    assert!(e.contains("GRU_node") && e.contains("time steps"), "{e}");
    for (attrs, needle) in bad {
        let mut case = base.clone();
        case.attrs
            .retain(|a| !attrs.iter().any(|b| b.name == a.name));
        case.attrs.extend(attrs);
        let infos = case
            .inputs
            .iter()
            .zip(case.args(DType::F32))
            .filter_map(|((n, _), t)| t.map(|t| input_like(n, &t)))
            .collect();
        let names: Vec<&str> = case.inputs.iter().map(|(n, _)| *n).collect();
        let n = node("GRU", "", &names, &case.outputs, case.attrs.clone());
        let e = import_one_node(n, 14, infos, vec![])
            .expect_err(needle)
            .to_string();
        assert!(
            e.contains("GRU_node") && e.contains(needle),
            "{needle}: {e}"
        );
    }
}
