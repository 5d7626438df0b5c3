"""Grader that prints something that is not a number."""
print("looks good to me!")
