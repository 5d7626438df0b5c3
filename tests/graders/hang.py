"""Grader that hangs past any sane timeout."""
import time

time.sleep(60)
print(1.0)
