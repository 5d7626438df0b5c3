"""The run's prompts checked before launch: the prompt source resolves (`run.task`, every row of `run.data`,
the `run.environment` dataset) and the policy's tokenizer reads a sample of its prompts within the context.

Why: a task, data file or dataset that does not resolve, a malformed row, or a prompt the tokenizer cannot
represent otherwise fails in the controller or inside a generator once the meshes are up. Here it is one line
naming the source and the row, and the setting that fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.actors.messages import Prompt
from composer_mesh.app.preflight.errors import PreflightError
from composer_mesh.envs import sample_environment_rows
from composer_mesh.errors import UserInputError
from composer_mesh.models.compat import context_length
from composer_mesh.orchestration.prompts import DataPrompts, prompt_source
from composer_mesh.tasks.data import DataRow
from composer_mesh.topology.schema import Topology

SAMPLE_ROWS = 2000  # data rows encoded (in file order: train rows, then the eval rows); every row is validated
SAMPLE_DRAWN = 32  # prompts drawn from a task or an environment


@dataclass(frozen=True)
class PromptSample:
    """A prompt to encode and where it comes from, for the error message."""

    where: str
    prompt: Prompt


def check_prompts(topology: Topology) -> tuple[str, Prompt | None]:
    """Resolve the run's prompt source and encode a sample of its prompts with the policy's tokenizer. Raises
    the source's own `UserInputError` (DataError, PromptSourceError, ...) or PreflightError naming the first
    prompt that cannot be encoded or does not fit the context. Returns what was checked, in a few words, and
    the first prompt read (None when the source is only read once the run starts), so the reward check does
    not open the source again."""
    samples, checked = prompt_samples(topology)
    encode_samples(topology, samples)
    if not samples:
        return checked, None
    return f"{checked}; {len(samples)} prompt(s) encoded by the policy's tokenizer", samples[0].prompt


def prompt_samples(topology: Topology) -> tuple[list[PromptSample], str]:
    """A sample of the run's prompts, each with its source and row, and a few words on what was read."""
    run = topology.run
    if run.environment is not None:
        rows = sample_environment_rows(run.environment, run.seed, SAMPLE_DRAWN)
        if rows is None:
            return [], f"run.environment ({run.environment.kind}): checked when the run starts"
        return [_row_sample(i, row) for i, row in enumerate(rows)], f"run.environment: {len(rows)} prompt(s) drawn"
    source = prompt_source(run)
    try:
        if isinstance(source, DataPrompts):
            data = source.data
            rows = (data.train + data.eval)[:SAMPLE_ROWS]
            read = f"run.data: {len(data.train)} train row(s), {len(data.eval)} eval row(s), all well-formed"
            return [_row_sample(i, row) for i, row in enumerate(rows)], read
        drawn = source.take(SAMPLE_DRAWN) + source.eval_prompts(min(run.eval_prompts, SAMPLE_DRAWN))
        return [PromptSample(f"run.task {run.task!r}, prompt {p.prompt_id}", p) for p in drawn], \
            f"run.task {run.task!r}: resolves"
    finally:
        source.close()


def _row_sample(index: int, row: DataRow) -> PromptSample:
    return PromptSample(row.where or f"row {index + 1}", DataPrompts.row_prompt(f"row{index}", row))


def encode_samples(topology: Topology, samples: list[PromptSample]) -> None:
    """Each prompt through the policy's tokenizer as the generators will encode it (chat template for
    messages), and within the context with `run.max_new_tokens` to spare; PreflightError for the first that
    is not."""
    from composer_mesh.models.chat import prompt_token_ids
    from composer_mesh.models.loading import load_tokenizer

    if not samples:
        return
    model = topology.model
    tokenizer = load_tokenizer(model)
    context, max_new = context_length(model), topology.run.max_new_tokens
    fix = _tokenizer_fix(topology)
    for sample in samples:
        try:
            ids = prompt_token_ids(tokenizer, sample.prompt)
        except UserInputError as e:
            raise PreflightError(f"{sample.where}: {e}{fix}") from None
        if context is not None and len(ids) + max_new > context:
            raise PreflightError(
                f"{sample.where}: the prompt is {len(ids)} tokens; with run.max_new_tokens={max_new} that is more "
                f"than the policy's context of {context} tokens: shorten the prompt, lower run.max_new_tokens"
                + (", or raise model.max_position_embeddings" if model.is_tiny else ""))


def _tokenizer_fix(topology: Topology) -> str:
    """What to set when the built-in tiny model's character tokenizer cannot read the prompts."""
    model = topology.model
    if model.is_tiny and model.tokenizer == "char":
        return (f" (model.tokenizer: char reads only the characters of model.task {model.task!r}: set "
                "model.tokenizer: byte to read any text)")
    return ""
