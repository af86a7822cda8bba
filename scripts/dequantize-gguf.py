#!/usr/bin/env python3
"""Writes a float copy of a quantized GGUF: every tensor dequantized (by
the `gguf` package's reference dequantizers) to F32, or to F16 with
--f16, with all metadata kept. bench/spec-decode.sh uses it to make the
demo model's float target, which its own Q4_1 file then drafts for.

    python3 scripts/dequantize-gguf.py IN.gguf OUT.gguf [--f16]
"""
import sys

import gguf
import numpy as np


def field_value(field):
    """The Python value of a reader field, for GGUFWriter."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        item = field.types[1]
        if item == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 2:
        sys.exit(__doc__)
    f16 = "--f16" in sys.argv
    src, dst = args
    reader = gguf.GGUFReader(src)
    arch = field_value(reader.fields["general.architecture"])
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        value = field_value(field)
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, kind)
    for t in reader.tensors:
        # GGUF lists dimensions fastest first; numpy wants them reversed.
        shape = tuple(int(d) for d in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        keep_f32 = f16 and len(shape) == 1  # norms stay F32, as llama.cpp writes them
        data = data.astype(np.float32 if (not f16 or keep_f32) else np.float16)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
