# Converts a tests/fixtures/hf-families-2026 folder to GGUF with llama.cpp's own
# converter (convert_hf_to_gguf.py), unchanged but for one thing: the fixtures'
# 512-token test tokenizer is unknown to the converter's pre-tokenizer hash
# table, which refuses it, so its pre-tokenizer is named "qwen2" (it is a
# Qwen2-style byte-level BPE). This wrapper exists only for that.
#
# usage: python scripts/convert-hf-to-gguf-fixture.py LLAMA_CPP_DIR HF_FOLDER \
#            --outtype f32 --no-mtp --outfile OUT.gguf
import runpy
import sys

D = sys.argv.pop(1)
sys.path[:0] = [D, D + "/gguf-py"]
import conversion.base as base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tok: "qwen2"
sys.argv[0] = D + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
