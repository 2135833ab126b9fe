//! The small pattern matcher every rule is written with: who produces a value, who
//! consumes it, which values are constants, and what shape inference knows.
//!
//! Shapes come from `infer_graph` run twice: once with the model's `dims:` defaults (a
//! probe size for unbound symbols) and once with every symbol scaled by a different
//! factor. A dim that agrees in both runs is static; a rule that compares shapes asks
//! that they agree in every run, so a decision made at the default sizes holds at others.

use crate::graph::infer::{self, Inferred, ValueType};
use crate::graph::{validate, Dim, Graph, HostEval, Initializer, Node, Op};
use crate::tensor::{DType, Tensor};
use std::collections::{HashMap, HashSet};

/// Size given to a symbol with no default in the first inference run.
const PROBE: usize = 32;

/// The size of symbol `s`, the `i`-th of the graph's symbols, in an inference run.
type Size<'a> = dyn Fn(usize, &str) -> usize + 'a;

/// What shape inference knows about a graph's values.
pub struct Facts {
    runs: Vec<Inferred>,
    /// The graph has symbolic dims: shapes are only trusted when both runs agree.
    symbolic: bool,
    /// Ranks found structurally, for when inference cannot run at all.
    ranks: HashMap<String, usize>,
    /// Evaluates nodes on the host (inference's shape arithmetic, constant folding).
    pub eval: &'static dyn HostEval,
}

impl Facts {
    pub fn new(g: &Graph, eval: &'static dyn HostEval) -> Facts {
        let syms = g.symbols();
        let run = |size: &Size| -> Option<Inferred> {
            let shapes: HashMap<String, Vec<usize>> = g
                .inputs
                .iter()
                .map(|inp| {
                    let dims = inp.shape.iter().map(|d| match d {
                        Dim::Fixed(n) => *n,
                        Dim::Sym(s) => size(syms.iter().position(|x| x == s).unwrap_or(0), s),
                    });
                    (inp.name.clone(), dims.collect())
                })
                .collect();
            infer::infer_graph(g, &shapes, eval).ok()
        };
        // The first run at the model's defaults (a probe size for the others); a model
        // that refuses the probe (a position table shorter than it, say) gets smaller ones.
        let base = |probe: usize| move |_: usize, s: &str| g.dims.get(s).copied().unwrap_or(probe);
        let mut runs = vec![];
        let mut chosen = None;
        for probe in [PROBE, 8, 3] {
            if let Some(a) = run(&base(probe)) {
                runs.push(a);
                chosen = Some(probe);
                break;
            }
        }
        // The second run moves every symbol to its own other size: scaled up, else a
        // little up or down (a model may refuse sizes past a table's length).
        if let (Some(probe), false) = (chosen, syms.is_empty()) {
            let b = base(probe);
            let moves: [&Size; 3] = [
                &|i, s| b(i, s) * (i + 2),
                &|i, s| b(i, s) + i + 1,
                &|i, s| b(i, s).saturating_sub(i + 1).max(1),
            ];
            for m in moves {
                // Every symbol must move, or a dim that depends on it would look static.
                if syms.iter().enumerate().any(|(i, s)| m(i, s) == b(i, s)) {
                    continue;
                }
                if let Some(r) = run(m) {
                    runs.push(r);
                    break;
                }
            }
        }
        let ranks = if runs.is_empty() {
            structural_ranks(g)
        } else {
            HashMap::new()
        };
        Facts {
            runs,
            symbolic: !syms.is_empty(),
            ranks,
            eval,
        }
    }

