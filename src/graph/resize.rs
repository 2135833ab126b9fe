//! Resize's sampling along one axis. ONNX Resize (and Upsample) is separable: along each
//! resized axis, output position `o` reads a few input positions with weights that depend
//! only on the axis's lengths, its scale and roi, and the attributes. `ResizeMatrix`
//! computes them on the host when the plan is made, as an `[out, in]` matrix (linear and
//! cubic) or an index vector (nearest), and the importer applies them with MatMul or
//! Gather, so every backend runs Resize and autodiff differentiates it through those ops.
//! The arithmetic follows ONNX's reference (`onnx/reference/ops/op_resize.py`) step for
//! step, in float64, so that the node suite's expected outputs are met exactly; the one
//! departure is where a rounding in the reference reads the wrong positions (`taps`).

use super::op::{AttrValue, Op};
use crate::tensor::{Bool, DType, Tensor};

/// How an output is interpolated from the input positions around it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResizeMode {
    /// The nearest input position (`mode = "nearest"`, the default).
    Nearest,
    /// Linear interpolation between the two neighbouring positions (`"linear"`).
    Linear,
    /// Cubic convolution over the four neighbouring positions (`"cubic"`).
    Cubic,
}

/// ONNX's `coordinate_transformation_mode`: where output position `o` lies in the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoordMode {
    /// `(o + 0.5) / scale - 0.5` (the default).
    HalfPixel,
    /// Half-pixel, shifted so that the sampled span is centred on the input.
    HalfPixelSymmetric,
    /// Half-pixel, except that an output of length 1 reads position 0 (PyTorch's).
    PytorchHalfPixel,
    /// `o · (in - 1) / (out - 1)`: the first and last positions of input and output
    /// coincide.
    AlignCorners,
    /// `o / scale`.
    Asymmetric,
    /// Opset 11 only: `(o + 0.5) / scale`.
    TfHalfPixelForNn,
    /// The roi's span sampled end to end; positions outside the input take
    /// extrapolation_value.
    TfCropAndResize,
}

/// ONNX's `nearest_mode`, plus `Simple`: what Upsample and Resize-10 do (ONNX Runtime's
/// "simple" mode), floor when the axis grows and ceil when it shrinks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NearestMode {
    /// Round to the nearest position, halves down (the default).
    RoundPreferFloor,
    /// Round to the nearest position, halves up.
    RoundPreferCeil,
    /// Round down.
    Floor,
    /// Round up.
    Ceil,
    /// Floor when the axis grows, ceil when it shrinks.
    Simple,
}

/// ONNX's `keep_aspect_ratio_policy` (for `sizes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AspectPolicy {
    /// Each axis resized to its size independently (the default).
    Stretch,
    /// One scale for every axis, the largest that keeps each output no larger than its
    /// size.
    NotLarger,
    /// One scale for every axis, the smallest that keeps each output no smaller than its
    /// size.
    NotSmaller,
}

macro_rules! named {
    ($t:ident, $what:literal, $($v:ident = $n:literal),+) => {
        impl $t {
            /// Every value, in declaration order.
            pub const ALL: &'static [$t] = &[$($t::$v),+];
            /// The value's name in the ONNX attribute.
            pub fn name(self) -> &'static str {
                match self { $($t::$v => $n),+ }
            }
            fn parse(key: &str, v: Option<AttrValue>, default: $t) -> Result<$t, String> {
                match v {
                    None => Ok(default),
                    Some(AttrValue::Str(s)) => $t::ALL
                        .iter()
                        .copied()
                        .find(|m| m.name() == s)
                        .ok_or_else(|| {
                            let names: Vec<&str> = $t::ALL.iter().map(|m| m.name()).collect();
                            format!("attribute '{key}' must be one of {}; got \"{s}\"", names.join(", "))
                        }),
                    Some(v) => Err(format!("attribute '{key}' must be a string ({}), got {v:?}", $what)),
                }
            }
        }
    };
}

