"""``mhf-dist profile``: throughput, MFU, memory and communication per hash configuration and layout.

Each (layout, hash configuration) trains the preset ``{size}-{hash}`` (``h4b16k+engram``: with the Engram memory)
on tp local ranks, on one synthetic batch: warm-up steps, then ``--steps`` measured ones, each split into forward,
backward, optimizer and tensor-parallel collective time, with MFU against a timed matmul; then the inference heads'
time per token. What it reports and writes: docs/profiling.md. By concern: ``timing`` (the clocks), ``training``
(one configuration's training steps, on one rank), ``scoring`` (the inference heads), ``sweep`` (one set of
processes per configuration and layout), ``layouts`` (the layouts checked first), ``report`` (CSV, JSON,
TensorBoard, the text table) and ``plot`` (the PNG plots).
"""
