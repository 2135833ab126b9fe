//! Operators of ONNX's other domains that are compositions of graphrun's ops: the
//! optimizers of ai.onnx.preview.training (Adagrad, Momentum, Adam; each updates any
//! number of tensors with one learning rate R and one step count T) and ai.onnx.ml's
//! Binarizer and ArrayFeatureExtractor (and TreeEnsemble, in `trees`).

use super::composite::{bin, inputs, reshape, un, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::Attr;
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::Tensor;

pub(super) const TRAINING: &str = "ai.onnx.preview.training";
pub(super) const ML: &str = "ai.onnx.ml";

/// The operators written here, by domain.
pub(super) const OPS: &[(&str, &[&str])] = &[
    (TRAINING, &["Adagrad", "Momentum", "Adam"]),
    (ML, &["Binarizer", "ArrayFeatureExtractor", "TreeEnsemble"]),
];

/// Whether `op` of `domain` is written here.
pub(super) fn writes(domain: &str, op: &str) -> bool {
    OPS.iter().any(|(d, ops)| *d == domain && ops.contains(&op))
}

impl Importer<'_> {
    /// Writes one of `OPS`.
    pub(super) fn lower_domain(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        let mut a = Attrs::of(n, shown, attrs)?;
        a.what = format!("node '{shown}' ({}::{})", n.domain, n.op_type);
        let what = a.what.clone();
        match n.op_type.as_str() {
            "Binarizer" => self.binarizer(n, &what, a),
            "ArrayFeatureExtractor" => self.array_feature_extractor(n, &what, a),
            "TreeEnsemble" => self.tree_ensemble(n, &what, a),
            op => self.optimizer(n, &what, a, op),
        }
    }

    /// Adagrad, Momentum or Adam: inputs R, T, then each of X, G and the optimizer's
    /// state (H; V; V and H) for every updated tensor; outputs the new X, then the new
    /// state, for every tensor (any may be omitted). As ONNX's definitions compute them,
    /// with the regularization `norm_coefficient · X` added to the gradient.
    fn optimizer(&mut self, n: &NodeProto, what: &str, mut a: Attrs, op: &str) -> Result<()> {
        let per = match op {
            "Adam" => 4,
            _ => 3,
        };
        let norm = match op {
            "Momentum" => required_float(&mut a, "norm_coefficient")?,
            _ => a.float("norm_coefficient", 0.0)?,
        };
        enum Rule {
            Adagrad {
                decay: f32,
                eps: f32,
            },
            Momentum {
                alpha: f32,
                beta: f32,
                nesterov: bool,
            },
            Adam {
                alpha: f32,
                beta: f32,
                eps: f32,
                post: f32,
            },
        }
        let rule = match op {
            "Adagrad" => Rule::Adagrad {
                decay: a.float("decay_factor", 0.0)?,
                eps: a.float("epsilon", 1e-6)?,
            },
            "Momentum" => {
                let alpha = required_float(&mut a, "alpha")?;
                let beta = required_float(&mut a, "beta")?;
                let nesterov = match a.take("mode") {
                    Some(crate::graph::op::AttrValue::Str(m)) if m == "standard" => false,
                    Some(crate::graph::op::AttrValue::Str(m)) if m == "nesterov" => true,
                    Some(v) => return Err(a.wrong("mode", "\"standard\" or \"nesterov\"", &v)),
                    None => return Err(a.refuse("mode", "is required")),
                };
                Rule::Momentum {
                    alpha,
                    beta,
                    nesterov,
                }
            }
            _ => Rule::Adam {
                alpha: a.float("alpha", 0.9)?,
                beta: a.float("beta", 0.999)?,
                eps: a.float("epsilon", 1e-6)?,
                post: a.float("norm_coefficient_post", 0.0)?,
            },
        };
        a.finish()?;
        let given = n.input.len();
        if given < 2 + per
            || !(given - 2).is_multiple_of(per)
            || n.input.iter().any(|i| i.is_empty())
        {
            return Err(Error::Graph(format!(
                "{what} takes R, T and {per} inputs per updated tensor, got {given} inputs"
            )));
        }
        let count = (given - 2) / per;
        let outs = per - 1;
        if n.output.len() > outs * count {
            return Err(Error::Graph(format!(
                "{what} gives {} outputs for {count} tensors, got {}",
                outs * count,
                n.output.len()
            )));
        }
        let (r, t) = (n.input[0].clone(), n.input[1].clone());
        let zero_t = self.constant(n, "t_zero", Tensor::scalar(0i64));
        let zero_t = self.val(n, "t_zero_like", Op::CastLike, vec![zero_t, t.clone()]);
        let started = self.val(
            n,
            "started",
            bin(BinaryOp::Greater),
            vec![t.clone(), zero_t],
        );
        for k in 0..count {
            let input = |j: usize| n.input[2 + j * count + k].clone();
            let x = input(0);
            let tag = |s: &str| format!("t{k}_{s}");
            let c = |me: &mut Self, s: &str, v: f32| me.float_like(n, &tag(s), v, &x);
            let b = |me: &mut Self, s: &str, op: BinaryOp, l: &str, r: &str| {
                me.val(n, &tag(s), bin(op), vec![l.to_string(), r.to_string()])
            };
            let mut g = input(1);
            if norm != 0.0 {
                let nc = c(self, "norm", norm);
                let nx = b(self, "norm_x", BinaryOp::Mul, &nc, &x);
                g = b(self, "g_reg", BinaryOp::Add, &nx, &g);
            }
            let rate = self.val(n, &tag("rate"), Op::CastLike, vec![r.clone(), x.clone()]);
            let steps = self.val(n, &tag("steps"), Op::CastLike, vec![t.clone(), x.clone()]);
            let one = c(self, "one", 1.0);
            // (new X, new state...) in output order.
            let news: Vec<String> = match rule {
                Rule::Adagrad { decay, eps } => {
                    let d = c(self, "decay", decay);
                    let td = b(self, "t_decay", BinaryOp::Mul, &steps, &d);
                    let den = b(self, "rate_den", BinaryOp::Add, &one, &td);
                    let rate = b(self, "rate_adj", BinaryOp::Div, &rate, &den);
                    let g2 = b(self, "g_sq", BinaryOp::Mul, &g, &g);
                    let h = b(self, "h_new", BinaryOp::Add, &input(2), &g2);
                    let step = self.scaled_step(n, &tag(""), &g, &h, eps, &x);
                    let upd = b(self, "update", BinaryOp::Mul, &rate, &step);
                    vec![b(self, "x_new", BinaryOp::Sub, &x, &upd), h]
                }
                Rule::Momentum {
                    alpha,
                    beta,
                    nesterov,
                } => {
                    // The gradient's coefficient is 1 on the first step (T = 0).
                    let bc = c(self, "beta", beta);
                    let bc = self.val(
                        n,
                        &tag("beta_t"),
                        Op::Where,
                        vec![started.clone(), bc, one.clone()],
                    );
                    let ac = c(self, "alpha", alpha);
                    let av = b(self, "alpha_v", BinaryOp::Mul, &ac, &input(2));
                    let bg = b(self, "beta_g", BinaryOp::Mul, &bc, &g);
                    let v = b(self, "v_new", BinaryOp::Add, &av, &bg);
                    let dir = if nesterov {
                        let avn = b(self, "alpha_v_new", BinaryOp::Mul, &ac, &v);
                        b(self, "direction", BinaryOp::Add, &g, &avn)
                    } else {
                        v.clone()
                    };
                    let upd = b(self, "update", BinaryOp::Mul, &rate, &dir);
                    vec![b(self, "x_new", BinaryOp::Sub, &x, &upd), v]
                }
                Rule::Adam {
                    alpha,
                    beta,
                    eps,
                    post,
                } => {
                    let ac = c(self, "alpha", alpha);
                    let bc = c(self, "beta", beta);
                    let a1 = b(self, "one_m_alpha", BinaryOp::Sub, &one, &ac);
                    let b1 = b(self, "one_m_beta", BinaryOp::Sub, &one, &bc);
                    let av = b(self, "alpha_v", BinaryOp::Mul, &ac, &input(2));
                    let ag = b(self, "alpha_g", BinaryOp::Mul, &a1, &g);
                    let v = b(self, "v_new", BinaryOp::Add, &av, &ag);
                    let bh = b(self, "beta_h", BinaryOp::Mul, &bc, &input(3));
                    let g2 = b(self, "g_sq", BinaryOp::Mul, &g, &g);
                    let bg = b(self, "beta_g", BinaryOp::Mul, &b1, &g2);
                    let h = b(self, "h_new", BinaryOp::Add, &bh, &bg);
                    // Bias correction from the first step on: R·sqrt(1 - β^T)/(1 - α^T).
                    let at = b(self, "alpha_t", BinaryOp::Pow, &ac, &steps);
                    let bt = b(self, "beta_t", BinaryOp::Pow, &bc, &steps);
                    let at = b(self, "one_m_alpha_t", BinaryOp::Sub, &one, &at);
                    let bt = b(self, "one_m_beta_t", BinaryOp::Sub, &one, &bt);
                    let bt = self.val(n, &tag("sqrt_beta_t"), un(UnaryOp::Sqrt), vec![bt]);
                    let corr = b(self, "correction", BinaryOp::Div, &bt, &at);
                    let corr = self.val(
                        n,
                        &tag("correction_t"),
                        Op::Where,
                        vec![started.clone(), corr, one.clone()],
                    );
                    let rate = b(self, "rate_adj", BinaryOp::Mul, &rate, &corr);
                    let step = self.scaled_step(n, &tag(""), &v, &h, eps, &x);
                    let upd = b(self, "update", BinaryOp::Mul, &rate, &step);
                    let mut xn = b(self, "x_new", BinaryOp::Sub, &x, &upd);
                    if post != 0.0 {
                        let p = c(self, "post", post);
                        let p = b(self, "one_m_post", BinaryOp::Sub, &one, &p);
                        xn = b(self, "x_post", BinaryOp::Mul, &p, &xn);
                    }
                    vec![xn, v, h]
                }
            };
            for (j, v) in news.into_iter().enumerate() {
                let o = j * count + k;
                if n.output.get(o).is_some_and(|s| !s.is_empty()) {
                    self.out(n, o, Op::Identity, vec![v]);
                }
            }
        }
        Ok(())
    }

    /// d / (sqrt(h) + eps).
    fn scaled_step(
        &mut self,
        n: &NodeProto,
        tag: &str,
        d: &str,
        h: &str,
        eps: f32,
        like: &str,
    ) -> String {
        let e = self.float_like(n, &format!("{tag}eps"), eps, like);
        let s = self.val(
            n,
            &format!("{tag}h_sqrt"),
            un(UnaryOp::Sqrt),
            vec![h.to_string()],
        );
        let s = self.val(
            n,
            &format!("{tag}h_sqrt_eps"),
            bin(BinaryOp::Add),
            vec![s, e],
        );
        self.val(
            n,
            &format!("{tag}step"),
            bin(BinaryOp::Div),
            vec![d.to_string(), s],
        )
    }

    /// Binarizer: 1 where x > threshold, else 0, in x's dtype.
    fn binarizer(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let threshold = a.float("threshold", 0.0)?;
        a.finish()?;
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let th = self.float_like(n, "threshold", threshold, &x);
        let above = self.val(n, "above", bin(BinaryOp::Greater), vec![x.clone(), th]);
        self.out(n, 0, Op::CastLike, vec![above, x]);
        Ok(())
    }

    /// ArrayFeatureExtractor: the last axis of X at the (flattened) indices; a 1-D X gives
    /// one row, [1, k], as ONNX Runtime does.
    fn array_feature_extractor(&mut self, n: &NodeProto, what: &str, a: Attrs) -> Result<()> {
        a.finish()?;
        let (ins, _) = inputs(n, what, (2, 2), 1)?;
        let x = ins[0].clone();
        let flat = self.ints_const(n, "flat", &[-1])?;
        let idx = self.val(n, "indices", reshape(), vec![ins[1].clone(), flat]);
        match self.ranks.get(&x) {
            Some(1) => {
                let v = self.val(n, "picked", Op::Gather { axis: -1 }, vec![x, idx]);
                let row = self.ints_const(n, "row", &[1, -1])?;
                self.out(n, 0, reshape(), vec![v, row]);
            }
            Some(_) => self.out(n, 0, Op::Gather { axis: -1 }, vec![x, idx]),
            None => {
                return Err(Error::Graph(format!(
                    "{what}: the rank of X is unknown: declare it (a value_info or input type)"
                )))
            }
        }
        Ok(())
    }
}

/// A float attribute the definition requires.
fn required_float(a: &mut Attrs, key: &str) -> Result<f32> {
    if !a.list.iter().any(|at| at.name == key) {
        return Err(a.refuse(key, "is required"));
    }
    a.float(key, 0.0)
}
