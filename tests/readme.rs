//! README.md's operator table is generated from the code; this keeps them in step.
//! Regenerate with `UPDATE_README=1 cargo test --test readme`.

#[test]
fn readme_op_table_matches_the_code() {
    let readme = std::fs::read_to_string("README.md").unwrap();
    let (start, end) = ("<!-- ops:start -->\n", "<!-- ops:end -->");
    let i = readme.find(start).expect("README has the ops markers") + start.len();
    let j = readme.find(end).unwrap();
    let table =
        graphrun::graph::op::op_table_markdown() + &graphrun::backends::not_on_backend_markdown();
    if std::env::var_os("UPDATE_README").is_some() {
        std::fs::write(
            "README.md",
            format!("{}{}{}", &readme[..i], table, &readme[j..]),
        )
        .unwrap();
        return;
    }
    assert_eq!(
        &readme[i..j],
        table,
        "README.md's op table is stale: run UPDATE_README=1 cargo test --test readme"
    );
    // Every op in the table is accepted by the parser (no name drift).
    for n in graphrun::graph::op::OP_NAMES.iter() {
        let r = graphrun::Op::parse(n, &[], "t", None);
        if let Err(e) = r {
            assert!(!e.to_string().contains("unknown op"), "{n}: {e}");
        }
    }
}
