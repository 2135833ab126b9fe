//! Sessions: a graph bound to a backend. A session uploads the initializers once, makes
//! (and caches) a plan per set of input shapes and values of the inputs that decide
//! shapes (`PlanKey`), and runs it.

use super::plan::{Place, Plan, PlanKey};
use crate::backends::{cpu::Cpu, Backend, BackendKind};
use crate::error::{Error, Result};
use crate::graph::infer::ValueType;
use crate::graph::{Graph, Node, Op, Optimizer};
use crate::passes::autodiff::{self, Backward, BackwardOptions};
use crate::passes::PassOptions;
use crate::tensor::Tensor;
use std::collections::{BTreeMap, HashMap};

/// How a `Session` runs its graph. `Default` is the CPU, optimized, for inference;
/// `unfused` runs the graph exactly as given.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// The backend to run on.
    pub backend: BackendKind,
    /// Symbol bindings (`--dim`), over the model's `dims:` defaults.
    pub dims: BTreeMap<String, usize>,
    /// `backward` differentiates in training mode (Dropout applies its mask); `run` is
    /// always inference and `train_step` always training.
    pub training: bool,
    /// The passes: run on the graph when the session is made (with `fuse`), and on
    /// generated backward graphs.
    pub passes: PassOptions,
    /// Optimize the graph (`passes::optimize` with `passes`: constant folding, fusion of
    /// MatMul epilogues and attention, …) before planning it, as the command line does.
    /// On by default; off runs the graph exactly as given (the command line turns it off
    /// because it optimizes first, to report what the passes did).
    pub fuse: bool,
    /// f32 matrix products may use TF32 tensor cores (`--dtype tf32`); the CPU ignores it.
    pub tf32: bool,
    /// The CUDA device (ordinal) of a cuda session.
    pub device: usize,
    /// Let training go on when an update leaves NaN or infinite values in a parameter
    /// (by default `train_step` stops with an error naming it).
    pub allow_nonfinite: bool,
    /// Data-parallel training (`DataParallel`) with the optimizer sharded (ZeRO stage
    /// 1): each GPU keeps the optimizer state (Adam's moments, momentum) of its own
    /// shard of every parameter only, a 1/N share; gradients are reduce-scattered to the
    /// shards' owners and the stepped parameters gathered back. The same steps as
    /// without it. A plain session ignores it.
    pub shard_optimizer: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            backend: BackendKind::Cpu,
            dims: BTreeMap::new(),
            training: false,
            passes: PassOptions::default(),
            fuse: true,
            tf32: false,
            device: 0,
            allow_nonfinite: false,
            shard_optimizer: false,
        }
    }
}

impl SessionOptions {
    /// The defaults with `fuse` off: the session runs the graph exactly as given.
    pub fn unfused() -> Self {
        SessionOptions {
            fuse: false,
            ..Default::default()
        }
    }
}

/// What `Session::backward` returns.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// The forward outputs, in the order of `graph.outputs`.
    pub outputs: Vec<(String, Tensor)>,
    /// (floating graph input or trainable initializer, its gradient), inputs first.
    pub grads: Vec<(String, Tensor)>,
}

/// A plan that keeps extra values to fetch: (fetch list, what it is for, plan).
type FetchPlan = (Vec<String>, PlanKey, Plan);

/// A backward graph for one set of input shapes (and plan-time values), and its plan.
struct BackwardPlan {
    key: PlanKey,
    bwd: Backward,
    plan: Plan,
    /// The default seed of each seed input (all ones), made once.
    ones: HashMap<String, Tensor>,
}

/// A graph bound to a backend, ready to run.
pub struct Session {
    graph: Graph,
    opts: SessionOptions,
    exec: Box<dyn Run>,
    plans: PlanCache,
    /// The graph inputs whose fed values decide shapes: plans are made (and cached) for
    /// their values as well as for the input shapes.
    plan_inputs: Vec<crate::graph::infer::PlanTimeInput>,
    /// Plans made so far, of every kind (`plans_made`).
    plans_made: std::cell::Cell<usize>,
    /// Plans that keep extra values to fetch (`run_fetch`), per fetch list and shapes.
    fetch_plans: Vec<FetchPlan>,
    /// Backward graphs of every floating output (`backward`), per input shapes.
    grad_plans: Vec<BackwardPlan>,
    /// The outputs `backward` differentiates (`set_backward_outputs`); None: every
    /// floating output.
    grad_outputs: Option<Vec<String>>,
    /// Backward graphs of the training loss (`train_step`), per input shapes.
    train_plans: Vec<BackwardPlan>,
    /// Optimizer steps taken.
    steps: u64,
    /// The train plan of the last step (its update pairs name what `check_finite` finds).
    last_train: usize,
    /// `set_static_feeds`.
    static_feeds: bool,
}

/// A training step's optimizer update, run with the step's launches (so that a backend
/// that records steps records it too).
struct Update<'a> {
    /// (trainable initializer, its gradient value)
    pairs: &'a [(String, String)],
    opt: &'a Optimizer,
    /// Counts steps from 1.
    t: u64,
    /// Gradient accumulation: this run is micro-batch `micro.0` of `micro.1` (0 of 1
    /// without accumulation). Each adds its gradients, weighted 1/count, into the
    /// executor's accumulators; only the last averages them over the workers and steps
    /// the optimizer, reading the accumulators as the gradients.
    micro: (usize, usize),
}

impl Update<'_> {
    fn accumulates(&self) -> bool {
        self.micro.1 > 1
    }
    fn last(&self) -> bool {
        self.micro.0 + 1 == self.micro.1
    }
}

