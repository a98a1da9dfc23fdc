"""The judge of both execution modes: what a schedule holds step by step and what it costs.
`simulate` (the compiled mode's memory, copy by copy), `overlap` (offload transfers on their
own stream), `evaluate` (`make_schedule`: a decision priced), `peak_meter` (peaks of many
decisions, fast), `eager_blocks`, `eager` and `eager_offload` (the eager mode's timeline under
a selective-checkpoint policy per block), `pipeline_rank` (a pipeline stage's schedule of
micro-batches). Imports only `core`."""
