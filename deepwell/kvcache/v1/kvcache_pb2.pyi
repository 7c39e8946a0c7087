from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_OK: _ClassVar[ErrorCode]
    ERROR_CODE_STALE: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_QUOTA_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID: _ClassVar[ErrorCode]
    ERROR_CODE_INCOMPLETE: _ClassVar[ErrorCode]
    ERROR_CODE_UNKNOWN_CLIENT: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]

class PartRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PART_ROLE_UNSPECIFIED: _ClassVar[PartRole]
    PART_ROLE_ATTENTION_KV: _ClassVar[PartRole]
    PART_ROLE_RECURRENT_STATE: _ClassVar[PartRole]
    PART_ROLE_CONV_STATE: _ClassVar[PartRole]
    PART_ROLE_MTP_STATE: _ClassVar[PartRole]
    PART_ROLE_HIDDEN: _ClassVar[PartRole]
    PART_ROLE_OTHER: _ClassVar[PartRole]

class FrontierKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRONTIER_KIND_UNSPECIFIED: _ClassVar[FrontierKind]
    FRONTIER_KIND_EXEC: _ClassVar[FrontierKind]
    FRONTIER_KIND_CHECKPOINT: _ClassVar[FrontierKind]

class MatchSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MATCH_SOURCE_UNSPECIFIED: _ClassVar[MatchSource]
    MATCH_SOURCE_DIGEST: _ClassVar[MatchSource]
    MATCH_SOURCE_SESSION: _ClassVar[MatchSource]

class ReleaseOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_OUTCOME_UNSPECIFIED: _ClassVar[ReleaseOutcome]
    RELEASE_OUTCOME_OK: _ClassVar[ReleaseOutcome]
    RELEASE_OUTCOME_FAILED: _ClassVar[ReleaseOutcome]
