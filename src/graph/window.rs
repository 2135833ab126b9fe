//! Sliding windows: where a convolution or pooling window reads. `Im2Col` lays every
//! window of an `[N, C, *spatial]` image out as a column (`[N, C·K, *out]`, K the window's
//! size), and `Col2Im` sums columns back into an image. Conv, ConvTranspose and the pools
//! are written on them by the ONNX importer (a MatMul over the columns, a reduction over
//! the window axis), so every backend runs them and autodiff differentiates them through
//! these two ops, each the other's gradient.

use super::op::AttrValue;

/// The permutation that moves axis 1 of a rank-`r` tensor last: `[0, 2, .., r-1, 1]`.
pub fn to_last_perm(r: usize) -> Vec<usize> {
    std::iter::once(0).chain(2..r).chain([1]).collect()
}
/// `to_last_perm`'s inverse: `[0, r-1, 1, .., r-2]`.
pub fn to_first_perm(r: usize) -> Vec<usize> {
    [0, r - 1].into_iter().chain(1..r - 1).collect()
}
/// `shape` with axis 1 moved last.
pub fn channels_last_of<T: Clone>(shape: &[T]) -> Vec<T> {
    to_last_perm(shape.len())
        .iter()
        .map(|&d| shape[d].clone())
        .collect()
}
/// `shape` with its last axis moved to 1.
pub fn channels_first_of<T: Clone>(shape: &[T]) -> Vec<T> {
    to_first_perm(shape.len())
        .iter()
        .map(|&d| shape[d].clone())
        .collect()
}

/// ONNX's `auto_pad`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AutoPad {
    /// The explicit `pads` (default).
    #[default]
    NotSet,
    /// `ceil(size / stride)` outputs, any odd padding at the end.
    SameUpper,
    /// `ceil(size / stride)` outputs, any odd padding at the beginning.
    SameLower,
    /// No padding.
    Valid,
}

impl AutoPad {
    /// Every value, in declaration order.
    pub const ALL: [AutoPad; 4] = [
        AutoPad::NotSet,
        AutoPad::SameUpper,
        AutoPad::SameLower,
        AutoPad::Valid,
    ];
    /// The value's name in the ONNX attribute (`"SAME_UPPER"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            AutoPad::NotSet => "NOTSET",
            AutoPad::SameUpper => "SAME_UPPER",
            AutoPad::SameLower => "SAME_LOWER",
            AutoPad::Valid => "VALID",
        }
    }
}

/// Strides, dilations, pads (the begin of every spatial axis, then the end of every one),
/// auto_pad and ceil_mode of a window. An empty list means ONNX's default (1s, 0s) for the
/// kernel's rank.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Window {
    /// The step between windows along each spatial axis (ONNX `strides`).
    pub strides: Vec<usize>,
    /// The spacing of the kernel's taps along each spatial axis (ONNX `dilations`).
    pub dilations: Vec<usize>,
    /// The explicit padding: every axis's begin, then every axis's end (ONNX `pads`).
    pub pads: Vec<usize>,
    /// Automatic padding, which replaces `pads` unless `NotSet`.
    pub auto_pad: AutoPad,
    /// Round the output size up rather than down, so that a last, partial window is
    /// kept (the pools' ONNX `ceil_mode`).
    pub ceil_mode: bool,
    /// Every operand of rank above 2 (X, W, Y and their gradients) is stored with its
    /// channel axis last: `[N, *spatial, C]`, and W as `[M, *kernel, C/group]`. Not an ONNX
    /// attribute: the `channels_last` layout pass writes it for backends whose kernels
    /// want that order (cuDNN's tensor-core convolutions), and a model may use it.
    pub channels_last: bool,
}

/// A window placed on an image: the output's spatial dims and the padding before and
/// after each axis. Output position `o` with kernel offset `j` reads input position
/// `o·stride + j·dilation - begin`: padding where that is outside the image, and past
/// `size + end` what ceil_mode's last windows read beyond the padding.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Placed {
    pub out: Vec<usize>,
    pub begin: Vec<usize>,
    pub end: Vec<usize>,
    pub strides: Vec<usize>,
    pub dilations: Vec<usize>,
}

