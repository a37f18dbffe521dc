"""Integrations with other tools; each submodule needs that tool installed."""
