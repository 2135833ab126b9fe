//! Losses appended to a model for training: a model exported with its logits as output
//! (as `transformers` and `torchvision` models are) trains against labels once
//! `append_cross_entropy` has given it a loss.

use super::infer::symbolic::{infer_symbolic, SymDim};
use super::op::LossReduction;
use super::{Dim, Graph, HostEval, InputInfo, Node, Op};
use crate::error::Result;
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The label PyTorch's cross-entropy ignores by default: positions labelled so (padding,
/// a language model's last position) add nothing to the loss or its mean.
pub const IGNORED_LABEL: i64 = -100;

/// Appends the mean softmax cross-entropy of graph output `logits` against a new int64
/// graph input `labels`, as `torch.nn.functional.cross_entropy(logits.reshape(-1, C),
/// labels.reshape(-1))` computes it: the classes run along `logits`' last axis and every
/// other axis is a position (`[N, C]` for a classifier, `[batch, seq, vocab]` for a
/// language model, whose labels are then the next tokens), and labels equal to
/// `IGNORED_LABEL` are left out. `labels` takes `logits`' shape without its last axis, in
/// the same symbols. Returns the loss, a new scalar graph output.
pub fn append_cross_entropy(
    g: &mut Graph,
    logits: &str,
    labels: &str,
    ev: &dyn HostEval,
) -> Result<String> {
    append_cross_entropy_on(g, logits, -1, labels, ev)
}

/// `append_cross_entropy` with the classes along axis `class_axis` of `logits` (negative
/// counts from the end): 1 is PyTorch's `cross_entropy(logits, labels)` on `[N, C, H, W]`
/// scores of a segmentation model. `labels` takes `logits`' shape without that axis.
pub fn append_cross_entropy_on(
    g: &mut Graph,
    logits: &str,
    class_axis: i64,
    labels: &str,
    ev: &dyn HostEval,
) -> Result<String> {
    if !g.outputs.iter().any(|o| o == logits) {
        crate::bail!(
            Input,
            "'{logits}' is not an output of the model (its outputs: {})",
            g.outputs.join(", ")
        );
    }
    let mut taken: HashSet<String> = g.inputs.iter().map(|i| i.name.clone()).collect();
    taken.extend(g.initializers.iter().map(|i| i.name.clone()));
    taken.extend(g.nodes.iter().flat_map(|n| n.outputs.iter().cloned()));
    taken.extend(g.nodes.iter().map(|n| n.name.clone()));
    if taken.contains(labels) {
        crate::bail!(
            Input,
            "the model already has a value named '{labels}', the name the labels input would take"
        );
    }
    let types = infer_symbolic(g, &BTreeMap::new(), &HashMap::new(), ev)?;
    let ty = &types[logits];
    let rank = ty.shape.len();
    if !ty.dtype.is_float() || rank < 2 {
        crate::bail!(
            Input,
            "the cross-entropy needs floating logits with a class axis and at least one \
             position axis; '{logits}' is {} {}",
            ty.dtype,
            ty.shape_text()
        );
    }
    let axis = match usize::try_from(if class_axis < 0 {
        class_axis + rank as i64
    } else {
        class_axis
    }) {
        Ok(a) if a < rank => a,
        _ => crate::bail!(
            Input,
            "class axis {class_axis} is not an axis of '{logits}' {}",
            ty.shape_text()
        ),
    };
    let classes = match &ty.shape[axis] {
        SymDim::Product(m) if m.syms.is_empty() => m.coef,
        _ => crate::bail!(
            Input,
            "the class axis ({axis}) of '{logits}' {} has no fixed size",
            ty.shape_text()
        ),
    };
    let mut shape = vec![];
    for (_, d) in ty.shape.iter().enumerate().filter(|&(i, _)| i != axis) {
        shape.push(match d {
            SymDim::Product(m) if m.syms.is_empty() => Dim::Fixed(m.coef),
            SymDim::Product(m) if m.coef == 1 && m.syms.len() == 1 && m.syms[0].1 == 1 => {
                Dim::Sym(m.syms[0].0.clone())
            }
            _ => crate::bail!(
                Input,
                "'{logits}' is {}: the labels' shape (all but the last axis) must be sizes \
                 or single symbols",
                ty.shape_text()
            ),
        });
    }
    let mut fresh = |base: &str| {
        let mut name = base.to_string();
        let mut k = 1;
        while taken.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        taken.insert(name.clone());
        name
    };
    let mut node = |g: &mut Graph, what: &str, op: Op, inputs: Vec<String>| {
        let out = fresh(&format!("cross_entropy/{what}"));
        g.nodes.push(Node {
            name: out.clone(),
            op,
            inputs,
            outputs: vec![out.clone()],
            loc: None,
        });
        out
    };
    let ints = |v: Vec<i64>| Op::Constant {
        value: Tensor::from_vec(&[v.len()], v).expect("1-D"),
    };
    let rows = node(g, "rows_shape", ints(vec![-1, classes as i64]), vec![]);
    let flat = node(g, "flat_shape", ints(vec![-1]), vec![]);
    let reshape = || Op::Reshape { allowzero: false };
    // Classes elsewhere than last move there, the positions keeping their order.
    let last = if axis + 1 == rank {
        logits.to_string()
    } else {
        let perm = (0..rank).filter(|&i| i != axis).chain([axis]).collect();
        node(
            g,
            "classes_last",
            Op::Transpose { perm: Some(perm) },
            vec![logits.to_string()],
        )
    };
    let scores = node(g, "scores", reshape(), vec![last, rows]);
    let targets = node(g, "labels", reshape(), vec![labels.to_string(), flat]);
    let loss = node(
        g,
        "loss",
        Op::SoftmaxCrossEntropyLoss {
            reduction: LossReduction::Mean,
            ignore_index: Some(IGNORED_LABEL),
        },
        vec![scores, targets],
    );
    g.inputs.push(InputInfo {
        name: labels.to_string(),
        dtype: DType::I64,
        shape,
        range: Some((0.0, classes as f64)),
        default: None,
        loc: None,
    });
    g.outputs.push(loss.clone());
    crate::graph::validate::validate(g, ev)?;
    Ok(loss)
}
