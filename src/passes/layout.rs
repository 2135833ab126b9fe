//! The channels-last layout, for backends whose convolution kernels want it (cuDNN's
//! tensor-core kernels read NHWC): `channels_last` stores the activations between
//! convolutions `[N, H, W, C]`, so that a network of convolutions, pools, residual Adds
//! and activations transposes only where that layout meets an op that reads channels
//! first (a Flatten before the classifier, say), not around every convolution.
//! `channels_first` undoes it for a backend whose kernels do not take the layout.
//!
//! Neither is a pass of the default pipeline: a session picks one for its backend after
//! the pipeline ran (exec/session.rs), and autodiff then differentiates the graph as laid
//! out (a convolution's gradient is channels-last too).
//!
//! A value laid out channels-last gets a twin, `<name>.nhwc`, that the laid-out nodes read
//! and write. Every twin made by a laid-out node is also transposed back to its original
//! name, so that every value of the graph keeps its name, shape and meaning (a plan runs
//! only the transposes something reads).

use super::pattern::{Ctx, Facts};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::window::{channels_last_of, to_first_perm, to_last_perm, AutoPad, Window};
use crate::graph::{Graph, HostEval, InitSource, Initializer, Node, Op};
use crate::tensor::DType;
use std::collections::{HashMap, HashSet};

/// The window of an op that the channels-last flag lays out.
fn window_of(op: &mut Op) -> Option<&mut Window> {
    match op {
        Op::Conv { window, .. }
        | Op::FusedConv { window, .. }
        | Op::ConvGrad { window, .. }
        | Op::MaxPool { window, .. }
        | Op::MaxPoolGrad { window, .. } => Some(window),
        _ => None,
    }
}

/// Whether `op` is a convolution (the ops worth a layout of their own).
fn is_conv(op: &Op) -> bool {
    matches!(
        op,
        Op::Conv { .. } | Op::FusedConv { .. } | Op::ConvGrad { .. }
    )
}

/// Ops that map elements one to one whatever the layout, given operands laid out alike.
fn elementwise(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_) | Op::Binary(_) | Op::UnaryGrad(_) | Op::Clip
    )
}

/// Whether a window's padding is the same on both sides of each axis, as the channels-last
/// kernels take it (cuDNN takes one pad per axis).
fn symmetric(w: &Window) -> bool {
    match w.auto_pad {
        AutoPad::Valid => true,
        AutoPad::NotSet => {
            let h = w.pads.len() / 2;
            w.pads[..h] == w.pads[h..]
        }
        // The padding of SAME depends on the image's size.
        _ => false,
    }
}

/// Names not yet taken in `g`.
struct Names(HashSet<String>);

impl Names {
    fn of(g: &Graph) -> Names {
        let mut s: HashSet<String> = g.initializers.iter().map(|i| i.name.clone()).collect();
        s.extend(g.inputs.iter().map(|i| i.name.clone()));
        for n in &g.nodes {
            s.insert(n.name.clone());
            s.extend(n.outputs.iter().cloned());
        }
        Names(s)
    }
    fn fresh(&mut self, base: String) -> String {
        let name = super::pattern::fresh(&base, |n| self.0.contains(n));
        self.0.insert(name.clone());
        name
    }
}

fn transpose(name: String, from: &str, to: &str, perm: Vec<usize>) -> Node {
    Node {
        name,
        op: Op::Transpose { perm: Some(perm) },
        inputs: vec![from.to_string()],
        outputs: vec![to.to_string()],
        loc: None,
    }
}

