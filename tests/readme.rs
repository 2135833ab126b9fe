//! README.md's generated parts (the operator table, the planned-memory table) and its
//! library example are kept in step with the code here. Regenerate the tables with
//! `UPDATE_README=1 cargo test --test readme`.

/// Checks the README's block between `<!-- KEY:start -->` and `<!-- KEY:end -->` against
/// `table`, or with UPDATE_README set rewrites it (and returns true).
fn generated(key: &str, what: &str, table: &str) -> bool {
    // The tests run in parallel; rewriting the file is one at a time.
    static README: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = README.lock().unwrap_or_else(|e| e.into_inner());
    let readme = std::fs::read_to_string("README.md").unwrap();
    let (start, end) = (
        format!("<!-- {key}:start -->\n"),
        format!("<!-- {key}:end -->"),
    );
    let i = readme.find(&start).expect("README has the markers") + start.len();
    let j = readme.find(&end).unwrap();
    if std::env::var_os("UPDATE_README").is_some() {
        let text = format!("{}{}{}", &readme[..i], table, &readme[j..]);
        std::fs::write("README.md", text).unwrap();
        return true;
    }
    assert_eq!(
        &readme[i..j],
        table,
        "README.md's {what} is stale: run UPDATE_README=1 cargo test --test readme"
    );
    false
}

#[test]
fn readme_op_table_matches_the_code() {
    let table =
        graphrun::graph::op::op_table_markdown() + &graphrun::backends::not_on_backend_markdown();
    if generated("ops", "op table", &table) {
        return;
    }
    // Every op in the table is accepted by the parser (no name drift).
    for n in graphrun::graph::op::OP_NAMES.iter() {
        let r = graphrun::Op::parse(n, &[], "t", None);
        if let Err(e) = r {
            assert!(!e.to_string().contains("unknown op"), "{n}: {e}");
        }
    }
}

/// The README's planned-memory table: each row is what `graphrun inspect` prints for its
/// command, so the numbers cannot go stale. Regenerate with
/// `UPDATE_README=1 cargo test --test readme`.
#[test]
fn readme_memory_table_matches_inspect() {
    const ROWS: &[(&str, &str)] = &[
        (
            "gpt_block (batch 8, seq 1024), unfused",
            "inspect models/gpt_block.yaml --no-fuse",
        ),
        (
            "gpt_block (batch 8, seq 1024), fused (1 Attention + 4 FusedMatMul)",
            "inspect models/gpt_block.yaml",
        ),
        (
            "gpt_block (batch 8, seq 1024) forward + backward, fused",
            "inspect models/gpt_block.yaml --backward",
        ),
        (
            "gpt_block (batch 8, seq 1024) forward + backward, unfused",
            "inspect models/gpt_block.yaml --backward --no-fuse",
        ),
        (
            "gpt_block (batch 1, seq 512), fused",
            "inspect models/gpt_block.yaml --dim batch=1 --dim seq=512",
        ),
        (
            "gpt_block (batch 1, seq 512), unfused",
            "inspect models/gpt_block.yaml --dim batch=1 --dim seq=512 --no-fuse",
        ),
        (
            "attention (1×4×2048×64, causal), fused (flash-style)",
            "inspect models/attention.yaml --dim batch=1 --dim heads=4",
        ),
        (
            "attention (1×4×2048×64, causal), unfused",
            "inspect models/attention.yaml --dim batch=1 --dim heads=4 --no-fuse",
        ),
        (
            "mlp_small (batch 64) training step",
            "inspect models/mlp.yaml --backward",
        ),
    ];
    let mut table =
        String::from("| what | peak planned activation memory | command |\n|---|---|---|\n");
    for (what, cmd) in ROWS {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_graphrun"))
            .args(cmd.split(' '))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "graphrun {cmd}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        // The last "peak activation memory" line: the forward+backward one with --backward.
        let line = text
            .lines()
            .rfind(|l| l.trim_start().starts_with("peak activation memory"))
            .unwrap_or_else(|| panic!("graphrun {cmd} printed no memory line:\n{text}"));
        let number = line
            .trim_start()
            .trim_start_matches("peak activation memory ")
            .trim_start_matches("forward+backward ");
        // "1.28 GiB (without ...)": the size in bold, the comparison after it.
        let cut = number
            .match_indices(' ')
            .nth(1)
            .map_or(number.len(), |(k, _)| k);
        let (size, rest) = number.split_at(cut);
        table.push_str(&format!(
            "| {what} | **{size}**{rest} | `graphrun {cmd}` |\n"
        ));
    }
    generated("memory", "memory table", &table);
}

/// The README's library example is examples/library.rs (which `cargo test` compiles), line
/// for line.
#[test]
fn readme_library_example_is_the_compiled_one() {
    let readme = std::fs::read_to_string("README.md").unwrap();
    let start = readme
        .find("As a library:\n\n```rust\n")
        .expect("README has the example");
    let block = &readme[start..];
    let block = &block[block.find("use ").unwrap()..];
    let block = &block[..block.find("```").unwrap()];
    let example = std::fs::read_to_string("examples/library.rs").unwrap();
    let lines: Vec<&str> = example.lines().map(str::trim).collect();
    for line in block.lines().map(str::trim).filter(|l| !l.is_empty()) {
        assert!(
            lines.contains(&line),
            "examples/library.rs lacks the README's line {line:?}"
        );
    }
}
