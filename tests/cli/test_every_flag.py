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
