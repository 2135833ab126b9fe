//! The indexing ops the importer writes as graphrun's ops, exactly and on every backend
//! (gradients included): Tile as Reshape → Expand → Reshape, OneHot as an Equal against a
//! Range and a Where, EyeLike as Range comparisons, and Einsum as Transpose, MatMul, Mul,
//! ReduceSum and (for repeated labels, a diagonal) Reshape + strided Slice, and Compress as
//! a Gather of NonZero's indices. Shape-deciding values (repeats, depth, the diagonal's
//! length, Compress's condition) flow through small nodes that the planner evaluates on
//! the host, so they may be graph inputs fed when planning.

use super::{Importer, NodeProto};
use crate::error::{Error, Result};
use crate::graph::op::{Attr, AttrValue};
use crate::graph::{BinaryOp, Op, ReduceKind};
use crate::tensor::{DType, Tensor};

/// One operand of an Einsum while it is lowered: its value and a label per dim (letters
/// as their char code, ellipsis dims as `ELLIPSIS + k`).
type Term = (String, Vec<u32>);

const ELLIPSIS: u32 = 1 << 16;

impl Importer<'_> {
    /// A helper node of `n` computing `op`; its output is a fresh value named after n's
    /// output and `what` (which also names the node, so each is used once per node).
    fn emit(&mut self, n: &NodeProto, what: &str, op: Op, ins: Vec<String>) -> String {
        let y = n.output.first().map(String::as_str).unwrap_or("onnx");
        let out = self.fresh(&format!("{y}/{what}"));
        self.push(n, what, op, ins, &out);
        out
    }

    fn i64_const(&mut self, n: &NodeProto, what: &str, v: &[i64], scalar: bool) -> Result<String> {
        let t = if scalar {
            Tensor::scalar(v[0])
        } else {
            Tensor::from_vec(&[v.len()], v.to_vec())?
        };
        Ok(self.constant(n, what, t))
    }

    /// Tile(x, repeats): x reshaped to `[1, d0, 1, d1, ...]`, expanded to
    /// `[r0, d0, r1, d1, ...]` and reshaped to `[r0·d0, r1·d1, ...]`; its gradient (Expand's)
    /// sums over the tiles.
    pub(super) fn lower_tile(&mut self, n: &NodeProto, shown: &str, attrs: &[Attr]) -> Result<()> {
        let [x, r, y] = io(n, shown, attrs, 2, &[])?;
        let shape = |s, e| Op::Shape { start: s, end: e };
        let col = || Op::Unsqueeze {
            axes: Some(vec![1]),
        };
        let reshape = || Op::Reshape { allowzero: false };
        let s = self.emit(n, "shape", shape(0, None), vec![x.clone()]);
        let rank = self.emit(n, "rank", shape(0, None), vec![s.clone()]);
        let one = self.i64_const(n, "one", &[1], true)?;
        let ones = self.emit(n, "ones", Op::Expand, vec![one, rank]);
        let flat = self.i64_const(n, "flat", &[-1], false)?;
        let sc = self.emit(n, "shape_col", col(), vec![s.clone()]);
        let oc = self.emit(n, "ones_col", col(), vec![ones]);
        let rc = self.emit(n, "repeats_col", col(), vec![r.clone()]);
        let pairs = self.emit(
            n,
            "spread_pairs",
            Op::Concat { axis: 1 },
            vec![oc, sc.clone()],
        );
        let spread = self.emit(n, "spread_shape", reshape(), vec![pairs, flat.clone()]);
        let pairs = self.emit(n, "tiled_pairs", Op::Concat { axis: 1 }, vec![rc, sc]);
        let tiled = self.emit(n, "tiled_shape", reshape(), vec![pairs, flat]);
        let xs = self.emit(n, "spread", reshape(), vec![x, spread]);
        let xt = self.emit(n, "tiled", Op::Expand, vec![xs, tiled]);
        let out = self.emit(n, "out_shape", Op::Binary(BinaryOp::Mul), vec![s, r]);
        self.push(n, "", reshape(), vec![xt, out], &y);
        Ok(())
    }

    /// TensorScatter (past_cache, update, write_indices?) -> present_cache: the update
    /// written into the cache along `axis` from each batch row's write index (0 when
    /// none), wrapping around the cache in circular mode. Per cache position p of a row
    /// written from w, the update position j = p - w (mod the cache length when
    /// circular) supplies it when 0 <= j < the update's length; every other position
    /// keeps the cache. A GatherElements of the update at j and a Where, so both the
    /// cache and the update get gradients.
    pub(super) fn lower_tensor_scatter(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: Vec<Attr>,
    ) -> Result<()> {
        use super::composite::{bin, inputs, reshape, shape, Attrs};
        let mut a = Attrs::of(n, shown, attrs)?;
        let what = a.what.clone();
        let circular = match a.string("mode", "linear")?.as_str() {
            "linear" => false,
            "circular" => true,
            m => return Err(a.refuse("mode", &format!("must be linear or circular, got '{m}'"))),
        };
        let axis = a.int("axis", -2)?;
        a.finish()?;
        let (req, opt) = inputs(n, &what, (2, 3), 1)?;
        let (past, update) = (req[0].clone(), req[1].clone());
        let Some(&r) = self.ranks.get(&past).or_else(|| self.ranks.get(&update)) else {
            return Err(Error::Graph(format!(
                "{what}: the rank of past_cache is unknown: declare it (a value_info or input type)"
            )));
        };
        let ax = if axis < 0 { axis + r as i64 } else { axis };
        if !(1..r as i64).contains(&ax) {
            return Err(a.refuse(
                "axis",
                &format!(
                    "must name an axis after the batch axis of the rank-{r} cache, got {axis}"
                ),
            ));
        }
        let ax_u = ax as usize;
        let cache_len = self.emit(n, "cache_len", shape(ax, Some(ax + 1)), vec![past.clone()]);
        let upd_len = self.emit(
            n,
            "update_len",
            shape(ax, Some(ax + 1)),
            vec![update.clone()],
        );
        let zero = self.i64_const(n, "zero", &[0], true)?;
        let one = self.i64_const(n, "one", &[1], true)?;
        let len_s = self.emit(
            n,
            "cache_len_scalar",
            super::composite::squeeze(0),
            vec![cache_len.clone()],
        );
        let pos = self.emit(n, "positions", Op::Range, vec![zero, len_s, one]);
        // j as [B or 1, cache length].
        let row = self.i64_const(n, "row", &[1, -1], false)?;
        let pos = self.emit(n, "positions_row", reshape(), vec![pos, row]);
        let j = match opt.first().cloned().flatten() {
            None => pos,
            Some(w) => {
                let col = self.i64_const(n, "col", &[-1, 1], false)?;
                let w = self.emit(n, "write_at", Op::Cast { to: DType::I64 }, vec![w]);
                let w = self.emit(n, "write_col", reshape(), vec![w, col]);
                self.emit(n, "offsets", bin(BinaryOp::Sub), vec![pos, w])
            }
        };
        let j = if circular {
            self.emit(n, "wrapped", bin(BinaryOp::Mod), vec![j, cache_len.clone()])
        } else {
            j
        };
        let zero1 = self.i64_const(n, "zero_1d", &[0], false)?;
        let ge = self.emit(
            n,
            "from_start",
            bin(BinaryOp::GreaterOrEqual),
            vec![j.clone(), zero1.clone()],
        );
        let lt = self.emit(
            n,
            "before_end",
            bin(BinaryOp::Less),
            vec![j.clone(), upd_len.clone()],
        );
        let written = self.emit(n, "written", bin(BinaryOp::And), vec![ge, lt]);
        let one1 = self.i64_const(n, "one_1d", &[1], false)?;
        let last = self.emit(
            n,
            "update_last",
            bin(BinaryOp::Sub),
            vec![upd_len, one1.clone()],
        );
        let jc = self.emit(n, "at_least_0", bin(BinaryOp::Max), vec![j, zero1]);
        let jc = self.emit(n, "clamped", bin(BinaryOp::Min), vec![jc, last]);
        // Viewed as [B, 1, .., L, .., 1] (L at the axis) and spread over the cache.
        let mut view = vec![self.emit(n, "rows", shape(0, Some(1)), vec![jc.clone()])];
        for d in 1..r {
            view.push(if d == ax_u {
                cache_len.clone()
            } else {
                one1.clone()
            });
        }
        let view = self.emit(n, "view", Op::Concat { axis: 0 }, view);
        let full = self.emit(n, "cache_shape", shape(0, None), vec![past.clone()]);
        let jv = self.emit(n, "index_view", reshape(), vec![jc, view.clone()]);
        let jv = self.emit(n, "index", Op::Expand, vec![jv, full.clone()]);
        let mv = self.emit(n, "mask_view", reshape(), vec![written, view]);
        let mv = self.emit(n, "mask", Op::Expand, vec![mv, full]);
        let taken = self.emit(
            n,
            "taken",
            Op::GatherElements { axis: ax },
            vec![update, jv],
        );
        self.push(n, "", Op::Where, vec![mv, taken, past], &n.output[0]);
        Ok(())
    }

    /// Compress(x, condition, axis) = Gather(x, Squeeze(NonZero(condition), 0), axis), x
    /// flattened first when there is no axis; a condition shorter than the axis keeps
    /// nothing past its end, as ONNX defines. NonZero's output decides the shape, so the
    /// condition must be known when the plan is made (a graph input fed when planning, or
    /// computed from one on the host): NonZero then runs on the host and the indices are a
    /// constant of the plan, while the Gather runs on every backend. The gradient is
    /// Gather's: dY scattered back to the kept positions, zero elsewhere.
    pub(super) fn lower_compress(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: &[Attr],
    ) -> Result<()> {
        let [x, cond, y] = io(n, shown, attrs, 2, &["axis"])?;
        let axis = int_attr(attrs, "axis", shown, "Compress")?;
        let nz = self.emit(n, "nonzero", Op::NonZero, vec![cond]);
        // NonZero of the 1-D condition is [1, nnz]; Squeeze refuses any other rank.
        let squeeze = Op::Squeeze {
            axes: Some(vec![0]),
        };
        let idx = self.emit(n, "indices", squeeze, vec![nz]);
        let (data, axis) = match axis {
            Some(a) => (x, a),
            None => {
                let flat = self.i64_const(n, "flat_shape", &[-1], false)?;
                let reshape = Op::Reshape { allowzero: false };
                (self.emit(n, "flat", reshape, vec![x, flat]), 0)
            }
        };
        self.push(n, "", Op::Gather { axis }, vec![data, idx], &y);
        Ok(())
    }

    /// OneHot(indices, depth, values): `Where(Unsqueeze(i, axis) == Range(depth) placed
    /// along axis, on, off)`, with negative indices counting from the end (i + depth) and
    /// indices outside [-depth, depth) matching nothing (all off), as the operator defines.
    pub(super) fn lower_one_hot(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: &[Attr],
    ) -> Result<()> {
        let [idx, depth, values, y] = io(n, shown, attrs, 3, &["axis"])?;
        let axis = int_attr(attrs, "axis", shown, "OneHot")?.unwrap_or(-1);
        // Index arithmetic in i32, which every backend has: depth fits it, and an index
        // beyond it saturates to one that is still out of range (all off).
        let to_i32 = || Op::Cast { to: DType::I32 };
        let bin = |b| Op::Binary(b);
        // Depth reaches the plan only as Range's bound (Range takes float bounds, so a
        // float depth fed at run time plans too); the rest reads Range's length.
        let bound = |me: &mut Self, what: &str, v: f64| -> Result<String> {
            Ok(match me.dtypes.get(&depth) {
                Some(&dt) => me.constant(n, what, Tensor::from_f64(dt, &[], &[v])?),
                None => {
                    let c = me.constant(n, &format!("{what}_f32"), Tensor::scalar(v as f32));
                    me.emit(n, what, Op::CastLike, vec![c, depth.clone()])
                }
            })
        };
        let (lo, step) = (
            bound(self, "range_start", 0.0)?,
            bound(self, "range_step", 1.0)?,
        );
        let range = self.emit(n, "range", Op::Range, vec![lo, depth.clone(), step]);
        let range_i = self.emit(n, "range_i32", to_i32(), vec![range.clone()]);
        let dv = self.emit(
            n,
            "depth_vec",
            Op::Shape {
                start: 0,
                end: None,
            },
            vec![range],
        );
        let scalar_shape = self.i64_const(n, "scalar_shape", &[], false)?;
        let d = self.emit(
            n,
            "depth_scalar",
            Op::Reshape { allowzero: false },
            vec![dv.clone(), scalar_shape],
        );
        let d = self.emit(n, "depth_i32", to_i32(), vec![d]);
        let i = self.emit(n, "indices_i32", to_i32(), vec![idx.clone()]);
        let zero = self.constant(n, "zero", Tensor::scalar(0i32));
        let one = self.i64_const(n, "one", &[1], true)?;
        let neg = self.emit(n, "negative", bin(BinaryOp::Less), vec![i.clone(), zero]);
        let wrapped = self.emit(n, "wrapped", bin(BinaryOp::Add), vec![i.clone(), d]);
        let i = self.emit(n, "index", Op::Where, vec![neg, wrapped, i]);
        // Range as [depth, 1, ..., 1] with one 1 per dim after the new axis.
        let trailing = if axis < 0 {
            let k = usize::try_from(-axis - 1).unwrap_or(0);
            self.i64_const(n, "trailing_ones", &vec![1; k], false)?
        } else {
            let after = self.emit(
                n,
                "dims_after",
                Op::Shape {
                    start: axis,
                    end: None,
                },
                vec![idx],
            );
            let count = self.emit(
                n,
                "dims_after_count",
                Op::Shape {
                    start: 0,
                    end: None,
                },
                vec![after],
            );
            self.emit(n, "trailing_ones", Op::Expand, vec![one, count])
        };
        let rshape = self.emit(n, "range_shape", Op::Concat { axis: 0 }, vec![dv, trailing]);
        let range = self.emit(
            n,
            "range_placed",
            Op::Reshape { allowzero: false },
            vec![range_i, rshape],
        );
        let iu = self.emit(
            n,
            "index_placed",
            Op::Unsqueeze {
                axes: Some(vec![axis]),
            },
            vec![i],
        );
        let hot = self.emit(n, "hot", bin(BinaryOp::Equal), vec![iu, range]);
        let pick = |me: &mut Self, what: &str, k: i64| -> Result<String> {
            let at = me.i64_const(n, &format!("{what}_at"), &[k], true)?;
            Ok(me.emit(n, what, Op::Gather { axis: 0 }, vec![values.clone(), at]))
        };
        let off = pick(self, "off", 0)?;
        let on = pick(self, "on", 1)?;
        self.push(n, "", Op::Where, vec![hot, on, off], &y);
        Ok(())
    }

    /// EyeLike(x): `cols - rows == k` over x's 2-D shape, cast to `dtype` (default x's).
    pub(super) fn lower_eye_like(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: &[Attr],
    ) -> Result<()> {
        let [x, y] = io(n, shown, attrs, 1, &["k", "dtype"])?;
        let k = int_attr(attrs, "k", shown, "EyeLike")?.unwrap_or(0);
        let to = match int_attr(attrs, "dtype", shown, "EyeLike")? {
            None => None,
            Some(c) => Some(DType::from_onnx(c).ok_or_else(|| {
                Error::Graph(format!(
                    "node '{shown}' (EyeLike): attribute 'dtype' {c} ({}) is not a dtype graphrun has",
                    crate::tensor::onnx_dtype_name(c)
                ))
            })?),
        };
        let s = self.emit(
            n,
            "shape",
            Op::Shape {
                start: 0,
                end: None,
            },
            vec![x.clone()],
        );
        let zero = self.i64_const(n, "zero", &[0], true)?;
        let one = self.i64_const(n, "one", &[1], true)?;
        let dim = |me: &mut Self, what: &str, at: &str| {
            me.emit(
                n,
                what,
                Op::Gather { axis: 0 },
                vec![s.clone(), at.to_string()],
            )
        };
        let rows = dim(self, "rows", &zero);
        let cols = dim(self, "cols", &one);
        let rows = self.emit(
            n,
            "row_range",
            Op::Range,
            vec![zero.clone(), rows, one.clone()],
        );
        let cols = self.emit(n, "col_range", Op::Range, vec![zero, cols, one]);
        let rows = self.emit(
            n,
            "row_col",
            Op::Unsqueeze {
                axes: Some(vec![1]),
            },
            vec![rows],
        );
        let diff = self.emit(n, "offset", Op::Binary(BinaryOp::Sub), vec![cols, rows]);
        let kc = self.i64_const(n, "k", &[k], true)?;
        let eye = self.emit(n, "eye", Op::Binary(BinaryOp::Equal), vec![diff, kc]);
        match to {
            Some(to) => self.push(n, "", Op::Cast { to }, vec![eye], &y),
            None => self.push(n, "", Op::CastLike, vec![eye, x], &y),
        }
        Ok(())
    }

    /// Einsum: repeated labels within an operand become diagonals, labels no one else
    /// needs are summed out, operands are combined left to right (a MatMul where one label
    /// is contracted and each side keeps at most one label of its own, else a broadcast
    /// Mul and a ReduceSum), and the result is transposed to the output's order. An
    /// ellipsis needs its operand's rank from the model's types.
    pub(super) fn lower_einsum(
        &mut self,
        n: &NodeProto,
        shown: &str,
        attrs: &[Attr],
    ) -> Result<()> {
        let err = |m: String| Error::Graph(format!("node '{shown}' (Einsum): {m}"));
        let eq = match attrs
            .iter()
            .find(|a| a.name == "equation")
            .map(|a| &a.value)
        {
            Some(AttrValue::Str(s)) => s.clone(),
            _ => return Err(err("attribute 'equation' (a string) is required".into())),
        };
        if let Some(a) = attrs.iter().find(|a| a.name != "equation") {
            return Err(err(format!("unknown attribute '{}'", a.name)));
        }
        let (Some(y), 1) = (n.output.first().cloned(), n.output.len()) else {
            return Err(err("needs exactly one output".into()));
        };
        let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
        let (lhs, rhs) = match eq.split_once("->") {
            Some((l, r)) => (l, Some(r)),
            None => (eq.as_str(), None),
        };
        let specs: Vec<&str> = lhs.split(',').collect();
        if specs.len() != n.input.len() || n.input.iter().any(String::is_empty) {
            return Err(err(format!(
                "the equation names {} operands and the node has {} inputs",
                specs.len(),
                n.input.len()
            )));
        }
        // Labels per operand, the ellipsis expanded right-aligned to the widest one.
        let mut parsed = vec![];
        let mut width = 0;
        for (spec, v) in specs.iter().zip(&n.input) {
            let (letters, dots) = parse_labels(spec).map_err(&err)?;
            let e = if dots.is_some() {
                let r = self.ranks.get(v).copied().ok_or_else(|| {
                    err(format!(
                        "operand '{v}' has an ellipsis and the model gives no rank for it"
                    ))
                })?;
                r.checked_sub(letters.len()).ok_or_else(|| {
                    err(format!(
                        "operand '{v}' has rank {r}, fewer dims than labels"
                    ))
                })?
            } else {
                0
            };
            width = width.max(e);
            parsed.push((letters, dots, e));
        }
        let expand = |letters: &[u32], dots: Option<usize>, e: usize| -> Vec<u32> {
            let mut l = letters.to_vec();
            if let Some(at) = dots {
                let ell = (width - e..width).map(|k| ELLIPSIS + k as u32);
                l.splice(at..at, ell);
            }
            l
        };
        let mut terms: Vec<Term> = parsed
            .iter()
            .zip(&n.input)
            .map(|((l, d, e), v)| (v.clone(), expand(l, *d, *e)))
            .collect();
        let out: Vec<u32> = match rhs {
            Some(r) => {
                let (l, d) = parse_labels(r).map_err(&err)?;
                expand(&l, d, width)
            }
            None => {
                let all: Vec<u32> = terms.iter().flat_map(|t| t.1.clone()).collect();
                let mut once: Vec<u32> = all
                    .iter()
                    .copied()
                    .filter(|&c| c < ELLIPSIS && all.iter().filter(|&&x| x == c).count() == 1)
                    .collect();
                once.sort_unstable();
                (0..width as u32)
                    .map(|k| ELLIPSIS + k)
                    .chain(once)
                    .collect()
            }
        };
        for (i, &c) in out.iter().enumerate() {
            if out[..i].contains(&c) || !terms.iter().any(|t| t.1.contains(&c)) {
                return Err(err(format!(
                    "output label '{}' is repeated or in no operand",
                    label_text(c)
                )));
            }
        }
        let mut k = 0usize;
        let mut tag = |what: &str| {
            k += 1;
            format!("{what}{k}")
        };
        for t in terms.iter_mut() {
            while let Some((p, q)) = first_repeat(&t.1) {
                *t = self.diagonal(n, &mut tag, t, p, q)?;
            }
        }
        let mut acc = terms.remove(0);
        let mut rest = terms;
        loop {
            let needed: Vec<u32> = out
                .iter()
                .chain(rest.iter().flat_map(|t| t.1.iter()))
                .copied()
                .collect();
            acc = self.sum_out(n, &mut tag, acc, &needed)?;
            if rest.is_empty() {
                break;
            }
            let b = rest.remove(0);
            let b_needed: Vec<u32> = needed.iter().chain(&acc.1).copied().collect();
            let b = self.sum_out(n, &mut tag, b, &b_needed)?;
            acc = self.contract(n, &mut tag, acc, b, &needed)?;
        }
        let perm: Vec<usize> = out
            .iter()
            .map(|c| {
                acc.1
                    .iter()
                    .position(|x| x == c)
                    .expect("output labels are kept")
            })
            .collect();
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            self.push(n, "", Op::Identity, vec![acc.0], &y);
        } else {
            self.push(n, "", Op::Transpose { perm: Some(perm) }, vec![acc.0], &y);
        }
        Ok(())
    }

    /// The diagonal of labels p < q of `t` (both one label): the two dims moved last,
    /// flattened, and every (n+1)-th element taken.
    fn diagonal(
        &mut self,
        n: &NodeProto,
        tag: &mut impl FnMut(&str) -> String,
        t: &Term,
        p: usize,
        q: usize,
    ) -> Result<Term> {
        let r = t.1.len();
        let mut perm: Vec<usize> = (0..r).filter(|&d| d != p && d != q).collect();
        perm.extend([p, q]);
        let x = self.transposed(n, tag, &t.0, &perm);
        let head = self.emit(
            n,
            &tag("diag_head"),
            Op::Shape {
                start: 0,
                end: Some(-2),
            },
            vec![x.clone()],
        );
        let last = self.emit(
            n,
            &tag("diag_len"),
            Op::Shape {
                start: -1,
                end: None,
            },
            vec![x.clone()],
        );
        let minus1 = self.i64_const(n, &tag("diag_flat"), &[-1], false)?;
        let shape = self.emit(
            n,
            &tag("diag_shape"),
            Op::Concat { axis: 0 },
            vec![head, minus1.clone()],
        );
        let flat = self.emit(
            n,
            &tag("diag_rows"),
            Op::Reshape { allowzero: false },
            vec![x, shape],
        );
        let one = self.i64_const(n, &tag("diag_one"), &[1], false)?;
        let step = self.emit(
            n,
            &tag("diag_step"),
            Op::Binary(BinaryOp::Add),
            vec![last, one],
        );
        let zero = self.i64_const(n, &tag("diag_start"), &[0], false)?;
        let end = self.i64_const(n, &tag("diag_end"), &[i64::MAX], false)?;
        let d = self.emit(
            n,
            &tag("diagonal"),
            Op::Slice,
            vec![flat, zero, end, minus1, step],
        );
        let mut labels: Vec<u32> = perm[..r - 2].iter().map(|&d| t.1[d]).collect();
        labels.push(t.1[p]);
        Ok((d, labels))
    }

    /// `x` transposed by `perm` (itself when `perm` is the identity).
    fn transposed(
        &mut self,
        n: &NodeProto,
        tag: &mut impl FnMut(&str) -> String,
        x: &str,
        perm: &[usize],
    ) -> String {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return x.to_string();
        }
        self.emit(
            n,
            &tag("transpose"),
            Op::Transpose {
                perm: Some(perm.to_vec()),
            },
            vec![x.to_string()],
        )
    }

    /// `t` summed over its labels that `needed` lacks.
    fn sum_out(
        &mut self,
        n: &NodeProto,
        tag: &mut impl FnMut(&str) -> String,
        t: Term,
        needed: &[u32],
    ) -> Result<Term> {
        let axes: Vec<i64> = (0..t.1.len())
            .filter(|&d| !needed.contains(&t.1[d]))
            .map(|d| d as i64)
            .collect();
        if axes.is_empty() {
            return Ok(t);
        }
        let labels = t.1.iter().copied().filter(|c| needed.contains(c)).collect();
        let v = self.emit(n, &tag("sum"), sum_over(axes), vec![t.0]);
        Ok((v, labels))
    }

    /// `a` and `b` multiplied, summed over the labels they share that `needed` lacks;
    /// the result's labels are the shared kept ones, then a's own, then b's own.
    fn contract(
        &mut self,
        n: &NodeProto,
        tag: &mut impl FnMut(&str) -> String,
        a: Term,
        b: Term,
        needed: &[u32],
    ) -> Result<Term> {
        let shared: Vec<u32> = a.1.iter().copied().filter(|c| b.1.contains(c)).collect();
        let batch: Vec<u32> = shared
            .iter()
            .copied()
            .filter(|c| needed.contains(c))
            .collect();
        let summed: Vec<u32> = shared
            .iter()
            .copied()
            .filter(|c| !needed.contains(c))
            .collect();
        let a_own: Vec<u32> = a.1.iter().copied().filter(|c| !b.1.contains(c)).collect();
        let b_own: Vec<u32> = b.1.iter().copied().filter(|c| !a.1.contains(c)).collect();
        let order = |t: &Term, want: &[&[u32]]| -> Vec<usize> {
            want.iter()
                .flat_map(|w| w.iter())
                .filter_map(|c| t.1.iter().position(|x| x == c))
                .collect()
        };
        let labels: Vec<u32> = [&batch[..], &a_own, &b_own].concat();
        let unsq = |axes: Vec<i64>| Op::Unsqueeze { axes: Some(axes) };
        if summed.len() == 1 && a_own.len() <= 1 && b_own.len() <= 1 {
            let pa = order(&a, &[&batch, &a_own, &summed]);
            let pb = order(&b, &[&batch, &summed, &b_own]);
            let mut xa = self.transposed(n, tag, &a.0, &pa);
            let mut xb = self.transposed(n, tag, &b.0, &pb);
            if a_own.is_empty() {
                xa = self.emit(n, &tag("row"), unsq(vec![-2]), vec![xa]);
            }
            if b_own.is_empty() {
                xb = self.emit(n, &tag("col"), unsq(vec![-1]), vec![xb]);
            }
            let mut m = self.emit(n, &tag("matmul"), Op::MatMul, vec![xa, xb]);
            let squeeze: Vec<i64> = [(a_own.is_empty(), -2), (b_own.is_empty(), -1)]
                .into_iter()
                .filter_map(|(e, ax)| e.then_some(ax))
                .collect();
            if !squeeze.is_empty() {
                m = self.emit(
                    n,
                    &tag("squeeze"),
                    Op::Squeeze {
                        axes: Some(squeeze),
                    },
                    vec![m],
                );
            }
            return Ok((m, labels));
        }
        let all: Vec<u32> = [&labels[..], &summed].concat();
        let mut aligned = vec![];
        for t in [&a, &b] {
            let p = order(t, &[&all]);
            let x = self.transposed(n, tag, &t.0, &p);
            let missing: Vec<i64> = (0..all.len())
                .filter(|&d| !t.1.contains(&all[d]))
                .map(|d| d as i64)
                .collect();
            aligned.push(if missing.is_empty() {
                x
            } else {
                self.emit(n, &tag("align"), unsq(missing), vec![x])
            });
        }
        let mut m = self.emit(n, &tag("product"), Op::Binary(BinaryOp::Mul), aligned);
        if !summed.is_empty() {
            let axes = (labels.len()..all.len()).map(|d| d as i64).collect();
            m = self.emit(n, &tag("sum"), sum_over(axes), vec![m]);
        }
        Ok((m, labels))
    }
}

