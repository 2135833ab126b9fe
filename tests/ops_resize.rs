//! Resize (opsets 10, 11, 19) and Upsample (7, 9) imported from one-node ONNX models, roi,
//! scales and sizes fed at run time, on every backend in f32 and (where the backend
//! computes it) f64, against a float64 reference written here from ONNX's definitions:
//! every mode, coordinate transformation and nearest rounding, up- and down-scaling,
//! scales and sizes, axes, keep_aspect_ratio_policy, antialias, exclude_outside,
//! tf_crop_and_resize with roi and extrapolation, one to three resized axes of 3-D to 5-D
//! tensors, integer X; gradients with respect to X against central finite differences.

mod common;
#[path = "common/onnx_case.rs"]
mod onnx_case;
#[path = "common/onnx_model.rs"]
mod onnx_model;

use common::*;
use graphrun::onnx::proto::AttributeProto;
use graphrun::{DType, Op, Session, SessionOptions, Tensor};
use onnx_case::*;
use onnx_model::*;

/// One Resize or Upsample node: its attributes ("" / None: not written) and inputs.
#[derive(Clone, Debug)]
struct R {
    op: &'static str,
    opset: i64,
    mode: &'static str,
    coord: &'static str,
    nearest: &'static str,
    cubic_a: Option<f32>,
    exclude: bool,
    antialias: bool,
    axes: Option<Vec<i64>>,
    policy: &'static str,
    extrapolation: Option<f32>,
    x: Vec<usize>,
    /// X's dtype when an integer one (else the run's float dtype).
    int_x: Option<DType>,
    roi: Option<Vec<f32>>,
    scales: Option<Vec<f32>>,
    sizes: Option<Vec<i64>>,
}

/// Resize-19 of X `x` by `scales`, with the defaults.
fn by_scales(mode: &'static str, x: &[usize], scales: &[f32]) -> R {
    R {
        op: "Resize",
        opset: 19,
        mode,
        coord: "",
        nearest: "",
        cubic_a: None,
        exclude: false,
        antialias: false,
        axes: None,
        policy: "",
        extrapolation: None,
        x: x.to_vec(),
        int_x: None,
        roi: None,
        scales: Some(scales.to_vec()),
        sizes: None,
    }
}

/// Resize-19 of X `x` to `sizes`.
fn by_sizes(mode: &'static str, x: &[usize], sizes: &[i64]) -> R {
    R {
        scales: None,
        sizes: Some(sizes.to_vec()),
        ..by_scales(mode, x, &[])
    }
}

impl R {
    fn coord(self, coord: &'static str) -> R {
        R { coord, ..self }
    }
    fn nearest(self, nearest: &'static str) -> R {
        R { nearest, ..self }
    }
    fn axes(self, axes: &[i64]) -> R {
        R {
            axes: Some(axes.to_vec()),
            ..self
        }
    }

    /// Whether this form takes roi, scales and sizes (Resize from opset 11), else X and
    /// scales (Resize-10, Upsample-9) or X alone (Upsample-7, scales an attribute).
    fn full(&self) -> bool {
        self.op == "Resize" && self.opset >= 11
    }

