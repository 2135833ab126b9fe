//! A plan: the graph compiled once for one set of input shapes. It fixes the schedule,
//! folds what is known on the host, and gives every runtime value a buffer slot, reusing
//! slots whose values are dead, so peak memory stays far below the sum of intermediates.
//! Reshape-like nodes (a new shape over the same bytes) are not steps at all: their output
//! lives in their input's slot, and a slot is reused only once every value in it is dead.

use crate::error::Result;
use crate::graph::infer::{self, Inferred, ValueType};
use crate::graph::{Graph, Op};
use crate::tensor::Tensor;
use std::collections::{HashMap, HashSet};

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

#[derive(Clone, Debug)]
pub struct Step {
    pub node: usize,
    pub ins: Vec<Option<Place>>,
    /// Every output gets a slot, used or not: kernels write all their outputs.
    pub outs: Vec<usize>,
    pub out_types: Vec<ValueType>,
}

#[derive(Clone, Debug)]
pub struct Plan {
    /// Unique per plan made in this process (executors key uploaded constants by it).
    pub id: u64,
    pub steps: Vec<Step>,
    pub types: HashMap<String, ValueType>,
    pub places: HashMap<String, Place>,
    pub consts: Vec<(String, Tensor)>,
    pub slot_bytes: Vec<usize>,
    /// Bytes of all initializers.
    pub weight_bytes: usize,
    /// Bytes of every graph input and node output if each had its own buffer.
    pub naive_bytes: usize,
    pub flops: u64,
}

impl Plan {
    /// Peak bytes of the reused slots (the activations' memory).
    pub fn peak_bytes(&self) -> usize {
        self.slot_bytes.iter().sum()
    }

    pub fn new(g: &Graph, input_shapes: &HashMap<String, Vec<usize>>) -> Result<Plan> {
        Plan::keeping(g, input_shapes, &HashSet::new())
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
        let inf: Inferred = infer::infer_graph(g, input_shapes)?;
        // Nodes whose outputs are all known on the host are folded, not run.
        let folded = |ni: usize| {
            let n = &g.nodes[ni];
            !matches!(n.op, Op::Dropout { .. })
                && n.outputs
                    .iter()
                    .all(|o| o.is_empty() || inf.consts.contains_key(o))
        };
        // Only what the outputs need is scheduled.
        let producer: HashMap<&str, usize> = g
            .nodes
            .iter()
            .enumerate()
            .flat_map(|(i, n)| n.outputs.iter().map(move |o| (o.as_str(), i)))
            .collect();
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
        let mut want_const = |name: &str, places: &mut HashMap<String, Place>| {
            if places.contains_key(name) {
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

        let mut slots = SlotAlloc::default();
        let mut naive = 0usize;
        for i in &g.inputs {
            let t = &inf.types[&i.name];
            naive += t.bytes();
            let s = slots.take(t.bytes());
            places.insert(i.name.clone(), Place::Slot(s));
            if !last_use.contains_key(i.name.as_str()) && !outputs.contains(i.name.as_str()) {
                slots.free(s);
            }
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
            // shared between plans).
            if is_view(&node.op) {
                let (x, o) = (&node.inputs[0], &node.outputs[0]);
                if let Some(&Place::Slot(sl)) = places.get(x) {
                    if !outputs.contains(x.as_str()) && !outputs.contains(o.as_str()) {
                        naive += inf.types[o].bytes();
                        places.insert(o.clone(), Place::Slot(sl));
                        slots.share(sl);
                        let mut seen = HashSet::new();
                        for i in &node.inputs {
                            if last_use.get(i.as_str()) == Some(&s)
                                && !outputs.contains(i.as_str())
                                && seen.insert(i)
                            {
                                if let Some(Place::Slot(sl)) = places.get(i) {
                                    slots.free(*sl);
                                }
                            }
                        }
                        if !last_use.contains_key(o.as_str()) {
                            slots.free(sl);
                        }
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
                        infer::infer_node(node, &tys, &[])
                            .map(|v| v[k].clone())
                            .unwrap_or(ValueType::new(crate::tensor::DType::F32, &[]))
                    })
                })
                .collect();
            for (o, t) in node.outputs.iter().zip(&out_types) {
                naive += t.bytes();
                let slot = slots.take(t.bytes());
                outs.push(slot);
                if !o.is_empty() {
                    places.insert(o.clone(), Place::Slot(slot));
                }
            }
            {
                let in_tys: Vec<Option<&ValueType>> =
                    node.inputs.iter().map(|i| inf.types.get(i)).collect();
                flops += infer::flops(node, &in_tys, &out_types);
            }
            // Free inputs read for the last time, and outputs nobody reads.
            let mut seen = HashSet::new();
            for i in &node.inputs {
                if last_use.get(i.as_str()) == Some(&s)
                    && !outputs.contains(i.as_str())
                    && seen.insert(i)
                {
                    if let Some(Place::Slot(sl)) = places.get(i) {
                        slots.free(*sl);
                    }
                }
            }
            for (o, &sl) in node.outputs.iter().zip(&outs) {
                if !last_use.contains_key(o.as_str()) && !outputs.contains(o.as_str()) {
                    slots.free(sl);
                }
            }
            steps.push(Step {
                node: ni,
                ins,
                outs,
                out_types,
            });
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
            slot_bytes: slots.bytes,
            weight_bytes,
            naive_bytes: naive,
            flops,
        })
    }
}

/// Ops whose output is their first input's bytes under another shape: the plan gives the
/// output the input's slot instead of a copy.
fn is_view(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape { .. }
            | Op::Flatten { .. }
            | Op::Squeeze { .. }
            | Op::Unsqueeze { .. }
            | Op::Identity
    )
}

/// Best-fit reuse of freed slots; a slot grows when the value it takes is larger. A slot
/// counts the live values in it (more than one where views share it) and is reused only
/// when the last one dies.
#[derive(Default)]
struct SlotAlloc {
    bytes: Vec<usize>,
    free: Vec<usize>,
    live: Vec<usize>,
}

impl SlotAlloc {
    fn take(&mut self, need: usize) -> usize {
        // Smallest free slot that fits; else the largest free one (grown); else a new one.
        let fit = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, &s)| self.bytes[s] >= need)
            .min_by_key(|(_, &s)| self.bytes[s]);
        let pick = fit.or_else(|| {
            self.free
                .iter()
                .enumerate()
                .max_by_key(|(_, &s)| self.bytes[s])
        });
        match pick.map(|(i, _)| i) {
            Some(i) => {
                let s = self.free.swap_remove(i);
                self.bytes[s] = self.bytes[s].max(need);
                self.live[s] = 1;
                s
            }
            None => {
                self.bytes.push(need);
                self.live.push(1);
                self.bytes.len() - 1
            }
        }
    }
    /// One more value (a view) lives in slot `s`.
    fn share(&mut self, s: usize) {
        self.live[s] += 1;
    }
    /// One value in slot `s` is dead; the slot is free when none is left.
    fn free(&mut self, s: usize) {
        self.live[s] = self.live[s].saturating_sub(1);
        if self.live[s] == 0 && !self.free.contains(&s) {
            self.free.push(s);
        }
    }
}
