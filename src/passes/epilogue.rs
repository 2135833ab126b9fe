//! MatMul-epilogue fusion: `MatMul|Gemm → Add(bias) → activation → Add(residual)` becomes
//! one `FusedMatMul` computing `act(A @ B + bias) + residual`. Each stage is optional
//! (at least one must be there) and is taken only when the value it swallows is read by
//! nothing else; otherwise the fusion stops before it. Activations are single ops or the
//! expansions exporters write for GELU (tanh and erf forms) and SiLU.

use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::{Activation, BinaryOp, InitSource, Initializer, Node, Op, ReduceKind, UnaryOp};
use crate::tensor::Tensor;

pub(crate) const RULES: &[Rule] = &[
    Rule {
        name: "unpack_gate_up",
        anchor: |op| matches!(op, Op::MatMul | Op::FusedMatMul { .. }),
        run: super::gated::unpack_gate_up,
    },
    Rule {
        name: "matmul_epilogue",
        anchor: |op| matches!(op, Op::MatMul | Op::Gemm { .. }),
        run: fuse,
    },
    Rule {
        name: "gated_matmul",
        anchor: |op| *op == Op::Binary(BinaryOp::Mul),
        run: super::gated::gated_matmul,
    },
    Rule {
        name: "dact_into_da",
        anchor: |op| matches!(op, Op::FusedMatMulGrad { .. }),
        run: dact_into_da,
    },
    Rule {
        name: "ln_grad_residual",
        anchor: |op| *op == Op::Binary(BinaryOp::Add),
        run: ln_grad_residual,
    },
    Rule {
        name: "mean_square",
        anchor: |op| {
            matches!(
                op,
                Op::Reduce {
                    kind: ReduceKind::Mean,
                    ..
                }
            )
        },
        run: mean_square,
    },
];

/// `Add(dX, r)` where dX is a LayerNormalizationGrad's (or RMSNormalizationGrad's) first
/// output read by nothing else and r has dX's type (a pre-norm block's residual gradient,
/// gpt_block's `ln2/Add`): the gradient node adds r as it writes dX (its last input), one
/// pass fewer.
fn ln_grad_residual(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let found = n.inputs.iter().enumerate().find_map(|(k, v)| {
        let (j, ln) = cx.prod(v, |op| matches!(op, Op::LayerNormalizationGrad { .. }))?;
        let Op::LayerNormalizationGrad { rms, .. } = ln.op else {
            return None;
        };
        let (_, _, res) = crate::graph::op::norm_grad_inputs(rms);
        (ln.outputs[0] == *v && ln.inputs.len() == res).then_some((k, j, ln))
    });
    let Some((k, j, ln)) = found else {
        return why.no("no LayerNormalizationGrad's dX");
    };
    let (dx, r) = (&n.inputs[k], &n.inputs[1 - k]);
    if dx == r || cx.sole_consumer(dx) != Some(i) {
        return why.no("dX is read elsewhere");
    }
    if !cx.facts.same_shape(dx, r) || cx.facts.dtype(dx) != cx.facts.dtype(r) {
        return why.no("the other term is broadcast or of another dtype");
    }
    let mut fused = ln.clone();
    fused.inputs.push(r.clone());
    fused.outputs[0] = n.outputs[0].clone();
    Some(Patch {
        remove: vec![j, i],
        add: vec![fused],
        ..Default::default()
    })
}

