//! Random well-typed graphs, for property tests (tests/passes_random.rs) and the
//! `random_graphs` fuzz target: a byte stream (random or from the fuzzer) decides each
//! node — its op among the SPEC §2 families, its inputs among the values made so far —
//! and every node is shape-checked as it is added, so the result always validates.
//! The shapes follow the patterns the passes look for (MatMul + bias + activation,
//! residual adds, Transpose pairs, Identity chains, repeated subexpressions), so that
//! rewrites actually fire.

use crate::graph::infer::{infer_node, ValueType};
use crate::graph::op::{Attr, AttrValue};
use crate::graph::{Dim, Graph, InitSource, Initializer, InputInfo, Node, Op};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashMap};

/// Reads decisions from bytes; when they run out, from a generator seeded by them.
struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
    rng: Rng,
}

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.data.get(self.at) {
            Some(&b) => {
                self.at += 1;
                b
            }
            None => self.rng.next_u64() as u8,
        }
    }
    /// A choice in 0..n.
    fn pick(&mut self, n: usize) -> usize {
        self.byte() as usize % n.max(1)
    }
}

fn op(name: &str, attrs: &[(&str, AttrValue)]) -> Op {
    let attrs: Vec<Attr> = attrs
        .iter()
        .map(|(k, v)| Attr {
            name: k.to_string(),
            value: v.clone(),
            loc: None,
        })
        .collect();
    Op::parse(name, &attrs, "random", None).expect("valid op")
}

