"""Every check before a launch: the data source, the parallel layout and the engine config, before any rank starts
and without torch (``plan``, ``submit`` and ``train`` on a login node)."""

from __future__ import annotations

from mhf_dist.backend import engine_config
from mhf_dist.config import ConfigError, RunConfig, check_data_source
from mhf_dist.model.host_memory import run_host_table_memory, sharing_ranks
from mhf_dist.parallel.layout import Layout, backend_name, resolve_layout
from mhf_dist.parallel.stages import layer_costs, pipeline_bounds, stage_blocks

GB = 2**30  # as plan counts


def preflight(
    cfg: RunConfig,
    world_size: int,
    device: str,
    data_here: bool = True,
    ranks_per_node: int | None = None,
    host_budget_gb: float | None = None,
) -> tuple[Layout, dict]:
    """Every check before a launch on ``device`` ranks (cpu, cuda): the data source (on this machine unless
    ``data_here`` is False), the layout for ``world_size`` (``ranks_per_node``: None, one node), the engine config and
    the host tables' memory per rank against ``model.engram.host_budget_gb`` (else ``host_budget_gb``, a cluster
    profile's share); before any rank starts."""
    check_data_source(cfg, data_here)
    backend_name(cfg.train.dist_backend, device)
    layout = resolve_layout(cfg, world_size)
    engram = cfg.model.engram
    if engram is not None and engram.offload:
        budget = engram.host_budget_gb or host_budget_gb
        if budget is not None:
            check_host_tables(cfg, layout, ranks_per_node or world_size, budget)
    return layout, engine_config(cfg, layout, device)


def check_host_tables(
    cfg: RunConfig, layout: Layout, ranks_per_node: int, budget_gb: float
) -> None:
    """Refuse host tables whose memory per rank exceeds ``budget_gb``, naming a layout that fits."""
    world = layout.tp * layout.pp * layout.dp
    stage_ranks, stages = world // layout.pp, None
    if layout.pp > 1:
        try:  # the cut; a Standard model's moves with its vocabulary's size, not known here
            costs = layer_costs(cfg.model, cfg.data.seq_len, vocab_rows=None)
            stages = stage_blocks(pipeline_bounds(costs, layout.pp), cfg.model.n_layers)
        except ValueError:
            pass
    share = sharing_ranks(cfg.model, world, ranks_per_node, layout.pp)
    here = run_host_table_memory(cfg, share, layout.accum, stages)
    if here.total <= budget_gb * GB:
        return
    held = "the whole tables" if here.ranks == 1 else f"1/{here.ranks} of the tables' rows"
    sharded = run_host_table_memory(cfg, stage_ranks, layout.accum, stages)
    advice = (
        f"set model.engram.offload=sharded ({sharded.total / GB:.3g} GB per rank over {stage_ranks} ranks)"
        if sharded.total <= budget_gb * GB and here.ranks < stage_ranks
        else "add ranks to share the rows (model.engram.offload=sharded, offload_shards=all), or make the tables "
        "smaller (model.engram.table_size)"
    )
    raise ConfigError(
        f"host-memory Engram tables need {here.total / GB:.3g} GB per rank ({held}: {here.tables / GB:.3g} GB of "
        f"weights, Adam moments and gradients, plus {here.buffers / GB:.3g} GB of exchange buffers), over the "
        f"budget of {budget_gb:g} GB per rank; {advice}, or raise model.engram.host_budget_gb"
    )