impl Window {
    /// Reads `strides`, `dilations`, `pads`, `auto_pad` and (for pools) `ceil_mode` with
    /// `take(name)`, which returns the attribute if it was written.
    pub fn parse(
        mut take: impl FnMut(&str) -> Option<AttrValue>,
        ceil: bool,
    ) -> Result<Window, String> {
        let mut list = |key: &str, min: i64| -> Result<Vec<usize>, String> {
            match take(key) {
                None => Ok(vec![]),
                Some(AttrValue::Ints(v)) => v
                    .iter()
                    .map(|&x| {
                        if x >= min {
                            Ok(x as usize)
                        } else {
                            Err(format!(
                                "attribute '{key}' must hold values >= {min}, got {v:?}"
                            ))
                        }
                    })
                    .collect(),
                Some(AttrValue::Int(x)) if x >= min => Ok(vec![x as usize]),
                // An empty YAML list has no element type to tell.
                Some(AttrValue::Floats(v)) if v.is_empty() => Ok(vec![]),
                Some(v) => Err(format!(
                    "attribute '{key}' must be a list of integers >= {min}, got {v:?}"
                )),
            }
        };
        let strides = list("strides", 1)?;
        let dilations = list("dilations", 1)?;
        let pads = list("pads", 0)?;
        let auto_pad = match take("auto_pad") {
            None => AutoPad::NotSet,
            Some(AttrValue::Str(s)) => match AutoPad::ALL.iter().find(|a| a.name() == s) {
                Some(a) => *a,
                None => {
                    return Err(format!(
                        "attribute 'auto_pad' must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, got \"{s}\""
                    ))
                }
            },
            Some(v) => return Err(format!("attribute 'auto_pad' must be a string, got {v:?}")),
        };
        let ceil_mode = if ceil {
            match take("ceil_mode") {
                None | Some(AttrValue::Int(0)) => false,
                Some(AttrValue::Int(1)) => true,
                Some(v) => return Err(format!("attribute 'ceil_mode' must be 0 or 1, got {v:?}")),
            }
        } else {
            false
        };
        if !pads.is_empty() && pads.len() % 2 == 1 {
            return Err(format!(
                "attribute 'pads' must hold a begin and an end per spatial axis, got {} values",
                pads.len()
            ));
        }
        Ok(Window {
            strides,
            dilations,
            pads,
            auto_pad,
            ceil_mode,
            channels_last: false,
        })
    }

