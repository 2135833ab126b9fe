//! RNN, GRU and LSTM as compositions of graphrun's ops: the recurrence unrolled, one step
//! of small ops per time step, with the input projection of every step done before the
//! loop as one MatMul. Every backend then runs them and autodiff differentiates them
//! through their parts (backpropagation through time falls out of the unrolled graph).
//!
//! Unrolling needs the sequence length when the model is loaded. The importer therefore
//! writes these nodes after shape inference (`graph::lower::lower_all`), where a length
//! that the model's input shapes fix is known even when the exporter declared no
//! intermediate types (as the TorchScript exporter does not).
//!
//! ReverseSequence (also what a reverse direction with `sequence_lens` needs) is a
//! GatherElements whose indices reverse each batch entry's first `len` steps.

use super::composite::{bin, output, shape, squeeze, un, unsqueeze, Attrs};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::AttrValue;
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// The recurrent ops, written after shape inference.
pub(super) const RECURRENT: &[&str] = &["RNN", "GRU", "LSTM"];

/// The longest sequence unrolled: each step is a dozen or so nodes per direction, and a
/// model file (or a fed shape) could otherwise ask for any number of them.
pub(super) const MAX_STEPS: usize = 16_384;

/// ReverseSequence, written here as well.
pub(super) const REVERSE_SEQUENCE: &str = "ReverseSequence";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Cell {
    Rnn,
    Gru { linear_before_reset: bool },
    Lstm { input_forget: bool },
}

impl Cell {
    /// Gates per step: the rows of W and R are this many blocks of hidden_size.
    fn gates(self) -> usize {
        match self {
            Cell::Rnn => 1,
            Cell::Gru { .. } => 3,
            Cell::Lstm { .. } => 4,
        }
    }
    /// The activation functions of one direction, by default (f, then g, then h).
    fn default_acts(self) -> &'static [&'static str] {
        match self {
            Cell::Rnn => &["Tanh"],
            Cell::Gru { .. } => &["Sigmoid", "Tanh"],
            Cell::Lstm { .. } => &["Sigmoid", "Tanh", "Tanh"],
        }
    }
    /// Inputs (all, the first three required) and outputs.
    fn arity(self) -> (usize, usize) {
        match self {
            Cell::Lstm { .. } => (8, 3),
            _ => (6, 2),
        }
    }
}

/// One of the activation functions the recurrent ops name.
#[derive(Clone, Copy, Debug)]
enum Act {
    Map(UnaryOp),
    /// alpha · x + beta
    Affine(f32, f32),
    /// alpha · tanh(beta · x)
    ScaledTanh(f32, f32),
}

/// The activation named `name` (case as ONNX Runtime takes it: any), taking its alpha and
/// beta from the front of the lists as far as it uses them (ONNX Runtime's reading of
/// "consumed in the order of activation functions"), else the operator's defaults.
fn activation(
    name: &str,
    alphas: &mut std::slice::Iter<f32>,
    betas: &mut std::slice::Iter<f32>,
    what: &str,
) -> Result<Act> {
    let mut alpha = |d: f32| alphas.next().copied().unwrap_or(d);
    let act = match name.to_ascii_lowercase().as_str() {
        "relu" => Act::Map(UnaryOp::Relu),
        "tanh" => Act::Map(UnaryOp::Tanh),
        "sigmoid" => Act::Map(UnaryOp::Sigmoid),
        "softsign" => Act::Map(UnaryOp::Softsign),
        "softplus" => Act::Map(UnaryOp::Softplus),
        "leakyrelu" => Act::Map(UnaryOp::LeakyRelu { alpha: alpha(0.01) }),
        "thresholdedrelu" => Act::Map(UnaryOp::ThresholdedRelu { alpha: alpha(1.0) }),
        "elu" => Act::Map(UnaryOp::Elu { alpha: alpha(1.0) }),
        "hardsigmoid" => {
            let a = alpha(0.2);
            Act::Map(UnaryOp::HardSigmoid {
                alpha: a,
                beta: betas.next().copied().unwrap_or(0.5),
            })
        }
        "affine" => {
            let a = alpha(1.0);
            Act::Affine(a, betas.next().copied().unwrap_or(0.0))
        }
        "scaledtanh" => {
            let a = alpha(1.0);
            Act::ScaledTanh(a, betas.next().copied().unwrap_or(1.0))
        }
        _ => {
            return Err(Error::Graph(format!(
                "{what}: unknown activation '{name}' (the recurrent ops take Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, Elu, Softsign, Softplus)"
            )))
        }
    };
    Ok(act)
}

