"""Grader that prints bytes that are not UTF-8."""
import sys

sys.stdout.buffer.write(b"\xff\xfe 1.0?\n")