named!(
    ResizeMode,
    "the mode",
    Nearest = "nearest",
    Linear = "linear",
    Cubic = "cubic"
);
named!(
    CoordMode,
    "the coordinate transformation",
    HalfPixel = "half_pixel",
    HalfPixelSymmetric = "half_pixel_symmetric",
    PytorchHalfPixel = "pytorch_half_pixel",
    AlignCorners = "align_corners",
    Asymmetric = "asymmetric",
    TfHalfPixelForNn = "tf_half_pixel_for_nn",
    TfCropAndResize = "tf_crop_and_resize"
);
named!(
    NearestMode,
    "the rounding",
    RoundPreferFloor = "round_prefer_floor",
    RoundPreferCeil = "round_prefer_ceil",
    Floor = "floor",
    Ceil = "ceil",
    Simple = "simple"
);
named!(
    AspectPolicy,
    "the policy",
    Stretch = "stretch",
    NotLarger = "not_larger",
    NotSmaller = "not_smaller"
);

/// Resize's interpolation attributes (ONNX's names and defaults). `extrapolation_value` is
/// not here: the importer applies it after the product (`ResizeMatrix`'s mask output).
#[derive(Clone, Debug, PartialEq)]
pub struct Resize {
    /// How outputs are interpolated (ONNX `mode`).
    pub mode: ResizeMode,
    /// Where an output position lies in the input (ONNX
    /// `coordinate_transformation_mode`).
    pub coord: CoordMode,
    /// How the nearest mode rounds a position (ONNX `nearest_mode`).
    pub nearest: NearestMode,
    /// The cubic kernel's coefficient `a` (ONNX `cubic_coeff_a`, default -0.75).
    pub cubic_coeff_a: f64,
    /// Give input positions outside the input weight 0 and renormalize the rest (ONNX
    /// `exclude_outside`).
    pub exclude_outside: bool,
    /// When shrinking, widen the linear or cubic filter by the inverse of the scale (ONNX
    /// `antialias`).
    pub antialias: bool,
    /// How `sizes` treats the aspect ratio (ONNX `keep_aspect_ratio_policy`).
    pub policy: AspectPolicy,
}

impl Default for Resize {
    fn default() -> Self {
        Resize {
            mode: ResizeMode::Nearest,
            coord: CoordMode::HalfPixel,
            nearest: NearestMode::RoundPreferFloor,
            cubic_coeff_a: -0.75,
            exclude_outside: false,
            antialias: false,
            policy: AspectPolicy::Stretch,
        }
    }
}

impl Resize {
    /// Reads mode, coordinate_transformation_mode, nearest_mode, cubic_coeff_a,
    /// exclude_outside, antialias and keep_aspect_ratio_policy with `take(name)`, which
    /// returns the attribute if it was written.
    pub fn parse(mut take: impl FnMut(&str) -> Option<AttrValue>) -> Result<Resize, String> {
        let d = Resize::default();
        let mut flag = |key: &str| match take(key) {
            None | Some(AttrValue::Int(0)) => Ok(false),
            Some(AttrValue::Int(1)) => Ok(true),
            Some(v) => Err(format!("attribute '{key}' must be 0 or 1, got {v:?}")),
        };
        let exclude_outside = flag("exclude_outside")?;
        let antialias = flag("antialias")?;
        let r = Resize {
            mode: ResizeMode::parse("mode", take("mode"), d.mode)?,
            coord: CoordMode::parse(
                "coordinate_transformation_mode",
                take("coordinate_transformation_mode"),
                d.coord,
            )?,
            nearest: NearestMode::parse("nearest_mode", take("nearest_mode"), d.nearest)?,
            cubic_coeff_a: match take("cubic_coeff_a") {
                None => d.cubic_coeff_a,
                Some(AttrValue::Float(v)) => v,
                Some(AttrValue::Int(v)) => v as f64,
                Some(v) => {
                    return Err(format!(
                        "attribute 'cubic_coeff_a' must be a float, got {v:?}"
                    ))
                }
            },
            exclude_outside,
            antialias,
            policy: AspectPolicy::parse(
                "keep_aspect_ratio_policy",
                take("keep_aspect_ratio_policy"),
                d.policy,
            )?,
        };
        if r.antialias && r.mode == ResizeMode::Nearest {
            return Err("antialias applies to modes linear and cubic, not nearest".into());
        }
        Ok(r)
    }

