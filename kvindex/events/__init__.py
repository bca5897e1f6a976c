"""vLLM KV events → router-key index ops: wire framing, adapters, key map, subscriber.

Pipeline: ``wire`` (ZMQ frames) → ``vllm_adapter`` (msgpack payload → ``EngineBatch``)
→ ``translate`` (engine hashes → router keys via ``engine_map``) → ``ingest``
(``store.apply``); ``subscriber`` drives it from ZMQ with seq tracking and replay,
``http_ingest`` decodes the same schema posted over HTTP.
"""

from kvindex.events.engine_map import EngineKeyMap
from kvindex.events.http_ingest import BadEventsBody, decode_http_events
from kvindex.events.ingest import PodIngestor
from kvindex.events.subscriber import KVEventSubscriber, offset_port
from kvindex.events.translate import EventTranslator
from kvindex.events.types import EngineBatch, EngineCleared, EngineRemoved, EngineStored
from kvindex.events.vllm_adapter import MalformedPayload, decode_payload, tier_of

__all__ = [
    "BadEventsBody",
    "EngineBatch",
    "EngineCleared",
    "EngineKeyMap",
    "EngineRemoved",
    "EngineStored",
    "EventTranslator",
    "KVEventSubscriber",
    "MalformedPayload",
    "PodIngestor",
    "decode_http_events",
    "decode_payload",
    "offset_port",
    "tier_of",
]
