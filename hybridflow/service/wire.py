"""The three protobuf bodies of the Tinker API: the forward_backward request in, its output and a sample out.

The schema is the one the `tinker` SDK ships (`tinker.proto.tinker_public_pb2`); everything else on the wire
is JSON. Decoding turns a request into plain numpy arrays; a body that does not parse, or holds something the
service does not take (images, audio, non-1-D loss inputs), raises `WireError` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request body the service cannot read."""


@dataclass
class Datum:
    """One training example: the input tokens and the loss inputs, each as long as the tokens."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardBody:
    """A decoded forward_backward request."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[Datum]
    loss_fn_config: dict[str, float] = field(default_factory=dict)


def decode_forward_backward(body: bytes, content_encoding: str | None) -> ForwardBackwardBody:
    """The request in `body` (zstd-compressed when `content_encoding` says so)."""
    if content_encoding == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except zstandard.ZstdError as err:
            raise WireError(f"forward_backward body is not valid zstd: {err}") from None
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as err:
        raise WireError(f"forward_backward body is not a ForwardBackwardRequest protobuf: {err}") from None
    if not msg.model_id:
        raise WireError("forward_backward body has no model_id (not a ForwardBackwardRequest protobuf?)")
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config[{k!r}] is a string; the service's losses take numbers only")
        config[k] = float(v.number)
    data = [_datum(d, i) for i, d in enumerate(msg.data)]
    return ForwardBackwardBody(msg.model_id, int(msg.seq_id), msg.loss_fn, bool(msg.forward_only), data, config)


def _datum(msg: pb.Datum, index: int) -> Datum:
    parts = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"datum {index}: {kind} chunks are not served (text tokens only)")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    return Datum(
        tokens, {name: _tensor(t, f"datum {index}: loss_fn_inputs[{name!r}]") for name, t in msg.loss_fn_inputs.items()}
    )


def _tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where} has unsupported dtype {pb.DType.Name(msg.dtype)}")
    if msg.WhichOneof("encoding") == "sparse_csr" or len(msg.shape) > 1:
        raise WireError(f"{where} has shape {list(msg.shape)}; the service's losses take 1-D inputs only")
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    if msg.shape and arr.size != msg.shape[0]:
        raise WireError(f"{where} holds {arr.size} values but declares shape {list(msg.shape)}")
    return arr


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput bytes: one ArrayRecord with each field's per-datum float32 arrays batched."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
            )
        )
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


@dataclass
class Sequence:
    """One sampled continuation: its tokens, their log-probs and why it stopped ("stop" or "length")."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


def encode_sample_response(sequences: list[Sequence], prompt_logprobs: np.ndarray | None) -> bytes:
    """SampleResponse bytes (`prompt_logprobs`: float32, NaN where none was computed)."""
    msg = pb.SampleResponse()
    for s in sequences:
        msg.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes(),
            )
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