/// A random graph of at most `max_nodes` nodes on f64 values, with its input feeds.
/// Every graph input is `[B, F]` with B = 3 and F in {4, 6}.
pub fn random_graph(data: &[u8], max_nodes: usize) -> (Graph, HashMap<String, Tensor>) {
    let seed = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut b = Bytes {
        data,
        at: 0,
        rng: Rng::new(seed),
    };
    let mut rng = Rng::new(seed ^ 0x5555);
    let mut g = Graph {
        name: "random".into(),
        dims: BTreeMap::new(),
        inputs: vec![],
        outputs: vec![],
        initializers: vec![],
        nodes: vec![],
        training: None,
        updates: vec![],
        file: None,
    };
    let mut feeds = HashMap::new();
    let mut vals: Vec<(String, ValueType)> = vec![];
    let mut consts: HashMap<String, Tensor> = HashMap::new();
    let dt = DType::F64;
    for k in 0..2 {
        let f = [4, 6][b.pick(2)];
        let name = format!("x{k}");
        g.inputs.push(InputInfo {
            default: None,
            name: name.clone(),
            dtype: dt,
            shape: vec![Dim::Fixed(3), Dim::Fixed(f)],
            range: None,
            loc: None,
        });
        let v: Vec<f64> = (0..3 * f).map(|_| rng.uniform_in(-1.0, 1.0)).collect();
        feeds.insert(name.clone(), Tensor::from_vec(&[3, f], v).expect("sized"));
        vals.push((name, ValueType::new(dt, &[3, f])));
    }
    // Initializers are known on the host: they go into `consts` as well.
    let add_init = |g: &mut Graph,
                    consts: &mut HashMap<String, Tensor>,
                    name: String,
                    t: Tensor,
                    trainable: bool| {
        consts.insert(name.clone(), t.clone());
        g.initializers.push(Initializer {
            name: name.clone(),
            tensor: t,
            trainable,
            source: InitSource::Data,
            loc: None,
        });
        name
    };
    let init = |g: &mut Graph,
                consts: &mut HashMap<String, Tensor>,
                shape: &[usize],
                rng: &mut Rng,
                trainable: bool|
     -> String {
        let name = format!("w{}", g.initializers.len());
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| rng.uniform_in(-1.0, 1.0)).collect();
        add_init(
            g,
            consts,
            name,
            Tensor::from_vec(shape, v).expect("sized"),
            trainable,
        )
    };
    let scalar = |v: f64| AttrValue::Float(v);
    for step in 0..max_nodes {
        // Mostly extend the newest value, so that chains (MatMul → Add → activation →
        // residual Add) form as they do in models.
        let xi = if b.pick(8) < 5 {
            vals.len() - 1
        } else {
            b.pick(vals.len())
        };
        let (x, xt) = vals[xi].clone();
        let (y, yt) = vals[b.pick(vals.len())].clone();
        let r = xt.shape.len();
        let last = *xt.shape.last().unwrap_or(&1);
        let (o, ins): (Op, Vec<String>) = match b.pick(19) {
            0 => {
                let u = [
                    "Relu", "Tanh", "Sigmoid", "Neg", "Exp", "Abs", "Erf", "Identity",
                ];
                (op(u[b.pick(u.len())], &[]), vec![x])
            }
            1 => {
                let a = ["Add", "Sub", "Mul"];
                (op(a[b.pick(a.len())], &[]), vec![x, y])
            }
            2 if r >= 1 => {
                // MatMul by a weight, the start of an epilogue chain.
                let n = [4, 6, 8][b.pick(3)];
                let w = init(&mut g, &mut consts, &[last, n], &mut rng, true);
                (op("MatMul", &[]), vec![x, w])
            }
            3 if r >= 1 => {
                let bias = init(&mut g, &mut consts, &[last], &mut rng, true);
                (op("Add", &[]), vec![x, bias])
            }
            4 => {
                let a = ["none", "tanh"][b.pick(2)];
                (
                    op("Gelu", &[("approximate", AttrValue::Str(a.into()))]),
                    vec![x],
                )
            }
            5 if r >= 1 => (op("Softmax", &[("axis", AttrValue::Int(-1))]), vec![x]),
            6 if r >= 1 => {
                let s = init(&mut g, &mut consts, &[last], &mut rng, true);
                let bias = init(&mut g, &mut consts, &[last], &mut rng, true);
                (
                    op("LayerNormalization", &[("axis", AttrValue::Int(-1))]),
                    vec![x, s, bias],
                )
            }
            7 if r == 2 => (
                op("Transpose", &[("perm", AttrValue::Ints(vec![1, 0]))]),
                vec![x],
            ),
            8 => {
                let k = ["ReduceSum", "ReduceMean", "ReduceMax"];
                (
                    op(
                        k[b.pick(3)],
                        &[
                            ("axes", AttrValue::Ints(vec![-1])),
                            ("keepdims", AttrValue::Int(1)),
                        ],
                    ),
                    vec![x],
                )
            }
            9 => {
                // x * sigmoid(x): SiLU as exporters write it.
                let s = format!("s{step}");
                g.nodes.push(Node {
                    name: format!("n{step}_sig"),
                    op: op("Sigmoid", &[]),
                    inputs: vec![x.clone()],
                    outputs: vec![s.clone()],
                    loc: None,
                });
                vals.push((s.clone(), xt.clone()));
                (op("Mul", &[]), vec![x, s])
            }
            10 => {
                let c = init(&mut g, &mut consts, &[], &mut rng, false);
                (op("Mul", &[]), vec![x, c])
            }
            11 if r >= 1 => {
                let shape = Tensor::from_vec(&[2], vec![-1i64, last as i64]).expect("sized");
                let name = add_init(&mut g, &mut consts, format!("shape{step}"), shape, false);
                (op("Reshape", &[]), vec![x, name])
            }
            12 => (
                op("Clip", &[]),
                vec![x, init(&mut g, &mut consts, &[], &mut rng, false)],
            ),
            13 => (op("LeakyRelu", &[("alpha", scalar(0.1))]), vec![x]),
            14 if r >= 1 && xt.shape == yt.shape => {
                (op("Concat", &[("axis", AttrValue::Int(-1))]), vec![x, y])
            }
            15 if r == 2 => {
                // Gemm with every attribute: transA, alpha, beta, transB; C none, a bias
                // or a full [M, N]; weights trainable or constant.
                let (ta, tb) = (b.pick(2) == 1, b.pick(2) == 1);
                let (m, k) = if ta {
                    (xt.shape[1], xt.shape[0])
                } else {
                    (xt.shape[0], xt.shape[1])
                };
                let n = [4, 6][b.pick(2)];
                let trainable = b.pick(2) == 0;
                let w_shape = if tb { [n, k] } else { [k, n] };
                let w = init(&mut g, &mut consts, &w_shape, &mut rng, trainable);
                let mut ins = vec![x, w];
                match b.pick(3) {
                    0 => {}
                    1 => ins.push(init(&mut g, &mut consts, &[n], &mut rng, trainable)),
                    _ => ins.push(init(&mut g, &mut consts, &[m, n], &mut rng, trainable)),
                }
                let alpha = [1.0, 0.5, -2.0][b.pick(3)];
                let beta = [1.0, 0.25][b.pick(2)];
                let attrs = [
                    ("transA", AttrValue::Int(ta as i64)),
                    ("transB", AttrValue::Int(tb as i64)),
                    ("alpha", scalar(alpha)),
                    ("beta", scalar(beta)),
                ];
                (op("Gemm", &attrs), ins)
            }
            16 if r == 2 => {
                // A 1-D sliding window, as the importer writes Conv and the pools:
                // [B, F] → [B, 1, F] → Im2Col → [B, k, L]; the next nodes make it a
                // convolution (MatMul), a pool (a Reduce) or sum it back (Col2Im).
                let shape = Tensor::from_vec(&[3], vec![0i64, 1, -1]).expect("sized");
                let shape = add_init(&mut g, &mut consts, format!("img{step}"), shape, false);
                let img = format!("i{step}");
                let img_node = Node {
                    name: format!("n{step}_img"),
                    op: op("Reshape", &[]),
                    inputs: vec![x.clone(), shape],
                    outputs: vec![img.clone()],
                    loc: None,
                };
                let (k, stride, dil) = (1 + b.pick(3), 1 + b.pick(2), 1 + b.pick(2));
                let pads = vec![b.pick(2) as i64, b.pick(2) as i64];
                let win = [
                    ("kernel_shape", AttrValue::Ints(vec![k as i64])),
                    ("strides", AttrValue::Ints(vec![stride as i64])),
                    ("dilations", AttrValue::Ints(vec![dil as i64])),
                    ("pads", AttrValue::Ints(pads.clone())),
                ];
                if b.pick(3) == 0 {
                    // Col2Im of the window's own columns back into the image.
                    let cols = format!("c{step}");
                    let im2col = Node {
                        name: format!("n{step}_cols"),
                        op: op("Im2Col", &win),
                        inputs: vec![img.clone()],
                        outputs: vec![cols.clone()],
                        loc: None,
                    };
                    let image = Tensor::from_vec(&[1], vec![last as i64]).expect("sized");
                    let image = add_init(&mut g, &mut consts, format!("image{step}"), image, false);
                    let block = [
                        ("block", AttrValue::Ints(vec![k as i64])),
                        ("strides", AttrValue::Ints(vec![stride as i64])),
                        ("dilations", AttrValue::Ints(vec![dil as i64])),
                        ("pads", AttrValue::Ints(pads)),
                    ];
                    let img_t = ValueType::new(dt, &[xt.shape[0], 1, last]);
                    let ev = &crate::backends::cpu::HOST_EVAL;
                    match infer_node(&im2col, &[Some(&img_t)], &[None], ev) {
                        Ok(mut t) => {
                            g.nodes.push(img_node);
                            g.nodes.push(im2col);
                            vals.push((img, img_t));
                            vals.push((cols.clone(), t.remove(0)));
                            (op("Col2Im", &block), vec![cols, image])
                        }
                        Err(_) => (op("Identity", &[]), vec![x]),
                    }
                } else if b.pick(2) == 0 {
                    // Conv, with a bias or not: [B, 1, F] → [B, M, L].
                    let (m, trainable) = (1 + b.pick(3), b.pick(2) == 0);
                    let mut ins = vec![img.clone()];
                    ins.push(init(&mut g, &mut consts, &[m, 1, k], &mut rng, trainable));
                    if b.pick(2) == 0 {
                        ins.push(init(&mut g, &mut consts, &[m], &mut rng, trainable));
                    }
                    let conv = op("Conv", &win);
                    let img_t = ValueType::new(dt, &[xt.shape[0], 1, last]);
                    let types: Vec<Option<ValueType>> = ins
                        .iter()
                        .map(|v| match v == &img {
                            true => Some(img_t.clone()),
                            false => consts.get(v).map(|t| ValueType::new(t.dtype(), t.shape())),
                        })
                        .collect();
                    let refs: Vec<Option<&ValueType>> = types.iter().map(Option::as_ref).collect();
                    let probe = Node {
                        name: String::new(),
                        op: conv.clone(),
                        inputs: ins.clone(),
                        outputs: vec![String::new()],
                        loc: None,
                    };
                    let ev = &crate::backends::cpu::HOST_EVAL;
                    match infer_node(&probe, &refs, &vec![None; refs.len()], ev) {
                        Ok(_) => {
                            g.nodes.push(img_node);
                            vals.push((img, img_t));
                            (conv, ins)
                        }
                        Err(_) => (op("Identity", &[]), vec![x]),
                    }
                } else {
                    g.nodes.push(img_node);
                    vals.push((img.clone(), ValueType::new(dt, &[xt.shape[0], 1, last])));
                    (op("Im2Col", &win), vec![img])
                }
            }
            17 if r == 3 => {
                // A pool over the window axis of columns, back to rank 2.
                let k = ["ReduceMax", "ReduceMean", "ReduceSum"];
                let attrs = [
                    ("axes", AttrValue::Ints(vec![1])),
                    ("keepdims", AttrValue::Int(0)),
                ];
                (op(k[b.pick(3)], &attrs), vec![x])
            }
            _ => (op("Identity", &[]), vec![x]),
        };
        let name = format!("n{step}");
        let out = format!("v{step}");
        let node = Node {
            name,
            op: o,
            inputs: ins,
            outputs: vec![out.clone()],
            loc: None,
        };
        let types: HashMap<&str, ValueType> = vals
            .iter()
            .map(|(n, t)| (n.as_str(), t.clone()))
            .chain(
                consts
                    .iter()
                    .map(|(n, t)| (n.as_str(), ValueType::new(t.dtype(), t.shape()))),
            )
            .collect();
        let tys: Vec<Option<&ValueType>> =
            node.inputs.iter().map(|i| types.get(i.as_str())).collect();
        let cs: Vec<Option<&Tensor>> = node.inputs.iter().map(|i| consts.get(i)).collect();
        // Inputs that do not fit (shapes that do not broadcast, say) skip the node.
        let Ok(mut t) = infer_node(&node, &tys, &cs, &crate::backends::cpu::HOST_EVAL) else {
            continue;
        };
        if t[0].numel() > 4096 {
            continue;
        }
        vals.push((out, t.remove(0)));
        g.nodes.push(node);
    }
    // Outputs: every value no node reads (so nothing is dead), and sometimes one more
    // that is also read inside (a value needed twice must not be fused away).
    let read: std::collections::HashSet<&str> = g
        .nodes
        .iter()
        .flat_map(|n| n.inputs.iter().map(|s| s.as_str()))
        .collect();
    let sinks: Vec<String> = vals
        .iter()
        .skip(2)
        .filter(|(v, _)| !read.contains(v.as_str()))
        .map(|(v, _)| v.clone())
        .collect();
    g.outputs = sinks;
    if vals.len() > 3 && b.pick(2) == 0 {
        let (o, _) = vals[2 + b.pick(vals.len() - 2)].clone();
        if !g.outputs.contains(&o) {
            g.outputs.push(o);
        }
    }
    if g.outputs.is_empty() {
        g.outputs.push(vals.last().expect("inputs exist").0.clone());
    }
    (g, feeds)
}

/// (‖a − b‖, ‖b‖) in f64: the parts of a relative L2 difference; each caller decides what
/// a zero, infinite or NaN reference means for it.
pub fn l2_diff_and_norm(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    let num = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q) * (p - q))
        .sum::<f64>();
    let den = y.iter().map(|q| q * q).sum::<f64>();
    (num.sqrt(), den.sqrt())
}
