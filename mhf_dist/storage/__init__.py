"""Run directories (their layout, assets and lock), and outputs written through a staging directory."""