/// `g` with its 2-D convolutions (those `takes` accepts, in f16, bf16 or f32, with
/// symmetric padding) and everything between them that can be channels-last: the max
/// pools reading their outputs, elementwise ops whose full-size operands all are, and
/// reductions over them. Returns the graph and how many nodes were laid out (0: `g`
/// unchanged).
pub fn channels_last(
    g: &Graph,
    eval: &'static dyn HostEval,
    takes: &dyn Fn(&Node) -> bool,
) -> Result<(Graph, usize)> {
    const RANK: usize = 4;
    if !g.nodes.iter().any(|n| is_conv(&n.op)) {
        return Ok((g.clone(), 0));
    }
    let facts = Facts::new(g, eval);
    let cx = Ctx::new(g, &facts)?;
    let rank = |v: &str| facts.rank(v);
    // A value no layout changes: a scalar or a single element.
    let single = |v: &str| {
        rank(v) == Some(0)
            || facts
                .static_shape(v)
                .is_some_and(|s| s.iter().product::<usize>() == 1)
    };
    let float = |v: &str| matches!(facts.dtype(v), Some(DType::F16 | DType::BF16 | DType::F32));
    // Values the laid-out nodes write channels-last, and the nodes (with new Reduce axes).
    let mut last: HashSet<&str> = HashSet::new();
    let mut laid: HashMap<usize, Op> = HashMap::new();
    for &i in &cx.order {
        let n = cx.node(i);
        let mut op = n.op.clone();
        let x = n.inputs.first().map(String::as_str).unwrap_or("");
        let join = if let Some(w) = window_of(&mut op) {
            let ok = !w.channels_last
                && rank(x) == Some(RANK)
                && float(x)
                && match is_conv(&n.op) {
                    true => symmetric(w) && takes(n),
                    // A pool is laid out only where its image already is.
                    false => last.contains(x),
                };
            w.channels_last = true;
            ok
        } else if elementwise(&n.op) {
            // Operands of one rank broadcast axis by axis, so laid out alike they still
            // meet (a squeeze-and-excite's [N, 1, 1, C] scales against [N, H, W, C]).
            let y = n.outputs[0].as_str();
            rank(y) == Some(RANK)
                && n.inputs.iter().any(|v| last.contains(v.as_str()))
                && n.inputs.iter().all(|v| {
                    v.is_empty()
                        || single(v)
                        || (last.contains(v.as_str()) && rank(v) == Some(RANK))
                })
        } else if let Op::Reduce {
            axes,
            keepdims,
            noop_with_empty_axes,
            kind,
        } = &n.op
        {
            let given = match (axes, n.inputs.get(1).filter(|v| !v.is_empty())) {
                (Some(a), _) => Some(a.clone()),
                (None, Some(v)) => facts
                    .value(v)
                    .or_else(|| g.initializer(v).map(|i| &i.tensor))
                    .map(|t| t.to_f64_vec().iter().map(|&a| a as i64).collect()),
                (None, None) => None,
            };
            let norm: Option<Vec<usize>> = given.filter(|a| !a.is_empty()).and_then(|a| {
                a.iter()
                    .map(|&d| {
                        let d = if d < 0 { d + RANK as i64 } else { d };
                        (0..RANK as i64).contains(&d).then_some(d as usize)
                    })
                    .collect()
            });
            match norm {
                Some(a) if last.contains(x) => {
                    // Without keepdims the kept axes must stay in their order: not the
                    // channels together with a spatial axis.
                    let kept = |d: usize| !a.contains(&d);
                    let ordered = *keepdims || !(kept(1) && (2..RANK).any(kept));
                    let pos = to_first_perm(RANK);
                    op = Op::Reduce {
                        kind: *kind,
                        axes: Some(a.iter().map(|&d| pos[d] as i64).collect()),
                        keepdims: *keepdims,
                        noop_with_empty_axes: *noop_with_empty_axes,
                    };
                    ordered
                }
                _ => false,
            }
        } else {
            false
        };
        if !join {
            continue;
        }
        laid.insert(i, op);
        let keeps = !matches!(
            n.op,
            Op::Reduce {
                keepdims: false,
                ..
            }
        );
        for y in n.outputs.iter().filter(|y| !y.is_empty()) {
            if keeps && rank(y) == Some(RANK) {
                last.insert(y);
            }
        }
    }
    if !laid.keys().any(|&i| is_conv(&g.nodes[i].op)) {
        return Ok((g.clone(), 0));
    }
    let mut names = Names::of(g);
    let mut twins: HashMap<String, String> = HashMap::new();
    let mut out = g.clone();
    out.nodes.clear();
    let to_last = to_last_perm(RANK);
    let mut folded: HashSet<String> = HashSet::new();
    // In execution order, so that a value's twin is made before it is read.
    for &i in &cx.order {
        let n = &g.nodes[i];
        let Some(op) = laid.get(&i) else {
            out.nodes.push(n.clone());
            continue;
        };
        let mut node = n.clone();
        node.op = op.clone();
        if matches!(op, Op::Reduce { .. }) {
            // Its axes are now the attribute.
            node.inputs.truncate(1);
        }
        for v in node.inputs.iter_mut() {
            if v.is_empty() || rank(v) != Some(RANK) || single(v) {
                continue;
            }
            if let Some(t) = twins.get(v.as_str()) {
                *v = t.clone();
                continue;
            }
            let t = names.fresh(format!("{v}.nhwc"));
            match g.initializer(v).filter(|i| !i.trainable) {
                // A constant is stored laid out (a frozen model's weights).
                Some(init) => {
                    folded.insert(v.clone());
                    // Permuted on the host by the evaluator's Transpose.
                    let node = transpose(String::new(), v, &t, to_last.clone());
                    let shape = channels_last_of(init.tensor.shape());
                    let ty = ValueType::new(init.tensor.dtype(), &shape);
                    let tensor = eval.eval(&node, &[Some(&init.tensor)], &[ty])?.remove(0);
                    out.initializers.push(Initializer {
                        name: t.clone(),
                        tensor,
                        trainable: false,
                        source: InitSource::Data,
                        loc: init.loc.clone(),
                    })
                }
                None => {
                    let name = names.fresh(format!("{v}/to_nhwc"));
                    out.nodes.push(transpose(name, v, &t, to_last.clone()));
                }
            }
            twins.insert(v.clone(), t.clone());
            *v = t;
        }
        let mut back = vec![];
        for y in node.outputs.iter_mut() {
            if !last.contains(y.as_str()) {
                continue;
            }
            let t = names.fresh(format!("{y}.nhwc"));
            let name = names.fresh(format!("{y}/to_nchw"));
            back.push(transpose(name, &t, y, to_first_perm(RANK)));
            twins.insert(y.clone(), t.clone());
            *y = t;
        }
        out.nodes.push(node);
        out.nodes.extend(back);
    }
    // A constant now read only laid out is not kept twice.
    let read: HashSet<&str> = out
        .nodes
        .iter()
        .flat_map(|n| &n.inputs)
        .map(String::as_str)
        .collect();
    let outputs = out.outputs.clone();
    out.initializers.retain(|i| {
        !folded.contains(&i.name) || read.contains(i.name.as_str()) || outputs.contains(&i.name)
    });
    Ok((out, laid.len()))
}

