//! The op-code headers the CUDA and WGSL kernels include are generated from the Rust
//! declaration of the unary maps (src/graph/elementwise.rs); this keeps them current.
//! Regenerate with `UPDATE_OPCODES=1 cargo test --test opcodes`.

use graphrun::graph::elementwise::{opcodes_cuda, opcodes_wgsl};

#[test]
fn opcode_headers_match_the_declaration() {
    let mut stale = vec![];
    for (path, text) in [
        ("cuda/opcodes.cuh", opcodes_cuda()),
        ("shaders/opcodes.wgsl", opcodes_wgsl()),
    ] {
        if std::env::var_os("UPDATE_OPCODES").is_some() {
            std::fs::write(path, &text).unwrap();
        } else if std::fs::read_to_string(path).unwrap_or_default() != text {
            stale.push(path);
        }
    }
    assert!(
        stale.is_empty(),
        "{stale:?} stale: run UPDATE_OPCODES=1 cargo test --test opcodes"
    );
}

/// Every op code the generated headers define has a case in each device switch: a
/// forgotten case would trap (CUDA) or give NaN (WGSL) at run time; this names it first.
#[test]
fn every_unary_code_has_a_device_case() {
    let cuda = std::fs::read_to_string("cuda/elementwise.cu").unwrap();
    let wgsl = std::fs::read_to_string("shaders/common.wgsl").unwrap();
    let wgsl_bin = std::fs::read_to_string("shaders/elementwise.wgsl").unwrap();
    let mut missing = vec![];
    for line in opcodes_cuda().lines().filter(|l| l.starts_with("#define ")) {
        let name = line.split_whitespace().nth(1).unwrap();
        let case = format!("case {name}:");
        let wgsl = if name.starts_with("OP_") {
            &wgsl
        } else {
            &wgsl_bin
        };
        if !cuda.contains(&case) {
            missing.push(format!("cuda/elementwise.cu: {case}"));
        }
        if !wgsl.contains(&case) {
            missing.push(format!("shaders: {case}"));
        }
    }
    assert!(missing.is_empty(), "missing device cases: {missing:?}");
}
