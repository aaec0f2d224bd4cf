"""Chat templates: found where the engine's tokenizer is, rendered in jinja2's sandbox.

Where a model's template comes from, first found wins (:func:`load_chat_template`):

1. ``--chat-template FILE`` (the template text itself), for every model of the engine;
2. the tokenizer the engine advertises (the card's ``tokenizer.source``, else the model id),
   when it names a local directory: its ``chat_template.jinja``, else the ``chat_template``
   of its ``tokenizer_config.json`` (a string, or named templates: ``default``);
3. the same files in the local Hugging Face cache when the source is a hub id
   (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``; nothing is downloaded).

The special tokens the template may print (``bos_token``, ``eos_token``, …) come from
``tokenizer_config.json`` beside it. A model without a template cannot chat: the front answers
400 naming ``--chat-template``.

Rendering is Hugging Face's (what ``transformers`` and vLLM do): jinja2's
``ImmutableSandboxedEnvironment`` — no attribute of Python objects outside the sandbox's
allowance, no mutation of what is passed in, ``range`` bounded — with ``trim_blocks`` and
``lstrip_blocks``, loop controls, the ``tojson`` filter, ``raise_exception`` and
``strftime_now``, and ``{% generation %}`` blocks rendered as their content. A template error
(a ``raise_exception`` of the template, an undefined operation) is the client's 400.

Files are read at most :data:`MAX_FILE_BYTES` each. Loading does blocking file I/O: call it
in a worker thread (``routes`` does, once at start).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sidecar.json_types import JSONObject

__all__ = [
    "MAX_FILE_BYTES",
    "ChatTemplate",
    "TemplateRenderError",
    "find_template_files",
    "load_chat_template",
    "template_from_text",
]

log = logging.getLogger(__name__)

#: Largest template or ``tokenizer_config.json`` read.
MAX_FILE_BYTES = 8 * 1024 * 1024
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateRenderError(ValueError):
    """The template could not render these messages (the client's request, or the template)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (Hugging Face's assistant-mask marker): the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, **kw: object) -> str:
    """The ``tojson`` filter (Hugging Face's: not HTML-escaped). A bad argument is a
    ``TypeError`` (the render's error, as ``json.dumps`` raises)."""
    given = kw.get("separators")
    separators: tuple[str, str] | None = None
    if given is not None:
        if (
            not isinstance(given, tuple | list)
            or len(given) != 2
            or not all(isinstance(x, str) for x in given)
        ):
            raise TypeError("tojson separators must be two strings")
        separators = (given[0], given[1])
    sort_keys = bool(kw.get("sort_keys", False))
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass
class ChatTemplate:
    """A compiled template, the special tokens it may print, and how it wants content."""

    text: str
    origin: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    #: The tokenizer adds the BOS token itself (``add_bos_token``): a rendered prompt that
    #: starts with it loses that one (the engine tokenizes the text, adding its own).
    adds_bos: bool = False
    _compiled: jinja2.Template | None = field(default=None, repr=False)
    _content_loops: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self._compiled = _environment().from_string(self.text)
        self._content_loops = self._find_content_loops()

    @property
    def takes_content_parts(self) -> bool:
        """Whether the template walks a message's content as a list of parts (OpenAI's form:
        a ``for`` loop over ``….content`` or ``content``); otherwise text parts are joined into
        one string. vLLM decides the same way (its detection follows variables further)."""
        return self._content_loops

    def _find_content_loops(self) -> bool:
        def is_content(node: jinja2.nodes.Node) -> bool:
            while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
                node = node.node
            if isinstance(node, jinja2.nodes.Getitem):
                return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
            if isinstance(node, jinja2.nodes.Getattr):
                return node.attr == "content"
            return isinstance(node, jinja2.nodes.Name) and node.name == "content"

        tree = _environment().parse(self.text)
        return any(is_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, object] | None = None,
    ) -> str:
        """The prompt text; :class:`TemplateRenderError` when the template fails on them."""
        assert self._compiled is not None
        variables: dict[str, object] = dict(extra or {})
        variables.update(self.special_tokens)
        variables["messages"] = messages
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            text = self._compiled.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise TemplateRenderError(f"the chat template failed: {err}") from None
        bos = self.special_tokens.get("bos_token")
        if self.adds_bos and bos and text.startswith(bos):
            text = text[len(bos) :]
        return text


def _read(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_FILE_BYTES:
        log.warning("%s is larger than %d bytes: not read", path, MAX_FILE_BYTES)
        return None
    return data.decode("utf-8", "replace")


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of hub model ``org/name`` (its ``refs/main``, else the newest)."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".")):
        return None
    roots = [os.environ.get("HF_HUB_CACHE"), None, str(Path.home() / ".cache" / "huggingface" / "hub")]
    if os.environ.get("HF_HOME"):
        roots[1] = str(Path(os.environ["HF_HOME"]) / "hub")
    for root in filter(None, roots):
        repo = Path(root) / ("models--" + repo_id.replace("/", "--"))
        ref = _read(repo / "refs" / "main")
        if ref and (repo / "snapshots" / ref.strip()).is_dir():
            return repo / "snapshots" / ref.strip()
        snapshots = (
            sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) if repo.is_dir() else []
        )
        if snapshots:
            return snapshots[-1]
    return None


def find_template_files(source: str) -> Path | None:
    """The directory holding ``source``'s tokenizer files (local, or a hub id's cached snapshot)."""
    if not source:
        return None
    path = Path(source)
    if path.is_dir():
        return path
    return _hub_snapshot(source)


def _special_tokens(config: Mapping[str, object]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in _SPECIAL:
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _config_template(config: Mapping[str, object]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def template_from_text(
    text: str, origin: str, special_tokens: Mapping[str, str] | None = None, *, adds_bos: bool = False
) -> ChatTemplate:
    """A :class:`ChatTemplate` of ``text``; ``jinja2.TemplateSyntaxError`` when it does not compile."""
    return ChatTemplate(text, origin, dict(special_tokens or {}), adds_bos)


def load_chat_template(source: str, override: str | None = None) -> ChatTemplate | None:
    """The template of the tokenizer at ``source`` (module doc), ``override`` (a file) first;
    ``None`` when there is none. A file that does not compile is logged and skipped."""
    directory = find_template_files(source)
    config: JSONObject = {}
    if directory is not None:
        text = _read(directory / "tokenizer_config.json")
        try:
            loaded = json.loads(text) if text else {}
        except ValueError:
            loaded = {}
        config = loaded if isinstance(loaded, dict) else {}
    candidates: list[tuple[str | None, str]] = []
    if override is not None:
        candidates.append((_read(Path(override)), override))
    if directory is not None:
        candidates.append((_read(directory / "chat_template.jinja"), str(directory / "chat_template.jinja")))
        candidates.append((_config_template(config), str(directory / "tokenizer_config.json")))
    for text, origin in candidates:
        if not text:
            continue
        try:
            return template_from_text(
                text, origin, _special_tokens(config), adds_bos=config.get("add_bos_token") is True
            )
        except jinja2.TemplateSyntaxError as err:
            log.warning("chat template %s does not compile (%s): not used", origin, err)
    return None
