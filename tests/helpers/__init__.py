"""Helpers shared by the test modules (fixtures stay in conftest.py).

``ranks``: run a function on local gloo ranks; ``runs``: `mhf-dist` in a subprocess and tiny training runs;
``equivalence``: comparing a parallel or fused computation with the plain one; ``slurm``: a private SLURM;
``filesystems``: a full or read-only filesystem mounted for one test; ``toy_scheduler``: a scheduler from outside
the package; ``toy_variant``: a model variant from outside the package.
"""
