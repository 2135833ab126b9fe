//! Constant folding: a node whose inputs are all constants (non-trainable initializers,
//! Constants, earlier folds) is evaluated once by the host evaluator the passes were given
//! (the CPU backend's by default) and replaced by an initializer of the same name. `Shape` folds when its input's shape is static, which
//! turns exporter shape arithmetic (Shape → Gather → Concat → Reshape) into constants.

use super::pattern::{Ctx, Patch, Why};
use super::{any_op, Rule};
use crate::graph::infer::{self, ValueType};
use crate::graph::{InitSource, Initializer, Node, Op};
use crate::tensor::Tensor;

/// Folded results larger than this many elements are left to run time.
const MAX_ELEMENTS: usize = 1 << 20;

pub(crate) const RULES: &[Rule] = &[
    Rule {
        name: "fold_shape",
        anchor: |op| matches!(op, Op::Shape { .. }),
        run: fold_shape,
    },
    Rule {
        name: "fold_constant",
        anchor: any_op,
        run: fold_node,
    },
];

/// A constant initializer nobody trains.
pub(super) fn init(name: &str, tensor: Tensor) -> Initializer {
    Initializer {
        name: name.to_string(),
        tensor,
        trainable: false,
        source: InitSource::Data,
        loc: None,
    }
}

fn fold_shape(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::Shape { start, end } = n.op else {
        return None;
    };
    let shape = cx.facts.static_shape(&n.inputs[0])?;
    let (s, e) = infer::shape_range(start, end, shape.len());
    let dims: Vec<i64> = shape[s..e].iter().map(|&d| d as i64).collect();
    let t = Tensor::from_vec(&[dims.len()], dims).ok()?;
    Some(Patch {
        remove: vec![i],
        inits: vec![init(&n.outputs[0], t)],
        ..Default::default()
    })
}

fn fold_node(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    // Constants are already constant; random draws differ per run; Shape is above.
    if n.inputs.is_empty()
        || n.op.is_random()
        || matches!(n.op, Op::Shape { .. } | Op::Constant { .. })
    {
        return None;
    }
    // Folding a trainable weight into a frozen constant would stop it from training.
    if n.inputs.iter().any(|v| cx.trainable(v)) {
        return None;
    }
    let args: Vec<Option<&Tensor>> = n
        .inputs
        .iter()
        .map(|v| {
            if v.is_empty() {
                Some(None)
            } else {
                cx.konst(v).map(Some)
            }
        })
        .collect::<Option<_>>()?;
    let values = evaluate(cx, n, &args, MAX_ELEMENTS)?;
    let inits = n
        .outputs
        .iter()
        .zip(values)
        .filter(|(o, _)| !o.is_empty())
        .map(|(o, t)| init(o, t))
        .collect();
    Some(Patch {
        remove: vec![i],
        inits,
        ..Default::default()
    })
}

/// `n` evaluated on the host over the constant inputs `args` (None where an input is left
/// out), when it infers and no output holds more than `limit` elements.
pub(super) fn evaluate(
    cx: &Ctx,
    n: &Node,
    args: &[Option<&Tensor>],
    limit: usize,
) -> Option<Vec<Tensor>> {
    let types: Vec<Option<ValueType>> = args
        .iter()
        .map(|t| t.map(|t| ValueType::new(t.dtype(), t.shape())))
        .collect();
    let trefs: Vec<Option<&ValueType>> = types.iter().map(|t| t.as_ref()).collect();
    let outs = infer::infer_node(n, &trefs, args, cx.facts.eval).ok()?;
    if outs.iter().any(|t| t.numel() > limit) {
        return None;
    }
    cx.facts.eval.eval(n, args, &outs).ok()
}
