//! AttentionGrad and VarlenAttentionGrad, and the forward ops' LSE output.
//!
//! Gradients are checked against central finite differences in f64 of the *forward* op
//! (of the loss Σ dY∘Attention(Q, K, V, mask)), the lower precisions against the f64
//! kernel, and VarlenAttentionGrad also against AttentionGrad run per sequence.

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::rng::Rng;
use graphrun::{DType, Op, Tensor};

/// Finite-difference step: its truncation error (~h²) and rounding error (~1e-16/h)
/// both stay near 1e-10.
const H: f64 = 1e-5;
/// Largest number of coordinates of one tensor checked by finite differences.
const FD_SAMPLES: usize = 150;

fn attn(name: &str, causal: bool, scale: Option<f64>) -> Op {
    attn_heads(name, causal, scale, None)
}

/// With `heads` (q_num_heads, kv_num_heads), for the 3-D form.
fn attn_heads(name: &str, causal: bool, scale: Option<f64>, heads: Option<(usize, usize)>) -> Op {
    let mut attrs = vec![("is_causal", AttrValue::Int(causal as i64))];
    if let Some(s) = scale {
        attrs.push(("scale", AttrValue::Float(s)));
    }
    if let Some((hq, hkv)) = heads {
        attrs.push(("q_num_heads", AttrValue::Int(hq as i64)));
        attrs.push(("kv_num_heads", AttrValue::Int(hkv as i64)));
    }
    op(name, &attrs)
}

/// Runs one op on the CPU; `outs` names its outputs ("" = not wanted).
fn run(op: Op, ins: &[Option<Tensor>], outs: &[&str]) -> graphrun::Result<Vec<Tensor>> {
    eval(&node_of(op, ins, outs), ins)
}

fn cast_opt(t: &Option<Tensor>, dt: DType) -> Option<Tensor> {
    t.as_ref().map(|t| {
        if t.dtype().is_float() {
            t.cast(dt)
        } else {
            t.clone()
        }
    })
}

/// A seeded bool mask, true with probability `p_keep`.
fn rand_bools(n: usize, seed: u64, p_keep: f64) -> Vec<bool> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.uniform() < p_keep).collect()
}

/// Coordinates of a tensor of `n` elements to check: all of them, or a seeded sample.
fn coords(n: usize, seed: u64) -> Vec<usize> {
    if n <= FD_SAMPLES {
        return (0..n).collect();
    }
    let mut r = Rng::new(seed);
    (0..FD_SAMPLES)
        .map(|_| r.int_in(0, n as i64) as usize)
        .collect()
}

/// Compares the analytic gradient `grad` of `loss` w.r.t. `inputs[which]` with central
/// finite differences on (a sample of) its coordinates.
fn check_fd(
    what: &str,
    inputs: &[Option<Tensor>],
    which: usize,
    grad: &[f64],
    loss: &dyn Fn(&[Option<Tensor>]) -> f64,
) {
    let x = inputs[which].as_ref().unwrap();
    let (shape, base) = (x.shape().to_vec(), x.to_f64_vec());
    let at = coords(base.len(), 7 + which as u64);
    let mut ins = inputs.to_vec();
    let mut f = |c: usize, dx: f64| {
        let mut v = base.clone();
        v[c] += dx;
        ins[which] = Some(f64s(&shape, &v));
        loss(&ins)
    };
    let fd: Vec<f64> = at
        .iter()
        .map(|&c| (f(c, H) - f(c, -H)) / (2.0 * H))
        .collect();
    let an: Vec<f64> = at.iter().map(|&c| grad[c]).collect();
    assert!(
        an.iter().any(|&g| g != 0.0),
        "{what}: the checked gradient is all zeros"
    );
    assert_grad(what, &an, &fd, 1e-6);
}

/// An Attention problem: f64 inputs Q, K, V, [mask], the seed gradient dY, attributes.
#[derive(Clone)]
struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Option<Tensor>,
    dy: Tensor,
    causal: bool,
    scale: Option<f64>,
    /// The 3-D form: Q, K, V and dY are `[B, S, H·D]`, with these (Hq, Hkv).
    heads: Option<(usize, usize)>,
}