fn sum_over(axes: Vec<i64>) -> Op {
    Op::Reduce {
        kind: ReduceKind::Sum,
        axes: Some(axes),
        keepdims: false,
        noop_with_empty_axes: false,
    }
}

/// The first label that appears twice, as its two positions.
fn first_repeat(l: &[u32]) -> Option<(usize, usize)> {
    (0..l.len()).find_map(|p| (p + 1..l.len()).find(|&q| l[q] == l[p]).map(|q| (p, q)))
}

/// The letters of one Einsum term and where its ellipsis stands (if any).
fn parse_labels(s: &str) -> std::result::Result<(Vec<u32>, Option<usize>), String> {
    let mut letters = vec![];
    let mut dots = None;
    let mut rest = s;
    while let Some(c) = rest.chars().next() {
        if let Some(r) = rest.strip_prefix("...") {
            if dots.replace(letters.len()).is_some() {
                return Err(format!("term '{s}' has two ellipses"));
            }
            rest = r;
            continue;
        }
        if !c.is_ascii_alphabetic() {
            return Err(format!("term '{s}' has '{c}', which is not a letter"));
        }
        letters.push(c as u32);
        rest = &rest[1..];
    }
    Ok((letters, dots))
}

fn label_text(c: u32) -> String {
    if c >= ELLIPSIS {
        "...".into()
    } else {
        char::from_u32(c).map(String::from).unwrap_or_default()
    }
}

