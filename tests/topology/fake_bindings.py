"""Small binding classes for the topology tests, referenced from YAML by import path `topology.fake_bindings:X`.

They follow the binding contract of `composer_mesh.bindings` (a `Settings` model and `capabilities`) without
depending on the real backends, so the schema tests run whatever state those are in.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainerSettings(_Settings):
    lr: float = Field(1e-3, gt=0, description="Learning rate.")
    device: str = Field("cpu", description="Torch device.")


class Trainer:
    Settings: ClassVar[type[BaseModel]] = TrainerSettings
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings


class GeneratorSettings(_Settings):
    max_batch: int = Field(8, ge=1, description="Requests per batch.")
    sampler: Literal["greedy", "sample"] = Field("sample", description="Decoding.")


class Generator:
    Settings: ClassVar[type[BaseModel]] = GeneratorSettings
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: GeneratorSettings) -> None:
        self.settings = settings


class GPUGenerator(Generator):
    """A generator that can only run on a GPU (capability `gpu`)."""

    capabilities: ClassVar[frozenset[str]] = frozenset({"gpu"})


class RewarderSettings(_Settings):
    reward: str = Field("exact", description="Reward function name.")


class Rewarder:
    Settings: ClassVar[type[BaseModel]] = RewarderSettings
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: RewarderSettings) -> None:
        self.settings = settings


class TeacherSettings(_Settings):
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    gpus: int = Field(0, ge=0, description="GPUs the teacher needs.")


class LocalTeacher:
    """A teacher that shares the student's tokenizer: both channels."""

    Settings: ClassVar[type[BaseModel]] = TeacherSettings
    capabilities: ClassVar[frozenset[str]] = frozenset({"distill", "replay"})

    def __init__(self, settings: TeacherSettings) -> None:
        self.settings = settings


class APITeacher(LocalTeacher):
    """A remote-API teacher (like openrouter): full traces only."""

    capabilities: ClassVar[frozenset[str]] = frozenset({"replay"})


class NoSettings:
    """Not a binding: no `Settings` attribute."""

    capabilities: ClassVar[frozenset[str]] = frozenset()


class CrashingSettings(_Settings):
    value: int = Field(0, description="Anything; the validator crashes with a non-ValueError.")

    @field_validator("value")
    @classmethod
    def _crash(cls, v: int) -> int:
        if v == 13:
            raise OSError("unlucky settings validator")
        return v


class CrashingRewarder(Rewarder):
    """A binding whose settings validator raises an OSError (not a ValueError)."""

    Settings: ClassVar[type[BaseModel]] = CrashingSettings
