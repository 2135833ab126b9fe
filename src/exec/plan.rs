//! A plan: the graph compiled once for one set of input shapes (and values of the inputs
//! that decide shapes, where a graph has such inputs). It fixes the schedule,
//! folds what is known on the host, and gives every runtime value a buffer slot, reusing
//! slots whose values are dead, so peak memory stays far below the sum of intermediates.
//! Reshape-like nodes (a new shape over the same bytes) are not steps at all: their output
//! lives in their input's slot, and a slot is reused only once every value in it is dead.
//! Slots are assigned once the whole schedule is known (`assign`): each value's lifetime
//! is an interval of steps, and the largest values are placed first.

use crate::backends::cpu::HOST_EVAL;
use crate::error::Result;
use crate::graph::infer::{self, Inferred, ValueType};
use crate::graph::{Graph, Op};
use crate::tensor::Tensor;
use std::collections::{HashMap, HashSet};

/// What a plan is made for: every graph input's shape, and the fed values of the graph
/// inputs that decide shapes (`infer::plan_time_inputs`; none in most graphs). Sessions
/// cache their plans by it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanKey {
    /// Every graph input's shape, by name.
    pub shapes: HashMap<String, Vec<usize>>,
    /// The fed values of the graph inputs that decide shapes, by name.
    pub values: HashMap<String, Tensor>,
}

/// Where a value lives while the plan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// An initializer, uploaded once per session (index into `graph.initializers`).
    Weight(usize),
    /// A value folded at plan time, uploaded once per plan (index into `Plan::consts`).
    Const(usize),
    /// A graph input or node output in a reusable slot.
    Slot(usize),
}

/// One node run by a plan: where its inputs are read and its outputs written.
#[derive(Clone, Debug)]
pub struct Step {
    /// The node's index in `graph.nodes`.
    pub node: usize,
    /// Where each input is read; None for an omitted one.
    pub ins: Vec<Option<Place>>,
    /// Every output gets a slot, used or not: kernels write all their outputs.
    pub outs: Vec<usize>,
    /// Each output's type.
    pub out_types: Vec<ValueType>,
}

/// A graph compiled for one set of input shapes (see the module doc): the steps in run
/// order, every value's type and place, and the buffer slots they share.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Unique per plan made in this process (executors key uploaded constants by it).
    pub id: u64,
    /// The nodes to run, in order (nodes folded on the host, nodes no output needs and
    /// views are not steps).
    pub steps: Vec<Step>,
    /// Every value's type, by name.
    pub types: HashMap<String, ValueType>,
    /// Where each value lives while the plan runs, by name.
    pub places: HashMap<String, Place>,
    /// The values folded on the host when the plan was made (`Place::Const` indexes
    /// them).
    pub consts: Vec<(String, Tensor)>,
    /// Each slot's size in bytes (`Place::Slot` and `Step::outs` index them).
    pub slot_bytes: Vec<usize>,
    /// Bytes of all initializers.
    pub weight_bytes: usize,
    /// Bytes of every graph input and node output if each had its own buffer.
    pub naive_bytes: usize,
    /// Floating-point operations of one run (multiply-adds count 2).
    pub flops: u64,
}

impl Plan {
    /// Peak bytes of the reused slots (the activations' memory).
    pub fn peak_bytes(&self) -> usize {
        self.slot_bytes.iter().sum()
    }

    /// The plan for these input shapes (a graph without plan-time inputs).
    pub fn new(g: &Graph, input_shapes: &HashMap<String, Vec<usize>>) -> Result<Plan> {
        Plan::keeping(g, input_shapes, &HashSet::new())
    }

    /// The plan for `key`: its input shapes, and the values of the graph inputs that
    /// decide shapes, which inference takes as known on the host (they are still fed
    /// and uploaded as inputs: other nodes may read them as data).
    pub fn for_key(g: &Graph, key: &PlanKey, keep: &HashSet<String>) -> Result<Plan> {
        Plan::build(g, &key.shapes, &key.values, keep)
    }

    /// A plan where the values in `keep` are computed and live to the end, like graph
    /// outputs (so they can be fetched after a run): with every
    /// forward value kept, a backward graph's plan shows what an autograd that frees
    /// nothing would hold (the baseline `inspect --backward` prints).
    pub fn keeping(
        g: &Graph,
        input_shapes: &HashMap<String, Vec<usize>>,
        keep: &HashSet<String>,
    ) -> Result<Plan> {
        Plan::build(g, input_shapes, &HashMap::new(), keep)
    }

