//! Sessions: a graph bound to a backend. A session uploads the initializers once, makes
//! (and caches) a plan per set of input shapes, and runs it.

use super::plan::{Place, Plan};
use crate::backends::{cpu::Cpu, Backend, BackendKind};
use crate::error::{Error, Result};
use crate::graph::infer::ValueType;
use crate::graph::Graph;
use crate::tensor::Tensor;
use std::collections::{BTreeMap, HashMap};

#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub backend: BackendKind,
    /// Symbol bindings (`--dim`), over the model's `dims:` defaults.
    pub dims: BTreeMap<String, usize>,
    /// Training mode: Dropout applies its seeded mask.
    pub training: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            backend: BackendKind::Cpu,
            dims: BTreeMap::new(),
            training: false,
        }
    }
}

/// A graph bound to a backend, ready to run.
pub struct Session {
    graph: Graph,
    opts: SessionOptions,
    exec: Box<dyn Run>,
    plans: PlanCache,
}

/// What `Session` needs from an executor, whatever its backend.
trait Run {
    fn run(
        &mut self,
        g: &Graph,
        plan: &Plan,
        feeds: &HashMap<String, Tensor>,
    ) -> Result<Vec<Tensor>>;
    /// With profiling on, each step is synchronized and timed into `profile`.
    fn set_profiling(&mut self, on: bool);
    fn take_profile(&mut self) -> Vec<(usize, f64)>;
    fn backend_name(&self) -> &'static str;
}

