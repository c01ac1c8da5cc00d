# troupe's wire format between the judge and the processes that run generated code: JSON lines
# holding only plain values. Decoding builds fresh objects of exactly the builtin types (never
# a subclass, never an object with methods of the sender's choosing); anything else is refused.
#   None, bool, str: themselves      int: a JSON integer        float: {"f": repr}
#   list: a JSON array               tuple: {"t": [...]}         dict: {"d": [[key, value], ...]}
#   set: {"s": [...]}                frozenset: {"z": [...]}     bytes: {"b": hex}
#   complex: {"c": [repr, repr]}
import json as _json

MAX_DEPTH = 100


class NotPlain(Exception):
    pass


def wire_encode(value, depth=0):
    if depth > MAX_DEPTH:
        raise NotPlain("nested more than %d levels deep" % MAX_DEPTH)
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is int:
        return value
    if kind is float:
        return {"f": float.__repr__(value)}
    if kind is list:
        return [wire_encode(item, depth + 1) for item in value]
    if kind is tuple:
        return {"t": [wire_encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"d": [[wire_encode(k, depth + 1), wire_encode(v, depth + 1)] for k, v in dict.items(value)]}
    if kind is set:
        return {"s": [wire_encode(item, depth + 1) for item in value]}
    if kind is frozenset:
        return {"z": [wire_encode(item, depth + 1) for item in value]}
    if kind is bytes:
        return {"b": bytes.hex(value)}
    if kind is complex:
        return {"c": [float.__repr__(value.real), float.__repr__(value.imag)]}
    raise NotPlain("a value of type %s is not a plain value (None, bool, int, float, complex, str, bytes, "
                   "list, tuple, dict, set, frozenset)" % kind.__qualname__)


def _no_float(text):
    raise NotPlain("untagged float %r" % text[:40])


def _no_constant(text):
    raise NotPlain("constant %r" % text)


def _float(text):
    if type(text) is not str or len(text) > 40:
        raise NotPlain("bad float")
    return float(text)


def _build(raw, depth):
    if depth > MAX_DEPTH:
        raise NotPlain("nested more than %d levels deep" % MAX_DEPTH)
    kind = type(raw)
    if raw is None or kind is bool or kind is str or kind is int:
        return raw
    if kind is list:
        return [_build(item, depth + 1) for item in raw]
    if kind is not dict or len(raw) != 1:
        raise NotPlain("malformed value")
    ((tag, body),) = raw.items()
    if tag == "f":
        return _float(body)
    if tag == "b":
        if type(body) is not str:
            raise NotPlain("bad bytes")
        return bytes.fromhex(body)
    if tag == "c":
        if type(body) is not list or len(body) != 2:
            raise NotPlain("bad complex")
        return complex(_float(body[0]), _float(body[1]))
    if type(body) is not list:
        raise NotPlain("malformed %r" % tag)
    if tag == "t":
        return tuple(_build(item, depth + 1) for item in body)
    if tag == "s":
        return set(_build(item, depth + 1) for item in body)
    if tag == "z":
        return frozenset(_build(item, depth + 1) for item in body)
    if tag == "d":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise NotPlain("bad dict entry")
            out[_build(pair[0], depth + 1)] = _build(pair[1], depth + 1)
        return out
    raise NotPlain("unknown tag %r" % tag)


def wire_decode(raw):
    return _build(raw, 0)


def wire_dumps(message):
    return (_json.dumps(message, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def wire_loads(line):
    message = _json.loads(line, parse_float=_no_float, parse_constant=_no_constant)
    if type(message) is not dict:
        raise NotPlain("a message must be an object")
    return message


class Link:
    """One end of a pair of pipes, exchanging JSON-line messages."""

    LIMIT = 16 * 1024 * 1024

    def __init__(self, read_fd, write_fd):
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.buffer = bytearray()
        self.scanned = 0
        self.closed = False

    def send(self, message):
        data = wire_dumps(message)
        view = memoryview(data)
        while view:
            written = _os.write(self.write_fd, view)
            view = view[written:]

    def receive(self):
        """The next message, or None at end of file. Raises NotPlain on a malformed one."""
        while True:
            end = self.buffer.find(b"\n", self.scanned)
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[:end + 1]
                self.scanned = 0
                return wire_loads(line)
            self.scanned = len(self.buffer)
            if len(self.buffer) > self.LIMIT:
                self.buffer = bytearray()
                self.scanned = 0
                self.closed = True
                raise NotPlain("a message longer than %d bytes" % self.LIMIT)
            if self.closed:
                return None
            chunk = _os.read(self.read_fd, 1 << 20)
            if not chunk:
                self.closed = True
                if not self.buffer:
                    return None
                raise NotPlain("a message cut off at end of file")
            self.buffer += chunk


import os as _os