impl Case {
    /// Q [b,hq,sq,d], K [b,hkv,skv,d], V [b,hkv,skv,dv], seeded normal data.
    #[allow(clippy::too_many_arguments)]
    fn new(b: usize, hq: usize, hkv: usize, sq: usize, skv: usize, d: usize, dv: usize) -> Case {
        let seed = (b * 1000 + hq * 100 + sq * 10 + skv + d + dv) as u64;
        Case {
            q: randn(&[b, hq, sq, d], seed),
            k: randn(&[b, hkv, skv, d], seed + 1),
            v: randn(&[b, hkv, skv, dv], seed + 2),
            mask: None,
            dy: randn(&[b, hq, sq, dv], seed + 3),
            causal: false,
            scale: None,
            heads: None,
        }
    }
    /// The same problem in the 3-D form.
    fn packed(self) -> Case {
        let heads = Some((self.q.shape()[1], self.k.shape()[1]));
        Case {
            q: pack_heads(&self.q),
            k: pack_heads(&self.k),
            v: pack_heads(&self.v),
            dy: pack_heads(&self.dy),
            heads,
            ..self
        }
    }
    fn causal(mut self) -> Case {
        self.causal = true;
        self
    }
    fn scale(mut self, s: f64) -> Case {
        self.scale = Some(s);
        self
    }
    fn mask(mut self, m: Tensor) -> Case {
        self.mask = Some(m);
        self
    }
    fn inputs(&self) -> Vec<Option<Tensor>> {
        vec![
            Some(self.q.clone()),
            Some(self.k.clone()),
            Some(self.v.clone()),
            self.mask.clone(),
        ]
    }
    /// Y and LSE with every floating input cast to `dt`.
    fn forward(&self, ins: &[Option<Tensor>], dt: DType) -> Vec<Tensor> {
        let ins: Vec<Option<Tensor>> = ins.iter().map(|t| cast_opt(t, dt)).collect();
        let op = attn_heads("Attention", self.causal, self.scale, self.heads);
        run(op, &ins, &["y", "lse"]).unwrap_or_else(|e| panic!("{e}"))
    }
    /// Σ dY∘Y in f64.
    fn loss(&self, ins: &[Option<Tensor>]) -> f64 {
        let y = self.forward(ins, DType::F64)[0].to_f64_vec();
        y.iter().zip(self.dy.to_f64_vec()).map(|(a, b)| a * b).sum()
    }
    /// [dQ, dK, dV, (dMask)] in `dt` (outputs named by `outs`), from the forward in `dt`.
    fn grads_with(&self, dt: DType, outs: &[&str]) -> graphrun::Result<Vec<Tensor>> {
        // (dY, Q, K, V, Y, LSE, [mask])
        let fwd = self.forward(&self.inputs(), dt);
        let mut ins: Vec<Option<Tensor>> = vec![Some(self.dy.cast(dt))];
        ins.extend(self.inputs()[..3].iter().map(|t| cast_opt(t, dt)));
        ins.extend(fwd.into_iter().map(Some));
        ins.push(cast_opt(&self.mask, dt));
        let op = attn_heads("AttentionGrad", self.causal, self.scale, self.heads);
        run(op, &ins, outs)
    }
    fn grads(&self, dt: DType) -> Vec<Tensor> {
        let outs: &[&str] = match self.mask {
            Some(ref m) if m.dtype().is_float() => &["dq", "dk", "dv", "dmask"],
            _ => &["dq", "dk", "dv"],
        };
        self.grads_with(dt, outs).unwrap_or_else(|e| panic!("{e}"))
    }
    /// The same problem with its floating inputs rounded to `dt`.
    fn rounded(&self, dt: DType) -> Case {
        let r = |t: &Tensor| t.cast(dt).cast(DType::F64);
        Case {
            q: r(&self.q),
            k: r(&self.k),
            v: r(&self.v),
            mask: self.mask.as_ref().map(|m| {
                if m.dtype().is_float() {
                    r(m)
                } else {
                    m.clone()
                }
            }),
            dy: r(&self.dy),
            ..self.clone()
        }
    }