    fn case(&self) -> Case {
        let x = match self.int_x {
            Some(dt) => rand_ints(&self.x, 3, -50, 50).cast(dt),
            None => randn(&self.x, 3),
        };
        let f32s = |v: &[f32]| Tensor::from_vec(&[v.len()], v.to_vec()).unwrap();
        let mut ins: Vec<(&'static str, Option<Tensor>)> = vec![("x", Some(x))];
        let mut attrs: Vec<AttributeProto> = vec![];
        if self.full() {
            let opt = |name, t: Option<Tensor>| match t {
                Some(t) => (name, Some(t)),
                None => ("", None),
            };
            ins.push(opt("roi", self.roi.as_deref().map(f32s)));
            ins.push(opt("scales", self.scales.as_deref().map(f32s)));
            if let Some(s) = &self.sizes {
                ins.push(("sizes", Some(i64s(&[s.len()], s))));
            }
        } else if self.op == "Upsample" && self.opset < 9 {
            let s: Vec<f32> = self.scales.clone().unwrap();
            attrs.push(AttributeProto {
                name: "scales".into(),
                r#type: graphrun::onnx::proto::attr_type::FLOATS,
                floats: s,
                ..Default::default()
            });
        } else {
            ins.push(("scales", Some(f32s(self.scales.as_deref().unwrap()))));
        }
        attrs.push(str_attr("mode", self.mode));
        let strs = [
            ("coordinate_transformation_mode", self.coord),
            ("nearest_mode", self.nearest),
            ("keep_aspect_ratio_policy", self.policy),
        ];
        for (k, v) in strs {
            if !v.is_empty() {
                attrs.push(str_attr(k, v));
            }
        }
        if let Some(a) = self.cubic_a {
            attrs.push(float_attr("cubic_coeff_a", a));
        }
        if let Some(e) = self.extrapolation {
            attrs.push(float_attr("extrapolation_value", e));
        }
        if self.exclude {
            attrs.push(int_attr("exclude_outside", 1));
        }
        if self.antialias {
            attrs.push(int_attr("antialias", 1));
        }
        if let Some(a) = &self.axes {
            attrs.push(ints_attr("axes", a));
        }
        Case::new(self.op, self.opset, ins).with(attrs)
    }

    /// The values of input `name` among the case's inputs as fed (`v`), when given.
    fn fed<'a>(&self, v: &'a [Vec<f64>], name: &str) -> Option<&'a [f64]> {
        let k = self.case().inputs.iter().position(|(n, _)| *n == name)?;
        Some(&v[k]).filter(|v| !v.is_empty()).map(|v| v.as_slice())
    }

    /// Resize by its definition, one resized axis after another (in `axes` order).
    fn reference(&self) -> impl Fn(&[Vec<f64>]) -> Expected + '_ {
        move |v: &[Vec<f64>]| {
            let r = self.x.len();
            let axes: Vec<usize> = match &self.axes {
                None => (0..r).collect(),
                Some(a) => a
                    .iter()
                    .map(|&d| if d < 0 { d + r as i64 } else { d } as usize)
                    .collect(),
            };
            let k = axes.len();
            let mut scale = vec![1.0; r];
            let mut out = self.x.clone();
            let mut roi: Vec<Option<(f64, f64)>> = vec![None; r];
            if let Some(rv) = self.fed(v, "roi") {
                for (i, &a) in axes.iter().enumerate() {
                    roi[a] = Some((rv[i], rv[k + i]));
                }
            }
            let scales: Option<Vec<f64>> = match self.fed(v, "scales") {
                Some(s) => Some(s.to_vec()),
                // Upsample-7's attribute.
                None if self.sizes.is_none() => Some(
                    self.scales
                        .as_ref()
                        .unwrap()
                        .iter()
                        .map(|&s| s as f64)
                        .collect(),
                ),
                None => None,
            };
            if let Some(s) = scales {
                for (i, &a) in axes.iter().enumerate() {
                    scale[a] = s[i];
                    out[a] = (s[i] * self.x[a] as f64).floor() as usize;
                }
            } else {
                let sz = self.sizes.as_ref().unwrap();
                let ratio: Vec<f64> = axes
                    .iter()
                    .zip(sz)
                    .map(|(&a, &n)| n as f64 / self.x[a] as f64)
                    .collect();
                let keep = match self.policy {
                    "not_larger" => Some(ratio.iter().copied().fold(f64::INFINITY, f64::min)),
                    "not_smaller" => Some(ratio.iter().copied().fold(0.0, f64::max)),
                    _ => None,
                };
                for (i, &a) in axes.iter().enumerate() {
                    match keep {
                        None => (scale[a], out[a]) = (ratio[i], sz[i] as usize),
                        Some(s) => {
                            // Halves round up.
                            (scale[a], out[a]) = (s, (s * self.x[a] as f64 + 0.5).floor() as usize)
                        }
                    }
                }
            }
            let mut data = v[0].clone();
            let mut shape = self.x.clone();
            for &a in &axes {
                let unit = |(s, e): (f64, f64)| s == 0.0 && e == 1.0;
                let same = (scale[a] - 1.0).abs() <= 1e-9 && out[a] == shape[a];
                if same && roi[a].is_none_or(unit) {
                    continue;
                }
                data = self.along(&data, &shape, a, out[a], scale[a], roi[a]);
                shape[a] = out[a];
            }
            vec![(shape, data)]
        }
    }

    /// Resamples `data` (of `shape`) along `axis` to `len` positions.
    fn along(
        &self,
        data: &[f64],
        shape: &[usize],
        axis: usize,
        len: usize,
        scale: f64,
        roi: Option<(f64, f64)>,
    ) -> Vec<f64> {
        let n = shape[axis];
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis + 1..].iter().product();
        let extrapolation = self.extrapolation.unwrap_or(0.0) as f64;
        let mut y = vec![0.0; outer * len * inner];
        for o in 0..len {
            let reads = self.reads(n, len, scale, roi, o);
            for b in 0..outer {
                for i in 0..inner {
                    y[(b * len + o) * inner + i] = match &reads {
                        None => extrapolation,
                        Some(w) => w
                            .iter()
                            .map(|&(p, c)| c * data[(b * n + p) * inner + i])
                            .sum(),
                    };
                }
            }
        }
        y
    }

    /// What output position `o` of an axis of `n` resampled to `len` reads: (input
    /// position, weight) pairs, or None where tf_crop_and_resize extrapolates.
    fn reads(
        &self,
        n: usize,
        len: usize,
        scale: f64,
        roi: Option<(f64, f64)>,
        o: usize,
    ) -> Option<Vec<(usize, f64)>> {
        let (nf, y) = (n as f64, o as f64);
        // The output length the scale asks for (fractional with scales).
        let width = scale * nf;
        let old = !self.full();
        let coord = match self.coord {
            _ if old => "asymmetric",
            "" => "half_pixel",
            c => c,
        };
        let x = match coord {
            "half_pixel" => (y + 0.5) / scale - 0.5,
            "half_pixel_symmetric" => {
                let adjustment = len as f64 / width;
                nf / 2.0 * (1.0 - adjustment) + (y + 0.5) / scale - 0.5
            }
            // ONNX's reference takes -0.5 for a one-element output.
            "pytorch_half_pixel" if width == 1.0 => -0.5,
            "pytorch_half_pixel" => (y + 0.5) / scale - 0.5,
            "align_corners" if width == 1.0 => 0.0,
            "align_corners" => y * (nf - 1.0) / (width - 1.0),
            "asymmetric" => y / scale,
            "tf_half_pixel_for_nn" => (y + 0.5) / scale,
            "tf_crop_and_resize" => {
                let (s, e) = roi.unwrap();
                let x = if width == 1.0 {
                    (e - s) * (nf - 1.0) / 2.0
                } else {
                    y * (e - s) * (nf - 1.0) / (width - 1.0)
                } + s * (nf - 1.0);
                if x < 0.0 || x > nf - 1.0 {
                    return None;
                }
                x
            }
            c => panic!("coordinate mode {c}"),
        };
        let cubic = |d: f64| {
            let a = self.cubic_a.unwrap_or(-0.75) as f64;
            let d = d.abs();
            if d <= 1.0 {
                (a + 2.0) * d.powi(3) - (a + 3.0) * d * d + 1.0
            } else if d < 2.0 {
                a * d.powi(3) - 5.0 * a * d * d + 8.0 * a * d - 4.0 * a
            } else {
                0.0
            }
        };
        let tent = |d: f64| (1.0 - d.abs()).max(0.0);
        // The filter (of the distance from x) and its number of taps; antialias stretches
        // it by 1 / scale when shrinking.
        let s = if self.antialias { scale.min(1.0) } else { 1.0 };
        let (taps, weight): (usize, Box<dyn Fn(f64) -> f64>) = match self.mode {
            "nearest" => (1, Box::new(|_| 1.0)),
            "linear" => {
                let start = (-1.0 / s).floor() as i64 + 1;
                ((2 - 2 * start) as usize, Box::new(move |d| tent(d * s)))
            }
            "cubic" => {
                let start = (-2.0 / s).floor() as i64 + 1;
                ((2 - 2 * start) as usize, Box::new(move |d| cubic(d * s)))
            }
            m => panic!("mode {m}"),
        };
        let mut pos: Vec<i64> = if self.mode == "nearest" {
            // Halfway (and, as ONNX's reference has it, any integral x) by the rounding.
            let (f, frac) = (x.floor(), x - x.floor());
            let mode = match self.nearest {
                _ if old => {
                    if scale < 1.0 {
                        "ceil"
                    } else {
                        "floor"
                    }
                }
                "" => "round_prefer_floor",
                m => m,
            };
            let up = frac != 0.0
                && match mode {
                    "round_prefer_floor" => frac > 0.5,
                    "round_prefer_ceil" => frac >= 0.5,
                    "floor" => false,
                    "ceil" => true,
                    m => panic!("nearest mode {m}"),
                };
            vec![f as i64 + up as i64]
        } else {
            // The `taps` positions nearest x, the lower of two equally near.
            let c = x.floor() as i64;
            let mut cand: Vec<i64> = (c - taps as i64..=c + taps as i64 + 1).collect();
            cand.sort_by(|&a, &b| {
                let (da, db) = ((a as f64 - x).abs(), (b as f64 - x).abs());
                da.partial_cmp(&db).unwrap().then(a.cmp(&b))
            });
            cand.truncate(taps);
            cand
        };
        pos.sort();
        let mut w: Vec<f64> = pos.iter().map(|&p| weight(p as f64 - x)).collect();
        if self.exclude {
            for (c, &p) in w.iter_mut().zip(&pos) {
                if p < 0 || p >= n as i64 {
                    *c = 0.0;
                }
            }
        }
        if self.antialias || self.exclude {
            let sum: f64 = w.iter().sum();
            w.iter_mut().for_each(|c| *c /= sum);
        }
        // Positions past either end read the edge.
        Some(
            pos.iter()
                .zip(w)
                .map(|(&p, c)| (p.clamp(0, n as i64 - 1) as usize, c))
                .collect(),
        )
    }
}