/// An MSE's `ReduceMean(Mul(d, d))` becomes `ReduceMeanSquare(d)`: the squares are never
/// written, and its gradient is one pass `d · (2/N)·dY`.
fn mean_square(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::Reduce {
        axes,
        keepdims,
        noop_with_empty_axes,
        ..
    } = &n.op
    else {
        return None;
    };
    if *noop_with_empty_axes {
        // An identity when no axes are given: not a mean at all.
        return why.no("noop_with_empty_axes");
    }
    let Some((j, m)) = cx.prod(&n.inputs[0], is_bin(BinaryOp::Mul)) else {
        return why.no("the mean is not of a product");
    };
    if m.inputs[0] != m.inputs[1] {
        return why.no("not a square");
    }
    if cx.sole_consumer(&m.outputs[0]) != Some(i) {
        return why.no("the squares are read elsewhere");
    }
    if !cx.facts.dtype(&m.inputs[0]).is_some_and(|d| d.is_float()) {
        return why.no("not floating");
    }
    let mut r = n.clone();
    r.op = Op::Reduce {
        kind: ReduceKind::MeanSquare,
        axes: axes.clone(),
        keepdims: *keepdims,
        noop_with_empty_axes: false,
    };
    r.inputs[0] = m.inputs[0].clone();
    Some(Patch {
        remove: vec![j, i],
        add: vec![r],
        ..Default::default()
    })
}

/// In a backward graph, `FusedMatMulGrad(act)` whose dY is only the dA of another
/// FusedMatMulGrad (an MLP's fc1 behind fc2) takes its G = dY·act'(Pre) from that node:
/// the producer applies act' to its dA product (cuBLASLt's DGELU epilogue on CUDA, no
/// pass of its own), and the consumer runs with no activation (dY is G; its Pre input is
/// dropped). Saves writing dY and reading it and Pre back: 3 passes over [M, hidden].
/// The consumer's bias gradient Σ_rows G moves along as the producer's dBiasA (output
/// 3), summed where G is made (cuBLASLt's DGELU_BGRAD epilogue could do it in the
/// product; on the H100 it is slower than the pass it saves, see cuda/matmul.rs
/// `dgelu_bgrad`), not by a BGRADA reduction in the consumer's dB product.
fn dact_into_da(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::FusedMatMulGrad {
        activation,
        trans_b,
        a_activation,
    } = n.op
    else {
        return None;
    };
    if activation == Activation::None {
        return why.no("no activation to differentiate");
    }
    let (dy, pre) = (&n.inputs[0], n.inputs.get(3).filter(|p| !p.is_empty())?);
    let Some((j, p)) = cx.prod(dy, |op| {
        matches!(
            op,
            Op::FusedMatMulGrad {
                a_activation: Activation::None,
                ..
            }
        )
    }) else {
        return why.no("dY is not the dA of a FusedMatMulGrad");
    };
    if p.outputs[0] != *dy || cx.sole_consumer(dy) != Some(i) {
        return why.no("dY is read elsewhere");
    }
    if !cx.facts.same_shape(dy, pre) || cx.facts.dtype(dy) != cx.facts.dtype(pre) {
        return why.no("dY and Pre differ in shape or dtype");
    }
    let mut producer = p.clone();
    let Op::FusedMatMulGrad {
        activation: pa,
        trans_b: pt,
        ..
    } = p.op
    else {
        unreachable!("matched above")
    };
    producer.op = Op::FusedMatMulGrad {
        activation: pa,
        trans_b: pt,
        a_activation: activation,
    };
    producer.inputs.resize(4, String::new());
    producer.inputs.push(pre.clone());
    let mut consumer = n.clone();
    let free = producer.outputs.get(3).is_none_or(|o| o.is_empty());
    if let Some(dbias) = consumer.outputs.get(2).filter(|o| free && !o.is_empty()) {
        producer.outputs.resize(4, String::new());
        producer.outputs[3] = dbias.clone();
        // (A dBiasA of the consumer's own, from a firing further down, stays at 3.)
        consumer.outputs[2] = String::new();
        while consumer.outputs.len() > 2 && consumer.outputs.last().is_some_and(|o| o.is_empty()) {
            consumer.outputs.pop();
        }
    }
    consumer.op = Op::FusedMatMulGrad {
        activation: Activation::None,
        trans_b,
        a_activation,
    };
    // Pre is no longer read; a PreA of its own stays at input 4.
    consumer.inputs[3] = String::new();
    if consumer.inputs.len() == 4 {
        consumer.inputs.truncate(3);
    }
    Some(Patch {
        remove: vec![j, i],
        add: vec![producer, consumer],
        ..Default::default()
    })
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_CUBIC: f64 = 0.044715;

fn is_bin(b: BinaryOp) -> impl Fn(&Op) -> bool {
    move |op| *op == Op::Binary(b)
}
fn is_un(u: UnaryOp) -> impl Fn(&Op) -> bool {
    move |op| *op == Op::Unary(u)
}

/// The fused node being built; `out` is the value it will produce. A Gemm may need
/// nodes in front (`pre`: a Transpose of A, a Mul by alpha or beta) and new constants
/// (`inits`: A, B or C with transA, alpha or beta folded in).
#[derive(Clone)]
struct Fused<'g> {
    a: String,
    b: String,
    trans_b: bool,
    bias: Option<String>,
    act: Activation,
    residual: Option<String>,
    out: &'g str,
    nodes: Vec<usize>,
    pre: Vec<Node>,
    inits: Vec<Initializer>,
    /// A Reshape the chain went through (see `through_reshape`): the fused node writes
    /// `flat`, and this Reshape node (its own name, op and shape input) writes `out`.
    reshape: Option<(Node, String)>,
}

