"""YAML files validated by pydantic models, with every error at its field path, line and column.

Generic: it knows no topology section. `parse_yaml_model` / `load_yaml_model` validate any model (the price
table of `plan` uses them); `composer_mesh.topology.load` adds the checks across sections.

A discriminated union (`Annotated[A | B, Field(discriminator="kind")]`, e.g. a mesh's `backend`) reads like the
member its data names: pydantic's member tags are taken out of error paths, and a missing or unknown
discriminator is reported at that key with the allowed values, like any other choice.

A model whose field is typed only after validation (a role's `settings`, typed by its binding) can name the
model of that field for error messages with a classmethod `field_model(name, raw) -> type[BaseModel] | None`
(`raw` is the mapping the model was given): unknown keys then list the allowed ones.

Strings from the file are never echoed in messages (a pasted secret must not appear in an error; the line and
column point at it), except short values given for a closed set of choices.
"""

from __future__ import annotations

import difflib
import os
import re
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from composer_mesh.errors import FieldError

Loc = tuple[str | int, ...]
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class TopologyIssue:
    """One problem in a file: dotted field path, 1-based line and column (None when unknown), message."""

    path: str
    line: int | None
    column: int | None
    message: str

    def format(self, source: str | None = None) -> str:
        where = f"{source}:" if source else ""
        if self.line is not None:
            where += f"{self.line}:{self.column}:"
        return f"{where} {self.path or '(file)'}: {self.message}".lstrip()


