"""``mhf-dist profile``: throughput, MFU, memory and communication per hash configuration and layout.

For every (layout, hash configuration) the model is built from the preset
``{size}-{hash}`` (``h4b16k+engram``: with the Engram memory, docs/spec.md §8, so its
cost shows next to the same model without it), tensor-parallelised (tp ranks
are local processes), and trained with AdamW on the same synthetic token
batch: warm-up steps, then ``--steps`` measured ones. Each step is split into forward, backward and
optimizer time (CUDA events on GPUs, wall timers on CPU) and the time spent in
tensor-parallel collectives; the FLOPs are the analytic count of
:mod:`mhf_dist.model.flops`, the peak is measured in the same run (a timed
matmul in the run's dtype) and shown next to the cluster profile's nominal one.
Inference: the time per token of ``log P_inf`` over 32K, 128K and 1M registered
tokens next to a Standard LM head over the same vocabulary.

Outputs in ``--out``: ``profile.csv`` / ``profile.json`` (training rows),
``scoring.csv``, TensorBoard scalars, and PNG plots.

By concern: :mod:`.timing` (the clocks), :mod:`.training` (one configuration's training steps, on one rank),
:mod:`.scoring` (the inference heads), :mod:`.sweep` (one set of processes per configuration and layout),
:mod:`.report` (CSV, JSON, TensorBoard, the text table) and :mod:`.plot` (the PNG plots).
"""
