"""The request bodies of the OpenAI front, decoded strictly (types checked by msgspec).

What a client controls is bounded: the body itself (``--max-message-size``, read by
``routes``), and here the counts inside it (:data:`MAX_STOPS` stop strings, :data:`MAX_MESSAGES`
messages, :data:`MAX_PARTS` content parts per message, :data:`MAX_PROMPT_IDS` prompt token
ids). Values are checked further by ``request_map`` and admission. Fields OpenAI clients send
that change nothing here (``user``, ``metadata``, ``store``, ``service_tier``, …) are
accepted and ignored; unknown fields are ignored as OpenAI's own API does.

:func:`decode_completion` and :func:`decode_chat` raise :class:`BadRequest` with msgspec's
message (it names the field: ``Expected `float`, got `str` - at `$.temperature```).
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

__all__ = [
    "MAX_MESSAGES",
    "MAX_PARTS",
    "MAX_PROMPT_IDS",
    "MAX_STOPS",
    "BadRequest",
    "ChatRequest",
    "CompletionRequest",
    "GenerationFields",
    "ResponseFormat",
    "StreamOptions",
    "decode_chat",
    "decode_completion",
]

#: Most stop strings (OpenAI allows 4; vLLM more).
MAX_STOPS = 64
#: Most messages in one chat request, and content parts in one message.
MAX_MESSAGES = 4096
MAX_PARTS = 1024
#: Most token ids in a prompt given as ids.
MAX_PROMPT_IDS = 1 << 20

_Request = TypeVar("_Request", bound="GenerationFields")


class BadRequest(ValueError):
    """A body that is not a valid request; ``param`` names the field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    name: str = ""
    schema: dict[str, object] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` extension: one guide."""

    json: dict[str, object] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, object] | str | None = None


class GenerationFields(msgspec.Struct, kw_only=True):
    """What both endpoints take: the model, sampling, stopping, streaming and guides
    (OpenAI's fields, then vLLM's extensions of the same meaning)."""

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    best_of: int | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, object] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    prompt_logprobs: int | None = None
    request_id: str | None = None


class CompletionRequest(GenerationFields, kw_only=True):
    """``POST /v1/completions``: one prompt (text, or token ids)."""

    #: Text, token ids, or a list of either (one element: ``request_map`` takes one prompt).
    prompt: str | list[object]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatRequest(GenerationFields, kw_only=True):
    """``POST /v1/chat/completions``. Messages stay plain objects (the chat template reads them
    as they are); ``request_map`` checks their shape."""

    messages: list[dict[str, object]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: object = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, object] | None = None
    # vLLM's name of the same switch as continue_final_message's opposite: echo the last message
    echo: bool = False


_completion = msgspec.json.Decoder(CompletionRequest)
_chat = msgspec.json.Decoder(ChatRequest)


def _param(message: str) -> str | None:
    """The field msgspec names (``... - at `$.messages[0]` `` → ``messages``)."""
    _, sep, where = message.rpartition(" - at `$.")
    if not sep:
        return None
    return where.rstrip("`").split("[", 1)[0].split(".", 1)[0] or None


def _decode(decoder: msgspec.json.Decoder[_Request], body: bytes) -> _Request:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as err:
        raise BadRequest(str(err), _param(str(err))) from None
    except msgspec.DecodeError as err:
        raise BadRequest(f"the body is not valid JSON: {err}") from None


def _check_stops(req: GenerationFields) -> None:
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOPS:
        raise BadRequest(f"at most {MAX_STOPS} stop strings", "stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOPS:
        raise BadRequest(f"at most {MAX_STOPS} stop token ids", "stop_token_ids")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def decode_completion(body: bytes) -> CompletionRequest:
    """A Completions body; :class:`BadRequest` for anything malformed."""
    req = _decode(_completion, body)
    _check_stops(req)
    prompt = req.prompt
    if isinstance(prompt, list):
        if all(_is_id(t) for t in prompt):
            longest = len(prompt)
        elif all(isinstance(p, str) for p in prompt):
            longest = 0
        elif all(isinstance(p, list) and all(_is_id(t) for t in p) for p in prompt):
            longest = max((len(p) for p in prompt if isinstance(p, list)), default=0)
        else:
            raise BadRequest("prompt must be a string, token ids, or a list of either", "prompt")
        if longest > MAX_PROMPT_IDS:
            raise BadRequest(f"a prompt has more than {MAX_PROMPT_IDS} token ids", "prompt")
    return req


def decode_chat(body: bytes) -> ChatRequest:
    """A Chat Completions body; :class:`BadRequest` for anything malformed."""
    req = _decode(_chat, body)
    _check_stops(req)
    if not req.messages:
        raise BadRequest("messages must not be empty", "messages")
    if len(req.messages) > MAX_MESSAGES:
        raise BadRequest(f"at most {MAX_MESSAGES} messages", "messages")
    for i, message in enumerate(req.messages):
        content = message.get("content")
        if isinstance(content, list) and len(content) > MAX_PARTS:
            raise BadRequest(f"messages[{i}]: at most {MAX_PARTS} content parts", "messages")
    return req