ERROR_CODE_OK: ErrorCode
ERROR_CODE_STALE: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_QUOTA_EXCEEDED: ErrorCode
ERROR_CODE_INVALID: ErrorCode
ERROR_CODE_INCOMPLETE: ErrorCode
ERROR_CODE_UNKNOWN_CLIENT: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
PART_ROLE_UNSPECIFIED: PartRole
PART_ROLE_ATTENTION_KV: PartRole
PART_ROLE_RECURRENT_STATE: PartRole
PART_ROLE_CONV_STATE: PartRole
PART_ROLE_MTP_STATE: PartRole
PART_ROLE_HIDDEN: PartRole
PART_ROLE_OTHER: PartRole
FRONTIER_KIND_UNSPECIFIED: FrontierKind
FRONTIER_KIND_EXEC: FrontierKind
FRONTIER_KIND_CHECKPOINT: FrontierKind
MATCH_SOURCE_UNSPECIFIED: MatchSource
MATCH_SOURCE_DIGEST: MatchSource
MATCH_SOURCE_SESSION: MatchSource
RELEASE_OUTCOME_UNSPECIFIED: ReleaseOutcome
RELEASE_OUTCOME_OK: ReleaseOutcome
RELEASE_OUTCOME_FAILED: ReleaseOutcome

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Handle(_message.Message):
    __slots__ = ("epoch", "id", "generation")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    id: int
    generation: int
    def __init__(self, epoch: _Optional[int] = ..., id: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class Extent(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("name", "role", "offset", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: PartRole
    offset: int
    length: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[PartRole, str]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("parts", "total_bytes", "descriptor")
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    total_bytes: int
    descriptor: bytes
    def __init__(self, parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., descriptor: _Optional[bytes] = ...) -> None: ...

class Identity(_message.Message):
    __slots__ = ("tenant", "model_fingerprint", "session_key", "metadata_digest", "frontier_kind", "frontier_position", "num_tokens", "page_digests", "page_size", "requires_state")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    METADATA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_KIND_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_STATE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_fingerprint: bytes
    session_key: str
    metadata_digest: bytes
    frontier_kind: FrontierKind
    frontier_position: int
    num_tokens: int
    page_digests: _containers.RepeatedScalarFieldContainer[bytes]
    page_size: int
    requires_state: bool
    def __init__(self, tenant: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., session_key: _Optional[str] = ..., metadata_digest: _Optional[bytes] = ..., frontier_kind: _Optional[_Union[FrontierKind, str]] = ..., frontier_position: _Optional[int] = ..., num_tokens: _Optional[int] = ..., page_digests: _Optional[_Iterable[bytes]] = ..., page_size: _Optional[int] = ..., requires_state: bool = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("client_name", "pid")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("path", "size", "granule_size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    GRANULE_SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    granule_size: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., granule_size: _Optional[int] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("epoch", "client_id", "arena", "budget_bytes", "pin_quota_bytes", "grace_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIN_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    client_id: str
    arena: ArenaInfo
    budget_bytes: int
    pin_quota_bytes: int
    grace_s: float
    def __init__(self, epoch: _Optional[int] = ..., client_id: _Optional[str] = ..., arena: _Optional[_Union[ArenaInfo, _Mapping]] = ..., budget_bytes: _Optional[int] = ..., pin_quota_bytes: _Optional[int] = ..., grace_s: _Optional[float] = ...) -> None: ...

class TokenBlock(_message.Message):
    __slots__ = ("tokens_le32",)
    TOKENS_LE32_FIELD_NUMBER: _ClassVar[int]
    tokens_le32: bytes
    def __init__(self, tokens_le32: _Optional[bytes] = ...) -> None: ...

class ReserveHeader(_message.Message):
    __slots__ = ("client_id", "op_id", "identity", "layout")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    identity: Identity
    layout: Layout
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., identity: _Optional[_Union[Identity, _Mapping]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class ReserveChunk(_message.Message):
    __slots__ = ("header", "tokens")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    header: ReserveHeader
    tokens: TokenBlock
    def __init__(self, header: _Optional[_Union[ReserveHeader, _Mapping]] = ..., tokens: _Optional[_Union[TokenBlock, _Mapping]] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("epoch", "error", "reservation", "extents", "evicted_entries")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    reservation: Handle
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    evicted_entries: int
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., reservation: _Optional[_Union[Handle, _Mapping]] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ..., evicted_entries: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("client_id", "op_id", "reservation", "success", "written_parts")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_PARTS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    reservation: Handle
    success: bool
    written_parts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., reservation: _Optional[_Union[Handle, _Mapping]] = ..., success: bool = ..., written_parts: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("epoch", "error", "entry", "superseded")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    entry: Handle
    superseded: _containers.RepeatedCompositeFieldContainer[Handle]
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., entry: _Optional[_Union[Handle, _Mapping]] = ..., superseded: _Optional[_Iterable[_Union[Handle, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("client_id", "op_id", "reservation")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    reservation: Handle
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., reservation: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("epoch", "error")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class LookupHeader(_message.Message):
    __slots__ = ("client_id", "op_id", "tenant", "model_fingerprint", "metadata_digest", "session_key", "num_tokens", "page_digests", "pin")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    METADATA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    tenant: str
    model_fingerprint: bytes
    metadata_digest: bytes
    session_key: str
    num_tokens: int
    page_digests: _containers.RepeatedScalarFieldContainer[bytes]
    pin: bool
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., tenant: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., metadata_digest: _Optional[bytes] = ..., session_key: _Optional[str] = ..., num_tokens: _Optional[int] = ..., page_digests: _Optional[_Iterable[bytes]] = ..., pin: bool = ...) -> None: ...

class LookupChunk(_message.Message):
    __slots__ = ("header", "tokens")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    header: LookupHeader
    tokens: TokenBlock
    def __init__(self, header: _Optional[_Union[LookupHeader, _Mapping]] = ..., tokens: _Optional[_Union[TokenBlock, _Mapping]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("epoch", "error", "hit", "entry", "matched_tokens", "identity", "layout", "lease", "extents", "source")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    hit: bool
    entry: Handle
    matched_tokens: int
    identity: Identity
    layout: Layout
    lease: Handle
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    source: MatchSource
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., hit: bool = ..., entry: _Optional[_Union[Handle, _Mapping]] = ..., matched_tokens: _Optional[int] = ..., identity: _Optional[_Union[Identity, _Mapping]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., lease: _Optional[_Union[Handle, _Mapping]] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ..., source: _Optional[_Union[MatchSource, str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("client_id", "op_id", "lease", "outcome")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    lease: Handle
    outcome: ReleaseOutcome
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., lease: _Optional[_Union[Handle, _Mapping]] = ..., outcome: _Optional[_Union[ReleaseOutcome, str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("epoch", "error")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class TakeRequest(_message.Message):
    __slots__ = ("client_id", "op_id", "lease")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    lease: Handle
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., lease: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class TakeReply(_message.Message):
    __slots__ = ("epoch", "error", "take", "extents")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TAKE_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    take: Handle
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., take: _Optional[_Union[Handle, _Mapping]] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ...) -> None: ...

class ReAddRequest(_message.Message):
    __slots__ = ("client_id", "op_id", "take")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    TAKE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    take: Handle
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., take: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class ReAddReply(_message.Message):
    __slots__ = ("epoch", "error", "entry")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    entry: Handle
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., entry: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("client_id", "op_id", "take")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    TAKE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    take: Handle
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., take: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class DropReply(_message.Message):
    __slots__ = ("epoch", "error")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("client_id", "op_id", "entry")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    op_id: str
    entry: Handle
    def __init__(self, client_id: _Optional[str] = ..., op_id: _Optional[str] = ..., entry: _Optional[_Union[Handle, _Mapping]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("epoch", "error")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClientHoldings(_message.Message):
    __slots__ = ("client_id", "client_name", "leases", "reservations", "takes", "pinned_bytes", "oldest_lease_age_s", "attached")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    TAKES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_LEASE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    client_name: str
    leases: int
    reservations: int
    takes: int
    pinned_bytes: int
    oldest_lease_age_s: float
    attached: bool
    def __init__(self, client_id: _Optional[str] = ..., client_name: _Optional[str] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., takes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., oldest_lease_age_s: _Optional[float] = ..., attached: bool = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("epoch", "arena_bytes", "budget_bytes", "committed_bytes", "reserved_bytes", "taken_bytes", "free_bytes", "largest_free_run_bytes", "fragmentation", "entries", "evictions", "compactions", "compaction_bytes_moved", "leases", "oldest_lease_age_s", "clients", "lookups", "hits")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_RUN_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    COMPACTIONS_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_LEASE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    arena_bytes: int
    budget_bytes: int
    committed_bytes: int
    reserved_bytes: int
    taken_bytes: int
    free_bytes: int
    largest_free_run_bytes: int
    fragmentation: float
    entries: int
    evictions: int
    compactions: int
    compaction_bytes_moved: int
    leases: int
    oldest_lease_age_s: float
    clients: _containers.RepeatedCompositeFieldContainer[ClientHoldings]
    lookups: int
    hits: int
    def __init__(self, epoch: _Optional[int] = ..., arena_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., committed_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., taken_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., largest_free_run_bytes: _Optional[int] = ..., fragmentation: _Optional[float] = ..., entries: _Optional[int] = ..., evictions: _Optional[int] = ..., compactions: _Optional[int] = ..., compaction_bytes_moved: _Optional[int] = ..., leases: _Optional[int] = ..., oldest_lease_age_s: _Optional[float] = ..., clients: _Optional[_Iterable[_Union[ClientHoldings, _Mapping]]] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ...) -> None: ...

class SetBudgetRequest(_message.Message):
    __slots__ = ("budget_bytes",)
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    def __init__(self, budget_bytes: _Optional[int] = ...) -> None: ...

class SetBudgetReply(_message.Message):
    __slots__ = ("epoch", "error", "evicted_entries")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    evicted_entries: int
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., evicted_entries: _Optional[int] = ...) -> None: ...

class CompactRequest(_message.Message):
    __slots__ = ("max_ms",)
    MAX_MS_FIELD_NUMBER: _ClassVar[int]
    max_ms: int
    def __init__(self, max_ms: _Optional[int] = ...) -> None: ...

class CompactReply(_message.Message):
    __slots__ = ("epoch", "error", "entries_moved", "bytes_moved", "elapsed_ms", "largest_free_run_bytes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_RUN_BYTES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    error: Error
    entries_moved: int
    bytes_moved: int
    elapsed_ms: float
    largest_free_run_bytes: int
    def __init__(self, epoch: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., entries_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., largest_free_run_bytes: _Optional[int] = ...) -> None: ...
