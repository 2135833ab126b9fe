//! Bernoulli and Multinomial, written on graphrun's uniform draw (`RandomUniformLike`), so
//! that every backend samples them and each training step draws afresh:
//! - Bernoulli(p) = Cast(U < p) with U uniform in [0, 1) of p's shape: 1 with probability
//!   p. (ONNX's function body compares `U > p`, which is 1 with probability 1 - p; the
//!   operator's definition and its reference, numpy's `binomial(1, p)`, say p.)
//! - Multinomial(x) draws `sample_size` classes per row of x's `[batch, classes]`
//!   unnormalized log-probabilities: with c the running sum of Softmax(x) along the
//!   classes and U uniform, the class is the count of c's entries below U, capped at the
//!   last class (c's last entry may round below U).

use super::composite::{bin, inputs, shape, unsqueeze, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::AttrValue;
use crate::graph::{BinaryOp, Op, ReduceKind};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

impl Importer<'_> {
    /// Bernoulli(input; dtype = input's, seed).
    pub(super) fn bernoulli(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let to = out_dtype(&mut a, None)?;
        let seed = seed(&mut a)?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let p = ins[0].clone();
        let u = self.val(n, "uniform", uniform_like(seed), vec![p.clone()]);
        let hit = self.val(n, "hit", bin(BinaryOp::Less), vec![u, p.clone()]);
        match to {
            Some(to) => self.out(n, 0, Op::Cast { to }, vec![hit]),
            None => self.out(n, 0, Op::CastLike, vec![hit, p]),
        }
        Ok(())
    }

    /// Multinomial(input [batch, classes]; dtype = int32, sample_size = 1, seed) →
    /// [batch, sample_size] class indices.
    pub(super) fn multinomial(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let to = out_dtype(&mut a, Some(DType::I32))?.unwrap_or(DType::I32);
        if !matches!(to, DType::I32 | DType::I64) {
            return Err(a.refuse(
                "dtype",
                &format!("must be int32 or int64, got {}", to.name()),
            ));
        }
        let samples = a.int("sample_size", 1)?;
        if samples < 1 {
            return Err(a.refuse("sample_size", &format!("must be positive, got {samples}")));
        }
        let seed = seed(&mut a)?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        if let Some(r) = self.ranks.get(&x).filter(|&&r| r != 2) {
            return Err(Error::Graph(format!(
                "{what}: input '{x}' must be 2-D ([batch, classes]), got rank {r}"
            )));
        }
        // Running sums of the class probabilities, as [batch, 1, classes].
        let p = self.val(n, "probs", Op::Softmax { axis: 1 }, vec![x.clone()]);
        let axis = self.constant(n, "class_axis", Tensor::scalar(1i64));
        let cum = Op::Cumulative {
            prod: false,
            exclusive: false,
            reverse: false,
        };
        let c = self.val(n, "cdf", cum, vec![p, axis]);
        let c = self.val(n, "cdf_row", unsqueeze(1), vec![c]);
        // One uniform per sample, as [batch, samples, 1]: the shape of x[:, :1] broadcast
        // against [1, samples, 1].
        let (zero, one) = (
            self.ints_const(n, "zero", &[0])?,
            self.ints_const(n, "one", &[1])?,
        );
        let first = self.val(
            n,
            "first_class",
            Op::Slice,
            vec![x.clone(), zero, one.clone(), one],
        );
        let first = self.val(n, "first_class_3d", unsqueeze(2), vec![first]);
        let fan = self.ints_const(n, "samples", &[1, samples, 1])?;
        let like = self.val(n, "per_sample", Op::Expand, vec![first, fan]);
        let u = self.val(n, "uniform", uniform_like(seed), vec![like]);
        // The class: how many running sums lie below the draw, capped at classes - 1;
        // counted in f32 (exact to 2^24 classes), which every backend sums.
        let below = self.val(n, "below", bin(BinaryOp::Less), vec![c, u]);
        let f32_ = Op::Cast { to: DType::F32 };
        let below = self.val(n, "below_f32", f32_.clone(), vec![below]);
        let reduce = Op::Reduce {
            kind: ReduceKind::Sum,
            axes: Some(vec![2]),
            keepdims: false,
            noop_with_empty_axes: false,
        };
        let count = self.val(n, "count", reduce, vec![below]);
        let classes = self.val(n, "classes", shape(1, Some(2)), vec![x]);
        let classes = self.val(n, "classes_f32", f32_, vec![classes]);
        let one = self.constant(n, "one_f32", Tensor::scalar(1f32));
        let last = self.val(n, "last_class", bin(BinaryOp::Sub), vec![classes, one]);
        let class = self.val(n, "class", bin(BinaryOp::Min), vec![count, last]);
        self.out(n, 0, Op::Cast { to }, vec![class]);
        Ok(())
    }
}

/// A uniform draw in [0, 1) of its input's shape and type.
fn uniform_like(seed: Option<f64>) -> Op {
    Op::Random {
        normal: false,
        a: 0.0,
        b: 1.0,
        seed,
        dtype: None,
        shape: None,
    }
}

/// The optional float `seed` attribute.
fn seed(a: &mut Attrs) -> Result<Option<f64>> {
    match a.take("seed") {
        None => Ok(None),
        Some(AttrValue::Float(v)) => Ok(Some(v)),
        Some(AttrValue::Int(v)) => Ok(Some(v as f64)),
        Some(v) => Err(a.wrong("seed", "a float", &v)),
    }
}

/// The output type `dtype` by its ONNX code (`default` when absent).
fn out_dtype(a: &mut Attrs, default: Option<DType>) -> Result<Option<DType>> {
    match a.opt_int("dtype")? {
        None => Ok(default),
        Some(code) => DType::from_onnx(code).map(Some).ok_or_else(|| {
            Error::Graph(format!(
                "{}: attribute 'dtype' {code} ({}) is not a dtype graphrun has",
                a.what,
                crate::tensor::onnx_dtype_name(code)
            ))
        }),
    }
}