    fn build(
        g: &Graph,
        input_shapes: &HashMap<String, Vec<usize>>,
        values: &HashMap<String, Tensor>,
        keep: &HashSet<String>,
    ) -> Result<Plan> {
        let inf: Inferred = infer::infer_graph_with(g, input_shapes, values, &HOST_EVAL)?;
        // Nodes whose outputs are all known on the host are folded, not run.
        let folded = |ni: usize| {
            let n = &g.nodes[ni];
            !n.op.is_random()
                && n.outputs
                    .iter()
                    .all(|o| o.is_empty() || inf.consts.contains_key(o))
        };
        // Only what the outputs need is scheduled.
        let producer = g.producers();
        let mut needed: HashSet<usize> = HashSet::new();
        let mut stack: Vec<&str> = g.outputs.iter().chain(keep).map(|s| s.as_str()).collect();
        while let Some(v) = stack.pop() {
            if let Some(&p) = producer.get(v) {
                if needed.insert(p) && !folded(p) {
                    stack.extend(
                        g.nodes[p]
                            .inputs
                            .iter()
                            .map(|s| s.as_str())
                            .filter(|s| !s.is_empty()),
                    );
                }
            }
        }
        let order: Vec<usize> = inf
            .order
            .iter()
            .copied()
            .filter(|&i| needed.contains(&i) && !folded(i))
            .collect();

        let mut places: HashMap<String, Place> = HashMap::new();
        for (k, init) in g.initializers.iter().enumerate() {
            places.insert(init.name.clone(), Place::Weight(k));
        }
        // Constants that a scheduled node or a graph output reads.
        let mut consts = vec![];
        let input_names: HashSet<&str> = g.inputs.iter().map(|i| i.name.as_str()).collect();
        let mut want_const = |name: &str, places: &mut HashMap<String, Place>| {
            // Graph inputs known when planning are still fed into their slots.
            if places.contains_key(name) || input_names.contains(name) {
                return;
            }
            if let Some(c) = inf.consts.get(name) {
                places.insert(name.to_string(), Place::Const(consts.len()));
                consts.push((name.to_string(), c.clone()));
            }
        };
        for &ni in &order {
            for i in &g.nodes[ni].inputs {
                want_const(i, &mut places);
            }
        }
        for o in &g.outputs {
            if producer.get(o.as_str()).is_some_and(|&p| folded(p)) {
                want_const(o, &mut places);
            }
        }

        // Last step that reads each runtime value; graph outputs live to the end.
        let mut last_use: HashMap<&str, usize> = HashMap::new();
        for (s, &ni) in order.iter().enumerate() {
            for i in &g.nodes[ni].inputs {
                last_use.insert(i.as_str(), s);
            }
        }
        let outputs: HashSet<&str> = g.outputs.iter().chain(keep).map(|s| s.as_str()).collect();

        // Every value first gets a buffer of its own (views share their input's), with
        // the interval of steps it lives in; `assign` then maps buffers to slots.
        let end = order.len();
        let mut bufs = Buffers::default();
        let mut naive = 0usize;
        for i in &g.inputs {
            let t = &inf.types[&i.name];
            naive += t.bytes();
            let last = match last_use.get(i.name.as_str()) {
                _ if outputs.contains(i.name.as_str()) => end,
                Some(&l) => l,
                None => 0,
            };
            let b = bufs.add(t.bytes(), 0, last);
            places.insert(i.name.clone(), Place::Slot(b));
        }
        let mut steps = vec![];
        let mut flops = 0u64;
        for (s, &ni) in order.iter().enumerate() {
            let node = &g.nodes[ni];
            // A view: the output shares the input's slot and nothing runs. Not where the
            // output or the input is a graph output (or kept): callers may change those in
            // place after the run (the optimizer's weights, data-parallel gradient
            // averaging), and a slot holding an output then holds nothing else.
            // Weights and constants are not aliased either (they are updated in place or
            // shared between plans). A graph input kept to the end (static feeds) may be:
            // only the next feed writes it, and the view only reads it.
            if is_view(&node.op) {
                let (x, o) = (&node.inputs[0], &node.outputs[0]);
                if let Some(&Place::Slot(b)) = places.get(x) {
                    let fed = g.inputs.iter().any(|i| i.name == *x);
                    if (fed || !outputs.contains(x.as_str())) && !outputs.contains(o.as_str()) {
                        naive += inf.types[o].bytes();
                        places.insert(o.clone(), Place::Slot(b));
                        let last = last_use.get(o.as_str()).copied().unwrap_or(s);
                        bufs.extend(b, last);
                        continue;
                    }
                }
            }
            let ins: Vec<Option<Place>> = node.map_inputs(|i| places.get(i).copied());
            let mut outs = vec![];
            let out_types: Vec<ValueType> = node
                .outputs
                .iter()
                .enumerate()
                .map(|(k, o)| {
                    inf.types.get(o).cloned().unwrap_or_else(|| {
                        // An unnamed optional output still needs room; infer it again.
                        let tys: Vec<Option<&ValueType>> =
                            node.inputs.iter().map(|i| inf.types.get(i)).collect();
                        infer::infer_node(node, &tys, &[], &HOST_EVAL)
                            .map(|v| v[k].clone())
                            .unwrap_or(ValueType::new(crate::tensor::DType::F32, &[]))
                    })
                })
                .collect();
            for (o, t) in node.outputs.iter().zip(&out_types) {
                naive += t.bytes();
                let last = match last_use.get(o.as_str()) {
                    _ if outputs.contains(o.as_str()) => end,
                    Some(&l) if !o.is_empty() => l,
                    _ => s,
                };
                let b = bufs.add(t.bytes(), s, last);
                outs.push(b);
                if !o.is_empty() {
                    places.insert(o.clone(), Place::Slot(b));
                }
            }
            {
                let in_tys: Vec<Option<&ValueType>> =
                    node.inputs.iter().map(|i| inf.types.get(i)).collect();
                flops += infer::flops(node, &in_tys, &out_types);
            }
            steps.push(Step {
                node: ni,
                ins,
                outs,
                out_types,
            });
        }
        let (slot_of, slot_bytes) = bufs.assign();
        for st in &mut steps {
            for p in st.ins.iter_mut().flatten() {
                if let Place::Slot(b) = p {
                    *b = slot_of[*b];
                }
            }
            for b in &mut st.outs {
                *b = slot_of[*b];
            }
        }
        for p in places.values_mut() {
            if let Place::Slot(b) = p {
                *b = slot_of[*b];
            }
        }
        let weight_bytes = g.initializers.iter().map(|i| i.tensor.size_bytes()).sum();
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Plan {
            id,
            steps,
            types: inf.types,
            places,
            consts,
            slot_bytes,
            weight_bytes,
            naive_bytes: naive,
            flops,
        })
    }
}

