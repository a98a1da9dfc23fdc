"""Problems drawn for the solver's tests and benchmarks: `problems` (chains, transformers,
random graphs, hypothesis strategies), `cnn` (CNN-like graphs with skips) and `eager` (eager
problems with blocks)."""
