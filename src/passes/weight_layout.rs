//! Inference weights stored as PyTorch's `nn.Linear` stores them: a 2-D f32 initializer that
//! is only ever B of `FusedMatMul`s (`A · B`, B `[K, N]`) is transposed once to `[N, K]`
//! and read with `trans_b`. Both operands are then K-major, the layout Hopper's TF32
//! tensor-core instructions take straight from shared memory (with B N-major cuBLASLt
//! runs slower kernels: mlp_large's tf32 forward 0.494 → 0.455 ms on an H100; 16-bit
//! operands can be read either way, and are left alone).
//!
//! Not a pass of the default pipeline: it changes initializers' shapes, so gradients and
//! training would see other parameters than the model's. Callers apply it to graphs that
//! only run forward (`graphrun run` without `--backward`, `bench`'s forward pass).

use crate::graph::{Graph, Op};
use std::collections::HashMap;

/// `g` with such weights transposed, and how many were.
pub fn k_major_weights(g: &Graph) -> (Graph, usize) {
    // Each initializer's readers: (node, input position).
    let mut readers: HashMap<&str, Vec<(usize, usize)>> = HashMap::new();
    for (ni, n) in g.nodes.iter().enumerate() {
        for (k, i) in n.inputs.iter().enumerate() {
            readers.entry(i.as_str()).or_default().push((ni, k));
        }
    }
    let only_b = |name: &str| {
        readers.get(name).is_some_and(|rs| {
            rs.iter().all(|&(ni, k)| {
                k == 1 && matches!(g.nodes[ni].op, Op::FusedMatMul { trans_b: false, .. })
            })
        })
    };
    let mut out = g.clone();
    let (mut flip, mut flipped) = (vec![], 0);
    for init in &mut out.initializers {
        if init.tensor.shape().len() == 2
            && init.tensor.dtype() == crate::tensor::DType::F32
            && !g.outputs.contains(&init.name)
            && only_b(&init.name)
        {
            init.tensor = super::epilogue::transposed(&init.tensor);
            // The values are now the data (an `init:` spec would draw another shape).
            init.source = crate::graph::InitSource::Data;
            flipped += 1;
            flip.extend(readers[init.name.as_str()].iter().map(|&(ni, _)| ni));
        }
    }
    for &ni in &flip {
        if let Op::FusedMatMul { trans_b, .. } = &mut out.nodes[ni].op {
            *trans_b = true;
        }
    }
    (out, flipped)
}
