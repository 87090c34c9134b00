"""One module per command of :mod:`mhf_dist.cli` with logic of its own (the CLI keeps the argument parsing)."""
