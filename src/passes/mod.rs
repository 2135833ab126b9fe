//! Graph → Graph rewrites (SPEC §3). The pass manager, the cleanup passes, MatMul-epilogue
//! and attention fusion land here (issue: fusion passes); autodiff/ will hold the
//! gradient rules. The foundation runs graphs as written.
