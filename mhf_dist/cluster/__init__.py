"""Clusters and jobs: profiles and job templates, the schedulers (``mhf_dist.cluster.scheduler``), submission
and its estimates, starting and watching ranks, and a run's status.

Imports without torch: ``submit`` and ``status`` run on login nodes that may not have it. See docs/clusters.md and
docs/design.md ("The scheduler boundary").
"""