fn check_resize(what: &str, r: &R) {
    let what = format!("{what}: {r:?}");
    check_case(&what, &r.case(), &BOTH, 1e-5, r.reference());
}

const COORDS: [&str; 5] = [
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
];

#[test]
fn nearest_every_coordinate_mode_and_rounding() {
    let roundings = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"];
    for (k, coord) in COORDS.iter().enumerate() {
        for (j, nearest) in roundings.iter().enumerate() {
            // Growing and shrinking, by scales and by sizes, in turn.
            let r = match (k + j) % 4 {
                0 => by_scales("nearest", &[1, 2, 3, 4], &[1.0, 1.0, 2.0, 1.5]),
                1 => by_scales("nearest", &[1, 2, 5, 7], &[1.0, 1.0, 0.6, 0.5]),
                2 => by_sizes("nearest", &[2, 1, 3, 5], &[2, 1, 7, 3]),
                _ => by_sizes("nearest", &[1, 1, 6, 4], &[1, 1, 4, 9]),
            };
            check_resize("nearest", &r.coord(coord).nearest(nearest));
        }
    }
    // Opset 11's tf_half_pixel_for_nn.
    let r = R {
        opset: 11,
        ..by_scales("nearest", &[1, 2, 4, 5], &[1.0, 1.0, 1.5, 0.6])
    };
    check_resize("nearest", &r.coord("tf_half_pixel_for_nn"));
}

