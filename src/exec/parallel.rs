//! Data-parallel training on several GPUs of one machine.
//!
//! One worker thread per GPU, each holding its own `Session` on its device (made in the
//! thread, so sessions never cross threads). A training step splits the global batch
//! along axis 0 into one equal shard per worker; each worker runs forward and backward on
//! its shard, and its executor averages the gradients over the workers with NCCL
//! (ncclAvg) in buckets issued while the rest of the backward pass runs (exec/session.rs
//! `buckets`), then applies the same optimizer step. The parameters start identical
//! (broadcast from worker 0) and so stay identical. As with PyTorch's
//! DistributedDataParallel, averaging the workers' gradients equals the gradient of the
//! global batch when the loss is a mean over the batch and the shards are equal; the
//! loss returned is the mean of the workers' losses.
//!
//! Failure: a worker's error ends the step for everyone. Its peers may be blocked inside
//! a collective that will never complete, so every communicator is aborted (NCCL then
//! returns from it) and the first worker's own error is returned; a worker that answers
//! nothing within `GRAPHRUN_DP_TIMEOUT` seconds (default 600) is treated the same way.

use super::launch::{Launch, Link};
use super::session::{Session, SessionOptions};
use crate::backends::cuda::nccl::{self, Comm};
use crate::backends::BackendKind;
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::tensor::Tensor;
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

/// What the main thread asks of a worker.
enum Cmd {
    /// A step on this shard, in this many micro-batches.
    Step(Arc<HashMap<String, Tensor>>, usize),
    StaticFeeds(bool),
    Sync,
    Graph,
    Fetch(HashMap<String, Tensor>, Vec<String>),
    StateBytes,
}

/// A worker's answer.
enum Reply {
    Done,
    Loss(f64),
    Graph(Box<Graph>),
    Values(Vec<Tensor>),
    Bytes(usize),
}

/// Training on several GPUs at once; see the module comment.
pub struct DataParallel {
    cmds: Vec<Sender<Cmd>>,
    replies: Receiver<(usize, Result<Reply>)>,
    threads: Vec<std::thread::JoinHandle<()>>,
    comms: Vec<Arc<Comm>>,
    /// Set once a worker failed: the communicators are aborted and nothing more runs.
    broken: Option<String>,
    steps: u64,
    /// Micro-batches per step on each GPU (`set_accumulate`).
    accumulate: usize,
    timeout: Duration,
    graph: Graph,
    /// The other processes of a multi-process run (`launched`).
    link: Option<Link>,
}

impl DataParallel {
    /// Workers on CUDA devices 0..gpus, each with a session of `graph` (optimized once
    /// first unless `opts.fuse` is off, as for `Session::new`). `opts.backend` must be
    /// cuda; `opts.device` is ignored.
    pub fn new(graph: Graph, opts: SessionOptions, gpus: usize) -> Result<DataParallel> {
        Self::make(graph, opts, gpus, None)
    }

    /// This process's part of a run over several processes (on one machine or several;
    /// `Launch::from_env` reads what torchrun, Slurm or mpirun set): workers on its
    /// machine's CUDA devices `local_rank·gpus ..` as global ranks `rank·gpus ..` of
    /// `world·gpus`. Every process must make its part at the same time, with the same
    /// graph and `gpus`; they meet through `launch`'s rendezvous (within
    /// `GRAPHRUN_DP_TIMEOUT` seconds, default 600). A step's feeds are this process's
    /// share of the global batch; the loss a step returns is the mean over this
    /// process's GPUs. A failure in any process stops every process, with its error.
    pub fn launched(
        graph: Graph,
        opts: SessionOptions,
        gpus: usize,
        launch: &Launch,
    ) -> Result<DataParallel> {
        Self::make(graph, opts, gpus, Some(launch))
    }