    /// Shapes are known and can be compared across symbol values.
    pub fn complete(&self) -> bool {
        !self.runs.is_empty() && (!self.symbolic || self.runs.len() == 2)
    }
    fn ty(&self, v: &str) -> Option<&ValueType> {
        self.runs.first()?.types.get(v)
    }
    pub fn rank(&self, v: &str) -> Option<usize> {
        match self.ty(v) {
            Some(t) => Some(t.shape.len()),
            None => self.ranks.get(v).copied(),
        }
    }
    pub fn dtype(&self, v: &str) -> Option<DType> {
        self.ty(v).map(|t| t.dtype)
    }
    /// The shape, when it is the same for every binding of the symbols.
    pub fn static_shape(&self, v: &str) -> Option<Vec<usize>> {
        if !self.complete() {
            return None;
        }
        let first = &self.runs[0].types.get(v)?.shape;
        self.runs
            .iter()
            .all(|r| r.types.get(v).map(|t| &t.shape) == Some(first))
            .then(|| first.clone())
    }
    /// `a` and `b` have the same shape for every binding of the symbols.
    pub fn same_shape(&self, a: &str, b: &str) -> bool {
        self.complete()
            && self.runs.iter().all(|r| matches!((r.types.get(a), r.types.get(b)), (Some(x), Some(y)) if x.shape == y.shape))
    }
    /// The shape of `v` in each inference run, when shapes are known: a rule that relates
    /// several shapes checks the relation in every run, so that it holds for any symbol value.
    pub fn shapes(&self, v: &str) -> Option<Vec<&[usize]>> {
        if !self.complete() {
            return None;
        }
        self.runs
            .iter()
            .map(|r| r.types.get(v).map(|t| t.shape.as_slice()))
            .collect()
    }
    /// The value of `v` when shape inference computed it (shape arithmetic such as
    /// `Shape → Gather → Div`) and it is the same in every run: it does not depend on the
    /// symbols' sizes.
    pub fn value(&self, v: &str) -> Option<&Tensor> {
        if !self.complete() {
            return None;
        }
        let first = self.runs[0].consts.get(v)?;
        self.runs[1..]
            .iter()
            .all(|r| r.consts.get(v) == Some(first))
            .then_some(first)
    }
    /// Infers `nodes` (in order) over the known types and checks that value `out` keeps
    /// its type in every run: the proof that a replacement fits where the old subgraph was.
    pub fn check(&self, nodes: &[Node], out: &str) -> Result<(), String> {
        self.check_with(nodes, &[], out)
    }
    /// `check`, where the new nodes may also read the new initializers `inits`.
    pub fn check_with(
        &self,
        nodes: &[Node],
        inits: &[Initializer],
        out: &str,
    ) -> Result<(), String> {
        if !self.complete() {
            return Err("shapes are unknown (inference did not run)".into());
        }
        for run in &self.runs {
            let mut local: HashMap<&str, ValueType> = inits
                .iter()
                .map(|i| {
                    (
                        i.name.as_str(),
                        ValueType::new(i.tensor.dtype(), i.tensor.shape()),
                    )
                })
                .collect();
            let new_consts: HashMap<&str, &Tensor> =
                inits.iter().map(|i| (i.name.as_str(), &i.tensor)).collect();
            for n in nodes {
                let ins: Vec<Option<&ValueType>> =
                    n.map_inputs(|v| local.get(v).or(run.types.get(v)));
                if ins
                    .iter()
                    .zip(&n.inputs)
                    .any(|(t, v)| t.is_none() && !v.is_empty())
                {
                    return Err("shapes are unknown for a new value".into());
                }
                let consts: Vec<Option<&Tensor>> = n
                    .inputs
                    .iter()
                    .map(|v| run.consts.get(v).or(new_consts.get(v.as_str()).copied()))
                    .collect();
                let outs =
                    infer::infer_node(n, &ins, &consts, self.eval).map_err(|e| e.to_string())?;
                for (name, t) in n.outputs.iter().zip(outs) {
                    local.insert(name, t);
                }
            }
            match (local.get(out), run.types.get(out)) {
                (Some(new), Some(old)) if new == old => {}
                (Some(new), Some(old)) => {
                    return Err(format!("the fused result would be {new}, not {old}"))
                }
                _ => return Err(format!("no type for '{out}'")),
            }
        }
        Ok(())
    }
}