#[test]
fn linear_every_coordinate_mode() {
    for coord in COORDS {
        check_resize(
            "linear up",
            &by_scales("linear", &[1, 2, 3, 4], &[1.0, 1.0, 2.0, 1.5]).coord(coord),
        );
        check_resize(
            "linear down",
            &by_scales("linear", &[2, 1, 6, 7], &[1.0, 1.0, 0.5, 0.6]).coord(coord),
        );
        check_resize(
            "linear sizes",
            &by_sizes("linear", &[1, 2, 4, 5], &[1, 2, 7, 3]).coord(coord),
        );
    }
}

#[test]
fn cubic_every_coordinate_mode_a_and_exclude_outside() {
    for (k, coord) in COORDS.iter().enumerate() {
        for exclude in [false, true] {
            for a in [None, Some(-0.5)] {
                let base = if k % 2 == 0 {
                    by_scales("cubic", &[1, 1, 4, 5], &[1.0, 1.0, 1.75, 0.8])
                } else {
                    by_sizes("cubic", &[1, 2, 6, 4], &[1, 2, 3, 9])
                };
                let r = R {
                    exclude,
                    cubic_a: a,
                    ..base.coord(coord)
                };
                check_resize("cubic", &r);
            }
        }
    }
}

#[test]
fn antialias_when_shrinking() {
    for mode in ["linear", "cubic"] {
        for r in [
            by_scales(mode, &[1, 2, 8, 9], &[1.0, 1.0, 0.5, 0.3]),
            by_sizes(mode, &[1, 1, 9, 7], &[1, 1, 4, 3]),
            // Growing: the plain filter.
            by_scales(mode, &[1, 1, 3, 4], &[1.0, 1.0, 2.0, 0.75]),
        ] {
            for coord in ["half_pixel", "align_corners", "asymmetric"] {
                let r = R {
                    antialias: true,
                    ..r.clone().coord(coord)
                };
                check_resize("antialias", &r);
            }
        }
    }
}