impl Session {
    pub fn new(graph: Graph, opts: SessionOptions) -> Result<Session> {
        let exec: Box<dyn Run> = match opts.backend {
            BackendKind::Cpu => Box::new(Executor::new(Cpu { training: opts.training }, &graph)?),
            other => crate::bail!(
                Runtime,
                "backend '{}' is not available in this build of graphrun; use --backend cpu (run `graphrun doctor` to see what this machine offers)",
                other.name()
            ),
        };
        Ok(Session {
            graph,
            opts,
            exec,
            plans: PlanCache::default(),
        })
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }
    pub fn backend_name(&self) -> &'static str {
        self.exec.backend_name()
    }

    /// Checks feeds against the graph inputs and resolves every input's shape.
    pub fn input_shapes(
        &self,
        feeds: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Vec<usize>>> {
        for name in feeds.keys() {
            if self.graph.input(name).is_none() {
                let known: Vec<&str> = self.graph.inputs.iter().map(|i| i.name.as_str()).collect();
                crate::bail!(
                    Input,
                    "'{name}' is not an input of the graph (its inputs: {})",
                    known.join(", ")
                );
            }
        }
        let mut missing = vec![];
        for i in &self.graph.inputs {
            match feeds.get(&i.name) {
                None => missing.push(i.name.clone()),
                Some(t) if t.dtype() != i.dtype => {
                    crate::bail!(
                        Input,
                        "input '{}' must be {}, got {}",
                        i.name,
                        i.dtype,
                        t.dtype()
                    )
                }
                Some(_) => {}
            }
        }
        if !missing.is_empty() {
            crate::bail!(
                Input,
                "missing graph input{} {}",
                if missing.len() > 1 { "s" } else { "" },
                missing
                    .iter()
                    .map(|m| format!("'{m}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let dims = super::bind_dims(&self.graph, feeds, &self.opts.dims)?;
        self.graph
            .inputs
            .iter()
            .map(|i| Ok((i.name.clone(), super::concrete_shape(i, &dims)?)))
            .collect()
    }

    /// Makes the plan for these feeds' shapes (what `inspect` reports).
    pub fn plan_for(&self, feeds: &HashMap<String, Tensor>) -> Result<Plan> {
        Plan::new(&self.graph, &self.input_shapes(feeds)?)
    }

    /// Times every node from now on (each one synchronized: slower, for `bench`).
    pub fn set_profiling(&mut self, on: bool) {
        self.exec.set_profiling(on);
    }

    /// Seconds per node summed over the runs since the last call: (node name, op, s).
    pub fn take_profile(&mut self) -> Vec<(String, &'static str, f64)> {
        let mut acc: Vec<(String, &'static str, f64)> = vec![];
        for (ni, secs) in self.exec.take_profile() {
            let n = &self.graph.nodes[ni];
            match acc.iter_mut().find(|(name, _, _)| *name == n.name) {
                Some(e) => e.2 += secs,
                None => acc.push((n.name.clone(), n.op.name(), secs)),
            }
        }
        acc
    }

    /// Runs the graph; returns the outputs in the order of `graph.outputs`.
    pub fn run(&mut self, feeds: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>> {
        let shapes = self.input_shapes(feeds)?;
        let plan = self.plans.get_or_insert(&self.graph, shapes)?;
        let outs = self.exec.run(&self.graph, plan, feeds)?;
        Ok(self.graph.outputs.iter().cloned().zip(outs).collect())
    }
}

/// Runs plans on one backend, holding its uploaded initializers and slot buffers.
struct Executor<B: Backend> {
    backend: B,
    weights: Vec<B::Buffer>,
    slots: Vec<Option<B::Buffer>>,
    consts: Vec<B::Buffer>,
    /// Which plan (by id) the consts were uploaded for.
    consts_for: u64,
    profile: Option<Vec<(usize, f64)>>,
}

impl<B: Backend> Executor<B> {
    fn new(mut backend: B, g: &Graph) -> Result<Self> {
        let mut weights = vec![];
        for init in &g.initializers {
            let mut b = backend.alloc(init.tensor.size_bytes())?;
            backend.upload(&init.tensor, &mut b)?;
            weights.push(b);
        }
        Ok(Executor {
            backend,
            weights,
            slots: vec![],
            consts: vec![],
            consts_for: 0,
            profile: None,
        })
    }
}

impl<B: Backend> Run for Executor<B> {
    fn backend_name(&self) -> &'static str {
        self.backend.name()
    }
    fn set_profiling(&mut self, on: bool) {
        self.profile = if on {
            Some(self.profile.take().unwrap_or_default())
        } else {
            None
        };
    }
    fn take_profile(&mut self) -> Vec<(usize, f64)> {
        self.profile
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
    fn run(
        &mut self,
        g: &Graph,
        plan: &Plan,
        feeds: &HashMap<String, Tensor>,
    ) -> Result<Vec<Tensor>> {
        // Grow the slot pool to the plan (kept across runs: no allocation in steady state).
        if self.slots.len() < plan.slot_bytes.len() {
            self.slots.resize_with(plan.slot_bytes.len(), || None);
        }
        for (s, &bytes) in plan.slot_bytes.iter().enumerate() {
            if self.slots[s].is_none() {
                self.slots[s] = Some(self.backend.alloc(bytes)?);
            }
        }
        let plan_id = plan.id;
        if self.consts_for != plan_id {
            self.consts.clear();
            for (_, c) in &plan.consts {
                let mut b = self.backend.alloc(c.size_bytes())?;
                self.backend.upload(c, &mut b)?;
                self.consts.push(b);
            }
            self.consts_for = plan_id;
        }
        for i in &g.inputs {
            if let Some(Place::Slot(s)) = plan.places.get(&i.name) {
                let buf = self.slots[*s].as_mut().expect("allocated above");
                self.backend.upload(&feeds[&i.name], buf)?;
            }
        }
        for step in &plan.steps {
            let node = &g.nodes[step.node];
            let t0 = self.profile.is_some().then(std::time::Instant::now);
            let mut outs: Vec<B::Buffer> = step
                .outs
                .iter()
                .map(|&s| self.slots[s].take().expect("slot in use twice"))
                .collect();
            let result = {
                let ins: Vec<Option<(&B::Buffer, &ValueType)>> = node
                    .inputs
                    .iter()
                    .zip(&step.ins)
                    .map(|(name, p)| {
                        p.map(|p| {
                            let buf = match p {
                                Place::Weight(w) => &self.weights[w],
                                Place::Const(c) => &self.consts[c],
                                Place::Slot(s) => self.slots[s].as_ref().expect("input slot live"),
                            };
                            (buf, &plan.types[name])
                        })
                    })
                    .collect();
                let mut out_refs: Vec<(&mut B::Buffer, &ValueType)> =
                    outs.iter_mut().zip(&step.out_types).collect();
                self.backend.run(node, &ins, &mut out_refs)
            };
            for (&s, b) in step.outs.iter().zip(outs) {
                self.slots[s] = Some(b);
            }
            if let (Some(t0), true) = (t0, result.is_ok()) {
                self.backend.sync()?;
                let secs = t0.elapsed().as_secs_f64();
                self.profile
                    .as_mut()
                    .expect("profiling on")
                    .push((step.node, secs));
            }
            result.map_err(|e| match e {
                Error::Runtime(m) if !m.contains(&format!("node '{}'", node.name)) => {
                    Error::Runtime(format!("{}: {m}", node.describe()))
                }
                e => e,
            })?;
        }
        self.backend.sync()?;
        let mut out = vec![];
        for o in &g.outputs {
            let ty = &plan.types[o];
            let t = match plan.places.get(o) {
                Some(Place::Weight(w)) => self.backend.download(&self.weights[*w], ty)?,
                Some(Place::Const(c)) => plan.consts[*c].1.clone(),
                Some(Place::Slot(s)) => self
                    .backend
                    .download(self.slots[*s].as_ref().expect("output slot"), ty)?,
                None => crate::bail!(Runtime, "graph output '{o}' has no buffer in the plan"),
            };
            out.push(t);
        }
        Ok(out)
    }
}

/// Plans cached by input shapes.
#[derive(Default)]
pub(crate) struct PlanCache {
    plans: Vec<(HashMap<String, Vec<usize>>, Plan)>,
}

impl PlanCache {
    fn get_or_insert(&mut self, g: &Graph, shapes: HashMap<String, Vec<usize>>) -> Result<&Plan> {
        if let Some(i) = self.plans.iter().position(|(s, _)| *s == shapes) {
            return Ok(&self.plans[i].1);
        }
        let plan = Plan::new(g, &shapes)?;
        self.plans.push((shapes, plan));
        Ok(&self.plans.last().unwrap().1)
    }
}