/// What `Session` needs from an executor, whatever its backend.
trait Run {
    /// Runs a plan (and then `update`) and downloads the values named in `fetch`.
    fn run(
        &mut self,
        g: &Graph,
        plan: &Plan,
        feeds: &HashMap<&str, &Tensor>,
        fetch: &[String],
        update: Option<Update>,
    ) -> Result<Vec<Tensor>>;
    /// The current value of an initializer (trained parameters).
    fn weight(&mut self, name: &str) -> Result<Option<Tensor>>;
    /// With profiling on, each step is synchronized and timed into `profile`.
    fn set_profiling(&mut self, on: bool);
    fn take_profile(&mut self) -> Vec<(String, &'static str, f64)>;
    fn backend_name(&self) -> &'static str;
    /// `Backend::held_bytes`.
    fn held_bytes(&self) -> usize;
    /// The training step number (seeds Dropout masks: a new mask every step).
    fn set_step(&mut self, step: u64);
    /// `Session::set_static_feeds`.
    fn set_static_feeds(&mut self, on: bool);
    /// Waits for the backend's queued work (and reports its errors).
    fn sync(&mut self) -> Result<()>;
    /// Makes this executor a data-parallel worker: every initializer is replaced by the
    /// first worker's, and training steps average their gradients over the workers;
    /// with `shard`, each worker keeps the optimizer state of its shard of every
    /// parameter only (`SessionOptions::shard_optimizer`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn set_data_parallel(&mut self, shard: bool) -> Result<()>;
    /// Bytes of optimizer state held (Adam's moments, momentum).
    fn optimizer_state_bytes(&self) -> usize;
    /// `Backend::take_nonfinite`: the index in the step's update pairs of the first
    /// parameter an update left NaN or infinite.
    fn take_nonfinite(&mut self) -> Result<Option<usize>>;
}

/// The graph a session runs: optimized when `opts.fuse` asks (in training mode when the
/// session may train, so that training-only nodes such as Dropout's mask stay).
/// The graph is then laid out for the backend (`passes::layout`): channels-last between
/// convolutions on CUDA with cuDNN, channels-first everywhere else.
pub(crate) fn prepared(graph: Graph, opts: &SessionOptions) -> Result<Graph> {
    let graph = match opts.fuse {
        true => {
            let mut passes = opts.passes.clone();
            passes.training |= opts.training || graph.training.is_some();
            crate::passes::optimize(&graph, &passes)?.0
        }
        false => graph,
    };
    let eval = opts.passes.eval;
    let t = crate::backends::tuning::tuning();
    match opts.backend {
        BackendKind::Cuda
            if t.channels_last
                && ["", "nhwc"].contains(&t.cuda_conv.as_str())
                && crate::backends::cuda::cudnn_found() =>
        {
            Ok(crate::passes::layout::channels_last(&graph, eval, &|_| true)?.0)
        }
        // CUDA runs a model's channels-last nodes as they are.
        BackendKind::Cuda => Ok(graph),
        _ => crate::passes::layout::channels_first(&graph, eval),
    }
}

impl Session {
    /// A session of `graph` on `opts.backend`; the graph is optimized first unless
    /// `opts.fuse` is off.
    pub fn new(graph: Graph, opts: SessionOptions) -> Result<Session> {
        let graph = prepared(graph, &opts)?;
        let exec: Box<dyn Run> = match opts.backend {
            BackendKind::Cpu => Box::new(Executor::new(Cpu::default(), &graph)?),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => Box::new(Executor::new(
                crate::backends::cuda::Cuda::on(opts.device, opts.tf32)?,
                &graph,
            )?),
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => {
                crate::bail!(
                    Runtime,
                    "the cuda backend: {}",
                    crate::backends::cuda::NOT_BUILT
                )
            }
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => {
                Box::new(Executor::new(crate::backends::wgpu::Wgpu::new()?, &graph)?)
            }
            #[cfg(not(feature = "wgpu"))]
            BackendKind::Wgpu => {
                crate::bail!(
                    Runtime,
                    "the wgpu backend: {}",
                    crate::backends::wgpu::NOT_BUILT
                )
            }
        };
        Ok(Session::with_exec(graph, opts, exec))
    }

    /// A data-parallel worker (exec/parallel.rs) on CUDA device `opts.device`, rank
    /// `comm.rank`. Every worker must be made at the same time (the initializers are
    /// broadcast from rank 0 here).
    #[cfg(feature = "cuda")]
    pub(crate) fn worker(
        graph: Graph,
        opts: SessionOptions,
        comm: std::sync::Arc<crate::backends::cuda::nccl::Comm>,
    ) -> Result<Session> {
        if opts.backend != BackendKind::Cuda {
            crate::bail!(
                Input,
                "data-parallel training runs on the cuda backend (got {})",
                opts.backend.name()
            );
        }
        let mut cuda = crate::backends::cuda::Cuda::on(opts.device, opts.tf32)?;
        cuda.set_comm(comm)?;
        let mut exec: Box<dyn Run> = Box::new(Executor::new(cuda, &graph)?);
        exec.set_data_parallel(opts.shard_optimizer)?;
        Ok(Session::with_exec(graph, opts, exec))
    }

    fn with_exec(graph: Graph, opts: SessionOptions, exec: Box<dyn Run>) -> Session {
        Session {
            plan_inputs: crate::graph::infer::plan_time_inputs(&graph),
            plans_made: std::cell::Cell::new(0),
            graph,
            opts,
            exec,
            plans: PlanCache::default(),
            fetch_plans: vec![],
            grad_plans: vec![],
            grad_outputs: None,
            train_plans: vec![],
            steps: 0,
            last_train: 0,
            static_feeds: false,
        }
    }

    /// For timing loops: the caller promises that every following run gets the same feed
    /// values as the one before. The inputs are then uploaded once and kept (plans made
    /// from now on never reuse their buffers), and runs neither download nor wait: `run`
    /// and `backward` return no values, `train_step` returns NaN, and `sync` waits for the
    /// queued steps (and reports their errors).
    pub fn set_static_feeds(&mut self, on: bool) {
        self.static_feeds = on;
        self.exec.set_static_feeds(on);
    }

    /// Waits until every queued step has finished (with static feeds, runs return before).
    pub fn sync(&mut self) -> Result<()> {
        self.exec.sync()
    }

    /// A plan for `g`; with static feeds its inputs are kept to the end (never reused).
    fn make_plan(&self, g: &Graph, key: &PlanKey) -> Result<Plan> {
        let mut keep: std::collections::HashSet<String> = Default::default();
        if self.static_feeds {
            keep = g.inputs.iter().map(|i| i.name.clone()).collect();
        }
        let plan = Plan::for_key(g, key, &keep)?;
        crate::tensor::check_plan_bytes(plan.peak_bytes(), plan.weight_bytes)?;
        self.plans_made.set(self.plans_made.get() + 1);
        Ok(plan)
    }

    /// Plans made by this session so far (forward, fetch, backward and training plans):
    /// each is made once per distinct `plan_key` and then reused.
    pub fn plans_made(&self) -> usize {
        self.plans_made.get()
    }

    /// The graph inputs whose fed values decide shapes (Reshape's shape, Slice's starts,
    /// ... computed from them): plans are made for their values.
    pub fn plan_time_inputs(&self) -> &[crate::graph::infer::PlanTimeInput] {
        &self.plan_inputs
    }

    /// What a plan for these feeds is made for: the input shapes, and the values of the
    /// plan-time inputs (small integer tensors, checked here).
    pub fn plan_key(&self, feeds: &HashMap<String, Tensor>) -> Result<PlanKey> {
        Ok(PlanKey {
            shapes: self.input_shapes(feeds)?,
            values: super::plan_values(&self.graph, &self.plan_inputs, feeds)?,
        })
    }

    /// The graph the session runs (after the passes, when `SessionOptions::fuse` is on).
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
    /// The name of the backend it runs on (`cpu`, `cuda`, `wgpu`).
    pub fn backend_name(&self) -> &'static str {
        self.exec.backend_name()
    }
    /// Device memory the backend holds beside the plan's buffers (scratch pools, library
    /// workspaces), as allocated so far.
    pub fn held_bytes(&self) -> usize {
        self.exec.held_bytes()
    }

