"""Run directories, and outputs written through a staging directory."""
