//! Convolution-epilogue fusion: `Conv → Add(Z) → activation` becomes one `FusedConv`
//! computing `act(conv(X, W) + B + Z)`, the residual block's ending (ResNet's
//! `Relu(conv + shortcut)`, MobileNetV2's linear `conv + x`) and the plain `Relu(conv)`.
//! Each stage is optional (one must be there). Z must have the convolution's own shape and
//! dtype in every inference run: a per-channel constant is no residual (that is the
//! `conv_affine` rule's, folded into the bias). A swallowed value must be read by nothing
//! else. The activations are the MatMul epilogue's: Relu, Sigmoid, Tanh, Gelu and the
//! GELU and SiLU expansions exporters write.

use super::epilogue::activation;
use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::{Activation, BinaryOp, Node, Op};

pub(crate) const RULE: Rule = Rule {
    name: "conv_epilogue",
    // A channels-last Conv's per-channel operands lie along its last axis.
    anchor: |op| matches!(op, Op::Conv { window, .. } if !window.channels_last),
    run: fuse,
};

/// Why the rule did not fire on a convolution with nothing to take after it (the usual
/// case for one followed by a normalization, which `--explain-fusion` leaves out).
pub(crate) const NOTHING_FOLLOWS: &str = "no residual Add or activation follows it";

fn fuse(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::Conv {
        kernel,
        window,
        group,
    } = &n.op
    else {
        return None;
    };
    let mut out: &str = &n.outputs[0];
    let mut nodes = vec![i];
    let mut z = None;
    let mut stop = String::new();
    // 1. the residual, before the activation
    if let Some(c) = cx.sole_consumer(out) {
        let add = cx.node(c);
        if let (Op::Binary(BinaryOp::Add), Some(r)) = (&add.op, cx.other(add, out)) {
            if cx.facts.same_shape(r, out) && cx.facts.dtype(r) == cx.facts.dtype(out) {
                z = Some(r.to_string());
                nodes.push(c);
                out = &add.outputs[0];
            } else {
                stop = format!(
                    "Add '{}' is no residual: its other term does not have the convolution's shape and dtype in every inference run",
                    add.name
                );
            }
        }
    }
    // 2. the activation
    let mut act = Activation::None;
    match activation(cx, out) {
        Ok((a, taken, o)) => {
            act = a;
            nodes.extend(taken);
            out = o;
        }
        Err(e) if stop.is_empty() => stop = e,
        Err(_) => {}
    }
    if nodes.len() == 1 {
        return why.no(match stop.is_empty() {
            true => NOTHING_FOLLOWS.to_string(),
            false => stop,
        });
    }
    if let Err(e) = cx.swallow_ok(&nodes, out) {
        return why.no(e);
    }
    let note = (act == Activation::None && !stop.is_empty() && !cx.consumers(out).is_empty())
        .then(|| format!("stopped before '{out}': {stop}"));
    let mut inputs = n.inputs.clone();
    if let Some(z) = z {
        inputs.resize(2, String::new());
        inputs.push(n.inputs.get(2).cloned().unwrap_or_default());
        inputs.push(z);
    }
    let fused = Node {
        name: n.name.clone(),
        op: Op::FusedConv {
            kernel: kernel.clone(),
            window: window.clone(),
            group: *group,
            activation: act,
        },
        inputs,
        outputs: vec![out.to_string()],
        loc: n.loc.clone(),
    };
    Some(Patch {
        remove: nodes,
        add: vec![fused],
        note,
        ..Default::default()
    })
}
