"""Fuzz harness: the north decoder and admission, in-process, for as long as you like.

    .venv/bin/python -m tests.fuzz.harness --seconds 60 [--seed 7] [--max-message-size 65536]

Feeds :class:`tests.fuzz.mutate.FrameFuzzer` frames (mutated JSON / msgpack messages,
corrupted bytes, invalid UTF-8, deep nesting, long digit strings and echoed strings, oversized
and random frames) through exactly
what the server runs for one message: ``decode_frame``, the typed answer for a
``ProtocolError`` (encoded in the frame's encoding), and for a ``generate`` admission against
worker cards of every engine shape and role. Any other exception — or an answer whose message
is unbounded or carries control characters — is a finding: it is printed
with the frame that caused it (``repr``, reproducible with the seed) and the exit status is 1.
Prints a progress line every few seconds and the outcome counts at the end.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
import traceback

from sidecar.core.admission import admit
from sidecar.core.errors import Rejection
from sidecar.core.handoff import splice_kv_session
from sidecar.north import codec
from sidecar.north.codec import Encoding
from tests.core.shapes import R, sglang_card, trtllm_card, vllm_card
from tests.fuzz.mutate import OP_TEXT, FrameFuzzer

CARDS = [vllm_card(), vllm_card(R.DECODE), trtllm_card(), sglang_card(R.AGGREGATED), sglang_card(R.PREFILL)]


def _bounded(message: str) -> None:
    """An answer never carries unbounded or unescaped client input (issue 15)."""
    if len(message) > codec.MAX_ERROR_MESSAGE + 16 or not message.isprintable():
        raise AssertionError(f"unbounded or unescaped error message: {message[:200]!r}…")


def run_one(message: str | bytes, outcomes: collections.Counter[str]) -> None:
    """One message through the server's path; raises only on a finding."""
    encoding = Encoding.JSON if isinstance(message, str) else Encoding.MSGPACK
    try:
        cmd = codec.decode_frame(message)
    except codec.FrameDecodeError:
        outcomes["close 1007"] += 1
        return
    except codec.ProtocolError as err:
        _bounded(err.message)
        reply = codec.error_reply(err)
        codec.decode_server_frame(codec.encode(reply, encoding))
        outcomes[f"answer {type(reply).__name__}"] += 1
        return
    if isinstance(cmd, codec.GenerateCommand):
        for card in CARDS:
            # as sent, and renamed to the card's model so that the checks behind the model
            # lookup run too
            for request in (cmd.request, dataclasses.replace(cmd.request, model=card.served_model_names[0])):
                try:
                    admitted = admit(request, cmd.metadata, card)
                    bytes(admitted.request)
                    outcomes["admitted"] += 1
                except Rejection as rejection:
                    _bounded(rejection.message)
                    outcomes[f"rejected {rejection.code.name}"] += 1
        bytes(splice_kv_session(cmd.request, cmd.kv_session_bytes))
    else:
        outcomes[type(cmd).__name__] += 1


def fuzz(
    *,
    seed: str,
    seconds: float = 30.0,
    frames: int | None = None,
    max_message_size: int = 4 * 1024 * 1024,
    max_findings: int = 10,
    progress: bool = False,
) -> tuple[int, int, collections.Counter[str]]:
    """Run the fuzzer for ``seconds`` (or ``frames`` frames): (frames, findings, outcomes)."""
    fuzzer = FrameFuzzer(seed, max_message_size=max_message_size)
    outcomes: collections.Counter[str] = collections.Counter()
    findings = 0
    n = 0
    start = last = time.monotonic()
    while findings < max_findings and (
        n < frames if frames is not None else time.monotonic() - start < seconds
    ):
        frame = fuzzer.frame()
        n += 1
        if frame.raw is not None:
            outcomes["framing (WebSocket layer)"] += 1
            continue
        if len(frame.payload) > max_message_size:
            outcomes["close 1009"] += 1
            continue
        if frame.opcode == OP_TEXT:
            try:
                frame.payload.decode("utf-8")
            except UnicodeDecodeError:
                outcomes["invalid UTF-8 (WebSocket layer)"] += 1
                continue
        try:
            run_one(frame.message, outcomes)
        except Exception:
            findings += 1
            print(f"FINDING #{findings} at frame {n} ({frame.kind}): {frame.message!r}", flush=True)
            traceback.print_exc()
        if progress and time.monotonic() - last >= 5:
            last = time.monotonic()
            print(f"[{last - start:5.0f}s] {n} frames, {findings} findings", flush=True)
    return n, findings, outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", default="1")
    parser.add_argument("--max-message-size", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--max-findings", type=int, default=10)
    args = parser.parse_args()
    start = time.monotonic()
    n, findings, outcomes = fuzz(
        seed=args.seed,
        seconds=args.seconds,
        max_message_size=args.max_message_size,
        max_findings=args.max_findings,
        progress=True,
    )
    print(f"{n} frames in {time.monotonic() - start:.1f}s (seed {args.seed}), {findings} findings")
    for outcome, count in outcomes.most_common():
        print(f"  {count:8d}  {outcome}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