    /// The attributes that differ from the defaults, as a model file writes them.
    pub fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let d = Resize::default();
        let s = |x: &str| AttrValue::Str(x.into());
        let mut v = vec![];
        if self.mode != d.mode {
            v.push(("mode", s(self.mode.name())));
        }
        if self.coord != d.coord {
            v.push(("coordinate_transformation_mode", s(self.coord.name())));
        }
        if self.nearest != d.nearest {
            v.push(("nearest_mode", s(self.nearest.name())));
        }
        if self.cubic_coeff_a != d.cubic_coeff_a {
            v.push(("cubic_coeff_a", AttrValue::Float(self.cubic_coeff_a)));
        }
        if self.exclude_outside {
            v.push(("exclude_outside", AttrValue::Int(1)));
        }
        if self.antialias {
            v.push(("antialias", AttrValue::Int(1)));
        }
        if self.policy != d.policy {
            v.push(("keep_aspect_ratio_policy", s(self.policy.name())));
        }
        v
    }
}

/// One axis's resampling: its input and output lengths, the scale its coordinates use (a
/// fraction of the output length for `scales`, `sizes / in` or the aspect-kept one for
/// `sizes`), and its roi (start, end) when one is given.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AxisGeom {
    pub input: usize,
    pub output: usize,
    pub scale: f64,
    pub roi: Option<(f64, f64)>,
}

impl AxisGeom {
    /// Whether the axis is left as it is: ONNX's reference skips such an axis (scale
    /// close to 1 by `math.isclose`, the same length, and a roi of [0, 1] if any).
    pub fn identity(&self) -> bool {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
        close(self.scale, 1.0)
            && self.output == self.input
            && self.roi.is_none_or(|(s, e)| close(s, 0.0) && close(e, 1.0))
    }
}

