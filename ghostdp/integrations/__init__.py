"""Integrations with other libraries (imported on demand: ghostdp.integrations.transformers)."""