    fn make(
        graph: Graph,
        opts: SessionOptions,
        gpus: usize,
        launch: Option<&Launch>,
    ) -> Result<DataParallel> {
        if opts.backend != BackendKind::Cuda {
            crate::bail!(
                Input,
                "data-parallel training runs on the cuda backend (the session options ask for {})",
                opts.backend.name()
            );
        }
        if graph.training.is_none() {
            crate::bail!(
                Input,
                "the model has no training: section (loss and optimizer)"
            );
        }
        if gpus == 0 {
            crate::bail!(
                Input,
                "data-parallel training on 0 GPUs: it needs at least one"
            );
        }
        if let Err(e) = crate::backends::cuda::available() {
            crate::bail!(Runtime, "data-parallel training on {gpus} GPUs: {e}");
        }
        let have = crate::backends::cuda::device_count();
        let base = launch.map_or(0, |l| l.local_rank * gpus);
        if base + gpus > have {
            crate::bail!(
                Input,
                "data-parallel training on {gpus} GPUs{}: this machine has {have} CUDA device{}",
                match launch {
                    Some(l) if base > 0 => format!(
                        " (devices {base}..{} as local rank {})",
                        base + gpus - 1,
                        l.local_rank
                    ),
                    _ => String::new(),
                },
                if have == 1 { "" } else { "s" }
            );
        }
        let graph = super::session::prepared(graph, &opts)?;
        let opts = SessionOptions {
            fuse: false,
            ..opts
        };
        let lib = nccl::nccl()?;
        // Every device first (NCCL needs their contexts), then the communicators.
        let devices: Vec<usize> = (base..base + gpus).collect();
        for &d in &devices {
            crate::backends::cuda::device::device_on(d)?;
        }
        let timeout = Duration::from_secs(
            std::env::var("GRAPHRUN_DP_TIMEOUT")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(600),
        );
        let (comms, link) = match launch {
            None => (lib.init_all(&devices)?, None),
            Some(l) => {
                let (id, link) = Link::join(l, timeout, || lib.unique_id())?;
                let mine: Vec<(usize, usize)> = devices
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| (l.rank * gpus + i, d))
                    .collect();
                let comms = match lib.init_ranks(&id, l.world * gpus, &mine) {
                    Ok(c) => c,
                    Err(e) => {
                        link.fail(&e.to_string());
                        return Err(e);
                    }
                };
                // A peer's failure aborts this process's collectives.
                let cs = comms.clone();
                link.watch(Arc::new(move || cs.iter().for_each(|c| c.abort())))?;
                (comms, Some(link))
            }
        };
        let (reply_tx, replies) = channel();
        let mut dp = DataParallel {
            cmds: vec![],
            replies,
            threads: vec![],
            comms: comms.clone(),
            broken: None,
            steps: 0,
            accumulate: 1,
            graph: graph.clone(),
            timeout,
            link,
        };
        // The batch symbols (first axis of an input) take each shard's size, not the
        // global batch a caller may have bound.
        let mut dims = opts.dims.clone();
        for i in &graph.inputs {
            if let Some(crate::graph::Dim::Sym(s)) = i.shape.first() {
                dims.remove(s);
            }
        }
        for (rank, comm) in comms.into_iter().enumerate() {
            let (tx, rx) = channel();
            let graph = graph.clone();
            let opts = SessionOptions {
                device: devices[rank],
                dims: dims.clone(),
                ..opts.clone()
            };
            let reply = reply_tx.clone();
            let t = std::thread::Builder::new()
                .name(format!("graphrun-gpu{rank}"))
                .spawn(move || worker(rank, graph, opts, comm, rx, reply))
                .map_err(|e| crate::err!(Runtime, "cannot start worker thread {rank}: {e}"))?;
            dp.cmds.push(tx);
            dp.threads.push(t);
        }
        // Each worker answers once its session is made (and the broadcast is done).
        dp.gather()?;
        Ok(dp)
    }

    /// Ends this process's part of a multi-process run cleanly (`launched`): the other
    /// processes are told it finished rather than that it stopped. Dropping it without
    /// this tells them it stopped (an error). Nothing to do for one process.
    pub fn finish(&mut self) {
        if let Some(l) = &self.link {
            l.finish();
        }
    }

    /// How many GPUs (workers).
    pub fn gpus(&self) -> usize {
        self.cmds.len()
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Gradient accumulation: each GPU runs its shard of a step as `k` equal micro-batches
    /// (`Session::train_step_accumulated`) and the accumulated gradients are averaged over
    /// the GPUs once, on the last. 1 (the default) runs each shard whole.
    pub fn set_accumulate(&mut self, k: usize) -> Result<()> {
        if k == 0 {
            crate::bail!(Input, "gradient accumulation over 0 micro-batches");
        }
        self.accumulate = k;
        Ok(())
    }

    /// One training step on a global batch: every feed is split along axis 0 into one
    /// equal shard per GPU (`split_batch`). Returns the mean of the workers' losses.
    pub fn train_step(&mut self, feeds: &HashMap<String, Tensor>) -> Result<f64> {
        let shards: Vec<_> = split_batch(feeds, self.gpus())?
            .into_iter()
            .map(Arc::new)
            .collect();
        self.train_step_shards(&shards)
    }

    /// One training step with each worker's shard given (one map per GPU, in order;
    /// shared, so that timing loops pass the same shards without copying them).
    pub fn train_step_shards(&mut self, shards: &[Arc<HashMap<String, Tensor>>]) -> Result<f64> {
        if shards.len() != self.gpus() {
            crate::bail!(
                Input,
                "{} batch shards for {} GPUs",
                shards.len(),
                self.gpus()
            );
        }
        let k = self.accumulate;
        self.send(shards.iter().map(|s| Cmd::Step(s.clone(), k)).collect())?;
        let replies = self.gather()?;
        self.steps += 1;
        let losses: Vec<f64> = replies
            .into_iter()
            .map(|r| match r {
                Reply::Loss(l) => l,
                _ => f64::NAN,
            })
            .collect();
        Ok(losses.iter().sum::<f64>() / losses.len() as f64)
    }

    /// `Session::set_static_feeds` on every worker (timing loops: steps neither download
    /// nor wait; `sync` waits).
    pub fn set_static_feeds(&mut self, on: bool) -> Result<()> {
        self.send((0..self.gpus()).map(|_| Cmd::StaticFeeds(on)).collect())?;
        self.gather().map(drop)
    }

    /// Waits until every worker's queued steps have finished (and reports their errors).
    pub fn sync(&mut self) -> Result<()> {
        self.send((0..self.gpus()).map(|_| Cmd::Sync).collect())?;
        self.gather().map(drop)
    }

    /// The graph with the trained initializers (worker 0's; every worker holds the same).
    pub fn trained_graph(&mut self) -> Result<Graph> {
        match self.ask_first(Cmd::Graph)? {
            Reply::Graph(g) => Ok(*g),
            _ => crate::bail!(Runtime, "worker 0 answered out of turn"),
        }
    }

    /// Inference on worker 0 with the current parameters (`Session::run_fetch`): held-out
    /// evaluation during training.
    pub fn run_fetch(
        &mut self,
        feeds: &HashMap<String, Tensor>,
        fetch: &[String],
    ) -> Result<Vec<Tensor>> {
        match self.ask_first(Cmd::Fetch(feeds.clone(), fetch.to_vec()))? {
            Reply::Values(v) => Ok(v),
            _ => crate::bail!(Runtime, "worker 0 answered out of turn"),
        }
    }

    /// Bytes of optimizer state on each GPU, in rank order (with
    /// `SessionOptions::shard_optimizer`, about a 1/N share each).
    pub fn optimizer_state_bytes(&mut self) -> Result<Vec<usize>> {
        self.send((0..self.gpus()).map(|_| Cmd::StateBytes).collect())?;
        Ok(self
            .gather()?
            .into_iter()
            .map(|r| match r {
                Reply::Bytes(b) => b,
                _ => 0,
            })
            .collect())
    }

    /// The graph the workers run (as given, before training).
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Asks worker 0 alone.
    fn ask_first(&mut self, cmd: Cmd) -> Result<Reply> {
        self.check()?;
        if self.cmds[0].send(cmd).is_err() {
            let e = crate::err!(Runtime, "worker 0 (GPU 0) has stopped");
            return Err(self.fail(e));
        }
        match self.recv()? {
            (_, Ok(r)) => Ok(r),
            (_, Err(e)) => Err(self.fail(e)),
        }
    }

    fn check(&self) -> Result<()> {
        match &self.broken {
            Some(m) => crate::bail!(Runtime, "data-parallel training stopped: {m}"),
            None => Ok(()),
        }
    }

    fn send(&mut self, cmds: Vec<Cmd>) -> Result<()> {
        self.check()?;
        for (r, c) in cmds.into_iter().enumerate() {
            if self.cmds[r].send(c).is_err() {
                let e = crate::err!(Runtime, "worker {r} (GPU {r}) has stopped");
                return Err(self.fail(e));
            }
        }
        Ok(())
    }

    fn recv(&mut self) -> Result<(usize, Result<Reply>)> {
        match self.replies.recv_timeout(self.timeout) {
            Ok(r) => Ok(r),
            Err(RecvTimeoutError::Timeout) => {
                let e = crate::err!(
                    Runtime,
                    "a worker did not answer within {} s (GRAPHRUN_DP_TIMEOUT); stopping all",
                    self.timeout.as_secs()
                );
                Err(self.fail(e))
            }
            Err(RecvTimeoutError::Disconnected) => {
                let e = crate::err!(Runtime, "every worker has stopped");
                Err(self.fail(e))
            }
        }
    }

    /// One reply per worker, in rank order; the first error stops everything.
    fn gather(&mut self) -> Result<Vec<Reply>> {
        let mut out: Vec<Option<Reply>> = (0..self.gpus()).map(|_| None).collect();
        for _ in 0..self.gpus() {
            match self.recv()? {
                (r, Ok(rep)) => out[r] = Some(rep),
                (r, Err(e)) => {
                    // Which GPU failed, keeping the kind (and so the exit code).
                    let e = match e {
                        Error::Runtime(m) => Error::Runtime(format!("GPU {r}: {m}")),
                        Error::Input(m) => Error::Input(format!("GPU {r}: {m}")),
                        Error::Graph(m) => Error::Graph(format!("GPU {r}: {m}")),
                        e => e,
                    };
                    return Err(self.fail(e));
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("one reply each"))
            .collect())
    }

    /// Marks the run broken and aborts every communicator, so that workers blocked in a
    /// collective return; their answers are then drained for a short while.
    fn fail(&mut self, e: Error) -> Error {
        // Across processes: a peer's failure came first (and ours is its consequence,
        // a collective it aborted), or ours is news to the peers.
        let e = match &self.link {
            Some(link) => match link.failure() {
                Some(peer) if self.broken.is_none() => Error::Runtime(peer),
                Some(_) => e,
                None => {
                    link.fail(&e.to_string());
                    e
                }
            },
            None => e,
        };
        if self.broken.is_none() {
            self.broken = Some(e.to_string());
            for c in &self.comms {
                c.abort();
            }
            while self.replies.recv_timeout(Duration::from_secs(5)).is_ok() {}
        }
        e
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        // Closing the command channels ends the workers' loops.
        self.cmds.clear();
        if self.broken.is_none() {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
        // After a failure a worker may still be stuck in the driver: leave it (detached)
        // rather than hang the caller.
    }
}

/// Splits every feed along axis 0 into `n` equal shards, one per GPU.
pub fn split_batch(
    feeds: &HashMap<String, Tensor>,
    n: usize,
) -> Result<Vec<HashMap<String, Tensor>>> {
    super::split_feeds(feeds, n, "GPUs")
}

fn worker(
    rank: usize,
    graph: Graph,
    opts: SessionOptions,
    comm: Arc<Comm>,
    cmds: Receiver<Cmd>,
    reply: Sender<(usize, Result<Reply>)>,
) {
    let run = std::panic::AssertUnwindSafe(|| {
        let mut s = match Session::worker(graph, opts, comm) {
            Ok(s) => {
                let _ = reply.send((rank, Ok(Reply::Done)));
                s
            }
            Err(e) => {
                let _ = reply.send((rank, Err(e)));
                return;
            }
        };
        while let Ok(cmd) = cmds.recv() {
            let r = match cmd {
                Cmd::Step(feeds, 1) => s.train_step(&feeds).map(Reply::Loss),
                Cmd::Step(feeds, k) => super::split_feeds(&feeds, k, "micro-batches")
                    .and_then(|m| s.train_step_accumulated(&m))
                    .map(Reply::Loss),
                Cmd::StaticFeeds(on) => {
                    s.set_static_feeds(on);
                    Ok(Reply::Done)
                }
                Cmd::Sync => s.sync().map(|_| Reply::Done),
                Cmd::Graph => s.trained_graph().map(|g| Reply::Graph(Box::new(g.clone()))),
                Cmd::Fetch(feeds, fetch) => s.run_fetch(&feeds, &fetch).map(Reply::Values),
                Cmd::StateBytes => Ok(Reply::Bytes(s.optimizer_state_bytes())),
            };
            let _ = reply.send((rank, r));
        }
        // Queued steps finish before the buffers go.
        let _ = s.sync();
    });
    if let Err(p) = std::panic::catch_unwind(run) {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let _ = reply.send((
            rank,
            Err(crate::err!(Runtime, "worker {rank} panicked: {msg}")),
        ));
    }
}
