"""The element types the core moves and reduces, by name, for every front end.

A front end names its tensor's dtype the way numpy does ('float32',
'bfloat16', 'uint16', 'bool'); this table turns the name into the core's
code, and the error for a dtype outside it is the same in every framework.
The core reduces every type here, unsigned ones included (complex ones by Sum
or Average); a framework that cannot make a type simply never asks for it.
"""
from unison.exceptions import InvalidArgumentError
from unison._native import lib

CODES = {
    "uint8": lib.UNISON_UINT8,
    "int8": lib.UNISON_INT8,
    "uint16": lib.UNISON_UINT16,
    "int16": lib.UNISON_INT16,
    "uint32": lib.UNISON_UINT32,
    "int32": lib.UNISON_INT32,
    "uint64": lib.UNISON_UINT64,
    "int64": lib.UNISON_INT64,
    "float16": lib.UNISON_FLOAT16,
    "bfloat16": lib.UNISON_BFLOAT16,
    "float32": lib.UNISON_FLOAT32,
    "float64": lib.UNISON_FLOAT64,
    "bool": lib.UNISON_BOOL,
    # Moved as they are; reduced by Sum or Average only, part by part.
    "complex64": lib.UNISON_COMPLEX64,
    "complex128": lib.UNISON_COMPLEX128,
}

ITEM_BYTES = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8, "int64": 8,
              "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "bool": 1,
              "complex64": 8, "complex128": 16}

FLOATING = frozenset(("float16", "bfloat16", "float32", "float64"))


def label(name):
    """How an error message names a tensor."""
    return repr(name) if name else "(unnamed)"


def code_of(dtype_name, tensor_name):
    """The core's code for a dtype name, or InvalidArgumentError naming the
    tensor, its dtype and what is supported."""
    code = CODES.get(dtype_name)
    if code is None:
        raise InvalidArgumentError(
            "unison: tensor %s has dtype %s, which unison does not reduce or move; supported: %s"
            % (label(tensor_name), dtype_name, ", ".join(CODES)))
    return code