/// `g` with every channels-last node (a model's, or `channels_last`'s) run channels
/// first between transposes, for a backend whose kernels take only that layout.
pub fn channels_first(g: &Graph, eval: &'static dyn HostEval) -> Result<Graph> {
    let flagged = |n: &Node| {
        let mut op = n.op.clone();
        window_of(&mut op).is_some_and(|w| w.channels_last)
    };
    if !g.nodes.iter().any(flagged) {
        return Ok(g.clone());
    }
    let facts = Facts::new(g, eval);
    let mut names = Names::of(g);
    let mut out = g.clone();
    out.nodes.clear();
    for n in &g.nodes {
        if !flagged(n) {
            out.nodes.push(n.clone());
            continue;
        }
        let mut node = n.clone();
        if let Some(w) = window_of(&mut node.op) {
            w.channels_last = false;
        }
        for v in n.inputs.iter().chain(&n.outputs).filter(|v| !v.is_empty()) {
            if facts.rank(v).is_none() {
                crate::bail!(
                    Graph,
                    "{}: the rank of '{v}' is not known, so its channels-last layout cannot \
                     be undone for this backend",
                    n.describe()
                );
            }
        }
        let laid = |v: &str| !v.is_empty() && facts.rank(v).is_some_and(|r| r > 2);
        for v in node.inputs.iter_mut().filter(|v| laid(v)) {
            let r = facts.rank(v).unwrap_or(0);
            let t = names.fresh(format!("{v}.nchw"));
            let name = names.fresh(format!("{}/{v}/to_nchw", n.name));
            out.nodes.push(transpose(name, v, &t, to_first_perm(r)));
            *v = t;
        }
        let mut back = vec![];
        for y in node.outputs.iter_mut().filter(|y| laid(y)) {
            let r = facts.rank(y).unwrap_or(0);
            let t = names.fresh(format!("{y}.nchw"));
            let name = names.fresh(format!("{y}/to_nhwc"));
            back.push(transpose(name, &t, y, to_last_perm(r)));
            *y = t;
        }
        out.nodes.push(node);
        out.nodes.extend(back);
    }
    Ok(out)
}