    /// Checks feeds against the graph inputs and resolves every input's shape.
    pub fn input_shapes(
        &self,
        feeds: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Vec<usize>>> {
        let names: std::collections::HashSet<&str> =
            self.graph.inputs.iter().map(|i| i.name.as_str()).collect();
        for name in feeds.keys() {
            if !names.contains(name.as_str()) {
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

    /// Makes the plan for these feeds' shapes (and plan-time values): what `inspect`
    /// reports.
    pub fn plan_for(&self, feeds: &HashMap<String, Tensor>) -> Result<Plan> {
        self.make_plan(&self.graph, &self.plan_key(feeds)?)
    }

    /// Times every node from now on (each one synchronized: slower, for `bench`).
    pub fn set_profiling(&mut self, on: bool) {
        self.exec.set_profiling(on);
    }

    /// Seconds per node summed over the runs since the last call: (node name, op, s).
    pub fn take_profile(&mut self) -> Vec<(String, &'static str, f64)> {
        let mut acc: Vec<(String, &'static str, f64)> = vec![];
        let mut at: HashMap<String, usize> = HashMap::new();
        for (name, op, secs) in self.exec.take_profile() {
            match at.get(&name) {
                Some(&i) => acc[i].2 += secs,
                None => {
                    at.insert(name.clone(), acc.len());
                    acc.push((name, op, secs));
                }
            }
        }
        acc
    }

    /// Runs the graph; returns the outputs in the order of `graph.outputs`.
    pub fn run(&mut self, feeds: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>> {
        let defaulted = with_defaults(&self.graph, feeds);
        let feeds = &*defaulted;
        let planned = self.plan_key(feeds).and_then(|key| {
            if !self.plans.has(&key) {
                let plan = self.make_plan(&self.graph, &key)?;
                self.plans.insert(key.clone(), plan);
            }
            Ok(key)
        });
        let key = match planned {
            Ok(key) => key,
            Err(e) => return self.run_staged(feeds, e),
        };
        let plan = self.plans.get(&key).expect("inserted above");
        self.exec.set_step(0);
        let fetch: &[String] = if self.static_feeds {
            &[]
        } else {
            &self.graph.outputs
        };
        let outs = self
            .exec
            .run(&self.graph, plan, &by_ref(feeds), fetch, None)?;
        Ok(self.graph.outputs.iter().cloned().zip(outs).collect())
    }

    /// Runs a graph that no single plan can run, because a shape in it depends on a value
    /// computed inside it (`staged`): a stage at a time, each planned for these feeds
    /// alone (not kept). `why` is the error of planning it whole, returned when staging
    /// cannot help either (nothing is blocked by a value computed inside the graph).
    fn run_staged(
        &mut self,
        feeds: &HashMap<String, Tensor>,
        why: Error,
    ) -> Result<Vec<(String, Tensor)>> {
        use super::staged::Blocked;
        let ev = &crate::backends::cpu::HOST_EVAL;
        let shapes = self.input_shapes(feeds)?;
        let mut g = self.graph.clone();
        // Planning the graph whole said why it could not: that error stands when staging
        // cannot unblock what blocks it, or fails before a first stage has run.
        let mut original = Some(why);
        let mut staged = false;
        let mut fail = |staged: bool, e: Error| match original.take() {
            Some(o) if !staged => o,
            _ => e,
        };
        // Each stage removes at least one node, or one If.
        for _ in 0..=2 * g.nodes.len() {
            let key = PlanKey {
                shapes: shapes.clone(),
                values: super::staged::small_plan_values(&g, feeds),
            };
            let (ni, err) = match super::staged::first_blocked(&g, &key.shapes, &key.values, ev) {
                Ok(Some(Blocked::Value(ni, err))) => (ni, err),
                Ok(Some(Blocked::Branch(ni, pick))) => {
                    let n = &mut g.nodes[ni];
                    n.inputs = vec![n.inputs[pick].clone()];
                    n.op = Op::Identity;
                    staged = true;
                    continue;
                }
                Ok(None) if staged => {
                    let plan = self.make_plan(&g, &key)?;
                    self.exec.set_step(0);
                    let outs = self.exec.run(&g, &plan, &by_ref(feeds), &g.outputs, None)?;
                    return Ok(g.outputs.iter().cloned().zip(outs).collect());
                }
                Ok(None) => return Err(fail(false, crate::err!(Graph, "nothing to stage"))),
                Err(e) => return Err(fail(staged, e)),
            };
            let stage = super::staged::stage_before(&g, ni);
            let values = if stage.graph.nodes.is_empty() {
                vec![]
            } else {
                let skey = PlanKey {
                    shapes: shapes.clone(),
                    values: super::staged::small_plan_values(&stage.graph, feeds),
                };
                let plan = self
                    .make_plan(&stage.graph, &skey)
                    .map_err(|e| fail(staged, e))?;
                self.exec.set_step(0);
                let fetch = stage.graph.outputs.clone();
                self.exec
                    .run(&stage.graph, &plan, &by_ref(feeds), &fetch, None)?
            };
            g = super::staged::after_stage(&g, ni, &stage, values, feeds, ev, err)
                .map_err(|e| fail(false, e))?;
            staged = true;
        }
        crate::bail!(Graph, "staging the graph did not finish")
    }

    /// Runs the graph and returns the values named in `fetch` (any value of the graph,
    /// not only its outputs).
    pub fn run_fetch(
        &mut self,
        feeds: &HashMap<String, Tensor>,
        fetch: &[String],
    ) -> Result<Vec<Tensor>> {
        let defaulted = with_defaults(&self.graph, feeds);
        let feeds = &*defaulted;
        let key = self.plan_key(feeds)?;
        let i = match self
            .fetch_plans
            .iter()
            .position(|(f, k, _)| f == fetch && *k == key)
        {
            Some(i) => i,
            None => {
                for f in fetch {
                    if !self.graph.nodes.iter().any(|n| n.outputs.contains(f))
                        && self.graph.input(f).is_none()
                        && self.graph.initializer(f).is_none()
                    {
                        crate::bail!(Input, "'{f}' is not a value of the graph");
                    }
                }
                let keep = fetch.iter().cloned().collect();
                let plan = Plan::for_key(&self.graph, &key, &keep)?;
                self.plans_made.set(self.plans_made.get() + 1);
                self.fetch_plans.push((fetch.to_vec(), key, plan));
                self.fetch_plans.len() - 1
            }
        };
        let plan = &self.fetch_plans[i].2;
        self.exec.set_step(0);
        self.exec
            .run(&self.graph, plan, &by_ref(feeds), fetch, None)
    }

    /// The backward graph of every floating output for these feeds' shapes (what
    /// `inspect --backward` shows), and its plan.
    pub fn backward_graph(
        &mut self,
        feeds: &HashMap<String, Tensor>,
    ) -> Result<(&Backward, &Plan)> {
        let i = self.backward_plan(feeds, false)?;
        let e = &self.grad_plans[i];
        Ok((&e.bwd, &e.plan))
    }

    /// The graph and plan a training step (`train_step`) runs for these feeds' shapes:
    /// the loss's backward and the trained initializers' gradients only.
    pub fn train_graph(&mut self, feeds: &HashMap<String, Tensor>) -> Result<(&Backward, &Plan)> {
        let i = self.backward_plan(feeds, true)?;
        let e = &self.train_plans[i];
        Ok((&e.bwd, &e.plan))
    }

    fn backward_plan(&mut self, feeds: &HashMap<String, Tensor>, train: bool) -> Result<usize> {
        let key = self.plan_key(feeds)?;
        let cache = if train {
            &self.train_plans
        } else {
            &self.grad_plans
        };
        if let Some(i) = cache.iter().position(|e| e.key == key) {
            return Ok(i);
        }
        // The value types, for the checks and choices below (not every branch needs them).
        let infer = || {
            crate::graph::infer::infer_graph_with(
                &self.graph,
                &key.shapes,
                &key.values,
                &crate::backends::cpu::HOST_EVAL,
            )
        };
        let outputs: Vec<String> = if train {
            let Some(t) = &self.graph.training else {
                crate::bail!(
                    Input,
                    "the model has no training: section (loss and optimizer)"
                );
            };
            if let Err((_, why)) = t.optimizer.check() {
                crate::bail!(Input, "training optimizer: {why}");
            }
            // The loss must be one number: training on a tensor would silently seed every
            // element with one and minimise their sum.
            let inf = infer()?;
            let ty = &inf.types[&t.loss];
            if ty.numel() != 1 || !ty.dtype.is_float() {
                crate::bail!(
                    Input,
                    "training loss '{}' must be a floating scalar; it is {} {}",
                    t.loss,
                    ty.dtype,
                    crate::tensor::fmt_shape(&ty.shape)
                );
            }
            vec![t.loss.clone()]
        } else if let Some(chosen) = &self.grad_outputs {
            chosen.clone()
        } else {
            let inf = infer()?;
            self.graph
                .outputs
                .iter()
                .filter(|o| inf.types[*o].dtype.is_float())
                .cloned()
                .collect()
        };
        let opts = BackwardOptions {
            training: self.opts.training || train,
            inputs: !train,
            eval: self.opts.passes.eval,
        };
        let bwd = autodiff::backward_with(&self.graph, &outputs, &key.shapes, &key.values, &opts)?;
        let passes = PassOptions {
            training: opts.training,
            ..self.opts.passes.clone()
        };
        let (graph, _) = crate::passes::optimize(&bwd.graph, &passes)?;
        let bwd = Backward { graph, ..bwd };
        // The backward graph reads the forward's plan-time inputs (and no others: its
        // own nodes' shapes are constants or come from Shape).
        let mut all = key.clone();
        for (_, seed) in &bwd.seeds {
            let ty = bwd.graph.input(seed).expect("seed input");
            all.shapes
                .insert(seed.clone(), super::concrete_shape(ty, &BTreeMap::new())?);
        }
        let plan = self.make_plan(&bwd.graph, &all)?;
        let cache = if train {
            &mut self.train_plans
        } else {
            &mut self.grad_plans
        };
        let ones = bwd
            .seeds
            .iter()
            .map(|(_, s)| Ok((s.clone(), ones(&plan.types[s])?)))
            .collect::<Result<_>>()?;
        cache.push(BackwardPlan {
            key,
            bwd,
            plan,
            ones,
        });
        Ok(cache.len() - 1)
    }

    /// Makes `backward` differentiate these outputs only (e.g. a loss), instead of every
    /// floating output: the gradients are then those of their sum, and only they take
    /// seeds. An empty list goes back to every floating output.
    pub fn set_backward_outputs(&mut self, outputs: &[String]) -> Result<()> {
        for o in outputs {
            if !self.graph.outputs.contains(o) {
                crate::bail!(
                    Input,
                    "'{o}' is not an output of the graph (its outputs: {})",
                    self.graph.outputs.join(", ")
                );
            }
        }
        let chosen = (!outputs.is_empty()).then(|| outputs.to_vec());
        if chosen != self.grad_outputs {
            self.grad_outputs = chosen;
            self.grad_plans.clear();
        }
        Ok(())
    }

    /// Runs forward and backward: the gradient of every floating output (seeded from
    /// `seeds` by output name, else all ones) with respect to every floating graph input
    /// and trainable initializer.
    pub fn backward(
        &mut self,
        feeds: &HashMap<String, Tensor>,
        seeds: &HashMap<String, Tensor>,
    ) -> Result<Gradients> {
        let defaulted = with_defaults(&self.graph, feeds);
        let feeds = &*defaulted;
        let i = self.backward_plan(feeds, false)?;
        let e = &self.grad_plans[i];
        for name in seeds.keys() {
            if !e.bwd.seeds.iter().any(|(o, _)| o == name) {
                crate::bail!(
                    Input,
                    "a gradient seed for '{name}': '{name}' is not a floating output of the graph"
                );
            }
        }
        let mut all = by_ref(feeds);
        for (o, seed) in &e.bwd.seeds {
            let ty = &e.plan.types[seed];
            let t = match seeds.get(o) {
                Some(t) if t.dtype() != ty.dtype || t.shape() != &ty.shape[..] => crate::bail!(
                    Input,
                    "the gradient given for output '{o}' must be {ty}, got {}{}",
                    t.dtype(),
                    crate::tensor::fmt_shape(t.shape())
                ),
                Some(t) => t,
                None => &e.ones[seed],
            };
            all.insert(seed, t);
        }
        let n_out = self.graph.outputs.len();
        let fetch: Vec<String> = self
            .graph
            .outputs
            .iter()
            .cloned()
            .chain(e.bwd.grads.iter().map(|(_, g)| g.clone()))
            .collect();
        // In training mode, the mask the next training step would draw.
        self.exec.set_step(if self.opts.training {
            self.steps + 1
        } else {
            0
        });
        if self.static_feeds {
            self.exec.run(&e.bwd.graph, &e.plan, &all, &[], None)?;
            return Ok(Gradients {
                outputs: vec![],
                grads: vec![],
            });
        }
        let mut vals = self.exec.run(&e.bwd.graph, &e.plan, &all, &fetch, None)?;
        let grads = vals.split_off(n_out);
        Ok(Gradients {
            outputs: self.graph.outputs.iter().cloned().zip(vals).collect(),
            grads: e
                .bwd
                .grads
                .iter()
                .map(|(w, _)| w.clone())
                .zip(grads)
                .collect(),
        })
    }

    /// One training step: forward, backward of the model's `training.loss`, and the
    /// optimizer update of every trainable initializer in place on the backend. Returns
    /// the loss before the update.
    pub fn train_step(&mut self, feeds: &HashMap<String, Tensor>) -> Result<f64> {
        self.train_step_accumulated(std::slice::from_ref(feeds))
    }

    /// One training step over several micro-batches (gradient accumulation): forward and
    /// backward on each in turn, their gradients averaged (each weighted 1/count, summed
    /// on the backend in the gradients' dtype), then one optimizer update. With a loss
    /// that is a mean over the batch and micro-batches of equal size this is the step of
    /// the batch they make together, in the memory of one micro-batch. Returns the mean
    /// of their losses. State updates (BatchNormalization's running statistics) follow
    /// each micro-batch, as PyTorch's forward passes move them; each micro-batch draws
    /// its own Dropout masks.
    pub fn train_step_accumulated(&mut self, micro: &[HashMap<String, Tensor>]) -> Result<f64> {
        if micro.is_empty() {
            crate::bail!(Input, "a training step needs at least one micro-batch");
        }
        let opt = match &self.graph.training {
            Some(t) => t.optimizer.clone(),
            None => crate::bail!(
                Input,
                "the model has no training: section (loss and optimizer)"
            ),
        };
        // Every micro-batch's plan first: a bad one fails the step before any runs.
        let micro: Vec<_> = micro
            .iter()
            .map(|f| with_defaults(&self.graph, f))
            .collect();
        let plans = micro
            .iter()
            .map(|f| self.backward_plan(f, true))
            .collect::<Result<Vec<usize>>>()?;
        self.steps += 1;
        let mut sum = 0.0;
        for (m, (feeds, &i)) in micro.iter().zip(&plans).enumerate() {
            let feeds = &**feeds;
            let e = &self.train_plans[i];
            let mut all = by_ref(feeds);
            for (_, seed) in &e.bwd.seeds {
                all.insert(seed, &e.ones[seed]);
            }
            self.last_train = i;
            // The last micro-batch runs as step t itself (the optimizer reads t from the
            // backend's step); the others take steps no plain step reaches, so their
            // Dropout masks differ from each other's and from every other step's.
            let last = m + 1 == micro.len();
            self.exec.set_step(if last {
                self.steps
            } else {
                self.steps | ((m as u64 + 1) << 40)
            });
            let fetch = if self.static_feeds {
                vec![]
            } else {
                vec![e.bwd.seeds[0].0.clone()]
            };
            let update = Update {
                pairs: &e.bwd.grads,
                opt: &opt,
                t: self.steps,
                micro: (m, micro.len()),
            };
            let loss = self
                .exec
                .run(&e.bwd.graph, &e.plan, &all, &fetch, Some(update))?;
            // With the loss fetched the step is finished, and reading the update kernels'
            // non-finite note costs no extra wait; with static feeds (timed loops) it is
            // read by `check_finite`.
            if last && !fetch.is_empty() {
                self.check_finite()?;
            }
            let Some(loss) = loss.first() else {
                sum = f64::NAN;
                continue;
            };
            let l = loss.to_f64_vec();
            sum += l.iter().sum::<f64>() / l.len().max(1) as f64;
        }
        Ok(sum / micro.len() as f64)
    }

    /// Copies the backend's current initializer values (after training) into the graph
    /// and returns it.
    pub fn trained_graph(&mut self) -> Result<&Graph> {
        for init in &mut self.graph.initializers {
            if let Some(t) = self.exec.weight(&init.name)? {
                if t != init.tensor {
                    init.tensor = t;
                    init.source = crate::graph::InitSource::Data;
                }
            }
        }
        Ok(&self.graph)
    }

    /// An error naming the first parameter and the step when an optimizer update since
    /// the last check left a NaN or an infinity in a parameter (`train_step` checks
    /// after every step whose loss it fetches).
    pub fn check_finite(&mut self) -> Result<()> {
        let Some(i) = self.exec.take_nonfinite()? else {
            return Ok(());
        };
        if self.opts.allow_nonfinite {
            return Ok(());
        }
        let name = self
            .train_plans
            .get(self.last_train)
            .and_then(|e| e.bwd.grads.get(i))
            .map_or("?", |(w, _)| w.as_str());
        crate::bail!(
            Runtime,
            "training step {}: the update left NaN or infinite values in parameter '{name}' \
             (a NaN or infinity in its gradient: check the data and the learning rate)",
            self.steps
        )
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Bytes of optimizer state this session holds on its backend (Adam's two moments
    /// or SGD's momentum per trained parameter, in f32 for half-precision parameters;
    /// with `shard_optimizer`, this worker's shards only). Zero before the first step.
    pub fn optimizer_state_bytes(&self) -> usize {
        self.exec.optimizer_state_bytes()
    }
}

/// The feeds with every input that has a default and is not fed filled in (copied only
/// when there is one).
fn with_defaults<'a>(
    g: &Graph,
    feeds: &'a HashMap<String, Tensor>,
) -> std::borrow::Cow<'a, HashMap<String, Tensor>> {
    if !g
        .inputs
        .iter()
        .any(|i| i.default.is_some() && !feeds.contains_key(&i.name))
    {
        return std::borrow::Cow::Borrowed(feeds);
    }
    let mut all = feeds.clone();
    super::fill_defaults(g, &mut all);
    std::borrow::Cow::Owned(all)
}

/// A tensor of ones (the default seed gradient).
fn ones(ty: &ValueType) -> Result<Tensor> {
    Tensor::from_f64(ty.dtype, &ty.shape, &vec![1.0; ty.numel()])
}

/// Feeds by reference, so that seeds can join them without copying the inputs.
fn by_ref(feeds: &HashMap<String, Tensor>) -> HashMap<&str, &Tensor> {
    feeds.iter().map(|(k, v)| (k.as_str(), v)).collect()
}

/// Runs plans on one backend, holding its uploaded initializers and slot buffers.
struct Executor<B: Backend> {
    backend: B,
    /// Initializers by name: plans of the forward graph and of its backward graphs share
    /// them, and training updates them in place.
    weights: Vec<B::Buffer>,
    weight_types: Vec<ValueType>,
    weight_names: HashMap<String, usize>,
    /// Which weight each initializer of the graph last run is (by its index there).
    wmap: Vec<usize>,
    slots: Vec<Option<B::Buffer>>,
    /// The size of each slot buffer.
    slot_sizes: Vec<usize>,
    /// Folded constants uploaded per plan (by plan id), so that alternating plans do not
    /// upload them again.
    consts: HashMap<u64, Vec<B::Buffer>>,
    /// Optimizer state per trained initializer (momentum; Adam's m and v).
    opt_state: HashMap<String, Vec<B::Buffer>>,
    /// Gradient accumulators per trained initializer (`Update::micro`), made on the
    /// first accumulating step.
    grad_acc: HashMap<String, B::Buffer>,
    /// Bytes of `opt_state`.
    opt_state_bytes: usize,
    /// Counts buffer (re)allocations: a recorded step is valid only for the buffers it saw.
    generation: u64,
    /// `Session::set_static_feeds`, and the (plan, generation) whose inputs are uploaded.
    static_feeds: bool,
    uploaded: Option<(u64, u64)>,
    profile: Option<Vec<(String, &'static str, f64)>>,
    /// Data-parallel worker: training steps average gradients over the workers, in
    /// buckets issued as the backward pass makes them (per plan id: step index → the
    /// update pairs averaged after it).
    dp: bool,
    /// Data-parallel with the optimizer sharded: gradients are reduce-scattered, each
    /// worker steps its shard of every parameter (`Backend::shard`) and keeps only that
    /// shard's state, and the parameters are gathered back after the step.
    shard: bool,
    buckets: HashMap<u64, std::sync::Arc<HashMap<usize, Vec<usize>>>>,
}

/// The gradient buckets of a training plan: after which step each group of update pairs
/// (by index) can be averaged. Gradients without a slot (constants) are the same on every
/// worker and are left out.
fn buckets(g: &Graph, plan: &Plan, pairs: &[(String, String)]) -> HashMap<usize, Vec<usize>> {
    let mut ready: Vec<(usize, usize)> = vec![];
    for (i, (_, gname)) in pairs.iter().enumerate() {
        if !matches!(plan.places.get(gname), Some(Place::Slot(_))) {
            continue;
        }
        // After its writer and its last reader.
        let last = plan
            .steps
            .iter()
            .enumerate()
            .filter(|(_, st)| {
                let n = &g.nodes[st.node];
                n.outputs.contains(gname) || n.inputs.contains(gname)
            })
            .map(|(k, _)| k)
            .max();
        if let Some(k) = last {
            ready.push((k, i));
        }
    }
    ready.sort();
    // Buckets of about `Tuning::dp_bucket_bytes` (which says why 64 MiB), each issued as
    // soon as the backward pass has made (and finished reading) all of its gradients.
    let cap = crate::backends::tuning::tuning().dp_bucket_bytes;
    let mut out: HashMap<usize, Vec<usize>> = HashMap::new();
    let (mut cur, mut bytes) = (vec![], 0);
    for (j, &(k, i)) in ready.iter().enumerate() {
        cur.push(i);
        bytes += plan.types[&pairs[i].1].bytes();
        if bytes >= cap || j + 1 == ready.len() {
            out.entry(k).or_default().append(&mut cur);
            bytes = 0;
        }
    }
    out
}

impl<B: Backend> Executor<B> {
    fn new(backend: B, g: &Graph) -> Result<Self> {
        let mut e = Executor {
            backend,
            weights: vec![],
            weight_types: vec![],
            weight_names: HashMap::new(),
            wmap: vec![],
            slots: vec![],
            slot_sizes: vec![],
            consts: HashMap::new(),
            opt_state: HashMap::new(),
            grad_acc: HashMap::new(),
            opt_state_bytes: 0,
            generation: 0,
            static_feeds: false,
            uploaded: None,
            profile: None,
            dp: false,
            shard: false,
            buckets: HashMap::new(),
        };
        e.map_weights(g)?;
        Ok(e)
    }

    /// Points `wmap` at this graph's initializers, uploading those not seen before
    /// (initializers that passes made for a backward graph).
    fn map_weights(&mut self, g: &Graph) -> Result<()> {
        self.wmap.clear();
        for init in &g.initializers {
            let k = match self.weight_names.get(&init.name) {
                Some(&k) => k,
                None => {
                    let mut b = self
                        .backend
                        .alloc(init.tensor.size_bytes())
                        .map_err(|e| crate::err!(Runtime, "initializer '{}': {e}", init.name))?;
                    self.backend.upload(&init.tensor, &mut b)?;
                    self.weights.push(b);
                    self.weight_types
                        .push(ValueType::new(init.tensor.dtype(), init.tensor.shape()));
                    self.weight_names
                        .insert(init.name.clone(), self.weights.len() - 1);
                    self.generation += 1;
                    self.weights.len() - 1
                }
            };
            self.wmap.push(k);
        }
        Ok(())
    }

    /// Slot buffers at least as large as the plan's (no allocation in the steady state).
    /// Out of memory names the values that would have lived in the slot.
    fn ensure_slots(&mut self, g: &Graph, plan: &Plan) -> Result<()> {
        if self.slots.len() < plan.slot_bytes.len() {
            self.slots.resize_with(plan.slot_bytes.len(), || None);
            self.slot_sizes.resize(plan.slot_bytes.len(), 0);
        }
        for (s, &bytes) in plan.slot_bytes.iter().enumerate() {
            if self.slots[s].is_some() && self.slot_sizes[s] >= bytes {
                continue;
            }
            self.slots[s] = None; // free the smaller one first
            let b = self.backend.alloc(bytes).map_err(|e| {
                let mut vals: Vec<&str> = plan
                    .places
                    .iter()
                    .filter(|(_, p)| **p == Place::Slot(s))
                    .map(|(n, _)| n.as_str())
                    .collect();
                vals.sort();
                let writer = plan
                    .steps
                    .iter()
                    .find(|st| st.outs.contains(&s))
                    .map(|st| format!(", first written by {}", g.nodes[st.node].describe()))
                    .unwrap_or_default();
                crate::err!(
                    Runtime,
                    "buffer for {}{writer}: {e}",
                    vals.iter()
                        .map(|v| format!("'{v}'"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
            self.slots[s] = Some(b);
            self.slot_sizes[s] = bytes;
            self.generation += 1;
        }
        Ok(())
    }

    fn ensure_consts(&mut self, plan: &Plan) -> Result<()> {
        if self.consts.contains_key(&plan.id) {
            return Ok(());
        }
        let mut v = vec![];
        for (name, c) in &plan.consts {
            let mut b = self
                .backend
                .alloc(c.size_bytes())
                .map_err(|e| crate::err!(Runtime, "constant '{name}': {e}"))?;
            self.backend.upload(c, &mut b)?;
            v.push(b);
        }
        self.consts.insert(plan.id, v);
        self.generation += 1;
        Ok(())
    }

    /// Zeroed optimizer state for every trained initializer that has none yet.
    fn ensure_opt_state(&mut self, plan: &Plan, u: &Update) -> Result<()> {
        for (w, _) in u.pairs {
            if self.opt_state.contains_key(w) {
                continue;
            }
            let ty = &plan.types[w];
            // A sharded optimizer keeps its shard's state only.
            let shape = match self.shard {
                true => vec![self.backend.shard(ty.numel()).len()],
                false => ty.shape.clone(),
            };
            let mut st = vec![];
            for _ in 0..crate::backends::optimizer_state_len(u.opt) {
                let z = Tensor::zeros(crate::graph::infer::stat_dtype(ty.dtype), &shape);
                self.opt_state_bytes += z.size_bytes();
                let mut b = self
                    .backend
                    .alloc(z.size_bytes())
                    .map_err(|e| crate::err!(Runtime, "optimizer state of '{w}': {e}"))?;
                self.backend.upload(&z, &mut b)?;
                st.push(b);
            }
            self.opt_state.insert(w.clone(), st);
            self.generation += 1;
        }
        if u.accumulates() {
            for (w, _) in u.pairs {
                if self.grad_acc.contains_key(w) {
                    continue;
                }
                let ty = &plan.types[w];
                let mut b = self
                    .backend
                    .alloc(ty.bytes())
                    .map_err(|e| crate::err!(Runtime, "gradient accumulator of '{w}': {e}"))?;
                // Typed (a backend whose buffers carry their type) and never garbage,
                // though the first micro-batch overwrites it.
                self.backend
                    .upload(&Tensor::zeros(ty.dtype, &ty.shape), &mut b)?;
                self.grad_acc.insert(w.clone(), b);
                self.generation += 1;
            }
        }
        Ok(())
    }

    /// Adds the gradients of `which` (indices into the update's pairs) into their
    /// accumulators (`Update::micro`).
    fn accumulate(&mut self, plan: &Plan, u: &Update, which: &[usize]) -> Result<()> {
        let consts = &self.consts[&plan.id];
        let (i, k) = u.micro;
        for &j in which {
            let (w, gname) = &u.pairs[j];
            let Some(&p) = plan.places.get(gname) else {
                crate::bail!(Runtime, "gradient '{gname}' has no buffer in the plan");
            };
            let grad = place(&self.weights, &self.wmap, consts, &self.slots, p);
            let acc = self.grad_acc.get_mut(w).expect("made by ensure_opt_state");
            self.backend
                .accumulate(acc, grad, &plan.types[gname], 1.0 / k as f64, i == 0)
                .map_err(|e| match e {
                    Error::Runtime(m) => Error::Runtime(format!("gradient of '{w}': {m}")),
                    e => e,
                })?;
        }
        Ok(())
    }

    /// Issues the plan's launches, then the update's.
    fn launch(&mut self, g: &Graph, plan: &Plan, update: Option<&Update>) -> Result<()> {
        if let (true, Some(u)) = (self.dp, update) {
            self.buckets
                .entry(plan.id)
                .or_insert_with(|| std::sync::Arc::new(buckets(g, plan, u.pairs)));
        }
        // Averaged over the workers as the backward makes them: the gradients, or with
        // accumulation the accumulators, on the last micro-batch only.
        let bucket_at = match update {
            Some(u) if u.last() => self.buckets.get(&plan.id).cloned(),
            _ => None,
        };
        for (k, step) in plan.steps.iter().enumerate() {
            let node = &g.nodes[step.node];
            let t0 = self.profile.is_some().then(std::time::Instant::now);
            // Buffers that views share are read as the value's type.
            let consts = &self.consts[&plan.id];
            for (name, p) in node.inputs.iter().zip(&step.ins) {
                if let Some(Place::Slot(s)) = p {
                    let b = self.slots[*s].as_mut().expect("slot live");
                    self.backend.retype(b, &plan.types[name]);
                }
            }
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
                            (
                                place(&self.weights, &self.wmap, consts, &self.slots, p),
                                &plan.types[name],
                            )
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
                self.profile.as_mut().expect("profiling on").push((
                    node.name.clone(),
                    node.op.name(),
                    secs,
                ));
            }
            result.map_err(|e| match e {
                Error::Runtime(m) if !m.contains(&format!("node '{}'", node.name)) => {
                    Error::Runtime(format!("{}: {m}", node.describe()))
                }
                e => e,
            })?;
            if let (Some(b), Some(u)) = (bucket_at.as_ref().and_then(|b| b.get(&k)), update) {
                if u.accumulates() {
                    self.accumulate(plan, u, b)?;
                }
                let consts = &self.consts[&plan.id];
                let bufs: Vec<(&B::Buffer, &ValueType)> = b
                    .iter()
                    .map(|&i| {
                        let (w, gname) = &u.pairs[i];
                        let buf = match (u.accumulates(), plan.places.get(gname)) {
                            (true, _) => &self.grad_acc[w],
                            (false, Some(&p)) => {
                                place(&self.weights, &self.wmap, consts, &self.slots, p)
                            }
                            (false, None) => unreachable!("bucketed gradients have slots"),
                        };
                        (buf, &plan.types[gname])
                    })
                    .collect();
                if self.shard {
                    self.backend.reduce_scatter(&bufs)?;
                } else {
                    self.backend.all_reduce(&bufs)?;
                }
            }
        }
        let Some(u) = update else {
            return Ok(());
        };
        if u.accumulates() {
            // Every gradient the buckets did not take (all of them but on the last
            // micro-batch of a data-parallel step).
            let bucketed: std::collections::HashSet<usize> = bucket_at
                .iter()
                .flat_map(|b| b.values().flatten().copied())
                .collect();
            let rest: Vec<usize> = (0..u.pairs.len())
                .filter(|i| !bucketed.contains(i))
                .collect();
            self.accumulate(plan, u, &rest)?;
            if !u.last() {
                return self.write_state(g, plan);
            }
        }
        self.backend.comm_wait()?;
        let consts = &self.consts[&plan.id];
        let mut queued = || -> Result<()> {
            for (slot, (w, gname)) in u.pairs.iter().enumerate() {
                let Some(&k) = self.weight_names.get(w) else {
                    crate::bail!(Runtime, "trained initializer '{w}' is not on the backend");
                };
                let ty = plan.types[w].clone();
                let (param, grad) = match plan.places.get(gname) {
                    _ if u.accumulates() => (&mut self.weights[k], &self.grad_acc[w]),
                    Some(Place::Slot(s)) => (
                        &mut self.weights[k],
                        self.slots[*s].as_ref().expect("gradient slot"),
                    ),
                    Some(Place::Const(c)) => (&mut self.weights[k], &consts[*c]),
                    // A gradient the passes folded into an initializer: a constant one,
                    // such as the zeros of a parameter the loss does not read.
                    Some(Place::Weight(j)) if self.wmap[*j] != k => {
                        let g = self.wmap[*j];
                        let (lo, hi) = self.weights.split_at_mut(k.max(g));
                        if k < g {
                            (&mut lo[k], &hi[0])
                        } else {
                            (&mut hi[0], &lo[g])
                        }
                    }
                    _ => crate::bail!(Runtime, "gradient '{gname}' has no buffer in the plan"),
                };
                let state = self.opt_state.get_mut(w).expect("made by ensure_opt_state");
                let part = self.backend.shard(ty.numel());
                let r = match self.shard {
                    true if part.is_empty() => Ok(()),
                    true => self.backend.update_part(
                        u.opt,
                        u.t,
                        param,
                        grad,
                        state,
                        &ty,
                        slot as u32,
                        part,
                    ),
                    false => self
                        .backend
                        .update(u.opt, u.t, param, grad, state, &ty, slot as u32),
                };
                r.map_err(|e| match e {
                    Error::Runtime(m) => Error::Runtime(format!("optimizer step of '{w}': {m}")),
                    e => e,
                })?;
            }
            Ok(())
        };
        // What was queued goes out even when a later parameter failed (as when each
        // update ran at once), so nothing is left over for the next step.
        let queued = queued();
        let flushed = self.backend.flush_updates().map_err(|e| match e {
            Error::Runtime(m) => Error::Runtime(format!("optimizer step: {m}")),
            e => e,
        });
        queued.and(flushed)?;
        if self.shard {
            // Every parameter whole again on every worker before anything reads it.
            let bufs: Vec<(&B::Buffer, &ValueType)> = u
                .pairs
                .iter()
                .filter_map(|(w, _)| {
                    let k = *self.weight_names.get(w)?;
                    Some((&self.weights[k], &plan.types[w]))
                })
                .collect();
            self.backend.gather_shards(&bufs)?;
        }
        self.write_state(g, plan)
    }
}

impl<B: Backend> Executor<B> {
    /// A training step's state updates (`Graph::updates`): each target initializer takes
    /// its value, copied on the backend by its Identity kernel.
    fn write_state(&mut self, g: &Graph, plan: &Plan) -> Result<()> {
        let consts = &self.consts[&plan.id];
        for su in &g.updates {
            let Some(&k) = self.weight_names.get(&su.target) else {
                crate::bail!(
                    Runtime,
                    "updated initializer '{}' is not on the backend",
                    su.target
                );
            };
            let src = match plan.places.get(&su.value) {
                Some(Place::Slot(s)) => self.slots[*s].as_ref().expect("output slot"),
                Some(Place::Const(c)) => &consts[*c],
                _ => crate::bail!(
                    Runtime,
                    "the update of '{}' ('{}') is not a value the training step computes",
                    su.target,
                    su.value
                ),
            };
            let ty = &plan.types[&su.value];
            if *ty != self.weight_types[k] {
                crate::bail!(
                    Runtime,
                    "the update of '{}' is {ty}, but the initializer is {}",
                    su.target,
                    self.weight_types[k]
                );
            }
            let node = Node {
                name: format!("update of '{}'", su.target),
                op: Op::Identity,
                inputs: vec![su.value.clone()],
                outputs: vec![su.target.clone()],
                loc: None,
            };
            self.backend
                .run(&node, &[Some((src, ty))], &mut [(&mut self.weights[k], ty)])?;
        }
        Ok(())
    }
}

/// The buffer at a place (a free function, so that the backend can be borrowed mutably
/// beside it).
fn place<'a, Buf>(
    weights: &'a [Buf],
    wmap: &[usize],
    consts: &'a [Buf],
    slots: &'a [Option<Buf>],
    p: Place,
) -> &'a Buf {
    match p {
        Place::Weight(w) => &weights[wmap[w]],
        Place::Const(c) => &consts[c],
        Place::Slot(s) => slots[s].as_ref().expect("slot live"),
    }
}

impl<B: Backend> Run for Executor<B> {
    fn backend_name(&self) -> &'static str {
        self.backend.name()
    }
    fn held_bytes(&self) -> usize {
        self.backend.held_bytes()
    }
    fn set_profiling(&mut self, on: bool) {
        self.profile = if on {
            Some(self.profile.take().unwrap_or_default())
        } else {
            None
        };
    }
    fn take_profile(&mut self) -> Vec<(String, &'static str, f64)> {
        self.profile
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
    fn set_step(&mut self, step: u64) {
        self.backend.set_step(step);
    }
    fn set_static_feeds(&mut self, on: bool) {
        self.static_feeds = on;
        self.uploaded = None;
    }
    fn sync(&mut self) -> Result<()> {
        self.backend.sync()
    }
    fn optimizer_state_bytes(&self) -> usize {
        self.opt_state_bytes
    }
    fn set_data_parallel(&mut self, shard: bool) -> Result<()> {
        for (b, ty) in self.weights.iter_mut().zip(&self.weight_types) {
            self.backend.broadcast(b, ty)?;
        }
        self.backend.sync()?;
        self.dp = true;
        self.shard = shard;
        Ok(())
    }
    fn run(
        &mut self,
        g: &Graph,
        plan: &Plan,
        feeds: &HashMap<&str, &Tensor>,
        fetch: &[String],
        update: Option<Update>,
    ) -> Result<Vec<Tensor>> {
        self.map_weights(g)?;
        self.ensure_slots(g, plan)?;
        self.ensure_consts(plan)?;
        if let Some(u) = &update {
            self.ensure_opt_state(plan, u)?;
        }
        if !(self.static_feeds && self.uploaded == Some((plan.id, self.generation))) {
            for i in &g.inputs {
                if let Some(Place::Slot(s)) = plan.places.get(&i.name) {
                    let buf = self.slots[*s].as_mut().expect("allocated above");
                    let Some(t) = feeds.get(i.name.as_str()) else {
                        crate::bail!(Input, "graph input '{}' is not fed", i.name);
                    };
                    self.backend.upload(t, buf)?;
                }
            }
            self.uploaded = Some((plan.id, self.generation));
        }
        // The step: recorded by the backend where it can, unless each node is timed.
        let record = self.profile.is_none();
        let key = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            let micro = update.as_ref().map(|u| (u.micro.0 == 0, u.last()));
            (plan.id, self.generation, micro).hash(&mut h);
            h.finish()
        };
        if !(record && self.backend.begin_step(key)?) {
            let r = self.launch(g, plan, update.as_ref());
            let again = if record {
                self.backend.end_step(r.is_ok())?
            } else {
                false
            };
            if again {
                self.launch(g, plan, update.as_ref())?;
            } else {
                r?;
            }
        }
        // With static feeds nothing is fetched, and the caller waits (`Session::sync`).
        if self.static_feeds && fetch.is_empty() {
            return Ok(vec![]);
        }
        self.backend.sync()?;
        let mut out = vec![];
        for o in fetch {
            let ty = &plan.types[o];
            let t = match plan.places.get(o) {
                Some(Place::Const(c)) => plan.consts[*c].1.clone(),
                Some(&p) => self.backend.download(
                    place(
                        &self.weights,
                        &self.wmap,
                        &self.consts[&plan.id],
                        &self.slots,
                        p,
                    ),
                    ty,
                )?,
                None => crate::bail!(Runtime, "value '{o}' has no buffer in the plan"),
            };
            out.push(t);
        }
        Ok(out)
    }
    fn take_nonfinite(&mut self) -> Result<Option<usize>> {
        Ok(self.backend.take_nonfinite()?.map(|s| s as usize))
    }
    fn weight(&mut self, name: &str) -> Result<Option<Tensor>> {
        let Some(&k) = self.weight_names.get(name) else {
            return Ok(None);
        };
        Ok(Some(
            self.backend
                .download(&self.weights[k], &self.weight_types[k])?,
        ))
    }
}

/// Plans cached by input shapes and plan-time values.
#[derive(Default)]
pub(crate) struct PlanCache {
    plans: Vec<(PlanKey, Plan)>,
}

impl PlanCache {
    fn has(&self, key: &PlanKey) -> bool {
        self.get(key).is_some()
    }
    fn get(&self, key: &PlanKey) -> Option<&Plan> {
        self.plans.iter().find(|(k, _)| k == key).map(|(_, p)| p)
    }
    fn insert(&mut self, key: PlanKey, plan: Plan) {
        self.plans.push((key, plan));
    }
}

#[cfg(test)]
mod built_without {
    use super::*;

    /// A build without a GPU backend's feature (`--no-default-features`, as CI builds it)
    /// refuses that backend, and data-parallel training, with one line naming the feature.
    #[test]
    fn backends_left_out_of_the_build_say_so() {
        let g = crate::Model::from_str(
            "graphrun: 1\ninputs: [{name: x, dtype: f32, shape: [2]}]\noutputs: [y]\nnodes:\n  - {op: Relu, inputs: [x], outputs: [y]}\n",
            ".",
        )
        .unwrap()
        .graph;
        let built = [
            (BackendKind::Cuda, cfg!(feature = "cuda")),
            (BackendKind::Wgpu, cfg!(feature = "wgpu")),
        ];
        for (kind, _) in built.iter().filter(|(_, on)| !on) {
            let opts = SessionOptions {
                backend: *kind,
                ..Default::default()
            };
            let err = Session::new(g.clone(), opts).err().expect("refused");
            let want = format!("built without the {} feature", kind.name());
            assert!(err.to_string().contains(&want), "{err}");
            assert_eq!(err.to_string().lines().count(), 1, "{err}");
        }
        if !cfg!(feature = "cuda") {
            let opts = SessionOptions {
                backend: BackendKind::Cuda,
                ..Default::default()
            };
            let err = crate::DataParallel::new(g.clone(), opts, 2)
                .err()
                .expect("refused");
            assert!(
                err.to_string().contains("built without the cuda feature"),
                "{err}"
            );
        }
        // With every backend built in, the CPU still runs: the test is not vacuous there.
        let mut s = Session::new(g, SessionOptions::default()).unwrap();
        let x = Tensor::from_vec(&[2], vec![-1f32, 2.0]).unwrap();
        let y = s.run(&HashMap::from([("x".to_string(), x)])).unwrap();
        assert_eq!(y[0].1.to_f64_vec(), vec![0.0, 2.0]);
    }
}
