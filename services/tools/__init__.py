"""The tools: the `dapo` command line, the local launcher, reports, ablation, evaluation,
the ledger audit and benchmarks. They compose and drive the roles; no role imports them."""