/// Ranks by structure alone (declared inputs, initializers, simple propagation).
fn structural_ranks(g: &Graph) -> HashMap<String, usize> {
    let mut r: HashMap<String, usize> = HashMap::new();
    for i in &g.inputs {
        r.insert(i.name.clone(), i.shape.len());
    }
    for i in &g.initializers {
        r.insert(i.name.clone(), i.tensor.shape().len());
    }
    let consts: HashMap<&str, &Tensor> = g
        .initializers
        .iter()
        .map(|i| (i.name.as_str(), &i.tensor))
        .collect();
    for ni in validate::topo_order(g).unwrap_or_default() {
        let n = &g.nodes[ni];
        let ri = |k: usize| n.inputs.get(k).and_then(|v| r.get(v)).copied();
        let rank = match &n.op {
            Op::Unary(_)
            | Op::Cast { .. }
            | Op::CastLike
            | Op::Identity
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. } => ri(0),
            Op::LayerNormalization { .. } | Op::Dropout { .. } | Op::Trilu { .. } | Op::Clip => {
                ri(0)
            }
            Op::Binary(_) => ri(0).zip(ri(1)).map(|(a, b)| a.max(b)),
            Op::Where => ri(0)
                .zip(ri(1))
                .zip(ri(2))
                .map(|((a, b), c)| a.max(b).max(c)),
            Op::MatMul | Op::FusedMatMul { .. } => ri(0)
                .zip(ri(1))
                .filter(|(a, b)| *a >= 2 && *b >= 2)
                .map(|(a, b)| a.max(b)),
            Op::Gemm { .. } => Some(2),
            Op::Transpose { perm: Some(p) } => Some(p.len()),
            Op::Transpose { perm: None } => ri(0),
            Op::Reshape { .. } => n
                .inputs
                .get(1)
                .and_then(|v| consts.get(v.as_str()))
                .map(|t| t.numel()),
            Op::Attention { .. } => Some(4),
            _ => None,
        };
        if let (Some(rank), Some(o)) = (rank, n.outputs.first()) {
            r.insert(o.clone(), rank);
        }
    }
    r
}

/// Why a rule did not fire: the last failed condition, for `inspect --explain-fusion`.
#[derive(Default)]
pub struct Why(pub Option<String>);

impl Why {
    /// Records the failed condition and returns `None`, for `let ... else { return why.no(..) }`.
    pub fn no<T>(&mut self, msg: impl Into<String>) -> Option<T> {
        self.0 = Some(msg.into());
        None
    }
}

/// A rewrite found by a rule, applied atomically by the driver: nodes removed, nodes
/// added (in place of the last removed one), initializers added, and uses of values
/// rewired to other values. Whatever the removal leaves unused is pruned.
#[derive(Default, Debug)]
pub struct Patch {
    pub remove: Vec<usize>,
    pub add: Vec<Node>,
    pub inits: Vec<Initializer>,
    pub rewire: Vec<(String, String)>,
    /// What the rewrite left out and why (a fused MatMul that stopped before an
    /// activation, say), for `inspect --explain-fusion`.
    pub note: Option<String>,
}

/// One graph, indexed for matching.
pub struct Ctx<'g> {
    pub g: &'g Graph,
    pub facts: &'g Facts,
    /// Node indices in a valid execution order.
    pub order: Vec<usize>,
    /// Position of each node in `order`.
    pub pos: Vec<usize>,
    producer: HashMap<&'g str, usize>,
    consumers: HashMap<&'g str, Vec<usize>>,
    needed: HashSet<&'g str>,
    consts: HashMap<&'g str, &'g Tensor>,
    trainable: HashSet<&'g str>,
    node_names: HashSet<&'g str>,
}

