//! Inference of the sliding-window ops Im2Col and Col2Im (their geometry: graph/window.rs).

use super::*;

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let x = cx.x();
    let f = |m: String| cx.fail(m);
    match &cx.node.op {
        Op::Im2Col { kernel, window, .. } => {
            let k = dims(kernel, cx.known(1, "kernel_shape")?, "kernel_shape").map_err(f)?;
            let shape = crate::graph::window::im2col_shape(window, &x.shape, &k).map_err(f)?;
            one(ValueType::new(x.dtype, &shape))
        }
        Op::Col2Im { block, window } => {
            cx.need_float(&x, "the columns")?;
            let image = cx.known(1, "image_shape")?.unwrap_or_default();
            let block = dims(block, cx.known(2, "block_shape")?, "block_shape").map_err(f)?;
            let shape =
                crate::graph::window::col2im_shape(window, &x.shape, &image, &block).map_err(f)?;
            one(ValueType::new(x.dtype, &shape))
        }
        _ => unreachable!("window::infer is dispatched the window ops"),
    }
}

/// A window's kernel dims: the attribute, else the plan-time input.
fn dims(
    attr: &[usize],
    input: Option<Vec<i64>>,
    what: &str,
) -> std::result::Result<Vec<usize>, String> {
    match input {
        _ if !attr.is_empty() => Ok(attr.to_vec()),
        Some(v) => crate::graph::window::dims_of(&v, what),
        None => Err(format!(
            "{what} is required (as the input or the attribute)"
        )),
    }
}