#[test]
fn axes_and_aspect_ratio_policies() {
    for mode in ["nearest", "linear", "cubic"] {
        for policy in ["stretch", "not_larger", "not_smaller"] {
            for axes in [&[2i64, 3][..], &[3, 2], &[-1, -2], &[1]] {
                let sizes: Vec<i64> = [5, 3][..axes.len()].to_vec();
                let r = R {
                    policy,
                    ..by_sizes(mode, &[1, 3, 4, 6], &sizes).axes(axes)
                };
                check_resize("sizes with axes", &r);
            }
        }
        let r = by_scales(mode, &[2, 3, 4, 5], &[0.5, 1.5]).axes(&[3, 1]);
        check_resize("scales with axes", &r);
    }
}

#[test]
fn tf_crop_and_resize_with_roi_and_extrapolation() {
    for mode in ["nearest", "linear", "cubic"] {
        for extrapolation in [None, Some(10.0)] {
            // Inside the input, and reaching past it on either side.
            for roi in [
                vec![0.0, 0.0, 0.2, 0.4, 1.0, 1.0, 0.8, 0.9],
                vec![0.0, 0.0, -0.3, 0.5, 1.0, 1.0, 1.2, 1.4],
            ] {
                let r = R {
                    roi: Some(roi),
                    extrapolation,
                    ..by_sizes(mode, &[1, 2, 5, 6], &[1, 2, 4, 7]).coord("tf_crop_and_resize")
                };
                check_resize("tf_crop_and_resize", &r);
            }
            // A roi for the axes named, scales, and a one-element output.
            let r = R {
                roi: Some(vec![0.1, -0.2, 0.9, 0.7]),
                extrapolation,
                ..by_scales(mode, &[1, 2, 5, 6], &[0.2, 1.5])
                    .axes(&[2, 3])
                    .coord("tf_crop_and_resize")
            };
            check_resize("tf_crop_and_resize axes", &r);
        }
    }
}

#[test]
fn one_two_and_three_resized_axes() {
    for mode in ["nearest", "linear", "cubic"] {
        // 1-D spatial; the channel axis too (an axis before the last two).
        check_resize("3-D", &by_scales(mode, &[2, 3, 5], &[1.0, 1.0, 1.6]));
        check_resize(
            "3-D channels",
            &by_scales(mode, &[2, 3, 5], &[1.0, 2.0, 0.8]),
        );
        // 3-D spatial: two axes resized through the merged-trailing-axes path.
        check_resize(
            "5-D",
            &by_scales(mode, &[1, 2, 3, 4, 5], &[1.0, 1.0, 1.5, 0.5, 1.4]),
        );
        check_resize(
            "5-D sizes",
            &by_sizes(mode, &[2, 1, 4, 3, 2], &[2, 1, 2, 5, 3]),
        );
        // Every axis, the batch included.
        check_resize(
            "4-D all axes",
            &by_scales(mode, &[2, 2, 3, 3], &[1.5, 0.5, 2.0, 1.0]),
        );
    }
}

#[test]
fn declared_rank_only() {
    // Dims symbolic at import: nothing is left out there, the plan finds the identities.
    for mode in ["nearest", "linear"] {
        let r = by_scales(mode, &[1, 2, 3, 4], &[1.0, 1.0, 2.0, 0.5]);
        let mut c = r.case();
        c.symbolic = true;
        check_case(mode, &c, &BOTH, 1e-5, r.reference());
    }
}

#[test]
fn older_forms_resize_10_and_upsample() {
    for mode in ["nearest", "linear"] {
        for scales in [[1.0f32, 1.0, 2.0, 3.0], [1.0, 1.0, 1.5, 0.6]] {
            for (op, opset) in [("Resize", 10), ("Upsample", 9), ("Upsample", 7)] {
                let r = R {
                    op,
                    opset,
                    ..by_scales(mode, &[1, 2, 4, 5], &scales)
                };
                check_resize(op, &r);
            }
        }
    }
}

#[test]
fn integer_x_with_nearest() {
    for dt in [DType::I64, DType::I32] {
        for r in [
            by_scales("nearest", &[1, 2, 3, 4], &[1.0, 1.0, 2.0, 0.5]),
            by_sizes("nearest", &[2, 3, 5], &[2, 3, 8]).coord("align_corners"),
            R {
                roi: Some(vec![-0.2, 1.3]),
                extrapolation: Some(7.0),
                ..by_sizes("nearest", &[2, 6], &[5])
                    .axes(&[1])
                    .coord("tf_crop_and_resize")
            },
        ] {
            let r = R {
                int_x: Some(dt),
                ..r
            };
            check_resize("integer", &r);
        }
    }
}