/// Every axis's geometry for X of `shape`, from the values of roi, scales and sizes
/// (exactly one of the last two, non-empty), which name the axes `axes` in order.
pub(crate) fn geometry(
    r: &Resize,
    shape: &[usize],
    axes: &[usize],
    roi: Option<&[f64]>,
    scales: Option<&[f64]>,
    sizes: Option<&[i64]>,
) -> Result<Vec<AxisGeom>, String> {
    let rank = shape.len();
    if let Some(&a) = axes.iter().find(|&&a| a >= rank) {
        return Err(format!("axis {a} is out of range for X of rank {rank}"));
    }
    let k = axes.len();
    let mut g: Vec<AxisGeom> = shape
        .iter()
        .map(|&d| AxisGeom {
            input: d,
            output: d,
            scale: 1.0,
            roi: None,
        })
        .collect();
    // An empty roi is no roi (ONNX passes one where the mode does not read it).
    if let Some(roi) = roi.filter(|v| !v.is_empty()) {
        if roi.len() != 2 * k {
            return Err(format!(
                "roi holds {} values; it needs {} (a start and an end for each of the {k} axes)",
                roi.len(),
                2 * k
            ));
        }
        for (i, &a) in axes.iter().enumerate() {
            g[a].roi = Some((roi[i], roi[k + i]));
        }
    }
    match (scales, sizes) {
        (Some(s), None) => {
            if s.len() != k {
                return Err(format!(
                    "scales holds {} values, one per axis needs {k}",
                    s.len()
                ));
            }
            for (&a, &s) in axes.iter().zip(s) {
                if !(s > 0.0 && s.is_finite()) {
                    return Err(format!("scales must be positive and finite, got {s}"));
                }
                g[a].scale = s;
                // floor(in · scale), as the reference's astype(int).
                let out = (s * g[a].input as f64).floor();
                if out > (1u64 << 40) as f64 {
                    return Err(format!("scale {s} makes axis {a} too long"));
                }
                g[a].output = out as usize;
            }
        }
        (None, Some(sz)) => {
            if sz.len() != k {
                return Err(format!(
                    "sizes holds {} values, one per axis needs {k}",
                    sz.len()
                ));
            }
            if let Some(&v) = sz.iter().find(|&&v| v < 0) {
                return Err(format!("sizes must not be negative, got {v}"));
            }
            for (&a, &n) in axes.iter().zip(sz) {
                if g[a].input == 0 && n != 0 {
                    return Err(format!("axis {a} is empty; it cannot be resized to {n}"));
                }
            }
            let ratio = |a: usize, n: i64| {
                if g[a].input == 0 {
                    1.0
                } else {
                    n as f64 / g[a].input as f64
                }
            };
            let ratios: Vec<f64> = axes.iter().zip(sz).map(|(&a, &n)| ratio(a, n)).collect();
            let common = match r.policy {
                AspectPolicy::Stretch => None,
                AspectPolicy::NotLarger => ratios.iter().copied().reduce(f64::min),
                AspectPolicy::NotSmaller => ratios.iter().copied().reduce(f64::max),
            };
            for ((&a, &n), &q) in axes.iter().zip(sz).zip(&ratios) {
                match common {
                    None => {
                        g[a].scale = q;
                        g[a].output = n as usize;
                    }
                    Some(s) => {
                        g[a].scale = s;
                        // round_int, halves up: the reference's int(x + 0.5).
                        g[a].output = (s * g[a].input as f64 + 0.5).floor() as usize;
                    }
                }
            }
        }
        _ => return Err("exactly one of scales and sizes must be given (non-empty)".into()),
    }
    Ok(g)
}

/// The filter weights at distance `ratio` (in (0, 1]) past the input position below,
/// for the positions `start..` the window covers relative to it: ONNX's `_*_coeffs`.
fn coeffs(r: &Resize, ratio: f64, scale: f64) -> Vec<f64> {
    match r.mode {
        ResizeMode::Nearest => {
            if ratio == ratio.trunc() {
                return vec![0.0, 1.0];
            }
            let up = match r.nearest {
                NearestMode::RoundPreferFloor => ratio > 0.5,
                NearestMode::RoundPreferCeil => ratio >= 0.5,
                NearestMode::Floor => false,
                NearestMode::Ceil => true,
                NearestMode::Simple => scale < 1.0,
            };
            if up {
                vec![0.0, 1.0]
            } else {
                vec![1.0, 0.0]
            }
        }
        ResizeMode::Linear if r.antialias => {
            let scale = scale.min(1.0);
            let start = (-1.0 / scale).floor() as i64 + 1;
            let footprint = 2 - 2 * start;
            let c: Vec<f64> = (start..start + footprint)
                .map(|i| (1.0 - ((i as f64 - ratio) * scale).abs()).clamp(0.0, 1.0))
                .collect();
            let sum: f64 = c.iter().sum();
            c.iter().map(|v| v / sum).collect()
        }
        ResizeMode::Linear => vec![1.0 - ratio, ratio],
        ResizeMode::Cubic if r.antialias => {
            let a = r.cubic_coeff_a;
            let scale = scale.min(1.0);
            let kernel = |x: f64| {
                let x = x.abs();
                let (x2, x3) = (x * x, x * x * x);
                if x <= 1.0 {
                    (a + 2.0) * x3 - (a + 3.0) * x2 + 1.0
                } else if x < 2.0 {
                    a * x3 - 5.0 * a * x2 + 8.0 * a * x - 4.0 * a
                } else {
                    0.0
                }
            };
            let start = (-2.0 / scale).floor() as i64 + 1;
            let c: Vec<f64> = (start..2 - start)
                .map(|i| kernel(scale * (i as f64 - ratio)))
                .collect();
            let sum: f64 = c.iter().sum();
            c.iter().map(|v| v / sum).collect()
        }
        ResizeMode::Cubic => {
            let a = r.cubic_coeff_a;
            let s = 1.0 - ratio;
            let (p, q) = (ratio + 1.0, s + 1.0);
            vec![
                ((a * p - 5.0 * a) * p + 8.0 * a) * p - 4.0 * a,
                ((a + 2.0) * ratio - (a + 3.0)) * ratio * ratio + 1.0,
                ((a + 2.0) * s - (a + 3.0)) * s * s + 1.0,
                ((a * q - 5.0 * a) * q + 8.0 * a) * q - 4.0 * a,
            ]
        }
    }
}