/// An integer attribute of a lowered op.
fn int_attr(attrs: &[Attr], key: &str, shown: &str, op: &str) -> Result<Option<i64>> {
    match attrs.iter().find(|a| a.name == key).map(|a| &a.value) {
        None => Ok(None),
        Some(AttrValue::Int(v)) => Ok(Some(*v)),
        Some(v) => Err(Error::Graph(format!(
            "node '{shown}' ({op}): attribute '{key}' must be an integer, got {v:?}"
        ))),
    }
}

/// The node's `N - 1` required inputs and one output, after checking that it has no
/// attributes but `known`.
fn io<const N: usize>(
    n: &NodeProto,
    shown: &str,
    attrs: &[Attr],
    ins: usize,
    known: &[&str],
) -> Result<[String; N]> {
    let op = n.op_type.as_str();
    if let Some(a) = attrs.iter().find(|a| !known.contains(&a.name.as_str())) {
        return Err(Error::Graph(format!(
            "node '{shown}' ({op}): unknown attribute '{}'",
            a.name
        )));
    }
    let ok = n.input.len() == ins
        && n.input.iter().all(|v| !v.is_empty())
        && n.output.len() == 1
        && ins + 1 == N;
    if !ok {
        return Err(Error::Graph(format!(
            "node '{shown}' ({op}) needs exactly {ins} inputs and one output"
        )));
    }
    let mut v: Vec<String> = n.input.clone();
    v.push(n.output[0].clone());
    Ok(v.try_into().expect("N = inputs + 1"))
}
