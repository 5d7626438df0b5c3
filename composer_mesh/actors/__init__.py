"""Typed actors (thin Monarch wrappers) and the plain backend classes they delegate to."""
