"""A shell grader scoring from the prompt's extra data columns: prints extra["weight"] (0 when absent)."""
import json
import sys

req = json.load(sys.stdin)
print(float(req.get("extra", {}).get("weight", 0.0)))