impl Fused<'_> {
    fn node(&self, anchor: &Node) -> Node {
        let mut inputs = vec![self.a.clone(), self.b.clone()];
        if self.bias.is_some() || self.residual.is_some() {
            inputs.push(self.bias.clone().unwrap_or_default());
        }
        inputs.extend(self.residual.clone());
        Node {
            name: anchor.name.clone(),
            op: Op::FusedMatMul {
                activation: self.act,
                trans_b: self.trans_b,
            },
            inputs,
            outputs: vec![self
                .reshape
                .as_ref()
                .map_or(self.out, |(_, flat)| flat.as_str())
                .to_string()],
            loc: anchor.loc.clone(),
        }
    }
    /// The nodes that replace the matched ones: `pre`, the FusedMatMul, and the Reshape
    /// it was fused through.
    fn all(&self, anchor: &Node) -> Vec<Node> {
        let mut v = self.pre.clone();
        v.push(self.node(anchor));
        if let Some((r, flat)) = &self.reshape {
            let mut r = r.clone();
            r.inputs[0] = flat.clone();
            r.outputs = vec![self.out.to_string()];
            v.push(r);
        }
        v
    }
    /// A new constant, named after the anchor; returns its name.
    fn init(&mut self, cx: &Ctx, anchor: &Node, what: &str, t: Tensor) -> String {
        let name = cx.fresh_value(&format!("{}_{what}", anchor.name));
        self.inits.push(Initializer {
            name: name.clone(),
            tensor: t,
            trainable: false,
            source: InitSource::Data,
            loc: anchor.loc.clone(),
        });
        name
    }
    /// A node in front of the FusedMatMul; returns its output.
    fn pre(&mut self, cx: &Ctx, anchor: &Node, what: &str, op: Op, inputs: Vec<String>) -> String {
        let out = cx.fresh_value(&format!("{}_{what}", anchor.name));
        self.pre.push(Node {
            name: cx.fresh_node(&format!("{}_{what}", anchor.name)),
            op,
            inputs,
            outputs: vec![out.clone()],
            loc: anchor.loc.clone(),
        });
        out
    }
}

/// `t` (2-D) transposed.
pub(super) fn transposed(t: &Tensor) -> Tensor {
    let (m, n) = (t.shape()[0], t.shape()[1]);
    let v = t.to_f64_vec();
    let w: Vec<f64> = (0..n * m).map(|k| v[(k % m) * n + k / m]).collect();
    Tensor::from_f64(t.dtype(), &[n, m], &w).expect("same size")
}