#[test]
fn gradients_wrt_x() {
    let cases = [
        by_scales("linear", &[1, 2, 4, 5], &[1.0, 1.0, 0.5, 1.6]),
        R {
            exclude: true,
            cubic_a: Some(-0.5),
            ..by_scales("cubic", &[1, 1, 4, 3], &[1.0, 1.0, 1.5, 2.0])
        },
        by_sizes("nearest", &[1, 2, 3, 4], &[1, 2, 5, 3]).nearest("ceil"),
        R {
            roi: Some(vec![0.0, 0.0, -0.3, 0.2, 1.0, 1.0, 1.1, 0.9]),
            extrapolation: Some(2.0),
            ..by_sizes("linear", &[1, 2, 4, 5], &[1, 2, 5, 4]).coord("tf_crop_and_resize")
        },
        R {
            antialias: true,
            ..by_scales("cubic", &[1, 1, 6, 6], &[1.0, 1.0, 0.5, 0.4])
        },
        by_scales("linear", &[1, 2, 3, 4, 3], &[1.0, 1.5, 2.0, 0.5, 1.0]),
        by_scales("linear", &[2, 3, 5], &[1.0, 1.0, 1.4]).coord("align_corners"),
    ];
    for (k, r) in cases.iter().enumerate() {
        check_grads(
            &format!("{r:?}"),
            &r.case(),
            &[0],
            40 + k as u64,
            r.reference(),
        );
    }
}

/// Scales given as an initializer: the axes they leave as they are get no work (one
/// ResizeMatrix per resized axis), and the result is the same.
#[test]
fn known_scales_leave_unit_axes_alone() {
    let r = by_scales("linear", &[2, 3, 4, 5], &[1.0, 1.0, 2.0, 0.6]);
    let x = randn(&r.x, 3);
    let scales = Tensor::from_vec(&[4], vec![1.0f32, 1.0, 2.0, 0.6]).unwrap();
    let roi = Tensor::from_vec::<f32>(&[0], vec![]).unwrap();
    let n = node(
        "Resize",
        "",
        &["x", "roi", "scales"],
        &["y"],
        vec![str_attr("mode", "linear")],
    );
    let g = import_one_node(
        n,
        19,
        vec![input_like("x", &x.cast(DType::F32))],
        vec![initializer("roi", &roi), initializer("scales", &scales)],
    )
    .unwrap();
    let matrices = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::ResizeMatrix { .. }))
        .count();
    assert_eq!(matrices, 2, "one ResizeMatrix per resized axis");
    let want = r.reference()(&[x.to_f64_vec(), vec![], vec![1.0, 1.0, 2.0, 0.6f32 as f64]]);
    for backend in backends() {
        let opts = SessionOptions {
            backend,
            ..SessionOptions::unfused()
        };
        let mut s = Session::new(g.clone(), opts).unwrap();
        let feeds = std::collections::HashMap::from([("x".to_string(), x.cast(DType::F32))]);
        let got = s.run(&feeds).unwrap();
        assert_eq!(got[0].1.shape(), &want[0].0[..]);
        let e = rel_err(&got[0].1.to_f64_vec(), &want[0].1);
        assert!(e <= 1e-5, "{backend:?}: rel err {e:.2e}");
    }
}

/// X's rank carried from the graph input through the nodes before the Resize when the
/// model declares no value_info (as the TorchScript exporter often writes it: LRASPP's
/// `Resize(Relu(Conv(x)) * Sigmoid(...))`).
#[test]
fn rank_of_x_follows_from_the_nodes_before() {
    let r = by_scales("linear", &[2, 3, 4, 5], &[1.0, 1.0, 2.0, 0.6]);
    let x = randn(&r.x, 4);
    let scales = Tensor::from_vec(&[4], vec![1.0f32, 1.0, 2.0, 0.6]).unwrap();
    let nodes = vec![
        node("Relu", "", &["x"], &["a"], vec![]),
        node("Sigmoid", "", &["x"], &["s"], vec![]),
        node("Mul", "", &["a", "s"], &["m"], vec![]),
        node(
            "Resize",
            "",
            &["m", "", "scales"],
            &["y"],
            vec![str_attr("mode", "linear")],
        ),
    ];
    let bytes = model_bytes(
        nodes,
        19,
        vec![input_like("x", &x.cast(DType::F32))],
        vec![initializer("scales", &scales)],
        &["y"],
    );
    let g = graphrun::onnx::from_bytes(&bytes, "model", std::path::Path::new("."))
        .unwrap_or_else(|e| panic!("{e}"));
    let xv = x.to_f64_vec();
    let m: Vec<f64> = xv
        .iter()
        .map(|&v| v.max(0.0) / (1.0 + (-v).exp()))
        .collect();
    let want = r.reference()(&[m, vec![], vec![1.0, 1.0, 2.0, 0.6f32 as f64]]);
    let mut s = Session::new(g, SessionOptions::default()).unwrap();
    let feeds = std::collections::HashMap::from([("x".to_string(), x.cast(DType::F32))]);
    let got = s.run(&feeds).unwrap();
    assert_eq!(got[0].1.shape(), &want[0].0[..]);
    let e = rel_err(&got[0].1.to_f64_vec(), &want[0].1);
    assert!(e <= 1e-5, "rel err {e:.2e}");
}

