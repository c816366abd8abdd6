"""Datasets and samplers for the controller programs."""