/// `t · c`, rounded once to `t`'s dtype.
fn scaled(t: &Tensor, c: f64) -> Tensor {
    let v: Vec<f64> = t.to_f64_vec().iter().map(|x| x * c).collect();
    Tensor::from_f64(t.dtype(), t.shape(), &v).expect("same size")
}

/// A Gemm's `alpha · op(A) @ op(B) + beta · C` as FusedMatMul inputs. FusedMatMul has
/// trans_b but no trans_a, alpha or beta: those are folded into operands that are
/// non-trainable constants (A transposed, alpha into B or else A, beta into C), and
/// otherwise become a Transpose or a Mul in front. A C that is no bias on the last axis
/// (a full `[M, N]` C, say) is added after the product: the residual slot, and then
/// nothing after the Gemm can fuse (an activation would have to see C first).
/// Returns whether C took the residual slot.
fn gemm(cx: &Ctx, f: &mut Fused, mm: &Node, why: &mut Why) -> Option<bool> {
    let Op::Gemm {
        alpha,
        beta,
        trans_a,
        trans_b,
    } = mm.op
    else {
        return Some(false);
    };
    f.trans_b = trans_b;
    let folds = |v: &str| cx.konst(v).filter(|_| !cx.trainable(v));
    let (a0, b0) = (mm.inputs[0].clone(), mm.inputs[1].clone());
    let mut alpha = alpha as f64;
    if alpha != 1.0 {
        if let Some(t) = folds(&b0) {
            f.b = f.init(cx, mm, "b_alpha", scaled(t, alpha));
            alpha = 1.0;
        }
    }
    match folds(&a0).filter(|t| t.shape().len() == 2) {
        Some(t) if trans_a || alpha != 1.0 => {
            let t = if trans_a { transposed(t) } else { t.clone() };
            f.a = f.init(cx, mm, "a_folded", scaled(&t, alpha));
            alpha = 1.0;
        }
        _ if trans_a => {
            let perm = Some(vec![1, 0]);
            f.a = f.pre(cx, mm, "a_t", Op::Transpose { perm }, vec![a0.clone()]);
        }
        _ => {}
    }
    let dtype = cx
        .facts
        .dtype(&a0)
        .or_else(|| cx.konst(&a0).map(|t| t.dtype()));
    let scalar = |c: f64| dtype.and_then(|d| Tensor::from_f64(d, &[], &[c]).ok());
    if alpha != 1.0 {
        let Some(c) = scalar(alpha) else {
            return why.no("the dtype of Gemm's A is unknown, for a Mul by alpha");
        };
        let c = f.init(cx, mm, "alpha", c);
        f.a = f.pre(
            cx,
            mm,
            "a_alpha",
            Op::Binary(BinaryOp::Mul),
            vec![f.a.clone(), c],
        );
    }
    let Some(c0) = mm.input(2) else {
        return Some(false);
    };
    let mut c = c0.to_string();
    if beta != 1.0 {
        let beta = beta as f64;
        if let Some(t) = folds(c0) {
            c = f.init(cx, mm, "c_beta", scaled(t, beta));
        } else {
            let Some(k) = scalar(beta) else {
                return why.no("the dtype of Gemm's A is unknown, for a Mul by beta");
            };
            let k = f.init(cx, mm, "beta", k);
            c = f.pre(cx, mm, "c_beta", Op::Binary(BinaryOp::Mul), vec![c, k]);
        }
    }
    f.bias = Some(c);
    if is_bias(cx, f, mm) {
        return Some(false);
    }
    f.residual = f.bias.take();
    match check(cx, f, mm) {
        Ok(()) => Some(true),
        Err(e) => why.no(format!(
            "Gemm's C is neither a bias on the last axis nor a residual: {e}"
        )),
    }
}

