"""Data-only package: model, mesh and server configs (YAML)."""
