"""Ids on the wire are uint32, and protobuf keeps the low 32 bits of a larger varint: 2**32 + 5 would
read as token 5. The server parses requests through `strict_parser`, which refuses such a value first.

The check parses the bytes a second time, as a twin of draftwire.v1 whose uint32 fields are uint64
(the same wire encoding), and compares; it runs only when the bytes hold a varint that could be that
wide (a regular expression, in C), which honest proposals almost never do.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from draftwire.v1 import draftwire_pb2 as pb

UINT32_MAX = (1 << 32) - 1
# Four bytes with the continuation bit, then a fifth above 0x0f: a varint of 2**32 or more (the run
# cannot cross a varint's end, whose last byte is below 0x80). Other bytes may match too (a string's,
# a double's, a uint64 seed's): they only cost the exact check.
_MAYBE_WIDE = re.compile(rb"[\x80-\xff]{4}[\x10-\xff]")
_PACKAGE = pb.DESCRIPTOR.package
_WIDE_PACKAGE = f"{_PACKAGE}.wide"


@functools.cache
def _wide_pool() -> descriptor_pool.DescriptorPool:
    """draftwire.v1's messages again, in their own pool and package, with uint64 for every uint32."""
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    proto.name = proto.name.removesuffix(".proto") + "_wide.proto"
    proto.package = _WIDE_PACKAGE
    del proto.service[:]

    def widen(messages) -> None:
        for message in messages:
            for field in message.field:
                if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_UINT32:
                    field.type = descriptor_pb2.FieldDescriptorProto.TYPE_UINT64
                if field.type_name.startswith(f".{_PACKAGE}."):
                    field.type_name = f".{_WIDE_PACKAGE}." + field.type_name[len(_PACKAGE) + 2 :]
            widen(message.nested_type)

    widen(proto.message_type)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool


@functools.cache
def _wide_class(full_name: str) -> type[Message]:
    name = _WIDE_PACKAGE + full_name[len(_PACKAGE) :]
    return message_factory.GetMessageClass(_wide_pool().FindMessageTypeByName(name))


def too_wide(wide: Message, narrow: Descriptor, path: str = "") -> tuple[str, int] | None:
    """The first uint32 field of `narrow` (at any depth) whose value in `wide`, its twin, exceeds
    UINT32_MAX: its path and value; None when every one fits."""
    for field in narrow.fields:
        where = f"{path}{field.name}"
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_UINT32:
            values = getattr(wide, field.name)
            largest = max(values, default=0) if repeated else values
            if largest > UINT32_MAX:
                return where, largest
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            if repeated:
                children = getattr(wide, field.name)
            else:
                children = [getattr(wide, field.name)] if wide.HasField(field.name) else []
            for child in children:
                found = too_wide(child, field.message_type, f"{where}.")
                if found:
                    return found
    return None


def check(descriptor: Descriptor, data: bytes) -> None:
    """Raises DecodeError when a uint32 field of a `descriptor` message in `data` holds 2**32 or more."""
    if not _MAYBE_WIDE.search(data):
        return
    try:
        wide = _wide_class(descriptor.full_name).FromString(data)
    except DecodeError:
        return  # not a message at all: the parse proper says so
    found = too_wide(wide, descriptor)
    if found:
        where, value = found
        raise DecodeError(f"{where} is {value}: a uint32 holds at most {UINT32_MAX}")


def strict_parser(parse: Callable[[bytes], Message]) -> Callable[[bytes], Message]:
    """`parse` (a draftwire.v1 message's FromString) that first refuses uint32 values it would truncate,
    with DecodeError; any other parser unchanged."""
    cls = getattr(parse, "__self__", None)
    descriptor = getattr(cls, "DESCRIPTOR", None)
    if not isinstance(descriptor, Descriptor) or descriptor.file.package != _PACKAGE:
        return parse

    def strict(data: bytes) -> Message:
        check(descriptor, data)
        return parse(data)

    return strict