fn fuse<'g>(cx: &Ctx<'g>, i: usize, why: &mut Why) -> Option<Patch> {
    let mm = cx.node(i);
    let mut f = Fused {
        a: mm.inputs[0].clone(),
        b: mm.inputs[1].clone(),
        trans_b: false,
        bias: None,
        act: Activation::None,
        residual: None,
        out: &mm.outputs[0],
        nodes: vec![i],
        pre: vec![],
        inits: vec![],
        reshape: None,
    };
    let c_is_residual = gemm(cx, &mut f, mm, why)?;
    // A Transpose of a 2-D weight feeding B is folded into trans_b (the Transpose goes
    // once nothing else reads it).
    let mut transposed = false;
    if let Some((_, t)) = cx.prod(&f.b, |op| matches!(op, Op::Transpose { .. })) {
        let swaps = match &t.op {
            Op::Transpose { perm: Some(p) } => p == &[1, 0],
            _ => cx.facts.rank(&t.inputs[0]) == Some(2),
        };
        if swaps {
            f.b = t.inputs[0].clone();
            f.trans_b = !f.trans_b;
            transposed = true;
        }
    }
    let before = f.nodes.len();
    let mut stop = String::new();
    // 1. bias
    if f.bias.is_none() && !c_is_residual {
        match cx.sole_consumer(f.out).map(|c| cx.node(c)) {
            Some(add) if add.op == Op::Binary(BinaryOp::Add) => {
                if let Some(bias) = cx.other(add, f.out) {
                    let mut g = Fused {
                        bias: Some(bias.to_string()),
                        out: &add.outputs[0],
                        ..f.clone()
                    };
                    g.nodes.push(cx.producer(&add.outputs[0])?);
                    if is_bias(cx, &g, mm) {
                        f = g;
                    }
                }
            }
            _ => {}
        }
    }
    // 2. activation (also past a Reshape that only regroups the rows)
    if c_is_residual {
        stop = "Gemm's C took the residual slot".into();
    } else {
        let mut try_act = |f: &mut Fused<'g>| match activation(cx, f.out) {
            Ok((act, nodes, out)) => {
                f.act = act;
                f.nodes.extend(nodes);
                f.out = out;
                true
            }
            Err(e) => {
                stop = e;
                false
            }
        };
        if !try_act(&mut f) {
            if let Some(mut g) = through_reshape(cx, &f) {
                if try_act(&mut g) {
                    f = g;
                }
            }
        }
    }
    // 3. residual (likewise)
    if !c_is_residual {
        let residual = |f: &Fused<'g>, stop: &mut String| -> Option<Fused<'g>> {
            let c = cx.sole_consumer(f.out)?;
            let add = cx.node(c);
            if add.op != Op::Binary(BinaryOp::Add) {
                return None;
            }
            let r = cx.other(add, f.out)?;
            let mut g = Fused {
                out: &add.outputs[0],
                ..f.clone()
            };
            g.residual = Some(match &g.reshape {
                None => r.to_string(),
                // The residual has the reshaped shape: flattened like the product.
                Some(_) => {
                    let shapes = cx.facts.shapes(f.out)?;
                    let n = *shapes.first()?.last()?;
                    if shapes.iter().any(|s| s.last() != Some(&n)) {
                        return None;
                    }
                    let shape = Tensor::from_vec(&[2], vec![-1i64, n as i64]).ok()?;
                    let shape = g.init(cx, mm, "residual_shape", shape);
                    let op = Op::Reshape { allowzero: false };
                    g.pre(cx, mm, "residual_flat", op, vec![r.to_string(), shape])
                }
            });
            g.nodes.push(c);
            match check(cx, &g, mm) {
                Ok(()) => Some(g),
                Err(e) => {
                    *stop = format!("Add '{}' is not a residual: {e}", add.name);
                    None
                }
            }
        };
        if let Some(g) = residual(&f, &mut stop) {
            f = g;
        } else if let Some(g) = through_reshape(cx, &f).and_then(|g| residual(&g, &mut stop)) {
            f = g;
        }
    }
    if f.nodes.len() == before && !transposed && f.bias.is_none() && f.residual.is_none() {
        let s = if stop.is_empty() {
            String::new()
        } else {
            format!(" ({stop})")
        };
        return why.no(format!(
            "'{}' is not followed by a bias Add, an activation or a residual Add{s}",
            f.out
        ));
    }
    // A Gemm's Transpose or Mul in front must be paid for by the nodes fused.
    if f.pre.len() + 1 > f.nodes.len() {
        let what: Vec<&str> = f.pre.iter().map(|n| n.op.name()).collect();
        return why.no(format!(
            "FusedMatMul has no trans_a, alpha or beta, and the {} it would need in front of it for this Gemm add more nodes than fusing removes ({})",
            what.join(" and "),
            f.nodes.len()
        ));
    }
    if let Err(e) = cx.swallow_ok(&f.nodes, f.out) {
        return why.no(e);
    }
    if let Err(e) = check(cx, &f, mm) {
        if cx.facts.complete() {
            return why.no(e);
        }
    }
    Some(Patch {
        remove: f.nodes.clone(),
        add: f.all(mm),
        inits: f.inits,
        // Worth saying only where something reads on after the fused node.
        note: (!stop.is_empty() && !cx.consumers(f.out).is_empty())
            .then(|| format!("stopped before '{}': {stop}", f.out)),
        ..Default::default()
    })
}

