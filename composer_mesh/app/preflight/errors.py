"""`PreflightError`: what the checks before launch found, one line per problem."""

from __future__ import annotations

from composer_mesh.errors import UserInputError


class PreflightError(UserInputError, ValueError):
    """A topology that would fail once launched: each problem on a line of its own, naming the field or file
    and the fix."""
