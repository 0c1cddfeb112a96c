"""Integrations with other tools: Flower, Django."""
