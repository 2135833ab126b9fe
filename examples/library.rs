//! The README's library example, compiled by `cargo test` (tests/readme.rs checks that the
//! README shows this code). Run it with `cargo run --example library`; the last part needs
//! two CUDA GPUs and ends in an error without them.
use graphrun::{Model, Session, SessionOptions};

// Kept as the README shows it.
#[rustfmt::skip]
fn main() -> graphrun::Result<()> {
    let model = Model::load("models/mlp.yaml")?;
    let feeds = model.random_inputs(0, &Default::default())?;
    // The session optimizes the graph first (constant folding, MatMul-epilogue and attention
    // fusion), as the command line does; `SessionOptions { fuse: false, .. }` runs it as given.
    let mut session = Session::new(model.graph, SessionOptions::default())?;
    for (name, tensor) in session.run(&feeds)? {
        println!("{name}: {}", tensor.summary());
    }
    // Gradients of every floating output (seeded with ones) w.r.t. inputs and weights:
    let grads = session.backward(&feeds, &Default::default())?.grads;
    // One step of the model's `training:` optimizer, weights updated in place:
    let loss = session.train_step(&feeds)?;
    println!("{} gradients; loss {loss} after one step", grads.len());
    // The same on two GPUs at once: the batch split between them, gradients averaged (NCCL).
    let opts = SessionOptions { backend: graphrun::BackendKind::Cuda, ..Default::default() };
    let mut dp = graphrun::DataParallel::new(Model::load("models/mlp.yaml")?.graph, opts, 2)?;
    let loss = dp.train_step(&feeds)?;
    println!("loss {loss} after a step on two GPUs");
    Ok(())
}