/// Ops whose output is their first input's bytes under another shape (or, for BitCast,
/// another dtype of the same width): the plan gives the output the input's slot instead of
/// a copy.
fn is_view(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape { .. }
            | Op::Flatten { .. }
            | Op::Squeeze { .. }
            | Op::Unsqueeze { .. }
            | Op::Identity
            | Op::BitCast { .. }
    )
}

/// The values' buffers before they get slots: each one's size and the steps it lives
/// in, from the step that writes it (0 for graph inputs) to its last reader's (the plan's
/// end for outputs), both included, so that a step's outputs never share a slot with its
/// inputs.
#[derive(Default)]
struct Buffers {
    bytes: Vec<usize>,
    live: Vec<(usize, usize)>,
}

impl Buffers {
    fn add(&mut self, bytes: usize, first: usize, last: usize) -> usize {
        self.bytes.push(bytes);
        self.live.push((first, last.max(first)));
        self.bytes.len() - 1
    }
    /// A view of buffer `b` is read until step `last`.
    fn extend(&mut self, b: usize, last: usize) {
        self.live[b].1 = self.live[b].1.max(last);
    }

    /// Slots for the buffers (buffer → slot, and each slot's bytes). Two orders of
    /// placing them, keeping the one whose slots add up to less: in schedule order (each
    /// value reuses what is free when it is made, as a caching allocator would), and
    /// largest first over the whole schedule, which keeps a small long-lived value out
    /// of a large slot that a large value needs later (gpt_block's training step: 769
    /// MiB of slots instead of 849; mlp_large's gradient plan is the other way round).
    /// The second is quadratic in the buffers, so graphs with more than `BY_SIZE_MAX`
    /// (a hundred thousand inputs, say) get the first alone.
    fn assign(&self) -> (Vec<usize>, Vec<usize>) {
        const BY_SIZE_MAX: usize = 5000;
        let mut by_time: Vec<usize> = (0..self.bytes.len()).collect();
        by_time.sort_by_key(|&b| (self.live[b].0, b));
        let a = self.place_in_time_order(&by_time);
        if self.bytes.len() > BY_SIZE_MAX {
            return a;
        }
        let mut by_size = by_time.clone();
        by_size.sort_by_key(|&b| (std::cmp::Reverse(self.bytes[b]), self.live[b].0, b));
        let b = self.place(&by_size);
        if b.1.iter().sum::<usize>() < a.1.iter().sum::<usize>() {
            b
        } else {
            a
        }
    }