/// What one output position reads: (input position, weight) pairs, and whether it lies
/// outside the roi (tf_crop_and_resize: it takes extrapolation_value instead).
pub(crate) type Taps = (Vec<(usize, f64)>, bool);

/// The taps of every output position along one axis: ONNX's `_compute_x_ori` and
/// `_interpolate_1d_along_axis`, input positions past either end read the edge.
pub(crate) fn taps(r: &Resize, g: &AxisGeom) -> Result<Vec<Taps>, String> {
    if g.identity() {
        return Ok((0..g.input).map(|i| (vec![(i, 1.0)], false)).collect());
    }
    if g.output > 0 && g.input == 0 {
        return Err("an empty axis cannot be resized to a non-empty one".into());
    }
    let (input, scale) = (g.input as f64, g.scale);
    // The fractional output length the scale asks for, and the whole one.
    let width = scale * input;
    let width_int = g.output as f64;
    let mut out = Vec::with_capacity(g.output);
    for y in 0..g.output {
        let y = y as f64;
        let mut outside = false;
        let x = match r.coord {
            CoordMode::AlignCorners if width == 1.0 => 0.0,
            CoordMode::AlignCorners => y * (input - 1.0) / (width - 1.0),
            CoordMode::Asymmetric => y / scale,
            CoordMode::TfHalfPixelForNn => (y + 0.5) / scale,
            CoordMode::TfCropAndResize => {
                let Some((s, e)) = g.roi else {
                    return Err(
                        "coordinate_transformation_mode tf_crop_and_resize needs roi".into(),
                    );
                };
                let x = if width == 1.0 {
                    (e - s) * (input - 1.0) / 2.0
                } else {
                    y * (e - s) * (input - 1.0) / (width - 1.0)
                };
                let x = x + s * (input - 1.0);
                outside = x < 0.0 || x > input - 1.0;
                x
            }
            CoordMode::PytorchHalfPixel if width == 1.0 => -0.5,
            CoordMode::PytorchHalfPixel | CoordMode::HalfPixel => (y + 0.5) / scale - 0.5,
            CoordMode::HalfPixelSymmetric => {
                let adjustment = width_int / width;
                let offset = input / 2.0 * (1.0 - adjustment);
                offset + (y + 0.5) / scale - 0.5
            }
        };
        if !x.is_finite() {
            return Err(format!("output position {y} maps to input coordinate {x}"));
        }
        // ratio in (0, 1]: an integral coordinate counts as 1 past the position below.
        let floor = x.floor();
        let ratio = if x == floor { 1.0 } else { x - floor };
        let mut c = coeffs(r, ratio, scale);
        // The n positions nearest x, ties to the lower (n is even for every filter):
        // coefficient j weighs position `x - ratio - (n/2 - 1) + j`. ONNX's reference
        // finds them from x shifted by its edge padding, where a rounding can move an x
        // just past an integer back onto it and the window one position down from the
        // coefficients (an x of 1 + 2e-16 then reads positions 0 and 1 with weights for 1
        // and 2); the window is taken from x itself here, which agrees with it everywhere
        // else.
        let n = c.len() as i64;
        let left = if x == floor { floor - 1.0 } else { floor };
        let start = left as i64 - (n / 2 - 1);
        let last = g.input as i64 - 1;
        if r.exclude_outside {
            for (j, w) in c.iter_mut().enumerate() {
                let i = start + j as i64;
                if i < 0 || i > last {
                    *w = 0.0;
                }
            }
            let sum: f64 = c.iter().sum();
            let sum = if sum == 0.0 { 1.0 } else { sum };
            c.iter_mut().for_each(|w| *w /= sum);
        }
        let reads = c
            .iter()
            .enumerate()
            .map(|(j, &w)| ((start + j as i64).clamp(0, last) as usize, w))
            .collect();
        out.push((reads, outside));
    }
    Ok(out)
}