impl<'g> Ctx<'g> {
    pub fn new(g: &'g Graph, facts: &'g Facts) -> crate::Result<Ctx<'g>> {
        let order = validate::topo_order(g)?;
        let mut pos = vec![0; g.nodes.len()];
        for (p, &i) in order.iter().enumerate() {
            pos[i] = p;
        }
        let mut producer = HashMap::new();
        let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
        let mut consts: HashMap<&str, &Tensor> = HashMap::new();
        for (i, n) in g.nodes.iter().enumerate() {
            for o in n.outputs.iter().filter(|o| !o.is_empty()) {
                producer.insert(o.as_str(), i);
            }
            for v in n.inputs.iter().filter(|v| !v.is_empty()) {
                let c = consumers.entry(v.as_str()).or_default();
                if !c.contains(&i) {
                    c.push(i);
                }
            }
            if let Op::Constant { value } = &n.op {
                consts.insert(n.outputs[0].as_str(), value);
            }
        }
        for i in &g.initializers {
            consts.insert(i.name.as_str(), &i.tensor);
        }
        let mut needed: HashSet<&str> = g.outputs.iter().map(|s| s.as_str()).collect();
        if let Some(t) = &g.training {
            needed.insert(t.loss.as_str());
        }
        // What training changes (gradient steps and state updates) is no constant.
        let trainable = g
            .initializers
            .iter()
            .filter(|i| g.varies(i))
            .map(|i| i.name.as_str())
            .collect();
        Ok(Ctx {
            g,
            facts,
            order,
            pos,
            producer,
            consumers,
            needed,
            consts,
            trainable,
            node_names: g.nodes.iter().map(|n| n.name.as_str()).collect(),
        })
    }

    pub fn node(&self, i: usize) -> &'g Node {
        &self.g.nodes[i]
    }
    /// The node producing `v` if its op satisfies `is`.
    pub fn prod(&self, v: &str, is: impl Fn(&Op) -> bool) -> Option<(usize, &'g Node)> {
        let &i = self.producer.get(v)?;
        is(&self.g.nodes[i].op).then(|| (i, &self.g.nodes[i]))
    }
    pub fn producer(&self, v: &str) -> Option<usize> {
        self.producer.get(v).copied()
    }
    /// The distinct nodes reading `v`.
    pub fn consumers(&self, v: &str) -> &[usize] {
        self.consumers.get(v).map(|c| c.as_slice()).unwrap_or(&[])
    }
    /// A graph output or the training loss.
    pub fn needed(&self, v: &str) -> bool {
        self.needed.contains(v)
    }
    /// The one node reading `v`, when nothing else (no other node, no graph output) needs it.
    pub fn sole_consumer(&self, v: &str) -> Option<usize> {
        match self.consumers(v) {
            [c] if !self.needed(v) => Some(*c),
            _ => None,
        }
    }
    pub fn konst(&self, v: &str) -> Option<&'g Tensor> {
        self.consts.get(v).copied()
    }
    pub fn trainable(&self, v: &str) -> bool {
        self.trainable.contains(v)
    }
    /// The value of a one-element constant of rank 0 or 1.
    pub fn scalar(&self, v: &str) -> Option<f64> {
        let t = self.konst(v)?;
        (t.numel() == 1 && t.shape().len() <= 1).then(|| t.to_f64_vec()[0])
    }
    /// A scalar constant within 1e-4 (relative) of `want`, or as near as its dtype holds
    /// it (a graph cast to bf16 or f16 stores 0.044715 as 0.04468 or 0.04471).
    pub fn near(&self, v: &str, want: f64) -> bool {
        let rel = match self.konst(v).map(|t| t.dtype()) {
            Some(crate::tensor::DType::BF16) => 4e-3,
            Some(crate::tensor::DType::F16) => 1e-3,
            _ => 1e-4,
        };
        self.scalar(v)
            .is_some_and(|x| (x - want).abs() <= rel * want.abs())
    }
    /// The size of `x`'s last axis, when it is the same in every inference run.
    pub fn last_dim(&self, x: &str) -> Option<usize> {
        let shapes = self.facts.shapes(x)?;
        let d = *shapes.first()?.last()?;
        shapes.iter().all(|s| s.last() == Some(&d)).then_some(d)
    }
    /// When `v` is a Slice of `x` (of rank `rank`) on its last axis with step 1 and bounds
    /// that are constants (or computed from x's fixed last dim, as the TorchScript exporter
    /// writes `D // 2`): the Slice's node and its [start, end) clamped to x's last dim.
    pub fn last_axis_slice(&self, x: &str, v: &str, rank: usize) -> Option<(usize, (i64, i64))> {
        let (j, s) = self.prod(v, |op| *op == Op::Slice)?;
        if s.inputs[0] != x {
            return None;
        }
        let d = self.last_dim(x)? as i64;
        let ints = |k: usize| -> Option<Vec<i64>> {
            match s.inputs.get(k).filter(|v| !v.is_empty()) {
                Some(v) => Some(self.konst(v).or(self.facts.value(v))?.to_i64_vec()),
                None => None,
            }
        };
        let (starts, ends) = (ints(1)?, ints(2)?);
        let axes = ints(3).unwrap_or_else(|| (0..starts.len() as i64).collect());
        let steps = ints(4).unwrap_or_else(|| vec![1; starts.len()]);
        let ([s0], [e0], [a0], [1]) = (&starts[..], &ends[..], &axes[..], &steps[..]) else {
            return None;
        };
        if *a0 != -1 && *a0 != rank as i64 - 1 {
            return None;
        }
        let clamp = |b: i64| if b < 0 { (b + d).max(0) } else { b.min(d) };
        Some((j, (clamp(*s0), clamp(*e0))))
    }
    /// Whether everything `j` writes is read only by the nodes `sinks`, directly or
    /// through nodes of the same kind (within `depth` steps), and is no graph output: what
    /// pruning removes once `sinks` are gone (the shape arithmetic of a Slice's bounds).
    pub fn feeds_only(&self, j: usize, sinks: &[usize], depth: usize) -> bool {
        self.node(j)
            .outputs
            .iter()
            .filter(|o| !o.is_empty())
            .all(|o| {
                !self.needed(o)
                    && self.consumers(o).iter().all(|&c| {
                        sinks.contains(&c) || (depth > 0 && self.feeds_only(c, sinks, depth - 1))
                    })
            })
    }
    /// Whether `v` is computed from `from` within `depth` nodes.
    pub fn reaches_from(&self, from: &str, v: &str, depth: usize) -> bool {
        v == from
            || (depth > 0
                && self.producer(v).is_some_and(|p| {
                    self.node(p)
                        .inputs
                        .iter()
                        .any(|x| !x.is_empty() && self.reaches_from(from, x, depth - 1))
                }))
    }
    /// For a two-input node reading `v`: the other input.
    pub fn other<'n>(&self, n: &'n Node, v: &str) -> Option<&'n str> {
        match n.inputs.as_slice() {
            [a, b] if a == v && b != v => Some(b),
            [a, b] if b == v && a != v => Some(a),
            _ => None,
        }
    }
    /// The leaves of a product tree rooted at `v`: descends through Mul nodes whose result
    /// feeds only their parent. Returns the leaves and the Mul nodes walked.
    pub fn factors(&self, v: &'g str) -> (Vec<&'g str>, Vec<usize>) {
        let (mut leaves, mut nodes) = (vec![], vec![]);
        self.factors_into(v, true, &mut leaves, &mut nodes);
        (leaves, nodes)
    }
    fn factors_into(
        &self,
        v: &'g str,
        top: bool,
        leaves: &mut Vec<&'g str>,
        nodes: &mut Vec<usize>,
    ) {
        let mul = self.prod(v, |op| {
            matches!(op, Op::Binary(crate::graph::BinaryOp::Mul))
        });
        match mul {
            Some((i, n)) if top || self.sole_consumer(v).is_some() => {
                nodes.push(i);
                for x in &n.inputs {
                    self.factors_into(x, false, leaves, nodes);
                }
            }
            _ => leaves.push(v),
        }
    }
    /// Every value the nodes `set` produce, except `out`, is read only inside `set` and is
    /// no graph output: the condition for replacing `set` by one node producing `out`.
    pub fn swallow_ok(&self, set: &[usize], out: &str) -> Result<(), String> {
        self.swallow_ok_but(set, out, |_, _| false)
    }
    /// `swallow_ok`, where `spared(value, node)` names readers outside `set` that the
    /// rewrite takes care of itself (rewires, say).
    pub fn swallow_ok_but(
        &self,
        set: &[usize],
        out: &str,
        spared: impl Fn(&str, usize) -> bool,
    ) -> Result<(), String> {
        for &i in set {
            for o in self
                .node(i)
                .outputs
                .iter()
                .filter(|o| !o.is_empty() && o.as_str() != out)
            {
                if self.needed(o) {
                    return Err(format!("'{o}' is a graph output"));
                }
                let outside = |c: &&usize| !set.contains(c) && !spared(o, **c);
                if let Some(&c) = self.consumers(o).iter().find(outside) {
                    return Err(format!(
                        "'{o}' is also used by node '{}'",
                        self.node(c).name
                    ));
                }
            }
        }
        Ok(())
    }
    /// A value name not yet used in the graph, from `base`.
    pub fn fresh_value(&self, base: &str) -> String {
        let taken = |s: &str| {
            self.producer.contains_key(s)
                || self.consts.contains_key(s)
                || self.g.input(s).is_some()
        };
        fresh(base, taken)
    }
    pub fn fresh_node(&self, base: &str) -> String {
        fresh(base, |s| self.node_names.contains(s))
    }

    /// The nodes a patch touches: those it removes, the producers of their inputs and the
    /// readers of their outputs. Patches with disjoint footprints were matched on
    /// neighbourhoods that the others leave unchanged, so they can be applied together.
    pub fn footprint(&self, p: &Patch) -> HashSet<usize> {
        let mut f: HashSet<usize> = p.remove.iter().copied().collect();
        for &i in &p.remove {
            let n = self.node(i);
            f.extend(n.inputs.iter().filter_map(|v| self.producer(v)));
            for o in &n.outputs {
                f.extend(self.consumers(o).iter().copied());
            }
        }
        f
    }
}

