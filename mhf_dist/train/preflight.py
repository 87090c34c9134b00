"""Every check before a launch: the data source, the parallel layout and the engine config, before any rank starts
and without torch (``plan``, ``submit`` and ``train`` on a login node)."""

from __future__ import annotations

from mhf_dist.backend import engine_config
from mhf_dist.config import RunConfig, check_data_source
from mhf_dist.parallel.layout import Layout, backend_name, resolve_layout


def preflight(
    cfg: RunConfig, world_size: int, device: str, data_here: bool = True
) -> tuple[Layout, dict]:
    """Every check before a launch on ``device`` ranks (cpu, cuda): the data source (on this machine unless
    ``data_here`` is False), the layout for ``world_size`` and the engine config; before any rank starts."""
    check_data_source(cfg, data_here)
    backend_name(cfg.train.dist_backend, device)
    layout = resolve_layout(cfg, world_size)
    return layout, engine_config(cfg, layout, device)