/// A plan-time input, unless omitted or empty (ONNX passes an empty roi or scales where
/// the node does not use them).
fn given(t: Option<&Tensor>) -> Option<&Tensor> {
    t.filter(|t| t.numel() > 0)
}

/// `ResizeMatrix`'s outputs for X of `dtype` and `shape` and the values of its other
/// inputs: for linear and cubic the `[out, in]` weights in X's dtype, for nearest the i64
/// input position each output reads; and the bool `[out]` mask of the positions that take
/// a fill value instead (tf_crop_and_resize's outside, or a nearest read that
/// exclude_outside removed, which reads 0).
pub fn eval(
    op: &Op,
    dtype: DType,
    shape: &[usize],
    roi: Option<&Tensor>,
    scales: Option<&Tensor>,
    sizes: Option<&Tensor>,
) -> Result<Vec<Tensor>, String> {
    let Op::ResizeMatrix { resize, axes, axis } = op else {
        return Err(format!("{} is not ResizeMatrix", op.name()));
    };
    if resize.mode != ResizeMode::Nearest && !dtype.is_float() {
        return Err(format!(
            "mode {} needs a floating X, got {dtype} (integer X resizes with mode nearest)",
            resize.mode.name()
        ));
    }
    if *axis >= shape.len() {
        return Err(format!(
            "axis {axis} is out of range for X of rank {}",
            shape.len()
        ));
    }
    for (what, t) in [("roi", roi), ("scales", scales)] {
        if let Some(t) = t.filter(|t| !t.dtype().is_float()) {
            return Err(format!(
                "{what} must be a floating tensor, got {}",
                t.dtype()
            ));
        }
    }
    if let Some(t) = sizes.filter(|t| !t.dtype().is_int()) {
        return Err(format!("sizes must be i64, got {}", t.dtype()));
    }
    let roi = given(roi).map(Tensor::to_f64_vec);
    let scales = given(scales).map(Tensor::to_f64_vec);
    let sizes = given(sizes).map(Tensor::to_i64_vec);
    let geom = geometry(
        resize,
        shape,
        axes,
        roi.as_deref(),
        scales.as_deref(),
        sizes.as_deref(),
    )?;
    let g = geom[*axis];
    let taps = taps(resize, &g)?;
    let n = taps.len();
    let mut mask: Vec<bool> = taps.iter().map(|(_, outside)| *outside).collect();
    let weights = if resize.mode == ResizeMode::Nearest {
        let mut idx = vec![0i64; n];
        for (o, (reads, _)) in taps.iter().enumerate() {
            // One read has weight 1; none does where exclude_outside removed it.
            match reads.iter().find(|(_, w)| *w != 0.0) {
                Some(&(i, _)) => idx[o] = i as i64,
                None => mask[o] = true,
            }
        }
        Tensor::from_vec(&[n], idx)
    } else {
        let mut w = vec![0f64; n * g.input];
        for (o, (reads, _)) in taps.iter().enumerate() {
            for &(i, c) in reads {
                w[o * g.input + i] += c;
            }
        }
        Tensor::from_vec(&[n, g.input], w).map(|t| t.cast(dtype))
    }
    .map_err(|e| e.to_string())?;
    let mask: Vec<Bool> = mask.into_iter().map(Bool::from).collect();
    let mask = Tensor::from_vec(&[n], mask).map_err(|e| e.to_string())?;
    Ok(vec![weights, mask])
}
