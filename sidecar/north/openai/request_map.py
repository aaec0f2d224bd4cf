"""An OpenAI request → the ``GenerateRequest`` and metadata admitted like any other stream.

=====================================================  ==========================================
OpenAI (and vLLM's extensions)                         OpenEngine
=====================================================  ==========================================
``model`` (served name, alias or loaded LoRA adapter)  ``model`` (admission resolves an adapter)
``prompt`` (text, or token ids) / ``messages``         ``prompt`` (chat: the rendered template) /
                                                       ``token_ids``
``temperature``, ``top_p``, ``top_k``, ``min_p``,      ``sampling`` (``n`` → ``num_sequences``)
penalties, ``seed``, ``n``
``max_tokens`` (Completions: 16 when absent),          ``stopping.max_tokens``
``max_completion_tokens`` (Chat, before ``max_tokens``)
``stop``, ``stop_token_ids``, ``min_tokens``,          ``stopping`` conditions and options
``ignore_eos``, ``include_stop_str_in_output``
``logprobs`` (Completions: a count; Chat: true with     ``response``: output logprobs, ``top_n``
``top_logprobs``)                                      candidates
``response_format`` json_schema / json_object,         ``guided`` (one guide; backend from
``structured_outputs``, ``guided_json|regex|choice|    ``guided_decoding_backend``)
grammar``
image / video / audio content parts (Chat)             ``media`` in prompt order (URL, data URI)
``X-Request-Id`` header (or ``request_id``)            ``request_id`` (else the sidecar makes one)
``traceparent`` / ``tracestate`` headers               request metadata
=====================================================  ==========================================

Refused here with a :class:`~sidecar.core.errors.Rejection` (400): several prompts in one
request, ``echo``, ``suffix``, ``prompt_logprobs``, a non-empty ``logit_bias``, ``best_of``
above ``n``, ``tools``, ``top_logprobs`` without ``logprobs``, two guides at once, media in a
Completions request or in a chat whose template has no place for it, and a chat for a model
without a template (naming ``--chat-template``). Whether the engine offers the rest —
logprobs, guides, ``n`` > 1, media, LoRA — is admission's check against the worker card.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sidecar.core.card import MultimodalCard, WorkerCard
from sidecar.core.errors import invalid_argument, model_not_found, unsupported
from sidecar.core.request_options import (
    guided_decoding,
    media_item,
    model_multimodal,
    response_options,
    sampling_params,
    source_uuid,
    stopping_options,
    trace_metadata,
)
from sidecar.north.openai.chat_templates import ChatTemplate, TemplateRenderError
from sidecar.north.openai.protocol import ChatRequest, CompletionRequest, GenerationFields
from sidecar.openengine import pb
from sidecar.quoting import quote

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "MappedRequest", "map_chat", "map_completion", "render_chat"]

#: OpenAI's (and vLLM's) ``max_tokens`` of a Completions request that gives none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: Content part type → (modality, its name, the part the template sees).
_MEDIA_PARTS = {
    "image_url": (pb.Modality.IMAGE, "image"),
    "video_url": (pb.Modality.VIDEO, "video"),
    "audio_url": (pb.Modality.AUDIO, "audio"),
    "input_audio": (pb.Modality.AUDIO, "audio"),
}
#: Finds the chat template of a served model name (``None``: it has none).
TemplateLookup = Callable[[str], ChatTemplate | None]


@dataclass
class MappedRequest:
    """What to admit, and what the response needs."""

    request: pb.GenerateRequest
    metadata: dict[str, str]
    #: The ``model`` the response names (the request's, else the served name).
    model: str
    n: int
    #: Output logprobs asked for (their candidates: ``request.response``).
    logprobs: bool
    stream: bool
    include_usage: bool


def _visible_ascii(value: str) -> bool:
    return all(0x21 <= ord(c) <= 0x7E for c in value)


def _request_id(headers: Mapping[str, str], body_id: str | None) -> str:
    rid = headers.get("x-request-id") or body_id or ""
    if rid and not _visible_ascii(rid):
        invalid_argument("X-Request-Id must be visible ASCII characters")
    return rid


def _one_guide(req: GenerationFields) -> pb.GuidedDecoding | None:
    guides: list[dict[str, object]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        guides.append({"json_object": True})
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None or spec.schema is None:
            invalid_argument("response_format json_schema needs json_schema.schema")
        guides.append({"json": spec.schema})
    so = req.structured_outputs
    if so is not None:
        one: dict[str, object] = {
            k: v for k, v in (("json", so.json), ("regex", so.regex), ("choice", so.choice)) if v is not None
        }
        one.update({k: v for k, v in (("grammar", so.grammar), ("structural_tag", so.structural_tag)) if v})
        if so.json_object:
            one["json_object"] = True
        guides += [{k: v} for k, v in one.items()]
    for key, value in (
        ("json", req.guided_json),
        ("regex", req.guided_regex),
        ("choice", req.guided_choice),
        ("grammar", req.guided_grammar),
    ):
        if value is not None:
            guides.append({key: value})
    if len(guides) > 1:
        invalid_argument("give one guide: response_format, structured_outputs or one guided_* field")
    if not guides:
        return None
    return guided_decoding({**guides[0], "backend": req.guided_decoding_backend or ""})


def _refuse_unsupported(req: GenerationFields) -> None:
    if req.logit_bias:
        unsupported("logit_bias is not supported by this front")
    if req.best_of is not None and req.best_of > (req.n or 1):
        unsupported("best_of above n is not supported by this front")
    if req.prompt_logprobs is not None:
        unsupported("prompt_logprobs is not supported by this front")


def _request(
    req: GenerationFields,
    card: WorkerCard,
    headers: Mapping[str, str],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    media: list[pb.MediaItem],
) -> MappedRequest:
    _refuse_unsupported(req)
    if req.n is not None and req.n < 1:
        invalid_argument("n must be at least 1")
    if max_tokens is not None and max_tokens < 1:
        invalid_argument("max_tokens must be at least 1")
    sampling = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "n": req.n,
    }
    stop = {
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
    }
    request = pb.GenerateRequest(
        request_id=_request_id(headers, req.request_id),
        model=req.model,
        sampling=sampling_params(sampling),
        stopping=stopping_options(stop, include_stop=req.include_stop_str_in_output),
        response=response_options(logprobs),
        guided=_one_guide(req),
        media=media,
    )
    model = req.model or (card.models[0].served_model_name if len(card.models) == 1 else "")
    opts = req.stream_options
    return MappedRequest(
        request=request,
        metadata=trace_metadata(headers),
        model=model,
        n=req.n or 1,
        logprobs=logprobs is not None,
        stream=req.stream,
        include_usage=bool(req.stream and opts is not None and opts.include_usage),
    )


def _one_prompt(prompt: object) -> str | list[int]:
    """The prompt of a Completions request: text or token ids, alone or as a list of one
    (``decode_completion`` checked that a list holds token ids, texts, or lists of ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            invalid_argument("one prompt per request (send several requests)")
        prompt = prompt[0]
    if not isinstance(prompt, str | list):
        invalid_argument("prompt must be a string or token ids")
    if not prompt:
        invalid_argument("prompt must not be empty")
    return prompt


def map_completion(req: CompletionRequest, card: WorkerCard, headers: Mapping[str, str]) -> MappedRequest:
    """A Completions request (module doc); raises :class:`~sidecar.core.errors.Rejection`."""
    if req.echo:
        unsupported("echo is not supported by this front")
    if req.suffix:
        unsupported("suffix is not supported by this front")
    prompt = _one_prompt(req.prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    mapped = _request(req, card, headers, max_tokens=max_tokens, logprobs=req.logprobs, media=[])
    if isinstance(prompt, str):
        mapped.request.prompt = prompt
    else:
        mapped.request.token_ids = pb.TokenIds(ids=list(prompt))
    return mapped


def _media(part: Mapping[str, object], kind: str, mm: MultimodalCard | None, index: int) -> pb.MediaItem:
    modality, name = _MEDIA_PARTS[kind]
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, Mapping) or not isinstance(audio.get("data"), str):
            invalid_argument(f"messages[{index}]: input_audio needs data (base64) and format")
        fmt = audio.get("format") or "wav"
        url = f"data:audio/{fmt};base64,{audio['data']}"
    else:
        ref = part.get(kind)
        found = ref.get("url") if isinstance(ref, Mapping) else ref
        if not isinstance(found, str) or not found:
            invalid_argument(f"messages[{index}]: {kind} needs a url")
        url = found
    return media_item(modality, name, url, source_uuid(url), mm)


def _conversation(
    messages: list[dict[str, object]], template: ChatTemplate, mm: MultimodalCard | None
) -> tuple[list[dict[str, object]], list[pb.MediaItem]]:
    """The messages as the template reads them (OpenAI's content parts, or their text joined),
    and the media items in prompt order."""
    parts_form = template.takes_content_parts
    out: list[dict[str, object]] = []
    media: list[pb.MediaItem] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            invalid_argument(f"messages[{i}].role must be a non-empty string")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif content is None:
            content = []
        elif not isinstance(content, list):
            invalid_argument(f"messages[{i}].content must be a string or a list of parts")
        parts: list[dict[str, str]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif isinstance(kind, str) and kind in _MEDIA_PARTS:
                media.append(_media(part, kind, mm, i))
                parts.append({"type": _MEDIA_PARTS[kind][1]})
            else:
                invalid_argument(f"messages[{i}]: content part type {quote(str(kind))} is not supported")
        entry = dict(message)
        if parts_form:
            entry["content"] = parts
        elif any(p["type"] != "text" for p in parts):
            unsupported("the model's chat template has no place for media items (it takes text content only)")
        else:
            entry["content"] = "\n".join(p["text"] for p in parts)
        out.append(entry)
    return out, media


def render_chat(
    req: ChatRequest, template: ChatTemplate, mm: MultimodalCard | None
) -> tuple[str, list[pb.MediaItem]]:
    """The prompt text of a chat, and its media items; raises :class:`Rejection` (400)."""
    if req.continue_final_message and req.add_generation_prompt:
        invalid_argument("continue_final_message and add_generation_prompt cannot both be true")
    extra = req.chat_template_kwargs or {}
    if not all(isinstance(k, str) and k.isidentifier() for k in extra):
        invalid_argument("chat_template_kwargs keys must be identifiers")
    messages, media = _conversation(req.messages, template, mm)
    try:
        prompt = template.render(messages, add_generation_prompt=req.add_generation_prompt, extra=extra)
    except TemplateRenderError as err:
        invalid_argument(str(err))
    if req.continue_final_message:
        last = req.messages[-1].get("content")
        text = last if isinstance(last, str) else ""
        cut = prompt.rfind(text) if text else -1
        if cut >= 0:
            prompt = prompt[: cut + len(text)]
    return prompt, media


def map_chat(
    req: ChatRequest, card: WorkerCard, headers: Mapping[str, str], templates: TemplateLookup
) -> tuple[MappedRequest, ChatTemplate, MultimodalCard | None]:
    """A Chat Completions request, all but its prompt (module doc; :func:`render_chat` makes it:
    the caller may run it in a worker thread); raises :class:`Rejection`."""
    if req.tools:
        unsupported("tools are not supported by this front (no tool-call parsing)")
    if req.echo:
        unsupported("echo is not supported by this front")
    if req.top_logprobs is not None and not req.logprobs:
        invalid_argument("top_logprobs needs logprobs: true")
    if req.model:
        resolved = card.resolve(req.model)
        if resolved is None:
            served_names = ", ".join(card.served_model_names) or "none"
            model_not_found(f"model {quote(req.model)} is not served by this worker (serves: {served_names})")
        served = resolved.model.served_model_name
    elif len(card.models) == 1:
        served = card.models[0].served_model_name
    else:
        invalid_argument("model is required: this worker serves several models")
    template = templates(served)
    if template is None:
        unsupported(
            f"model {quote(served)} has no chat template (its tokenizer has none where the sidecar can "
            "read it): start the sidecar with --chat-template FILE, or use /v1/completions"
        )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    mapped = _request(req, card, headers, max_tokens=max_tokens, logprobs=logprobs, media=[])
    return mapped, template, model_multimodal(card, req.model)
