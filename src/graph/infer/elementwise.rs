//! Inference of the elementwise maps: unary and binary maps, Clip, Where, the casts,
//! Identity and Trilu. Outputs keep their input's shape (broadcast for several inputs).

use super::*;

pub(super) fn infer(cx: &Cx) -> Result<Vec<ValueType>> {
    let node = cx.node;
    let x = cx.x();
    match &node.op {
        Op::Unary(u) => {
            let ok = x.dtype.is_float() || (u.takes_ints() && x.dtype.is_int());
            if !ok {
                return Err(cx.fail(format!(
                    "{} is not defined for dtype {}",
                    node.op.name(),
                    x.dtype
                )));
            }
            one(x)
        }
        Op::Binary(b) => {
            let y = cx.t(1).unwrap();
            let bool_in = x.dtype == DType::Bool;
            match b.kind() {
                BinaryKind::Pow => {
                    if !x.dtype.is_float() && !x.dtype.is_int()
                        || !y.dtype.is_float() && !y.dtype.is_int()
                    {
                        return Err(cx.fail("Pow takes numeric inputs".into()));
                    }
                }
                BinaryKind::Logic => {
                    cx.same_dtype(&x, y)?;
                    if !bool_in {
                        return Err(cx.fail(format!(
                            "{} takes bool inputs, got {}",
                            node.op.name(),
                            x.dtype
                        )));
                    }
                }
                BinaryKind::Bitwise => {
                    cx.same_dtype(&x, y)?;
                    // ONNX shifts only unsigned integers (a signed right shift would have
                    // to choose between arithmetic and logical).
                    let shift = matches!(b, BinaryOp::BitShiftLeft | BinaryOp::BitShiftRight);
                    if !x.dtype.is_int() || shift && !x.dtype.is_unsigned() {
                        let want = if shift { "unsigned integer" } else { "integer" };
                        return Err(cx.fail(format!(
                            "{} takes {want} inputs, got {}",
                            node.op.name(),
                            x.dtype
                        )));
                    }
                }
                BinaryKind::Arith | BinaryKind::Compare => {
                    cx.same_dtype(&x, y)?;
                    if bool_in && *b != BinaryOp::Equal {
                        return Err(cx.fail(format!("{} is not defined for bool", node.op.name())));
                    }
                }
            }
            let Some(shape) = broadcast(&x.shape, &y.shape) else {
                return Err(cx.fail(format!(
                    "shapes {} and {} do not broadcast",
                    fmt_shape(&x.shape),
                    fmt_shape(&y.shape)
                )));
            };
            one(ValueType {
                dtype: if b.is_comparison() {
                    DType::Bool
                } else {
                    x.dtype
                },
                shape,
            })
        }
        Op::Clip => {
            if x.dtype == DType::Bool {
                return Err(cx.fail("Clip is not defined for bool".into()));
            }
            for i in 1..3 {
                if let Some(b) = cx.t(i) {
                    cx.same_dtype(&x, b)?;
                    if b.numel() != 1 {
                        return Err(cx.fail(format!(
                            "Clip's {} must be a scalar, got shape {}",
                            if i == 1 { "min" } else { "max" },
                            fmt_shape(&b.shape)
                        )));
                    }
                }
            }
            one(x)
        }
        Op::Where => {
            let (c, a, b) = (x, cx.t(1).unwrap(), cx.t(2).unwrap());
            if c.dtype != DType::Bool {
                return Err(cx.fail(format!("condition must be bool, got {}", c.dtype)));
            }
            cx.same_dtype(a, b)?;
            let s = broadcast(&c.shape, &a.shape).and_then(|s| broadcast(&s, &b.shape));
            let Some(shape) = s else {
                return Err(cx.fail("shapes do not broadcast".into()));
            };
            one(ValueType {
                dtype: a.dtype,
                shape,
            })
        }
        Op::Cast { to } => one(ValueType {
            dtype: *to,
            shape: x.shape,
        }),
        Op::CastLike => one(ValueType {
            dtype: cx.t(1).unwrap().dtype,
            shape: x.shape,
        }),
        Op::Identity => one(x),
        Op::BitCast { to } => {
            let narrow = |d: DType| d.narrow_bits().is_some();
            if narrow(x.dtype) || narrow(*to) {
                return Err(cx.fail(format!(
                    "BitCast from {} to {to}: the 4- and 2-bit types are stored one value a byte, so their bits cannot be reinterpreted",
                    x.dtype
                )));
            }
            if *to == DType::Bool && x.dtype != DType::Bool {
                return Err(cx.fail(format!(
                    "BitCast from {} to bool: a byte other than 0 or 1 is not a boolean",
                    x.dtype
                )));
            }
            if x.dtype.size() != to.size() {
                return Err(cx.fail(format!(
                    "BitCast needs types of the same width: {} is {} bits, {to} {}",
                    x.dtype,
                    8 * x.dtype.size(),
                    8 * to.size()
                )));
            }
            one(ValueType {
                dtype: *to,
                shape: x.shape,
            })
        }
        Op::Trilu { .. } => {
            if x.shape.len() < 2 {
                return Err(cx.fail("Trilu needs rank 2 or more".into()));
            }
            if let Some(k) = cx.t(1) {
                cx.need_int(k, "k")?;
                if k.numel() != 1 {
                    return Err(cx.fail("k must be a scalar".into()));
                }
            }
            one(x)
        }
        _ => unreachable!("{} is not inferred here", node.op.name()),
    }
}
