//! Inference of the sliding-window ops: Im2Col, Col2Im, Conv, FusedConv, ConvGrad, MaxPool
//! and MaxPoolGrad (their geometry: graph/window.rs).

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
        Op::Conv {
            kernel,
            window,
            group,
        }
        | Op::FusedConv {
            kernel,
            window,
            group,
            ..
        } => {
            let w = need(cx, 1, "W")?;
            let shape = conv_shape(kernel, window, *group, &x.shape, &w.shape).map_err(f)?;
            cx.need_float(&x, "X")?;
            if w.dtype != x.dtype {
                return Err(f(format!("W is {} but X is {}", w.dtype, x.dtype)));
            }
            if let Some(b) = cx.t(2) {
                if b.dtype != x.dtype || b.shape != [w.shape[0]] {
                    return Err(f(format!(
                        "B must be {}[{}] (one value per output channel), got {}{:?}",
                        x.dtype, w.shape[0], b.dtype, b.shape
                    )));
                }
            }
            let y = ValueType::new(x.dtype, &shape);
            if let Some(z) = cx.t(3) {
                if z.dtype != x.dtype || z.shape != shape {
                    return Err(f(format!(
                        "Z (the residual) must be {}{:?}, Y's type, got {}{:?}",
                        x.dtype, shape, z.dtype, z.shape
                    )));
                }
            }
            Ok(vec![y; cx.node.outputs.len()])
        }
        // (dY, X, W) -> (dX, dW)
        Op::ConvGrad {
            kernel,
            window,
            group,
        } => {
            let (xv, w) = (need(cx, 1, "X")?, need(cx, 2, "W")?);
            let shape = conv_shape(kernel, window, *group, &xv.shape, &w.shape).map_err(f)?;
            if x.shape != shape || x.dtype != xv.dtype {
                return Err(f(format!(
                    "dY is {}{:?} but the convolution gives {}{:?}",
                    x.dtype, x.shape, xv.dtype, shape
                )));
            }
            Ok(vec![xv, w])
        }
        Op::MaxPool { kernel, window } => {
            if !x.dtype.is_float() {
                return Err(f(format!(
                    "X is {}: this MaxPool takes a floating X. The importer writes an \
                     integer MaxPool another way when the model declares its input's type \
                     (as a graph input or in value_info, which onnx.shape_inference adds)",
                    x.dtype
                )));
            }
            one(ValueType::new(
                x.dtype,
                &pool_shape(window, &x.shape, kernel).map_err(f)?,
            ))
        }
        // (dY, X) -> dX
        Op::MaxPoolGrad { kernel, window } => {
            let xv = need(cx, 1, "X")?;
            cx.need_float(&xv, "X")?;
            let shape = pool_shape(window, &xv.shape, kernel).map_err(f)?;
            if x.shape != shape || x.dtype != xv.dtype {
                return Err(f(format!(
                    "dY is {}{:?} but the pool gives {}{:?}",
                    x.dtype, x.shape, xv.dtype, shape
                )));
            }
            one(xv)
        }
        _ => unreachable!("window::infer is dispatched the window ops"),
    }
}

/// Y's shape `[N, C, *out]` of a pool of X `[N, C, *spatial]` (1 to 3 spatial axes).
fn pool_shape(
    window: &crate::graph::window::Window,
    x: &[usize],
    kernel: &[usize],
) -> std::result::Result<Vec<usize>, String> {
    if x.len() != kernel.len() + 2 || kernel.len() > 3 {
        return Err(format!(
            "X must be [N, C, spatial...] with one spatial axis per kernel dim ({kernel:?}, 1 \
             to 3), got {x:?}"
        ));
    }
    let x = &window.channels_first(x)[..];
    let placed = window.place(&x[2..], kernel)?;
    Ok(window.laid_out(&[&x[..2], &placed.out[..]].concat()))
}

/// Required input `i`.
fn need(cx: &Cx, i: usize, what: &str) -> Result<ValueType> {
    cx.t(i)
        .cloned()
        .ok_or_else(|| cx.fail(format!("{what} (input {i}) is required")))
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

/// Y's shape `[N, M, *out]` of a convolution of X `[N, C, *spatial]` by W
/// `[M, C/group, *kernel]`.
pub fn conv_shape(
    kernel: &[usize],
    window: &crate::graph::window::Window,
    group: usize,
    x: &[usize],
    w: &[usize],
) -> std::result::Result<Vec<usize>, String> {
    let (x, w) = (&window.channels_first(x)[..], &window.channels_first(w)[..]);
    if x.len() < 3 || x.len() > 5 || w.len() != x.len() {
        return Err(format!(
            "X must be [N, C, spatial...] with 1 to 3 spatial axes and W [M, C/group, kernel...] of the same rank, got X {x:?} and W {w:?}"
        ));
    }
    if !kernel.is_empty() && kernel != &w[2..] {
        return Err(format!(
            "kernel_shape {kernel:?} is not W's spatial dims {:?}",
            &w[2..]
        ));
    }
    let (c, m) = (x[1], w[0]);
    if w[1] * group != c || !m.is_multiple_of(group) || w[2..].contains(&0) {
        return Err(format!(
            "X has {c} channels and W is {w:?} with group {group}: W must be [M, C/group, kernel...] with M a multiple of group"
        ));
    }
    let placed = window.place(&x[2..], &w[2..])?;
    Ok(window.laid_out(&[vec![x[0], m], placed.out].concat()))
}
