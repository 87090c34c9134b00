"""One module per command of ``mhf_dist.cli`` with logic of its own (the CLI keeps the argument parsing)."""
