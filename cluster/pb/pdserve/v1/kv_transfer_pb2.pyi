from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "kv_head_start", "total_kv_heads", "tp_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_head_start: int
    total_kv_heads: int
    tp_size: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("request_id", "num_tokens", "endpoint", "transport", "block_ids", "block_size", "layout", "lease_expiry_unix", "capability_token", "first_token_id", "rank_endpoints")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    endpoint: str
    transport: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    layout: KVLayout
    lease_expiry_unix: float
    capability_token: bytes
    first_token_id: int
    rank_endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., endpoint: _Optional[str] = ..., transport: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., lease_expiry_unix: _Optional[float] = ..., capability_token: _Optional[bytes] = ..., first_token_id: _Optional[int] = ..., rank_endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("handle", "receiver_layout", "max_chunk_bytes", "checksum")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    handle: KVHandle
    receiver_layout: KVLayout
    max_chunk_bytes: int
    checksum: bool
    def __init__(self, handle: _Optional[_Union[KVHandle, _Mapping]] = ..., receiver_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ..., checksum: _Optional[bool] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    data: bytes
    def __init__(self, header: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id", "capability_token", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    capability_token: bytes
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., capability_token: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class CancelPrefillRequest(_message.Message):
    __slots__ = ("request_id", "cancel_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CANCEL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cancel_token: bytes
    def __init__(self, request_id: _Optional[str] = ..., cancel_token: _Optional[bytes] = ...) -> None: ...

class CancelPrefillResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class OpenChannelRequest(_message.Message):
    __slots__ = ("transport", "handle")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    transport: str
    handle: KVHandle
    def __init__(self, transport: _Optional[str] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class OpenChannelResponse(_message.Message):
    __slots__ = ("channel_id", "store_port")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    store_port: int
    def __init__(self, channel_id: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = ("handle", "receiver_layout", "channel_id")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    handle: KVHandle
    receiver_layout: KVLayout
    channel_id: str
    def __init__(self, handle: _Optional[_Union[KVHandle, _Mapping]] = ..., receiver_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., channel_id: _Optional[str] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("dtype", "shape", "nbytes", "tag")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    tag: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., tag: _Optional[int] = ...) -> None: ...

class CloseChannelRequest(_message.Message):
    __slots__ = ("channel_id",)
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    def __init__(self, channel_id: _Optional[str] = ...) -> None: ...

class CloseChannelResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class ConnectNixlRequest(_message.Message):
    __slots__ = ("handle", "receiver_layout", "reader_agent")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    READER_AGENT_FIELD_NUMBER: _ClassVar[int]
    handle: KVHandle
    receiver_layout: KVLayout
    reader_agent: str
    def __init__(self, handle: _Optional[_Union[KVHandle, _Mapping]] = ..., receiver_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., reader_agent: _Optional[str] = ...) -> None: ...

class NixlPool(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "mem_type", "device_id", "k_base", "v_base", "layer_stride", "block_stride", "block_bytes", "num_layers", "num_blocks")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    K_BASE_FIELD_NUMBER: _ClassVar[int]
    V_BASE_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    mem_type: str
    device_id: int
    k_base: int
    v_base: int
    layer_stride: int
    block_stride: int
    block_bytes: int
    num_layers: int
    num_blocks: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ..., k_base: _Optional[int] = ..., v_base: _Optional[int] = ..., layer_stride: _Optional[int] = ..., block_stride: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class HoldKVRequest(_message.Message):
    __slots__ = ("handle", "receiver_layout", "reader_agent")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    READER_AGENT_FIELD_NUMBER: _ClassVar[int]
    handle: KVHandle
    receiver_layout: KVLayout
    reader_agent: str
    def __init__(self, handle: _Optional[_Union[KVHandle, _Mapping]] = ..., receiver_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., reader_agent: _Optional[str] = ...) -> None: ...

class KVHeld(_message.Message):
    __slots__ = ("agent_name",)
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    def __init__(self, agent_name: _Optional[str] = ...) -> None: ...

class PinKVRequest(_message.Message):
    __slots__ = ("request_id", "capability_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    capability_token: bytes
    def __init__(self, request_id: _Optional[str] = ..., capability_token: _Optional[bytes] = ...) -> None: ...

class KVPinned(_message.Message):
    __slots__ = ("block_ids", "num_tokens")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ImportKVRequest(_message.Message):
    __slots__ = ("handle", "block_ids", "replica_secret")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SECRET_FIELD_NUMBER: _ClassVar[int]
    handle: KVHandle
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    replica_secret: bytes
    def __init__(self, handle: _Optional[_Union[KVHandle, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., replica_secret: _Optional[bytes] = ...) -> None: ...

class ImportKVResponse(_message.Message):
    __slots__ = ("nbytes", "nixl_bytes")
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NIXL_BYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    nixl_bytes: int
    def __init__(self, nbytes: _Optional[int] = ..., nixl_bytes: _Optional[int] = ...) -> None: ...
