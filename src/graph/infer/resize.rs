//! Inference of ResizeMatrix, Resize's per-axis interpolation weights (graph/resize.rs):
//! computed here on the host from X's type and the values of roi, scales and sizes.

use super::*;

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let outs = values(cx.node, cx.ins, cx.consts).map_err(|m| cx.fail(m))?;
    Ok(outs
        .iter()
        .take(cx.node.outputs.len())
        .map(|t| ValueType::new(t.dtype(), t.shape()))
        .collect())
}

/// ResizeMatrix's outputs, from X's type and the host values of roi, scales and sizes.
pub(super) fn values(
    node: &Node,
    ins: &[Option<&ValueType>],
    consts: &[Option<&Tensor>],
) -> std::result::Result<Vec<Tensor>, String> {
    let x = ins
        .first()
        .copied()
        .flatten()
        .ok_or("input X is required")?;
    let mut vals = [None; 3];
    for (k, what) in [(1, "roi"), (2, "scales"), (3, "sizes")] {
        if ins.get(k).copied().flatten().is_none() {
            continue;
        }
        vals[k - 1] = Some(consts.get(k).copied().flatten().ok_or_else(|| {
            format!(
                "{what} (input '{}') must be known when the plan is made (computed from initializers, Constants, Shape and the graph inputs fed when planning, through small nodes evaluated on the host), but it depends on a value that is not",
                node.inputs[k]
            )
        })?);
    }
    crate::graph::resize::eval(&node.op, x.dtype, &x.shape, vals[0], vals[1], vals[2])
}
