//! Stands in for data-parallel training (parallel.rs) when graphrun is built without the
//! `cuda` feature: the same type and methods, so that callers compile unchanged. `new`
//! says that it was not built in, and no value of the type can exist, so the other
//! methods are never reached.

use super::session::SessionOptions;
use crate::error::Result;
use crate::graph::Graph;
use crate::tensor::Tensor;
use std::collections::HashMap;
use std::sync::Arc;

/// Training on several GPUs at once: not built in (see the module comment).
pub struct DataParallel {
    never: std::convert::Infallible,
}

impl DataParallel {
    /// Fails: data-parallel training needs the `cuda` feature.
    pub fn new(_graph: Graph, _opts: SessionOptions, gpus: usize) -> Result<DataParallel> {
        crate::bail!(
            Runtime,
            "data-parallel training on {gpus} GPUs runs on CUDA, and {}",
            crate::backends::cuda::NOT_BUILT
        )
    }
    /// Fails: data-parallel training needs the `cuda` feature.
    pub fn launched(
        _graph: Graph,
        _opts: SessionOptions,
        gpus: usize,
        launch: &super::launch::Launch,
    ) -> Result<DataParallel> {
        crate::bail!(
            Runtime,
            "rank {} of a {}-process run: data-parallel training on {gpus} GPUs runs on CUDA, and {}",
            launch.rank,
            launch.world,
            crate::backends::cuda::NOT_BUILT
        )
    }
    /// Ends this process's part of a multi-process run cleanly.
    pub fn finish(&mut self) {
        match self.never {}
    }
    /// How many GPUs (workers).
    pub fn gpus(&self) -> usize {
        match self.never {}
    }
    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        match self.never {}
    }
    /// Gradient accumulation over `k` micro-batches per GPU.
    pub fn set_accumulate(&mut self, _k: usize) -> Result<()> {
        match self.never {}
    }
    /// One training step on a global batch split across the GPUs.
    pub fn train_step(&mut self, _feeds: &HashMap<String, Tensor>) -> Result<f64> {
        match self.never {}
    }
    /// One training step with each worker's shard given.
    pub fn train_step_shards(&mut self, _shards: &[Arc<HashMap<String, Tensor>>]) -> Result<f64> {
        match self.never {}
    }
    /// `Session::set_static_feeds` on every worker.
    pub fn set_static_feeds(&mut self, _on: bool) -> Result<()> {
        match self.never {}
    }
    /// Waits until every worker's queued steps have finished.
    pub fn sync(&mut self) -> Result<()> {
        match self.never {}
    }
    /// The graph with the trained initializers.
    pub fn trained_graph(&mut self) -> Result<Graph> {
        match self.never {}
    }
    /// Inference on worker 0 with the current parameters.
    pub fn run_fetch(
        &mut self,
        _feeds: &HashMap<String, Tensor>,
        _fetch: &[String],
    ) -> Result<Vec<Tensor>> {
        match self.never {}
    }
    /// Bytes of optimizer state on each GPU.
    pub fn optimizer_state_bytes(&mut self) -> Result<Vec<usize>> {
        match self.never {}
    }
    /// The graph the workers run.
    pub fn graph(&self) -> &Graph {
        match self.never {}
    }
}
