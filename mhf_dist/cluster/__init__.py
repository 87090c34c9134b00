"""Clusters and jobs: profiles and job templates, submission, local and SLURM launch, run status and the run lock.

Imports without torch: ``submit`` and ``status`` run on login nodes that may not have it.
"""
