"""Runnable examples of epochal models and data factories (``epochal.examples.digits``)."""
