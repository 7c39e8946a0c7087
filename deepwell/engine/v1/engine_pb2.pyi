from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_DEADLINE: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class CachePlacement(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_PLACEMENT_NONE: _ClassVar[CachePlacement]
    CACHE_PLACEMENT_RESIDENT: _ClassVar[CachePlacement]
    CACHE_PLACEMENT_HOST: _ClassVar[CachePlacement]
    CACHE_PLACEMENT_BOTH: _ClassVar[CachePlacement]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_DEADLINE: FinishReason
FINISH_REASON_ERROR: FinishReason
CACHE_PLACEMENT_NONE: CachePlacement
CACHE_PLACEMENT_RESIDENT: CachePlacement
CACHE_PLACEMENT_HOST: CachePlacement
CACHE_PLACEMENT_BOTH: CachePlacement

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "turn_boundary", "session_key", "tenant", "prompt_metadata_digest", "priority", "prefix_boundary")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TURN_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_METADATA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    turn_boundary: int
    session_key: str
    tenant: str
    prompt_metadata_digest: bytes
    priority: int
    prefix_boundary: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., turn_boundary: _Optional[int] = ..., session_key: _Optional[str] = ..., tenant: _Optional[str] = ..., prompt_metadata_digest: _Optional[bytes] = ..., priority: _Optional[int] = ..., prefix_boundary: _Optional[int] = ...) -> None: ...

class CacheHits(_message.Message):
    __slots__ = ("resident_frontier", "resident_checkpoint", "host_entry", "session_lookup", "shared_prefix")
    RESIDENT_FRONTIER_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    HOST_ENTRY_FIELD_NUMBER: _ClassVar[int]
    SESSION_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    resident_frontier: int
    resident_checkpoint: int
    host_entry: int
    session_lookup: int
    shared_prefix: int
    def __init__(self, resident_frontier: _Optional[int] = ..., resident_checkpoint: _Optional[int] = ..., host_entry: _Optional[int] = ..., session_lookup: _Optional[int] = ..., shared_prefix: _Optional[int] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "cached", "max_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    cached: CacheHits
    max_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached: _Optional[_Union[CacheHits, _Mapping]] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached", "spec_draft_tokens", "spec_accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached: CacheHits
    spec_draft_tokens: int
    spec_accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached: _Optional[_Union[CacheHits, _Mapping]] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "restore_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    restore_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., restore_ms: _Optional[float] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "usage", "timings", "stop_token_id", "error")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    timings: Timings
    stop_token_id: int
    error: str
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., stop_token_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("admitted", "tokens", "finished")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    admitted: Admitted
    tokens: TokenChunk
    finished: Finished
    def __init__(self, admitted: _Optional[_Union[Admitted, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelFile(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "architecture", "model_type", "max_context_tokens", "kv_dtype", "vocab_size", "eos_token_ids", "bos_token_id", "pad_token_id", "chat_template", "bos_token", "eos_token", "files", "default_sampling", "page_size", "max_concurrency", "engine_id", "version", "hybrid", "supports_vision", "kv_calibration_digest", "speculative_tokens")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HYBRID_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_VISION_FIELD_NUMBER: _ClassVar[int]
    KV_CALIBRATION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    model_type: str
    max_context_tokens: int
    kv_dtype: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    pad_token_id: int
    chat_template: str
    bos_token: str
    eos_token: str
    files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    default_sampling: SamplingParams
    page_size: int
    max_concurrency: int
    engine_id: str
    version: str
    hybrid: bool
    supports_vision: bool
    kv_calibration_digest: str
    speculative_tokens: int
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., model_type: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ..., default_sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., page_size: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., engine_id: _Optional[str] = ..., version: _Optional[str] = ..., hybrid: bool = ..., supports_vision: bool = ..., kv_calibration_digest: _Optional[str] = ..., speculative_tokens: _Optional[int] = ...) -> None: ...

class ReadModelFileRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("offset", "data", "last")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    last: bool
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: bool = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("requests_running", "requests_waiting", "kv_pages_used", "kv_pages_total", "state_slots_used", "state_slots_total", "tokens_prefilled", "tokens_decoded", "requests_finished", "cached_total", "uptime_s", "device", "cache_entries", "cache_pages", "cache_state_slots", "host")
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PREFILLED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DECODED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CACHE_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    requests_running: int
    requests_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    state_slots_used: int
    state_slots_total: int
    tokens_prefilled: int
    tokens_decoded: int
    requests_finished: int
    cached_total: CacheHits
    uptime_s: float
    device: str
    cache_entries: int
    cache_pages: int
    cache_state_slots: int
    host: HostTierStats
    def __init__(self, requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., state_slots_used: _Optional[int] = ..., state_slots_total: _Optional[int] = ..., tokens_prefilled: _Optional[int] = ..., tokens_decoded: _Optional[int] = ..., requests_finished: _Optional[int] = ..., cached_total: _Optional[_Union[CacheHits, _Mapping]] = ..., uptime_s: _Optional[float] = ..., device: _Optional[str] = ..., cache_entries: _Optional[int] = ..., cache_pages: _Optional[int] = ..., cache_state_slots: _Optional[int] = ..., host: _Optional[_Union[HostTierStats, _Mapping]] = ...) -> None: ...

class HostTierStats(_message.Message):
    __slots__ = ("arena_bytes", "budget_bytes", "committed_bytes", "entries", "evictions")
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    arena_bytes: int
    budget_bytes: int
    committed_bytes: int
    entries: int
    evictions: int
    def __init__(self, arena_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., committed_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class SessionsRequest(_message.Message):
    __slots__ = ("tenant", "limit")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    limit: int
    def __init__(self, tenant: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class SessionTurn(_message.Message):
    __slots__ = ("prompt_tokens", "cached", "cached_tokens", "cached_fraction", "ttft_ms", "completion_tokens", "reason")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached: CacheHits
    cached_tokens: int
    cached_fraction: float
    ttft_ms: float
    completion_tokens: int
    reason: FinishReason
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached: _Optional[_Union[CacheHits, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., cached_fraction: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., completion_tokens: _Optional[int] = ..., reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("tenant", "session_key", "cached_tokens", "resident_tokens", "host_tokens", "placement", "resident_entries", "host_entries", "resident_bytes", "host_bytes", "last_turn", "age_s", "idle_s", "requests_running", "requests")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HOST_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_TURN_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_key: str
    cached_tokens: int
    resident_tokens: int
    host_tokens: int
    placement: CachePlacement
    resident_entries: int
    host_entries: int
    resident_bytes: int
    host_bytes: int
    last_turn: SessionTurn
    age_s: float
    idle_s: float
    requests_running: int
    requests: int
    def __init__(self, tenant: _Optional[str] = ..., session_key: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., placement: _Optional[_Union[CachePlacement, str]] = ..., resident_entries: _Optional[int] = ..., host_entries: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., last_turn: _Optional[_Union[SessionTurn, _Mapping]] = ..., age_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., requests_running: _Optional[int] = ..., requests: _Optional[int] = ...) -> None: ...

class SessionsReply(_message.Message):
    __slots__ = ("sessions", "engine_id", "ledger_capacity", "total")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEDGER_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    engine_id: str
    ledger_capacity: int
    total: int
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., engine_id: _Optional[str] = ..., ledger_capacity: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...
