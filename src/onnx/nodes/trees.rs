//! ai.onnx.ml's TreeEnsemble, written as comparisons and matrix products.
//!
//! The trees are constants, so the importer walks them once, depth first from each root
//! (a set-membership node's set is its run of `membership_values`, the runs ended by NaN
//! and given in node order; a root whose two branches name one leaf is that leaf). Every
//! node the walk reaches becomes a column of one comparison of the gathered features,
//! `c[N, V]`; every leaf it reaches is a path, the nodes on it each required true or false.
//! With P = +1 where a path needs its node true and -1 where false, `c·P + (number of
//! false literals)` counts the literals a sample satisfies, and the sample reaches the
//! leaf exactly when that count is the path's length (whole numbers, exact in f32). The
//! leaves' weights are then summed into their targets by a product with a `[paths,
//! targets]` matrix (SUM, AVERAGE), or the smallest or largest is picked per target (MIN,
//! MAX; a target no leaf reaches keeps the type's largest or smallest finite value, as the
//! reference starts from those).

use super::composite::{bin, check_size, inputs, un, unsqueeze, Attrs, Axes};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::{AttrValue, ReduceKind};
use crate::graph::{BinaryOp, Op, UnaryOp};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// Comparison of a node: x `mode` split sends the sample down the true branch.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Leq,
    Lt,
    Gte,
    Gt,
    Eq,
    Neq,
    Member,
}

const MODES: [Mode; 7] = [
    Mode::Leq,
    Mode::Lt,
    Mode::Gte,
    Mode::Gt,
    Mode::Eq,
    Mode::Neq,
    Mode::Member,
];

/// A node as the walk reached it.
struct Visit {
    feature: i64,
    mode: Mode,
    split: f64,
    members: Vec<f64>,
    missing_true: bool,
}

/// A leaf as the walk reached it, with the visits on its path and the branch taken.
struct Path {
    steps: Vec<(usize, bool)>,
    weight: f64,
    target: usize,
}

/// The attributes that describe the trees, read and checked.
struct Forest {
    splits: Vec<f64>,
    features: Vec<i64>,
    modes: Vec<Mode>,
    true_ids: Vec<i64>,
    false_ids: Vec<i64>,
    true_leaf: Vec<i64>,
    false_leaf: Vec<i64>,
    missing_true: Vec<i64>,
    leaf_targets: Vec<i64>,
    leaf_weights: Vec<f64>,
    members: Vec<f64>,
    targets: usize,
}

/// More visits than this is a malformed ensemble (a cycle, or a DAG that unfolds
/// exponentially), refused rather than written out; so are paths longer than
/// `MAX_STEPS` in all (a deep chain of nodes, each with a leaf).
const MAX_VISITS: usize = 1 << 20;
const MAX_STEPS: usize = 1 << 24;

impl Forest {
    /// Walks every tree from its root, depth first and the true branch first: the
    /// reached nodes and the paths to the leaves. Iterative, so a deep tree cannot
    /// overflow the stack; a path longer than the node count is a cycle.
    fn walk(&self, what: &str, roots: &[i64]) -> Result<(Vec<Visit>, Vec<Path>)> {
        enum Work {
            Enter(i64, bool, Option<(usize, bool)>),
            Exit,
        }
        let mut visits = Vec::new();
        let mut paths: Vec<Path> = Vec::new();
        let mut steps = 0usize;
        // The sets belong to the set-membership nodes in node order, as the definition
        // lists them.
        let mut runs = self.members.split(|v| v.is_nan());
        let sets: Vec<Vec<f64>> = self
            .modes
            .iter()
            .map(|&m| match m {
                Mode::Member => runs.next().unwrap_or_default().to_vec(),
                _ => vec![],
            })
            .collect();
        for &r in roots {
            let i = self.node(what, r)?;
            // A root whose both branches are the same leaf is that leaf.
            let leaf = self.true_leaf[i] != 0
                && self.false_leaf[i] != 0
                && self.true_ids[i] == self.false_ids[i];
            let root = if leaf { self.true_ids[i] } else { r };
            let mut path: Vec<(usize, bool)> = Vec::new();
            let mut work = vec![Work::Enter(root, leaf, None)];
            while let Some(w) = work.pop() {
                let Work::Enter(id, leaf, lit) = w else {
                    path.pop();
                    continue;
                };
                if let Some(l) = lit {
                    path.push(l);
                    work.push(Work::Exit);
                }
                if path.len() > self.modes.len() || visits.len() + paths.len() > MAX_VISITS {
                    return Err(Error::Graph(format!(
                        "{what}: the trees unfold to a path longer than their {} nodes, or to more than {MAX_VISITS} nodes (a cycle?)",
                        self.modes.len()
                    )));
                }
                if leaf {
                    steps += path.len();
                    if steps > MAX_STEPS {
                        return Err(Error::Graph(format!(
                            "{what}: the paths to the leaves pass more than {MAX_STEPS} nodes in all"
                        )));
                    }
                    paths.push(self.leaf(what, id, &path)?);
                    continue;
                }
                let i = self.node(what, id)?;
                let v = visits.len();
                visits.push(Visit {
                    feature: self.features[i],
                    mode: self.modes[i],
                    split: self.splits[i],
                    members: sets[i].clone(),
                    missing_true: self.missing_true.get(i).is_some_and(|&m| m != 0),
                });
                work.push(Work::Enter(
                    self.false_ids[i],
                    self.false_leaf[i] != 0,
                    Some((v, false)),
                ));
                work.push(Work::Enter(
                    self.true_ids[i],
                    self.true_leaf[i] != 0,
                    Some((v, true)),
                ));
            }
        }
        Ok((visits, paths))
    }

