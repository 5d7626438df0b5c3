"""The sandbox side of grading: imports `solution.py` and answers calls of its functions, one JSON line each.
Stdlib only: its source is passed with `-c` (`python -I -S -B -c SOURCE`; `-B` because `-I` ignores the sandbox's
PYTHONDONTWRITEBYTECODE), composer_mesh is not importable in the sandbox.

stdin: a tag line, then one JSON line, the calls: `[{"fn": "fizzbuzz", "args": [9]}, ...]`. Both are read, and
`json` imported, before the solution is: its files cannot shadow the probe's imports. stdout: for call i, once it
returned, `\\n<tag> {"i": i, "returns": <value>}`, `\\n<tag> {"i": i, "raises": [<class names, most derived
first>], "message": "..."}`, or `\\n<tag> {"i": i, "error": "..."}` (a value that is not JSON, an answer over
`MAX_ANSWER` bytes); an import that fails is one `\\n<tag> {"import_error": "..."}` line. The solution's own
prints go to stderr, so they cannot crowd the answers out of the kept output.

Why nothing here is trusted: the solution runs in this process and can rewrite any of it, read the tag, print
lines of its own. It gains nothing: the expected values are never in the sandbox (`judge.py` compares on the
host), so all it can forge is its own function's answers.
"""

import json
import os
import sys

MAX_ANSWER = 4096  # bytes of one answer line; `judge.py` refuses longer ones too


def main() -> None:
    """Read the tag and the calls, import the solution, answer each call in order."""
    tag = sys.stdin.readline().strip()
    calls = json.loads(sys.stdin.readline())
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.path.insert(0, ".")  # only now: the probe's own imports are done
    try:
        import solution
    except BaseException as e:  # the solution's failure, reported
        out.write(f"\n{tag} {json.dumps({'import_error': _describe(e)})}\n")
        out.flush()
        return
    for i, call in enumerate(calls):
        out.write(f"\n{tag} {_answer(solution, i, call)}\n")
        out.flush()


def _answer(module: object, i: int, call: dict) -> str:
    """Call `call["fn"]` of `module` with `call["args"]`: the answer's JSON text."""
    try:
        value = getattr(module, call["fn"])(*call["args"])
    except BaseException as e:  # what the call raised is its answer
        answer = {"i": i, "raises": [c.__name__ for c in type(e).__mro__], "message": _describe(e)}
    else:
        answer = {"i": i, "returns": value}
    try:
        text = json.dumps(answer, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        text = json.dumps({"i": i, "error": f"the answer is not JSON: {type(e).__name__}: {e}"[:300]})
    if len(text) > MAX_ANSWER:
        text = json.dumps({"i": i, "error": f"the answer is larger than {MAX_ANSWER} bytes"})
    return text


def _describe(e: BaseException) -> str:
    try:
        return f"{type(e).__name__}: {e}"[:300]
    except BaseException:  # an exception whose str() fails
        return type(e).__name__


if __name__ == "__main__":
    main()