/// `f` continued past a Reshape that is the sole reader of its output and only regroups
/// its rows: a 2-D `[M, N]` product reshaped to `[..., N]` (the exporters' Linear on a
/// 3-D input: flatten, Gemm, reshape back, then the bias, activation or residual). The
/// elementwise epilogue commutes with such a Reshape, so the fused node computes it on the
/// rows and the Reshape follows. Checked on the shapes of every inference run.
fn through_reshape<'g>(cx: &Ctx<'g>, f: &Fused<'g>) -> Option<Fused<'g>> {
    if f.reshape.is_some() || f.residual.is_some() || cx.needed(f.out) {
        return None;
    }
    let ri = cx.sole_consumer(f.out)?;
    let r = cx.node(ri);
    if !matches!(r.op, Op::Reshape { .. }) || r.inputs[0] != f.out {
        return None;
    }
    let (before, after) = (cx.facts.shapes(f.out)?, cx.facts.shapes(&r.outputs[0])?);
    let rows = before.iter().zip(&after).all(|(b, a)| match (b, a.last()) {
        ([_, n], Some(m)) => n == m,
        _ => false,
    });
    if !rows {
        return None;
    }
    let mut g = f.clone();
    g.nodes.push(ri);
    g.reshape = Some((r.clone(), cx.fresh_value(&format!("{}_rows", r.outputs[0]))));
    g.out = &r.outputs[0];
    Some(g)
}

/// The fused node infers to the type of the value it replaces, in every inference run.
fn check(cx: &Ctx, f: &Fused, mm: &Node) -> Result<(), String> {
    cx.facts.check_with(&f.all(mm), &f.inits, f.out)
}

/// A rank-1 bias on the last axis. With shapes, inference proves it; without, the bias
/// must be a rank-1 constant as long as a constant 2-D weight's output dim.
fn is_bias(cx: &Ctx, f: &Fused, mm: &Node) -> bool {
    if cx.facts.complete() {
        return check(cx, f, mm).is_ok();
    }
    let (Some(bias), Some(w)) = (f.bias.as_deref().and_then(|b| cx.konst(b)), cx.konst(&f.b))
    else {
        return false;
    };
    let n = match (w.shape(), f.trans_b) {
        ([_, n], false) | ([n, _], true) => *n,
        _ => return false,
    };
    bias.shape() == [n] && cx.facts.rank(&f.a).is_some_and(|r| r >= 2)
}