    /// Leaf `id` reached by `steps`.
    fn leaf(&self, what: &str, id: i64, steps: &[(usize, bool)]) -> Result<Path> {
        let l = usize::try_from(id)
            .ok()
            .filter(|&l| l < self.leaf_weights.len())
            .ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: leaf id {id} is out of range (the ensemble has {} leaves)",
                    self.leaf_weights.len()
                ))
            })?;
        let target = usize::try_from(self.leaf_targets[l])
            .ok()
            .filter(|&t| t < self.targets)
            .ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: leaf {l} targets {}, outside 0..n_targets ({})",
                    self.leaf_targets[l], self.targets
                ))
            })?;
        Ok(Path {
            steps: steps.to_vec(),
            weight: self.leaf_weights[l],
            target,
        })
    }

    fn node(&self, what: &str, id: i64) -> Result<usize> {
        usize::try_from(id)
            .ok()
            .filter(|&i| i < self.modes.len())
            .ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: node id {id} is out of range (the ensemble has {} nodes)",
                    self.modes.len()
                ))
            })
    }
}

impl Importer<'_> {
    /// TreeEnsemble (ai.onnx.ml opset 5): X [N, F] → [N, n_targets] in X's type.
    pub(super) fn tree_ensemble(&mut self, n: &NodeProto, what: &str, mut a: Attrs) -> Result<()> {
        let aggregate = a.int("aggregate_function", 1)?;
        let post = a.int("post_transform", 0)?;
        let targets = a
            .opt_int("n_targets")?
            .ok_or_else(|| a.refuse("n_targets", "is required"))?;
        let ints = |a: &mut Attrs, key: &str| -> Result<Vec<i64>> {
            a.opt_ints(key)?.ok_or_else(|| a.refuse(key, "is required"))
        };
        let tensor = |a: &mut Attrs, key: &str, need: bool| -> Result<Option<Tensor>> {
            match a.take(key) {
                Some(AttrValue::Tensor(t)) => Ok(Some(t)),
                None if !need => Ok(None),
                None => Err(a.refuse(key, "is required")),
                Some(v) => Err(a.wrong(key, "a tensor", &v)),
            }
        };
        let weights = tensor(&mut a, "leaf_weights", true)?.expect("required");
        let splits = tensor(&mut a, "nodes_splits", true)?.expect("required");
        let modes = tensor(&mut a, "nodes_modes", true)?.expect("required");
        let members = tensor(&mut a, "membership_values", false)?;
        // Hit rates only inform how a runtime orders its work.
        tensor(&mut a, "nodes_hitrates", false)?;
        let mut modes_v = Vec::new();
        for m in modes.to_i64_vec() {
            match usize::try_from(m).ok().and_then(|m| MODES.get(m)) {
                Some(&m) => modes_v.push(m),
                None => return Err(a.refuse("nodes_modes", &format!("has mode {m}, not 0..=6"))),
            }
        }
        let forest = Forest {
            splits: splits.to_f64_vec(),
            features: ints(&mut a, "nodes_featureids")?,
            modes: modes_v,
            true_ids: ints(&mut a, "nodes_truenodeids")?,
            false_ids: ints(&mut a, "nodes_falsenodeids")?,
            true_leaf: ints(&mut a, "nodes_trueleafs")?,
            false_leaf: ints(&mut a, "nodes_falseleafs")?,
            missing_true: a.ints("nodes_missing_value_tracks_true", &[])?,
            leaf_targets: ints(&mut a, "leaf_targetids")?,
            leaf_weights: weights.to_f64_vec(),
            members: members.as_ref().map(Tensor::to_f64_vec).unwrap_or_default(),
            targets: usize::try_from(targets)
                .ok()
                .filter(|&t| t > 0)
                .ok_or_else(|| {
                    a.refuse("n_targets", &format!("must be positive, got {targets}"))
                })?,
        };
        let roots = ints(&mut a, "tree_roots")?;
        a.finish()?;
        let nodes = forest.modes.len();
        for (key, len) in [
            ("nodes_splits", forest.splits.len()),
            ("nodes_featureids", forest.features.len()),
            ("nodes_truenodeids", forest.true_ids.len()),
            ("nodes_falsenodeids", forest.false_ids.len()),
            ("nodes_trueleafs", forest.true_leaf.len()),
            ("nodes_falseleafs", forest.false_leaf.len()),
        ] {
            if len != nodes {
                return Err(a.refuse(key, &format!("has {len} entries for {nodes} nodes")));
            }
        }
        if !forest.missing_true.is_empty() && forest.missing_true.len() != nodes {
            return Err(a.refuse(
                "nodes_missing_value_tracks_true",
                &format!(
                    "has {} entries for {nodes} nodes",
                    forest.missing_true.len()
                ),
            ));
        }
        if forest.leaf_targets.len() != forest.leaf_weights.len() {
            return Err(a.refuse(
                "leaf_targetids",
                &format!(
                    "has {} entries for {} leaf weights",
                    forest.leaf_targets.len(),
                    forest.leaf_weights.len()
                ),
            ));
        }
        let set_nodes = forest.modes.iter().filter(|&&m| m == Mode::Member).count();
        let set_ends = forest.members.iter().filter(|v| v.is_nan()).count();
        if set_nodes != set_ends {
            return Err(a.refuse(
                "membership_values",
                &format!(
                    "holds {set_ends} NaN-terminated sets for {set_nodes} set-membership nodes"
                ),
            ));
        }
        if !(0..=3).contains(&aggregate) {
            return Err(a.refuse(
                "aggregate_function",
                &format!("must be 0 (AVERAGE), 1 (SUM), 2 (MIN) or 3 (MAX), got {aggregate}"),
            ));
        }
        if !(0..=3).contains(&post) {
            let msg = match post {
                4 => "4 (PROBIT) needs the inverse error function, which graphrun does not have"
                    .to_string(),
                p => format!("must be 0 to 4, got {p}"),
            };
            return Err(a.refuse("post_transform", &msg));
        }
        let (visits, paths) = forest.walk(what, &roots)?;
        let dt = weights.dtype();
        if !dt.is_float() {
            return Err(a.refuse(
                "leaf_weights",
                &format!("must be floating, got {}", dt.name()),
            ));
        }
        let (ins, _) = inputs(n, what, (1, 1), 1)?;
        let x = ins[0].clone();
        let t = forest.targets;
        let y = if visits.is_empty() {
            // Every tree is one leaf: the same scores for every sample.
            let ones = self.reached_all(n, &x, paths.len())?;
            self.aggregate(n, ones, &paths, aggregate, roots.len(), t, dt)?
        } else {
            let v = visits.len();
            let feats: Vec<i64> = visits.iter().map(|s| s.feature).collect();
            let idx = self.ints_const(n, "features", &feats)?;
            let xg = self.val(n, "gathered", Op::Gather { axis: 1 }, vec![x, idx]);
            let mut cond: Option<String> = None;
            for mode in MODES {
                let mask: Vec<bool> = visits.iter().map(|s| s.mode == mode).collect();
                if !mask.contains(&true) {
                    continue;
                }
                let tag = format!("{mode:?}").to_lowercase();
                let c = if mode == Mode::Member {
                    let width = visits
                        .iter()
                        .map(|s| s.members.len())
                        .max()
                        .unwrap_or(0)
                        .max(1);
                    check_size(what, dt, &[v, width])?;
                    let mut sets = vec![f64::NAN; v * width];
                    for (i, s) in visits.iter().enumerate() {
                        sets[i * width..i * width + s.members.len()].copy_from_slice(&s.members);
                    }
                    let sets = self.constant(n, "sets", Tensor::from_f64(dt, &[v, width], &sets)?);
                    let x3 = self.val(n, "gathered3", unsqueeze(2), vec![xg.clone()]);
                    let eq = self.val(n, "in_set", bin(BinaryOp::Equal), vec![x3, sets]);
                    let eq = self.val(n, "in_set_f", Op::Cast { to: DType::F32 }, vec![eq]);
                    let any = self.reduce(
                        n,
                        "in_set_any",
                        ReduceKind::Max,
                        &eq,
                        &Axes::Fixed(vec![2]),
                        false,
                    );
                    let zero = self.constant(n, "zero_f", Tensor::scalar(0f32));
                    self.val(n, "member", bin(BinaryOp::Greater), vec![any, zero])
                } else {
                    let s: Vec<f64> = visits.iter().map(|s| s.split).collect();
                    let s =
                        self.constant(n, &format!("{tag}_splits"), Tensor::from_f64(dt, &[v], &s)?);
                    let (op, ins) = match mode {
                        Mode::Leq => (BinaryOp::LessOrEqual, [xg.clone(), s]),
                        Mode::Lt => (BinaryOp::Less, [xg.clone(), s]),
                        Mode::Gte => (BinaryOp::GreaterOrEqual, [xg.clone(), s]),
                        Mode::Gt => (BinaryOp::Greater, [xg.clone(), s]),
                        _ => (BinaryOp::Equal, [xg.clone(), s]),
                    };
                    let c = self.val(n, &tag, bin(op), ins.to_vec());
                    if mode == Mode::Neq {
                        // x != s, NaN included, as Python's != is.
                        self.not(n, "neq", c)?
                    } else {
                        c
                    }
                };
                let c = if mask.iter().all(|&m| m) {
                    c
                } else {
                    let m: Vec<f64> = mask.iter().map(|&m| m as u8 as f64).collect();
                    let m = self.constant(
                        n,
                        &format!("{tag}_mask"),
                        Tensor::from_f64(DType::Bool, &[v], &m)?,
                    );
                    self.val(n, &format!("{tag}_masked"), bin(BinaryOp::And), vec![c, m])
                };
                cond = Some(match cond {
                    None => c,
                    Some(p) => self.val(n, &format!("{tag}_or"), bin(BinaryOp::Or), vec![p, c]),
                });
            }
            let mut cond = cond.expect("a visit has a mode");
            if visits.iter().any(|s| s.missing_true) {
                let m: Vec<f64> = visits.iter().map(|s| s.missing_true as u8 as f64).collect();
                let m = self.constant(n, "missing_true", Tensor::from_f64(DType::Bool, &[v], &m)?);
                let same = self.val(n, "self_equal", bin(BinaryOp::Equal), vec![xg.clone(), xg]);
                let nan = self.not(n, "is_nan", same)?;
                let nan = self.val(n, "nan_true", bin(BinaryOp::And), vec![nan, m]);
                cond = self.val(n, "cond", bin(BinaryOp::Or), vec![cond, nan]);
            }
            let cf = self.val(n, "cond_f", Op::Cast { to: DType::F32 }, vec![cond]);
            let p = paths.len();
            check_size(what, DType::F32, &[v, p])?;
            let mut lit = vec![0f32; v * p];
            let mut falses = vec![0f32; p];
            let mut lens = vec![0f32; p];
            for (j, path) in paths.iter().enumerate() {
                for &(s, branch) in &path.steps {
                    lit[s * p + j] += if branch { 1.0 } else { -1.0 };
                    falses[j] += (!branch) as u8 as f32;
                }
                lens[j] = path.steps.len() as f32;
            }
            let lit = self.constant(n, "literals", Tensor::from_vec(&[v, p], lit)?);
            let sat = self.val(n, "satisfied", Op::MatMul, vec![cf, lit]);
            let falses = self.constant(n, "false_literals", Tensor::from_vec(&[p], falses)?);
            let sat = self.val(n, "satisfied_all", bin(BinaryOp::Add), vec![sat, falses]);
            let lens = self.constant(n, "path_lengths", Tensor::from_vec(&[p], lens)?);
            let reached = self.val(n, "reached", bin(BinaryOp::Equal), vec![sat, lens]);
            self.aggregate(n, reached, &paths, aggregate, roots.len(), t, dt)?
        };
        let y = match post {
            1 => self.val(n, "softmax", Op::Softmax { axis: -1 }, vec![y]),
            2 => self.val(n, "logistic", un(UnaryOp::Sigmoid), vec![y]),
            3 => self.softmax_zero(n, y)?,
            _ => y,
        };
        self.out(n, 0, Op::Identity, vec![y]);
        Ok(())
    }

    /// A `[N, leaves]` bool of trues: every sample reaches every root leaf.
    fn reached_all(&mut self, n: &NodeProto, x: &str, leaves: usize) -> Result<String> {
        let b = self.val(
            n,
            "batch",
            super::composite::shape(0, Some(1)),
            vec![x.to_string()],
        );
        let w = self.ints_const(n, "leaves", &[leaves as i64])?;
        let dims = self.val(n, "dims", Op::Concat { axis: 0 }, vec![b, w]);
        let t = self.constant(n, "true", Tensor::from_f64(DType::Bool, &[], &[1.0])?);
        Ok(self.val(n, "reached", Op::Expand, vec![t, dims]))
    }

    /// The targets' scores from which leaves each sample reached (`reached`, bool [N, P]).
    #[allow(clippy::too_many_arguments)]
    fn aggregate(
        &mut self,
        n: &NodeProto,
        reached: String,
        paths: &[Path],
        aggregate: i64,
        trees: usize,
        t: usize,
        dt: DType,
    ) -> Result<String> {
        let p = paths.len();
        check_size(&format!("node '{}' (TreeEnsemble)", n.name), dt, &[p, t])?;
        if aggregate <= 1 {
            let scale = if aggregate == 0 {
                1.0 / trees as f64
            } else {
                1.0
            };
            let mut w = vec![0f64; p * t];
            for (j, path) in paths.iter().enumerate() {
                w[j * t + path.target] = path.weight * scale;
            }
            let w = self.constant(n, "leaf_matrix", Tensor::from_f64(dt, &[p, t], &w)?);
            let r = self.val(n, "reached_w", Op::Cast { to: dt }, vec![reached]);
            return Ok(self.val(n, "scores", Op::MatMul, vec![r, w]));
        }
        let min = aggregate == 2;
        let far = match (dt, min) {
            (DType::F64, true) => f64::MAX,
            (DType::F64, false) => f64::MIN,
            (DType::F16, m) => 65504.0 * if m { 1.0 } else { -1.0 },
            (DType::BF16, m) => 3.389_531_389_251_535e38 * if m { 1.0 } else { -1.0 },
            (_, true) => f32::MAX as f64,
            (_, false) => f32::MIN as f64,
        };
        // MIN is the negated MAX of the negated values (graphrun reduces by Max).
        let sign = if min { -1.0 } else { 1.0 };
        let mut w = vec![sign * far; p * t];
        let mut hit = vec![0f64; p * t];
        for (j, path) in paths.iter().enumerate() {
            w[j * t + path.target] = sign * path.weight;
            hit[j * t + path.target] = 1.0;
        }
        let w = self.constant(n, "leaf_values", Tensor::from_f64(dt, &[p, t], &w)?);
        let hit = self.constant(
            n,
            "leaf_targets",
            Tensor::from_f64(DType::Bool, &[p, t], &hit)?,
        );
        let r3 = self.val(n, "reached3", unsqueeze(2), vec![reached]);
        let on = self.val(n, "contributes", bin(BinaryOp::And), vec![r3, hit]);
        let far = self.constant(n, "far", Tensor::from_f64(dt, &[], &[sign * far])?);
        let vals = self.val(n, "contributions", Op::Where, vec![on, w, far]);
        let best = self.reduce(
            n,
            "best",
            ReduceKind::Max,
            &vals,
            &Axes::Fixed(vec![1]),
            false,
        );
        Ok(if min {
            self.val(n, "scores", un(UnaryOp::Neg), vec![best])
        } else {
            best
        })
    }

    /// SOFTMAX_ZERO: softmax over the scores that are not zero; zeros stay zero.
    fn softmax_zero(&mut self, n: &NodeProto, y: String) -> Result<String> {
        let zero = self.float_like(n, "sz_zero", 0.0, &y);
        let nz = self.val(
            n,
            "sz_nonzero",
            bin(BinaryOp::Equal),
            vec![y.clone(), zero.clone()],
        );
        let nz = self.not(n, "sz_kept", nz)?;
        let neg = self.float_like(n, "sz_lowest", f32::MIN, &y);
        let m = self.val(n, "sz_masked", Op::Where, vec![nz.clone(), y.clone(), neg]);
        let last = Axes::Fixed(vec![-1]);
        let max = self.reduce(n, "sz_max", ReduceKind::Max, &m, &last, true);
        let d = self.val(n, "sz_shift", bin(BinaryOp::Sub), vec![y, max]);
        let e = self.val(n, "sz_exp", un(UnaryOp::Exp), vec![d]);
        let e = self.val(n, "sz_exp_kept", Op::Where, vec![nz, e, zero]);
        let s = self.reduce(n, "sz_sum", ReduceKind::Sum, &e, &last, true);
        Ok(self.val(n, "sz", bin(BinaryOp::Div), vec![e, s]))
    }
}
