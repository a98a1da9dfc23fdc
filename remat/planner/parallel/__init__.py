"""Plans for a parallel job: `tensor_parallel` (a plan per tensor-parallel rank), `pipeline`
(a plan per pipeline stage and schedule), with `stage` (a stage's candidate plans), `split`
(the model split into stages) and `fsdp` (FSDP2 inside a stage). Imports `job` and `plans`."""