    /// The attributes as a model file writes them (defaults left out).
    pub fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let ints = |v: &[usize]| AttrValue::Ints(v.iter().map(|&x| x as i64).collect());
        let mut out = vec![];
        if !self.strides.is_empty() {
            out.push(("strides", ints(&self.strides)));
        }
        if !self.dilations.is_empty() {
            out.push(("dilations", ints(&self.dilations)));
        }
        if !self.pads.is_empty() {
            out.push(("pads", ints(&self.pads)));
        }
        if self.auto_pad != AutoPad::NotSet {
            out.push(("auto_pad", AttrValue::Str(self.auto_pad.name().into())));
        }
        if self.ceil_mode {
            out.push(("ceil_mode", AttrValue::Int(1)));
        }
        if self.channels_last {
            out.push(("channels_last", AttrValue::Int(1)));
        }
        out
    }

    /// `shape` (channels first) in this window's layout: the channel axis moved last when
    /// `channels_last`.
    pub fn laid_out<T: Clone>(&self, shape: &[T]) -> Vec<T> {
        match self.channels_last && shape.len() > 2 {
            true => channels_last_of(shape),
            false => shape.to_vec(),
        }
    }
    /// `laid_out`'s inverse: a shape in this window's layout, channels first.
    pub fn channels_first<T: Clone>(&self, shape: &[T]) -> Vec<T> {
        match self.channels_last && shape.len() > 2 {
            true => channels_first_of(shape),
            false => shape.to_vec(),
        }
    }

    /// Places the window of `kernel` on an image of spatial dims `image`.
    pub(crate) fn place(&self, image: &[usize], kernel: &[usize]) -> Result<Placed, String> {
        let r = kernel.len();
        if image.len() != r {
            return Err(format!(
                "the kernel has {r} spatial dims but the image has {} ({:?})",
                image.len(),
                image
            ));
        }
        if kernel.contains(&0) {
            return Err(format!("kernel_shape {kernel:?} has a zero dim"));
        }
        let pick = |v: &[usize], what: &str, n: usize, d: usize| -> Result<Vec<usize>, String> {
            match v.len() {
                0 => Ok(vec![d; n]),
                k if k == n => Ok(v.to_vec()),
                k => Err(format!(
                    "attribute '{what}' has {k} values; a kernel of {r} spatial dims needs {n}"
                )),
            }
        };
        let strides = pick(&self.strides, "strides", r, 1)?;
        let dilations = pick(&self.dilations, "dilations", r, 1)?;
        let pads = pick(&self.pads, "pads", 2 * r, 0)?;
        let mut out = vec![0; r];
        let mut begin = vec![0; r];
        let mut end = vec![0; r];
        for d in 0..r {
            let (s, k, st) = (image[d], kernel[d], strides[d]);
            let span = dilations[d]
                .checked_mul(k - 1)
                .and_then(|x| x.checked_add(1))
                .ok_or_else(|| "the dilated kernel's size overflows".to_string())?;
            match self.auto_pad {
                AutoPad::SameUpper | AutoPad::SameLower => {
                    let o = s.div_ceil(st);
                    let total = ((o.max(1) - 1) * st + span).saturating_sub(s);
                    begin[d] = if self.auto_pad == AutoPad::SameUpper {
                        total / 2
                    } else {
                        total - total / 2
                    };
                    end[d] = total - begin[d];
                    out[d] = o;
                }
                AutoPad::Valid | AutoPad::NotSet => {
                    let (b, e) = if self.auto_pad == AutoPad::Valid {
                        (0, 0)
                    } else {
                        (pads[d], pads[r + d])
                    };
                    let padded = s + b + e;
                    if padded < span {
                        return Err(format!(
                            "the window ({span} wide on spatial axis {d}, dilation included) is larger than the padded input ({padded})"
                        ));
                    }
                    let mut o = (padded - span) / st + 1;
                    if self.ceil_mode && (padded - span) % st != 0 {
                        o += 1;
                        // A window must start inside the input or its leading padding.
                        if (o - 1) * st >= s + b {
                            o -= 1;
                        }
                    }
                    begin[d] = b;
                    end[d] = e;
                    out[d] = o;
                }
            }
        }
        Ok(Placed {
            out,
            begin,
            end,
            strides,
            dilations,
        })
    }
}

/// `Im2Col`'s attributes as a model file writes them.
pub(super) fn im2col_attrs(
    kernel: &[usize],
    window: &Window,
    pad_value: f64,
    beyond_value: f64,
) -> Vec<(&'static str, AttrValue)> {
    let num = |v: f64| {
        if v.is_infinite() {
            AttrValue::Str(if v > 0.0 { "inf" } else { "-inf" }.into())
        } else {
            AttrValue::Float(v)
        }
    };
    let mut out = vec![];
    if !kernel.is_empty() {
        out.push((
            "kernel_shape",
            AttrValue::Ints(kernel.iter().map(|&d| d as i64).collect()),
        ));
    }
    out.extend(window.attrs());
    if pad_value != 0.0 {
        out.push(("pad_value", num(pad_value)));
    }
    if beyond_value != 0.0 {
        out.push(("beyond_value", num(beyond_value)));
    }
    out
}

/// The `[N, C·K, *out]` columns of an `[N, C, *spatial]` image `x` under `kernel`.
pub fn im2col_shape(window: &Window, x: &[usize], kernel: &[usize]) -> Result<Vec<usize>, String> {
    if x.len() < 3 {
        return Err(format!(
            "X must be [N, C, spatial...] (rank 3 or more), got rank {}",
            x.len()
        ));
    }
    let k = kernel;
    let placed = window.place(&x[2..], k)?;
    let ck = k
        .iter()
        .try_fold(x[1], |a, &d| a.checked_mul(d))
        .ok_or("the column height C·K overflows")?;
    Ok([vec![x[0], ck], placed.out].concat())
}