/// `base`, or `base_2`, `base_3`, ... : the first name `taken` refuses.
pub(crate) fn fresh(base: &str, taken: impl Fn(&str) -> bool) -> String {
    if !taken(base) {
        return base.to_string();
    }
    (2..)
        .map(|k| format!("{base}_{k}"))
        .find(|s| !taken(s))
        .expect("some name is free")
}

/// Applies patches found on the same graph whose footprints are disjoint (the driver
/// checks that), then prunes what they left unused (nodes and initializers that only fed
/// removed nodes), so a rule never has to name every orphan. Each patch's new nodes take
/// the place of its last removed node. Linear in the graph size, whatever the number of
/// patches: a 100 000-node chain of rewrites is one pass, not 100 000.
pub fn apply_all(mut g: Graph, patches: Vec<Patch>) -> Graph {
    let mut removed: HashSet<usize> = HashSet::new();
    let mut add_at: HashMap<usize, Vec<Node>> = HashMap::new();
    let mut add_end: Vec<Node> = vec![];
    let mut orphans: Vec<String> = vec![];
    let mut map: HashMap<String, String> = HashMap::new();
    for p in patches {
        removed.extend(p.remove.iter().copied());
        orphans.extend(p.remove.iter().flat_map(|&i| g.nodes[i].inputs.clone()));
        match p.remove.iter().copied().max() {
            Some(at) => add_at.entry(at).or_default().extend(p.add),
            None => add_end.extend(p.add),
        }
        map.extend(p.rewire);
        g.initializers.extend(p.inits);
    }
    let old = std::mem::take(&mut g.nodes);
    for (i, n) in old.into_iter().enumerate() {
        if let Some(add) = add_at.remove(&i) {
            g.nodes.extend(add);
        }
        if !removed.contains(&i) {
            g.nodes.push(n);
        }
    }
    g.nodes.extend(add_end);
    let resolve = |v: &str| {
        let mut v = v.to_string();
        while let Some(w) = map.get(&v) {
            v = w.clone();
        }
        v
    };
    for n in &mut g.nodes {
        for v in &mut n.inputs {
            if map.contains_key(v.as_str()) {
                orphans.push(v.clone());
                *v = resolve(v);
            }
        }
    }
    prune(&mut g, orphans);
    g
}