/// An X whose rank the importer cannot see (reshaped to a shape computed in the graph,
/// as the TorchScript exporter writes DINOv2's and MobileViT's position-embedding
/// interpolation, no value_info) and sizes computed from X's own shape: the Resize is
/// written after shape inference, at the model's opset (Resize-10 reads X and scales).
#[test]
fn rank_of_x_found_by_shape_inference() {
    let cases = [
        (by_sizes("linear", &[2, 3, 4, 5], &[2, 3, 7, 3]), 19),
        (by_sizes("cubic", &[2, 3, 4, 5], &[2, 3, 6, 8]), 13),
        (
            R {
                op: "Resize",
                opset: 10,
                ..by_scales("nearest", &[2, 3, 4, 5], &[1.0, 1.0, 2.0, 0.6])
            },
            10,
        ),
    ];
    for (r, opset) in cases {
        let c = r.case();
        let x = c.inputs[0].1.clone().unwrap();
        let fed: Vec<Vec<f64>> = c
            .inputs
            .iter()
            .map(|(_, t)| t.as_ref().map(|t| t.to_f64_vec()).unwrap_or_default())
            .collect();
        let flat = x.clone().reshaped(&[2, 60]).unwrap();
        let i64s1 = |v: &[i64]| Tensor::from_vec(&[v.len()], v.to_vec()).unwrap();
        let mut nodes = vec![
            // shape = [x.shape[0]] ++ [3, 4, 5]
            node("Shape", "", &["flat"], &["fs"], vec![]),
            node("Slice", "", &["fs", "zero", "one"], &["n"], vec![]),
            node(
                "Concat",
                "",
                &["n", "rest"],
                &["shape"],
                vec![int_attr("axis", 0)],
            ),
            node("Reshape", "", &["flat", "shape"], &["xr"], vec![]),
        ];
        let mut inits = vec![
            initializer("zero", &i64s1(&[0])),
            initializer("one", &i64s1(&[1])),
            initializer("rest", &i64s1(&[3, 4, 5])),
        ];
        let resize_in: Vec<&str> = if opset == 10 {
            inits.push(initializer(
                "scales",
                &Tensor::from_vec(&[4], r.scales.clone().unwrap()).unwrap(),
            ));
            vec!["xr", "scales"]
        } else {
            // sizes = X.shape[0:2] ++ the new spatial sizes
            let s = r.sizes.as_ref().unwrap();
            nodes.push(node("Shape", "", &["xr"], &["xs"], vec![]));
            nodes.push(node("Slice", "", &["xs", "zero", "two"], &["nc"], vec![]));
            nodes.push(node(
                "Concat",
                "",
                &["nc", "hw"],
                &["sizes"],
                vec![int_attr("axis", 0)],
            ));
            inits.push(initializer("two", &i64s1(&[2])));
            inits.push(initializer("hw", &i64s1(&s[2..])));
            vec!["xr", "", "", "sizes"]
        };
        nodes.push(node(
            "Resize",
            "",
            &resize_in,
            &["y"],
            vec![str_attr("mode", r.mode)],
        ));
        for (i, nd) in nodes.iter_mut().enumerate() {
            nd.name = format!("n{i}");
        }
        let bytes = model_bytes(
            nodes,
            opset,
            vec![input("flat", DType::F32, &[None, Some(60)])],
            inits,
            &["y"],
        );
        let g = graphrun::onnx::from_bytes(&bytes, "model", std::path::Path::new("."))
            .unwrap_or_else(|e| panic!("opset {opset}: {e}"));
        let want = r.reference()(&fed);
        let mut s = Session::new(g, SessionOptions::default()).unwrap();
        let feeds = std::collections::HashMap::from([("flat".to_string(), flat.cast(DType::F32))]);
        let got = s
            .run(&feeds)
            .unwrap_or_else(|e| panic!("opset {opset}: {e}"));
        assert_eq!(got[0].1.shape(), &want[0].0[..], "opset {opset}");
        let e = rel_err(&got[0].1.to_f64_vec(), &want[0].1);
        assert!(e <= 1e-5, "opset {opset}: rel err {e:.2e}");
    }
}