    /// Checks every gradient against finite differences (the mask's summed back to its
    /// broadcast shape), and returns them.
    fn check_fd(&self) -> Vec<Tensor> {
        let g = self.grads(DType::F64);
        let ins = self.inputs();
        let loss = |ins: &[Option<Tensor>]| self.loss(ins);
        for (i, name) in ["dQ", "dK", "dV"].iter().enumerate() {
            check_fd(name, &ins, i, &g[i].to_f64_vec(), &loss);
        }
        if let Some(dm) = g.get(3) {
            let shape = self.mask.as_ref().unwrap().shape();
            check_fd(
                "dMask",
                &ins,
                3,
                &sum_to(&dm.to_f64_vec(), dm.shape(), shape),
                &loss,
            );
        }
        for t in &g {
            assert!(
                t.to_f64_vec().iter().all(|x| x.is_finite()),
                "non-finite gradient"
            );
        }
        g
    }

    /// Checks the f32/f16/bf16 kernels against the f64 one on the same rounded inputs.
    fn check_dtypes(&self) {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let want = self.rounded(dt).grads(DType::F64);
            let got = self.grads(dt);
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.dtype(), dt);
                let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
                assert!(e <= tol(dt), "{dt} gradient {k}: rel err {e:.3e}");
            }
        }
    }
}

#[test]
fn grad_plain() {
    let c = Case::new(2, 2, 2, 5, 7, 8, 8);
    c.check_fd();
    c.check_dtypes();
}

#[test]
fn grad_causal_fewer_and_more_queries_than_keys() {
    Case::new(1, 2, 2, 9, 13, 8, 8).causal().check_fd();
    Case::new(1, 2, 2, 13, 9, 8, 8).causal().check_fd();
    Case::new(1, 2, 2, 13, 9, 8, 8).causal().check_dtypes();
}

#[test]
fn grad_additive_mask_broadcast() {
    let (b, h, sq, skv) = (2, 2, 6, 11);
    let m = rand(&[1, 1, sq, skv], 300, -2.0, 1.0);
    let c = Case::new(b, h, h, sq, skv, 8, 8).mask(m);
    c.check_fd();
    c.check_dtypes();
    let m = rand(&[b, 1, 1, skv], 301, -2.0, 1.0);
    let c = Case::new(b, h, h, sq, skv, 8, 8).causal().mask(m);
    c.check_fd();
    c.check_dtypes();
}

#[test]
fn grad_additive_mask_full_shape_with_neg_inf() {
    // −inf entries (masked out) and one fully masked row: dMask is 0 there, nothing NaN.
    // (Finite differences cannot step an infinite entry, so the FD check is on Q, K, V.)
    let (b, h, sq, skv) = (1, 2, 5, 9);
    let mut r = Rng::new(310);
    let mut m: Vec<f64> = (0..b * h * sq * skv)
        .map(|_| {
            if r.uniform() < 0.2 {
                f64::NEG_INFINITY
            } else {
                r.uniform_in(-1.0, 1.0)
            }
        })
        .collect();
    m[2 * skv..3 * skv].fill(f64::NEG_INFINITY);
    let c = Case::new(b, h, h, sq, skv, 8, 8).mask(f64s(&[b, h, sq, skv], &m));
    let g = c.grads(DType::F64);
    let ins = c.inputs();
    for (i, name) in ["dQ", "dK", "dV"].iter().enumerate() {
        check_fd(name, &ins, i, &g[i].to_f64_vec(), &|x| c.loss(x));
    }
    for (dm, mv) in g[3].to_f64_vec().iter().zip(&m) {
        assert!(dm.is_finite());
        if *mv == f64::NEG_INFINITY {
            assert_eq!(*dm, 0.0);
        }
    }
    assert!(g[0].to_f64_vec()[2 * 8..3 * 8].iter().all(|&x| x == 0.0));
}

