"""Every flag of every subcommand is checked by its click type or callback at parse time
(issue 21: "every flag validated at parse time ... the CLI library's own types and callbacks").

For each option a value it must refuse is derived from its type (a number below the range, a
port above 65535, a scheme no address takes, a file in a missing directory, a word no choice
has); the option itself must raise :class:`click.BadParameter` for it — no command runs. The
options whose values are free-form text (names, ids, patterns, prompts, command words) are
listed with what makes any text acceptable. ``test_usage.py`` runs a sample as real processes
(one line, exit 2).
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from sidecar.cli import main
from sidecar.cli_options import EngineAddressType, HostName, ListenAddressType, NewFile

#: (subcommand, flag) whose value is free text, and why any text is acceptable there.
FREE_TEXT = {
    ("*", "--model"): "a model name the engine resolves (not vllm-engine's: a directory)",
    ("mock-engine", "--alias"): "extra served names",
    ("mock-engine", "--tokenizer-source"): "a tokenizer name reported in the card",
    ("mock-engine", "--instance-id"): "an opaque id",
    ("vllm-engine", "--served-model-name"): "served names",
    ("vllm-engine", "--dtype"): "vLLM's own dtype names (vLLM checks them; refused as one line)",
    ("vllm-engine", "--instance-id"): "an opaque id",
    ("vllm-engine", "--kv-topic"): "a ZMQ topic prefix (any bytes)",
    ("sglang-engine", "--served-model-name"): "served names",
    ("sglang-engine", "--dtype"): "SGLang's own dtype names (SGLang checks them)",
    ("sglang-engine", "--instance-id"): "an opaque id",
    ("sglang-engine", "--kv-topic"): "a ZMQ topic prefix (any bytes)",
    ("run", "--kv-topic"): "a ZMQ topic prefix (any bytes)",
    ("*", "--expected-engine"): "an engine name compared with the card's",
    ("conformance", "--only"): "a glob or group (one matching nothing is refused before the suite)",
    ("conformance", "--skip"): "a glob or group",
    ("bench", "--sidecar-command"): "shell words; empty means 'python -m sidecar'",
    ("run", "--dynamo-namespace"): "Dynamo's own names",
    ("run", "--dynamo-component"): "Dynamo's own names",
    ("run", "--dynamo-endpoint"): "Dynamo's own names",
}

#: Checked before anything starts, but in the command body: they depend on another flag.
CROSS_FLAG = {
    ("mock-engine", "--fault"): "a fault's validity depends on --role (test_usage.py runs it)",
    ("run", "--kv-publish"): "checked with --kv-replay as one endpoint pair (test_usage.py runs it)",
    ("run", "--kv-replay"): "checked with --kv-publish as one endpoint pair (test_usage.py runs it)",
    ("vllm-engine", "--model"): "a directory holding config.json (test_usage.py runs it)",
    ("sglang-engine", "--model"): "a directory holding config.json (tests/engines run it)",
}

#: Options whose bad value needs more than the type: (subcommand, flag) -> bad value.
SPECIAL = {
    ("run", "--expected-schema-release"): "main",
    ("describe", "--expected-schema-release"): "main",
    ("run", "--handoff-profile"): "not a profile",
    ("describe", "--handoff-profile"): "not a profile",
    ("run", "--lora-root"): "relative/dir",
    ("conformance", "--lora-path"): "relative/dir",
    ("bench", "--scenarios"): "nope",
    ("bench", "--scale-points"): "1,x",
    ("mock-engine", "--seed"): "x",
    ("vllm-engine", "--seed"): "x",
    ("vllm-engine", "--listen"): "ftp://x",
    ("vllm-engine", "--ready-file"): "/nonexistent-dir/ready.json",
    ("vllm-engine", "--block-size"): "48",
    ("sglang-engine", "--seed"): "x",
    ("sglang-engine", "--listen"): "ftp://x",
    ("sglang-engine", "--ready-file"): "/nonexistent-dir/ready.json",
    ("run", "--dynamo-model-path"): "/nonexistent-dir/model",
    ("run", "--otlp-endpoint"): "ftp://x",
    ("run", "--tls-cert"): "/nonexistent.pem",
    ("run", "--tls-key"): "/nonexistent.pem",
    ("bench", "--out"): f"{__file__}/under-a-file/out.json",
    ("bench", "--profile"): f"{__file__}/under-a-file",
}


def _bad_value(command: str, option: click.Option) -> str | None:
    """A value ``option`` must refuse, from its type (None: not derivable)."""
    flag = option.opts[-1] if option.opts[-1].startswith("--") else option.opts[0]
    special = SPECIAL.get((command, flag))
    if special is not None:
        return special
    t = option.type
    if isinstance(t, click.IntRange | click.FloatRange):
        if t.min is not None:
            return str(t.min - 1)
        if t.max is not None:
            return str(t.max + 1)
    if isinstance(t, click.Choice):
        return "no-such-choice"
    if isinstance(t, ListenAddressType):
        return "127.0.0.1:99999"
    if isinstance(t, EngineAddressType):
        return "ftp://x"
    if isinstance(t, HostName):
        return "two words"
    if isinstance(t, NewFile):
        return "/nonexistent-dir/file"
    if isinstance(t, click.Path) and t.exists:
        return "/nonexistent-dir/file"
    if type(t).__name__ == "SidecarUrl":
        return "ftp://x"
    if isinstance(t, click.types.IntParamType | click.types.FloatParamType):
        return "x"
    return None


def _options() -> list[tuple[str, click.Option]]:
    ctx = click.Context(main)
    out = []
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None
        for param in command.params:
            visible = isinstance(param, click.Option) and not param.hidden and not param.is_flag
            if visible and param.name not in ("help", "config"):
                out.append((name, param))
    return out


OPTIONS = _options()


def _flag(option: click.Option) -> str:
    return next(o for o in option.opts if o.startswith("--"))


@pytest.mark.parametrize(("command", "option"), OPTIONS, ids=[f"{c} {_flag(o)}" for c, o in OPTIONS])
def test_every_flag_refuses_a_bad_value_at_parse_time(command: str, option: click.Option) -> None:
    flag = _flag(option)
    if (command, flag) in FREE_TEXT or (
        ("*", flag) in FREE_TEXT and command not in ("vllm-engine", "sglang-engine")
    ):
        assert option.type is click.STRING or isinstance(option.type, click.types.StringParamType), flag
        return
    if (command, flag) in CROSS_FLAG:
        return
    bad = _bad_value(command, option)
    assert bad is not None, f"{command} {flag}: no parse-time check (type {option.type!r})"
    cmd = main.get_command(click.Context(main), command)
    assert cmd is not None
    ctx = click.Context(cmd, info_name=command)
    value = (bad,) if option.multiple else bad
    with pytest.raises(click.BadParameter):
        option.process_value(ctx, value)


def test_the_sweep_sees_every_subcommand() -> None:
    assert {c for c, _ in OPTIONS} == {
        "run",
        "describe",
        "generate",
        "disagg",
        "conformance",
        "mock-engine",
        "bench",
        "vllm-engine",
        "sglang-engine",
    }
    assert Path(__file__).name in {p.name for p in Path(__file__).parent.iterdir()}


# -- the reference: every flag of every subcommand in docs/CLI.md ---------------------------------

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "CLI.md"
REFERENCE_DOCS = [Path(__file__).resolve().parents[2] / "README.md"] + [
    p for p in sorted(CLI_DOC.parent.rglob("*.md")) if "results" not in p.relative_to(CLI_DOC.parent).parts
]
#: Flags on their way out: not documented anywhere in the reference (they go to CHANGELOG.md as
#: removed). Delete the entry once the flag is gone from the code.
_FLAG = re.compile(r"--[a-z0-9]+(?:-[a-z0-9]+)*")


def _long_flags(param: click.Parameter) -> set[str]:
    return {o for o in [*param.opts, *param.secondary_opts] if o.startswith("--")}


def _doc_sections() -> list[tuple[list[str], set[str]]]:
    """docs/CLI.md's sections: the subcommands each heading names in backticks (``[]`` for
    "Every subcommand") and the flags its body names."""
    sections = []
    for section in re.split(r"^## ", CLI_DOC.read_text(), flags=re.M)[1:]:
        heading, _, body = section.partition("\n")
        names = [] if heading.startswith("Every subcommand") else re.findall(r"`([a-z-]+)`", heading)
        sections.append((names, set(_FLAG.findall(body))))
    return sections


def _command_flags(name: str, global_flags: set[str]) -> set[str]:
    command = main.get_command(click.Context(main), name)
    assert command is not None, name
    return (
        {f for p in command.params if isinstance(p, click.Option) and not p.hidden for f in _long_flags(p)}
        - global_flags
        - {"--help"}
    )


def test_every_flag_of_every_subcommand_is_in_docs_cli_md() -> None:
    sections = _doc_sections()
    global_flags = {f for p in main.params if not p.hidden for f in _long_flags(p)} - {"--help"}
    common = set().union(*(flags for names, flags in sections if not names))
    missing = sorted(f"(every subcommand) {f}" for f in global_flags - common)
    extra: list[str] = []
    for name in main.list_commands(click.Context(main)):
        documented = set().union(*(flags for names, flags in sections if name in names))
        missing += [f"{name} {f}" for f in sorted(_command_flags(name, global_flags) - documented)]
    for names, flags in sections:
        if names:
            real = set().union(*(_command_flags(n, global_flags) for n in names))
            extra += [f"{'/'.join(names)} {f}" for f in sorted(flags - real - global_flags)]
    assert missing == [], f"document these in docs/CLI.md, in their subcommand's section: {missing}"
    assert extra == [], f"docs/CLI.md names flags these subcommands do not have: {extra}"