/// Removes, transitively, the producers of `candidates` once nothing reads them (with
/// use counts, so that pruning stays linear).
fn prune(g: &mut Graph, mut candidates: Vec<String>) {
    let mut needed: HashSet<String> = g.outputs.iter().cloned().collect();
    needed.extend(g.training.as_ref().map(|t| t.loss.clone()));
    let mut uses: HashMap<String, usize> = HashMap::new();
    let mut producer: HashMap<String, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for v in &n.inputs {
            *uses.entry(v.clone()).or_default() += 1;
        }
        for o in n.outputs.iter().filter(|o| !o.is_empty()) {
            producer.insert(o.clone(), i);
        }
    }
    let used = |v: &str, uses: &HashMap<String, usize>| {
        needed.contains(v) || uses.get(v).is_some_and(|&c| c > 0)
    };
    let mut dead: HashSet<usize> = HashSet::new();
    let mut dead_inits: HashSet<String> = HashSet::new();
    while let Some(v) = candidates.pop() {
        if v.is_empty() || used(&v, &uses) {
            continue;
        }
        match producer.get(&v) {
            Some(&i) if !dead.contains(&i) => {
                let n = &g.nodes[i];
                if n.outputs.iter().all(|o| o.is_empty() || !used(o, &uses)) {
                    dead.insert(i);
                    for x in &n.inputs {
                        if let Some(c) = uses.get_mut(x) {
                            *c -= 1;
                        }
                        candidates.push(x.clone());
                    }
                }
            }
            Some(_) => {}
            None => {
                dead_inits.insert(v);
            }
        }
    }
    if !dead.is_empty() {
        let old = std::mem::take(&mut g.nodes);
        g.nodes = old
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !dead.contains(i))
            .map(|(_, n)| n)
            .collect();
    }
    g.initializers
        .retain(|init| !dead_inits.contains(&init.name));
}