#[test]
fn grad_bool_mask_with_fully_masked_row() {
    let (b, h, sq, skv, d) = (2, 2, 7, 12, 8);
    let mut m = rand_bools(sq * skv, 320, 0.7);
    m[3 * skv..4 * skv].fill(false); // row 3 sees nothing
    let c = Case::new(b, h, h, sq, skv, d, d).mask(bools(&[sq, skv], &m));
    let g = c.check_fd();
    c.check_dtypes();
    let dq = g[0].to_f64_vec();
    for bh in 0..b * h {
        assert!(dq[(bh * sq + 3) * d..][..d].iter().all(|&x| x == 0.0));
    }
    // Causal on top: row 0 sees only key 0, which the mask removes.
    m[0] = false;
    Case::new(b, h, h, sq, skv, d, d)
        .mask(bools(&[sq, skv], &m))
        .causal()
        .check_fd();
}

#[test]
fn grad_bool_mask_has_no_mask_gradient() {
    let m = bools(&[3, 4], &rand_bools(12, 330, 0.5));
    let c = Case::new(1, 1, 1, 3, 4, 8, 8).mask(m);
    let e = match c.grads_with(DType::F32, &["dq", "dk", "dv", "dmask"]) {
        Ok(_) => panic!("dMask of a bool mask was computed"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("bool"), "unclear error: {e}");
}

#[test]
fn grad_gqa() {
    let c = Case::new(2, 4, 2, 6, 10, 8, 8);
    c.check_fd();
    c.check_dtypes();
    Case::new(1, 4, 2, 10, 10, 8, 8).causal().check_fd();
    // A mask that differs per query head, so each head of a kv group must read its own.
    let m = rand(&[1, 4, 6, 10], 335, -1.0, 1.0);
    Case::new(2, 4, 2, 6, 10, 8, 8).mask(m).check_fd();
}

#[test]
fn grad_dv_differs_and_explicit_scale() {
    // 0.375 is exact in f32, the type the attribute is stored in.
    let c = Case::new(1, 4, 2, 7, 9, 8, 5).scale(0.375);
    c.check_fd();
    c.check_dtypes();
    Case::new(1, 2, 2, 9, 9, 12, 16)
        .causal()
        .scale(0.375)
        .check_fd();
}

#[test]
fn grad_crosses_block_boundaries() {
    // Several query blocks (32 rows) and key blocks (64 keys), none full at the end.
    let c = Case::new(1, 2, 1, 70, 130, 8, 8);
    c.check_fd();
    c.check_dtypes();
    let m = rand(&[1, 1, 70, 130], 340, -1.0, 1.0);
    Case::new(1, 2, 2, 70, 130, 8, 8)
        .causal()
        .mask(m)
        .check_fd();
}

#[test]
fn grad_outputs_not_wanted_are_skipped() {
    let m = rand(&[1, 2, 6, 9], 350, -1.0, 1.0);
    let c = Case::new(1, 2, 2, 6, 9, 8, 8).mask(m);
    let all = c.grads(DType::F64);
    let some = c.grads_with(DType::F64, &["dq", "", "dv"]).unwrap();
    assert_eq!(some.len(), 3);
    for k in [0, 2] {
        assert_eq!(some[k].to_f64_vec(), all[k].to_f64_vec());
    }
    let only_mask = c.grads_with(DType::F64, &["", "", "", "dmask"]).unwrap();
    assert_eq!(only_mask[3].to_f64_vec(), all[3].to_f64_vec());
}

/// log Σ_j exp(s_j) over visible keys, −inf when none is visible.
fn logsumexp(s: &[f64]) -> f64 {
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn attention_lse_output() {
    let (b, hq, hkv, sq, skv, d) = (2, 4, 2, 40, 70, 8);
    let mut m = rand_bools(sq * skv, 360, 0.8);
    m[5 * skv..6 * skv].fill(false); // row 5 sees nothing
    let c = Case::new(b, hq, hkv, sq, skv, d, d)
        .causal()
        .mask(bools(&[sq, skv], &m));
    let scale = 1.0 / (d as f64).sqrt();
    let (qd, kd) = (c.q.to_f64_vec(), c.k.to_f64_vec());
    let mut want = vec![];
    for bi in 0..b {
        for h in 0..hq {
            let kv = (bi * hkv + h / (hq / hkv)) * skv;
            for i in 0..sq {
                let qi = &qd[((bi * hq + h) * sq + i) * d..][..d];
                let s: Vec<f64> = (0..skv)
                    .filter(|&j| j <= i && m[i * skv + j])
                    .map(|j| scale * dot(qi, &kd[(kv + j) * d..][..d]))
                    .collect();
                want.push(logsumexp(&s));
            }
        }
    }
    for dt in FLOATS {
        let lse = &c.forward(&c.inputs(), dt)[1];
        assert_eq!(lse.shape(), &[b, hq, sq]);
        assert_eq!(lse.dtype(), if dt == DType::F64 { dt } else { DType::F32 });
        let e = rel_err(&lse.to_f64_vec(), &want);
        assert!(e <= tol(dt), "{dt}: LSE rel err {e:.3e}");
    }
}

/// A VarlenAttention problem: packed f64 Q, K, V, dY and the sequences' lengths.
struct Varlen {
    lq: Vec<usize>,
    lk: Vec<usize>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dy: Tensor,
    causal: bool,
    scale: Option<f64>,
}

fn offsets(l: &[usize]) -> Vec<usize> {
    let mut c = vec![0];
    for &x in l {
        c.push(c.last().unwrap() + x);
    }
    c
}
fn cu_tensor(l: &[usize]) -> Tensor {
    let c: Vec<i32> = offsets(l).iter().map(|&x| x as i32).collect();
    Tensor::from_vec(&[c.len()], c).unwrap()
}

impl Varlen {
    #[allow(clippy::too_many_arguments)]
    fn new(
        lq: &[usize],
        lk: &[usize],
        hq: usize,
        hkv: usize,
        d: usize,
        dv: usize,
        seed: u64,
    ) -> Self {
        let (tq, tk) = (lq.iter().sum(), lk.iter().sum());
        Varlen {
            lq: lq.to_vec(),
            lk: lk.to_vec(),
            q: randn(&[tq, hq, d], seed),
            k: randn(&[tk, hkv, d], seed + 1),
            v: randn(&[tk, hkv, dv], seed + 2),
            dy: randn(&[tq, hq, dv], seed + 3),
            causal: false,
            scale: None,
        }
    }
    fn inputs(&self) -> Vec<Option<Tensor>> {
        vec![
            Some(self.q.clone()),
            Some(self.k.clone()),
            Some(self.v.clone()),
            Some(cu_tensor(&self.lq)),
            Some(cu_tensor(&self.lk)),
        ]
    }
    fn forward(&self, ins: &[Option<Tensor>]) -> Vec<Tensor> {
        let op = attn("VarlenAttention", self.causal, self.scale);
        run(op, ins, &["y", "lse"]).unwrap_or_else(|e| panic!("{e}"))
    }
    fn grads(&self) -> Vec<Tensor> {
        let ins = self.inputs();
        let mut all = vec![Some(self.dy.clone())];
        all.extend(ins.iter().cloned());
        all.extend(self.forward(&ins).into_iter().map(Some));
        let op = attn("VarlenAttentionGrad", self.causal, self.scale);
        run(op, &all, &["dq", "dk", "dv"]).unwrap_or_else(|e| panic!("{e}"))
    }
    fn loss(&self, ins: &[Option<Tensor>]) -> f64 {
        let y = self.forward(ins)[0].to_f64_vec();
        y.iter().zip(self.dy.to_f64_vec()).map(|(a, b)| a * b).sum()
    }

    /// Rows `r` of a packed `[T, H, W]` tensor as a 4-D `[1, H, len, W]` one.
    fn unpack(t: &Tensor, r: std::ops::Range<usize>) -> Tensor {
        let (h, w) = (t.shape()[1], t.shape()[2]);
        let x = t.to_f64_vec();
        let mut v = vec![];
        for hh in 0..h {
            for i in r.clone() {
                v.extend_from_slice(&x[(i * h + hh) * w..][..w]);
            }
        }
        f64s(&[1, h, r.len(), w], &v)
    }

    /// Checks the gradients against finite differences, and each sequence's against
    /// AttentionGrad on that sequence alone (bottom-right causal written as a bool mask);
    /// a sequence without keys has dQ = 0, one without queries dK = dV = 0.
    fn check(&self) {
        let g = self.grads();
        let ins = self.inputs();
        for (i, name) in ["dQ", "dK", "dV"].iter().enumerate() {
            check_fd(name, &ins, i, &g[i].to_f64_vec(), &|x| self.loss(x));
        }
        let (cq, ck) = (offsets(&self.lq), offsets(&self.lk));
        for b in 0..self.lq.len() {
            let (rq, rk) = (cq[b]..cq[b + 1], ck[b]..ck[b + 1]);
            let (lq, lk) = (rq.len(), rk.len());
            let parts = [
                Varlen::unpack(&g[0], rq.clone()),
                Varlen::unpack(&g[1], rk.clone()),
                Varlen::unpack(&g[2], rk.clone()),
            ];
            if lq == 0 || lk == 0 {
                for p in &parts {
                    assert!(p.to_f64_vec().iter().all(|&x| x == 0.0), "sequence {b}");
                }
                continue;
            }
            // Query i sees key j iff j <= i + lk - lq.
            let visible: Vec<bool> = (0..lq * lk)
                .map(|x| !self.causal || x % lk + lq <= x / lk + lk)
                .collect();
            let c = Case {
                q: Varlen::unpack(&self.q, rq.clone()),
                k: Varlen::unpack(&self.k, rk.clone()),
                v: Varlen::unpack(&self.v, rk),
                mask: Some(bools(&[lq, lk], &visible)),
                dy: Varlen::unpack(&self.dy, rq),
                causal: false,
                scale: self.scale,
                heads: None,
            };
            for (k, (got, want)) in parts.iter().zip(c.grads(DType::F64)).enumerate() {
                let e = rel_err(&got.to_f64_vec(), &want.to_f64_vec());
                assert!(e <= 1e-12, "sequence {b} gradient {k}: rel err {e:.3e}");
            }
        }
    }
}

#[test]
fn varlen_grad_with_an_empty_sequence() {
    for causal in [false, true] {
        let mut c = Varlen::new(&[5, 0, 9, 3], &[7, 0, 6, 3], 2, 2, 8, 8, 400);
        c.causal = causal;
        c.check();
    }
}

#[test]
fn varlen_grad_gqa_sequences_without_queries_or_keys() {
    for causal in [false, true] {
        let mut c = Varlen::new(&[6, 4, 0, 5], &[4, 0, 3, 5], 4, 2, 8, 6, 410);
        c.causal = causal;
        c.scale = Some(0.375);
        c.check();
    }
}

#[test]
fn varlen_grad_crosses_block_boundaries() {
    let mut c = Varlen::new(&[70, 3], &[130, 3], 2, 1, 8, 8, 420);
    c.causal = true;
    c.check();
}

#[test]
fn varlen_lse_output() {
    let (lq, lk) = ([5usize, 0, 9, 4], [7usize, 3, 6, 0]);
    let (hq, hkv, d) = (4, 2, 8);
    let mut c = Varlen::new(&lq, &lk, hq, hkv, d, d, 430);
    c.causal = true;
    let scale = 1.0 / (d as f64).sqrt();
    let (qd, kd) = (c.q.to_f64_vec(), c.k.to_f64_vec());
    let (cq, ck) = (offsets(&lq), offsets(&lk));
    let mut want = vec![0.0; cq[4] * hq];
    for b in 0..4 {
        for i in 0..lq[b] {
            for h in 0..hq {
                let qi = &qd[((cq[b] + i) * hq + h) * d..][..d];
                let s: Vec<f64> = (0..lk[b])
                    .filter(|&j| (j + lq[b]) as i64 <= (i + lk[b]) as i64) // bottom-right
                    .map(|j| scale * dot(qi, &kd[((ck[b] + j) * hkv + h / 2) * d..][..d]))
                    .collect();
                want[(cq[b] + i) * hq + h] = logsumexp(&s);
            }
        }
    }
    let lse = &c.forward(&c.inputs())[1];
    assert_eq!(lse.shape(), &[cq[4], hq]);
    let e = rel_err(&lse.to_f64_vec(), &want);
    assert!(e <= 1e-12, "LSE rel err {e:.3e}");
}

#[test]
fn grad_empty_sequences() {
    // No queries: dK = dV = 0. No keys: Y = 0, LSE = −inf, dQ = 0.
    let g = Case::new(1, 2, 1, 0, 5, 8, 8).grads(DType::F32);
    assert_eq!(g[1].shape(), &[1, 1, 5, 8]);
    assert!(g[1..]
        .iter()
        .all(|t| t.to_f64_vec().iter().all(|&x| x == 0.0)));
    let c = Case::new(1, 2, 1, 4, 0, 8, 8);
    let fwd = c.forward(&c.inputs(), DType::F32);
    assert!(fwd[0].to_f64_vec().iter().all(|&x| x == 0.0));
    assert!(fwd[1].to_f64_vec().iter().all(|&x| x == f64::NEG_INFINITY));
    let g = c.grads(DType::F32);
    assert_eq!(g[0].shape(), &[1, 2, 4, 8]);
    assert!(g[0].to_f64_vec().iter().all(|&x| x == 0.0));
}

/// The 3-D form's gradients are the 4-D form's, packed (dMask and LSE unchanged), and
/// pass finite differences themselves.
fn check_packed(c: Case) {
    let g4 = c.grads(DType::F64);
    let p = c.clone().packed();
    let g3 = p.check_fd();
    p.check_dtypes();
    for (k, (a, b)) in g3.iter().zip(&g4).enumerate() {
        let b = if k < 3 { pack_heads(b) } else { b.clone() };
        assert_eq!(a.shape(), b.shape(), "gradient {k}");
        let e = rel_err(&a.to_f64_vec(), &b.to_f64_vec());
        assert!(e <= 1e-12, "gradient {k}: 3-D differs from 4-D by {e:.1e}");
    }
    let (l3, l4) = (
        p.forward(&p.inputs(), DType::F64),
        c.forward(&c.inputs(), DType::F64),
    );
    assert_eq!(
        l3[1].to_f64_vec(),
        l4[1].to_f64_vec(),
        "LSE is [B, Hq, Sq] in both forms"
    );
}

#[test]
fn grad_3d() {
    check_packed(Case::new(2, 2, 2, 5, 7, 8, 8));
    check_packed(Case::new(1, 2, 2, 9, 13, 8, 8).causal());
    check_packed(Case::new(1, 2, 2, 13, 9, 8, 8).causal());
}

#[test]
fn grad_3d_gqa_masks_dv() {
    check_packed(Case::new(2, 4, 2, 6, 10, 8, 8));
    let m = rand(&[1, 4, 6, 10], 340, -1.0, 1.0);
    check_packed(Case::new(2, 4, 2, 6, 10, 8, 8).mask(m));
    let mut bm = rand_bools(6 * 10, 341, 0.7);
    bm[2 * 10..3 * 10].fill(false); // a row that sees nothing
    check_packed(
        Case::new(2, 2, 1, 6, 10, 8, 8)
            .causal()
            .mask(bools(&[6, 10], &bm)),
    );
    check_packed(Case::new(1, 4, 2, 7, 9, 8, 5).scale(0.375));
    // Several query and key blocks of the CPU kernels.
    check_packed(Case::new(1, 2, 1, 70, 90, 4, 4).causal());
}

/// The packed-QKV form (K and V omitted): dQKV (output 0) is the 3-D form's dQ, dK and dV
/// joined on the last axis, passes finite differences itself (of Σ dY∘Attention(QKV)), and
/// f32/f16/bf16 agree with f64; dMask beside it; naming output 1 or 2 is an error.
fn check_qkv(c: Case) {
    let p = c.packed();
    let g3 = p.grads(DType::F64);
    let x = concat_last(&[&p.q, &p.k, &p.v]);
    let op_ = |name: &str| attn_heads(name, p.causal, p.scale, p.heads);
    let fwd = |x: &Tensor, dt: DType| -> Vec<Tensor> {
        let mut ins = vec![Some(x.cast(dt)), None, None];
        ins.push(cast_opt(&p.mask, dt));
        run(op_("Attention"), &ins, &["y", "lse"]).unwrap_or_else(|e| panic!("{e}"))
    };
    let dmask = p.mask.as_ref().is_some_and(|m| m.dtype().is_float());
    let outs: &[&str] = if dmask {
        &["dqkv", "", "", "dmask"]
    } else {
        &["dqkv"]
    };
    let grads = |x: &Tensor, dy: &Tensor, dt: DType| -> Vec<Tensor> {
        let f = fwd(x, dt);
        let mut ins = vec![Some(dy.cast(dt)), Some(x.cast(dt)), None, None];
        ins.extend(f.into_iter().map(Some));
        ins.push(cast_opt(&p.mask, dt));
        run(op_("AttentionGrad"), &ins, outs).unwrap_or_else(|e| panic!("{e}"))
    };
    let g = grads(&x, &p.dy, DType::F64);
    let want = concat_last(&[&g3[0], &g3[1], &g3[2]]);
    assert_eq!(g[0].shape(), want.shape());
    let e = rel_err(&g[0].to_f64_vec(), &want.to_f64_vec());
    assert!(e <= 1e-12, "dQKV differs from the 3-D form's by {e:.1e}");
    if dmask {
        assert_eq!(g[3].to_f64_vec(), g3[3].to_f64_vec(), "dMask");
    }
    let loss = |ins: &[Option<Tensor>]| -> f64 {
        let y = fwd(ins[0].as_ref().unwrap(), DType::F64)[0].to_f64_vec();
        y.iter().zip(p.dy.to_f64_vec()).map(|(a, b)| a * b).sum()
    };
    check_fd("dQKV", &[Some(x.clone())], 0, &g[0].to_f64_vec(), &loss);
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let r = |t: &Tensor| t.cast(dt).cast(DType::F64);
        let want = grads(&r(&x), &r(&p.dy), DType::F64);
        let got = grads(&x, &p.dy, dt);
        let e = rel_err(&got[0].to_f64_vec(), &want[0].to_f64_vec());
        assert!(e <= tol(dt), "{dt} dQKV: rel err {e:.3e}");
    }
    let mut ins = vec![Some(p.dy.clone()), Some(x.clone()), None, None];
    ins.extend(fwd(&x, DType::F64).into_iter().map(Some));
    let e = run(op_("AttentionGrad"), &ins, &["dqkv", "dk", ""])
        .unwrap_err()
        .to_string();
    assert!(e.contains("outputs 1 and 2 must be omitted"), "{e}");
}

#[test]
fn grad_packed_qkv() {
    check_qkv(Case::new(2, 2, 2, 7, 7, 8, 8).causal());
    check_qkv(Case::new(1, 4, 2, 9, 9, 4, 4));
    let m = rand(&[1, 2, 6, 6], 350, -1.0, 1.0);
    check_qkv(Case::new(2, 2, 2, 6, 6, 4, 4).mask(m));
}
