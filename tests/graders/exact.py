"""A well-behaved grader: exact match of the completion (up to ';') with the answer, read as JSON on stdin."""
import json
import sys

req = json.load(sys.stdin)
print(1.0 if req["completion"].split(";")[0].strip() == req["answer"] else 0.0)
