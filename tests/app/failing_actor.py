"""An actor that raises what its caller asks for (imported by its module path in the actor's proc)."""

from __future__ import annotations

from monarch.actor import Actor, endpoint

from composer_mesh.actors.backends.teachers.openrouter_client import read_api_key
from composer_mesh.models.tokenizer import build_tokenizer, encode_checked
from composer_mesh.tasks.data import DataRowError


class Failing(Actor):
    """Raises what the controller asks for, as a binding would inside `generate` or `setup`."""

    @endpoint
    def fail(self, kind: str) -> None:
        if kind == "row":
            raise DataRowError("data/train.jsonl", 7, "prompt", "expected non-empty text, got str ''")
        if kind == "prompt":
            encode_checked(build_tokenizer("0123456789+=;"), "What is 1 plus 1?")
        if kind == "key":
            read_api_key("COMPOSER_MESH_TEST_NO_SUCH_KEY")
        raise ValueError("an index went out of range")  # a bug
