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

pub struct DataParallel {
    never: std::convert::Infallible,
}

impl DataParallel {
    pub fn new(_graph: Graph, _opts: SessionOptions, gpus: usize) -> Result<DataParallel> {
        crate::bail!(
            Runtime,
            "data-parallel training on {gpus} GPUs runs on CUDA, and {}",
            crate::backends::cuda::NOT_BUILT
        )
    }
    pub fn gpus(&self) -> usize {
        match self.never {}
    }
    pub fn steps(&self) -> u64 {
        match self.never {}
    }
    pub fn train_step(&mut self, _feeds: &HashMap<String, Tensor>) -> Result<f64> {
        match self.never {}
    }
    pub fn train_step_shards(&mut self, _shards: &[Arc<HashMap<String, Tensor>>]) -> Result<f64> {
        match self.never {}
    }
    pub fn set_static_feeds(&mut self, _on: bool) -> Result<()> {
        match self.never {}
    }
    pub fn sync(&mut self) -> Result<()> {
        match self.never {}
    }
    pub fn trained_graph(&mut self) -> Result<Graph> {
        match self.never {}
    }
    pub fn run_fetch(
        &mut self,
        _feeds: &HashMap<String, Tensor>,
        _fetch: &[String],
    ) -> Result<Vec<Tensor>> {
        match self.never {}
    }
    pub fn graph(&self) -> &Graph {
        match self.never {}
    }
}
