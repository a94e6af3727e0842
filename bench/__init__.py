"""The lab: benchmarks, the scheduler simulator, controlled drafters, bench-only forward modes,
distillation and the tiny-model fixtures. The service never imports it; `verity bench` and
`verity distill` load it when they run."""
