"""Binding implementations (plain classes, no Monarch). Heavy imports stay inside functions."""
