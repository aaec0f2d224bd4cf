"""Optional Dynamo worker plane (``run --dynamo``): the only code importing Dynamo's runtime.

See docs/DYNAMO.md. Modules: ``config``/``options`` (flags), ``registration`` (worker card →
Dynamo model registrations), ``mapping`` (Dynamo request/chunks ↔ OpenEngine), ``handler``
(Dynamo handler ↔ trio stream lifecycle), ``plane`` (runtime, serving, KV relay, leave on
drain), ``tokenizer_dir`` (a Hugging Face tokenizer directory of the mock engines' vocabulary).
Only ``plane`` imports ``dynamo``, lazily.
"""
