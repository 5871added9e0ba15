"""Scaling science: compute accounting (and, later, curve fitting and extrapolation)."""
