"""Benchmarks: `python -m bench.op OP --shape PRESET` (kernels against peers) and, later,
`python -m bench.model` (a whole forward pass). Results land in bench/results/."""