/// The `[N, C, *image]` image that `[N, C·K, L]` columns sum into.
pub fn col2im_shape(
    window: &Window,
    cols: &[usize],
    image: &[i64],
    block: &[usize],
) -> Result<Vec<usize>, String> {
    if cols.len() != 3 {
        return Err(format!(
            "the columns must be [N, C·K, L] (rank 3), got rank {}",
            cols.len()
        ));
    }
    let image = dims_of(image, "image_shape")?;
    let placed = window.place(&image, block)?;
    let k: usize = block.iter().product();
    if !cols[1].is_multiple_of(k) {
        return Err(format!(
            "the columns' height {} is not a multiple of the block's size {k} ({block:?})",
            cols[1]
        ));
    }
    let l: usize = placed.out.iter().product();
    if cols[2] != l {
        return Err(format!(
            "the columns hold {} blocks but the image {image:?} holds {l} ({:?}) of block {block:?}",
            cols[2], placed.out
        ));
    }
    Ok([vec![cols[0], cols[1] / k], image].concat())
}

/// Positive dims from a shape-like input.
pub fn dims_of(v: &[i64], what: &str) -> Result<Vec<usize>, String> {
    if v.is_empty() {
        return Err(format!(
            "{what} is empty: it needs one value per spatial axis"
        ));
    }
    v.iter()
        .map(|&d| {
            if d >= 1 {
                Ok(d as usize)
            } else {
                Err(format!("{what} {v:?} must hold positive values"))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(pads: &[usize], strides: &[usize], auto_pad: AutoPad, ceil_mode: bool) -> Window {
        Window {
            strides: strides.to_vec(),
            dilations: vec![],
            pads: pads.to_vec(),
            auto_pad,
            ceil_mode,
            channels_last: false,
        }
    }

    #[test]
    fn output_dims_follow_onnx() {
        // 5 wide, kernel 3, pad 1 each side, stride 2: (5 + 2 - 3) / 2 + 1 = 3.
        let p = w(&[1, 1], &[2], AutoPad::NotSet, false)
            .place(&[5], &[3])
            .unwrap();
        assert_eq!((p.out, p.begin), (vec![3], vec![1]));
        // SAME_UPPER, 5 wide, stride 2: ceil(5/2) = 3, total pad (3-1)*2+3-5 = 2 → 1 before.
        let p = w(&[], &[2], AutoPad::SameUpper, false)
            .place(&[5], &[3])
            .unwrap();
        assert_eq!((p.out, p.begin), (vec![3], vec![1]));
        // SAME_LOWER with odd total padding puts the extra one first.
        let p = w(&[], &[1], AutoPad::SameLower, false)
            .place(&[4], &[2])
            .unwrap();
        assert_eq!((p.out, p.begin), (vec![4], vec![1]));
        let p = w(&[], &[1], AutoPad::SameUpper, false)
            .place(&[4], &[2])
            .unwrap();
        assert_eq!((p.out, p.begin), (vec![4], vec![0]));
        // ceil_mode: 6 wide, kernel 3, stride 2 → floor 2, ceil 3 (the last starts at 4 < 6).
        assert_eq!(
            w(&[], &[2], AutoPad::NotSet, false)
                .place(&[6], &[3])
                .unwrap()
                .out,
            vec![2]
        );
        assert_eq!(
            w(&[], &[2], AutoPad::NotSet, true)
                .place(&[6], &[3])
                .unwrap()
                .out,
            vec![3]
        );
        // ceil_mode never starts a window in the end padding alone: 5 wide + pad 2 at the
        // end, kernel 2, stride 3: ceil((7-2)/3)+1 = 3, but the third starts at 6 >= 5.
        assert_eq!(
            w(&[0, 2], &[3], AutoPad::NotSet, true)
                .place(&[5], &[2])
                .unwrap()
                .out,
            vec![2]
        );
        assert!(w(&[], &[1], AutoPad::NotSet, false)
            .place(&[2], &[3])
            .is_err());
        assert!(w(&[1], &[1], AutoPad::NotSet, false)
            .place(&[2, 2], &[1, 1])
            .is_err());
    }
}
