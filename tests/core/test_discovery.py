from __future__ import annotations

import pytest

from sidecar.core.card import card_to_json
from sidecar.core.discovery import compare_cards, discover
from sidecar.core.errors import DiscoveryError, NegotiationError
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineUnavailable
from tests.fake_engine import FakeEngine, status

from .shapes import R, sglang_info, trtllm_info, vllm_card, vllm_info


async def test_vllm_discovery_sequence() -> None:
    src = pb.KvEventSource(
        transport="zmq", endpoint_addr=pb.KvEndpoint(host="h", port=5557), encoding="msgpack"
    )
    lora = pb.LoraAdapter(lora_id=3, lora_name="chat", source_path="/a/chat")
    client = FakeEngine(vllm_info(), sources=[src], loras=[lora])
    card = await discover(client)
    assert client.calls == ["GetServerInfo", "GetModelInfo:llama", "GetKvEventSources", "ListLoras"]
    assert card.problems == []
    assert card.kv_event_sources is not None and len(card.kv_event_sources) == 1
    assert card.lora_adapters is not None and card.lora_adapters[0].lora_name == "chat"
    assert "chat" in card.served_model_names
    card_to_json(card)


async def test_kv_sources_unimplemented_and_other_failures_are_unknown() -> None:
    for name in ("UNIMPLEMENTED", "INTERNAL"):
        client = FakeEngine(vllm_info(), fail={"GetKvEventSources": status(name)})
        card = await discover(client)
        assert card.kv_event_sources is None


async def test_lora_listing() -> None:
    client = FakeEngine(vllm_info(), fail={"ListLoras": status("UNIMPLEMENTED")})
    assert (await discover(client)).lora_adapters is None
    client = FakeEngine(trtllm_info())  # supports_lora False everywhere
    assert (await discover(client)).lora_adapters == []
    assert "ListLoras" not in client.calls
    client = FakeEngine(sglang_info())  # supports_lora unreported
    assert (await discover(client)).lora_adapters is None
    assert "ListLoras" not in client.calls


async def test_negotiation_failure_stops_discovery() -> None:
    info, models = vllm_info()
    info.schema_release = "main"
    client = FakeEngine((info, models))
    with pytest.raises(NegotiationError, match="not an immutable"):
        await discover(client)
    assert client.calls == ["GetServerInfo"]
    with pytest.raises(NegotiationError, match="expected engine 'sglang'"):
        await discover(FakeEngine(vllm_info()), expected_engine="sglang")


async def test_model_info_failure_is_fatal() -> None:
    info, models = vllm_info()
    info.supported_models = ["llama", "ghost"]
    with pytest.raises(DiscoveryError, match=r"GetModelInfo\('ghost'\) failed"):
        await discover(FakeEngine((info, models)))


async def test_transport_failure_propagates() -> None:
    client = FakeEngine(vllm_info(), fail={"GetModelInfo:llama": EngineUnavailable("connection lost")})
    with pytest.raises(EngineUnavailable):
        await discover(client)


async def test_strict_and_lenient() -> None:
    info, models = vllm_info(R.DECODE)
    info.kv_connector = None
    with pytest.raises(
        DiscoveryError, match="cannot serve vllm: decode engine advertises no enabled KV connector"
    ):
        await discover(FakeEngine((info, models)))
    card = await discover(FakeEngine((info, models)), strict=False)
    assert card.problems == ["decode engine advertises no enabled KV connector"]


async def test_model_filter_and_duplicates() -> None:
    info, models = vllm_info()
    info.supported_models = ["llama", "llama", "other", ""]
    models["other"] = pb.ModelInfo(served_model_name="other", served_model_aliases=["o2"])
    client = FakeEngine((info, models))
    card = await discover(client, model="o2")
    assert [m.served_model_name for m in card.models] == ["other"]
    assert client.calls.count("GetModelInfo:llama") == 1
    with pytest.raises(DiscoveryError, match="model 'zzz' is not served"):
        await discover(FakeEngine((info, models)), model="zzz")


async def test_reuses_given_server_info() -> None:
    shape = vllm_info()
    client = FakeEngine(shape)
    await discover(client, info=shape[0])
    assert "GetServerInfo" not in client.calls


def test_compare_cards() -> None:
    base = vllm_card()
    assert compare_cards(base, vllm_card()) == []
    restarted = vllm_card()
    restarted.engine.instance_id = "vllm-2"
    restarted.engine.version = "0.27.0"
    assert compare_cards(base, restarted) == []
    # loaded adapters and load come and go: not a change of identity
    assert compare_cards(base, vllm_card(loras=[])) == []

    assert compare_cards(base, vllm_card(R.DECODE)) == ["engine role changed from aggregated to decode"]
    assert compare_cards(base, vllm_card(dp=2)) == ["DP ranks changed from [0] to [0, 1]"]

    info, models = vllm_info()
    models["llama"].model_id = "meta-llama/Llama-3.2-1B"
    from .shapes import card_of

    assert compare_cards(base, card_of((info, models))) == [
        "model 'llama' changed from 'meta-llama/Llama-3.1-8B-Instruct' to 'meta-llama/Llama-3.2-1B'"
    ]
    info, models = vllm_info()
    models["llama"].served_model_name = "llama2"
    reasons = compare_cards(base, card_of((info, models)))
    assert "model 'llama' is no longer served" in reasons and "model 'llama2' is newly served" in reasons
    info, models = vllm_info()
    models["llama"].served_model_aliases = ["x"]
    assert compare_cards(base, card_of((info, models))) == [
        "aliases of model 'llama' changed from ['meta-llama/Llama-3.1-8B-Instruct'] to ['x']"
    ]
    info, models = vllm_info()
    assert info.kv_connector is not None
    info.kv_connector.transfer_backend = "ucx"
    [reason] = compare_cards(base, card_of((info, models)))
    assert reason.startswith("KV connector changed")
    info, models = vllm_info()
    info.engine_name = "sglang"
    assert compare_cards(base, card_of((info, models))) == ["engine changed from 'vllm' to 'sglang'"]