class TopologyError(ValueError):
    """A topology (or price table) file is invalid; `.errors` lists every problem found."""

    def __init__(self, errors: list[TopologyIssue], source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        n = len(self.errors)
        head = f"{self.source or 'topology'}: {n} error{'s' if n != 1 else ''}"
        return "\n".join([head, *("  " + e.format(self.source) for e in self.errors)])


def _path_str(parts: Sequence[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# ---------------------------------------------------------------------------------------------------------
# The YAML document: plain data plus the node tree, to turn a field path into a line and column
# ---------------------------------------------------------------------------------------------------------


class YamlDoc:
    """A parsed YAML file: `data` (plain Python), `root` (the node tree) and the `issues` found so far
    (syntax errors, duplicate keys)."""

    def __init__(self, text: str) -> None:
        self.issues: list[TopologyIssue] = []
        self.root: yaml.Node | None = None
        self.data: Any = None
        bad = first_unprintable(text)
        if bad is not None:  # YAML refuses it (the loader raises on it before parsing anything)
            self.issues.append(bad)
            return
        loader = yaml.SafeLoader(text)
        try:
            self.root = loader.get_single_node()
            if self.root is not None:
                self._find_duplicates(self.root, ())
                self.data = loader.construct_document(self.root)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            msg = " ".join(filter(None, [e.context, e.problem]))
            line, column = (mark.line + 1, mark.column + 1) if mark else (None, None)
            self.issues.append(TopologyIssue("", line, column, f"YAML syntax error: {msg}"))
        except yaml.YAMLError as e:
            self.issues.append(TopologyIssue("", None, None, f"YAML error: {e}"))
        finally:
            loader.dispose()

    def _find_duplicates(self, node: yaml.Node, parts: Loc) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, yaml.Node] = {}
            for key, value in node.value:
                k = str(key.value) if isinstance(key, yaml.ScalarNode) else repr(key.value)
                if k in seen:
                    first = seen[k].start_mark.line + 1
                    self.issues.append(
                        TopologyIssue(
                            _path_str((*parts, k)),
                            key.start_mark.line + 1,
                            key.start_mark.column + 1,
                            f"duplicate key {k!r} (first given on line {first})",
                        )
                    )
                else:
                    seen[k] = key
                self._find_duplicates(value, (*parts, k))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._find_duplicates(item, (*parts, i))

    @staticmethod
    def _child(node: yaml.Node | None, el: str | int) -> tuple[yaml.Node, yaml.Node] | None:
        """(key node or item node, value node) of `el` under `node`, or None."""
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and str(key.value) == str(el):
                    return key, value
        elif isinstance(node, yaml.SequenceNode) and isinstance(el, int) and 0 <= el < len(node.value):
            return node.value[el], node.value[el]
        return None

    def locate(self, loc: Loc, *, key: bool = False) -> tuple[str, int | None, int | None]:
        """Field path, line and column of a pydantic `loc`.

        Elements that are not in the file are pydantic's union tags (dropped) or a missing/defaulted field
        (kept in the path, located at its nearest parent). `key=True` points at the key rather than its value.
        """
        node = self.root
        parts: list[str | int] = []
        mark = node.start_mark if node is not None else None
        last_key: yaml.Node | None = None
        for i, el in enumerate(loc):
            if el == "[key]":
                if last_key is not None:
                    mark = last_key.start_mark
                continue
            found = self._child(node, el)
            if found is None:
                if any(self._child(node, r) is not None for r in loc[i + 1 :]):
                    continue  # a union tag such as 'function-after[...]'
                parts.extend(r for r in loc[i:] if r != "[key]")
                break
            key_node, value = found
            parts.append(str(el) if isinstance(node, yaml.MappingNode) else el)
            last_key = key_node
            is_last = i == len(loc) - 1
            scalar = isinstance(value, yaml.ScalarNode)
            mark = key_node.start_mark if (key and is_last) or not scalar else value.start_mark
            node = value
        if mark is None:
            return _path_str(parts), None, None
        return _path_str(parts), mark.line + 1, mark.column + 1

    def issue(self, loc: Loc, message: str, *, key: bool = False) -> TopologyIssue:
        """An issue at `loc`, located in this document."""
        path, line, column = self.locate(loc, key=key)
        return TopologyIssue(path, line, column, message)


# ---------------------------------------------------------------------------------------------------------
# Which type validates a path (to say what is allowed there, and to tell the file's keys from pydantic's tags)
# ---------------------------------------------------------------------------------------------------------


def model_of(tp: Any) -> type[BaseModel] | None:
    """The pydantic model behind an annotation (through `Annotated` and `Optional`), if there is one.

    `BaseModel` itself (a field typed only after validation) is not a model with fields: None.
    """
    if get_origin(tp) is Annotated:
        return model_of(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        models = [m for m in map(model_of, get_args(tp)) if m is not None]
        return models[0] if len(models) == 1 else None
    if isinstance(tp, type) and issubclass(tp, BaseModel) and tp is not BaseModel:
        return tp
    return None


def field_type(model: type[BaseModel], name: str) -> Any:
    """The annotation of a model's field, with its metadata (validators) as `Annotated`."""
    field = model.model_fields[name]
    return Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation


def _members(tp: Any) -> list[Any]:
    """The members of a union annotation but None (`[tp]` for any other annotation)."""
    if get_origin(tp) in (Union, types.UnionType):
        return [a for a in get_args(tp) if a is not type(None)]
    return [tp]


def bare(tp: Any) -> Any:
    """`tp` without `Optional` and without `Annotated` metadata, except a discriminated union's.

    Why: `EnvironmentConfig | None` is a discriminated union too; seen through its `Optional`, its tags and its
    members are found like those of a union that is required."""
    while True:
        if get_origin(tp) is Annotated and _discriminator(tp) is None:
            tp = get_args(tp)[0]
        elif get_origin(tp) in (Union, types.UnionType) and len(_members(tp)) == 1:
            tp = _members(tp)[0]
        else:
            return tp


def _discriminator(tp: Any) -> str | None:
    """The discriminator key of an `Annotated[Union[...], Field(discriminator=...)]`, else None."""
    if get_origin(tp) is not Annotated or get_origin(get_args(tp)[0]) not in (Union, types.UnionType):
        return None
    metadata = get_args(tp)[1:]
    return next((m.discriminator for m in metadata if isinstance(getattr(m, "discriminator", None), str)), None)


def discriminated(tp: Any) -> tuple[str, dict[str, type[BaseModel]]] | None:
    """(discriminator field, tag -> member model) of a discriminated union annotation (also when optional)."""
    tp = bare(tp)
    key = _discriminator(tp)
    if key is None:
        return None
    members: dict[str, type[BaseModel]] = {}
    for member in map(model_of, get_args(get_args(tp)[0])):
        field_info = member.model_fields.get(key) if member is not None else None
        if member is not None and field_info is not None and get_origin(field_info.annotation) is Literal:
            members.update({str(tag): member for tag in get_args(field_info.annotation)})
    return key, members


def _resolve(tp: Any, raw: Any) -> Any:
    """The member of a discriminated union that `raw` names (`tp` itself otherwise)."""
    union = discriminated(tp)
    if union is None or not isinstance(raw, dict):
        return tp
    return union[1].get(str(raw.get(union[0])), tp)


def _plain_union(tp: Any) -> bool:
    """A union of several types without a discriminator (`int | Literal['auto']`): pydantic tags each member's
    errors with the member's name (`'constrained-int'`, `"literal['auto']"`), which is not a key of the file."""
    tp = bare(tp)
    return get_origin(tp) in (Union, types.UnionType) and len(_members(tp)) > 1 and discriminated(tp) is None


def _member_for(tp: Any, raw: Any) -> Any:
    """The member of a plain union that holds `raw`'s children (its list or mapping member), if any."""
    for member in _members(bare(tp)):
        origin = get_origin(bare(member))
        if isinstance(raw, list) and origin is list:
            return member
        if isinstance(raw, dict) and (origin is dict or model_of(member) is not None):
            return member
    return None


def _item_type(tp: Any) -> Any:
    """The value type of a list or dict annotation (through `Annotated` / `Optional`), or None."""
    tp = bare(tp)
    return get_args(tp)[-1] if get_origin(tp) in (list, dict) else None


def _child_data(raw: Any, el: str | int) -> Any:
    if isinstance(raw, dict):
        return raw.get(el)
    if isinstance(raw, list) and isinstance(el, int) and el < len(raw):
        return raw[el]
    return None


def _field_of(model: type[BaseModel], name: str, raw: Any) -> Any:
    """The type of field `name`; a model's `field_model` hook may name it from the raw data."""
    hook = getattr(model, "field_model", None)
    if hook is not None:
        try:
            dynamic = hook(name, raw)
        except Exception:
            return None
        if dynamic is not None:
            return dynamic
    return field_type(model, name)


@dataclass(frozen=True)
class _Step:
    """One element of a pydantic error location: whether it is a union tag (not in the file), and the type
    and data of the value it leads to (`tp` None when unknown)."""

    el: str | int
    tag: Literal["", "member", "plain"]  # "member": a discriminated union's; "plain": another union's
    tp: Any
    raw: Any


def _child_type(tp: Any, raw: Any, el: str | int) -> Any:
    """The annotation of the value at `el` under a value of type `tp` (data `raw`), or None."""
    if _plain_union(tp):
        tp = _member_for(tp, raw) or tp
    model = model_of(_resolve(tp, raw))
    if model is not None:
        return _field_of(model, str(el), raw) if el in model.model_fields else None
    return _item_type(tp)


def _tag_kind(tp: Any, raw: Any, el: str | int) -> Literal["", "member", "plain"]:
    """Whether `el`, under a value of type `tp` (data `raw`), is a union tag pydantic put in the location."""
    union = discriminated(tp)
    if union is not None and isinstance(raw, dict) and str(el) == str(raw.get(union[0])) and str(el) in union[1]:
        return "member"
    if _plain_union(tp) and isinstance(el, str) and not (isinstance(raw, dict) and el in raw):
        return "plain"
    return ""


def _tag_member(tp: Any, raw: Any, el: str | int) -> Any:
    """The union member that the tag `el` leads into (the whole union when it cannot be told)."""
    union = discriminated(tp)
    if union is not None:
        return union[1][str(el)]
    return _member_for(tp, raw) or bare(tp)


def walk(root: type[BaseModel], loc: Loc, data: Any, *, tagged: bool = True) -> list[_Step]:
    """`loc` element by element, with what validates each value and which elements are union tags (only in a
    location as pydantic gives it, `tagged`; a path of the file's own keys has none).

    The one walk behind every lookup below: errors under an optional discriminated union, a plain union, a
    list item, a dict value or a binding's settings all find their type and their key in the file the same way."""
    steps: list[_Step] = []
    tp: Any = root
    raw = data
    for el in loc:
        if el == "[key]":
            steps.append(_Step(el, "", tp, raw))
            continue
        tag = _tag_kind(tp, raw, el) if tagged and tp is not None else ""
        if tag:
            tp = _tag_member(tp, raw, el)
        else:
            tp = _child_type(tp, raw, el) if tp is not None else None
            raw = _child_data(raw, el)
        steps.append(_Step(el, tag, tp, raw))
    return steps


def _model_at(root: type[BaseModel], loc: Loc, data: Any) -> type[BaseModel] | None:
    """The model that validates the mapping at `loc` (a tag-free path: to list its allowed keys), if known."""
    steps = walk(root, loc, data, tagged=False)
    tp, raw = (steps[-1].tp, steps[-1].raw) if steps else (root, data)
    return model_of(_resolve(tp, raw)) if tp is not None else None


def _type_at(root: type[BaseModel], loc: Loc, data: Any) -> Any:
    """The annotation that validates the value at `loc` (a tag-free path), or None."""
    steps = walk(root, loc, data, tagged=False)
    return steps[-1].tp if steps else root


def _without_tags(root: type[BaseModel], loc: Loc, data: Any) -> tuple[Loc, bool]:
    """`loc` without the union tags pydantic adds (they are not keys of the file: 'slurm' in ('meshes', 'gpu',
    'slurm', 'hosts') is the member, not the mesh's `slurm` options), and whether a plain union's tag was dropped
    (then each member's error is one alternative of the value's single error)."""
    steps = walk(root, loc, data)
    return tuple(s.el for s in steps if not s.tag), any(s.tag == "plain" for s in steps)


# ---------------------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------------------


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _echoable_choice(kind: str, value: Any) -> bool:
    """A short string given for a closed set (a typo like 'kubernetes' for a backend) is safe and useful to echo."""
    return kind in ("literal_error", "enum") and isinstance(value, str) and len(value) <= 24


def _unknown_key(loc: Loc, root: type[BaseModel], data: Any) -> str:
    model = _model_at(root, loc[:-1], data)
    if model is None:
        return f"unknown key {str(loc[-1])!r}"
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {str(loc[-1])!r}{hint}; allowed keys: {', '.join(model.model_fields)}"


def _missing_key(loc: Loc, root: type[BaseModel], data: Any) -> str:
    model = _model_at(root, loc[:-1], data)
    field_info = model.model_fields.get(str(loc[-1])) if model is not None else None
    if field_info is not None and get_origin(field_info.annotation) is Literal:
        choices = ", ".join(repr(a) for a in get_args(field_info.annotation))
        return f"required key is missing (one of {choices})"
    return "required key is missing"


def _given(value: Any) -> str:
    """What the file gave, for a message: numbers, booleans and null as written, anything else by its kind (a
    string is not echoed: a pasted secret must never appear in an error; the line and column point at it)."""
    if isinstance(value, (int, float, bool)) or value is None:
        return _short(value)
    kinds = {str: "a string", list: "a list", dict: "a mapping"}
    return next((name for kind, name in kinds.items() if isinstance(value, kind)), f"a {type(value).__name__}")


def _explain(err: dict[str, Any], root: type[BaseModel], data: Any) -> tuple[str, str | None]:
    """What is wrong and what is allowed, and what was given (None: not to be shown) for one pydantic error."""
    kind, msg, loc = err["type"], err["msg"], tuple(err["loc"])
    if kind == "extra_forbidden":
        return _unknown_key(loc, root, data), None
    if kind == "missing":
        return _missing_key(loc, root, data), None
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix) :], None
    value = err.get("input")
    return msg, _short(value) if _echoable_choice(kind, value) else _given(value)


def describe(err: dict[str, Any], root: type[BaseModel], data: Any) -> str:
    """A message for one pydantic error that says what is wrong, what is allowed and what was given."""
    message, given = _explain(err, root, data)
    return message if given is None else f"{message} (got {given})"


def _tag_issue(err: dict[str, Any], root: type[BaseModel], data: Any) -> tuple[Loc, str] | None:
    """A discriminated union's missing or unknown tag, as an error at its key naming the allowed values."""
    if err["type"] not in ("union_tag_invalid", "union_tag_not_found"):
        return None
    loc = tuple(err["loc"])
    union = discriminated(_type_at(root, loc, data))
    if union is None:
        return None
    key, tags = union[0], [repr(tag) for tag in union[1]]
    if err["type"] == "union_tag_not_found":
        return (*loc, key), f"required key is missing (one of {', '.join(tags)})"
    choices = " or ".join([", ".join(tags[:-1]), tags[-1]] if len(tags) > 1 else tags)
    got = err.get("ctx", {}).get("tag")
    shown = f" (got {_short(got)})" if _echoable_choice("literal_error", got) else ""
    return (*loc, key), f"Input should be {choices}{shown}"


def _field_loc(err: dict[str, Any]) -> Loc:
    """The error's location, down to the field a validator named with `FieldError` (a check across fields)."""
    error = (err.get("ctx") or {}).get("error")
    return (*err["loc"], *error.loc) if isinstance(error, FieldError) else tuple(err["loc"])


def _one_of(alternatives: list[tuple[str, str | None]]) -> str:
    """One message for the errors of every member of a plain union (`int >= 0 | 'auto'`): the value is wrong
    once, and any member would have done."""
    messages = list(dict.fromkeys(m for m, _ in alternatives))
    given = next((g for _, g in alternatives if g is not None), None)
    text = messages[0] + "".join(", or " + m.removeprefix("Input should be ") for m in messages[1:])
    return text if given is None else f"{text} (got {given})"


def issues_from(e: ValidationError, doc: YamlDoc, root: type[BaseModel]) -> list[TopologyIssue]:
    """One located issue per pydantic error of validating `doc.data` with `root` (the errors of a plain union's
    members: one issue for the value)."""
    out: list[TopologyIssue] = []
    unions: dict[Loc, list[tuple[str, str | None]]] = {}
    for err in e.errors(include_url=False):
        loc, plain = _without_tags(root, _field_loc(err), doc.data)
        err = {**err, "loc": loc}
        tagged = _tag_issue(err, root, doc.data)
        if tagged is not None:
            out.append(doc.issue(tagged[0], tagged[1]))
        elif plain:
            unions.setdefault(loc, []).append(_explain(err, root, doc.data))
        else:
            out.append(doc.issue(loc, describe(err, root, doc.data), key=err["type"] == "extra_forbidden"))
    out.extend(doc.issue(loc, _one_of(alternatives)) for loc, alternatives in unions.items())
    return out


# ---------------------------------------------------------------------------------------------------------
# Parsing and validating
# ---------------------------------------------------------------------------------------------------------


def fail(issues: list[TopologyIssue], source: str | None) -> NoReturn:
    """Raise the issues (deduplicated, sorted by position) as one TopologyError."""
    unique = list(dict.fromkeys(issues))
    unique.sort(key=lambda i: (i.line is None, i.line or 0, i.column or 0))
    raise TopologyError(unique, source)


def finish(issues: list[TopologyIssue], source: str | None) -> None:
    """Raise a TopologyError if there are issues; return otherwise."""
    if issues:
        fail(issues, source)


def parse_document(text: str, source: str | None) -> YamlDoc:
    """The parsed document; a TopologyError when there is nothing to validate (empty file, syntax error)."""
    doc = YamlDoc(text)
    if doc.root is None and not doc.issues:
        doc.issues.append(TopologyIssue("", 1, 1, "the file is empty"))
    if doc.root is None or (doc.issues and doc.data is None):
        fail(doc.issues, source)
    return doc


def validate_into(doc: YamlDoc, model: type[M]) -> M | None:
    """`model` validated from the document's data, or None with the problems added to `doc.issues`."""
    try:
        return model.model_validate(doc.data)
    except ValidationError as e:
        doc.issues.extend(issues_from(e, doc, model))
    except Exception as e:  # a component validator that raised something other than ValueError
        doc.issues.append(TopologyIssue("", None, None, f"validation failed: {type(e).__name__}: {e}"))
    return None


def parse_yaml_model(text: str, model: type[M], source: str | None = None) -> M:
    """Validate YAML text with a pydantic model; errors carry field paths and line/column positions."""
    doc = parse_document(text, source)
    result = validate_into(doc, model)
    finish(doc.issues, source)
    assert result is not None
    return result


# What YAML does not accept in a file (yaml.reader.Reader.NON_PRINTABLE): C0 controls but tab, LF and CR,
# DEL, C1 controls but NEL, surrogates, U+FFFE and U+FFFF.
_UNPRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _line_column(text: str, index: int) -> tuple[int, int]:
    """1-based line and column (in characters) of `text[index]`."""
    line_start = text.rfind("\n", 0, index) + 1
    return text.count("\n", 0, index) + 1, index - line_start + 1


def first_unprintable(text: str) -> TopologyIssue | None:
    """An issue at the first character YAML refuses (a NUL byte, another control character), if any."""
    found = _UNPRINTABLE.search(text)
    if found is None:
        return None
    index = found.start()
    char = text[index]
    line, column = _line_column(text, index)
    if char == "\0":
        name = "a NUL byte"
    elif ord(char) < 0xA0:
        name = f"control character U+{ord(char):04X}"
    else:
        name = f"character U+{ord(char):04X}"
    offset = len(text[:index].encode("utf-8", "surrogatepass"))
    return TopologyIssue("", line, column, f"{name} at byte offset {offset}: not allowed in a YAML file")


def decode_utf8(data: bytes) -> str | TopologyIssue:
    """The text of a file's bytes, or an issue at the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        prefix = data[: e.start].decode("utf-8")  # valid up to the bad byte
        line, column = _line_column(prefix, len(prefix))
        return TopologyIssue(
            "",
            line,
            column,
            f"not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset {e.start} ({e.reason}); "
            "save the file as UTF-8",
        )


def read_text(path: str | os.PathLike[str]) -> str:
    """The file's text; a file that cannot be read or is not UTF-8 is a TopologyError naming it."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TopologyError(
            [TopologyIssue("", None, None, f"cannot read file: {e.strerror or e}")], str(path)
        ) from None
    text = decode_utf8(data)
    if isinstance(text, TopologyIssue):
        raise TopologyError([text], str(path))
    bad = first_unprintable(text)  # before newlines are translated, so that its byte offset is the file's
    if bad is not None:
        raise TopologyError([bad], str(path))
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as open() reads text


def load_yaml_model(path: str | os.PathLike[str], model: type[M]) -> M:
    """`parse_yaml_model` on a file; an unreadable file is a TopologyError too."""
    return parse_yaml_model(read_text(path), model, str(path))
