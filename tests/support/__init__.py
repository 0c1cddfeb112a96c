"""Helpers shared by the project's tests."""