/// What cannot be resized is refused with the reason.
#[test]
fn refusals_say_why() {
    let run = |r: &R| -> String {
        let c = r.case();
        let args = c.args(DType::F32);
        let g = c.graph(DType::F32);
        let mut s = Session::new(g, SessionOptions::unfused()).unwrap();
        s.run(&c.feeds(&args)).unwrap_err().to_string()
    };
    let linear_int = R {
        int_x: Some(DType::I64),
        ..by_scales("linear", &[1, 1, 2, 2], &[1.0, 1.0, 2.0, 2.0])
    };
    let e = run(&linear_int);
    assert!(e.contains("mode linear needs a floating X"), "{e}");
    let no_roi = by_sizes("linear", &[1, 1, 2, 2], &[1, 1, 3, 3]).coord("tf_crop_and_resize");
    let e = run(&no_roi);
    assert!(e.contains("tf_crop_and_resize needs roi"), "{e}");
    let short = by_scales("linear", &[1, 1, 2, 2], &[2.0, 2.0]);
    let e = run(&short);
    assert!(e.contains("scales holds 2 values"), "{e}");
    let both = R {
        sizes: Some(vec![1, 1, 3, 3]),
        ..by_scales("linear", &[1, 1, 2, 2], &[1.0, 1.0, 2.0, 2.0])
    };
    let e = run(&both);
    assert!(e.contains("exactly one of scales and sizes"), "{e}");
    // At import: antialias with nearest.
    let r = R {
        antialias: true,
        ..by_scales("nearest", &[1, 1, 2, 2], &[1.0, 1.0, 0.5, 0.5])
    };
    let c = r.case();
    let x = Tensor::zeros(DType::F32, &r.x);
    let n = node("Resize", "", &["x", "", "scales"], &["y"], c.attrs.clone());
    let scales = Tensor::from_vec(&[4], vec![1.0f32, 1.0, 0.5, 0.5]).unwrap();
    let e = import_one_node(
        n,
        19,
        vec![input_like("x", &x), input_like("scales", &scales)],
        vec![],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("antialias applies to modes linear and cubic"),
        "{e}"
    );
}

/// The imported graph written as YAML (`ResizeMatrix` with its attributes, Upsample's
/// "simple" rounding included) loads back and computes the same.
#[test]
fn written_as_yaml_and_read_back() {
    for r in [
        R {
            cubic_a: Some(-0.5),
            exclude: true,
            antialias: true,
            policy: "not_smaller",
            ..by_sizes("cubic", &[1, 2, 6, 5], &[3, 4]).axes(&[-1, 2])
        },
        R {
            roi: Some(vec![0.1, 0.2, 0.9, 1.3]),
            extrapolation: Some(3.0),
            ..by_sizes("nearest", &[1, 2, 6, 5], &[4, 7])
                .axes(&[2, 3])
                .coord("tf_crop_and_resize")
                .nearest("ceil")
        },
        R {
            op: "Upsample",
            opset: 9,
            ..by_scales("nearest", &[1, 1, 3, 4], &[1.0, 1.0, 0.5, 1.5])
        },
    ] {
        let c = r.case();
        let g = c.graph(DType::F64);
        let (text, side) = graphrun::graph::yaml::emit(&g, "side.safetensors");
        assert!(side.is_empty(), "no side file for a one-node model");
        assert!(text.contains("ResizeMatrix"), "{text}");
        let back = graphrun::graph::yaml::load_str(
            &text,
            "resize.yaml",
            std::path::Path::new("."),
            &graphrun::backends::cpu::HOST_EVAL,
            &graphrun::graph::lower::NoLower,
        )
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
        let args = c.args(DType::F64);
        let feeds = c.feeds(&args);
        let run = |g: graphrun::Graph| {
            let mut s = Session::new(g, SessionOptions::unfused()).unwrap();
            s.run(&feeds).unwrap().remove(0).1
        };
        let (a, b) = (run(g), run(back));
        assert_eq!(a.shape(), b.shape(), "{r:?}");
        assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{r:?}");
        let want = r.reference()(
            &args
                .iter()
                .map(|t| t.as_ref().map(Tensor::to_f64_vec).unwrap_or_default())
                .collect::<Vec<_>>(),
        );
        assert!(rel_err(&a.to_f64_vec(), &want[0].1) <= 1e-10, "{r:?}");
    }
}