/// An activation reading `x` (and nothing else reading `x`): its kind, its nodes, its output.
pub(super) fn activation<'g>(
    cx: &Ctx<'g>,
    x: &'g str,
) -> Result<(Activation, Vec<usize>, &'g str), String> {
    if cx.needed(x) {
        // Worth saying where an activation or a residual Add reads it.
        let fusable = cx.consumers(x).iter().any(|&c| {
            matches!(
                cx.node(c).op,
                Op::Unary(_) | Op::Binary(BinaryOp::Add | BinaryOp::Mul)
            )
        });
        return Err(if fusable {
            format!("'{x}' is a graph output")
        } else {
            String::new()
        });
    }
    if let Some(c) = cx.sole_consumer(x) {
        let n = cx.node(c);
        let act = match n.op {
            Op::Unary(UnaryOp::Relu) => Some(Activation::Relu),
            Op::Unary(UnaryOp::Sigmoid) => Some(Activation::Sigmoid),
            Op::Unary(UnaryOp::Tanh) => Some(Activation::Tanh),
            Op::Unary(UnaryOp::Gelu) => Some(Activation::Gelu),
            Op::Unary(UnaryOp::GeluTanh) => Some(Activation::GeluTanh),
            // ReLU6 as exporters write it: Clip with constant bounds 0 and 6.
            Op::Clip
                if n.inputs[0] == x
                    && n.inputs.get(1).is_some_and(|v| cx.near(v, 0.0))
                    && n.inputs.get(2).is_some_and(|v| cx.near(v, 6.0)) =>
            {
                Some(Activation::Relu6)
            }
            _ => None,
        };
        if let Some(act) = act {
            return Ok((act, vec![c], &n.outputs[0]));
        }
    }
    // Expanded forms: try each Mul near `x` as the expansion's last node.
    let mut last_err = String::new();
    for y in muls_near(cx, x) {
        let m = silu(cx, x, y)
            .map(|n| (Activation::Silu, n))
            .or_else(|| gelu(cx, x, y));
        let Some((act, nodes)) = m else { continue };
        let mut all = nodes.clone();
        all.extend(cx.producer(x));
        match cx.swallow_ok(&all, y) {
            Ok(()) => return Ok((act, nodes, y)),
            Err(e) => last_err = format!("{} expansion: {e}", act.name()),
        }
    }
    if cx.consumers(x).len() > 1 && last_err.is_empty() {
        last_err = format!(
            "'{x}' is read by {} nodes and they are no activation expansion",
            cx.consumers(x).len()
        );
    }
    Err(last_err)
}

/// Outputs of Mul nodes within a few elementwise steps downstream of `x`.
fn muls_near<'g>(cx: &Ctx<'g>, x: &'g str) -> Vec<&'g str> {
    let (mut seen, mut frontier, mut out) = (vec![], vec![x], vec![]);
    for _ in 0..8 {
        let mut next = vec![];
        for v in frontier {
            for &c in cx.consumers(v) {
                let n = cx.node(c);
                if seen.contains(&c) || !matches!(n.op, Op::Unary(_) | Op::Binary(_)) {
                    continue;
                }
                seen.push(c);
                if n.op == Op::Binary(BinaryOp::Mul) {
                    out.push(n.outputs[0].as_str());
                }
                next.push(n.outputs[0].as_str());
            }
        }
        frontier = next;
    }
    out
}

/// `x * Sigmoid(x)`, either order.
fn silu(cx: &Ctx, x: &str, y: &str) -> Option<Vec<usize>> {
    let (f, mut nodes) = cx.factors(y);
    let s = match f[..] {
        [p, q] if p == x => q,
        [p, q] if q == x => p,
        _ => return None,
    };
    let (si, sn) = cx.prod(s, is_un(UnaryOp::Sigmoid))?;
    (sn.inputs[0] == x).then(|| nodes.push(si))?;
    Some(nodes)
}