/// What one direction's steps read, made once before the loop.
struct Direction {
    /// X·Wᵀ (+ the biases that add outside the recurrence), `[S, B, G·H]` (layout 0)
    /// or `[B, S, G·H]`, reversed per batch entry where the direction runs backwards
    /// over `sequence_lens`.
    xw: String,
    /// Rᵀ, `[H, G·H]`; for GRU without linear_before_reset, `[Rzᵀ | Rrᵀ]` and `Rhᵀ`.
    rt: String,
    rht: Option<String>,
    /// GRU with linear_before_reset: R's bias, added inside the step.
    rb: Option<String>,
    /// LSTM's peepholes (input, output, forget), each `[H]`.
    peep: Option<[String; 3]>,
    acts: Vec<Act>,
}

impl Importer<'_> {
    /// RNN, GRU or LSTM (any opset: layout from 14 on), unrolled.
    pub(super) fn recurrent(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let cell = match n.op_type.as_str() {
            "RNN" => Cell::Rnn,
            "GRU" => Cell::Gru {
                linear_before_reset: a.flag("linear_before_reset")?,
            },
            _ => Cell::Lstm {
                input_forget: a.flag("input_forget")?,
            },
        };
        let alphas = a.floats("activation_alpha")?;
        let betas = a.floats("activation_beta")?;
        let names = match a.take("activations") {
            None => None,
            Some(AttrValue::Strs(v)) => Some(v),
            Some(AttrValue::Str(s)) => Some(vec![s]),
            Some(v) => return Err(a.wrong("activations", "a list of strings", &v)),
        };
        let clip = match a.take("clip") {
            None => None,
            Some(AttrValue::Float(v)) if v > 0.0 => Some(v as f32),
            Some(v) => return Err(a.wrong("clip", "a positive float", &v)),
        };
        let direction = a.string("direction", "forward")?;
        let hidden = a.opt_int("hidden_size")?;
        let layout = a.int("layout", 0)?;
        a.finish()?;
        let reversed: &[bool] = match direction.as_str() {
            "forward" => &[false],
            "reverse" => &[true],
            "bidirectional" => &[false, true],
            d => {
                return Err(a.refuse(
                    "direction",
                    &format!("must be forward, reverse or bidirectional, got '{d}'"),
                ))
            }
        };
        let dirs = reversed.len();
        // Time and batch axes of X, Y's layout.
        let (ta, ba) = match layout {
            0 => (0usize, 1usize),
            1 => (1, 0),
            l => return Err(a.refuse("layout", &format!("must be 0 or 1, got {l}"))),
        };
        let (most_in, most_out) = cell.arity();
        let given = |v: &[String]| v.iter().rposition(|s| !s.is_empty()).map_or(0, |i| i + 1);
        if given(&n.input) < 3
            || n.input.len() > most_in
            || n.input[..3].iter().any(String::is_empty)
            || n.output.len() > most_out
            || given(&n.output) == 0
        {
            return Err(Error::Graph(format!(
                "{what} takes 3 to {most_in} inputs (X, W, R required) and up to {most_out} outputs (at least one named), got {} inputs and {} outputs",
                given(&n.input),
                n.output.len()
            )));
        }
        let opt = |k: usize| n.input.get(k).filter(|s| !s.is_empty()).cloned();
        let [x, w, r] = [0, 1, 2].map(|k| n.input[k].clone());
        let (bias, lens, h0) = (opt(3), opt(4), opt(5));
        let (c0, peep) = (opt(6), opt(7));

        // The sizes the unrolling needs.
        let xdims = self.dims.get(&x).cloned().unwrap_or_default();
        if self.ranks.get(&x).is_some_and(|&r| r != 3) {
            return Err(Error::Graph(format!(
                "{what}: X ('{x}') must have rank 3 ([seq, batch, input] with layout 0, [batch, seq, input] with layout 1)"
            )));
        }
        let Some(steps) = xdims.get(ta).copied().flatten() else {
            let axis = if layout == 0 { "first" } else { "second" };
            return Err(Error::Graph(format!(
                "{what}: graphrun unrolls a recurrence, one step per time step, so it needs the sequence length (the {axis} dim of X, '{x}') when the model is loaded, and here it follows a symbolic input dim: give the shapes that will be fed when loading (the command line takes them from the --input files and --dim; the library from ImportOptions), or export the model with a fixed sequence length"
            )));
        };
        if steps > MAX_STEPS {
            return Err(Error::Graph(format!(
                "{what}: X ('{x}') has {steps} time steps; graphrun unrolls a recurrence and takes up to {MAX_STEPS} steps"
            )));
        }
        if steps == 0 {
            return Err(Error::Graph(format!("{what}: X ('{x}') has no time steps")));
        }
        let rdims = self.dims.get(&r).cloned().unwrap_or_default();
        let h = match (hidden, rdims.get(2).copied().flatten()) {
            (Some(h), Some(rh)) if h as usize != rh => {
                return Err(Error::Graph(format!(
                    "{what}: hidden_size is {h} but R ('{r}') is [.., .., {rh}]"
                )))
            }
            (Some(h), _) if h > 0 => h as usize,
            (None, Some(rh)) => rh,
            _ => {
                return Err(Error::Graph(format!(
                "{what}: the hidden size is not known (give hidden_size, or R with a known shape)"
            )))
            }
        };
        for (v, name, rows) in [(&w, "W", cell.gates() * h), (&r, "R", cell.gates() * h)] {
            if let Some(d) = self.dims.get(v) {
                let ok = d.len() == 3
                    && d[0].is_none_or(|k| k == dirs)
                    && d[1].is_none_or(|k| k == rows);
                if !ok {
                    return Err(Error::Graph(format!(
                        "{what}: {name} ('{v}') must be [{dirs}, {rows}, ..] for {direction} with hidden size {h}"
                    )));
                }
            }
        }
        let k = cell.default_acts().len();
        let names = names.unwrap_or_else(|| {
            (0..dirs)
                .flat_map(|_| cell.default_acts().iter().map(|s| s.to_string()))
                .collect()
        });
        let names: Vec<String> = match names.len() {
            l if l == k * dirs => names,
            // One set for both directions.
            l if l == k => names.iter().chain(&names).cloned().collect(),
            l => {
                return Err(Error::Graph(format!(
                    "{what}: 'activations' lists {l} functions; {} takes {k} per direction ({})",
                    n.op_type,
                    k * dirs
                )))
            }
        };
        let (mut al, mut be) = (alphas.iter(), betas.iter());
        let acts: Vec<Act> = names
            .iter()
            .map(|s| activation(s, &mut al, &mut be, what))
            .collect::<Result<_>>()?;

        // Shared by the directions: the masks of `sequence_lens` (left out where the
        // lengths are a known constant of at least `steps`), clip's bounds.
        let lens = lens.filter(|l| {
            !self
                .small
                .get(l)
                .is_some_and(|t| t.to_i64_vec().iter().all(|&v| v >= steps as i64))
        });
        let lens64 = lens
            .as_ref()
            .map(|l| self.val(n, "lens64", Op::Cast { to: DType::I64 }, vec![l.clone()]));
        let mask = match &lens64 {
            Some(l) => {
                let t: Vec<i64> = (0..steps as i64).collect();
                let t = self.constant(n, "steps", Tensor::from_vec(&[steps, 1], t)?);
                let l = self.val(n, "lens_row", unsqueeze(0), vec![l.clone()]);
                let m = self.bin2(n, "valid", BinaryOp::Less, t, l);
                Some(self.val(n, "mask", unsqueeze(2), vec![m]))
            }
            None => None,
        };
        let clip = clip.map(|c| {
            (
                self.float_like(n, "clip_lo", -c, &x),
                self.float_like(n, "clip_hi", c, &x),
            )
        });
        let zero = match mask {
            Some(_) => self.float_like(n, "zero", 0.0, &x),
            None => String::new(),
        };
        let one = match cell {
            Cell::Lstm { input_forget: true } => self.float_like(n, "one", 1.0, &x),
            _ => String::new(),
        };
        let state_axis = if layout == 0 { 0 } else { 1 };

        let mut ys = vec![];
        let mut hs = vec![];
        let mut cs = vec![];
        for (d, &backwards) in reversed.iter().enumerate() {
            let tag = format!("d{d}");
            let dc = self.constant(n, &tag, Tensor::scalar(d as i64));
            let pick = |im: &mut Self, v: &str, what: &str, axis: i64| {
                im.val(
                    n,
                    &format!("{tag}_{what}"),
                    Op::Gather { axis },
                    vec![v.to_string(), dc.clone()],
                )
            };
            let wd = pick(self, &w, "w", 0);
            let wt = self.val(n, &format!("{tag}_wt"), transpose2(), vec![wd]);
            let mut xw = self.val(n, &format!("{tag}_xw"), Op::MatMul, vec![x.clone(), wt]);
            let rd = pick(self, &r, "r", 0);
            let mut rb = None;
            if let Some(b) = &bias {
                let bd = pick(self, b, "b", 0);
                let halves = self.vals(n, &format!("{tag}_b"), split(0, 2), vec![bd], 2);
                let [wb, rbd] = [halves[0].clone(), halves[1].clone()];
                let add = if matches!(
                    cell,
                    Cell::Gru {
                        linear_before_reset: true
                    }
                ) {
                    rb = Some(rbd);
                    wb
                } else {
                    self.bin2(n, &format!("{tag}_bias"), BinaryOp::Add, wb, rbd)
                };
                xw = self.bin2(n, &format!("{tag}_xwb"), BinaryOp::Add, xw, add);
            }
            let (rt, rht) = if matches!(
                cell,
                Cell::Gru {
                    linear_before_reset: false
                }
            ) {
                let sizes = vec![2 * h as i64, h as i64];
                let parts = self.vals(
                    n,
                    &format!("{tag}_r"),
                    Op::Split {
                        axis: 0,
                        split: Some(sizes),
                        num_outputs: None,
                    },
                    vec![rd],
                    2,
                );
                let zr = self.val(
                    n,
                    &format!("{tag}_rzrt"),
                    transpose2(),
                    vec![parts[0].clone()],
                );
                let hh = self.val(
                    n,
                    &format!("{tag}_rht"),
                    transpose2(),
                    vec![parts[1].clone()],
                );
                (zr, Some(hh))
            } else {
                (
                    self.val(n, &format!("{tag}_rt"), transpose2(), vec![rd]),
                    None,
                )
            };
            let peep = match &peep {
                Some(p) => {
                    let pd = pick(self, p, "p", 0);
                    let v = self.vals(n, &format!("{tag}_p"), split(0, 3), vec![pd], 3);
                    Some([v[0].clone(), v[1].clone(), v[2].clone()])
                }
                None => None,
            };
            // Backwards over `sequence_lens`: each batch entry's own first `len` steps
            // reversed, run forwards, and the outputs reversed back.
            let flip = backwards && lens64.is_some();
            if let (true, Some(l)) = (flip, &lens64) {
                xw = self.reverse_sequence(n, &format!("{tag}_xw_rev"), &xw, l, 3, ba, ta)?;
            }
            let dir = Direction {
                xw,
                rt,
                rht,
                rb,
                peep,
                acts: acts[d * k..(d + 1) * k].to_vec(),
            };
            let initial = |im: &mut Self, given: &Option<String>, what: &str| match given {
                Some(v) => Ok(pick(im, v, what, state_axis)),
                None => im.zeros(n, &format!("{tag}_{what}"), &x, ba, h),
            };
            let mut hv = initial(self, &h0, "h0")?;
            let mut cv = match cell {
                Cell::Lstm { .. } => Some(initial(self, &c0, "c0")?),
                _ => None,
            };
            let order: Vec<usize> = if backwards && !flip {
                (0..steps).rev().collect()
            } else {
                (0..steps).collect()
            };
            let mut y = vec![String::new(); steps];
            for t in order {
                let st = format!("{tag}_t{t}");
                let tc = self.constant(n, &format!("{st}_index"), Tensor::scalar(t as i64));
                let xg = self.val(
                    n,
                    &format!("{st}_x"),
                    Op::Gather { axis: ta as i64 },
                    vec![dir.xw.clone(), tc.clone()],
                );
                let (hn, cn) =
                    self.step(n, &st, cell, &dir, &clip, &one, xg, &hv, cv.as_deref())?;
                match &mask {
                    Some(m) => {
                        let mt = self.val(
                            n,
                            &format!("{st}_mask"),
                            Op::Gather { axis: 0 },
                            vec![m.clone(), tc],
                        );
                        let keep = |im: &mut Self, new: String, old: &str, what: &str| {
                            im.val(
                                n,
                                &format!("{st}_{what}"),
                                Op::Where,
                                vec![mt.clone(), new, old.to_string()],
                            )
                        };
                        y[t] = keep(self, hn.clone(), &zero, "y");
                        hv = keep(self, hn, &hv, "h_kept");
                        if let (Some(c), Some(cn)) = (&cv, cn) {
                            cv = Some(keep(self, cn, c, "c_kept"));
                        }
                    }
                    None => {
                        y[t] = hn.clone();
                        hv = hn;
                        cv = cn;
                    }
                }
            }
            // [S·B, H] → [S, 1, B, H]
            let flat = self.val(n, &format!("{tag}_y_flat"), Op::Concat { axis: 0 }, y);
            let to = self.ints_const(
                n,
                &format!("{tag}_y_shape"),
                &[steps as i64, 1, -1, h as i64],
            )?;
            let mut yd = self.val(
                n,
                &format!("{tag}_y"),
                super::composite::reshape(),
                vec![flat, to],
            );
            if let (true, Some(l)) = (flip, &lens64) {
                yd = self.reverse_sequence(n, &format!("{tag}_y_rev"), &yd, l, 4, 2, 0)?;
            }
            ys.push(yd);
            hs.push(self.val(n, &format!("{tag}_h_last"), unsqueeze(0), vec![hv]));
            if let Some(c) = cv {
                cs.push(self.val(n, &format!("{tag}_c_last"), unsqueeze(0), vec![c]));
            }
        }
        // Y [S, D, B, H] (layout 1: [B, S, D, H]); Y_h and Y_c [D, B, H] ([B, D, H]).
        let outs = [
            (ys, 1i64, [2usize, 0, 1, 3].as_slice()),
            (hs, 0, &[1, 0, 2]),
            (cs, 0, &[1, 0, 2]),
        ];
        for (k, (parts, axis, perm)) in outs.into_iter().enumerate() {
            if output(n, k).is_none() {
                continue;
            }
            let joined = match parts.len() {
                1 if layout == 0 => {
                    self.out(n, k, Op::Identity, parts);
                    continue;
                }
                1 => parts.into_iter().next().expect("one part"),
                _ if layout == 0 => {
                    self.out(n, k, Op::Concat { axis }, parts);
                    continue;
                }
                _ => self.val(n, &format!("out{k}_joined"), Op::Concat { axis }, parts),
            };
            let perm = Some(perm.to_vec());
            self.out(n, k, Op::Transpose { perm }, vec![joined]);
        }
        Ok(())
    }

    /// One time step: the new hidden state (and LSTM's new cell state) from the step's
    /// input projection `xg` `[B, G·H]` and the previous state.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        n: &NodeProto,
        st: &str,
        cell: Cell,
        dir: &Direction,
        clip: &Option<(String, String)>,
        one: &str,
        xg: String,
        hv: &str,
        cv: Option<&str>,
    ) -> Result<(String, Option<String>)> {
        let h = hv.to_string();
        match cell {
            Cell::Rnn => {
                let hr = self.val(n, &format!("{st}_hr"), Op::MatMul, vec![h, dir.rt.clone()]);
                let pre = self.bin2(n, &format!("{st}_pre"), BinaryOp::Add, xg, hr);
                let hn = self.act(n, &format!("{st}_h"), dir.acts[0], pre, clip)?;
                Ok((hn, None))
            }
            Cell::Gru {
                linear_before_reset,
            } => {
                let xs = self.vals(n, &format!("{st}_x"), split(1, 3), vec![xg], 3);
                let (hz, hr, hh) = if linear_before_reset {
                    let mut all = self.val(
                        n,
                        &format!("{st}_hr"),
                        Op::MatMul,
                        vec![h.clone(), dir.rt.clone()],
                    );
                    if let Some(rb) = &dir.rb {
                        all = self.bin2(n, &format!("{st}_hrb"), BinaryOp::Add, all, rb.clone());
                    }
                    let p = self.vals(n, &format!("{st}_hparts"), split(1, 3), vec![all], 3);
                    (p[0].clone(), p[1].clone(), Some(p[2].clone()))
                } else {
                    let zr = self.val(
                        n,
                        &format!("{st}_hzr"),
                        Op::MatMul,
                        vec![h.clone(), dir.rt.clone()],
                    );
                    let p = self.vals(n, &format!("{st}_hparts"), split(1, 2), vec![zr], 2);
                    (p[0].clone(), p[1].clone(), None)
                };
                let [f, g] = [dir.acts[0], dir.acts[1]];
                let z = self.bin2(n, &format!("{st}_zpre"), BinaryOp::Add, xs[0].clone(), hz);
                let z = self.act(n, &format!("{st}_z"), f, z, clip)?;
                let rr = self.bin2(n, &format!("{st}_rpre"), BinaryOp::Add, xs[1].clone(), hr);
                let rr = self.act(n, &format!("{st}_r"), f, rr, clip)?;
                let inner = match hh {
                    // r ⊙ (H·Rhᵀ + Rbh)
                    Some(hh) => self.bin2(n, &format!("{st}_rh"), BinaryOp::Mul, rr, hh),
                    // (r ⊙ H)·Rhᵀ
                    None => {
                        let rh = self.bin2(n, &format!("{st}_rh"), BinaryOp::Mul, rr, h.clone());
                        let rht = dir.rht.clone().expect("GRU's Rhᵀ");
                        self.val(n, &format!("{st}_rhr"), Op::MatMul, vec![rh, rht])
                    }
                };
                let pre = self.bin2(
                    n,
                    &format!("{st}_hpre"),
                    BinaryOp::Add,
                    xs[2].clone(),
                    inner,
                );
                let cand = self.act(n, &format!("{st}_cand"), g, pre, clip)?;
                // (1 − z) ⊙ h̃ + z ⊙ H = h̃ + z ⊙ (H − h̃)
                let diff = self.bin2(n, &format!("{st}_diff"), BinaryOp::Sub, h, cand.clone());
                let zd = self.bin2(n, &format!("{st}_zdiff"), BinaryOp::Mul, z, diff);
                let hn = self.bin2(n, &format!("{st}_h"), BinaryOp::Add, cand, zd);
                Ok((hn, None))
            }
            Cell::Lstm { input_forget } => {
                let c = cv.expect("LSTM's cell state").to_string();
                let hr = self.val(n, &format!("{st}_hr"), Op::MatMul, vec![h, dir.rt.clone()]);
                let pre = self.bin2(n, &format!("{st}_pre"), BinaryOp::Add, xg, hr);
                let g4 = self.vals(n, &format!("{st}_gates"), split(1, 4), vec![pre], 4);
                let [mut i, mut o, mut f, gc] = [0, 1, 2, 3].map(|k| g4[k].clone());
                let [fa, ga, ha] = [dir.acts[0], dir.acts[1], dir.acts[2]];
                if let Some([pi, _, pf]) = &dir.peep {
                    i = self.peep(n, &format!("{st}_ipeep"), i, pi, &c);
                    f = self.peep(n, &format!("{st}_fpeep"), f, pf, &c);
                }
                // input_forget couples the gates as ONNX Runtime does: f = 1 − i.
                let i = self.act(n, &format!("{st}_i"), fa, i, clip)?;
                let f = if input_forget {
                    self.bin2(
                        n,
                        &format!("{st}_f"),
                        BinaryOp::Sub,
                        one.to_string(),
                        i.clone(),
                    )
                } else {
                    self.act(n, &format!("{st}_f"), fa, f, clip)?
                };
                let gc = self.act(n, &format!("{st}_g"), ga, gc, clip)?;
                let fc = self.bin2(n, &format!("{st}_fc"), BinaryOp::Mul, f, c);
                let ig = self.bin2(n, &format!("{st}_ig"), BinaryOp::Mul, i, gc);
                let cn = self.bin2(n, &format!("{st}_c"), BinaryOp::Add, fc, ig);
                if let Some([_, po, _]) = &dir.peep {
                    o = self.peep(n, &format!("{st}_opeep"), o, po, &cn);
                }
                let o = self.act(n, &format!("{st}_o"), fa, o, clip)?;
                let hc = self.act(n, &format!("{st}_hc"), ha, cn.clone(), &None)?;
                let hn = self.bin2(n, &format!("{st}_h"), BinaryOp::Mul, o, hc);
                Ok((hn, Some(cn)))
            }
        }
    }

    /// `act(x)`, x clipped to the clip range first where one is given.
    fn act(
        &mut self,
        n: &NodeProto,
        what: &str,
        act: Act,
        x: String,
        clip: &Option<(String, String)>,
    ) -> Result<String> {
        let x = match clip {
            Some((lo, hi)) => self.val(
                n,
                &format!("{what}_clip"),
                Op::Clip,
                vec![x, lo.clone(), hi.clone()],
            ),
            None => x,
        };
        Ok(match act {
            Act::Map(u) => self.val(n, what, un(u), vec![x]),
            Act::Affine(a, b) | Act::ScaledTanh(a, b) => {
                let ac = self.float_like(n, &format!("{what}_alpha"), a, &x);
                let bc = self.float_like(n, &format!("{what}_beta"), b, &x);
                if let Act::Affine(..) = act {
                    let ax = self.bin2(n, &format!("{what}_scaled"), BinaryOp::Mul, x, ac);
                    self.bin2(n, what, BinaryOp::Add, ax, bc)
                } else {
                    let bx = self.bin2(n, &format!("{what}_scaled"), BinaryOp::Mul, x, bc);
                    let t = self.val(n, &format!("{what}_tanh"), un(UnaryOp::Tanh), vec![bx]);
                    self.bin2(n, what, BinaryOp::Mul, t, ac)
                }
            }
        })
    }

    /// `a op b`, a new value named as `val` names it.
    fn bin2(&mut self, n: &NodeProto, what: &str, op: BinaryOp, a: String, b: String) -> String {
        self.val(n, what, bin(op), vec![a, b])
    }

    /// A peephole: `x + p ⊙ c`.
    fn peep(&mut self, n: &NodeProto, what: &str, x: String, p: &str, c: &str) -> String {
        let pc = self.bin2(
            n,
            &format!("{what}_pc"),
            BinaryOp::Mul,
            p.to_string(),
            c.to_string(),
        );
        self.bin2(n, what, BinaryOp::Add, x, pc)
    }

    /// Zeros `[B, H]`, B being `like`'s dim `batch_axis`, in `like`'s dtype.
    fn zeros(
        &mut self,
        n: &NodeProto,
        what: &str,
        like: &str,
        batch_axis: usize,
        h: usize,
    ) -> Result<String> {
        let b = batch_axis as i64;
        let bdim = self.val(
            n,
            &format!("{what}_batch"),
            shape(b, Some(b + 1)),
            vec![like.to_string()],
        );
        let hdim = self.ints_const(n, &format!("{what}_hidden"), &[h as i64])?;
        let dims = self.val(
            n,
            &format!("{what}_shape"),
            Op::Concat { axis: 0 },
            vec![bdim, hdim],
        );
        let zero = self.float_like(n, &format!("{what}_zero"), 0.0, like);
        Ok(self.val(n, what, Op::Expand, vec![zero, dims]))
    }

    /// A node with `count` outputs, named after the node's first output.
    pub(super) fn vals(
        &mut self,
        n: &NodeProto,
        what: &str,
        op: Op,
        ins: Vec<String>,
        count: usize,
    ) -> Vec<String> {
        let out = n.output[0].clone();
        let outs: Vec<String> = (0..count)
            .map(|k| self.fresh(&format!("{out}/{what}{k}")))
            .collect();
        // Named as `val` names its nodes: after the (fresh) first output.
        self.nodes.push(crate::graph::Node {
            name: super::helper_name(n, &outs[0][out.len() + 1..]),
            op,
            inputs: ins,
            outputs: outs.clone(),
            loc: None,
        });
        outs
    }

    /// ONNX ReverseSequence: `(input, sequence_lens)`, each batch entry's first `len` steps
    /// along time_axis reversed, the rest kept.
    pub(super) fn reverse_sequence_node(
        &mut self,
        n: &NodeProto,
        what: &str,
        mut a: Attrs,
    ) -> Result<()> {
        let ba = a.int("batch_axis", 1)?;
        let ta = a.int("time_axis", 0)?;
        a.finish()?;
        let (ins, _) = super::composite::inputs(n, what, (2, 2), 1)?;
        let [x, lens] = [ins[0].clone(), ins[1].clone()];
        if !matches!((ba, ta), (0, 1) | (1, 0)) {
            return Err(Error::Graph(format!(
                "{what}: batch_axis and time_axis must be 0 and 1 in some order, got {ba} and {ta}"
            )));
        }
        let Some(&rank) = self.ranks.get(&x) else {
            return Err(Error::Graph(format!(
                "{what}: the rank of input '{x}' is not known"
            )));
        };
        if rank < 2 {
            return Err(Error::Graph(format!(
                "{what}: input '{x}' must have rank 2 or more, got {rank}"
            )));
        }
        let y = self.reverse_sequence(n, "reversed", &x, &lens, rank, ba as usize, ta as usize)?;
        self.out(n, 0, Op::Identity, vec![y]);
        Ok(())
    }

    /// x with each batch entry b's first `lens[b]` steps along `ta` reversed: the index
    /// of step t is `len − 1 − t` below len, t after it (i64 `lens`).
    #[allow(clippy::too_many_arguments)]
    fn reverse_sequence(
        &mut self,
        n: &NodeProto,
        what: &str,
        x: &str,
        lens: &str,
        rank: usize,
        ba: usize,
        ta: usize,
    ) -> Result<String> {
        let t0 = ta as i64;
        let len = self.val(
            n,
            &format!("{what}_steps"),
            shape(t0, Some(t0 + 1)),
            vec![x.to_string()],
        );
        let len = self.val(n, &format!("{what}_steps0"), squeeze(0), vec![len]);
        let start = self.constant(n, &format!("{what}_start"), Tensor::scalar(0i64));
        let one = self.constant(n, &format!("{what}_one"), Tensor::scalar(1i64));
        let t = self.val(
            n,
            &format!("{what}_t"),
            Op::Range,
            vec![start, len, one.clone()],
        );
        let along = |axis: usize| -> Vec<i64> {
            (0..rank).map(|k| if k == axis { -1 } else { 1 }).collect()
        };
        let ts = self.ints_const(n, &format!("{what}_t_shape"), &along(ta))?;
        let t = self.val(
            n,
            &format!("{what}_t_axis"),
            super::composite::reshape(),
            vec![t, ts],
        );
        let l = self.val(
            n,
            &format!("{what}_lens"),
            Op::Cast { to: DType::I64 },
            vec![lens.to_string()],
        );
        let ls = self.ints_const(n, &format!("{what}_lens_shape"), &along(ba))?;
        let l = self.val(
            n,
            &format!("{what}_lens_axis"),
            super::composite::reshape(),
            vec![l, ls],
        );
        let inside = self.bin2(
            n,
            &format!("{what}_inside"),
            BinaryOp::Less,
            t.clone(),
            l.clone(),
        );
        let last = self.bin2(n, &format!("{what}_last"), BinaryOp::Sub, l, one);
        let back = self.bin2(n, &format!("{what}_back"), BinaryOp::Sub, last, t.clone());
        let idx = self.val(
            n,
            &format!("{what}_index"),
            Op::Where,
            vec![inside, back, t],
        );
        let full = self.val(
            n,
            &format!("{what}_shape"),
            shape(0, None),
            vec![x.to_string()],
        );
        let idx = self.val(
            n,
            &format!("{what}_index_full"),
            Op::Expand,
            vec![idx, full],
        );
        Ok(self.val(
            n,
            what,
            Op::GatherElements { axis: ta as i64 },
            vec![x.to_string(), idx],
        ))
    }
}

fn transpose2() -> Op {
    Op::Transpose {
        perm: Some(vec![1, 0]),
    }
}

fn split(axis: i64, parts: usize) -> Op {
    Op::Split {
        axis,
        split: None,
        num_outputs: Some(parts),
    }
}