    /// `place` for buffers in the order their lives begin, in O(n log n): every buffer
    /// placed before begins no later, so a slot is free exactly when the last life it
    /// holds has ended. Slots wait in a heap by that end and, once free, in a set by size
    /// (ties by slot number, the choice `place` makes).
    fn place_in_time_order(&self, order: &[usize]) -> (Vec<usize>, Vec<usize>) {
        use std::cmp::Reverse;
        use std::collections::{BTreeSet, BinaryHeap};
        let mut slot_of = vec![0; self.bytes.len()];
        let mut slots: Vec<usize> = vec![];
        let mut busy: BinaryHeap<Reverse<(usize, usize)>> = BinaryHeap::new();
        let mut free: BTreeSet<(usize, usize)> = BTreeSet::new();
        for &b in order {
            let ((f, l), need) = (self.live[b], self.bytes[b]);
            while let Some(&Reverse((end, s))) = busy.peek() {
                if end >= f {
                    break;
                }
                busy.pop();
                free.insert((slots[s], s));
            }
            let fit = free.range((need, 0)..).next().copied();
            let s = match fit.or_else(|| free.last().copied()) {
                Some(k) => {
                    free.remove(&k);
                    k.1
                }
                None => {
                    slots.push(0);
                    slots.len() - 1
                }
            };
            slots[s] = slots[s].max(need);
            busy.push(Reverse((l, s)));
            slot_of[b] = s;
        }
        (slot_of, slots)
    }

    /// Places the buffers in `order`: each into the smallest slot that holds no buffer
    /// living at the same time and is large enough, else the largest such slot (grown),
    /// else a new one.
    fn place(&self, order: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let mut slot_of = vec![0; self.bytes.len()];
        let mut slots: Vec<usize> = vec![];
        let mut held: Vec<Vec<(usize, usize)>> = vec![];
        for &b in order {
            let ((f, l), need) = (self.live[b], self.bytes[b]);
            let free: Vec<usize> = (0..slots.len())
                .filter(|&s| held[s].iter().all(|&(f2, l2)| l2 < f || l < f2))
                .collect();
            let fit = free
                .iter()
                .copied()
                .filter(|&s| slots[s] >= need)
                .min_by_key(|&s| slots[s]);
            let s = match fit.or_else(|| free.iter().copied().max_by_key(|&s| slots[s])) {
                Some(s) => s,
                None => {
                    slots.push(0);
                    held.push(vec![]);
                    slots.len() - 1
                }
            };
            slots[s] = slots[s].max(need);
            held[s].push((f, l));
            slot_of[b] = s;
        }
        (slot_of, slots)
    }
}

#[cfg(test)]
mod tests {
    use super::Buffers;

    /// The O(n log n) placement makes exactly the choices of the general one in schedule
    /// order, on random lives and sizes (many ties of both).
    #[test]
    fn time_order_placement_matches_the_general_one() {
        let mut r = crate::rng::Rng::new(7);
        for case in 0..200 {
            let n = 1 + case % 60;
            let mut b = Buffers::default();
            for _ in 0..n {
                let f = (r.next_u64() % 20) as usize;
                let len = (r.next_u64() % 8) as usize;
                let bytes = 64 * (1 + (r.next_u64() % 6) as usize);
                b.add(bytes, f, f + len);
            }
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&k| (b.live[k].0, k));
            assert_eq!(
                b.place(&order),
                b.place_in_time_order(&order),
                "case {case}"
            );
        }
    }
}