/// `x * 0.5 * (1 + g)` in any grouping and order, with `g` = `erf(x / sqrt(2))` (or
/// `x * 0.7071…`) for exact GELU or `tanh(sqrt(2/pi) * (x + 0.044715 * x³))` (x³ as Pow
/// or x·x·x; also `x * (1 + 0.044715 * x²)` inside) for its tanh form.
fn gelu(cx: &Ctx, x: &str, y: &str) -> Option<(Activation, Vec<usize>)> {
    let (f, mut nodes) = cx.factors(y);
    if f.len() != 3 {
        return None;
    }
    let xi = f.iter().position(|v| *v == x)?;
    let hi = (0..3).find(|&k| k != xi && cx.near(f[k], 0.5))?;
    let t1 = f[3 - xi - hi];
    let (ai, add) = cx.prod(t1, is_bin(BinaryOp::Add))?;
    nodes.push(ai);
    let g = add.inputs.iter().find(|v| !cx.near(v, 1.0))?;
    if !add.inputs.iter().any(|v| cx.near(v, 1.0)) {
        return None;
    }
    if let Some((ei, erf)) = cx.prod(g, is_un(UnaryOp::Erf)) {
        nodes.push(ei);
        let d = &erf.inputs[0];
        if let Some((di, div)) = cx.prod(d, is_bin(BinaryOp::Div)) {
            (div.inputs[0] == x && cx.near(&div.inputs[1], std::f64::consts::SQRT_2))
                .then(|| nodes.push(di))?;
        } else {
            let (df, dn) = cx.factors(d);
            let [p, q] = df[..] else { return None };
            let ok = (p == x && cx.near(q, std::f64::consts::FRAC_1_SQRT_2))
                || (q == x && cx.near(p, std::f64::consts::FRAC_1_SQRT_2));
            ok.then(|| nodes.extend(dn))?;
        }
        return Some((Activation::Gelu, nodes));
    }
    let (ti, tanh) = cx.prod(g, is_un(UnaryOp::Tanh))?;
    nodes.push(ti);
    // sqrt(2/pi) * (x + 0.044715 * x³), or sqrt(2/pi) * x * (1 + 0.044715 * x²) (BLOOM's)
    let (sf, sn) = cx.factors(&tanh.inputs[0]);
    let si = sf.iter().position(|v| cx.near(v, SQRT_2_OVER_PI))?;
    let rest: Vec<&str> = (0..sf.len()).filter(|&k| k != si).map(|k| sf[k]).collect();
    nodes.extend(sn);
    let (inner, power) = match rest[..] {
        [inner] => (inner, 3),
        [p, q] if p == x => (q, 2),
        [p, q] if q == x => (p, 2),
        _ => return None,
    };
    // inner = x + 0.044715 * x³, or 1 + 0.044715 * x²
    let (ii, add) = cx.prod(inner, is_bin(BinaryOp::Add))?;
    nodes.push(ii);
    let cubic = if power == 3 {
        cx.other(add, x)?
    } else {
        let one = add.inputs.iter().position(|v| cx.near(v, 1.0))?;
        &add.inputs[1 - one]
    };
    let (cf, cn) = cx.factors(cubic);
    nodes.extend(cn);
    let ci = cf.iter().position(|v| cx.near(v, GELU_CUBIC))?;
    let rest: Vec<&str> = (0..cf.len()).filter(|&k| k != ci).map(|k| cf[k]).collect();
    if rest.len() == power && rest.iter().all(|v| *v == x) {
        // x·x(·x)
    } else if let [p] = rest[..] {
        let (pi, pow) = cx.prod(p, is_bin(BinaryOp::Pow))?;
        (pow.inputs[0] == x && cx.near(&pow.inputs[1], power as f64)).then(|| nodes.push(pi))?;
    } else {
        return None;
    }
    Some((Activation::GeluTanh, nodes))
}
